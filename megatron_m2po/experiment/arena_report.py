"""The arena's report, ``<out>/arena.md``, from what the runner's report wrote (``summary.json``: the
per-seed rows and their aggregates; ``figures/*.png``), the time ledger (``experiment_time.json``)
and the calibration (``calibration/calibration.json``), so that ``--report-only`` rebuilds it.

Sections: the table (best / final held-out accuracy, final reward, clip / mask fraction: mean ±
std over seeds and the standard error of the mean); the differences against the two references
(on-policy GRPO, M2PO at k) with their standard errors; no trust region per seed (prosperity
before collapse); the learning rate and its calibration; the compute (wall and CPU time of every
invocation, and per run); the figures.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from megatron_m2po.experiment.analysis import SPREAD_Z, SeedStat, diff_se, mean_se
from megatron_m2po.experiment.paired import paired
from megatron_m2po.experiment.figures import FIGURES
from megatron_m2po.experiment.timing import TIME_FILE, TimeLedger, fmt_duration

_BY_STEM = {f[0]: f for f in FIGURES}
ARENA_FIGURES: list[tuple[str, str, str]] = [
    _BY_STEM["heldout_acc"], _BY_STEM["reward"],
    ("trust_region", "Masked / clipped / truncated token fraction (each arm's own rule; analysis.TR_KEY)", "@tr"),
    _BY_STEM["kl"], _BY_STEM["m2"],
    ("vcpo_lr_scale", "VCPO step-size factor on the scheduled lr (vcpo/lr_scale)", "vcpo/lr_scale"),
    _BY_STEM["staleness"],
]
REFERENCES = ("grpo_s0", "m2po_sk")
# (aggregate column, title, percent)
COLUMNS = [("best_acc", "best held-out acc", False), ("final_acc", "final held-out acc", False),
           ("final_reward", "final reward", False), ("stale_tr_frac", "clip / mask on stale steps", True),
           ("mean_tr_frac", "clip / mask, all steps", True)]
DIFF_COLUMNS = COLUMNS[:3]


def _stat(d: Optional[dict]) -> SeedStat:
    d = d or {}
    return SeedStat(d.get("mean"), d.get("std"), int(d.get("n", 0)), list(d.get("values", [])))


def _num(v: float, pct: bool) -> str:
    return f"{100 * v:.2f}%" if pct else f"{v:.3f}"


def _cell(s: SeedStat, pct: bool) -> str:
    if s.mean is None:
        return "—"
    se = mean_se(s)
    return _num(s.mean, pct) + (f" ± {_num(s.std, pct)} ({_num(se, pct)})" if se is not None else "")


def _diff(a: dict, b: dict, col: str) -> str:
    """``a - b`` in column ``col``, paired by seed (summaries written since the drift ladder carry
    ``per_seed``); Welch's unpaired error for older summaries, and said so."""
    sa, sb = _stat(a["stats"].get(col)), _stat(b["stats"].get(col))
    if sa.mean is None or sb.mean is None:
        return "—"
    if "per_seed" in a and "per_seed" in b:
        p = paired({int(k): v for k, v in a["per_seed"].get(col, {}).items()},
                   {int(k): v for k, v in b["per_seed"].get(col, {}).items()})
        d, se, how = p.mean, p.se, ""
        if d is None:
            return "—"
    else:
        d, se, how = sa.mean - sb.mean, diff_se(sa, sb), " unpaired"
    if se is None:
        return f"{d:+.3f}"
    z = abs(d) / se if se > 0 else (0.0 if d == 0 else float("inf"))  # seeds that agree exactly
    text = f"{d:+.3f} ± {se:.3f} ({z:.1f}×{how})"
    return f"**{text}**" if z > SPREAD_Z else text


def results_table(aggs: list[dict]) -> list[str]:
    lines = ["| arm | k | seeds | " + " | ".join(t for _, t, _ in COLUMNS) + " | collapsed |",
             "|" + "---|" * (len(COLUMNS) + 4)]
    for a in aggs:
        cells = [_cell(_stat(a["stats"].get(attr)), pct) for attr, _, pct in COLUMNS]
        lines.append(f"| {a['label']} | {a['staleness']} | {len(a['seeds'])} | " + " | ".join(cells)
                     + f" | {a['collapsed']}/{a['judged']} |")
    lines += ["", "Cells: mean ± sample standard deviation over seeds (standard error of the mean, std / √n). "
              "Clip / mask: each arm's own rule (GRPO clips, M2PO / IcePop / MIS / AReaL M2PO mask, VCPO "
              "truncates its sequence weight); \"on stale steps\": the steps whose tokens are all >= k updates old."]
    return lines


def differences(aggs: list[dict]) -> list[str]:
    lines: list[str] = []
    by = {a["arm"]: a for a in aggs}
    for ref in (r for r in REFERENCES if r in by):
        lines += ["", f"Against **{by[ref]['label']}** (arm − reference, paired by seed: mean of the per-seed "
                  f"differences ± their standard error sd / √n, and how many of them; bold: more than {SPREAD_Z:g}):",
                  "",
                  "| arm | " + " | ".join(t for _, t, _ in DIFF_COLUMNS) + " |", "|" + "---|" * (len(DIFF_COLUMNS) + 1)]
        for a in aggs:
            if a["arm"] != ref:
                lines.append(f"| {a['label']} | " + " | ".join(
                    _diff(a, by[ref], c) for c, _, _ in DIFF_COLUMNS) + " |")
    return lines


