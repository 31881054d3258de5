"""What a run says when it ends, and whether a run directory holds a finished run.

:func:`run_summary` is the end of a run's output: where its metrics, plots (the exact
``tools/plot_metrics.py`` command), trace and final weights are, and how reward and accuracy
moved from its first steps to its last. :func:`finished_step` decides that a re-run of a
finished run has nothing to do (the trainer then says so and exits before it builds the actor or
starts an engine; docs/design.md §5b). Both read files only: rank 0 calls them.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

from megatron_m2po.actor.checkpoint import latest_checkpoint
from megatron_m2po.config import Config
from megatron_m2po.utils.logging import METRICS_FILE, TB_DIR, read_metrics

__all__ = ["finished_step", "finished_message", "run_summary", "metric_movement"]

log = logging.getLogger(__name__)

FINAL_HF = "final_hf"
FINAL_ADAPTER = "final_adapter"  # next to final_hf in a LoRA run
# Steps averaged at each end of a run for "reward 0.36 -> 0.47": one step's reward is noisy.
ENDS = 5


def _checkpoint_step(ckpt: Path) -> Optional[int]:
    try:
        return int(json.loads((ckpt / "extra_state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def finished_step(cfg: Config) -> Optional[int]:
    """The step count of ``cfg``'s run when it is finished, else None.

    Finished: resuming is on (``checkpoint.resume``), the newest complete checkpoint is at
    ``trainer.num_steps`` or beyond, and with ``checkpoint.export_hf_at_end`` the final weights
    were exported after that checkpoint was written (a run killed between its last checkpoint and
    the export is not finished: its re-run exports them)."""
    if not cfg.checkpoint.resume:
        return None
    ckpt = latest_checkpoint(cfg.resolved_path(cfg.checkpoint.dir, "checkpoints"))
    step = _checkpoint_step(ckpt) if ckpt is not None else None
    if step is None or step < cfg.trainer.num_steps:
        return None
    if cfg.checkpoint.export_hf_at_end:
        final = Path(cfg.trainer.run_dir) / FINAL_HF
        # An export older than the checkpoint is of an earlier finish (trainer.num_steps raised since).
        if not (final / "config.json").is_file() or final.stat().st_mtime < ckpt.stat().st_mtime:
            return None
    return step


def finished_message(cfg: Config, step: int) -> str:
    """What a re-run of a finished run prints (then :func:`run_summary`)."""
    more = (f" (trainer.num_steps={cfg.trainer.num_steps}: a smaller value does not undo steps)"
            if step > cfg.trainer.num_steps else "")
    return (f"run complete: {_show(Path(cfg.trainer.run_dir))} finished all {step} steps{more}; nothing to do, "
            "nothing started. To train on, raise trainer.num_steps (it resumes from the last checkpoint); to start "
            "over, choose another trainer.run_dir.")


def _show(path: Path | str) -> str:
    """``path`` relative to the working directory when it lies under it (what a user typed), quoted for a shell."""
    p = Path(path)
    try:
        rel = os.path.relpath(p)
        if not rel.startswith(".."):
            p = Path(rel)
    except ValueError:  # another drive (Windows)
        pass
    return shlex.quote(str(p))


def _tool(name: str, *args: str) -> str:
    """The command line that runs the repository's ``tools/<name>`` with this interpreter."""
    tool = Path(__file__).resolve().parents[2] / "tools" / name
    script = _show(tool) if tool.is_file() else f"tools/{name}"  # an installed package: the repository's
    return " ".join([_show(sys.executable), script, *args])


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _eval_step(r: dict[str, Any]) -> Optional[int]:
    """The step an evaluation in record ``r`` followed: a step record's is after step
    ``train/step`` + 1; the one before training says ``eval/at_step`` 0; None for other records."""
    if isinstance(r.get("train/step"), (int, float)):
        return int(r["train/step"]) + 1
    return int(r["eval/at_step"]) if isinstance(r.get("eval/at_step"), (int, float)) else None


def metric_movement(records: list[dict[str, Any]], ends: int = ENDS) -> str:
    """``"reward 0.362 -> 0.478, acc 0.291 -> 0.432 (mean of steps 1-5 vs 56-60)"`` from a run's
    step records (``train/step`` and ``rollout/*``; :func:`~megatron_m2po.utils.logging.read_metrics`),
    plus the held-out accuracy's first and last evaluation; "" when no step was logged."""
    steps = [r for r in records if isinstance(r.get("train/step"), (int, float))
             and isinstance(r.get("rollout/reward_mean"), (int, float))]
    parts = []
    if steps:
        w = max(1, min(ends, len(steps) // 4))
        first, last = steps[:w], steps[-w:]
        moved = []
        for key, label in (("rollout/reward_mean", "reward"), ("rollout/acc", "acc")):
            a = [r[key] for r in first if isinstance(r.get(key), (int, float))]
            b = [r[key] for r in last if isinstance(r.get(key), (int, float))]
            if a and b:
                moved.append(f"{label} {_mean(a):.3f} -> {_mean(b):.3f}")

        def span(rs: list[dict]) -> str:
            lo, hi = int(rs[0]["train/step"]) + 1, int(rs[-1]["train/step"]) + 1
            return str(lo) if lo == hi else f"{lo}-{hi}"

        parts.append(", ".join(moved) + f" (training rollouts, mean of steps {span(first)} vs {span(last)})")
    evals = sorted({k for r in records for k in r if k.startswith("eval/") and k.endswith("acc")})
    for key in evals:
        pts = [(_eval_step(r), r[key]) for r in records
               if isinstance(r.get(key), (int, float)) and _eval_step(r) is not None]
        if pts:
            (s0, a0), (s1, a1) = pts[0], pts[-1]
            parts.append(f"held-out {key} {a0:.3f} (step {s0}) -> {a1:.3f} (step {s1})" if s1 != s0
                         else f"held-out {key} {a0:.3f} (step {s0})")
    return "; ".join(parts)


def run_summary(run_dir: str | os.PathLike, *, trace: Optional[str | os.PathLike] = None,
                final_hf: Optional[str | os.PathLike] = None) -> str:
    """The lines that end a run's output: how reward / accuracy moved, and where its metrics,
    plots (the command that draws them), trace (``trace``, when written) and final weights
    (``final_hf``, when exported) are."""
    run = Path(run_dir)
    metrics = run / METRICS_FILE
    lines = []
    try:
        moved = metric_movement(read_metrics(metrics))
    except ValueError:  # no metrics file: nothing was logged
        moved = ""
    if moved:
        lines.append(f"  moved:   {moved}")
    if metrics.is_file():
        tb = run / TB_DIR
        lines.append(f"  metrics: {_show(metrics)}" + (f" (TensorBoard: {_show(tb)})" if tb.is_dir() else ""))
        lines.append(f"  plots:   {_tool('plot_metrics.py', _show(run), '--out', _show(run / 'plots'))}")
    if trace is not None and Path(trace).is_file():
        lines.append(f"  trace:   {_show(trace)} (open it in https://ui.perfetto.dev, or draw it: "
                     f"{_tool('plot_trace.py', _show(run))})")
    if final_hf is not None and Path(final_hf).is_dir():
        lines.append(f"  weights: {_show(final_hf)} (HF format: transformers, SGLang, `m2po eval --model`)")
        adapter = Path(final_hf).parent / FINAL_ADAPTER  # a LoRA run's adapter (weights/hf_export.py)
        if adapter.is_dir():
            lines.append(f"  adapter: {_show(adapter)} (peft: PeftModel.from_pretrained(base, adapter); SGLang "
                         "--lora-paths)")
    return "\n".join(lines)
