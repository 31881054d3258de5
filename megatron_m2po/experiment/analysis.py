"""Pure analysis of experiment runs: one arm's table row, the collapse rule, the pooled base-model
reward, and the aggregation over seeds (mean ± std, which differences exceed the seed spread)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

# Trust-region statistic per loss: the fraction of tokens the loss clips / masks / truncates
# (the metric names of algo/losses.py and algo/offpolicy_losses.py), and what it is called.
TR_KEY = {"grpo": "loss/clip_frac", "gspo": "loss/clip_frac", "cispo": "loss/clip_frac", "m2po": "m2po/mask_frac",
          "icepop": "icepop/mask_frac", "mis": "mis/mask_frac", "areal_m2po": "areal_m2po/mask_frac",
          "vcpo": "vcpo/is_trunc_frac"}
TR_KIND = {"grpo": "clip", "gspo": "clip", "cispo": "clip", "vcpo": "trunc"}  # the others mask


def tr_kind(loss: str) -> str:
    """What ``loss`` does to the tokens its :data:`TR_KEY` counts: ``clip``, ``mask`` or ``trunc``."""
    return TR_KIND.get(loss, "mask")


@dataclass(frozen=True)
class CollapseRule:
    acc_ratio: float = 0.5
    reward_margin: float = 0.05
    tail_frac: float = 0.1

    def describe(self) -> str:
        return (f"collapsed = final held-out accuracy < {self.acc_ratio:g} x best held-out accuracy, or mean "
                f"training reward over the last {self.tail_frac:.0%} of steps < base-model reward "
                f"- {self.reward_margin:g} (base-model reward: mean reward of the steps trained on rollouts of "
                f"the base model)")


@dataclass
class ArmSummary:
    arm: str
    label: str
    loss: str
    staleness: int
    steps: int  # training steps logged
    updates: int  # optimizer updates (x axis)
    best_acc: Optional[float] = None
    best_acc_update: Optional[int] = None
    final_acc: Optional[float] = None
    base_reward: Optional[float] = None
    final_reward: Optional[float] = None
    best_reward: Optional[float] = None  # max of the smoothed (tail-window) reward curve
    tr_key: Optional[str] = None
    mean_tr_frac: Optional[float] = None  # mean clip (grpo) / mask (m2po) fraction; 0 for no_tr
    # the same over the steps whose tokens are all >= staleness updates old (the stale regime)
    stale_tr_frac: Optional[float] = None
    mean_kl_k3: Optional[float] = None
    collapsed: Optional[bool] = None
    collapse_reason: str = ""
    extra: dict = field(default_factory=dict)


def step_records(records: Sequence[dict]) -> list[dict]:
    """The step-level records of a metrics file (per-update records carry only ``update/*``)."""
    return [r for r in records if "train/step" in r and isinstance(r.get("step"), (int, float))]


def metric_values(recs: Sequence[dict], key: str) -> list[tuple[int, float]]:
    out = []
    for r in recs:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append((int(r["step"]), float(v)))
    return out


def _mean(xs: Sequence[float]) -> Optional[float]:
    return float(sum(xs) / len(xs)) if xs else None


def summarize_arm(records: Sequence[dict], *, arm: str, label: str, loss: str, staleness: int,
                  rule: CollapseRule = CollapseRule(), base_reward: Optional[float] = None,
                  acc_key: str = "eval/synthetic/acc", reward_key: str = "rollout/reward_mean") -> ArmSummary:
    """The table row of one arm from its metrics records (``read_metrics`` output).

    ``base_reward``: the base model's training reward (default: this arm's step-0 reward, whose
    rollouts always come from the base model); :func:`pooled_base_reward` is less noisy.
    """
    recs = step_records(records)
    s = ArmSummary(arm=arm, label=label, loss=loss, staleness=staleness, steps=len(recs),
                   updates=int(recs[-1]["step"]) if recs else 0)
    acc = metric_values(recs, acc_key)
    if acc:
        best = max(acc, key=lambda t: t[1])  # first occurrence of the maximum
        s.best_acc, s.best_acc_update = best[1], best[0]
        s.final_acc = acc[-1][1]
    rew = [v for _, v in metric_values(recs, reward_key)]
    if rew:
        n_tail = max(1, int(round(rule.tail_frac * len(rew))))
        s.base_reward = rew[0] if base_reward is None else float(base_reward)
        s.final_reward = _mean(rew[-n_tail:])
        s.best_reward = max(_mean(rew[i:i + n_tail]) for i in range(len(rew) - n_tail + 1))
    if loss in TR_KEY:
        s.tr_key = TR_KEY[loss]
        s.mean_tr_frac = _mean([v for _, v in metric_values(recs, s.tr_key)])
        s.stale_tr_frac = _mean([float(r[s.tr_key]) for r in recs if _is_num(r.get(s.tr_key))
                                 and _is_num(r.get("staleness/min")) and r["staleness/min"] >= staleness])
    elif loss == "no_tr":
        s.mean_tr_frac = s.stale_tr_frac = 0.0  # no trust region: nothing is clipped or masked
    s.mean_kl_k3 = _mean([v for _, v in metric_values(recs, "policy/kl_k3")])
    s.collapsed, s.collapse_reason = collapse_verdict(s, rule)
    return s


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def pooled_base_reward(runs: Sequence[tuple[Sequence[dict], int, int]],
                       reward_key: str = "rollout/reward_mean") -> Optional[float]:
    """Mean training reward over every step, of every arm, that trained on base-model rollouts.

    ``runs``: (records, staleness k, updates per step) per arm. In ``stale_k`` mode the steps that
    start before version ``k`` exists train on rollouts of version 0 (``schedule.generation_version``),
    so a stale arm contributes about ``k / U + 1`` such steps and an on-policy arm its step 0.
    """
    from megatron_m2po.trainer.schedule import generation_version

    vals = []
    for records, k, U in runs:
        for r in step_records(records):
            v = r.get(reward_key)
            if isinstance(v, (int, float)) and generation_version(int(r["train/step"]), U, k) == 0:
                vals.append(float(v))
    return _mean(vals)


def collapse_verdict(s: ArmSummary, rule: CollapseRule = CollapseRule()) -> tuple[Optional[bool], str]:
    """(collapsed, why) under ``rule``; ``None`` when the arm has no data to judge."""
    reasons = []
    judged = False
    if s.best_acc is not None and s.final_acc is not None:
        judged = True
        if s.final_acc < rule.acc_ratio * s.best_acc:
            reasons.append(f"final held-out acc {s.final_acc:.3f} < {rule.acc_ratio:g} x best {s.best_acc:.3f}")
    if s.base_reward is not None and s.final_reward is not None:
        judged = True
        if s.final_reward < s.base_reward - rule.reward_margin:
            reasons.append(f"final reward {s.final_reward:.3f} < base {s.base_reward:.3f} - {rule.reward_margin:g}")
    if not judged:
        return None, "no data"
    return bool(reasons), "; ".join(reasons)


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if pct:  # two decimals below 1 % (the paper's mask fractions are ~0.06 %)
        return f"{100 * v:.2f}%" if 0 < abs(v) < 0.01 else f"{100 * v:.1f}%"
    return f"{v:.3f}"


def _kl(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:.2g}"


def format_table(rows: Sequence[ArmSummary], rule: CollapseRule = CollapseRule()) -> str:
    """The paper-style table as markdown."""
    head = ("| arm | staleness | updates | best held-out acc (update) | final held-out acc | base reward | "
            "final reward | mean clip / mask frac | on stale steps | mean KL k3 | collapsed |")
    lines = [head, "|" + "---|" * 11]
    for s in rows:
        best = _fmt(s.best_acc) + (f" ({s.best_acc_update})" if s.best_acc_update is not None else "")
        tr = _fmt(s.mean_tr_frac, pct=True)
        if s.loss == "no_tr":
            tr += " (none)"
        elif s.tr_key:
            tr += " " + tr_kind(s.loss)
        lines.append(f"| {s.label} | {s.staleness} | {s.updates} | {best} | {_fmt(s.final_acc)} | "
                     f"{_fmt(s.base_reward)} | {_fmt(s.final_reward)} | {tr} | {_fmt(s.stale_tr_frac, pct=True)} | "
                     f"{_kl(s.mean_kl_k3)} | {_fmt(s.collapsed)} |")
    lines.append("")
    lines.append("\"on stale steps\": mean clip / mask fraction over the steps whose tokens are all at least "
                 "the arm's staleness old; \"mean KL k3\": KL(behaviour || current) of the trained tokens, mean over "
                 "steps (for an on-policy arm: the policy's drift within a step).")
    lines.append(f"Rule: {rule.describe()}.")
    return "\n".join(lines)



# --------------------------------------------------------------------------------------------
# Several seeds per arm

# The table row's numbers aggregated over seeds: (ArmSummary attribute, column title, percent).
SEED_COLUMNS: list[tuple[str, str, bool]] = [
    ("best_acc", "best held-out acc", False),
    ("final_acc", "final held-out acc", False),
    ("final_reward", "final reward", False),
    ("best_reward", "best reward", False),
    ("mean_tr_frac", "mean clip / mask frac", True),
    ("stale_tr_frac", "clip / mask frac on stale steps", True),
    ("mean_kl_k3", "mean KL k3", False),
]

# A difference between two arms' means "exceeds the seed spread" when it is larger than
# SPREAD_Z standard errors of the difference (see :func:`exceeds_spread`).
SPREAD_Z = 2.0


@dataclass
class SeedStat:
    """Mean, sample standard deviation (n - 1) and count of one number over seeds."""

    mean: Optional[float]
    std: Optional[float]
    n: int
    values: list[float] = field(default_factory=list)


def seed_stat(values: Sequence[Optional[float]]) -> SeedStat:
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return SeedStat(None, None, 0, [])
    m = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else None
    return SeedStat(m, sd, len(vals), vals)


def exceeds_spread(a: SeedStat, b: SeedStat, z: float = SPREAD_Z) -> Optional[bool]:
    """Whether ``|mean_a - mean_b| > z * sqrt(std_a^2 / n_a + std_b^2 / n_b)`` (Welch's standard
    error of the difference of means, ``z`` = 2: about a 95 % two-sided test for normal noise).

    ``None`` when either arm has fewer than two seeds (no spread to compare with). Two arms whose
    seeds all agree exactly (std 0) differ as soon as their means differ.
    """
    se = diff_se(a, b)
    return None if se is None else abs(a.mean - b.mean) > z * se


def diff_se(a: SeedStat, b: SeedStat) -> Optional[float]:
    """Welch's standard error of ``mean_a - mean_b``, ``sqrt(std_a^2 / n_a + std_b^2 / n_b)``;
    ``None`` when either has fewer than two seeds."""
    if a.n < 2 or b.n < 2 or a.mean is None or b.mean is None or a.std is None or b.std is None:
        return None
    return math.sqrt(a.std ** 2 / a.n + b.std ** 2 / b.n)


def mean_se(s: SeedStat) -> Optional[float]:
    """Standard error of the mean over seeds, ``std / sqrt(n)``; ``None`` with fewer than two seeds."""
    return None if s.std is None or s.n < 2 else s.std / math.sqrt(s.n)


@dataclass
class ArmAggregate:
    """One arm over its seeds: the per-seed rows and each column's :class:`SeedStat`."""

    arm: str
    label: str
    loss: str
    staleness: int
    seeds: list[int]
    rows: list[ArmSummary]
    stats: dict[str, SeedStat]
    collapsed: int  # seeds that collapsed
    judged: int     # seeds with a collapse verdict


def aggregate_seeds(rows: Sequence[ArmSummary], seeds: Sequence[int]) -> ArmAggregate:
    """The per-seed summaries of one arm (same arm, different seeds) aggregated."""
    first = rows[0]
    stats = {attr: seed_stat([getattr(r, attr) for r in rows]) for attr, _, _ in SEED_COLUMNS}
    return ArmAggregate(arm=first.arm, label=first.label, loss=first.loss, staleness=first.staleness,
                        seeds=list(seeds), rows=list(rows), stats=stats,
                        collapsed=sum(1 for r in rows if r.collapsed), judged=sum(1 for r in rows if r.collapsed is not None))


def _pm(s: SeedStat, pct: bool) -> str:
    if s.mean is None:
        return "—"
    f = (lambda v: f"{100 * v:.2f}%") if pct else (lambda v: f"{v:.3f}")
    return f(s.mean) + (f" ± {f(s.std)}" if s.std is not None else "")


def format_seed_table(aggs: Sequence[ArmAggregate], rule: CollapseRule = CollapseRule(),
                      z: float = SPREAD_Z) -> str:
    """Markdown: mean ± std per arm over its seeds, then every pair of arms whose difference in a
    column exceeds the seed-to-seed spread (rule stated under the table)."""
    head = "| arm | staleness | seeds | " + " | ".join(t for _, t, _ in SEED_COLUMNS) + " | collapsed |"
    lines = [head, "|" + "---|" * (len(SEED_COLUMNS) + 4)]
    for a in aggs:
        cells = [_pm(a.stats[attr], pct) for attr, _, pct in SEED_COLUMNS]
        lines.append(f"| {a.label} | {a.staleness} | {len(a.seeds)} | " + " | ".join(cells)
                     + f" | {a.collapsed}/{a.judged} |")
    if len({tuple(a.seeds) for a in aggs}) == 1:
        over = _seed_range(aggs[0].seeds) + " for every arm"
    else:
        over = ", ".join(f"{a.label}: {_seed_range(a.seeds)}" for a in aggs)
    lines += ["", f"Mean ± sample standard deviation (n - 1) over {over}."]
    diffs = seed_differences(aggs, z)
    lines += ["", f"Differences paired by seed (the arms of a seed share its prompts and sampling seeds) that "
              f"exceed {z:g} standard errors: |mean(d)| > {z:g} x sd(d) / sqrt(n), d = a - b per seed:"]
    if diffs is None:
        lines.append("- not judged: the arms need at least two seeds in common (`--seeds 2` or more)")
    elif not diffs:
        lines.append("- none: no paired difference between arms in these columns exceeds it")
    for col, la, lb, d, se in diffs or []:
        lines.append(f"- {col}: {la} − {lb} = {d:+.4f} (standard error {se:.4f}, {abs(d) / se if se else math.inf:.1f}×)")
    lines += ["", f"Collapse rule (per seed; the column counts collapsed seeds): {rule.describe()}."]
    return "\n".join(lines)


def per_seed(agg: ArmAggregate, attr: str) -> dict[int, Optional[float]]:
    """``{seed: value}`` of one column of an arm (its rows are in the order of its seeds)."""
    return {seed: getattr(row, attr) for seed, row in zip(agg.seeds, agg.rows)}


def seed_differences(aggs: Sequence[ArmAggregate], z: float = SPREAD_Z
                     ) -> Optional[list[tuple[str, str, str, float, float]]]:
    """(column, arm a, arm b, mean of a - b, its standard error) of every pair of arms and column whose
    difference, **paired by seed** (arms of one seed share prompts and sampling seeds:
    :mod:`~megatron_m2po.experiment.paired`), exceeds ``z`` standard errors; ``None`` when no pair
    could be judged (fewer than two shared seeds)."""
    from megatron_m2po.experiment.paired import paired

    out, judged = [], False
    for attr, title, _ in SEED_COLUMNS:
        for i, a in enumerate(aggs):
            for b in aggs[i + 1:]:
                p = paired(per_seed(a, attr), per_seed(b, attr))
                verdict = p.exceeds(z)
                if verdict is None:
                    continue
                judged = True
                if verdict:
                    out.append((title, a.label, b.label, p.mean, p.se))
    return out if judged else None


def _seed_range(seeds: Sequence[int]) -> str:
    s = sorted(seeds)
    if len(s) > 2 and s == list(range(s[0], s[-1] + 1)):
        return f"seeds {s[0]}–{s[-1]}"
    return "seed" + ("s " if len(s) > 1 else " ") + ", ".join(map(str, s))
