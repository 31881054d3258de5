"""Figures of an experiment: one PNG per metric, one colour per arm; over several seeds the mean
curve and a min-max band."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from megatron_m2po.experiment.analysis import TR_KEY, metric_values, step_records

FIGURES: list[tuple[str, str, str]] = [
    # (file stem, title, metric key; "@tr" = the arm's clip / mask fraction; "@m2" = M2)
    ("heldout_acc", "Held-out accuracy (eval/synthetic/acc)", "eval/synthetic/acc"),
    ("reward", "Training reward (rollout/reward_mean)", "rollout/reward_mean"),
    ("trust_region", "Clipped (GRPO) / masked (M2PO) token fraction", "@tr"),
    ("m2", "M2 = mean (log r)^2", "@m2"),
    ("kl", "KL(behaviour || current), k3 estimator", "policy/kl_k3"),
    ("grad_norm", "Gradient norm (before clipping)", "optim/grad_norm"),
    ("entropy", "Policy entropy", "policy/entropy"),
    ("staleness", "Mean staleness of trained tokens (updates)", "staleness/mean"),
]


def _curves(recs: list[dict], loss: str, key: str) -> list[tuple[str, list[int], list[float], str]]:
    """(suffix, xs, ys, linestyle) curves of one run of an arm with loss ``loss`` for one figure key."""
    if key == "@tr":
        if loss == "no_tr":  # no trust region: nothing is ever clipped or masked
            xs = [int(r["step"]) for r in recs]
            return [(" (nothing clipped)", xs, [0.0] * len(xs), ":")] if xs else []
        key = TR_KEY.get(loss, "")
    if key == "@m2":
        out = []
        exact = metric_values(recs, "policy/m2") or metric_values(recs, "m2po/m2_before")
        if exact:
            src = "" if metric_values(recs, "policy/m2") else " (exact, trust-region tokens)"
            out.append((src, [x for x, _ in exact], [y for _, y in exact], "-"))
            after = metric_values(recs, "m2po/m2_after")
            if after:
                out.append((" after mask", [x for x, _ in after], [y for _, y in after], "--"))
        k3 = metric_values(recs, "policy/kl_k3")
        if k3 and not metric_values(recs, "policy/m2"):
            out.append((" ≈ 2·KL_k3 (all tokens)", [x for x, _ in k3], [2 * y for _, y in k3], ":"))
        return out
    vals = metric_values(recs, key)
    return [("", [x for x, _ in vals], [y for _, y in vals], "-")] if vals else []


NOISY = ("rollout/reward_mean", "@tr", "optim/grad_norm", "policy/kl_k3", "@m2", "policy/entropy")
PALETTE = ["tab:blue", "tab:orange", "tab:red", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
           "tab:olive", "tab:cyan"]


def _across_seeds(curves: list[tuple[list[int], list[float]]]) -> tuple[list[int], list[float], list[float],
                                                                        list[float]]:
    """(xs, mean, min, max) over the seeds' curves at the x values every seed logged."""
    common = set(curves[0][0])
    for xs, _ in curves[1:]:
        common &= set(xs)
    xs = sorted(common)
    cols = [[dict(zip(cx, cy))[x] for cx, cy in curves] for x in xs]
    return xs, [sum(c) / len(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols]


def write_figures(arms: Sequence[tuple[str, str, str, list[list[dict]]]], out_dir: Path, *, smooth: int = 0,
                  figures: Sequence[tuple[str, str, str]] = FIGURES, colors: dict[str, str] | None = None
                  ) -> list[Path]:
    """One PNG per figure in ``figures`` with one colour per arm (figures no arm has data for are skipped).

    ``arms``: (name, label, loss, [metrics records of each seed]). With one seed the raw curve (and,
    for noisy metrics, a ``smooth``-step moving average over it); with several the mean over seeds
    and a shaded min-max band (the mean is smoothed, the band is not).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_m2po.utils.logging import moving_average

    out_dir.mkdir(parents=True, exist_ok=True)
    colors = dict(colors or {})
    written = []
    for stem, title, key in figures:
        fig, ax = plt.subplots(figsize=(7.5, 4.4), dpi=110)
        drew = banded = False
        for i, (name, label, loss, seeds) in enumerate(arms):
            c = colors.get(name) or PALETTE[i % len(PALETTE)]
            per_seed = [_curves(step_records(recs), loss, key) for recs in seeds]
            per_seed = [cs for cs in per_seed if cs]
            if not per_seed:
                continue
            for j, (suffix, _, _, ls) in enumerate(per_seed[0]):
                runs = [(cs[j][1], cs[j][2]) for cs in per_seed if len(cs) > j and cs[j][1]]
                if not runs:
                    continue
                if len(runs) == 1:
                    xs, ys = runs[0]
                    lo = hi = None
                else:
                    xs, ys, lo, hi = _across_seeds(runs)
                    if not xs:
                        continue
                    ax.fill_between(xs, lo, hi, color=c, alpha=0.18, linewidth=0)
                    banded = True
                if smooth > 1 and len(ys) > smooth and key in NOISY:
                    if lo is None:
                        ax.plot(xs, ys, color=c, linestyle=ls, linewidth=0.8, alpha=0.25)
                    ys = moving_average(ys, smooth)
                n = f" (mean of {len(runs)})" if len(runs) > 1 else ""
                ax.plot(xs, ys, color=c, linestyle=ls, linewidth=1.6, label=label + suffix + n,
                        marker="o" if len(xs) <= 30 else None, markersize=3)
                drew = True
        if not drew:
            plt.close(fig)
            continue
        if key in ("policy/kl_k3", "@m2", "optim/grad_norm") and _all_positive(ax):
            ax.set_yscale("log")
        ax.set_title(title + ("\n(line: mean over seeds; band: min–max over seeds)" if banded else ""), fontsize=10)
        ax.set_xlabel("optimizer updates")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = out_dir / f"{stem}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def _all_positive(ax) -> bool:
    ys = [y for line in ax.get_lines() for y in line.get_ydata()]
    return bool(ys) and min(ys) > 0 and max(ys) / min(ys) > 50



def write_sweep_figure(points: Sequence[tuple[float, object]], sweep: str, path: Path) -> Path:
    """Best / final held-out accuracy, final reward and clip / mask fraction on stale steps against the
    swept value (staleness k or threshold τ): ``points`` = (value, :class:`ArmAggregate`) per arm;
    mean over seeds, error bars ±1 std (none with one seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("best_acc", "best held-out acc"), ("final_acc", "final held-out acc"),
              ("final_reward", "final training reward"), ("stale_tr_frac", "clip / mask fraction on stale steps")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.0 * len(panels), 3.6), dpi=110)
    for ax, (attr, title) in zip(axes, panels):
        pts = sorted((x, a.stats[attr]) for x, a in points if a.stats[attr].mean is not None)
        if pts:
            ax.errorbar([x for x, _ in pts], [s.mean for _, s in pts], yerr=[s.std or 0.0 for _, s in pts],
                        marker="o", capsize=3)
            if sweep == "threshold":
                ax.set_xscale("log")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("staleness k (updates)" if sweep == "staleness" else "M2PO threshold τ")
        ax.grid(True, alpha=0.3)
    n = max((len(a.seeds) for _, a in points), default=1)
    fig.suptitle(f"{sweep} sweep: mean over {n} seed(s)" + (", error bars ±1 std" if n > 1 else ""), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
