"""Row 8: disk weight push bandwidth -- write and read back a weights-sized shard set at a directory.

A disk push (``rollout.weight_sync=disk``) has every pipeline stage write its safetensors shards
(``utils/hf_dir.write_stage_shards``, the production writer) and every engine read the whole
checkpoint (SGLang 0.5.23 ``update_weights_from_disk``: every TP rank iterates every shard). This
row times both at ``--push-dir`` (point it at the filesystem of ``rollout.weight_sync_dir``; default:
the check's work directory) for ``--push-gb`` of bf16 shards: the write until every file is
``fsync``-ed, then, after the files' pages are dropped from the page cache
(``posix_fadvise(POSIX_FADV_DONTNEED)``, so the read comes from the disk, not from memory), the read
of every shard onto the GPU (``safetensors.torch.load_file(device=...)``). Verdict: PASS when the read
is at least ``rollout.weight_sync_min_gbps`` (the floor the push timeout assumes,
``rollout/push_timeout.py``), FAIL otherwise (lower the floor to the measured value or give the
weights a faster disk); the result also says what a 32B bf16 push (64 GB) would take at the measured
rates and the timeout the floor gives it. ``--cpu-smoke`` runs it at 64 MB onto CPU tensors: INFO
(a CI runner's disk says nothing about a cluster's).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import torch

from .report import Row

DISK_PUSH_CHECK = "disk weight push bandwidth (write + read of shards)"
PUSH_32B_BYTES = 64e9  # Qwen2.5-32B in bf16


def _shards(total: int, shard: int):
    """bf16 tensors of ``shard`` bytes (the last one smaller) summing to ``total``: one random buffer,
    reused (random bytes: a compressing filesystem cannot shrink them)."""
    buf = torch.randint(-2 ** 15, 2 ** 15, (shard // 2,), dtype=torch.int16).view(torch.bfloat16)
    done, i = 0, 0
    while done < total:
        n = min(shard, total - done) // 2
        yield f"model.layers.{i}.weight", buf[:n]
        done += 2 * n
        i += 1


def _drop_cache(path: Path) -> bool:
    """Drop ``path``'s pages from the page cache (written back first); False where the OS cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def row_disk_push(smoke: bool, work: Path, push_dir: Optional[str] = None, push_gb: Optional[float] = None) -> list[Row]:
    from safetensors.torch import load_file

    from megatron_m2po.config import RolloutConfig
    from megatron_m2po.rollout.push_timeout import disk_push_timeout_s
    from megatron_m2po.utils.hf_dir import write_stage_shards

    cuda = torch.cuda.is_available() and not smoke
    total = int((push_gb if push_gb is not None else (0.064 if smoke else 16.0)) * 1e9)
    shard = min(total, 2 ** 30 if not smoke else 16 * 2 ** 20)
    root = Path(push_dir).expanduser() if push_dir else work
    out = root / f"gpu_check-push-{os.getpid()}"
    out.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        files = write_stage_shards(_shards(total, shard), out, 0, shard)
        for fname, _, _ in files:  # written = on the disk: what an engine on another node can read
            fd = os.open(out / fname, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        write_s = time.perf_counter() - t0
        dropped = all(_drop_cache(out / f) for f, _, _ in files)
        device = "cuda" if cuda else "cpu"
        t0 = time.perf_counter()
        got = 0
        for fname, _, _ in files:
            got += sum(t.numel() * t.element_size() for t in load_file(str(out / fname), device=device).values())
        if cuda:
            torch.cuda.synchronize()
        read_s = time.perf_counter() - t0
    finally:
        for f in out.glob("*"):
            f.unlink()
        out.rmdir()
    if got != total:
        raise RuntimeError(f"read back {got} bytes of the {total} written")
    cfg = RolloutConfig()
    floor, configured = cfg.weight_sync_min_gbps, cfg.weight_sync_timeout_s
    w_gbps, r_gbps = total / 1e9 / write_s, total / 1e9 / read_s
    result = (f"write {w_gbps:.2f} GB/s, read {r_gbps:.2f} GB/s{'' if dropped else ' (page cache not dropped)'}; "
              f"a 32B push (64 GB): write {PUSH_32B_BYTES / 1e9 / w_gbps:.0f} s, load {PUSH_32B_BYTES / 1e9 / r_gbps:.0f} s "
              f"of a {disk_push_timeout_s(PUSH_32B_BYTES, configured, floor):.0f} s timeout")
    shape = f"{total / 1e9:.3g} GB in {len(files)} shards at {root} -> {device}"
    if smoke:
        verdict, criterion = "INFO", f"none on CPU (read >= weight_sync_min_gbps {floor:g} GB/s on the cluster)"
    else:
        verdict = "PASS" if r_gbps >= floor and dropped else "FAIL"
        criterion = f"read >= rollout.weight_sync_min_gbps {floor:g} GB/s, from the disk (page cache dropped)"
    values = {"bytes": total, "write_s": write_s, "read_s": read_s, "write_gbps": w_gbps, "read_gbps": r_gbps,
              "cache_dropped": dropped, "floor_gbps": floor}
    return [Row(DISK_PUSH_CHECK, shape, result, criterion, verdict, values)]
