"""The drift ladder's report, exactly as registered (docs/measurements/drift_ladder/PREREGISTRATION.md).

    m2po experiment ladder-report docs/measurements/drift_ladder/results --out report.md --figure ladder.png

Reads what ``run_ladder.sh`` harvests (``onpolicy/grpo_s0/seed_<s>/`` and ``k<k>/<arm>/seed_<s>/``:
``metrics.jsonl[.gz]``, ``experiment_done.json``, and the on-policy runs' ``drift/drift.json``) and
computes every registered endpoint and criterion from them; a run without ``experiment_done.json``
is not finished and counts as missing. Every cell is reported whatever it holds; a criterion whose
data are missing is **not testable** and says what is missing.

* primary: the late-window held-out accuracy (mean of the evaluations after update 768 of 1,024)
  of each stale arm minus the on-policy arm's, **paired by seed** (``experiment/paired.py``);
* secondary: the lag-corrected training reward (at the same generating version as on-policy),
  the best evaluation (reported, never judged), the collapse verdict of the existing rule
  (``CollapseRule``, base-model reward pooled over every run), GRPO's clip and M2PO's mask
  fraction on stale steps;
* the x-axis: D(k) from the on-policy checkpoints, mean and SE over seeds;
* P1-P3 and the drift at which each method breaks, as worded in the registration.

Environments (Amendment 1): runs are compared only with runs of the same base weights. Each run's
environment is its ``experiment_done.json`` ``environment.base`` (the fingerprint of the base model it
ran from, recorded since the amendment), or for runs finished before, the label ``environments.json``
in the results gives it; reruns of a cell in another environment go under ``<results>/reruns/`` in
the same layout. The report is written once per environment, each with its own endpoints and
criteria from its own runs only.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron_m2po.experiment.analysis import CollapseRule, pooled_base_reward, summarize_arm
from megatron_m2po.experiment.paired import Paired, late_window, paired, reward_by_generating_version

__all__ = ["KS", "SEEDS", "METHODS", "Ladder", "load", "report", "register"]

KS = (8, 32, 128)
SEEDS = (1234, 1235, 1236)
METHODS = {"grpo_sk": ("grpo", "stale GRPO"), "no_tr_sk": ("no_tr", "no trust region"),
           "m2po_sk": ("m2po", "M2PO")}
ONPOLICY = "grpo_s0"
UPDATES = 1024          # registered length: 256 steps x 4 updates
UPDATES_PER_STEP = 4
P2_WINDOW = 384         # P2 (a): updates k .. k + 384
ACC_KEY = "eval/synthetic/acc"


@dataclass
class Run:
    records: list[dict]
    k: int
    late: Optional[float] = None
    best: Optional[float] = None
    collapsed: Optional[bool] = None
    collapse_why: str = ""
    tr_frac: Optional[float] = None        # clip (GRPO) / mask (M2PO) fraction on stale steps
    reward_by_version: dict[int, float] = field(default_factory=dict)
    env: str = "unknown"                   # the base weights it ran from (module docstring)


@dataclass
class Ladder:
    runs: dict[tuple[str, int], dict[int, Run]]   # (arm, k) -> seed -> run; on-policy is (ONPOLICY, 0)
    drift: dict[int, dict[int, float]]            # k -> seed -> D(k)
    missing: list[str]
    env: str = "unknown"


def read_records(d: Path) -> Optional[list[dict]]:
    """A run directory's metrics records (``metrics.jsonl.gz`` or ``metrics.jsonl``), None without either."""
    for name in ("metrics.jsonl.gz", "metrics.jsonl"):
        p = d / name
        if p.is_file():
            text = gzip.open(p, "rt").read() if name.endswith(".gz") else p.read_text()
            return [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    return None


def _cells(root: Path) -> list[tuple[str, int, str]]:
    return [(ONPOLICY, 0, f"onpolicy/{ONPOLICY}")] + [(arm, k, f"k{k}/{arm}") for k in KS for arm in METHODS]


def run_env(root: Path, rel: str) -> Optional[str]:
    """The environment of the finished run at ``root / rel`` (module docstring); None if unfinished."""
    done = root / rel / "experiment_done.json"
    if not done.is_file():
        return None
    try:
        env = (json.loads(done.read_text()).get("environment") or {}).get("base")
    except ValueError:
        env = None
    if env and env != "unknown":
        return env
    legacy = root / "environments.json"
    labels = json.loads(legacy.read_text()).get("runs", {}) if legacy.is_file() else {}
    return labels.get(rel.removeprefix("reruns/"), "unknown")


def environments(root: Path) -> list[str]:
    """Every environment with a finished run under ``root``, the one with the most runs first."""
    count: dict[str, int] = {}
    for _, _, cell in _cells(root):
        for tree in ("", "reruns/"):
            for s in SEEDS:
                env = run_env(root, f"{tree}{cell}/seed_{s}")
                if env is not None:
                    count[env] = count.get(env, 0) + 1
    return sorted(count, key=lambda e: -count[e])


def load(root: Path, env: Optional[str] = None) -> Ladder:
    """Every finished run and drift under ``root`` of environment ``env`` (default: the one with the
    most runs; module docstring), with the endpoints of each run."""
    root = Path(root)
    if env is None:
        found = environments(root)
        env = found[0] if found else "unknown"
    runs: dict[tuple[str, int], dict[int, Run]] = {}
    missing: list[str] = []
    where: dict[tuple[str, int, int], str] = {}
    for arm, k, cell in _cells(root):
        for s in SEEDS:
            rels = [f"{tree}{cell}/seed_{s}" for tree in ("", "reruns/")]
            rel = next((r for r in rels if run_env(root, r) == env), None)
            recs = read_records(root / rel) if rel is not None else None
            if recs is None:
                missing.append(f"{'on-policy' if k == 0 else f'k={k} {arm}'} seed {s}")
                continue
            runs.setdefault((arm, k), {})[s] = Run(recs, k, env=env)
            where[(arm, k, s)] = rel
    drift: dict[int, dict[int, float]] = {}
    for s in SEEDS:
        rel = where.get((ONPOLICY, 0, s))
        p = root / rel / "drift" / "drift.json" if rel else None
        if p is None or not p.is_file():
            missing.append(f"drift of seed {s}")
            continue
        got = json.loads(p.read_text()).get("k", {})
        for k in KS:
            if str(k) in got:
                drift.setdefault(k, {})[s] = float(got[str(k)]["mean_kl"])
    base = pooled_base_reward([(r.records, r.k, UPDATES_PER_STEP) for by in runs.values() for r in by.values()])
    for (arm, k), by in runs.items():
        loss = "grpo" if arm == ONPOLICY else METHODS[arm][0]
        for r in by.values():
            acc = [(int(x["step"]), float(x[ACC_KEY])) for x in r.records
                   if isinstance(x.get(ACC_KEY), (int, float)) and isinstance(x.get("step"), (int, float))]
            r.late = late_window(acc, UPDATES)
            summ = summarize_arm(r.records, arm=arm, label=arm, loss=loss, staleness=k, base_reward=base,
                                 rule=CollapseRule())
            r.best, r.collapsed, r.collapse_why = summ.best_acc, summ.collapsed, summ.collapse_reason
            r.tr_frac = summ.stale_tr_frac
            r.reward_by_version = reward_by_generating_version(r.records, k)
    return Ladder(runs, drift, missing, env)


# ------------------------------------------------------------------------------------------------
# endpoints and criteria
# ------------------------------------------------------------------------------------------------


def _by_seed(lad: Ladder, arm: str, k: int, attr: str) -> dict[int, Optional[float]]:
    return {s: getattr(r, attr) for s, r in lad.runs.get((arm, k), {}).items()}


def primary(lad: Ladder, arm: str, k: int) -> Paired:
    """Late-window held-out accuracy, ``arm`` at ``k`` minus on-policy, paired by seed."""
    return paired(_by_seed(lad, arm, k, "late"), _by_seed(lad, ONPOLICY, 0, "late"))


def lag_corrected(lad: Ladder, arm: str, k: int) -> Paired:
    """Training reward at the same generating versions, ``arm`` minus on-policy: per seed, the mean
    over the generating versions in the last quarter (versions > 768) that both runs have."""
    diffs_a, diffs_b = {}, {}
    ref = lad.runs.get((ONPOLICY, 0), {})
    for s, r in lad.runs.get((arm, k), {}).items():
        if s not in ref:
            continue
        common = [v for v in sorted(set(r.reward_by_version) & set(ref[s].reward_by_version))
                  if v > 0.75 * UPDATES]
        if common:
            diffs_a[s] = sum(r.reward_by_version[v] for v in common) / len(common)
            diffs_b[s] = sum(ref[s].reward_by_version[v] for v in common) / len(common)
    return paired(diffs_a, diffs_b)


def early_reward(r: Run, k: int) -> Optional[float]:
    """Mean training reward over updates ``k .. k + 384``: rollouts generated by versions 0 .. 384
    (P2 (a): no trust region and stale GRPO at one k compare at the same generating versions)."""
    vals = [v for ver, v in r.reward_by_version.items() if 0 <= ver <= P2_WINDOW]
    return sum(vals) / len(vals) if vals else None


def drift_stat(lad: Ladder, k: int) -> tuple[Optional[float], Optional[float], int]:
    """D(k): mean and standard error over the seeds measured, and their number."""
    xs = list(lad.drift.get(k, {}).values())
    if not xs:
        return None, None, 0
    m = sum(xs) / len(xs)
    se = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) / math.sqrt(len(xs)) if len(xs) > 1 else None
    return m, se, len(xs)


