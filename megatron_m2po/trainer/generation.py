"""Rank 0's rollout generation: scheduled steps (sync / stale_k) and continuous generation (async).

Three parts, all on the rollout side's background event loop (:class:`BackgroundLoop`), so
generation overlaps training whenever the schedule allows:

* :class:`GroupMaker` runs the producer for a batch of prompts, gives its groups their
  deterministic ids (:mod:`megatron_m2po.rollout.group_ids`) and stores one batch at a time;
* :class:`StepGenerator` generates the groups of scheduled steps; prompts are drawn in the main
  thread, in schedule order, so a resumed run re-draws the same prompts for the same steps, skips
  the groups the store already holds (generated before the crash) and generates only the missing
  ones;
* :class:`AsyncProducerLoop` generates continuously, admitting no more unconsumed data than the
  trainer can use before it is too stale.

Both generators answer :meth:`raise_failed` and :meth:`idle`, which the leaser
(:mod:`.leaser`) asks while it waits for data.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable, Optional

from megatron_m2po.config import RolloutConfig, StoreConfig, TrainerConfig
from megatron_m2po.rollout import group_ids
from megatron_m2po.rollout.producer import Producer, ProducerContext
from megatron_m2po.store.store import RolloutStore
from megatron_m2po.store.types import Group
from megatron_m2po.trainer.waiting import wait_future
from megatron_m2po.utils.background_loop import BackgroundLoop
from megatron_m2po.utils.timing import TIMER

log = logging.getLogger(__name__)


class GroupMaker:
    """Prompts in, stored groups with deterministic ids out (one batch at a time).

    ``engine_version()``: the weight version the engines hold now (the push controller's); every
    batch is tagged with it at submission. ``client``: the SGLang client the producer samples with
    (None without engines)."""

    def __init__(self, rollout: RolloutConfig, *, seed: Optional[int], tokenizer: Any, reward: Any,
                 producer: Producer, client: Any, store: RolloutStore, engine_version: Callable[[], int]):
        self.rollout, self.seed = rollout, seed
        self.tokenizer, self.reward, self.producer, self.client = tokenizer, reward, producer, client
        self.store, self.engine_version = store, engine_version
        self._lock: Optional[asyncio.Lock] = None  # batches are generated one after another

    def context(self, prefix: str, n_samples: Optional[int] = None, **meta) -> ProducerContext:
        """The producer's context for a batch whose groups are named ``group_id(prefix, position)``."""
        r = self.rollout
        params = {"temperature": r.temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens}
        if self.tokenizer.eos_token_id is not None:
            params["stop_token_ids"] = [int(self.tokenizer.eos_token_id)]
        return ProducerContext(client=self.client, tokenizer=self.tokenizer, reward=self.reward,
                               sampling_params=params, n_samples=n_samples or r.n_samples_per_prompt,
                               version=self.engine_version(), group_prefix=prefix, metadata=meta,
                               max_attempts=r.max_retries + 1, seed=self.seed)

    async def generate(self, ctx: ProducerContext, prompts: list, positions: list[int]) -> list[Group]:
        """The producer's groups for ``prompts``, renamed to their deterministic ids (unstored)."""
        groups = await self.producer(ctx, prompts)
        if len(groups) != len(prompts):
            raise RuntimeError(f"producer returned {len(groups)} groups for {len(prompts)} prompts")
        # Rename to the step's deterministic ids (a custom producer may not know them).
        fixed = []
        for g, pos in zip(groups, positions):
            gid = group_ids.group_id(ctx.group_prefix, pos)
            for j, t in enumerate(g.trajectories):
                t.group_id, t.uid = gid, group_ids.trajectory_uid(gid, j)
            fixed.append(Group(gid, g.trajectories))
        return fixed

    async def generate_and_store(self, ctx: ProducerContext, prompts: list, positions: list[int]) -> int:
        """Generate and store one batch; returns the number of groups stored."""
        # One batch at a time: a step's groups are committed in one transaction, so the store's
        # arrival order keeps steps that share a generation version (base-model steps) apart.
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            with TIMER.phase("generation"):  # the driver's thread: overlaps the trainer in stale_k / async
                fixed = await self.generate(ctx, prompts, positions)
            await asyncio.get_running_loop().run_in_executor(None, lambda: self.store.put_groups(fixed))
            return len(fixed)


class StepGenerator:
    """The groups of scheduled steps (sync / stale_k), generated in the background.

    ``dataset``: the prompt stream (drawn here, in schedule order); ``trainer``: its
    ``prompts_per_step``, ``wait_timeout_s`` and ``run_dir``; ``stop_event``: set by the
    trainer's signal handler, ends an interruptible wait (StopRequested)."""

    def __init__(self, trainer: TrainerConfig, *, maker: GroupMaker, dataset: Any, store: RolloutStore,
                 bg: BackgroundLoop, stop_event: threading.Event):
        self.trainer, self.maker, self.dataset, self.store = trainer, maker, dataset, store
        self.bg, self.stop_event = bg, stop_event
        self._inflight: list[concurrent.futures.Future] = []

    def _plan(self, step: int) -> Optional[tuple[ProducerContext, list, list[int]]]:
        """Draw this step's prompts now (deterministic order); the groups still to generate, or None."""
        prompts = self.dataset.next_prompts(self.trainer.prompts_per_step)
        gids = group_ids.step_group_ids(step, len(prompts))
        have = self.store.existing_group_ids(gids)
        todo = [p for p, g in zip(prompts, gids) if g not in have]
        if have:
            log.info("step %d: %d/%d groups already in the store (generated before a restart)", step, len(have),
                     len(gids))
        if not todo:
            return None
        ctx = self.maker.context(group_ids.step_prefix(step), step=step, generated_at=self.maker.engine_version())
        positions = [gids.index(g) for g in gids if g not in have]
        ctx.positions = positions
        return ctx, todo, positions

    def missing_steps(self, steps: list[int]) -> list[int]:
        """Those of ``steps`` whose groups the store does not hold completely (never generated)."""
        n = self.trainer.prompts_per_step
        return [s for s in steps if len(self.store.existing_group_ids(group_ids.step_group_ids(s, n))) < n]

    def generate_for_step(self, step: int, *, background: bool = True) -> concurrent.futures.Future:
        """Generate and store the step's missing groups (in the background unless ``background=False``)."""
        plan = self._plan(step)
        if plan is None:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(0)
            return done
        fut = self.bg.submit(self.maker.generate_and_store(*plan))
        self._inflight.append(fut)
        if not background:
            self.wait(fut, f"the on-policy rollouts of step {step}", interruptible=True)
        return fut

    def generate_step_groups(self, step: int) -> list[Group]:
        """Generate the step's missing groups now and return them *unstored*.

        For trainer-side behaviour log-probs: the trainer fills them in on every rank, then
        stores the groups with :meth:`put_groups`.
        """
        plan = self._plan(step)
        if plan is None:
            return []
        return self.wait(self.bg.submit(self.maker.generate(*plan)), f"the rollouts of step {step}",
                         interruptible=True)

    def put_groups(self, groups: list[Group]) -> None:
        if groups:
            self.store.put_groups(groups)

    def wait(self, fut: concurrent.futures.Future, what: str, *, interruptible: bool) -> Any:
        """``fut.result()`` within ``trainer.wait_timeout_s`` (:func:`~.waiting.wait_future`)."""
        return wait_future(fut, what, timeout_s=self.trainer.wait_timeout_s, run_dir=self.trainer.run_dir,
                           stop_event=self.stop_event, interruptible=interruptible)

    def wait_generation(self, *, interruptible: bool = False) -> None:
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


class AsyncProducerLoop:
    """Continuous generation (async mode) from :meth:`start` until :meth:`stop`.

    Admission control: never hold more unconsumed data than the trainer can use within
    ``store.max_staleness`` updates (nor more than two steps' worth), so nothing is generated only
    to be refused as too old."""

    def __init__(self, trainer: TrainerConfig, store_cfg: StoreConfig, *, maker: GroupMaker, dataset: Any,
                 store: RolloutStore, bg: BackgroundLoop, stop_timeout_s: float):
        self.trainer, self.store_cfg, self.maker, self.dataset = trainer, store_cfg, maker, dataset
        self.store, self.bg, self.stop_timeout_s = store, bg, stop_timeout_s
        self._stop = threading.Event()
        self._future: Optional[concurrent.futures.Future] = None

    @property
    def capacity(self) -> int:
        """Groups held unconsumed (available + pending) at most."""
        t = self.trainer
        horizon_updates = max(1, min(self.store_cfg.max_staleness, 2 * t.num_updates_per_step))
        return horizon_updates * t.prompts_per_update

    def start(self) -> None:
        self._stop.clear()
        self._future = self.bg.submit(self._run())

    async def _run(self) -> None:
        chunk, cap = self.trainer.prompts_per_update, self.capacity
        seq = 0
        while not self._stop.is_set():
            counts = self.store.counts()
            if counts["available"] + counts["pending"] >= cap:
                await asyncio.sleep(0.05)
                continue
            prompts = self.dataset.next_prompts(chunk)
            version = self.maker.engine_version()
            ctx = self.maker.context(group_ids.async_prefix(int(time.time() * 1e3), seq), generated_at=version)
            seq += 1
            await self.maker.generate_and_store(ctx, prompts, list(range(len(prompts))))

    def stop(self) -> None:
        """Stop generating (a batch in flight finishes first, within ``stop_timeout_s``)."""
        self._stop.set()
        if self._future is not None:
            try:
                self._future.result(timeout=self.stop_timeout_s)
            except Exception as e:  # noqa: BLE001 - surfaced by the leaser otherwise
                log.warning("async producer stopped with: %s", e)
            self._future = None

    def idle(self) -> bool:
        """The loop is not running (never started, or stopped)."""
        return self._future is None

    def raise_failed(self) -> None:
        """Re-raise the loop's error if it ended with one."""
        if self._future is not None and self._future.done():
            self._future.result()
