"""The training loop: generate -> score -> store -> train -> push weights -> checkpoint.

Every rank runs :class:`Trainer`; global rank 0 also owns the rollout side (the
:class:`~megatron_m2po.rollout_service.service.RolloutService`, metric logging, progress), which every
rank reaches through one object, :class:`_Lead`: its methods are called on every rank and act on
rank 0 only, so the loop never asks which rank it runs on. The service issues no collectives: it
returns data, and the loop shares it with every rank (:meth:`_Lead.call`; a step's rollouts are scattered: each rank receives its data-parallel shard and the mini-batches'
plans, :meth:`Trainer._fetch_step`) and runs the actor's collectives (log-prob recompute, weight gathers, checkpoints) on all of them.
The engines' weight version is the push controller's (:mod:`megatron_m2po.weights.push`; every rank
holds one, and the loop takes rank 0's from the service once).
The trainer creates the process group and destroys it when the run ends, however it ends.

Modes (docs/design.md §3), each a schedule object (:mod:`.schedule`: what to generate, what to
lease, when to push), so :meth:`Trainer._train_step` tests no mode:

* ``sync`` — on-policy: the rollouts of step ``s`` are generated with the weights the step
  starts at (mini-batch ``j`` has staleness ``j``; the first update is exactly on-policy).
* ``stale_k`` — the paper's controlled setting: step ``s`` trains on rollouts generated at
  version ``s*U - k`` (base-model rollouts while that version does not exist); generation runs
  in the background, up to ``k`` updates ahead of its use (:mod:`.schedule`).
* ``async`` — engines generate continuously (or external producers push), weights are pushed every
  ``trainer.sync_every_updates`` updates, the store serves under ``store.max_staleness``.

Colocated mode (``rollout.colocate=true``, sync and stale_k): engines and trainer time-share the GPUs;
the loop asks for the engines where it generates or evaluates (:meth:`Trainer._engines_generate`) and
for the trainer where it trains, recomputes log-probs, loads or writes a checkpoint
(:meth:`Trainer._trainer_resident`); :class:`~.colocated.ColocatedPhases` runs the release, reload,
resume, push and offload between the two.

Updates are run one optimizer mini-batch at a time so that a generation event that falls
inside a step (``k`` not a multiple of ``U``) happens at exactly the right version.

SIGINT / SIGTERM: the current step finishes, a checkpoint (actor, optimizer, RNG, store cursor,
dataset position) is written, and the process exits with code 0. A signal that arrives while the
trainer waits for a step's rollouts ends the wait: the checkpoint is then of the steps finished
before it. A second signal raises KeyboardInterrupt at once.

Restarts (docs/design.md §5b): every start, with or without a checkpoint, rewinds
the store to the resume point (:meth:`RolloutService.rewind`), so the same command always
finishes, whatever point the previous run died at.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import numpy as np
import torch.distributed as dist

from megatron_m2po.actor.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
from megatron_m2po.actor.batch import RolloutBatch, ShardedBatch
from megatron_m2po.actor.checkpoint import latest_checkpoint
from megatron_m2po.config import Config, config_to_dict, dump_config
from megatron_m2po.parallel.rank0 import any_rank, check_shared_run_dir, from_rank0, scatter_from_rank0
from megatron_m2po.trainer.colocated import ColocatedPhases
from megatron_m2po.trainer.batching import (groups_to_batch, rollout_metrics, shard_step, step_trajectories,
                                             trajectory_to_sample)
from megatron_m2po.trainer.distill import distill_step
from megatron_m2po.trainer.kl_reward import LeadStep, penalise_step
from megatron_m2po.trainer.preflight import claim_checked_run_dir
from megatron_m2po.trainer.run_lock import RunDirLock
from megatron_m2po.trainer.run_report import finished_message, finished_step, run_summary
from megatron_m2po.trainer.schedule import make_schedule
from megatron_m2po.trainer.token_dump import TokenDump
from megatron_m2po.weights.hf_export import export_hf
from megatron_m2po.weights.lora_push import lora_push_mode
from megatron_m2po.weights.push import WeightPushController
from megatron_m2po.utils.faults import fault_point
from megatron_m2po.utils.hf_dir import resolve_model_path
from megatron_m2po.utils.timing import TIMER

if TYPE_CHECKING:
    from megatron_m2po.rollout_service.engine_control import EngineControl
    from megatron_m2po.rollout_service.service import RolloutService

log = logging.getLogger(__name__)
T = TypeVar("T")


class _Stopped:
    """What rank 0 shares instead of a step's data when a stop request ended its wait."""