@dataclass
class Verdict:
    name: str
    verdict: str        # holds | fails | not testable
    why: str


def _deficit_exceeds(p: Paired) -> Optional[bool]:
    """Whether the paired difference is a deficit of more than 2 SE (None: not testable)."""
    ex = p.exceeds(2.0)
    return None if ex is None else bool(ex and p.mean < 0)


def p1(lad: Ladder) -> tuple[Verdict, dict[int, Optional[bool]]]:
    first = {k: _deficit_exceeds(primary(lad, "grpo_sk", k)) for k in (32, 128)}
    if None in first.values():
        return Verdict("P1", "not testable", "stale GRPO or on-policy lacks two paired seeds at k = 32 or 128"), first
    # the k = 128 deficit is at least the k = 32 one minus 1 SE of their paired difference
    d = paired(_by_seed(lad, "grpo_sk", 32, "late"), _by_seed(lad, "grpo_sk", 128, "late"))
    if d.mean is None or d.se is None:
        return Verdict("P1", "not testable", "k = 32 and k = 128 share fewer than two seeds"), first
    # deficit(k) = on-policy - late(k): deficit(128) - deficit(32) = late(32) - late(128), per seed
    second = d.mean >= -d.se
    ok = all(first.values()) and second
    why = (f"deficit > 2 SE at k=32: {first[32]}, at k=128: {first[128]}; k=128 deficit >= k=32 deficit - 1 SE: "
           f"{second} (paired late(32) - late(128) = {d.format()})")
    return Verdict("P1", "holds" if ok else "fails", why), first


