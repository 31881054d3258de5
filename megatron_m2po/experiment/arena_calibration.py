"""``m2po experiment arena CONFIG --calibrate-lr LRS``: the learning rate that puts the tiny task's
drift where the paper's is.

The paper's GRPO clips ~1.2 % of the tokens of data 256 updates old. The tiny model moves much
further per update, so at the config's lr stale GRPO clips several times that and every stale arm
is far from the paper's regime. Here GRPO at staleness k runs once per lr (one seed, no
evaluation) for ``k`` warm-up updates plus ``--calibration-updates`` updates on stale data; its
clip fraction on the steps whose tokens are all >= k updates old (``ArmSummary.stale_tr_frac``)
is compared with ``--target-clip``, and the lr nearest it (in log ratio, :func:`choose_lr`) is
named. The result goes to ``<out>/calibration/calibration.{md,json}``; the arena report quotes it.
Resumable like every experiment (finished lrs are skipped).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_m2po.experiment.runner import ArmRun, Variant, plan_runs

CALIBRATION_DIR = "calibration"


def plan_calibration(config: str, base_overrides: Sequence[str], *, k: int, lrs: Sequence[float],
                     stale_updates: int, out: Path, target: float) -> tuple[list[ArmRun], dict[str, Any]]:
    """GRPO s=k at each lr of ``lrs`` for ``k + stale_updates`` updates (rounded up to whole steps)."""
    from megatron_m2po.config import load_config
    from megatron_m2po.utils.settings import ConfigError

    if not lrs or any(lr <= 0 for lr in lrs) or len(set(lrs)) != len(lrs):
        raise ConfigError(f"--calibrate-lr={','.join(f'{x:g}' for x in lrs)}: give distinct learning rates > 0, "
                          "e.g. 5e-6,1e-5,2e-5")
    if stale_updates < 1:
        raise ConfigError(f"--calibration-updates={stale_updates}: the clip fraction needs at least one stale update")
    if not 0 < target < 1:
        raise ConfigError(f"--target-clip={target}: a fraction in (0, 1), e.g. 0.012 (the paper's 1.2 %)")
    U = load_config(config, list(base_overrides)).trainer.num_updates_per_step
    steps = -(-(k + stale_updates) // U) + 1  # + 1: the step that starts at update k trains on base rollouts
    variants = [Variant(name=f"grpo_sk_lr{lr:g}", label=f"GRPO s={k} lr={lr:g}", loss="grpo", k=k,
                        overrides=(f"optim.lr={lr!r}",)) for lr in sorted(lrs)]
    return plan_runs(config, list(base_overrides) + [f"trainer.num_steps={steps}", "trainer.eval_every_steps=0"],
                     variants, str(Path(out) / CALIBRATION_DIR), 1,
                     spec={"experiment": "arena-calibration", "k": k, "lrs": sorted(lrs), "target_clip": target,
                           "stale_updates": stale_updates})


def choose_lr(points: Sequence[tuple[float, Optional[float]]], target: float) -> Optional[float]:
    """The lr whose clip fraction is nearest ``target`` in ``|log(clip / target)|`` (a fraction twice
    the target is as far as half of it); points without a positive clip fraction are left out."""
    measured = [(lr, c) for lr, c in points if c is not None and c > 0]
    if not measured:
        return None
    return min(measured, key=lambda p: (abs(math.log(p[1] / target)), p[0]))[0]


def calibration_result(runs: Sequence[ArmRun], spec: dict[str, Any]) -> dict[str, Any]:
    """Per lr: GRPO s=k's clip fraction on stale steps and its mean KL k3; and the chosen lr."""
    from megatron_m2po.experiment.analysis import summarize_arm
    from megatron_m2po.utils.logging import read_metrics

    rows = []
    for lr, r in zip(spec["lrs"], runs):
        path = r.run_dir / "metrics.jsonl"
        s = summarize_arm(read_metrics(path), arm=r.arm.name, label=r.arm.label, loss="grpo", staleness=r.arm.k) \
            if path.is_file() else None
        rows.append({"lr": lr, "stale_clip_frac": s.stale_tr_frac if s else None,
                     "mean_kl_k3": s.mean_kl_k3 if s else None, "updates": s.updates if s else 0,
                     "finished": r.status in ("done", "skipped")})
    chosen = choose_lr([(row["lr"], row["stale_clip_frac"]) for row in rows], spec["target_clip"])
    return {"k": spec["k"], "target_clip": spec["target_clip"], "stale_updates": spec["stale_updates"],
            "rows": rows, "chosen_lr": chosen}


