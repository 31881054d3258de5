"""``m2po experiment entropy RUN_DIR``: the paper's Fig. 4b analysis on a run's token dumps.

The trainer writes token-level data of chosen steps with ``logging.dump_tokens_every=N``
(:mod:`megatron_m2po.trainer.token_dump`). Over the dumped tokens that are at least
``--min-staleness`` updates old (default: the run's ``stale_k``; 0 keeps every token) this
writes ``<out>/entropy.png`` with three panels and ``<out>/entropy.json`` / ``entropy.md``:

1. mean token entropy (± its standard error) against ``|r - 1|``, ``r = exp(logp - behav_logp)``,
   in logarithmically spaced bins;
2. the entropy distributions of all tokens, of the tokens GRPO's ε-clip removes and of the
   tokens M2PO's second-moment mask removes (both decided on the same data; see the dump's
   docstring);
3. the overlap: how many tokens only the clip removes, only the mask removes, both remove.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Optional

import numpy as np

from megatron_m2po.trainer.token_dump import read_token_dump


def load_dumps(run_dir: Path) -> tuple[dict[str, np.ndarray], list[dict]]:
    """Every ``tokens/step_*.npz`` of ``run_dir`` concatenated (plus a ``step`` array), and their metadata."""
    files = sorted((Path(run_dir) / "tokens").glob("step_*.npz"))
    if not files:
        raise ValueError(f"{run_dir} has no token dumps (tokens/step_*.npz); train with logging.dump_tokens_every=N "
                         "(e.g. m2po train CONFIG logging.dump_tokens_every=10) first")
    parts, metas = [], []
    for f in files:
        d, meta = read_token_dump(f)
        d["step"] = np.full(len(d["update"]), int(meta["step"]), np.int32)
        parts.append(d)
        metas.append(meta)
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}, metas


def entropy_stats(d: dict[str, np.ndarray], n_bins: int = 12) -> dict:
    """The numbers behind the figure, from per-token arrays (``entropy``, ``logratio``,
    ``grpo_clipped``, ``m2po_masked``)."""
    ent = d["entropy"].astype(np.float64)
    dev = np.abs(np.exp(d["logratio"].astype(np.float64)) - 1.0)
    clip, mask = d["grpo_clipped"].astype(bool), d["m2po_masked"].astype(bool)
    n = len(ent)
    lo = max(float(dev[dev > 0].min()) if (dev > 0).any() else 1e-6, 1e-6)
    hi = max(float(dev.max()), lo * 10)
    edges = np.geomspace(lo, hi * (1 + 1e-9), n_bins + 1)
    which = np.clip(np.searchsorted(edges, dev, side="right") - 1, 0, n_bins - 1)
    bins = []
    for b in range(n_bins):
        sel = which == b
        m = int(sel.sum())
        if m == 0:
            continue
        e = ent[sel]
        bins.append({"lo": float(edges[b]), "hi": float(edges[b + 1]), "n": m, "entropy_mean": float(e.mean()),
                     "entropy_se": float(e.std(ddof=1) / math.sqrt(m)) if m > 1 else 0.0,
                     "clip_frac": float(clip[sel].mean()), "mask_frac": float(mask[sel].mean())})

    def group(sel: np.ndarray) -> dict:
        m = int(sel.sum())
        return {"n": m, "frac": m / n if n else 0.0, "entropy_mean": float(ent[sel].mean()) if m else None,
                "entropy_median": float(np.median(ent[sel])) if m else None}

    union = int((clip | mask).sum())
    return {"tokens": n, "bins": bins, "all": group(np.ones(n, bool)), "clipped": group(clip), "masked": group(mask),
            "both": group(clip & mask), "clipped_only": group(clip & ~mask), "masked_only": group(mask & ~clip),
            "jaccard": float((clip & mask).sum() / union) if union else None,
            "spearman_entropy_vs_dev": _spearman(ent, dev)}


def _spearman(a: np.ndarray, b: np.ndarray) -> Optional[float]:
    if len(a) < 3:
        return None
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    c = np.corrcoef(ra, rb)[0, 1]
    return float(c) if np.isfinite(c) else None


def write_entropy_figure(d: dict[str, np.ndarray], stats: dict, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ent = d["entropy"].astype(np.float64)
    clip, mask = d["grpo_clipped"].astype(bool), d["m2po_masked"].astype(bool)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), dpi=110)
    ax = axes[0]
    bins = stats["bins"]
    if bins:
        xs = [math.sqrt(b["lo"] * b["hi"]) for b in bins]
        ax.errorbar(xs, [b["entropy_mean"] for b in bins], yerr=[b["entropy_se"] for b in bins], marker="o",
                    capsize=3)
        ax.set_xscale("log")
    ax.set_xlabel("|r - 1| (log bins)")
    ax.set_ylabel("token entropy (nats)")
    ax.set_title("entropy vs |r - 1| (mean ± s.e. per bin)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax = axes[1]
    top = float(ent.max()) if len(ent) else 1.0
    edges = np.linspace(0.0, top if top > 0 else 1.0, 31)
    for sel, lab, c in ((np.ones(len(ent), bool), "all tokens", "tab:gray"), (clip, "GRPO clip removes", "tab:orange"),
                        (mask, "M2PO mask removes", "tab:green")):
        if sel.any():
            ax.hist(ent[sel], bins=edges, density=True, histtype="step", linewidth=1.6, color=c,
                    label=f"{lab} (n={int(sel.sum())}, mean {ent[sel].mean():.2f})")
    ax.set_xlabel("token entropy (nats)")
    ax.set_ylabel("density")
    ax.set_title("entropy of removed tokens", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    ax = axes[2]
    names = ["clip only", "both", "mask only"]
    counts = [stats["clipped_only"]["n"], stats["both"]["n"], stats["masked_only"]["n"]]
    means = [stats[k]["entropy_mean"] for k in ("clipped_only", "both", "masked_only")]
    bars = ax.bar(names, counts, color=["tab:orange", "tab:olive", "tab:green"])
    for b, m in zip(bars, means):
        ax.annotate("—" if m is None else f"H̄ {m:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=8)
    j = stats["jaccard"]
    ax.set_title(f"overlap of removed tokens (Jaccard {'—' if j is None else f'{j:.2f}'}; "
                 f"{stats['tokens']} tokens)", fontsize=10)
    ax.set_ylabel("tokens")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def format_entropy_table(stats: dict) -> str:
    def row(name: str, g: dict) -> str:
        m = "—" if g["entropy_mean"] is None else f"{g['entropy_mean']:.3f}"
        md = "—" if g["entropy_median"] is None else f"{g['entropy_median']:.3f}"
        return f"| {name} | {g['n']} | {100 * g['frac']:.2f}% | {m} | {md} |"

    lines = ["| tokens | count | fraction | mean entropy | median entropy |", "|---|---|---|---|---|"]
    for name, key in (("all", "all"), ("GRPO clip removes", "clipped"), ("M2PO mask removes", "masked"),
                      ("both", "both"), ("clip only", "clipped_only"), ("mask only", "masked_only")):
        lines.append(row(name, stats[key]))
    j, rho = stats["jaccard"], stats["spearman_entropy_vs_dev"]
    lines += ["", f"Jaccard overlap of the removed sets: {'—' if j is None else f'{j:.3f}'}; Spearman correlation "
              f"of entropy with |r - 1|: {'—' if rho is None else f'{rho:.3f}'}."]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    d, metas = load_dumps(run_dir)
    k = args.min_staleness if args.min_staleness is not None else int(metas[0].get("stale_k", 0))
    sel = d["staleness"] >= k
    if not sel.any():
        raise ValueError(f"no dumped token of {run_dir} is at least {k} updates old (staleness "
                         f"{int(d['staleness'].min())}..{int(d['staleness'].max())}); lower --min-staleness or dump "
                         "later steps")
    d = {key: v[sel] for key, v in d.items()}
    stats = entropy_stats(d, n_bins=args.bins)
    m = metas[0]
    stats.update({"run_dir": str(run_dir), "steps": sorted({int(x["step"]) for x in metas}), "min_staleness": k,
                  "loss": m.get("loss"), "eps_low": m.get("eps_low"), "eps_high": m.get("eps_high"),
                  "m2po_threshold": m.get("m2po_threshold")})
    out = Path(args.out) if args.out else run_dir / "entropy"
    title = (f"{run_dir.name}: {stats['tokens']} tokens of steps {stats['steps'][0]}..{stats['steps'][-1]} with "
             f"staleness >= {k}; clip ε = {m.get('eps_low')}/{m.get('eps_high')}, M2PO τ = {m.get('m2po_threshold')}")
    fig = write_entropy_figure(d, stats, out / "entropy.png", title)
    table = title + "\n\n" + format_entropy_table(stats)
    (out / "entropy.md").write_text(table + "\n")
    (out / "entropy.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(table)
    print(f"\nfigure: {fig}\ntable: {out / 'entropy.md'}, {out / 'entropy.json'}")
    return 0


def register(esub) -> None:
    e = esub.add_parser("entropy", help="Entropy of the tokens GRPO clips vs M2PO masks (paper Fig. 4b).",
                        description="Reads <RUN_DIR>/tokens/step_*.npz (written with logging.dump_tokens_every=N) "
                                    "and writes entropy.png / entropy.md / entropy.json.")
    e.add_argument("run_dir", help="A run directory with token dumps (e.g. <experiment out>/grpo_sk)")
    e.add_argument("--min-staleness", type=int, default=None,
                   help="Use tokens at least this many updates old (default: the run's stale_k)")
    e.add_argument("--bins", type=int, default=12, help="Number of |r - 1| bins (default 12)")
    e.add_argument("--out", default=None, help="Output directory (default: <RUN_DIR>/entropy)")
    e.set_defaults(func=run)