def p2(lad: Ladder) -> Verdict:
    testable, notes = False, []
    for k in KS:
        nt, gr = lad.runs.get(("no_tr_sk", k), {}), lad.runs.get(("grpo_sk", k), {})
        seeds = sorted(set(nt) & set(gr))
        if len(seeds) < 2:
            notes.append(f"k={k}: {len(seeds)} paired seed(s)")
            continue
        testable = True
        both = []
        for s in seeds:
            a, b = early_reward(nt[s], k), early_reward(gr[s], k)
            both.append(a is not None and b is not None and a >= b and bool(nt[s].collapsed))
        notes.append(f"k={k}: prospers and collapses in {sum(both)} of {len(seeds)} seeds")
        if sum(both) >= 2:
            return Verdict("P2", "holds", "; ".join(notes))
    if not testable:
        return Verdict("P2", "not testable", "; ".join(notes))
    return Verdict("P2", "fails", "; ".join(notes))


def p3(lad: Ladder, p1_first: dict[int, Optional[bool]]) -> Verdict:
    parts, testable = [], True
    for k in KS:
        runs = lad.runs.get(("m2po_sk", k), {})
        if len(runs) < len(SEEDS):
            testable = False
            parts.append(f"k={k}: {len(runs)} of {len(SEEDS)} M2PO seeds")
            continue
        collapsed = sum(bool(r.collapsed) for r in runs.values())
        prim = primary(lad, "m2po_sk", k)
        if prim.mean is None:
            testable = False
            parts.append(f"k={k}: no on-policy run pairs with M2PO's ({prim.n} paired seeds)")
            continue
        ok = collapsed == 0 and prim.mean >= -0.02
        if p1_first.get(k):
            vs = paired(_by_seed(lad, "m2po_sk", k, "late"), _by_seed(lad, "grpo_sk", k, "late"))
            ok = ok and vs.mean is not None and vs.mean > 0 and bool(vs.exceeds(2.0))
        mask = [r.tr_frac for r in runs.values() if r.tr_frac is not None]
        clip = [r.tr_frac for r in lad.runs.get(("grpo_sk", k), {}).values() if r.tr_frac is not None]
        if mask and clip:
            ok = ok and sum(mask) / len(mask) <= 0.1 * sum(clip) / len(clip)
        else:
            testable = False
        parts.append(f"k={k}: {'ok' if ok else 'fails'} (collapsed {collapsed}/3, vs on-policy {prim.format()})")
        if not ok and testable:
            return Verdict("P3", "fails", "; ".join(parts))
    return Verdict("P3", "holds" if testable else "not testable", "; ".join(parts))