def no_trust_region(rows: list[dict]) -> list[str]:
    lines = []
    for r in (r for r in rows if r["loss"] == "no_tr"):
        seed = r.get("extra", {}).get("seed")
        acc = "—" if r.get("best_acc") is None else f"{r['best_acc']:.3f} at update {r['best_acc_update']}, " \
            f"final {r['final_acc']:.3f}"
        rew = "—" if r.get("best_reward") is None else f"best {r['best_reward']:.3f}, final {r['final_reward']:.3f}"
        verdict = {True: "collapsed (" + r.get("collapse_reason", "") + ")", False: "no collapse",
                   None: "not judged"}[r.get("collapsed")]
        lines.append(f"- seed {seed}: held-out acc best {acc}; reward {rew}; {verdict}")
    return lines


def learning_rate(spec: dict, aggs: list[dict], out_dir: Path) -> list[str]:
    how = "`--lr`" if spec.get("lr_override") is not None else "`optim.lr` of the config and its overrides"
    lines = [f"lr {spec['lr']:g} ({how}) for every arm."]
    stale_grpo = next((a for a in aggs if a["loss"] == "grpo" and a["staleness"] > 0), None)
    s = _stat(stale_grpo["stats"].get("stale_tr_frac")) if stale_grpo else SeedStat(None, None, 0)
    if s.mean is not None:
        lines.append(f"Stale GRPO clipped {_cell(s, True)} of the tokens on stale steps (the paper: ~1.2 % at "
                     "k = 256).")
    cal = out_dir / "calibration" / "calibration.json"
    if cal.is_file():
        from megatron_m2po.experiment.arena_calibration import format_calibration

        lines += ["", format_calibration(json.loads(cal.read_text()))]
    else:
        lines.append("No calibration in this directory (`--calibrate-lr`, docs/staleness_experiment.md, Arena).")
    return lines


def compute(out_dir: Path, rows: list[dict]) -> list[str]:
    from megatron_m2po.experiment.arena_calibration import CALIBRATION_DIR
    from megatron_m2po.experiment.cost import PROBE_DIR

    parts = [("arena runs", out_dir), ("cost probe", out_dir / PROBE_DIR),
             ("lr calibration", out_dir / CALIBRATION_DIR)]
    totals = [(name, TimeLedger.totals(d / TIME_FILE)) for name, d in parts]
    totals = [(name, t) for name, t in totals if t["invocations"] or name == "arena runs"]
    lines = ["| part | wall | CPU | invocations (killed before the end) |", "|---|---|---|---|"]
    for name, t in totals:
        lines.append(f"| {name} | {fmt_duration(t['wall_s'])} | {fmt_duration(t['cpu_s'])} | {t['invocations']} "
                     f"({t['killed']}) |")
    if len(totals) > 1:
        lines.append(f"| **total** | **{fmt_duration(sum(t['wall_s'] for _, t in totals))}** | "
                     f"**{fmt_duration(sum(t['cpu_s'] for _, t in totals))}** | |")
    lines += ["", f"From each part's `{TIME_FILE}`; CPU = user + system of the arena process and of every process "
              "its runs started; a killed invocation counts up to its last record (at most 10 s before it died)."]
    walls = [r["extra"]["wall_s"] for r in rows if isinstance(r.get("extra", {}).get("wall_s"), (int, float))]
    cpus = [r["extra"]["cpu_s"] for r in rows if isinstance(r.get("extra", {}).get("cpu_s"), (int, float))]
    if walls:
        lines.append(f"Per run (its last attempt): wall {fmt_duration(sum(walls) / len(walls))} on average, "
                     f"{fmt_duration(sum(walls))} in all ({len(walls)} runs)"
                     + (f"; CPU {fmt_duration(sum(cpus) / len(cpus))} on average" if cpus else "") + ".")
    return lines


def write_arena_report(out_dir: Path, spec: dict[str, Any], runs: list) -> Path:
    """``<out>/arena.md`` (module docstring); ``runs`` for the unfinished ones."""
    summary = json.loads((out_dir / "summary.json").read_text())
    aggs, rows = summary["aggregate"], summary["arms"]
    unfinished = [r.tag for r in runs if r.status not in ("done", "skipped")]
    lines = [f"# Arena: k = {spec['k']}, {spec['updates']} updates, {len(spec['seeds'])} seed(s) per arm", "",
             f"Config `{spec['config']}` with `{' '.join(spec['overrides'])}`; {spec['num_steps']} steps x "
             f"{spec['updates_per_step']} updates; seeds {spec['seeds']}; base-model reward "
             + (f"{spec['base_reward']:.3f}" if isinstance(spec.get("base_reward"), float) else "—") + "."]
    if unfinished:
        lines += ["", f"**Not finished:** {', '.join(unfinished)} (the table holds what they logged so far)."]
    lines += ["", "## Results", ""] + results_table(aggs) + differences(aggs)
    lines += ["", f"Collapse rule (per seed): {summary['rule']['text']}.", "",
              "All columns and every pair of arms: [summary.md](summary.md)."]
    if any(r["loss"] == "no_tr" for r in rows):
        lines += ["", "## No trust region: prosperity before collapse?", ""] + no_trust_region(rows)
    lines += ["", "## Learning rate", ""] + learning_rate(spec, aggs, out_dir)
    lines += ["", "## Compute", ""] + compute(out_dir, rows)
    lines += ["", "## Figures", "", "Line: mean over seeds; band: min–max over seeds.", ""]
    lines += [f"![{Path(f).stem}]({os.path.relpath(f, out_dir)})" for f in summary.get("figures", [])]
    path = out_dir / "arena.md"
    path.write_text("\n".join(lines) + "\n")
    return path
