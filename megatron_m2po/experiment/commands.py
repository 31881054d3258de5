"""``m2po experiment ...``: the staleness comparison, the two sweeps and the entropy analysis.

``staleness``, ``sweep-staleness`` and ``sweep-threshold`` differ only in their arms
(:class:`~megatron_m2po.experiment.runner.Variant` lists); planning, running (``--parallel``,
``--seeds``, resume) and reporting are :mod:`megatron_m2po.experiment.runner`'s.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_m2po.experiment.runner import ArmRun, Variant, execute, mark_finished, plan_runs, report

# --fast: a short variant for CI and smoke tests (user overrides given on the command line win).
FAST_OVERRIDES = [
    "optim.lr=5e-5",
    "trainer.num_steps=8",
    "trainer.prompts_per_step=16",
    "trainer.prompts_per_update=4",
    "trainer.eval_every_steps=0",
    "rollout.num_engines=1",
    "checkpoint.save_every_steps=0",
    "checkpoint.export_hf_at_end=false",
]
FAST_K = 8


@dataclass(frozen=True)
class Arm:
    """An arm of the staleness experiment: its loss, and whether it trains at staleness k or 0."""

    name: str
    loss: str
    stale: bool  # staleness k (True) or 0 (False)
    title: str
    color: str
    overrides: tuple[str, ...] = ()  # what else the arm sets (the distillation arms: algo.distill)

    def label(self, k: int) -> str:
        return f"{self.title} s={k if self.stale else 0}"

    def variant(self, k: int) -> Variant:
        return Variant(name=self.name, label=self.label(k), loss=self.loss, k=k if self.stale else 0,
                       overrides=self.overrides, color=self.color)


# On-policy distillation from the tiny task's teacher (algo.distill; the tiny base trained further,
# standins/tiny_base.py teacher_spec): the distillation arms are a core arm plus these.
DISTILL_OVERRIDES = ("algo.distill.teacher=tiny-teacher", "algo.distill.coef=1", "algo.distill.mode=megatron")

ARMS: dict[str, Arm] = {a.name: a for a in (
    Arm("grpo_s0", "grpo", False, "GRPO", "tab:blue"),
    Arm("grpo_sk", "grpo", True, "GRPO", "tab:orange"),
    Arm("no_tr_sk", "no_tr", True, "no trust region", "tab:red"),
    Arm("m2po_sk", "m2po", True, "M2PO", "tab:green"),
    Arm("grpo_distill_s0", "grpo", False, "GRPO + distillation", "navy", DISTILL_OVERRIDES),
    Arm("m2po_distill_sk", "m2po", True, "M2PO + distillation", "darkgoldenrod", DISTILL_OVERRIDES),
)}
CORE = ("grpo_s0", "grpo_sk", "no_tr_sk", "m2po_sk")  # the staleness experiment's default arms

SWEEP_FIGURES = [
    ("heldout_acc", "Held-out accuracy (eval/synthetic/acc)", "eval/synthetic/acc"),
    ("reward", "Training reward (rollout/reward_mean)", "rollout/reward_mean"),
    ("trust_region", "Clipped (GRPO) / masked (M2PO) token fraction", "@tr"),
    ("kl", "KL(behaviour || current), k3 estimator", "policy/kl_k3"),
]


def _base(config: str, overrides: Sequence[str], fast: bool) -> list[str]:
    return (FAST_OVERRIDES if fast else []) + list(overrides)


def _default_k(config: str, base: list[str], k: Optional[int], fast: bool) -> int:
    from megatron_m2po.config import load_config
    from megatron_m2po.utils.settings import ConfigError

    if k is None:
        k = FAST_K if fast else load_config(config, base).trainer.stale_k
    if k < 1:
        raise ConfigError(f"staleness k={k}: the stale arms need k >= 1; pass --k or set trainer.stale_k in {config}")
    return k


def plan(config: str, overrides: Sequence[str], arms: Sequence[str], k: Optional[int], out: Optional[str],
         fast: bool, seeds: int = 1) -> tuple[list[ArmRun], dict[str, Any]]:
    """The staleness experiment's runs: the chosen arms of :data:`ARMS` at staleness ``k``."""
    from megatron_m2po.utils.settings import ConfigError

    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise ConfigError(f"unknown arm(s) {unknown or arms}; choose from {list(ARMS)}")
    base = _base(config, overrides, fast)
    k = _default_k(config, base, k, fast)
    return plan_runs(config, base, [ARMS[a].variant(k) for a in arms], out, seeds,
                     spec={"experiment": "staleness", "fast": fast, "k": k})


