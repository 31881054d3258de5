"""Row 1: the actor's bf16 path against the CPU fp32 reference (a subprocess), with row 1's criterion."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .env import ROOT, SCRIPT, block_gpu_only_modules, check_cpu_fallbacks, spec_name
from .models import actor_outputs, make_batch, make_random_qwen2
from .report import Row

RMS_TOL = 4.0
MAX_TOL = 4.0
GRAD_NORM_TOL = 0.05


def _reference_worker(hf_dir: str, batch_json: str, out: str) -> int:
    """Subprocess: the CPU fp32 path, with CUDA hidden and the GPU-only packages blocked (local
    layer spec, torch AdamW, local multi-tensor ops: the code path of the CPU tests)."""
    block_gpu_only_modules()
    spec = json.loads(Path(batch_json).read_text())
    samples = make_batch(**spec)
    res = actor_outputs(Path(hf_dir), "float32", samples, calibrate=True)
    check_cpu_fallbacks()
    np.savez(out, **res)
    return 0


def start_reference(hf_dir: Path, spec: dict, work: Path) -> tuple[subprocess.Popen, Path]:
    batch_json, out = work / "batch.json", work / "reference.npz"
    batch_json.write_text(json.dumps(spec))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get(
        "PYTHONPATH", ""), "PYTHONWARNINGS": "ignore"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, str(SCRIPT), "--_reference", str(hf_dir), str(batch_json), str(out)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out


def compare(ref: dict[str, np.ndarray], dev: dict[str, np.ndarray]) -> dict[str, Any]:
    """Row 1's criterion (module docstring). Returns the measured values and ``ok``."""
    out: dict[str, Any] = {}
    ok = True
    for key in ("logp", "entropy"):
        r, d = ref[key].astype(np.float64), dev[key].astype(np.float64)
        if r.shape != d.shape:
            raise ValueError(f"{key}: reference has {r.shape} values, device path {d.shape}")
        unit = np.abs(ref[key + "_perturbed"].astype(np.float64) - r)
        unit_rms, unit_max = float(np.sqrt(np.mean(unit ** 2))), float(unit.max())
        diff = np.abs(d - r)
        finite = bool(np.isfinite(d).all())
        rms = float(np.sqrt(np.mean(diff ** 2))) if finite else math.inf
        mx = float(diff.max()) if finite else math.inf
        rel_rms, rel_max = rms / max(unit_rms, 1e-12), mx / max(unit_max, 1e-12)
        out[key] = dict(rms=rms, max=mx, unit_rms=unit_rms, unit_max=unit_max, rel_rms=rel_rms, rel_max=rel_max)
        ok &= finite and rel_rms <= RMS_TOL and rel_max <= MAX_TOL
    if "logp_defect" in ref:  # the negative control, in the same units (not part of ``ok``)
        unit = np.abs(ref["logp_perturbed"] - ref["logp"]).astype(np.float64)
        dd = np.abs(ref["logp_defect"] - ref["logp"]).astype(np.float64)
        out["defect"] = dict(rel_rms=float(np.sqrt(np.mean(dd ** 2)) / max(np.sqrt(np.mean(unit ** 2)), 1e-12)),
                             rel_max=float(dd.max() / max(unit.max(), 1e-12)))
    g_ref, g_dev = float(ref["grad_norm"][0]), float(dev["grad_norm"][0])
    rel = abs(g_dev - g_ref) / max(abs(g_ref), 1e-12)
    out["grad_norm"] = dict(reference=g_ref, device=g_dev, rel=rel)
    ok &= math.isfinite(g_dev) and rel <= GRAD_NORM_TOL
    out["ok"] = bool(ok)
    return out


def _numerics_inputs(smoke: bool, work: Path) -> tuple[dict, Path, dict]:
    """The random model and batch of rows 1 and 4 (they share the CPU fp32 reference)."""
    shape = (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=256, max_position_embeddings=512) if smoke else
             dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=1408, vocab_size=8192, max_position_embeddings=2048))
    # weights ~ N(0, 1/H): unit gain per matmul, so errors neither vanish nor explode with depth
    hf = make_random_qwen2(work / "numerics-model", seed=0, init_std=shape["hidden_size"] ** -0.5,
                           tie_word_embeddings=False, **shape)
    spec = dict(n=4 if smoke else 8, vocab=shape["vocab_size"], prompt=(4, 12) if smoke else (16, 64),
                response=(6, 16) if smoke else (32, 160), seed=3)
    return shape, hf, spec


