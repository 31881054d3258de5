"""The tiny-task distillation comparison's report, as registered (docs/measurements/distill_tiny/PREREGISTRATION.md).

    m2po experiment distill-report docs/measurements/distill_tiny/results \\
        --controls docs/measurements/drift_ladder/results --out report.md

Reads the harvested distillation runs (``k0/grpo_distill_s0/seed_<s>/``, ``k32/m2po_distill_sk/seed_<s>/``;
control runs there too when the pre-flight sent them to be rerun: ``k0/grpo_s0``, ``k32/m2po_sk``) and
the controls from the drift ladder's results (``onpolicy/grpo_s0``, ``k32/m2po_sk``) otherwise. A run
without ``experiment_done.json`` is not finished and counts as missing; every cell is reported, and a
criterion without its data is **not testable** and says what is missing.

* primary: the early-window held-out accuracy (mean of the evaluations at updates 1 .. 512 of 1,024)
  of each distillation arm minus its control, **paired by seed** (``experiment/paired.py``);
* secondary: the late window (updates > 768), ``distill/reverse_kl`` over the first and last 10 % of
  steps, the collapse verdict of the existing rule;
* D1 (k = 0), D2 (k = 32): the early difference is positive and exceeds 2 SE; D3: at each k the late
  difference is above -2 SE and no distillation run collapses.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_m2po.experiment.analysis import CollapseRule, pooled_base_reward, summarize_arm
from megatron_m2po.experiment.ladder import ACC_KEY, SEEDS, UPDATES, UPDATES_PER_STEP, Verdict, read_records
from megatron_m2po.experiment.paired import Paired, late_window, paired

__all__ = ["PAIRS", "load", "report", "register"]

EARLY = UPDATES // 2
# k -> (distillation arm, its control, where the ladder keeps the control)
PAIRS = {0: ("grpo_distill_s0", "grpo_s0", "onpolicy"), 32: ("m2po_distill_sk", "m2po_sk", "k32")}


@dataclass
class Run:
    early: Optional[float]
    late: Optional[float]
    collapsed: Optional[bool]
    rkl_first: Optional[float] = None
    rkl_last: Optional[float] = None
    env: str = "unknown"  # the base weights it ran from (experiment/environment.py)


def _early(acc: list[tuple[int, float]]) -> Optional[float]:
    vals = [a for u, a in acc if 0 < u <= EARLY]
    return sum(vals) / len(vals) if vals else None


def _rkl(records: list[dict]) -> tuple[Optional[float], Optional[float]]:
    vals = [float(r["distill/reverse_kl"]) for r in records if "distill/reverse_kl" in r and "train/step" in r]
    n = max(1, len(vals) // 10)
    return (sum(vals[:n]) / n, sum(vals[-n:]) / n) if vals else (None, None)


def _load_run(d: Path) -> Optional[list[dict]]:
    return read_records(d) if (d / "experiment_done.json").is_file() else None


def _env(d: Path) -> str:
    try:
        return (json.loads((d / "experiment_done.json").read_text()).get("environment") or {}).get("base") or "unknown"
    except (OSError, ValueError):
        return "unknown"


def load(results: Path, controls: Path) -> tuple[dict[tuple[str, int], dict[int, Run]], list[str]]:
    """(arm, k) -> seed -> run, and what is missing (module docstring)."""
    raw: dict[tuple[str, int], dict[int, list[dict]]] = {}
    envs: dict[tuple[str, int, int], str] = {}
    missing: list[str] = []
    for k, (arm, control, ladder_dir) in PAIRS.items():
        for name, where in ((arm, results / f"k{k}" / arm),
                            (control, results / f"k{k}" / control if (results / f"k{k}" / control).is_dir()
                             else controls / ladder_dir / control)):
            for s in SEEDS:
                recs = _load_run(where / f"seed_{s}")
                if recs is None:
                    missing.append(f"k={k} {name} seed {s}")
                else:
                    raw.setdefault((name, k), {})[s] = recs
                    envs[(name, k, s)] = _env(where / f"seed_{s}")
    base = pooled_base_reward([(r, k, UPDATES_PER_STEP) for (_, k), by in raw.items() for r in by.values()])
    runs: dict[tuple[str, int], dict[int, Run]] = {}
    for (name, k), by in raw.items():
        loss = "grpo" if name.startswith("grpo") else "m2po"
        for s, recs in by.items():
            acc = [(int(x["step"]), float(x[ACC_KEY])) for x in recs
                   if isinstance(x.get(ACC_KEY), (int, float)) and isinstance(x.get("step"), (int, float))]
            summ = summarize_arm(recs, arm=name, label=name, loss=loss, staleness=k, base_reward=base,
                                 rule=CollapseRule())
            first, last = _rkl(recs)
            runs.setdefault((name, k), {})[s] = Run(_early(acc), late_window(acc, UPDATES), summ.collapsed, first, last,
                                                    envs[(name, k, s)])
    return runs, missing


def _diff(runs, k: int, attr: str) -> Paired:
    """``attr`` of the distillation arm minus its control, paired by seed over the seeds whose two
    runs ran from the same base weights (a pair across environments is confounded: environment.py)."""
    arm, control, _ = PAIRS[k]
    a, b = runs.get((arm, k), {}), runs.get((control, k), {})
    seeds = [s for s in a if s in b and a[s].env == b[s].env]
    return paired({s: getattr(a[s], attr) for s in seeds}, {s: getattr(b[s], attr) for s in seeds})


def criteria(runs) -> list[Verdict]:
    out = []
    for name, k in (("D1 (k = 0)", 0), ("D2 (k = 32)", 32)):
        p = _diff(runs, k, "early")
        if p.n < 2 or p.mean is None or p.se is None:
            out.append(Verdict(name, "not testable", f"{p.n} paired seeds of the early window"))
        else:
            ok = p.mean > 0 and p.exceeds(2.0)
            out.append(Verdict(name, "holds" if ok else "fails", f"early-window difference {p.format()}"))
    why, ok, testable = [], True, True
    for k in PAIRS:
        p = _diff(runs, k, "late")
        arm = PAIRS[k][0]
        col = [r.collapsed for r in runs.get((arm, k), {}).values()]
        if p.n < 2 or p.se is None or len(col) < len(SEEDS):
            testable = False
            why.append(f"k={k}: {p.n} paired seeds, {len(col)} distillation runs")
            continue
        good = p.mean > -2 * p.se and not any(col)
        ok &= good
        why.append(f"k={k}: late {p.format()}, {sum(bool(c) for c in col)} collapsed")
    out.append(Verdict("D3", "holds" if testable and ok else ("not testable" if not testable else "fails"),
                       "; ".join(why)))
    return out


def _f(v: Optional[float], digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def report(runs, missing: list[str], preflight: str = "") -> str:
    out = ["# On-policy distillation on the tiny task: report", "",
           "Computed by `m2po experiment distill-report` from the harvested runs, as registered "
           "(PREREGISTRATION.md). Every cell is shown; n/a is a cell without its data.", "",
           f"Pre-flight (this commit against the ladder's on-policy seed 1234): {preflight or 'not run yet'}", ""]
    if missing:
        out += [f"**Not finished yet ({len(missing)}):** " + ", ".join(missing) + ".", ""]
    for k, (arm, control, _) in PAIRS.items():
        out += [f"## k = {k}: {arm} against {control}", "",
                "| arm | early acc per seed | late acc per seed | reverse KL first / last 10 % | collapsed |",
                "| --- | --- | --- | --- | --- |"]
        for name in (arm, control):
            by = runs.get((name, k), {})
            early = " / ".join(_f(by[s].early) if s in by else "n/a" for s in SEEDS)
            late = " / ".join(_f(by[s].late) if s in by else "n/a" for s in SEEDS)
            rkl = " ; ".join(f"{_f(by[s].rkl_first)} / {_f(by[s].rkl_last)}" if s in by else "n/a" for s in SEEDS) \
                if name == arm else "-"
            col = f"{sum(bool(r.collapsed) for r in by.values())} of {len(by)}"
            out.append(f"| {name} | {early} | {late} | {rkl} | {col} |")
        out += ["", f"Paired by seed, {arm} minus {control}: early window {_diff(runs, k, 'early').format()}; "
                f"late window {_diff(runs, k, 'late').format()}.", ""]
    out += ["## Criteria", "", "| criterion | verdict | why |", "| --- | --- | --- |"]
    out += [f"| {v.name} | **{v.verdict}** | {v.why} |" for v in criteria(runs)]
    return "\n".join(out) + "\n"


def register(esub: argparse._SubParsersAction) -> None:
    r = esub.add_parser("distill-report", help="The tiny-task distillation comparison's registered report.",
                        description=__doc__.split("\n\n")[0])
    r.add_argument("results", help="the harvested distillation runs (docs/measurements/distill_tiny/results)")
    r.add_argument("--controls", required=True,
                   help="the drift ladder's harvested results (docs/measurements/drift_ladder/results)")
    r.add_argument("--out", default=None, help="write the report here (markdown; default: print it)")
    r.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    results, controls = Path(args.results), Path(args.controls)
    for p, what in ((results, "the distillation runs"), (controls, "the ladder's results")):
        if not p.is_dir():
            print(f"m2po experiment distill-report: {p} is not a directory ({what})")
            return 2
    runs, missing = load(results, controls)
    verdict = results / "preflight" / "verdict.txt"
    text = report(runs, missing, verdict.read_text().strip() if verdict.is_file() else "")
    if args.out:
        Path(args.out).write_text(text)
        print(f"report written to {args.out}")
    else:
        print(text, end="")
    return 0
