"""The rows of ``tools/gpu_check.py`` by concern (its module docstring says what each proves).

``env``: packages, the GPU-only modules blocked for the CPU paths, peak FLOP/s; ``models``: random
HF models, batches and the actor's outputs on them; ``numerics`` (row 1, and the CPU fp32
reference rows 1 and 4 share), ``logprobs`` (row 2), ``throughput`` (row 3), ``packed`` (rows 4 and 5),
``moe`` (row 6: Qwen3-MoE with replayed routing), ``imbalance`` (row 7: token copies per EP rank),
``disk_push`` (row 8: write and read bandwidth of a weight push's shards), ``colocated`` (row 9),
``expert_lora`` (row 10: the expert adapters' grouped GEMMs, forward and backward, against the loop);
``report``: the row record, the table and the guard that turns a failing row group into a FAIL row.
Nothing here imports Megatron-Core at import time: ``env.block_gpu_only_modules`` must come first.
"""
