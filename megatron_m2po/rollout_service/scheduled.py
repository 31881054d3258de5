"""Scheduled generation: the groups of the steps a sync / stale_k schedule generates at a version.

:class:`ScheduledGeneration` draws a step's prompts in the main thread, in schedule order, so a
resumed run re-draws the same prompts for the same steps, skips the groups the store already holds
(generated before the crash) and generates only the missing ones, on the rollout side's background
event loop (:class:`BackgroundLoop`): with stale data (``stale_k`` with ``k > 0``) that overlaps
training. It answers :meth:`~ScheduledGeneration.raise_failed` and
:meth:`~ScheduledGeneration.idle`, which the leaser (:mod:`.leaser`) asks while it waits for data.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, Optional

from megatron_m2po.trainer.settings import TrainerConfig
from megatron_m2po.rollout import group_ids
from megatron_m2po.rollout.producer import ProducerContext
from megatron_m2po.rollout_service.groups import GroupSampler, oversample_prompts
from megatron_m2po.rollout_service.waiting import wait_future
from megatron_m2po.store.store import RolloutStore
from megatron_m2po.store.types import Group
from megatron_m2po.utils.background_loop import BackgroundLoop
from megatron_m2po.utils.timing import TIMER

log = logging.getLogger(__name__)


class ScheduledGeneration:
    """The groups of scheduled steps (sync / stale_k), generated in the background.

    ``dataset``: the prompt stream (drawn here, in schedule order); ``trainer``: its
    ``prompts_per_step``, ``wait_timeout_s`` and ``run_dir``; ``stop_event``: set by the
    trainer's signal handler, ends an interruptible wait (StopRequested)."""

    def __init__(self, trainer: TrainerConfig, *, sampler: GroupSampler, dataset: Any, store: RolloutStore,
                 bg: BackgroundLoop, stop_event: threading.Event):
        self.trainer, self.sampler, self.dataset, self.store = trainer, sampler, dataset, store
        self.bg, self.stop_event = bg, stop_event
        self._inflight: list[concurrent.futures.Future] = []

    @property
    def filtering(self) -> bool:
        return self.sampler.rollout.filter != "none"

    def _step_ids(self, step: int) -> list[str]:
        """Every id a group of ``step`` may have: its own positions, and under ``rollout.filter``
        those of its over-sampling rounds (at most ``filter_max_rounds`` x ``prompts_per_step`` more)."""
        n = self.trainer.prompts_per_step
        return group_ids.step_group_ids(step, n * (1 + self.sampler.rollout.filter_max_rounds if self.filtering else 1))

    def _plan(self, step: int) -> Optional[tuple[ProducerContext, list, list[int]]]:
        """Draw this step's prompts now (deterministic order); the groups still to generate, or None."""
        prompts = self.dataset.next_prompts(self.trainer.prompts_per_step)
        if self.filtering:
            # The kept ids are known only after generation: the step is complete or regenerated whole
            # (deterministically; :meth:`_make` stores only the ids the store lacks).
            have = self.store.existing_group_ids(self._step_ids(step))
            if len(have) >= len(prompts):
                return None
            ctx = self.sampler.context(group_ids.step_prefix(step), step=step,
                                       generated_at=self.sampler.engine_version())
            return ctx, prompts, list(range(len(prompts)))
        gids = group_ids.step_group_ids(step, len(prompts))
        have = self.store.existing_group_ids(gids)
        todo = [p for p, g in zip(prompts, gids) if g not in have]
        if have:
            log.info("step %d: %d/%d groups already in the store (generated before a restart)", step, len(have),
                     len(gids))
        if not todo:
            return None
        ctx = self.sampler.context(group_ids.step_prefix(step), step=step, generated_at=self.sampler.engine_version())
        positions = [gids.index(g) for g in gids if g not in have]
        ctx.positions = positions
        return ctx, todo, positions

    def missing_steps(self, steps: list[int]) -> list[int]:
        """Those of ``steps`` whose groups the store does not hold completely (never generated)."""
        n = self.trainer.prompts_per_step
        return [s for s in steps if len(self.store.existing_group_ids(self._step_ids(s))) < n]

    async def _make(self, step: int, ctx: ProducerContext, prompts: list, positions: list[int]) -> list[Group]:
        """The step's groups still to store (unstored): as planned, or over-sampled under ``rollout.filter``."""
        if not self.filtering:
            return await self.sampler.sample(ctx, prompts, positions)
        seed = self.trainer.seed
        groups = await self.sampler.oversample(
            ctx, prompts, positions, step=step, need=self.trainer.prompts_per_step,
            more=lambda start, k: oversample_prompts(self.dataset, seed, step, start, k))
        have = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.store.existing_group_ids([g.group_id for g in groups]))
        return [g for g in groups if g.group_id not in have]

    def generate(self, step: int, *, background: bool = True) -> concurrent.futures.Future:
        """Generate and store the step's missing groups (in the background unless ``background=False``);
        returns the future of how many were stored (done at once when the store holds them all)."""
        plan = self._plan(step)
        if plan is None:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(0)
            return done
        fut = self.bg.submit(self.sampler.store_in_order(lambda: self._make(step, *plan)))
        self._inflight.append(fut)
        if not background:
            self.wait(fut, f"the on-policy rollouts of step {step}", interruptible=True)
        return fut

    def sample(self, step: int) -> list[Group]:
        """Generate the step's missing groups now and return them *unstored*.

        For trainer-side behaviour log-probs: the trainer fills them in on every rank, then
        stores the groups with :meth:`put`.
        """
        plan = self._plan(step)
        if plan is None:
            return []
        return self.wait(self.bg.submit(self._timed(self._make(step, *plan))), f"the rollouts of step {step}",
                         interruptible=True)

    @staticmethod
    async def _timed(make: Any) -> Any:
        """``await make`` timed as the step's ``generation`` phase, as :meth:`GroupSampler.store_in_order`
        times the stored path (without it a run with trainer-side behaviour log-probs logged no
        ``time/generation_s`` or ``time/engine_idle_frac``)."""
        with TIMER.union("generation"):
            return await make

    def put(self, groups: list[Group]) -> None:
        """Store groups :meth:`sample` returned."""
        if groups:
            self.store.put_groups(groups)

    def wait(self, fut: concurrent.futures.Future, what: str, *, interruptible: bool) -> Any:
        """``fut.result()`` within ``trainer.wait_timeout_s`` (:func:`~.waiting.wait_future`)."""
        return wait_future(fut, what, timeout_s=self.trainer.wait_timeout_s, run_dir=self.trainer.run_dir,
                           stop_event=self.stop_event, interruptible=interruptible)

    def drain(self, *, interruptible: bool = False) -> None:
        """Block until every submitted generation is stored; re-raises its error. Bounded by
        ``trainer.wait_timeout_s``; ``interruptible``: a stop request ends it (StopRequested)."""
        while self._inflight:
            self.wait(self._inflight[0], "the generation of scheduled rollouts", interruptible=interruptible)
            self._inflight.pop(0)

    def idle(self) -> bool:
        """No scheduled generation is in flight (every one submitted is stored or failed)."""
        return all(f.done() for f in self._inflight)

    def raise_failed(self) -> None:
        """Re-raise the error of a finished generation (forgetting the finished ones)."""
        for f in list(self._inflight):
            if f.done():
                self._inflight.remove(f)
                f.result()  # raises the producer's error

    def cancel(self) -> None:
        for f in self._inflight:
            f.cancel()
