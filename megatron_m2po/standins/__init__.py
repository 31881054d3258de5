"""CPU stand-ins: what lets the whole system run on a laptop CPU, kept apart from production code.

    cpu_worker.py        an inference engine speaking SGLang 0.5.23's HTTP protocol on HF transformers
                         (``python -m megatron_m2po.standins.cpu_worker``); cpu_worker_http.py its routes,
                         sglang_sampling.py SGLang's per-request sampling rules, cpu_prefix_cache.py its
                         radix cache of prompt KV, cpu_worker_lora.py (+ _routes) its LoRA serving
    cpu_platform.py      CPU emulation of CUDA for Megatron-Core (gloo); collective_audit.py makes gloo
                         refuse what NCCL refuses (host tensors on groups that are NCCL on GPUs)
    tiny_base.py         the tiny base model (``model.hf_path=tiny``): built, warmed up, cached
    dist_testing.py      multi-process gloo test helper (``run_distributed``)

The rule (``tests/test_import_graph.py``): production code -- every module of ``megatron_m2po/``
outside this package -- never imports it. Production reaches a stand-in only through
:func:`megatron_m2po.utils.standin.load_standin` / ``standin_module``, by module name, at the few
seams listed there. Stand-ins may import production code.

Each stand-in must fail where the real part fails; its docstrings cite the upstream source it follows.
"""
