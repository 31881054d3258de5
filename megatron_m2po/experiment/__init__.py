"""``m2po experiment ...``: the paper's evidence from several training runs.

``staleness CONFIG`` — the paper's staleness comparison on one config.

Four arms, identical in everything (config, seed, prompts, base model) except the loss and the
staleness ``k`` of ``trainer.mode=stale_k`` (docs/design.md §3):

=============  ============  ===========================================================
arm            loss          staleness
=============  ============  ===========================================================
``grpo_s0``    grpo (clip)   0 (on-policy reference)
``grpo_sk``    grpo (clip)   k
``no_tr_sk``   no_tr         k (no trust region: the "prosperity before collapse" arm)
``m2po_sk``    m2po          k
=============  ============  ===========================================================

Each arm is one ``m2po train CONFIG [overrides] <arm overrides>`` subprocess with its own run
directory ``<out>/<arm>``; up to ``--parallel`` arms run at once (default: half the cores). A
live bar per arm follows its ``metrics.jsonl``. The experiment is resumable: an arm whose run
finished (``<out>/<arm>/experiment_done.json``) is skipped, an interrupted arm re-runs its
command, which resumes from the arm's last checkpoint. Ctrl-C / SIGTERM forwards SIGTERM to the
running arms (each checkpoints and exits), so re-running the same command continues; a SIGKILL
takes the arms with it (``utils/lifeline.py``), which then resume from their last checkpoint.
Every invocation's wall and CPU time go to ``<out>/experiment_time.json`` (:mod:`.timing`).

Afterwards (and with ``--report-only`` on existing runs) it writes one PNG per metric with the
four curves into ``<out>/figures`` and the paper-style table (best / final held-out accuracy,
mean clip or mask fraction, collapsed) as ``<out>/summary.md`` and ``<out>/summary.json``.

Collapse rule (:class:`CollapseRule`, stated in the table): an arm collapsed when its final
held-out accuracy is below ``acc_ratio`` (0.5) times its best, or when its mean training reward
over the last ``tail_frac`` (10 %) of its steps is more than ``reward_margin`` (0.05) below the
base model's reward (the mean reward of all steps, of all arms, that trained on rollouts of the
base model: step 0 of every arm, the first ``k / U + 1`` steps of the stale arms).

``--seeds N`` runs every arm at seeds ``trainer.seed + 0 .. N-1``; the figures then show the mean
over seeds with a min-max band, and the table mean ± standard deviation with the differences
between arms that exceed the seed-to-seed spread (:func:`~.analysis.exceeds_spread`).

``sweep-staleness CONFIG --ks 0,4,8`` (GRPO at several staleness values) and ``sweep-threshold
CONFIG --thresholds 0.01,0.04`` (M2PO at several thresholds) run other lists of arms through the
same machinery (:mod:`.runner`); ``entropy RUN_DIR`` analyses a run's token dumps (:mod:`.entropy`).

``arena CONFIG`` -- M2PO, GRPO, no trust region and every off-policy loss of
``algo/offpolicy_losses.py`` at staleness k (default 256), on-policy GRPO as the reference, 3 seeds,
with a compute estimate before it starts and ``<out>/arena.md`` after (:mod:`.arena`).

Modules: :mod:`.analysis` (pure functions over metrics), :mod:`.figures`, :mod:`.runner`
(subprocesses, resume, report), :mod:`.commands` (the arms of each command, the CLI),
:mod:`.entropy`, :mod:`.arena` (+ :mod:`.arena_report`, :mod:`.arena_calibration`), :mod:`.cost`
(compute estimates), :mod:`.timing` (wall and CPU time of every invocation).
"""

from megatron_m2po.experiment.analysis import (  # noqa: F401
    SPREAD_Z, TR_KEY, ArmAggregate, ArmSummary, CollapseRule, SeedStat, aggregate_seeds, collapse_verdict,
    exceeds_spread, format_seed_table, format_table, pooled_base_reward, seed_stat, step_records, summarize_arm)
from megatron_m2po.experiment.commands import (  # noqa: F401
    ARMS, CORE, FAST_K, FAST_OVERRIDES, Arm, plan, plan_staleness_sweep, plan_threshold_sweep)
from megatron_m2po.experiment.figures import FIGURES, write_figures, write_sweep_figure  # noqa: F401
from megatron_m2po.experiment.runner import (  # noqa: F401
    DONE_FILE, SPEC_FILE, ArmRun, MetricsTail, Variant, execute, mark_finished, plan_runs, report)


def register(sub) -> None:
    """``m2po experiment ...`` (megatron_m2po/cli.py): the commands of :mod:`.commands` and ``arena``."""
    from megatron_m2po.experiment.arena import register as register_arena
    from megatron_m2po.experiment.commands import register as register_commands
    from megatron_m2po.experiment.distill_report import register as register_distill
    from megatron_m2po.experiment.drift import register as register_drift
    from megatron_m2po.experiment.ladder import register as register_ladder

    esub = register_commands(sub)
    register_arena(esub)
    register_drift(esub)
    register_ladder(esub)
    register_distill(esub)
