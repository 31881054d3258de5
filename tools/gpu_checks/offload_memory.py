"""Row 12: what an offloaded trainer leaves on its GPU, with NCCL's NVLink SHARP buffers on and off.

Colocated mode (``trainer/colocated.py``) gives the engines the GPU after ``actor.offload()``:
``actor/offload.py`` moves every parameter, gradient, main parameter and Adam state off the device
and empties torch's cache, but what torch does not own stays -- the CUDA context, cuBLAS
workspaces, and NCCL's communicator buffers. On NVSwitch systems (H100 / H200 HGX) NCCL 2.17+
registers NVLink SHARP (NVLS) buffers per communicator with multicast memory outside torch's
allocator, often GiBs; ``NCCL_NVLS_ENABLE=0`` turns them off at some all-reduce bandwidth. The
planner assumes ``--overhead-gib`` (3 GiB) of such fixed memory per GPU (``plan/memory.py``) and
that the offloaded trainer leaves only that (``plan/colocated.py``).

Two ranks (NCCL, TP=2: every rank joins a tensor-parallel communicator, as a colocated recipe's
trainer does), row 1's model in bf16 with the distributed optimizer, one M2PO update, then
``actor.offload()``; each rank reads the GPU's memory in use (``cudaMemGetInfo``) after creating its
CUDA context, after the update and after the offload, and torch's allocated / reserved bytes. Run
twice: ``NCCL_NVLS_ENABLE=1`` (NCCL's default where NVLS exists) and ``=0``. PASS when, in the
trainer's environment as ``scripts/train.sh`` leaves it (NVLS at NCCL's default), the memory the
offloaded rank still holds beyond its CUDA context is at most the planner's 3 GiB overhead and
torch holds at most 1 % of what the update held; the other setting is reported beside it (INFO),
so a layout that needs NVLS off says so. Needs 2 GPUs (refused by name otherwise).
``--cpu-smoke``: the same two ranks on gloo, once, torch's bytes only (no device memory to read).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from .env import ROOT, SCRIPT, block_gpu_only_modules
from .models import _actor_config, make_batch
from .numerics import _numerics_inputs
from .packed import gpus_refusal
from .report import Row

OFFLOAD_CHECK = "offloaded trainer's residue on its GPU (TP=2, NCCL)"
GiB = 1024 ** 3
OVERHEAD_GIB = 3.0  # plan/memory.py Layout.overhead_gib's default
RANKS = 2


def _used() -> int:
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def offload_rank_worker(hf_dir: str, batch_json: str, out: str, smoke: str) -> int:
    """One rank (RANK / WORLD_SIZE / MASTER_* from the environment): context, update, offload, and
    the memory at each point; every rank writes ``out.<rank>.json``."""
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch

    if smoke == "1":
        block_gpu_only_modules()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.zeros(1, device="cuda")  # the CUDA context
    rec = {"context_used": _used() if cuda else 0}
    samples = make_batch(**json.loads(Path(batch_json).read_text()))
    cfg = _actor_config(Path(hf_dir), "bfloat16", parallel={"tensor_parallel": RANKS, "sequence_parallel": True})
    cfg.parallel.distributed_optimizer = True
    actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=10))
    try:
        for s, lp in zip(samples, actor.compute_logprobs(RolloutBatch(samples))):
            s.behav_logprobs = lp.astype("float32")
        actor.train_step(RolloutBatch(samples), num_minibatches=1)
        if cuda:
            torch.cuda.synchronize()
        rec.update(trained_used=_used() if cuda else 0, trained_allocated=torch.cuda.memory_allocated() if cuda else 0)
        off = actor.offload()
        rec.update(offloaded_used=_used() if cuda else 0, offloaded_resident=off.resident_bytes,
                   offloaded_allocated=torch.cuda.memory_allocated() if cuda else 0,
                   offloaded_reserved=torch.cuda.memory_reserved() if cuda else 0,
                   state_bytes=off.released_bytes)
        actor.reload()
    finally:
        actor.close()
    Path(f"{out}.{os.environ['RANK']}.json").write_text(json.dumps(rec))
    return 0


def _run_ranks(hf: Path, spec: dict, work: Path, smoke: bool, nvls: str, timeout_s: float) -> list[dict]:
    from megatron_m2po.utils.net import free_port

    batch_json, out = work / "offload-batch.json", work / f"offload-nvls{nvls}"
    batch_json.write_text(json.dumps(spec))
    base = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(RANKS)}
    if smoke:
        base["CUDA_VISIBLE_DEVICES"] = ""
    if nvls != "default":
        base["NCCL_NVLS_ENABLE"] = nvls
    logs = [work / f"offload-nvls{nvls}-rank{r}.log" for r in range(RANKS)]
    procs = []
    for r in range(RANKS):
        with open(logs[r], "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, str(SCRIPT), "--_offload_rank", str(hf), str(batch_json), str(out), "1" if smoke else "0"],
                env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs) and not any(p.poll() not in (None, 0) for p in procs):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    bad = [r for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        tail = "\n".join(logs[bad[0]].read_text().strip().splitlines()[-15:])
        raise RuntimeError(f"offload rank {bad[0]} (NCCL_NVLS_ENABLE={nvls}) failed (exit {procs[bad[0]].returncode}):"
                           f"\n{tail}")
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(RANKS)]


def _describe(recs: list[dict], cuda: bool) -> tuple[str, float, float]:
    """The worst rank's residue beyond its context (GiB) and torch's share of the update's bytes."""
    residue = max(r["offloaded_used"] - r["context_used"] for r in recs) / GiB
    torch_frac = max(r["offloaded_allocated"] / max(r["trained_allocated"], 1) for r in recs) if cuda else \
        max(r["offloaded_resident"] / max(r["state_bytes"], 1) for r in recs)
    if not cuda:
        return f"torch keeps {torch_frac:.2%} of the training state (device memory: needs CUDA)", 0.0, torch_frac
    trained = max(r["trained_used"] - r["context_used"] for r in recs) / GiB
    alloc = max(r["offloaded_allocated"] for r in recs) / GiB
    reserved = max(r["offloaded_reserved"] for r in recs) / GiB
    return (f"{residue:.2f} GiB beyond the CUDA context after offload (update: {trained:.2f}); torch allocated "
            f"{alloc:.3f}, reserved {reserved:.3f} GiB; the rest NCCL, cuBLAS", residue, torch_frac)


