"""``m2po experiment arena CONFIG``: M2PO against the off-policy methods at one large staleness.

The staleness experiment's machinery (:mod:`.runner`: one ``m2po train`` subprocess per arm and
seed, ``--parallel``, resume, figures, seed tables) with more arms, at the paper's staleness:

* ``grpo_s0``: on-policy GRPO (k = 0), the reference;
* at staleness ``k`` (default 256 optimizer updates): ``grpo_sk``, ``no_tr_sk``, ``m2po_sk`` and
  one arm per off-policy loss registered by ``algo/offpolicy_losses.py`` (:func:`arena_variants`;
  ``mis`` twice, at sequence and token level), and ``m2po_distill_sk``: M2PO at ``k`` with on-policy
  distillation from ``--teacher`` (algo.distill; the tiny task's teacher by default);
* every arm ``--updates`` optimizer updates long (default 1,024), at ``--seeds`` seeds (default 3).

Before anything runs the compute is estimated (:mod:`.cost`) and printed: from the arena's own
runs when it resumes, else from a probe of ``--probe-steps`` steps of its first arms, else from
``--cost-from`` directories; ``--dry-run`` prints the plan and the estimate from what is measured
already, and runs nothing. A bar follows all runs (steps, ETA) and each running one. A killed
arena (Ctrl-C, SIGTERM or SIGKILL: its runs die with it) is continued by the same command:
finished runs are skipped, the others resume from their last checkpoint. Then
:mod:`.arena_report` writes ``<out>/arena.md`` and the figures.

Learning rate (``--lr``): the tiny model drifts far more per update than an LLM, so at the
config's lr stale GRPO clips several times the paper's ~1.2 %. ``--calibrate-lr 1e-5,2e-5,...``
runs GRPO s=k at each lr for ``k + --calibration-updates`` updates, measures its clip fraction on
stale steps and names the lr nearest ``--target-clip`` (:mod:`.arena_calibration`); the arena
then runs with ``--lr`` that value (docs/staleness_experiment.md, "Arena").
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_m2po.experiment.commands import ARMS, FAST_K, FAST_OVERRIDES, add_common_args, csv_of
from megatron_m2po.experiment.runner import ArmRun, Variant, plan_runs

ARENA_K = 256
ARENA_UPDATES = 1024
ARENA_SEEDS = 3
FAST_UPDATES = 4 * FAST_K

CORE_ARMS = ("grpo_s0", "grpo_sk", "no_tr_sk", "m2po_sk")
TITLES = {"icepop": "IcePop", "mis": "MIS", "areal_m2po": "AReaL M2PO", "vcpo": "VCPO"}
# Losses whose settings differ enough to be arms of their own: (name suffix, title, overrides).
SETTING_ARMS: dict[str, list[tuple[str, str, tuple[str, ...]]]] = {
    "mis": [("", "MIS seq", ("algo.mis.level=sequence",)), ("_tok", "MIS token", ("algo.mis.level=token",))],
}
COLORS = ["tab:purple", "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan"]


def offpolicy_losses() -> list[str]:
    """The losses ``algo/offpolicy_losses.py`` registers, in registration order."""
    from megatron_m2po.algo import offpolicy_losses as module
    from megatron_m2po.algo.registry import LOSSES

    return [name for name, spec in LOSSES.items() if spec.objective.__module__ == module.__name__]


def arena_variants(k: int, teacher: str = "tiny-teacher") -> list[Variant]:
    """Every arm of the arena at staleness ``k`` (module docstring), in run order; the distillation
    arm (M2PO at k plus on-policy distillation) learns from ``teacher`` (an HF directory with the
    student's tokenizer; the tiny task's own teacher by default)."""
    out = [ARMS[a].variant(k) for a in CORE_ARMS]
    for loss in offpolicy_losses():
        for suffix, title, overrides in SETTING_ARMS.get(loss, [("", TITLES.get(loss, loss), ())]):
            out.append(Variant(name=f"{loss}{suffix}_sk", label=f"{title} s={k}", loss=loss, k=k,
                               overrides=overrides, color=COLORS[(len(out) - len(CORE_ARMS)) % len(COLORS)]))
    d = ARMS["m2po_distill_sk"]
    out.append(dataclasses.replace(d.variant(k), overrides=tuple(
        f"algo.distill.teacher={teacher}" if o.startswith("algo.distill.teacher=") else o for o in d.overrides)))
    return out


def arena_base(overrides: Sequence[str], fast: bool, lr: Optional[float]) -> list[str]:
    """The overrides every arena run shares: ``--fast``'s, the user's, then ``--lr`` (it wins)."""
    return (FAST_OVERRIDES if fast else []) + list(overrides) + ([f"optim.lr={lr!r}"] if lr is not None else [])


def plan_arena(config: str, overrides: Sequence[str], *, k: Optional[int] = None, updates: Optional[int] = None,
               seeds: int = ARENA_SEEDS, lr: Optional[float] = None, arms: Optional[Sequence[str]] = None,
               out: Optional[str] = None, fast: bool = False, teacher: str = "tiny-teacher"
               ) -> tuple[list[ArmRun], dict[str, Any]]:
    """The arena's runs (nothing runs): ``arms`` of :func:`arena_variants` (default all), each
    ``updates`` optimizer updates long at ``seeds`` seeds."""
    from megatron_m2po.config import load_config
    from megatron_m2po.utils.settings import ConfigError

    k = k if k is not None else (FAST_K if fast else ARENA_K)
    updates = updates if updates is not None else (FAST_UPDATES if fast else ARENA_UPDATES)
    if k < 1:
        raise ConfigError(f"--k={k}: the stale arms need k >= 1 (the on-policy reference is the grpo_s0 arm)")
    base = arena_base(overrides, fast, lr)
    cfg = load_config(config, base)
    U = cfg.trainer.num_updates_per_step
    if updates % U:
        raise ConfigError(f"--updates={updates} is not a multiple of the {U} optimizer updates per step "
                          f"(trainer.prompts_per_step / prompts_per_update); use {updates // U * U or U} or "
                          f"{(updates // U + 1) * U}")
    if updates <= k:
        raise ConfigError(f"--updates={updates} <= --k={k}: the stale arms would never train on data k updates "
                          f"old; give more than k updates (the issue's arena: k = 256, 1,024 updates)")
    variants = arena_variants(k, teacher)
    chosen = list(arms) if arms else [v.name for v in variants]
    unknown = [a for a in chosen if a not in {v.name for v in variants}]
    if unknown:
        raise ConfigError(f"unknown arena arm(s) {unknown}; choose from {[v.name for v in variants]}")
    variants = [v for v in variants if v.name in chosen]
    out = out or f"{cfg.trainer.run_dir}_arena_k{k}"
    return plan_runs(config, base + [f"trainer.num_steps={updates // U}"], variants, out, seeds,
                     spec={"experiment": "arena", "fast": fast, "k": k, "updates": updates, "lr": cfg.optim.lr,
                           "lr_override": lr})


# --------------------------------------------------------------------------------------------
# The command line


def register(esub: argparse._SubParsersAction) -> None:
    a = esub.add_parser(
        "arena", help="M2PO, GRPO, no trust region and every registered off-policy loss at staleness k "
                      "(default 256), with on-policy GRPO as the reference.",
        description="Runs the arena's arms (docs/staleness_experiment.md, Arena) as `m2po train` subprocesses "
                    "that differ only in algo.loss (and its settings) and trainer.stale_k; estimates the compute "
                    "first; resumable (re-run the same command); writes <out>/arena.md and <out>/figures.")
    add_common_args(a, f"Smoke variant: {' '.join(FAST_OVERRIDES)}, k={FAST_K}, {FAST_UPDATES} updates (overrides win)",
            seeds_default=ARENA_SEEDS)
    a.add_argument("--k", type=int, default=None, help=f"Staleness of the stale arms in updates (default {ARENA_K})")
    a.add_argument("--updates", type=int, default=None,
                   help=f"Optimizer updates per run (default {ARENA_UPDATES}; a multiple of the updates per step)")
    a.add_argument("--lr", type=float, default=None, help="optim.lr of every arm (wins over a dotted override)")
    a.add_argument("--teacher", default="tiny-teacher",
                   help="The distillation arm's teacher (algo.distill.teacher: an HF directory with the student's "
                        "tokenizer; default: the tiny task's teacher)")
    a.add_argument("--arms", type=csv_of(str), default=None,
                   help="Comma-separated subset of the arms (default all; --dry-run lists them)")
    a.add_argument("--dry-run", action="store_true",
                   help="Print the plan and the compute estimate from runs measured already; run nothing")
    a.add_argument("--estimate-only", action="store_true",
                   help="Measure (probe if nothing is measured yet), print the estimate and stop")
    a.add_argument("--probe-steps", type=int, default=None,
                   help="Steps of the probe that measures the cost when nothing is measured yet (default: "
                        "trainer.eval_every_steps + 1, at least 4; 0: no probe)")
    a.add_argument("--cost-from", nargs="+", default=[], metavar="DIR",
                   help="Earlier experiment directories (this machine) to estimate the cost from")
    a.add_argument("--calibrate-lr", type=csv_of(float), default=None, metavar="LRS",
                   help="Run only the learning-rate calibration at these lrs (e.g. 5e-6,1e-5,2e-5) and name the "
                        "one whose stale GRPO clip fraction is nearest --target-clip")
    a.add_argument("--calibration-updates", type=int, default=64,
                   help="Updates on stale data per calibration run, after the k warm-up updates (default 64)")
    a.add_argument("--target-clip", type=float, default=0.012,
                   help="Clip fraction of GRPO s=k on stale steps to calibrate to (default 0.012, the paper's)")
    a.set_defaults(func=run_arena)


def run_arena(args: argparse.Namespace) -> int:
    from megatron_m2po.experiment.arena_calibration import run_calibration
    from megatron_m2po.experiment.arena_report import ARENA_FIGURES, write_arena_report
    from megatron_m2po.experiment.commands import run_and_report
    from megatron_m2po.experiment.runner import resolve_parallel, skip_finished

    runs, spec = plan_arena(args.config, args.overrides, k=args.k, updates=args.updates, seeds=args.seeds,
                            lr=args.lr, arms=args.arms, out=args.out, fast=args.fast, teacher=args.teacher)
    out_dir = Path(spec["out"])
    if args.calibrate_lr is not None:
        return run_calibration(args, spec, resolve_parallel(args.parallel))
    if not args.report_only:
        parallel = resolve_parallel(args.parallel)
        skip_finished(runs, progress=not args.no_progress)
        print(describe_plan(runs, spec, verbose=args.dry_run))
        if args.lr is None and not any(o.startswith("optim.lr=") for o in args.overrides):
            print(f"warning: no --lr: every arm runs at the config's optim.lr={spec['lr']:g}, at which the tiny model "
                  "drifts far more per update than an LLM (stale GRPO clips several times the paper's ~1.2 %); "
                  "choose one with --calibrate-lr first (docs/staleness_experiment.md, \"Arena\")", file=sys.stderr)
        print(_estimate(args, runs, spec, parallel), flush=True)
        if args.dry_run or args.estimate_only:
            return 0
    rc = run_and_report(args, runs, spec, figures=ARENA_FIGURES, title=f"Arena: k = {spec['k']}, {spec['updates']} updates")
    path = write_arena_report(out_dir, spec, runs)
    print(f"arena report: {path}")
    return rc


def describe_plan(runs: list[ArmRun], spec: dict[str, Any], verbose: bool) -> str:
    n_arms, n_seeds = len(spec["arms"]), len(spec["seeds"])
    lines = [f"arena: {n_arms} arms x {n_seeds} seed(s) = {len(runs)} runs, k = {spec['k']} (GRPO s=0 is the "
             f"on-policy reference), {spec['updates']} updates each ({spec['num_steps']} steps x "
             f"{spec['updates_per_step']} updates), lr {spec['lr']:g}, seeds {spec['seeds']}; out: {spec['out']}"]
    for name in spec["arms"]:
        done = [r for r in runs if r.arm.name == name and r.status == "skipped"]
        lines.append(f"  {name:<16} {spec['arm_labels'][name]:<24} {' '.join(spec['arm_overrides'][name])}"
                     + (f"  [{len(done)}/{n_seeds} finished]" if done else ""))
    if verbose and runs:
        lines.append("first run's command: " + " ".join(runs[0].command))
    return "\n".join(lines)


def _estimate(args: argparse.Namespace, runs: list[ArmRun], spec: dict[str, Any], parallel: int) -> str:
    """The compute estimate, from the arena's own runs, its probe, or ``--cost-from`` (in that order);
    runs the probe when none has a measurement (not with ``--dry-run``)."""
    from megatron_m2po.config import load_config
    from megatron_m2po.experiment.cost import (
        PROBE_DIR, estimate, format_estimate, measure_dirs, measure_run, plan_probe, probe_steps)
    from megatron_m2po.experiment.runner import usable_cores, execute

    out_dir, cores = Path(spec["out"]), usable_cores()
    sources = [("this arena's runs", [c for c in (measure_run(r.run_dir) for r in runs) if c is not None]),
               ("the probe " + str(out_dir / PROBE_DIR), measure_dirs([out_dir / PROBE_DIR])),
               ("--cost-from " + " ".join(args.cost_from), measure_dirs(args.cost_from))]
    source, costs = next(((s, c) for s, c in sources if c), ("", []))
    todo = any(r.status != "skipped" for r in runs)
    steps = probe_steps(load_config(args.config, spec["overrides"]).trainer.eval_every_steps, args.probe_steps)
    if not costs and todo and steps and not args.dry_run:
        print(f"measuring the cost: {min(parallel, len(spec['arms']))} probe run(s) of {steps} steps at once "
              f"in {out_dir / PROBE_DIR}", flush=True)
        probe, probe_spec = plan_probe(args.config, spec["overrides"], [r.arm for r in runs[::len(spec['seeds'])]],
                                       out_dir, parallel=parallel, steps=steps)
        execute(probe, probe_spec, parallel=parallel, progress=not args.no_progress)
        bad = [r.tag for r in probe if r.status not in ("done", "skipped")]
        if bad:
            print(f"probe run(s) {bad} did not finish; see their train.log in {out_dir / PROBE_DIR}", file=sys.stderr)
        source, costs = sources[1][0], measure_dirs([out_dir / PROBE_DIR])
    return format_estimate(estimate(runs, costs, parallel=parallel, cores=cores,
                                    updates_per_step=spec["updates_per_step"], source=source))