_REFERENCES: dict[tuple[str, str], dict[str, np.ndarray]] = {}  # (model dir, batch spec) -> reference outputs


def reference_outputs(hf: Path, spec: dict, work: Path, proc_out=None) -> dict[str, np.ndarray]:
    """The CPU fp32 reference of ``hf`` on ``spec``'s batch: computed once per run (``proc_out``: a
    :func:`start_reference` already under way)."""
    key = (str(hf), json.dumps(spec, sort_keys=True))
    if key not in _REFERENCES:
        proc, out = proc_out or start_reference(hf, spec, work)
        log, _ = proc.communicate()
        if proc.returncode != 0:
            tail = "\n".join(log.strip().splitlines()[-15:])
            raise RuntimeError(f"the CPU fp32 reference failed (exit {proc.returncode}):\n{tail}")
        _REFERENCES[key] = dict(np.load(out))
    return _REFERENCES[key]


def bf16_and_reference(hf: Path, spec: dict, work: Path) -> tuple[dict, dict]:
    """The actor's bf16 outputs on this process's device and the CPU fp32 reference's (a subprocess
    that runs meanwhile, its files in ``work``), on ``hf`` and ``spec``'s batch (rows 1 and 6)."""
    key = (str(hf), json.dumps(spec, sort_keys=True))
    started = None if key in _REFERENCES else start_reference(hf, spec, work)  # runs while this process does
    try:
        dev = actor_outputs(hf, "bfloat16", make_batch(**spec))
    except BaseException:
        if started:
            started[0].kill()
            started[0].communicate()
        raise
    return dev, reference_outputs(hf, spec, work, started)


def row_actor_numerics(smoke: bool, work: Path) -> list[Row]:
    shape, hf, spec = _numerics_inputs(smoke, work)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dev, ref = bf16_and_reference(hf, spec, work)
    what = (f"L={shape['num_hidden_layers']} H={shape['hidden_size']} V={shape['vocab_size']}, "
            f"{spec['n']} seqs, {len(ref['logp'])} resp tokens")
    path = f"actor {device} bf16 ({spec_name() if device == 'cuda' else 'te-twin'} spec) vs CPU fp32"
    return comparison_rows(path, what, ref, dev, control=True)


def comparison_rows(path: str, what: str, ref: dict, dev: dict, *, control: bool) -> list[Row]:
    """The rows of :func:`compare`: log-probs, entropies, (the negative control), grad norm."""
    c = compare(ref, dev)
    lp, en, gn = c["logp"], c["entropy"], c["grad_norm"]
    crit = f"rms, max <= {RMS_TOL:g}x unit"

    def res(v: dict) -> str:
        return (f"rms {v['rms']:.1e} = {v['rel_rms']:.2f}x unit {v['unit_rms']:.1e}, "
                f"max {v['max']:.1e} = {v['rel_max']:.2f}x unit {v['unit_max']:.1e}")

    rows = [
        Row(f"{path}: log-probs", what, res(lp), crit,
            "PASS" if lp["rel_rms"] <= RMS_TOL and lp["rel_max"] <= MAX_TOL else "FAIL", lp),
        Row(f"{path}: entropies", what, res(en), crit,
            "PASS" if en["rel_rms"] <= RMS_TOL and en["rel_max"] <= MAX_TOL else "FAIL", en),
    ]
    if control:
        defect, detail = str(ref["control"]).split("|")  # models._negative_control: what it broke|how much
        rows.append(Row(f"negative control: {defect}", what,
                        f"{c['defect']['rel_rms']:.1f}x unit rms, {c['defect']['rel_max']:.1f}x unit max "
                        f"({detail})", f"> {RMS_TOL:g}x unit (the check can fail)",
                        "PASS" if c["defect"]["rel_rms"] > RMS_TOL else "FAIL", c["defect"]))
    rows.append(Row(f"{path}: M2PO grad norm", what,
                    f"{gn['device']:.4g} vs {gn['reference']:.4g} ({gn['rel']:.2%})", f"within {GRAD_NORM_TOL:.0%}",
                    "PASS" if gn["rel"] <= GRAD_NORM_TOL else "FAIL", gn))
    return rows
