"""What a run ran on, recorded with it (``experiment_done.json`` ``environment``), so that runs are only
compared with runs of the same base weights and machine.

Why: the tiny base is built on the machine that first asks for it (``standins/tiny_base.py``), and its
warm-up stops when a sampled held-out accuracy crosses a target: on another CPU type the floats, the
samples and so the stopping step differ, and so do the weights. The drift ladder met this: its runs
on two machines started from bases whose held-out accuracy at update 0 differed by 0.06-0.09 in every
seed (docs/measurements/drift_ladder/PREREGISTRATION.md, Amendment 1).
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Any

__all__ = ["run_environment", "weights_fingerprint", "cpu_name"]

_WHOLE = 256 << 20  # files up to this size are hashed whole; larger ones by their size, head and tail
_PART = 16 << 20


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def weights_fingerprint(model_dir: str | Path) -> str:
    """16 hex digits identifying a model directory's weights (``*.safetensors``, ``*.bin``): each
    file's name and size, and its bytes (whole up to 256 MiB, else the first and last 16 MiB).
    ``"unknown"`` when there are none."""
    files = sorted(p for pat in ("*.safetensors", "*.bin") for p in Path(model_dir).glob(pat))
    if not files:
        return "unknown"
    h = hashlib.sha256()
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.name}:{size}\n".encode())
        with open(p, "rb") as f:
            if size <= _WHOLE:
                h.update(f.read())
            else:
                h.update(f.read(_PART))
                f.seek(size - _PART)
                h.update(f.read(_PART))
    return h.hexdigest()[:16]


def run_environment(run_dir: str | Path) -> dict[str, Any]:
    """``{"cpu", "base", "base_path"}`` of a finished run: the machine's CPU and the fingerprint of the
    base model its ``config.json`` resolved (``model.hf_path``)."""
    path = ""
    try:
        path = json.loads((Path(run_dir) / "config.json").read_text())["model"]["hf_path"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return {"cpu": cpu_name(), "base": weights_fingerprint(path) if path else "unknown", "base_path": path}