def breaks_at(lad: Ladder, arm: str) -> str:
    """The smallest measured D(k) at which ``arm``'s paired deficit exceeds 2 SE or it collapses in
    at least 2 of 3 seeds."""
    for k in sorted(KS, key=lambda k: drift_stat(lad, k)[0] if drift_stat(lad, k)[0] is not None else math.inf):
        runs = lad.runs.get((arm, k), {})
        deficit = _deficit_exceeds(primary(lad, arm, k))
        if deficit or sum(bool(r.collapsed) for r in runs.values()) >= 2:
            d = drift_stat(lad, k)[0]
            return f"breaks at k={k}" + (f" (D = {d:.2e})" if d is not None else "")
        if deficit is None or drift_stat(lad, k)[0] is None:
            return f"not testable from k={k} on (its runs or its drift are not all in)"
    return "does not break up to D(128)"


# ------------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------------


def _f(v: Optional[float], digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def report(lad: Ladder) -> str:
    out = [f"# The drift ladder: report, environment {lad.env}", "",
           "Computed by `m2po experiment ladder-report` from the harvested runs, as registered "
           "(PREREGISTRATION.md, with Amendment 1: only runs of this environment, i.e. of one base model's "
           "weights). Every cell is shown; n/a is a cell without its data.", ""]
    if lad.missing:
        out += [f"**Not finished yet ({len(lad.missing)}):** " + ", ".join(lad.missing) + ".", ""]
    out += ["## Drift D(k) (on-policy checkpoints; mean KL(pi_{v-k} || pi_v) per token)", "",
            "| k | D(k) mean | SE | seeds |", "| ---: | ---: | ---: | ---: |"]
    for k in KS:
        m, se, n = drift_stat(lad, k)
        out.append(f"| {k} | {_f(m, 6) if m is None else f'{m:.3e}'} | {'n/a' if se is None else f'{se:.1e}'} | {n} |")
    on = lad.runs.get((ONPOLICY, 0), {})
    out += ["", "## On-policy GRPO (the reference)", "", "| seed | late acc | best acc | collapsed |",
            "| ---: | ---: | ---: | --- |"]
    for s in SEEDS:
        r = on.get(s)
        out.append(f"| {s} | {_f(r and r.late)} | {_f(r and r.best)} | "
                   f"{'n/a' if r is None or r.collapsed is None else r.collapsed} |")
    for k in KS:
        out += ["", f"## k = {k}", "",
                "| arm | late acc per seed | paired vs on-policy (late acc) | lag-corrected reward vs on-policy "
                "| best acc per seed | collapsed | clip / mask frac (stale steps) |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        for arm, (_, label) in METHODS.items():
            by = lad.runs.get((arm, k), {})
            late = " / ".join(_f(by[s].late) if s in by else "n/a" for s in SEEDS)
            best = " / ".join(_f(by[s].best) if s in by else "n/a" for s in SEEDS)
            col = f"{sum(bool(r.collapsed) for r in by.values())} of {len(by)}"
            fr = [r.tr_frac for r in by.values() if r.tr_frac is not None]
            frac = f"{100 * sum(fr) / len(fr):.3f} %" if fr else "n/a"
            out.append(f"| {label} | {late} | {primary(lad, arm, k).format()} | {lag_corrected(lad, arm, k).format()} "
                       f"| {best} | {col} | {frac} |")
    v1, first = p1(lad)
    verdicts = [v1, p2(lad), p3(lad, first)]
    out += ["", "## Criteria", "", "| criterion | verdict | why |", "| --- | --- | --- |"]
    out += [f"| {v.name} | **{v.verdict}** | {v.why} |" for v in verdicts]
    out += ["", "## Where each method breaks", ""]
    out += [f"- {label}: {breaks_at(lad, arm)}" for arm, (_, label) in METHODS.items()]
    return "\n".join(out) + "\n"


def figure(lad: Ladder, path: Path) -> bool:
    """Measured drift (log x) against the paired late-accuracy difference to on-policy (y), one line
    per method; False when no k has both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for arm, (_, label) in METHODS.items():
        pts = []
        for k in KS:
            d, p = drift_stat(lad, k)[0], primary(lad, arm, k)
            if d is not None and d > 0 and p.mean is not None:
                pts.append((d, p.mean, p.se or 0.0, k))
        if pts:
            drawn = True
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[2 * p[2] for p in pts], marker="o",
                        capsize=3, label=label)
            for p in pts:
                ax.annotate(f"k={p[3]}", (p[0], p[1]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axhline(0.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("measured drift D(k) (KL per token, on-policy checkpoints)")
    ax.set_ylabel("late held-out acc - on-policy (paired, ±2 SE)")
    if drawn:
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def register(esub: argparse._SubParsersAction) -> None:
    r = esub.add_parser("ladder-report", help="The drift ladder's registered report from its harvested runs.",
                        description=__doc__.split("\n\n")[0])
    r.add_argument("results", help="the harvested results (docs/measurements/drift_ladder/results)")
    r.add_argument("--out", default=None, help="write the report here (markdown; default: print it)")
    r.add_argument("--figure", default=None, help="also draw the drift figure (PNG) here")
    r.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    root = Path(args.results)
    if not root.is_dir():
        print(f"m2po experiment ladder-report: {root} is not a directory (run_ladder.sh's HARVEST)")
        return 2
    envs = environments(root) or ["unknown"]
    ladders = [load(root, env) for env in envs]
    lad = ladders[0]
    text = "\n".join(report(x) for x in ladders)
    if args.out:
        Path(args.out).write_text(text)
        print(f"report written to {args.out}")
    else:
        print(text, end="")
    if args.figure:
        drawn = figure(lad, Path(args.figure))
        print(f"figure written to {args.figure}" + ("" if drawn else " (empty: no k has drift and paired data yet)"))
    return 0
