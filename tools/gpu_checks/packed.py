"""Row 4: packed sequences at TP=2 + sequence parallel (the recipes' layout), 2 ranks; row 5: the
same at context parallel 2 (each sequence in 4 load-balanced chunks, TE's CP attention), 2 ranks."""

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
CP_CHECK = "actor packed CP=2 vs CPU fp32"
RANKS = 2  # both rows run two ranks


def packed_layout(smoke: bool) -> dict:
    """Row 4's ``parallel`` settings: what every recipe sets (TP with sequence parallelism, packed
    THD micro-batches under a token budget), at a budget that packs 3-5 of the row's sequences
    and leaves packs of odd length (the SP padding pseudo-sequence)."""
    return dict(tensor_parallel=PACKED_TP, sequence_parallel=True, packing=True,
                max_tokens_per_microbatch=64 if smoke else 512)


def cp_layout(smoke: bool) -> dict:
    """Row 5's ``parallel`` settings: context parallel 2 with packed micro-batches (every sequence
    padded to a multiple of 2 x CP and split into its load-balanced chunks; TE's p2p K/V ring on
    GPU, ``actor/attention.py`` ``cp_causal_attention`` on CPU), at row 4's token budget."""
    return dict(context_parallel=2, cp_comm_type="p2p", packing=True, max_tokens_per_microbatch=64 if smoke else 512)


LAYOUTS = {"packed": packed_layout, "cp": cp_layout}


def gpus_refusal(row: int, check: str, need: int, found: int) -> Optional[Row]:
    """A SKIP row naming why ``row`` cannot run (``found`` < ``need`` GPUs), else None."""
    if found >= need:
        return None
    return Row(check, "-", f"refused: row {row} needs {need} GPUs, found {found} (run it on a machine with "
               f">= {need}, or leave it out: --only numerics logprobs throughput)", "-", "SKIP")


def _packed_rank_worker(hf_dir: str, batch_json: str, out: str, smoke: str, which: str = "packed") -> int:
    """One rank of row 4 (``which="packed"``: TP=2 + SP, packed) or row 5 (``"cp"``: CP=2, packed)
    (RANK / WORLD_SIZE / MASTER_* in the environment, as torchrun sets them): the actor's own
    process-group setup (NCCL on CUDA, gloo on CPU); rank 0 writes the outputs."""
    if smoke == "1":
        block_gpu_only_modules()  # the CPU path of the image too (module docstring)
    spec = json.loads(Path(batch_json).read_text())
    res = actor_outputs(Path(hf_dir), "bfloat16", make_batch(**spec), parallel=LAYOUTS[which](smoke == "1"))
    if os.environ["RANK"] == "0":
        np.savez(out, **res)
    return 0


def run_packed_ranks(hf: Path, spec: dict, work: Path, smoke: bool, timeout_s: float,
                     which: str = "packed") -> dict[str, np.ndarray]:
    """Start row 4's (or, ``which="cp"``, row 5's) ranks as separate processes (CPU: CUDA hidden,
    gloo), wait for all with a deadline, and return rank 0's outputs; a failed rank's log tail
    becomes the error."""
    from megatron_m2po.utils.net import free_port

    batch_json, out = work / f"{which}-batch.json", work / f"{which}.npz"
    batch_json.write_text(json.dumps(spec))
    out.unlink(missing_ok=True)
    base = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(RANKS), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # as scripts/train.sh
    if smoke:
        base["CUDA_VISIBLE_DEVICES"] = ""
    logs = [work / f"{which}-rank{r}.log" for r in range(RANKS)]
    procs = []
    for r in range(RANKS):
        cmd = [sys.executable, str(SCRIPT), "--_packed_rank", str(hf), str(batch_json), str(out),
               "1" if smoke else "0", which]
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
        raise RuntimeError(f"{'packed TP=2' if which == 'packed' else 'CP=2'} rank {r} failed ({why}):\n{tail}")
    return dict(np.load(out))


def row_cp(smoke: bool, work: Path) -> list[Row]:
    """Row 5: :func:`row_packed_tp_sp` at context parallel 2 (:func:`cp_layout`)."""
    return row_packed_tp_sp(smoke, work, which="cp")


def row_packed_tp_sp(smoke: bool, work: Path, which: str = "packed") -> list[Row]:
    from megatron_m2po.actor.batch import group_microbatches

    cp = which == "cp"
    row, check = (5, CP_CHECK) if cp else (4, PACKED_CHECK)
    found = RANKS if smoke else torch.cuda.device_count()
    refused = gpus_refusal(row, check, RANKS, found)
    if refused:
        return [refused]
    shape, hf, spec = _numerics_inputs(smoke, work)
    layout = LAYOUTS[which](smoke)
    samples = make_batch(**spec)
    lengths = [s.length for s in samples]
    # CP pads every sequence to a multiple of 2 x CP (batch.cp_pad_multiple); TP + SP the pack to TP
    pad, seq_pad = (1, 2 * layout["context_parallel"]) if cp else (PACKED_TP, 1)
    packs = group_microbatches(lengths, list(range(len(samples))), micro_batch_size=1,
                               max_tokens=layout["max_tokens_per_microbatch"], packing=True, pad_multiple=pad,
                               seq_multiple=seq_pad)
    if max(len(p) for p in packs) < 2:
        raise ValueError(f"row {row} packs no two sequences together (packs {packs}, lengths {lengths}): it would not "
                         "test packed attention; lower the row's sequence lengths or raise its token budget")
    key = (str(hf), json.dumps(spec, sort_keys=True))
    started = None if key in _REFERENCES else start_reference(hf, spec, work)
    try:
        dev = run_packed_ranks(hf, spec, work, smoke, timeout_s=300 if smoke else 600, which=which)
    except BaseException:
        if started:
            started[0].kill()
            started[0].communicate()
        raise
    ref = reference_outputs(hf, spec, work, started)
    if cp:
        padded = sum(lengths[i] % seq_pad > 0 for p in packs for i in p)
        pad_words = f"{padded} seqs padded to a multiple of 2 x CP"
    else:
        odd = sum(sum(lengths[i] for i in p) % PACKED_TP for p in packs)
        pad_words = f"{odd} padded to a multiple of TP"
    what = (f"L={shape['num_hidden_layers']} H={shape['hidden_size']}, {spec['n']} seqs in {len(packs)} packs of "
            f"{'/'.join(str(len(p)) for p in packs)} seqs ({pad_words}), {len(ref['logp'])} resp tokens")
    device = "cpu gloo" if smoke else f"cuda nccl, {spec_name()} spec"
    name = "CP=2 (load-balanced chunks) packed (THD)" if cp else "TP=2+SP packed (THD)"
    return comparison_rows(f"actor {device} bf16 {name} vs CPU fp32", what, ref, dev, control=False)
