"""Weight-push time from 1 and 2 pipeline stages, disk and distributed (gloo), on CPU workers; and
the in-node (colocated) push beside a plain copy of the same bytes.

    OMP_NUM_THREADS=1 python tools/benchmarks/weight_sync.py [--hidden 768 --layers 8 --engines 1]
    OMP_NUM_THREADS=1 python tools/benchmarks/weight_sync.py --colocated [--bucket-mb 128]

Builds one random Llama model (fp32; ~0.43 GB with the defaults), launches CPU workers on it,
then for PP = 1 and PP = 2 spawns PP trainer ranks (gloo) that each hold one stage's tensors (the
embedding and the first half of the layers on stage 0, the rest and the head on stage 1, as
Megatron splits them) and push them with ``weight_stage.push_from_stages`` -- the trainer's own
call -- through ``DistributedWeightSync`` and ``DiskWeightSync``. Prints seconds and GB/s per push
(the best of ``--repeats``) side by side. What it measures is the sync itself (HTTP control,
broadcast or safetensors write + engine load); the actor's tensor-parallel gathers are not in it.

``--colocated``: the same model's tensors pushed from this process through ``ColocatedWeightSync``
(``weights/colocated.py``: per bucket, pack into shared memory, serialize the handles, hand over by
HTTP, the engine's load), timed by phase, beside the limit: one plain ``copy_`` of the same bytes
into preallocated tensors on this machine (an engine must write every byte into its parameters
at least once). Prints both bandwidths, their ratio, and where the push's time went. The push
copies each byte twice (into the bucket, then the engine into its parameters) but packs bucket
k + 1 while the engine loads bucket k, so with two free cores the copies overlap; the target is
at least half the copy's bandwidth. The phase lines say where the rest goes: the first copy
(pack), the engine's load where it does not overlap (its copy, plus opening each bucket's shared
memory, a page-table fault per page), pickling the handles, HTTP, and the session / pause calls.
On a 2-core machine with the test suite running beside it (load average 4-10) it measured 0.26-0.38
of the copy (0.2-0.4 GB models, 16-64 MiB buckets): pack ~45-55 %, the engine's load not hidden
~25-45 %, everything else < 15 %.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _stage_names(names: list[str], n_layers: int, stage: int, n_stages: int) -> list[str]:
    per = n_layers // n_stages
    lo, hi = stage * per, (stage + 1) * per if stage < n_stages - 1 else n_layers

    def owner(name: str) -> int:
        if ".layers." in name:
            return min(int(name.split(".layers.")[1].split(".")[0]) // per, n_stages - 1)
        return 0 if "embed_tokens" in name else n_stages - 1
    assert lo < hi
    return [n for n in names if owner(n) == stage]


def _job(rank, world, model_dir, urls, sync_dir, n_layers, bucket_mb, repeats):
    import torch
    from safetensors import safe_open

    from megatron_m2po.weights.stage import push_from_stages
    from megatron_m2po.weights.disk import DiskWeightSync
    from megatron_m2po.weights.distributed import DistributedWeightSync

    path = os.path.join(model_dir, "model.safetensors")
    with safe_open(path, "pt") as f:
        names = _stage_names(list(f.keys()), n_layers, rank, world)
        tensors = [(n, f.get_tensor(n)) for n in names]
    out = {}
    syncs = {"distributed": DistributedWeightSync(urls, backend="gloo", bucket_mb=bucket_mb, timeout_s=600),
             "disk": DiskWeightSync(urls, sync_dir, base_model_dir=model_dir, timeout_s=600)} if rank == 0 else {}
    version = 0
    try:
        for kind in ("distributed", "disk"):
            times = []
            for _ in range(repeats):
                version += 1
                for _, t in tensors:
                    t.add_(0.001)
                torch.distributed.barrier()
                t0 = time.perf_counter()
                stats = push_from_stages(syncs.get(kind), iter(tensors), version, stage=rank, n_stages=world,
                                         sender=True)
                times.append(time.perf_counter() - t0)
                if rank == 0:
                    out[kind] = (min(times), stats.bytes)
    finally:
        for s in syncs.values():
            s.close()
    return out


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _colocated(urls: list[str], model_dir: str, bucket_mb: float, repeats: int) -> None:
    """The in-node push beside a plain copy of the same bytes (module docstring)."""
    import asyncio

    import torch
    from safetensors.torch import load_file

    from megatron_m2po.rollout.client import SGLangClient
    from megatron_m2po.weights.colocated import ColocatedWeightSync, Phases, run_colocated_stage

    tensors = list(load_file(os.path.join(model_dir, "model.safetensors")).items())
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    dst = [torch.empty_like(t) for _, t in tensors]

    def copy() -> None:
        for d, (_, t) in zip(dst, tensors):
            d.copy_(t)
    copy()  # fault the destination pages in, as the engine's parameters are
    copy_s = _best(copy, repeats)
    sync = ColocatedWeightSync(urls, bucket_mb=bucket_mb, timeout_s=600)
    runs = []
    try:
        for version in range(1, repeats + 1):
            phases = Phases()
            t0 = time.perf_counter()
            plan = sync.begin(version, 1)
            t1 = time.perf_counter()
            res = run_colocated_stage(plan, 0, iter(tensors), phases)
            t2 = time.perf_counter()
            sync.finish(plan, [res])
            runs.append((time.perf_counter() - t0, t1 - t0, t2 - t1, phases))
    finally:
        sync.close()

    async def rtt() -> float:  # the HTTP floor of one hand-over: a control call that does nothing
        async with SGLangClient(urls[0]) as c:
            await c.weight_version()
            t0 = time.perf_counter()
            for _ in range(20):
                await c.weight_version()
            return (time.perf_counter() - t0) / 20
    http_s = asyncio.run(rtt())
    total, begin_s, stage_s, ph = min(runs, key=lambda r: r[0])
    gb = nbytes / 1e9
    print(f"{gb:.3f} GB, {len(tensors)} tensors, {ph.buckets} bucket(s) of <= {bucket_mb:g} MiB, {len(urls)} engine(s)")
    print(f"plain copy          {copy_s:8.3f} s  {gb / copy_s:7.2f} GB/s   (the limit)")
    print(f"in-node push        {total:8.3f} s  {gb / total:7.2f} GB/s   ratio {copy_s / total:.2f} of the copy")
    parts = [("pack (copy into the bucket)", ph.pack_s), ("serialize handles", ph.serialize_s),
             ("wait: hand-over + engine load, not overlapped", ph.wait_s),
             ("pause + begin session", begin_s), ("end session + continue", total - begin_s - stage_s),
             ("rest of the stage (iteration, lookahead)", stage_s - ph.pack_s - ph.serialize_s - ph.wait_s)]
    for name, secs in parts:
        print(f"  {name:46s} {secs:8.3f} s  {100 * secs / total:5.1f} %")
    print(f"  (HTTP round trip of a no-op control call: {1e3 * http_s:.1f} ms; x {ph.buckets} buckets = "
          f"{ph.buckets * http_s:.3f} s of the wait)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=128.0)
    p.add_argument("--colocated", action="store_true", help="the in-node push beside a plain copy (only that)")
    args = p.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_m2po.config import RolloutConfig
    from megatron_m2po.rollout.engines import EngineFleet
    from megatron_m2po.standins.dist_testing import run_distributed

    tmp = Path(tempfile.mkdtemp(prefix="bench_ws_"))
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=max(args.hidden // 256, 1), max_position_embeddings=2048,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(tmp / "model"))
    gb = os.path.getsize(tmp / "model" / "model.safetensors") / 1e9
    print(f"model: {gb:.3f} GB fp32, {args.layers} layers, {args.engines} CPU worker(s), "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    rc = RolloutConfig(engine="cpu_worker", num_engines=args.engines, base_port=0, use_router=False,
                       weight_sync_timeout_s=600)
    fleet = EngineFleet(rc, str(tmp / "model"), run_dir=str(tmp / "run"), startup_timeout_s=600).start()
    rows = {}
    if args.colocated:
        try:
            _colocated(fleet.engine_urls, str(tmp / "model"), args.bucket_mb, args.repeats)
        finally:
            fleet.stop()
        return
    try:
        for pp in (1, 2):
            res = run_distributed(_job, pp, args=(str(tmp / "model"), fleet.engine_urls, str(tmp / f"w{pp}"),
                                                  args.layers, args.bucket_mb, args.repeats), timeout_s=3600)
            rows[pp] = res[0]
    finally:
        fleet.stop()
    print(f"{'path':12s} {'PP=1 s':>8s} {'GB/s':>7s}   {'PP=2 s':>8s} {'GB/s':>7s}")
    for kind in ("distributed", "disk"):
        cells = []
        for pp in (1, 2):
            secs, nbytes = rows[pp][kind]
            cells.append(f"{secs:8.2f} {nbytes / 1e9 / secs:7.3f}")
        print(f"{kind:12s} " + "   ".join(cells))


if __name__ == "__main__":
    main()
