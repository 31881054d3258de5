#!/usr/bin/env python
"""PNG plots of metrics files written by ``MetricsLogger`` (``<run_dir>/metrics.jsonl``).

    python tools/plot_metrics.py runs/x/metrics.jsonl [runs/y ...] [--out plots/] [--metrics ...]

Without ``--metrics`` it draws the standard panels that exist in the files (reward / accuracy,
mask or clip fraction, M2 before/after, KL, entropy, staleness, gradient norm, response length,
throughput, where the time goes per step and the trainer's / engines' idle fractions): one PNG per panel plus ``overview.png`` with all of them. With ``--metrics`` (names
or shell-style patterns such as ``'policy/*'``) it draws one PNG per metric plus the overview.
Several files overlay as one colour per run, labelled by run directory name. One run's PNGs go
to ``<run_dir>/plots`` unless ``--out`` says otherwise.

The x-axis counts training steps, as the console does (``step 5/60``): a record logged at weight
version ``v`` (the ``step`` field of metrics.jsonl counts optimizer updates) is at step ``v / U``
with ``U`` updates per step (from the step records' ``train/step``), so a per-update metric
(``update/*``) sits at fractions of its step. ``--x step`` draws against the logged field itself
(optimizer updates), ``--x time`` against wall-clock time.

``plot_metrics(files, out_dir, metrics=None, labels=None)`` is the importable entry point.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import re
import sys
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a script: make the package importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_m2po.utils.logging import METRICS_FILE, moving_average, read_metrics  # noqa: E402

# (file stem, panel title, metric patterns in legend order)
PANELS: list[tuple[str, str, list[str]]] = [
    ("reward", "Reward / accuracy", ["rollout/reward_mean", "rollout/acc", "eval/*acc*"]),
    # every loss that masks tokens logs <loss>/mask_frac (m2po, icepop, mis, areal_m2po, a plugin's)
    ("trust_region", "Masked / clipped token fraction", ["*/mask_frac", "loss/clip_frac", "vcpo/is_trunc_frac"]),
    # M2 against its target (the run's algo.<loss>.threshold: a dashed line); M2PO's |log r| cut has
    # its own panel, as its scale (1-3.5) would flatten M2 (~0.04) to zero
    ("m2", "M2 = mean (log r)^2 and its target", ["*/m2_before", "*/m2_after"]),
    ("m2_cut", "M2PO's cut: tokens with |log r| above it are masked", ["m2po/threshold_value"]),
    ("kl", "KL(behaviour || current)", ["policy/kl_k1", "policy/kl_k3",
                                         "mismatch/train_vs_engine_kl"]),
    ("entropy", "Entropy", ["policy/entropy"]),
    ("staleness", "Staleness (updates)", ["staleness/mean", "staleness/max"]),
    ("grad_norm", "Gradient norm", ["*grad_norm*"]),
    ("response_len", "Response length (tokens)", ["rollout/response_len"]),
    ("throughput", "Throughput (tokens/s)", ["perf/tokens_per_s"]),
    # Where the time goes (docs/design.md §3): the trainer's phases per step, and who waits.
    ("time", "Where the time goes (s per step)",
     ["time/wall_s", "time/generation_wait_s", "time/data_wait_s", "time/push_s", "time/mask_s",
      "time/forward_backward_s", "time/optimizer_s", "time/checkpoint_s", "time/evaluation_s", "time/generation_s"]),
    ("idle", "Idle fraction (trainer waits for data, engines for work)",
     ["time/trainer_idle_frac", "time/engine_idle_frac"]),
]
_LINESTYLES = ["-", "--", ":", "-."]
_SKIP_KEYS = {"step", "time", "update"}
TRAIN_STEP = "train_step"  # the derived x-axis: training steps as the console counts them
_AXIS_LABELS = {TRAIN_STEP: "training step (as the console counts them)",
                "step": "optimizer update (weight version)"}


def updates_per_step(records: list[dict]) -> float | None:
    """``U``: the logged ``step`` (weight version, one per update) over the steps done
    (``train/step`` + 1) of the run's step records; None when it has none."""
    for r in records:
        s, v = r.get("train/step"), r.get("step")
        if isinstance(s, (int, float)) and isinstance(v, (int, float)) and v > 0:
            return v / (s + 1)
    return None


def _label_for(path: Path) -> str:
    p = path if path.is_dir() else path.parent
    return p.name or str(p)


def _series(records: list[dict], key: str, x_key: str) -> tuple[list[float], list[float]]:
    U = updates_per_step(records) if x_key == TRAIN_STEP else None
    xs, ys = [], []
    for i, r in enumerate(records):
        v = r.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        if x_key == TRAIN_STEP:  # without step records (older files): the logged step itself
            x = r.get("step", i) / U if U and isinstance(r.get("step"), (int, float)) else r.get("step", i)
        else:
            x = r.get(x_key, i)
        xs.append(float(x if isinstance(x, (int, float)) else i))
        ys.append(float(v))
    return xs, ys


def _scalar_keys(runs: list[list[dict]]) -> list[str]:
    keys: dict[str, None] = {}
    for recs in runs:
        for r in recs:
            for k, v in r.items():
                if k not in _SKIP_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool):
                    keys.setdefault(k, None)
    return list(keys)


def _match(patterns: Sequence[str], keys: Sequence[str]) -> list[str]:
    out: list[str] = []
    for pat in patterns:
        for k in keys:
            if fnmatch.fnmatchcase(k, pat) and k not in out:
                out.append(k)
    return out