class _Lead:
    """Global rank 0's part of the run, one object on every rank: the rollout service (its engines
    and push controller), the run directory, metrics, progress.

    Every rank holds one and calls its methods at the same points of the loop; what they do happens
    on global rank 0 only (``here``), so the loop never tests which rank it is on. Three kinds:
    rank 0's actions (``mark_step_start``, ``ack``, ``put``, ``start_continuous``, ``log_step``, ...:
    nothing elsewhere), rank 0's results shared with every rank (``missing_steps``, ``check_engines``,
    ``sample``, ``evaluate``, ``call``: :func:`~megatron_m2po.parallel.rank0.from_rank0`, an error on
    rank 0 raises on every rank) and rank 0's log lines (``info``, ``warning``)."""

    def __init__(self, here: bool) -> None:
        self.here = here
        self.service: Optional["RolloutService"] = None
        self.logger = self.progress = None

    @property
    def engines(self) -> Optional["EngineControl"]:
        """Rank 0's engines (None elsewhere)."""
        return self.service.engines if self.service is not None else None

    def start(self, cfg: Config, model_path: str, *, relaunch: Optional[Callable[[], list[str]]] = None) -> None:
        """Every rank: rank 0 builds the rollout side (data, store, engines), the metrics logger and
        the progress bar; a failure reaches the other ranks at once instead of leaving them waiting."""
        self.call(lambda: self._start(cfg, model_path, relaunch), what="the rollout side (data, store, engines)")

    def _start(self, cfg: Config, model_path: str, relaunch: Optional[Callable[[], list[str]]]) -> None:
        from transformers import AutoTokenizer

        from megatron_m2po.rollout_service.service import RolloutService
        from megatron_m2po.utils.logging import MetricsLogger, TrainProgress

        run_dir = Path(cfg.trainer.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        self.service = RolloutService(cfg, model_path, AutoTokenizer.from_pretrained(model_path), relaunch=relaunch)
        try:
            self.logger = MetricsLogger(str(run_dir), config_dict=config_to_dict(cfg),
                                        wandb_project=cfg.logging.wandb_project,
                                        wandb_run_name=cfg.logging.wandb_run_name)
            self.progress = TrainProgress(cfg.trainer.num_steps, enabled=cfg.logging.progress)
        except BaseException:
            self.close()
            raise

    def push_controller(self, cfg: Config, *, relaunch: Optional[Callable[[], list[str]]]) -> WeightPushController:
        """Rank 0's push controller (the service's); elsewhere a follower with the same LoRA push mode
        and relaunch policy (every rank tracks the same version)."""
        if self.service is not None:
            return self.service.weights
        return WeightPushController.follower(lora_push=lora_push_mode(cfg), relaunch=relaunch)

    # ------------------------------------------------------------------ rank 0's results, shared
    def call(self, fn: Callable[[], T], what: str = "rank 0's result") -> T:
        """``fn()`` evaluated on global rank 0 only; every rank gets its result, waiting without a
        collective that could time out (:func:`~megatron_m2po.parallel.rank0.from_rank0`)."""
        return from_rank0(fn, what=what)

    def stoppable(self, fn: Callable[[], T]) -> T | _Stopped:
        """Rank 0: ``fn()``, or a :class:`_Stopped` marker when a stop request ended its wait."""
        from megatron_m2po.rollout_service.waiting import StopRequested
        try:
            return fn()
        except StopRequested as e:
            log.warning("%s", e)
            return _Stopped()

    def missing_steps(self, steps: list[int]) -> list[int]:
        return self.call(lambda: self.service.missing_steps(steps), what="the steps to catch up")

    def check_engines(self) -> list[str]:
        """Dead engines relaunched; the engines that need the trainer's next push (EngineControl.check)."""
        return self.call(lambda: self.engines.check(), what="the engine check")

    def sample(self, step: int) -> list | _Stopped:
        return self.call(lambda: self.stoppable(lambda: self.service.sample(step)), what=f"the generation of step {step}")

    def rollout_state(self, *, at_step_start: bool) -> dict:
        """What a resume needs of the rollout side (RolloutService.state_dict), rank 0's on every rank."""
        return self.call(lambda: self.service.state_dict(at_step_start=at_step_start), what="the rollout side's state")

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out accuracy after ``step`` steps ({} when a stop request ended it: the step's
        checkpoint comes first)."""
        out = self.call(lambda: self.stoppable(lambda: self.service.evaluate(step)), what="the evaluation")
        return {} if isinstance(out, _Stopped) else out

    # ------------------------------------------------------------------ rank 0's actions
    def say(self, text: str) -> None:
        """Rank 0 prints ``text`` (the console's summaries)."""
        if self.here:
            print(text, flush=True)

    def info(self, msg: str, *args) -> None:
        if self.here:
            log.info(msg, *args)

    def warning(self, msg: str, *args) -> None:
        if self.here:
            log.warning(msg, *args)

    def mark_step_start(self) -> None:
        if self.service is not None:
            self.service.mark_step_start()  # the dataset position before the step's generation events

    def ack(self, lease) -> None:
        if self.service is not None:
            self.service.ack(lease)

    def put(self, groups: list) -> None:
        if self.service is not None:
            self.service.put(groups)

    def start_continuous(self) -> None:
        if self.service is not None:
            self.service.start_continuous()

    def request_stop(self) -> None:
        if self.service is not None:
            self.service.request_stop()  # a wait for data ends at once

    def generate(self, steps: list[int], *, background: bool) -> bool:
        """Rank 0 generates (or starts generating) ``steps``; True when a stop request ended a wait
        (rank 0 only: the step's lease shares it with every rank)."""
        if self.service is None:
            return False
        for s in steps:
            if isinstance(self.stoppable(lambda step=s: self.service.generate(step, background=background)), _Stopped):
                return True
        return False

    def resume(self, extra: Optional[dict], version: int, *, retire_ahead: bool, ckpt, start_step: int) -> None:
        """The rollout side of the restart rule (docs/design.md §5b): the dataset position of the
        checkpoint (``extra``; None: from the base model), the store rewound to it, metrics.jsonl
        without the records past it."""
        if self.service is None:
            return
        if extra is not None:
            self.service.load_state_dict(extra)
        # A run that died before its first checkpoint (or during its write) left leases and, in
        # async mode, groups of weights that are gone: rewound here as after a checkpoint.
        r = self.service.rewind(extra["store_cursor"] if extra is not None else None, version, retire_ahead=retire_ahead)
        # Records past the resume point are logged again (from the start: everything, the step-0 evaluation too).
        dropped = self.logger.rewind(version if ckpt is not None else -1)
        if ckpt is not None:
            log.info("resumed from %s at step %d (version %d); %d lease(s) will be replayed, %d group(s) retired",
                     ckpt, start_step, version, r["replays"], r["retired"])
        if dropped:
            log.info("metrics.jsonl: %d record(s) past version %d dropped (they are logged again)", dropped, version)

    def checkpoint_written(self, ckpt_dir: Path, name: str, seconds: float, keep_last: int) -> None:
        """Older checkpoints beyond ``keep_last`` and any ``.tmp`` left by a killed write removed; logged."""
        if not self.here:
            return
        import shutil
        done = sorted(p for p in ckpt_dir.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        # A `.tmp` left by a write that was killed is never read; it must not count as a kept checkpoint.
        stale = [p for p in ckpt_dir.glob("step_*.tmp") if p.is_dir()]
        for p in done[:-keep_last] + stale:
            shutil.rmtree(p, ignore_errors=True)
        log.info("checkpoint %s written in %.1fs", name, seconds)

    def log_step(self, step: int, version: int, metrics: dict, per_update: list[dict], weights) -> None:
        """The step's record (rank 0): the engines' load and the step's pushes (``weights``, the push
        controller) added, then :meth:`_record`."""
        if self.service is None:
            return
        metrics.update(TIMER.counters(self.engines.loads()))
        metrics.update(weights.take_metrics())  # this step's pushes: GB, GB/s
        self._record(step, version, metrics, per_update)

    def _record(self, step: int, version: int, metrics: dict, per_update: list[dict]) -> None:
        # metrics.jsonl's "step" (and W&B's): optimizer updates (the weight version after them);
        # TensorBoard plots the step records against the training step (1, 2, ...), as the console and
        # the plots count, and the update/* records against the update.
        first = version - len(per_update)
        for j, m in enumerate(per_update):
            self.logger.log({f"update/{k}": v for k, v in m.items()}, step=first + j + 1)
        self.logger.log(metrics, step=version, x=step + 1)
        self.progress.update(step + 1, metrics)

    def log_start_eval(self, metrics: dict) -> None:
        if self.service is None or not metrics:
            return
        self.logger.log({**metrics, "eval/at_step": 0}, step=0, x=0)
        log.info("held-out before training: %s", ", ".join(f"{k} {v:.3f}" for k, v in sorted(metrics.items())
                                                          if isinstance(v, float) and k.endswith("acc")))

    def close(self) -> None:
        for c in (self.service, self.progress, self.logger):
            if c is None:
                continue
            try:
                c.close()
            except Exception as e:  # noqa: BLE001
                log.warning("shutdown: %s", e)


@dataclasses.dataclass
class _Ended:
    """A run that stopped on request: ``heading`` of its summary (None: it stopped while waiting for
    a step's data, and prints none)."""

    heading: Optional[str]


class Trainer:
    """One training run over all ranks."""

    def __init__(self, cfg: Config, run_lock: Optional[RunDirLock] = None):
        """``run_lock``: the run directory's lock, when the caller claimed it already (a single
        process, before Megatron-Core is imported: ``trainer/cli.py``); the trainer releases it at close."""
        self.cfg = cfg
        self._stop_requested = False
        self.actor: Optional[MegatronActor] = None
        self.lead = _Lead(here=False)  # global rank 0's part of the run (set up below, every rank holds one)
        self.token_dump: Optional[TokenDump] = None
        # The engines' weights: rank 0's push controller (the service's), a follower elsewhere; every
        # rank tracks the same version.
        self.weights = WeightPushController.follower()
        self._run_lock = run_lock  # global rank 0: one run per run directory (trainer/run_lock.py)
        self.finished: Optional[int] = None  # the step count of a run that finished before this start
        self._trace_path: Optional[Path] = None
        # rollout.colocate=true: engines and trainer time-share the GPUs (trainer/colocated.py)
        self.colocated: Optional[ColocatedPhases] = None
        self._owns_pg = init_parallel(cfg.parallel, cfg.trainer.seed)
        try:
            self.rank = dist.get_rank()
            self.lead = _Lead(here=self.rank == 0)
            # Before anything is created or started: rank 0 locks the run directory and checks
            # what a user can get wrong at run time; a refusal reaches every rank in one line.
            if run_lock is None:
                self.lead.call(lambda: self._claim_run_dir(cfg), what="the start-up checks")
            self.run_dir = check_shared_run_dir(cfg.trainer.run_dir)
            cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, run_dir=str(self.run_dir)))
            # A finished run has nothing to do: no model, actor or engine is built (run() says so).
            self.finished = self.lead.call(lambda: finished_step(cfg), what="the run's progress")
            if self.finished is not None:
                self.cfg = cfg
                return
            self.model_path = self.lead.call(lambda: resolve_model_path(cfg.model, progress=cfg.logging.progress))
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=self.model_path))
            self.cfg = cfg
            self.U = cfg.trainer.num_updates_per_step
            self.schedule = make_schedule(cfg.trainer)  # what trainer.mode generates, leases and pushes
            self.actor = MegatronActor.from_config(
                ActorConfig.from_config(cfg, total_updates=cfg.trainer.num_steps * self.U))
            self.ckpt_dir = cfg.resolved_path(cfg.checkpoint.dir, "checkpoints")
            self.token_dump = TokenDump(cfg, self.actor, self.run_dir) if cfg.logging.dump_tokens_every else None
            # the data-parallel rank of every global rank: rank 0 sends each rank its shard only
            self._dp_of = [self.actor.dp_rank] * dist.get_world_size()
            if dist.get_world_size() > 1:
                dist.all_gather_object(self._dp_of, self.actor.dp_rank)
            if cfg.rollout.colocate:  # the trainer leaves the GPUs before the engines load onto them
                self.colocated = ColocatedPhases(self.actor, from_rank0=self.lead.call, rank=self.rank)
                self.colocated.start()
            # colocated mode relaunches dead engines with the trainer offloaded around it
            relaunch = self.colocated.relaunch_in_push if self.colocated is not None else None
            self.lead.start(cfg, self.model_path, relaunch=relaunch)
            self.weights = self.lead.push_controller(cfg, relaunch=relaunch)
            if self.colocated is not None:
                self.colocated.attach(self.weights, self.lead.engines)
        except BaseException:
            self.close()
            raise
        self.start_step = 0
        # Rank 0: the whole mini-batches of the step being trained, when its tokens are dumped.
        self._full_minibatches: Optional[list[RolloutBatch]] = None
        # Rank 0: a stop request ended a wait for data in this step.
        self._wait_stopped = False
        self._t_mark = 0.0  # where the current step's wall time started (the previous log line)

    def _claim_run_dir(self, cfg: Config) -> None:
        """Global rank 0: the run directory created if needed and locked, and the start-up checks
        passed (:func:`~.preflight.claim_checked_run_dir`)."""
        self._run_lock = claim_checked_run_dir(cfg)

    # ------------------------------------------------------------------ signals
    def _install_signal_handlers(self) -> None:
        def handler(signum, frame):  # noqa: ARG001
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True
            self.lead.request_stop()  # a wait for data ends at once
            log.warning("received %s: finishing the current step (or ending the wait for its data), then "
                        "checkpointing and exiting", signal.Signals(signum).name)
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, handler)

    # ------------------------------------------------------------------ checkpoints
    def _resume(self) -> None:
        """The restart rule (docs/design.md §5b): resume from the newest complete checkpoint, or
        from the base model when there is none, and rewind the store to that point either way."""
        # Rank 0 decides: every rank resumes from the same checkpoint.
        ckpt = self.lead.call(lambda: latest_checkpoint(self.ckpt_dir), what="the checkpoint to resume from") \
            if self.cfg.checkpoint.resume else None
        extra = None
        if ckpt is not None:
            self._trainer_resident()
            extra = self.actor.load_checkpoint(str(ckpt))
            self.start_step = int(extra["step"])
            self.schedule.load_state_dict(extra)
        self.lead.resume(extra, self.actor.version, retire_ahead=self.schedule.retires_ahead, ckpt=ckpt,
                         start_step=self.start_step)

    def _save(self, step: int, *, at_boundary: bool = False) -> None:
        """Checkpoint after ``step`` steps (all ranks); the actor's checkpoint moves ``latest``.

        ``at_boundary``: step ``step`` began (its generation events ran) but a stop request ended
        its wait for data; the checkpoint records the dataset position from before those events."""
        # What a resume needs besides the actor: the dataset position and store cursor (rank 0's; a step
        # stopped at its start whose prompts the resumed step re-draws: the position from before its
        # generation events) and the schedule's part (mode, stale_k, the catch-up bookkeeping).
        extra = {"step": step, **self.lead.rollout_state(at_step_start=at_boundary and self.schedule.redraws_step_prompts),
                 **self.schedule.state_dict()}
        name = f"step_{step:06d}"
        self._trainer_resident()
        t0 = time.perf_counter()
        with TIMER.phase("checkpoint"):
            self.actor.save_checkpoint(str(self.ckpt_dir / name), extra)
            self.lead.checkpoint_written(self.ckpt_dir, name, time.perf_counter() - t0, self.cfg.checkpoint.keep_last)

    # ------------------------------------------------------------------ weights
    def _push_weights(self) -> float:
        """All ranks: push the actor's weights to the engines (:meth:`WeightPushController.push_actor`:
        every pipeline stage sends its own layers, rank 0 drives the push, a push that engines'
        deaths broke is repeated once after they are relaunched); returns seconds."""
        t0 = time.perf_counter()
        self.weights.push_actor(self.actor)
        return time.perf_counter() - t0

    def _engines_generate(self, version: int) -> dict[str, float]:
        """All ranks: the engines hold the weights of ``version`` and may generate. Colocated: the
        engines resume and get the weights, the trainer offloads (:meth:`ColocatedPhases.to_engines`);
        else a push when the engines hold another version. Returns ``sync/weight_s`` of a push."""
        if self.colocated is not None:
            secs = self.colocated.to_engines()
            return {"sync/weight_s": secs} if secs else {}
        if self.weights.version != version:
            return {"sync/weight_s": self._push_weights()}
        return {}

    def _trainer_resident(self) -> None:
        """All ranks: the trainer's state on the device (colocated: the engines release theirs first)."""
        if self.colocated is not None:
            self.colocated.to_trainer()

    def _generation_events(self) -> dict[str, float]:
        """Generate what the schedule generates at the actor's version (all ranks; none in async)."""
        version = self.actor.version
        return self._generate_steps(self.schedule.steps_to_generate(version, self.start_step), version)

    def _catch_up(self) -> None:
        """A resumed stale_k / sync run (all ranks): steps whose generation event lies before the
        resume point but whose rollouts the store lacks are generated now, with the weights the
        run resumes from. That happens when ``trainer.num_steps`` was raised since the checkpoint:
        the old run never scheduled them, and no later event would (waiting for them would hang).
        Their staleness is below the scheduled one (the weights of their event are gone); the
        warning names them."""
        v = self.actor.version
        past = self.schedule.catch_up_candidates(v, self.start_step)
        if not past:
            return
        missing = self.lead.missing_steps(past)
        # Present ones were caught up from this same checkpoint before a crash: also at version v.
        self.schedule.mark_caught_up(past, v)
        if not missing:
            return
        self.lead.warning("steps %s were scheduled before the resume point (version %d) but never generated "
                          "(trainer.num_steps raised since the checkpoint?): generating them now at version %d; "
                          "their staleness is below the scheduled %d", missing, v, v, self.schedule.k)
        self._generate_steps(missing, v)

    def _form_weight_groups(self) -> None:
        """Distributed weight sync (all ranks): the weight-update groups form before the first step,
        as slime and verl connect the trainer to its engines at initialisation, by pushing the
        weights the run starts from. A mismatched NCCL pair, an engine the senders cannot reach or a
        wrong network interface then ends the run in its first seconds, before a step of GPU time is
        spent, instead of at the first push after step 1. On a fresh run the engines hold these
        weights already, so this costs one transfer; an engine relaunched later forms its groups
        again at its refit (:meth:`_run_step`)."""
        if self.colocated is not None or self.cfg.rollout.weight_sync != "distributed":
            return
        secs = self._push_weights()
        self.lead.info("weight-update groups formed with the engines at version %d (%.1f s)", self.actor.version, secs)

    def _start_continuous(self) -> None:
        """A schedule that generates continuously (async, all ranks): the engines get the weights the
        run starts from, then generate on their own. Engines kept from a run that died hold its
        weights: the producer must not start on them."""
        if not self.schedule.continuous:
            return
        off = self.lead.check_engines()
        if self.weights.version != self.actor.version or off:  # not when the groups' forming pushed them
            self._push_weights()
        self.lead.start_continuous()

    def _generate_steps(self, steps: list[int], version: int) -> dict[str, float]:
        """Generate the rollouts of ``steps`` with the weights of ``version`` (all ranks). A stop
        request that ends a wait for them marks the step stopped (:meth:`_fetch_step`)."""
        if not steps or self._wait_stopped:
            return {}
        out = self._engines_generate(version)
        with TIMER.phase("generation_wait"):  # on-policy: the trainer waits; stale: only starts it
            self._run_generation(steps)
        return out

    def _run_generation(self, steps: list[int]) -> None:
        """:meth:`_generate_steps` after its push: generate (or start generating) ``steps``."""
        if self.cfg.algo.recompute_behav_logprobs:
            # The trainer's own log-probs of the generated tokens at this version: every rank
            # takes part, so generation is synchronous here.
            for s in steps:
                self._engines_generate(self.actor.version)  # colocated: back to the engines after a recompute
                groups = self.lead.sample(s)
                if isinstance(groups, _Stopped):
                    self._wait_stopped = True
                    return
                self._trainer_resident()
                self._recompute_behaviour(groups)
                self.lead.put(groups)
            return
        # On-policy data is needed right away; stale data overlaps with training (schedule.background).
        # A stop request that ends a wait is rank 0's to know: the step's lease shares it with every rank.
        if self.lead.generate(steps, background=self.schedule.background):
            self._wait_stopped = True

    def _recompute_behaviour(self, groups: list) -> None:
        """All ranks (same ``groups``): the trainer's log-probs of freshly generated groups."""
        trajs = [t for g in groups for t in g.trajectories]
        batch = RolloutBatch([trajectory_to_sample(t) for t in trajs])
        logps = self.actor.compute_logprobs(batch) if trajs else []
        for t, lp in zip(trajs, logps):
            t.recomputed_behav_logprobs = np.minimum(np.asarray(lp, dtype=np.float32), 0.0)

    # ------------------------------------------------------------------ one step
    @property
    def _kl_in_reward(self) -> bool:
        """``algo.kl.placement=reward`` with a reference: the penalty goes into the advantages."""
        return self.cfg.algo.kl.coef > 0 and self.cfg.algo.kl.placement == "reward"

    @property
    def _distill_in_advantage(self) -> bool:
        """``algo.distill.placement=advantage`` with a teacher: its reverse KL goes into the advantages."""
        return self.cfg.algo.distill.coef > 0 and self.cfg.algo.distill.placement == "advantage"

    def _fetch_step(self, step: int) -> Optional[tuple[list[ShardedBatch], Any, dict]]:
        """Rank 0 leases the step's groups and splits them into optimizer mini-batches; every rank
        receives, per mini-batch, the global plan (sizes and versions) and the samples of its own
        data-parallel shard only (``actor.shards``), not the whole step. Returns those, the lease
        (rank 0) and the rollout metrics; None on every rank when a stop request ended the wait.
        With ``algo.kl.placement=reward`` the advantages are then recomputed from the penalised
        rewards (trainer/kl_reward.py) before they are returned."""
        leased: dict[str, Any] = {}

        def lease() -> list:
            service = self.lead.service
            got = _Stopped() if self._wait_stopped else self.lead.stoppable(lambda: self.schedule.lease(service, step))
            if isinstance(got, _Stopped):
                return [(None, got)] * len(self._dp_of)
            groups, leased["lease"] = got
            service.score_teacher(groups)  # algo.distill.mode=sglang: stored with the trajectories first
            meta = {**rollout_metrics(groups, correct_reward=self.cfg.reward.correct), **service.filter_metrics()}
            batch = groups_to_batch(groups, advantage=self.cfg.algo.advantage, adv_eps=self.cfg.algo.adv_eps,
                                    use_recomputed=self.cfg.algo.recompute_behav_logprobs)
            minis, parts = shard_step(batch, self.U, self.actor.shards, self._dp_of, meta)
            if self.token_dump is not None and self.token_dump.wants(step):
                leased["full"] = [RolloutBatch(samples) for samples in minis]
            if self._kl_in_reward:
                leased["step"] = LeadStep(step_trajectories(groups), [s for samples in minis for s in samples])
            if self._distill_in_advantage:
                leased["distill"] = [s for samples in minis for s in samples]
            return parts

        with TIMER.phase("data_wait"):
            meta, minibatches = scatter_from_rank0(lease, what=f"the rollouts of step {step}")
        if isinstance(minibatches, _Stopped):
            return None
        if self._kl_in_reward:  # the reference pass, then the advantages of the penalised rewards
            self._trainer_resident()
            meta = {**meta, **penalise_step(self.actor, minibatches, leased.get("step"), self.cfg.algo)}
        if self._distill_in_advantage:  # after the KL penalty, which rewrites the task advantages
            self._trainer_resident()
            meta = {**meta, **distill_step(self.actor, minibatches, leased.get("distill"), self.cfg.algo)}
        self._full_minibatches = leased.get("full")  # rank 0 only: the whole mini-batches (token dumps)
        return minibatches, leased.get("lease"), meta

    def _train_step(self, step: int) -> Optional[tuple[dict[str, float], list[dict[str, float]]]]:
        """One step (all ranks); None when a stop request ended the wait for its data.

        Generate what the schedule generates at the current version, lease the step's data, then
        per optimizer mini-batch: generate what falls due at its version (a generation event
        inside a step, stale_k with ``k`` not a multiple of ``U``), train, push when the schedule
        says; acknowledge the lease."""
        t0 = time.perf_counter()
        self.lead.mark_step_start()
        extra = self._generation_events()
        fetched = self._fetch_step(step)  # its wait is "data_wait"
        if fetched is None:
            return None
        minibatches, lease, rollout = fetched
        per_update, ages, age_counts = self._train_updates(step, minibatches, extra)
        self.lead.ack(lease)
        step_s = time.perf_counter() - t0
        metrics = _step_metrics(per_update, ages, age_counts)
        metrics.update(extra)
        if rollout:
            metrics.update(rollout)
        n_tokens = sum(int(mb.plan.lengths.sum()) for mb in minibatches)
        metrics["perf/step_s"] = step_s
        metrics["perf/tokens_per_s"] = n_tokens / step_s
        metrics["train/version"] = float(self.actor.version)
        metrics["train/step"] = float(step)
        return metrics, per_update

    def _train_updates(self, step: int, minibatches: list[ShardedBatch], extra: dict[str, float]
                       ) -> tuple[list[dict], list[np.ndarray], list[np.ndarray]]:
        """The step's optimizer updates (all ranks), one mini-batch each: the generation events due
        at its version first, a push after it when the schedule says (its seconds added to
        ``extra``). Returns the updates' metrics and their token ages (with counts)."""
        per_update, ages, age_counts = [], [], []
        dump = self.token_dump if self.token_dump is not None and self.token_dump.wants(step) else None
        if dump:
            dump.begin(step)
        first_sample = 0
        for j, mb in enumerate(minibatches):
            if j > 0:
                extra.update(self._generation_events())
            counts = mb.plan.version_counts
            present = counts > 0
            ages.append(self.actor.version - (mb.plan.version_base + np.arange(counts.shape[0]))[present])
            age_counts.append(counts[present])
            update = self.actor.version
            self._trainer_resident()  # colocated: the engines release, the trainer reloads
            per_update.append(self.actor.train_update(mb))
            fault_point("train_update")  # the step's lease is open, its updates half done
            if dump:  # rank 0 assembles the dump from the whole mini-batch it leased
                dump.end_update(self._full_minibatches[j] if self._full_minibatches else None, update, first_sample)
            first_sample += len(mb.plan.lengths)
            if self.schedule.push_after_update(self.actor.version):
                extra["sync/weight_s"] = extra.get("sync/weight_s", 0.0) + self._push_weights()
        if dump:
            dump.write()
        return per_update, ages, age_counts

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        """Train from the resume point to ``trainer.num_steps``, or until a stop request; the rollout
        side, the actor and the process group are closed however it ends. Returns the exit code."""
        if self.finished is not None:
            return self._run_finished()
        self._install_signal_handlers()
        self._resume()
        cfg = self.cfg
        self.lead.info("training steps %d..%d; SIGINT / SIGTERM: the step finishes, a checkpoint is written, the run "
                       "exits", self.start_step + 1, cfg.trainer.num_steps)
        if cfg.trainer.eval_every_steps and not self._evaluates:
            self.lead.warning("trainer.eval_every_steps=%d: no held-out evaluation, as the trainer has no engines to "
                              "sample with (rollout.source=external without rollout.external_addrs); list engines "
                              "there to evaluate", cfg.trainer.eval_every_steps)
        self._form_weight_groups()  # distributed sync: the groups form (and their NCCL builds match) now
        self._catch_up()          # exact schedules: steps scheduled before the resume point, never generated
        self._start_continuous()  # async: the engines generate from now on
        # Where the time goes (utils/timing.py): a step's wall time runs from the previous step's
        # log line to its own, so the previous step's checkpoint counts in this one.
        TIMER.reset(trace=cfg.logging.trace, pid=self.rank)
        self._t_mark = time.perf_counter()
        ended: Optional[str] = None  # the summary's heading, once the run ended as planned
        try:
            if self.start_step == 0 and self._evaluates and cfg.trainer.eval_at_start:
                self._evaluate_at_start()
            for step in range(self.start_step, cfg.trainer.num_steps):
                end = self._run_step(step)
                if end is not None:  # stopped on request
                    ended = end.heading
                    return 0
            if cfg.checkpoint.export_hf_at_end:
                self._trainer_resident()
                out = self.run_dir / "final_hf"
                export_hf(self.actor, str(out))
                self.lead.info("final weights exported to %s", out)
            ended = f"run complete: {cfg.trainer.num_steps} steps in {self.run_dir}"
            return 0
        finally:
            TIMER.finish(time.perf_counter() - self._t_mark)
            self._report_time()
            if ended is not None:
                self._print_summary(ended)
            self.close()

    def _run_step(self, step: int) -> Optional[_Ended]:
        """One step of the run (all ranks): train, evaluate when due, log, checkpoint when due; an
        :class:`_Ended` when the run stops here on request."""
        cfg = self.cfg
        # Relaunched engines that wait for weights (distributed sync) get them now. Colocated: only
        # where the node's memory allows, refit by the next move to the engines (trainer/colocated.py).
        if self.colocated is not None:
            self.colocated.check_engines()
        elif self.lead.check_engines():
            self._push_weights()
        trained = self._train_step(step)
        if trained is None:  # a stop request ended the wait for this step's data
            if step > self.start_step:
                self._save(step, at_boundary=True)
            log.warning("stopped while waiting for the data of step %d, after %d finished step(s); resume "
                        "with the same command", step, step)
            return _Ended(None)
        metrics, per_update = trained
        if self._evaluates and (step + 1) % cfg.trainer.eval_every_steps == 0:
            metrics.update(self._evaluate(step + 1))
        self._log_step(step, metrics, per_update)
        fault_point("step_end")  # logged, not yet checkpointed
        fault_point("worker_dies")
        done = step + 1
        stop = any_rank(self._stop_requested)
        every = cfg.checkpoint.save_every_steps
        if stop or (every and done % every == 0) or done == cfg.trainer.num_steps:
            self._save(done)
        if not stop:
            return None
        log.warning("stopped after step %d on request; resume with the same command", done)
        return _Ended(f"stopped after step {done} of {cfg.trainer.num_steps} (resume with the same command) "
                      f"in {self.run_dir}")

    def _log_step(self, step: int, metrics: dict, per_update: list[dict]) -> None:
        """The step's wall time and phases (every rank's timer); rank 0 adds the engines' load and
        this step's pushes, and logs."""
        now = time.perf_counter()
        metrics.update(TIMER.take_step(now - self._t_mark))
        self._t_mark = now
        self.lead.log_step(step, self.actor.version, metrics, per_update, self.weights)

    def _run_finished(self) -> int:
        """:meth:`run` of a run that finished before this start: say so (rank 0) and close."""
        try:
            self.lead.say(finished_message(self.cfg, self.finished))
            self._print_summary(None)
        finally:
            self.close()
        return 0

    def _print_summary(self, heading: Optional[str]) -> None:
        """Rank 0: where the run's outputs are and how reward moved (:func:`~.run_report.run_summary`)."""
        if not self.lead.here:
            return
        try:  # a report must not hide the exception that ends a run
            final = self.run_dir / "final_hf" if self.cfg.checkpoint.export_hf_at_end else None
            # a finished run's re-run wrote no trace: the one of the run, if it wrote one
            trace = self._trace_path or (self.run_dir / "trace.json" if self.finished is not None else None)
            text = run_summary(self.run_dir, trace=trace, final_hf=final)
            print("\n".join(x for x in (heading, text) if x), flush=True)
        except Exception as e:  # noqa: BLE001
            log.warning("could not summarise the run: %s", e)

    def _report_time(self) -> None:
        """Rank 0: print the "where the time went" table; every rank: write the trace (``logging.trace``)."""
        if TIMER.totals()[2] == 0:
            return
        try:  # a report must not hide the exception that ends a run
            self.lead.say(TIMER.table())
            if TIMER.trace:
                path = self._trace_path = TIMER.write_trace(self.run_dir, world_size=dist.get_world_size())
                self.lead.info("trace written to %s (open it in https://ui.perfetto.dev)", path)
        except Exception as e:  # noqa: BLE001
            log.warning("could not report where the time went: %s", e)

    @property
    def _evaluates(self) -> bool:
        """Held-out evaluation is on and has engines to sample with: external producers without
        ``rollout.external_addrs`` leave the trainer none (the run says so once, at start)."""
        return bool(self.cfg.trainer.eval_every_steps) and self.cfg.rollout.has_engines

    def _evaluate_at_start(self) -> None:
        """The base model's held-out accuracy, before the first step (``trainer.eval_at_start``):
        logged at step 0 with ``eval/at_step`` 0, so curves and the run's summary start there."""
        self.lead.log_start_eval(self._evaluate(0))

    def _evaluate(self, step: int) -> dict[str, float]:
        self._engines_generate(self.actor.version)
        with TIMER.phase("evaluation"):
            return self.lead.evaluate(step)

    def close(self) -> None:
        """Shut the rollout side and the actor down, then destroy the process group (if ours)."""
        try:
            self.lead.close()
            if self.actor is not None:
                self.actor.close()
        finally:
            destroy_parallel(self._owns_pg)
            if self._run_lock is not None:  # last: nothing of this run touches the run directory any more
                self._run_lock.release()


def _step_metrics(per_update: list[dict], ages: list[np.ndarray], age_counts: list[np.ndarray]) -> dict:
    """A step's training metrics: the mean over its updates, the extremes, and the token staleness
    histogram (``staleness/hist``, bins 0, 1, ...; ``ages``/``age_counts`` per update)."""
    metrics = _mean_dicts(per_update)
    for key, fn in (("staleness/max", max), ("policy/ratio_max", max), ("staleness/min", min)):
        if key in per_update[0]:
            metrics[key] = fn(m[key] for m in per_update)
    ages = np.concatenate(ages) if ages else np.zeros(0, np.int64)
    if ages.size:
        hist = np.bincount(ages, weights=np.concatenate(age_counts))
        metrics["staleness/hist"] = [int(c) for c in hist]
    return metrics


def _mean_dicts(ds: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for d in ds for k in d}
    return {k: float(np.mean([d[k] for d in ds if k in d])) for k in sorted(keys)}


def train(cfg: Config, run_lock: Optional[RunDirLock] = None) -> int:
    """Entry point used by ``m2po train`` (any number of ranks); ``run_lock`` as for :class:`Trainer`."""
    trainer = Trainer(cfg, run_lock=run_lock)
    return trainer.run()
