"""Row 4: packed sequences at TP=2 + sequence parallel (the recipes' layout), 2 ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .env import ROOT, SCRIPT, block_gpu_only_modules, spec_name
from .models import actor_outputs, make_batch
from .numerics import _REFERENCES, _numerics_inputs, comparison_rows, reference_outputs, start_reference
from .report import Row

PACKED_TP = 2
PACKED_CHECK = "actor packed TP=2+SP vs CPU fp32"


def packed_layout(smoke: bool) -> dict:
    """Row 4's ``parallel`` settings: what every recipe sets (TP with sequence parallelism, packed
    THD micro-batches under a token budget), at a budget that packs 3-5 of the row's sequences
    and leaves packs of odd length (the SP padding pseudo-sequence)."""
    return dict(tensor_parallel=PACKED_TP, sequence_parallel=True, packing=True,
                max_tokens_per_microbatch=64 if smoke else 512)


def gpus_refusal(row: int, check: str, need: int, found: int) -> Optional[Row]:
    """A SKIP row naming why ``row`` cannot run (``found`` < ``need`` GPUs), else None."""
    if found >= need:
        return None
    return Row(check, "-", f"refused: row {row} needs {need} GPUs, found {found} (run it on a machine with "
               f">= {need}, or leave it out: --only numerics logprobs throughput)", "-", "SKIP")


def _packed_rank_worker(hf_dir: str, batch_json: str, out: str, smoke: str) -> int:
    """One rank of row 4 (RANK / WORLD_SIZE / MASTER_* in the environment, as torchrun sets them):
    the actor's own process-group setup (NCCL on CUDA, gloo on CPU), TP=2 + SP, packed; rank 0
    writes the outputs."""
    if smoke == "1":
        block_gpu_only_modules()  # the CPU path of the image too (module docstring)
    spec = json.loads(Path(batch_json).read_text())
    res = actor_outputs(Path(hf_dir), "bfloat16", make_batch(**spec), parallel=packed_layout(smoke == "1"))
    if os.environ["RANK"] == "0":
        np.savez(out, **res)
    return 0


def run_packed_ranks(hf: Path, spec: dict, work: Path, smoke: bool, timeout_s: float) -> dict[str, np.ndarray]:
    """Start row 4's ranks as separate processes (CPU: CUDA hidden, gloo), wait for all with a
    deadline, and return rank 0's outputs; a failed rank's log tail becomes the error."""
    from megatron_m2po.utils.net import free_port

    batch_json, out = work / "packed-batch.json", work / "packed.npz"
    batch_json.write_text(json.dumps(spec))
    out.unlink(missing_ok=True)
    base = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(PACKED_TP), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # as scripts/train.sh
    if smoke:
        base["CUDA_VISIBLE_DEVICES"] = ""
    logs = [work / f"packed-rank{r}.log" for r in range(PACKED_TP)]
    procs = []
    for r in range(PACKED_TP):
        cmd = [sys.executable, str(SCRIPT), "--_packed_rank", str(hf), str(batch_json), str(out),
               "1" if smoke else "0"]
        with open(logs[r], "w") as log:
            procs.append(subprocess.Popen(cmd, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=log,
                                          stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    failed = None
    try:  # the first rank to fail is the one to report: its peer then waits in a collective
        while True:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = (bad[0][0], f"exit {bad[0][1]}")
                break
            if None not in codes:
                break
            running = codes.index(None)
            if time.monotonic() > deadline:
                failed = (running, f"still running after {timeout_s:g} s")
                break
            try:
                procs[running].wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if failed:
        r, why = failed
        tail = "\n".join(logs[r].read_text().strip().splitlines()[-15:])
        raise RuntimeError(f"packed TP={PACKED_TP} rank {r} failed ({why}):\n{tail}")
    return dict(np.load(out))


def row_packed_tp_sp(smoke: bool, work: Path) -> list[Row]:
    from megatron_m2po.actor.batch import group_microbatches

    found = PACKED_TP if smoke else torch.cuda.device_count()
    refused = gpus_refusal(4, PACKED_CHECK, PACKED_TP, found)
    if refused:
        return [refused]
    shape, hf, spec = _numerics_inputs(smoke, work)
    layout = packed_layout(smoke)
    samples = make_batch(**spec)
    lengths = [s.length for s in samples]
    packs = group_microbatches(lengths, list(range(len(samples))), micro_batch_size=1,
                               max_tokens=layout["max_tokens_per_microbatch"], packing=True, pad_multiple=PACKED_TP)
    if max(len(p) for p in packs) < 2:
        raise ValueError(f"row 4 packs no two sequences together (packs {packs}, lengths {lengths}): it would not "
                         "test packed attention; lower the row's sequence lengths or raise its token budget")
    key = (str(hf), json.dumps(spec, sort_keys=True))
    started = None if key in _REFERENCES else start_reference(hf, spec, work)
    try:
        dev = run_packed_ranks(hf, spec, work, smoke, timeout_s=300 if smoke else 600)
    except BaseException:
        if started:
            started[0].kill()
            started[0].communicate()
        raise
    ref = reference_outputs(hf, spec, work, started)
    odd = sum(sum(lengths[i] for i in p) % PACKED_TP for p in packs)
    what = (f"L={shape['num_hidden_layers']} H={shape['hidden_size']}, {spec['n']} seqs in {len(packs)} packs of "
            f"{'/'.join(str(len(p)) for p in packs)} seqs ({odd} padded to a multiple of TP), "
            f"{len(ref['logp'])} resp tokens")
    device = "cpu gloo" if smoke else f"cuda nccl, {spec_name()} spec"
    return comparison_rows(f"actor {device} bf16 TP=2+SP packed (THD) vs CPU fp32", what, ref, dev, control=False)