def row_offload_memory(smoke: bool, work: Path) -> list[Row]:
    found = RANKS if smoke else torch.cuda.device_count()
    refused = gpus_refusal(12, OFFLOAD_CHECK, RANKS, found)
    if refused:
        return [refused]
    shape, hf, spec = _numerics_inputs(smoke, work)
    what = f"L={shape['num_hidden_layers']} H={shape['hidden_size']}, bf16, distributed optimizer, 2 ranks"
    cuda = not smoke
    rows = []
    default = os.environ.get("NCCL_NVLS_ENABLE", "default")  # what train.sh leaves it at
    settings = [default] + ([("1" if default == "0" else "0")] if cuda else [])
    for nvls in settings:
        recs = _run_ranks(hf, spec, work, smoke, nvls, timeout_s=300 if smoke else 600)
        text, residue, torch_frac = _describe(recs, cuda)
        judged = nvls == default
        ok = residue <= OVERHEAD_GIB and torch_frac <= 0.01
        label = "NCCL's default" if nvls == "default" else f"NCCL_NVLS_ENABLE={nvls}"
        rows.append(Row(f"{OFFLOAD_CHECK}: {label}" + (" (the trainer's environment)" if judged else ""), what, text,
                        f"<= {OVERHEAD_GIB:g} GiB beyond the context, torch <= 1 %" if judged else "-",
                        ("PASS" if ok else "FAIL") if judged else "INFO",
                        {"ranks": recs, "residue_gib": residue, "torch_frac": torch_frac}))
    return rows
