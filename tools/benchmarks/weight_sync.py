"""Weight-push time from 1 and 2 pipeline stages, disk and distributed (gloo), on CPU workers; and
the in-node (colocated) push beside a plain copy of the same bytes.

    OMP_NUM_THREADS=1 python tools/benchmarks/weight_sync.py [--hidden 768 --layers 8 --engines 1]
    OMP_NUM_THREADS=1 python tools/benchmarks/weight_sync.py --colocated --repeats 8 [--bucket-mb 128]

Builds one random Llama model (fp32; ~0.43 GB with the defaults), launches CPU workers on it,
then for PP = 1 and PP = 2 spawns PP trainer ranks (gloo) that each hold one stage's tensors (the
embedding and the first half of the layers on stage 0, the rest and the head on stage 1, as
Megatron splits them) and push them with ``weight_stage.push_from_stages`` -- the trainer's own
call -- through ``DistributedWeightSync`` and ``DiskWeightSync``. Prints seconds and GB/s per push
(the best of ``--repeats``) side by side. What it measures is the sync itself (HTTP control,
broadcast or safetensors write + engine load); the actor's tensor-parallel gathers are not in it.

``--colocated``: the same model's tensors pushed from this process through ``ColocatedWeightSync``
(``weights/colocated.py``: per bucket, pack into reused shared memory, serialize the handles, hand
over by HTTP, the engine's load), timed by phase, beside the limit: one plain ``copy_`` of the
same bytes into preallocated tensors on this machine (an engine must write every byte into its
parameters at least once), timed just before each push as the machine's load moves. The push
copies each byte twice (into the bucket, then the engine into its parameters); bucket k + 1 is
packed and posted while the engine loads bucket k, so the engine loads back to back. So the line
"two copies at once" (two threads, each copying every byte) is what such a push can reach at best
here. Prints both bandwidths, the ratio (best push against best copy, and push by push against
the copy just before it, the first push left out: it faults fresh shared memory), and where the
push's time went: the first copy (pack), the engine's load where it does not overlap, pickling the
handles, HTTP, and the session / pause calls.

A two-stage pipeline of whole tensors in buckets takes at least the bytes once plus its largest
bucket: some bucket k is packed after every one before it and loaded before every one after it.
With the defaults (8 layers, hidden 768, vocab 32000: the embedding and the head are 98 MB each, a
quarter of the bytes each, against 7-15 % in 1.5B-8B Qwen models) that bound is 0.75-0.80 of the
copy at 32-128 MiB buckets, before the two copies share the memory bandwidth.
Measured (0.4 GB, --repeats 8) on a 2-core VM nearly idle (load average 0.3-1), 7 runs with 128 MiB
buckets: push by push median 0.50-0.70 of the copy (0.50, 0.52, 0.53, 0.54, 0.58, 0.59, 0.70),
best / best 0.48-0.57, two copies at once bounding it at 0.83-0.98; pack 55-60 %, the engine's load
not hidden 24-29 % (the bucket holding the head: the largest), the rest ~12 % (pause + session
5 %, pickling 3-4 %, end of session 3 %). 32 / 64 / 256 MiB buckets: median 0.57 / 0.53 / 0.48.
Two fixes got it there from 0.36-0.50 (earlier runs, same VM and load): the worker kept each
bucket mapped only while loading it (a page fault per page read, which opening a CUDA IPC handle
does not cost; it now keeps the two latest, as the trainer reuses two), and its weights were
views of the checkpoint file's private mapping, into which every push wrote 1.3-2x slower than
into its own memory (SGLang's weights are its own device memory; the worker now copies them out
at start). Under load the ratio drops with the machine: with other tests running (load average
4-11) two copies at once cost 1.8-3.4x one copy, a bound of 0.30-0.56 (the pushes then measured
0.35-0.44, before both fixes). The first bucket is a quarter of the others (nothing overlaps its
packing): +0.03-0.07 in the median where the first tensors are small.
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


def _copies(tensors):
    """A plain copy of ``tensors`` into preallocated (touched) tensors, and two such copies at once
    (two threads, two destinations: what a push that moves every byte twice costs at best)."""
    import threading

    import torch

    dst = [[torch.empty_like(t) for _, t in tensors] for _ in range(2)]

    def copy(i: int = 0) -> None:
        for d, (_, t) in zip(dst[i], tensors):
            d.copy_(t)

    def both() -> None:
        t = threading.Thread(target=copy, args=(1,))
        t.start()
        copy(0)
        t.join()
    for i in (0, 1):  # fault the destination pages in, as the engine's parameters are
        copy(i)
    return copy, both


def _colocated(urls: list[str], model_dir: str, bucket_mb: float, repeats: int) -> None:
    """The in-node push beside a plain copy of the same bytes (module docstring)."""
    from safetensors.torch import load_file

    from megatron_m2po.weights.colocated import ColocatedWeightSync, Phases, run_colocated_stage

    tensors = list(load_file(os.path.join(model_dir, "model.safetensors")).items())
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    copy, both = _copies(tensors)
    sync = ColocatedWeightSync(urls, bucket_mb=bucket_mb, timeout_s=600)
    runs, copies, twos = [], [], []
    try:
        for version in range(1, repeats + 1):  # a copy beside each push: the machine's load moves
            copies.append(_best(copy, 1))
            twos.append(_best(both, 1))
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
    _report(urls, nbytes, len(tensors), bucket_mb, runs, copies, twos)


def _report(urls, nbytes, n_tensors, bucket_mb, runs, copies, twos) -> None:
    import asyncio
    import statistics

    from megatron_m2po.rollout.client import SGLangClient

    async def rtt() -> float:  # the HTTP floor of one hand-over: a control call that does nothing
        async with SGLangClient(urls[0]) as c:
            await c.weight_version()
            t0 = time.perf_counter()
            for _ in range(20):
                await c.weight_version()
            return (time.perf_counter() - t0) / 20
    http_s = asyncio.run(rtt())
    total, begin_s, stage_s, ph = min(runs, key=lambda r: r[0])
    copy_s, gb = min(copies), nbytes / 1e9
    # each push against the copy timed just before it; the first push (fresh host buckets, the
    # workers' first write into their weights) is left out when there are others
    pairs = sorted(c / r[0] for c, r in list(zip(copies, runs))[1 if len(runs) > 1 else 0:])
    print(f"{gb:.3f} GB, {n_tensors} tensors, {ph.buckets} bucket(s) of <= {bucket_mb:g} MiB, {len(urls)} engine(s), "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"plain copy          {copy_s:8.3f} s  {gb / copy_s:7.2f} GB/s   (the limit)")
    print(f"two copies at once  {min(twos):8.3f} s  {2 * gb / min(twos):7.2f} GB/s   (bound of a push that copies "
          f"every byte twice: ratio {copy_s / min(twos):.2f})")
    print(f"in-node push        {total:8.3f} s  {gb / total:7.2f} GB/s   ratio {copy_s / total:.2f} of the copy "
          f"(best / best); push by push: median {statistics.median(pairs):.2f}, {pairs[0]:.2f} .. {pairs[-1]:.2f}")
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