def format_calibration(res: dict[str, Any]) -> str:
    lines = [f"Learning-rate calibration: GRPO s={res['k']}, {res['stale_updates']} updates on stale data per lr, "
             f"target clip fraction on stale steps {100 * res['target_clip']:.2f} %", "",
             "| lr | GRPO s=k: clip on stale steps | mean KL k3 | updates | finished |", "|---|---|---|---|---|"]
    for row in res["rows"]:
        clip = "—" if row["stale_clip_frac"] is None else f"{100 * row['stale_clip_frac']:.2f} %"
        kl = "—" if row["mean_kl_k3"] is None else f"{row['mean_kl_k3']:.2g}"
        mark = "**" if row["lr"] == res["chosen_lr"] else ""
        lines.append(f"| {mark}{row['lr']:g}{mark} | {clip} | {kl} | {row['updates']} | "
                     f"{'yes' if row['finished'] else 'no'} |")
    lines.append("")
    lines.append(f"Nearest the target: lr {res['chosen_lr']:g}." if res["chosen_lr"] is not None else
                 "No lr measured a clip fraction on stale steps (too few updates past k?).")
    return "\n".join(lines)


def run_calibration(args: argparse.Namespace, arena_spec: dict[str, Any], parallel: int) -> int:
    """The ``--calibrate-lr`` command: plan, estimate, run, write ``calibration.{md,json}``."""
    from megatron_m2po.experiment.cost import estimate, format_estimate, measure_dirs
    from megatron_m2po.experiment.runner import usable_cores, execute, mark_finished, skip_finished

    out = Path(arena_spec["out"])
    base = [o for o in arena_spec["overrides"] if not o.startswith("trainer.num_steps=")]
    runs, spec = plan_calibration(args.config, base, k=arena_spec["k"], lrs=args.calibrate_lr,
                                  stale_updates=args.calibration_updates, out=out, target=args.target_clip)
    if args.report_only:
        mark_finished(runs)
    else:
        skip_finished(runs, progress=not args.no_progress)
        cal_dir = Path(spec["out"])
        costs = measure_dirs([cal_dir] + [Path(d) for d in args.cost_from])
        print(format_estimate(estimate(runs, costs, parallel=parallel, cores=usable_cores(),
                                       updates_per_step=spec["updates_per_step"],
                                       source=f"{cal_dir} / --cost-from"),
                              hint="pass --cost-from DIR with earlier runs on this machine"), flush=True)
        if args.dry_run or args.estimate_only:
            return 0
        execute(runs, spec, parallel=parallel, progress=not args.no_progress)
    res = calibration_result(runs, spec)
    cal_dir = Path(spec["out"])
    cal_dir.mkdir(parents=True, exist_ok=True)
    (cal_dir / "calibration.json").write_text(json.dumps(res, indent=2) + "\n")
    text = format_calibration(res)
    (cal_dir / "calibration.md").write_text(text + "\n")
    print(text)
    if res["chosen_lr"] is not None:
        print(f"\nnext: the same command without --calibrate-lr, with --lr {res['chosen_lr']:g} (runs the arena in {out})")
    return 0 if all(r.status in ("done", "skipped") for r in runs) or args.report_only else 1
