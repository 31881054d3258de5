"""Weight-sync time per GB on CPU, both paths (not a test; run by hand).

    OMP_NUM_THREADS=1 .venv/bin/python tests/rollout/bench_weight_sync.py --hidden 1024 --layers 8

Builds a random Qwen2 model (fp32; ~0.7 GB with the defaults), launches CPU workers on it,
pushes new random weights with DiskWeightSync and DistributedWeightSync (gloo) and prints
seconds and GB/s per push (bytes = the fp32 tensors pushed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=512.0)
    args = p.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_m2po.rollout.weight_sync import DiskWeightSync, DistributedWeightSync
    from megatron_m2po.config import RolloutConfig
    from megatron_m2po.rollout.engines import EngineFleet

    tmp = Path(tempfile.mkdtemp(prefix="bench_ws_"))
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=max(args.hidden // 256, 1), max_position_embeddings=2048,
                      tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(str(tmp / "model"))
    named = [(n, t.detach().clone()) for n, t in model.state_dict().items()]
    del model
    gb = sum(t.numel() * t.element_size() for _, t in named) / 1e9
    print(f"model: {gb:.3f} GB fp32, {len(named)} tensors, {args.engines} engine(s)")
    rc = RolloutConfig(engine="cpu_worker", num_engines=args.engines, base_port=0, use_router=False,
                       weight_sync_timeout_s=600)
    fleet = EngineFleet(rc, str(tmp / "model"), run_dir=str(tmp / "run"), startup_timeout_s=600).start()
    try:
        disk = DiskWeightSync(fleet.engine_urls, str(tmp / "weights"), base_model_dir=str(tmp / "model"),
                              timeout_s=600)
        dist = DistributedWeightSync(fleet.engine_urls, backend="gloo", bucket_mb=args.bucket_mb, timeout_s=600)
        dist.connect()
        for r in range(args.repeats):
            for name, sync in (("disk", disk), ("distributed", dist)):
                for _, t in named:
                    t.add_(0.001)
                t0 = time.perf_counter()
                sync.push(iter(named), version=2 * r + (name == "distributed") + 1)
                dt = time.perf_counter() - t0
                print(f"{name:12s} push {r}: {dt:6.2f} s  {dt / gb:6.2f} s/GB  {gb / dt:6.3f} GB/s")
        disk.close()
        dist.close()
    finally:
        fleet.stop()


if __name__ == "__main__":
    main()
