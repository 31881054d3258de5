"""Rank 0's leases of a step's groups from the rollout store, and their acknowledgement.

* :meth:`Leaser.take_step` (sync / stale_k): exactly the groups of one step, generated at the
  version the schedule says; it fails at once when they can never come (a quarantined group of
  the step, or nothing generating and the store unable to serve them).
* :meth:`Leaser.take_async` (async): any groups within ``store.max_staleness``.

Both wait at most ``trainer.wait_timeout_s``, log what they wait for, and end on a stop request
(:class:`~.waiting.StopRequested`). While waiting they ask the generators (``sources``: objects
with ``raise_failed()`` and ``idle()``: :mod:`.scheduled`, :mod:`.continuous`) whether generation
failed or stopped.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Protocol, Sequence

from megatron_m2po.store.settings import StoreConfig
from megatron_m2po.trainer.settings import TrainerConfig
from megatron_m2po.rollout import group_ids
from megatron_m2po.store.store import Lease, NotReadyError, RolloutStore, bounded
from megatron_m2po.store.types import Group
from megatron_m2po.rollout_service.waiting import StopRequested, WaitNotes


class GenerationSource(Protocol):
    def raise_failed(self) -> None:
        """Re-raise the error of generation that ended with one."""

    def idle(self) -> bool:
        """Nothing is being generated now (so nothing more will arrive from this source)."""


class Leaser:
    """Leases a step's groups from ``store`` for the trainer, and acknowledges them.

    ``trainer``: ``prompts_per_step``, ``wait_timeout_s``, ``run_dir``; ``store_cfg``: the async
    policy (``max_staleness``, ``order``, ``retire_overage``). ``stop_event`` ends a wait.
    ``sources``: the generators feeding the store (none: the store holds all there will be).
    ``producers``: who makes the data, for the wait messages (default: the engines).
    ``on_leased(step)``: called after :meth:`take_async` leased a step (continuous generation's
    over-sampling cap counts from there: :meth:`.ContinuousGeneration.leased`)."""

    def __init__(self, trainer: TrainerConfig, store_cfg: StoreConfig, store: RolloutStore, *,
                 stop_event: threading.Event, sources: Sequence[GenerationSource] = (),
                 producers: Optional[str] = None, on_leased: Optional[Callable[[int], None]] = None):
        self.trainer, self.store_cfg, self.store = trainer, store_cfg, store
        self.stop_event, self.sources = stop_event, tuple(sources)
        self.on_leased = on_leased
        self.producers = producers or f"the engines generate them (logs in {trainer.run_dir}/engines)"

    def take_step(self, step: int, version: int, generated_at: int, *,
                  timeout_s: Optional[float] = None) -> tuple[list[Group], Lease]:
        """Lease the groups of ``step`` (generated at ``generated_at``); returns (groups, lease).

        Waits at most ``timeout_s`` (default ``trainer.wait_timeout_s``); a stop request ends the
        wait (StopRequested). It fails at once when the groups can never come: a quarantined
        group of the step, or no generation in flight and the step's groups not all stored."""
        n = self.trainer.prompts_per_step
        timeout_s = self.trainer.wait_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        notes = WaitNotes(f"the {n} groups of step {step + 1} generated at version {generated_at}",  # 1-based, as the console
                          f"they are generated in the background (engine logs in {self.trainer.run_dir}/engines)",
                          timeout_s)
        while True:
            self._raise_failed()
            try:
                lease = self.store.lease_exact(generated_at=generated_at, n_groups=n, current_version=version,
                                               step=step, timeout_s=1.0)
                break
            except NotReadyError:
                if self.stop_event.is_set():
                    raise StopRequested(f"stopped while waiting for the rollouts of step {step + 1}") from None
                self._fail_if_quarantined(step)
                notes.tick(f"{self.store.count_available(generated_at=generated_at)} available")
                if self._idle():
                    self._raise_failed()
                    if self._idle() and not self._can_serve(step, generated_at):
                        raise RuntimeError(self._never_message(step, generated_at)) from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"step {step}: rollouts generated at version {generated_at} did not arrive "
                                       f"within {timeout_s:.0f}s (trainer.wait_timeout_s); check the engine logs in "
                                       f"{self.trainer.run_dir}/engines; run the same command again to resume"
                                       ) from None
        self._check_step_groups(lease.groups, step)
        return lease.groups, lease

    def take_async(self, step: int, version: int, *, timeout_s: Optional[float] = None) -> tuple[list[Group], Lease]:
        """Lease a step's groups under ``store.max_staleness``; waits at most ``timeout_s`` (default
        ``trainer.wait_timeout_s``), a stop request ends the wait (StopRequested)."""
        s, n = self.store_cfg, self.trainer.prompts_per_step
        policy = bounded(s.max_staleness, s.order, s.retire_overage)
        timeout_s = self.trainer.wait_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        notes = WaitNotes(f"{n} groups for step {step + 1} within store.max_staleness={s.max_staleness} of version "
                          f"{version}", self.producers, timeout_s)
        while True:
            self._raise_failed()
            try:
                lease = self.store.lease(policy, n_groups=n, current_version=version, step=step, timeout_s=1.0)
                if self.on_leased is not None:
                    self.on_leased(step)
                return lease.groups, lease
            except NotReadyError as e:
                if self.stop_event.is_set():
                    raise StopRequested(f"stopped while waiting for the rollouts of step {step + 1}") from None
                notes.tick(str(e))
                if time.monotonic() > deadline:
                    raise RuntimeError(f"step {step}: no {n} servable groups within {timeout_s:.0f}s "
                                       f"(trainer.wait_timeout_s): {e}; check that {self.producers}; run the "
                                       "same command again to resume") from None

    def ack(self, lease: Any) -> None:
        """The lease's groups are consumed (the step trained on them)."""
        self.store.ack(lease)

    def _raise_failed(self) -> None:
        for s in self.sources:
            s.raise_failed()

    def _idle(self) -> bool:
        return all(s.idle() for s in self.sources)

    def _fail_if_quarantined(self, step: int) -> None:
        """A group of this step that failed the store's integrity check can never be served, and
        regenerating it now would sample at another version than the exact stale-k schedule says:
        stop at once instead of waiting for the timeout."""
        lost = self.store.quarantined_ids(group_ids.of_step(step))
        if lost:
            raise RuntimeError(
                f"step {step}: group(s) {lost[:5]} of this step failed the rollout store's integrity check "
                f"and are quarantined (`m2po store stats {self.store.path}` shows why); exact stale-k "
                "cannot serve the step without them. Restore the store from a backup (`m2po store backup` "
                "makes one while the run is live) and run the same command again to resume, or resume "
                "with a new trainer.run_dir") from None

    def _can_serve(self, step: int, generated_at: int) -> bool:
        """Whether the store can still serve ``step`` without more generation."""
        if self.store.has_replay():
            return True  # a recorded lease is served first; the request is compared with it there
        return self.store.count_available(generated_at=generated_at) >= self.trainer.prompts_per_step

    def _never_message(self, step: int, generated_at: int) -> str:
        n = self.trainer.prompts_per_step
        have = len(self.store.existing_group_ids(group_ids.step_group_ids(step, n)))
        return (f"step {step + 1}: waiting for {n} groups generated at version {generated_at}, but no generation is in "
                f"flight and the store holds {self.store.count_available(generated_at=generated_at)} available "
                f"(of this step's groups {have}/{n} are stored, counts {self.store.counts()}): they can never come. "
                f"The store in {self.store.path} holds consumption this run did not record (a run_dir reused by "
                "another run, or a store restored from elsewhere?): use a new trainer.run_dir, or restore the store "
                "from the backup that matches the checkpoint")

    @staticmethod
    def _check_step_groups(groups: list[Group], step: int) -> None:
        bad = [g.group_id for g in groups if not g.group_id.startswith(group_ids.of_step(step))]
        if bad:
            raise RuntimeError(f"step {step} was served groups of another step: {bad[:3]}; the store holds "
                               "data this schedule did not produce (reusing a run_dir of a different run?)")