def plan_staleness_sweep(config: str, overrides: Sequence[str], ks: Sequence[int], out: Optional[str], fast: bool,
                         seeds: int = 1, loss: str = "grpo") -> tuple[list[ArmRun], dict[str, Any]]:
    """GRPO (or ``loss``) at each staleness of ``ks`` (paper Fig. 2)."""
    from megatron_m2po.utils.settings import ConfigError

    if not ks or any(k < 0 for k in ks) or len(set(ks)) != len(ks):
        raise ConfigError(f"--ks={','.join(map(str, ks))}: give distinct staleness values >= 0, e.g. 0,4,8,16,32")
    variants = [Variant(name=f"{loss}_s{k}", label=f"{loss.upper() if loss != 'no_tr' else 'no TR'} s={k}",
                        loss=loss, k=k) for k in sorted(ks)]
    return plan_runs(config, _base(config, overrides, fast), variants, out, seeds,
                     spec={"experiment": "sweep-staleness", "fast": fast, "sweep": "staleness",
                           "values": sorted(ks), "loss": loss})


def plan_threshold_sweep(config: str, overrides: Sequence[str], thresholds: Sequence[float], k: Optional[int],
                         out: Optional[str], fast: bool, seeds: int = 1) -> tuple[list[ArmRun], dict[str, Any]]:
    """M2PO at staleness ``k`` with each threshold τ of ``thresholds`` (paper Fig. 7)."""
    from megatron_m2po.utils.settings import ConfigError

    if not thresholds or any(t <= 0 for t in thresholds) or len(set(thresholds)) != len(thresholds):
        raise ConfigError(f"--thresholds={','.join(map(str, thresholds))}: give distinct values > 0, "
                          "e.g. 0.01,0.02,0.04,0.08,0.16")
    base = _base(config, overrides, fast)
    k = _default_k(config, base, k, fast)
    variants = [Variant(name=f"m2po_t{t:g}", label=f"M2PO τ={t:g} s={k}", loss="m2po", k=k,
                        overrides=(f"algo.m2po.threshold={t!r}",)) for t in sorted(thresholds)]
    return plan_runs(config, base, variants, out, seeds,
                     spec={"experiment": "sweep-threshold", "fast": fast, "k": k, "sweep": "threshold",
                           "values": sorted(thresholds)})


# --------------------------------------------------------------------------------------------
# The command line


def add_common_args(p: argparse.ArgumentParser, fast_help: str, seeds_default: int = 1) -> None:
    p.add_argument("config", help="YAML config shared by every arm (e.g. examples/staleness_tiny.yaml)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides applied to every arm")
    p.add_argument("--seeds", type=int, default=seeds_default,
                   help=f"Runs per arm, at seeds trainer.seed + 0 .. N-1 (default {seeds_default}); with N > 1 the "
                        "figures show the mean and a min-max band and the table mean ± std")
    p.add_argument("--parallel", type=int, default=None, help="Runs at once (default: max(1, cores // 2))")
    p.add_argument("--out", default=None, help="Experiment directory (default: the config's trainer.run_dir)")
    p.add_argument("--figures", default=None, help="Where the PNGs go (default: <out>/figures)")
    p.add_argument("--fast", action="store_true", help=fast_help)
    p.add_argument("--report-only", action="store_true",
                   help="Do not run anything: redraw figures and the table from the existing runs")
    p.add_argument("--no-progress", action="store_true", help="No progress bars / progress lines")
    p.add_argument("--smooth", type=int, default=5, help="Moving-average window for noisy curves (0 = raw)")


def csv_of(kind):
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of {kind.__name__}s") from None
    return parse