def m2_targets(paths: Sequence[Path]) -> list[float]:
    """The M2 targets of the runs (``algo.<loss>.threshold`` of each run's config.json, for the losses
    that constrain M2: m2po, areal_m2po), distinct, in run order."""
    out: list[float] = []
    for p in paths:
        cfg = (p if p.is_dir() else p.parent) / "config.json"
        try:
            algo = json.loads(cfg.read_text()).get("algo", {})
        except (OSError, ValueError):
            continue
        loss = algo.get("loss")
        tau = (algo.get(loss) or {}).get("threshold") if loss in ("m2po", "areal_m2po") else None
        if isinstance(tau, (int, float)) and tau not in out:
            out.append(float(tau))
    return out


def _draw(ax, runs, labels, keys, x_key, title, smooth, targets: Sequence[float] = ()) -> bool:
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drew = False
    for ri, (recs, label) in enumerate(zip(runs, labels)):
        for ki, key in enumerate(keys):
            xs, ys = _series(recs, key, x_key)
            if not xs:
                continue
            if len(runs) == 1:
                name = key
            else:
                name = label if len(keys) == 1 else f"{label}: {key}"
            # One run: a colour per metric (a panel such as "time" has more lines than line styles).
            color = colors[(ki if len(runs) == 1 else ri) % len(colors)]
            ax.plot(xs, moving_average(ys, smooth), color=color,
                    linestyle=_LINESTYLES[ki % len(_LINESTYLES)], linewidth=1.4,
                    marker="o" if len(xs) < 30 else None, markersize=3, label=name)
            drew = True
    if drew:
        for tau in targets:
            ax.axhline(tau, color="black", linestyle="--", linewidth=1.0, label=f"target {tau:g}")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(_AXIS_LABELS.get(x_key, x_key))
    ax.grid(True, alpha=0.3)
    if drew:
        n = len(ax.get_legend_handles_labels()[1])
        if n > 4:  # many lines (the time panel): the legend beside the axes, not over the lines
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        else:
            ax.legend(fontsize=7, loc="best")
    return drew


def _safe_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("_") or "metric"


def plot_metrics(files: Sequence[str | Path], out_dir: str | Path, metrics: Sequence[str] | None = None,
                 labels: Sequence[str] | None = None, *, x_key: str = TRAIN_STEP,
                 smooth: int = 0) -> list[Path]:
    """Write PNGs for the metrics files (or run directories) ``files`` into ``out_dir``.

    ``metrics``: names or glob patterns, one PNG each; ``None`` draws the standard panels that
    exist. ``labels``: one per file (default: the run directory names). ``smooth``: moving
    average window (0 = raw). ``x_key``: ``"train_step"`` (training steps, as the console counts
    them), or a record field (``"step"``: optimizer updates; ``"time"``). Returns the written
    paths, ``overview.png`` last.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [Path(f) for f in files]
    if not paths:
        raise ValueError("plot_metrics: no metrics files given")
    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"plot_metrics: {len(labels)} labels for {len(paths)} files")
    runs = [read_metrics(p) for p in paths]
    labels = list(labels) if labels is not None else [_label_for(p) for p in paths]
    seen: dict[str, int] = {}
    for i, lab in enumerate(labels):  # distinct legend entries for same-named run dirs
        if lab in seen:
            labels[i] = f"{lab} ({i})"
        seen.setdefault(lab, i)
    keys = _scalar_keys(runs)

    if metrics:
        panels = [(_safe_name(k), k, [k]) for k in _match(metrics, keys)]
        if not panels:
            raise ValueError(f"none of the metrics {list(metrics)} is in {[str(p) for p in paths]}; "
                             f"available: {sorted(keys)}")
    else:
        panels = [(stem, title, found) for stem, title, pats in PANELS
                  if (found := _match(pats, keys))]
        if not panels:  # a metrics file with none of the standard names: plot what it has
            panels = [(_safe_name(k), k, [k]) for k in keys]
        if not panels:
            raise ValueError(f"no numeric metrics in {[str(p) for p in paths]}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    targets = {"m2": m2_targets(paths)}
    for stem, title, pkeys in panels:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        _draw(ax, runs, labels, pkeys, x_key, title, smooth, targets.get(stem, ()))
        fig.tight_layout()
        path = out / f"{stem}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)

    ncol = min(3, len(panels))
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.2 * ncol, 3.6 * nrow), dpi=100, squeeze=False)
    for ax, (stem, title, pkeys) in zip(axes.flat, panels):
        _draw(ax, runs, labels, pkeys, x_key, title, smooth, targets.get(stem, ()))
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(", ".join(labels), fontsize=11)
    fig.tight_layout()
    path = out / "overview.png"
    fig.savefig(path)
    plt.close(fig)
    written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help=f"{METRICS_FILE} files or run directories")
    ap.add_argument("--out", default=None,
                    help="Output directory for the PNGs (default for one run: <run_dir>/plots)")
    ap.add_argument("--metrics", nargs="+", default=None,
                    help="Metric names or glob patterns (default: the standard panels)")
    ap.add_argument("--labels", nargs="+", default=None, help="Legend label per file")
    ap.add_argument("--x", default=TRAIN_STEP,
                    help="x-axis: train_step (default: training steps, as the console counts them), step "
                         "(optimizer updates, the logged field) or another record field such as time")
    ap.add_argument("--smooth", type=int, default=0, help="Moving-average window (0 = raw)")
    args = ap.parse_args(argv)
    if args.out is None:
        if len(args.files) != 1:
            ap.error("--out is required with several runs")
        src = Path(args.files[0])
        args.out = str((src if src.is_dir() else src.parent) / "plots")  # next to the run
    try:
        written = plot_metrics(args.files, args.out, args.metrics, args.labels,
                               x_key=args.x, smooth=args.smooth)
    except ValueError as e:
        print(f"plot_metrics: {e}", file=sys.stderr)
        return 2
    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
