#!/usr/bin/env python
"""A PNG timeline of a run's trace (``<run_dir>/trace.json``, written with ``logging.trace=true``).

    python tools/plot_trace.py runs/x [--out runs/x/trace.png] [--from 0 --to 60]

One lane per trainer rank and thread (the trainer's main thread, the rank-0 driver's generation
and reward threads), each phase a bar coloured by its name (the same colour on every lane), and
below them the engines' ``/v1/loads`` counters (running / queued requests) when the trace has
them. It is the picture of what https://ui.perfetto.dev shows interactively.

``plot_trace(trace, out, t_from=None, t_to=None)`` is the importable entry point; it returns the
lane labels, top to bottom. The PNG goes next to the run (``<run_dir>/trace.png``) unless ``--out``
says otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Phases in legend order (utils/timing.py TRAINER_PHASES, then the driver's); others follow.
_ORDER = ["push", "generation_wait", "data_wait", "mask", "forward_backward", "optimizer", "checkpoint",
          "evaluation", "generation", "reward"]
_COUNTERS = ("engine/inflight_reqs", "engine/running_reqs", "engine/queued_reqs")


def _load(trace: str | Path) -> dict:
    path = Path(trace)
    if path.is_dir():
        path = path / "trace.json"
    if not path.is_file():
        raise ValueError(f"{path} does not exist (run with logging.trace=true; it is written at the end of the run)")
    return json.loads(path.read_text())


def _lanes(events: list[dict]) -> tuple[dict[tuple[int, int], str], list[dict]]:
    """(pid, tid) -> lane label, ordered by rank then thread; and the complete ("X") events."""
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    keys = sorted({(e["pid"], e["tid"]) for e in spans},
                  key=lambda k: (k[0], threads.get(k, "") != "MainThread", threads.get(k, ""), k[1]))
    return {k: f"{procs.get(k[0], f'pid {k[0]}')} / {threads.get(k, k[1])}" for k in keys}, spans


def _depths(spans: list[dict]) -> list[tuple[dict, int]]:
    """Each span with the number of spans of its lane still open when it starts (its nesting depth)."""
    out, open_ends = [], {}
    for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
        ends = [t for t in open_ends.get((e["pid"], e["tid"]), []) if t > e["ts"]]
        out.append((e, len(ends)))
        open_ends[(e["pid"], e["tid"])] = ends + [e["ts"] + e["dur"]]
    return out


def plot_trace(trace: str | Path, out: str | Path, t_from: float | None = None,
               t_to: float | None = None) -> list[str]:
    """Draw ``trace`` (a trace.json or its run directory) to the PNG ``out``; seconds
    ``t_from``..``t_to`` of the run when given. Returns the lane labels, top to bottom."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = _load(trace)["traceEvents"]
    lanes, spans = _lanes(events)
    if not lanes:
        raise ValueError(f"{trace} has no phase spans (ph 'X' events)")
    counters = [e for e in events if e.get("ph") == "C" and e["name"] in _COUNTERS]
    names = sorted({e["name"] for e in spans}, key=lambda n: (_ORDER.index(n) if n in _ORDER else len(_ORDER), n))
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    colour = {n: cmap(i) for i, n in enumerate(names)}
    row = {k: i for i, k in enumerate(lanes)}

    fig, axes = plt.subplots(2 if counters else 1, 1, sharex=True, squeeze=False,
                             figsize=(11, 0.45 * len(lanes) + 1.6 + (1.4 if counters else 0)),
                             gridspec_kw={"height_ratios": [max(len(lanes), 2), 2] if counters else [1]})
    ax = axes[0][0]
    for e, depth in _depths(spans):  # a span inside another (reward inside generation) is drawn lower and thinner
        d = min(depth, 2)
        ax.broken_barh([(e["ts"] / 1e6, max(e["dur"] / 1e6, 1e-4))],
                       (row[(e["pid"], e["tid"])] - 0.4 + 0.3 * d, 0.8 - 0.3 * d),
                       facecolors=colour[e["name"]], linewidth=0)
    ax.set_yticks(range(len(lanes)), list(lanes.values()), fontsize=8)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.grid(axis="x", alpha=0.3)
    fig.legend(handles=[matplotlib.patches.Patch(color=colour[n], label=n) for n in names], fontsize=7,
               ncol=len(names), loc="upper center", frameon=False)
    if counters:
        cax = axes[1][0]
        for name in _COUNTERS:
            pts = sorted((e["ts"] / 1e6, e["args"]["value"]) for e in counters if e["name"] == name)
            if pts:
                cax.step([p[0] for p in pts], [p[1] for p in pts], where="post", label=name,
                         marker="." if name != "engine/inflight_reqs" else None)
        cax.set_ylabel("requests\n(in flight; /v1/loads)", fontsize=8)
        cax.legend(fontsize=7, frameon=False)
        cax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("seconds since the run's first traced event")
    if t_from is not None or t_to is not None:
        ax.set_xlim(t_from, t_to)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))  # room for the legend on top
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return list(lanes.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="trace.json or the run directory holding it")
    ap.add_argument("--out", default=None, help="Output PNG (default: trace.png in the run directory)")
    ap.add_argument("--from", dest="t_from", type=float, default=None, help="Start (seconds) of the window drawn")
    ap.add_argument("--to", dest="t_to", type=float, default=None, help="End (seconds) of the window drawn")
    args = ap.parse_args(argv)
    if args.out is None:  # next to the run, not wherever the command happens to be run from
        src = Path(args.trace)
        args.out = str((src if src.is_dir() else src.parent) / "trace.png")
    try:
        plot_trace(args.trace, args.out, args.t_from, args.t_to)
    except ValueError as e:
        print(f"plot_trace: {e}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