def register(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """``m2po experiment`` with the commands of this module and ``entropy``; returns its subparsers
    (the package's ``register`` adds ``arena``, which builds on this module)."""
    from megatron_m2po.experiment.entropy import register as register_entropy

    p = sub.add_parser("experiment", help="Experiments built from several training runs.")
    esub = p.add_subparsers(dest="experiment", metavar="EXPERIMENT")
    esub.required = True
    fast = f"Short smoke variant: {' '.join(FAST_OVERRIDES)}, k={FAST_K} (overrides win)"
    s = esub.add_parser(
        "staleness", help="GRPO s=0 / GRPO s=k / no trust region s=k / M2PO s=k on identical seeds and data.",
        description="Runs GRPO s=0, GRPO s=k, no trust region s=k and M2PO s=k as `m2po train` subprocesses "
                    "that differ only in algo.loss and trainer.stale_k (same config, seed and data), then writes "
                    "one figure per metric and the paper-style table. Resumable: re-run the same command.")
    add_common_args(s, fast)
    s.add_argument("--arms", nargs="+", default=list(CORE), metavar="ARM",
                   help=f"Arms to run, any of {', '.join(ARMS)} (default: {', '.join(CORE)})")
    s.add_argument("--k", type=int, default=None, help="Staleness k of the stale arms (default: trainer.stale_k)")
    s.set_defaults(func=run_staleness)

    w = esub.add_parser("sweep-staleness", help="GRPO at several staleness values (paper Fig. 2).",
                        description="One GRPO run per staleness k (0 = on-policy), otherwise identical; figures "
                                    "over updates, a summary figure against k and the table.")
    add_common_args(w, fast.replace(f", k={FAST_K}", ""))
    w.add_argument("--ks", type=csv_of(int), required=True, help="Staleness values, e.g. 0,4,8,16,32")
    w.add_argument("--loss", default="grpo", help="algo.loss of every arm (default grpo)")
    w.set_defaults(func=run_staleness_sweep)

    t = esub.add_parser("sweep-threshold", help="M2PO at several thresholds τ on stale data (paper Fig. 7).",
                        description="One M2PO run per threshold algo.m2po.threshold at staleness k, otherwise "
                                    "identical; figures over updates, a summary figure against τ and the table.")
    add_common_args(t, fast)
    t.add_argument("--thresholds", type=csv_of(float), required=True, help="Thresholds, e.g. 0.01,0.02,0.04,0.08,0.16")
    t.add_argument("--k", type=int, default=None, help="Staleness of every arm (default: trainer.stale_k)")
    t.set_defaults(func=run_threshold_sweep)
    register_entropy(esub)
    return esub


def run_and_report(args: argparse.Namespace, runs: list[ArmRun], spec: dict[str, Any], **report_kw) -> int:
    import sys

    out_dir = Path(spec["out"])
    figures_dir = Path(args.figures) if args.figures else out_dir / "figures"
    if args.report_only:
        mark_finished(runs)
    else:
        execute(runs, spec, parallel=args.parallel, progress=not args.no_progress)
    aggs = report(runs, spec, out_dir, figures_dir, smooth=args.smooth, **report_kw)
    if spec.get("sweep"):
        from megatron_m2po.experiment.figures import write_sweep_figure

        value = dict(zip(spec["arms"], spec["values"]))  # arms are planned in the order of the sorted values
        path = write_sweep_figure([(value[a.arm], a) for a in aggs], spec["sweep"],
                                  figures_dir / f"sweep_{spec['sweep']}.png")
        print(f"sweep figure: {path}")
    bad = [r for r in runs if r.status not in ("done", "skipped")]
    for r in bad:
        print(f"run {r.tag}: {r.status}" + (f" (rc={r.rc}); see {r.run_dir / 'train.log'}" if r.rc else ""),
              file=sys.stderr)
    return 1 if bad else 0


def run_staleness(args: argparse.Namespace) -> int:
    arms = [a for item in args.arms for a in item.split(",") if a]
    runs, spec = plan(args.config, args.overrides, arms, args.k, args.out, args.fast, args.seeds)
    return run_and_report(args, runs, spec)


def run_staleness_sweep(args: argparse.Namespace) -> int:
    runs, spec = plan_staleness_sweep(args.config, args.overrides, args.ks, args.out, args.fast, args.seeds,
                                      loss=args.loss)
    return run_and_report(args, runs, spec, figures=SWEEP_FIGURES, title=f"Staleness sweep ({args.loss}): k = "
               + ", ".join(map(str, spec["values"])))


def run_threshold_sweep(args: argparse.Namespace) -> int:
    runs, spec = plan_threshold_sweep(args.config, args.overrides, args.thresholds, args.k, args.out, args.fast,
                                      args.seeds)
    return run_and_report(args, runs, spec, figures=SWEEP_FIGURES, title=f"Threshold sweep (M2PO, s={spec['k']}): τ = "
               + ", ".join(f"{t:g}" for t in spec["values"]))
