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

With ``rollout.filter`` (dynamic sampling, docs/design.md §3a) groups whose rewards are all equal
never reach the store: a scheduled step over-samples (:meth:`GroupMaker.generate_step`, prompts
from :func:`oversample_prompts`) until it has ``prompts_per_step`` informative groups, at its own
scheduled version; continuous generation simply generates more.

Both generators answer :meth:`raise_failed` and :meth:`idle`, which the leaser
(:mod:`.leaser`) asks while it waits for data.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from megatron_m2po.config import RolloutConfig, StoreConfig, TrainerConfig
from megatron_m2po.rollout import group_ids
from megatron_m2po.rollout.filters import FilterCounters, split_groups
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
        self.counters = FilterCounters()  # rollout.filter: what was generated, dropped, over-sampled

    def context(self, prefix: str, n_samples: Optional[int] = None, **meta) -> ProducerContext:
        """The producer's context for a batch whose groups are named ``group_id(prefix, position)``."""
        r = self.rollout
        params = {"temperature": r.temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens}
        if self.tokenizer.eos_token_id is not None:
            params["stop_token_ids"] = [int(self.tokenizer.eos_token_id)]
        routed = self._routing()
        # The store's layout is `required` exactly when the trainer replays routing (algo.routing_replay=rollout).
        replay = routed is not None and self.store.routing.required
        return ProducerContext(client=self.client, tokenizer=self.tokenizer, reward=self.reward,
                               sampling_params=params, n_samples=n_samples or r.n_samples_per_prompt,
                               version=self.engine_version(), group_prefix=prefix, metadata=meta,
                               max_attempts=r.max_retries + 1, seed=self.seed, routed_experts=routed,
                               routing_replay=replay)

    def _routing(self) -> Optional[tuple[int, int]]:
        """``(layers, top_k)`` of the routed experts the engines return (rollout.return_routed_experts),
        from the layout the trainer recorded in the store (``RolloutStore.set_routing``)."""
        if not self.rollout.return_routed_experts:
            return None
        spec = self.store.routing
        if spec is None or not spec.num_layers:
            raise RuntimeError("rollout.return_routed_experts=true but the store has no routed-experts layout; the "
                               "trainer records it from the model at start-up (RolloutStore.set_routing)")
        return spec.num_layers, spec.top_k

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

    async def generate_filtered(self, ctx: ProducerContext, prompts: list, positions: list[int]) -> list[Group]:
        """:meth:`generate` with ``rollout.filter`` applied: the kept groups (counted)."""
        groups = await self.generate(ctx, prompts, positions)
        kept, dropped = split_groups(groups, self.rollout.filter)
        self.counters.add(generated_groups=len(groups), filtered_groups=len(dropped))
        return kept

    async def generate_step(self, ctx: ProducerContext, prompts: list, positions: list[int], *, step: int,
                            need: int, more: Callable[[int, int], list]) -> list[Group]:
        """The ``need`` groups of scheduled step ``step`` (unstored), over-sampled under ``rollout.filter``.

        Round 0 generates the step's own ``prompts`` (at ``positions``); while fewer than ``need``
        groups survive the filter, an over-sampling round generates ``more(start, n)`` prompts at
        positions ``start .. start+n-1`` (after every position used so far), with the same context:
        same weight version, same id prefix, sampling seeds from the ids. The first ``need`` kept
        groups by position are the step's; informative ones beyond them are counted as surplus.
        Everything depends on the outcomes of earlier rounds only, so a re-run of the step (a
        resume) generates the same rounds where the engines sample reproducibly. More than
        ``rollout.filter_max_rounds`` rounds: RuntimeError naming the step and what to set."""
        r = self.rollout
        kept: list[Group] = []
        made, rounds, next_pos = 0, 0, 0
        while True:
            ctx.positions = list(positions)
            kept += await self.generate_filtered(ctx, prompts, positions)
            made += len(positions)
            next_pos = max(next_pos, max(positions, default=-1) + 1)
            if len(kept) >= need:
                break
            if rounds >= r.filter_max_rounds:
                raise RuntimeError(
                    f"step {step}: rollout.filter={r.filter} found {len(kept)} of the {need} informative groups "
                    f"(rewards not all equal) the step needs in {made} groups generated ({rounds} over-sampling "
                    f"round(s) after the step's own prompts, rollout.filter_max_rounds={r.filter_max_rounds}): the "
                    "task gives too few informative groups at this policy. Raise rollout.filter_max_rounds, give "
                    "more samples per prompt (rollout.n_samples_per_prompt), use prompts of a difficulty the "
                    "policy solves sometimes, or set rollout.filter=none")
            rounds += 1
            missing = need - len(kept)
            # Sized by the informative fraction seen so far, one step's prompts at most per round.
            size = min(need, max(missing, math.ceil(missing * made / max(len(kept), 1))))
            prompts, positions = more(next_pos, size), list(range(next_pos, next_pos + size))
        # ``kept`` is in position order: each round's groups come in position order, after the last round's.
        self.counters.add(oversample_rounds=rounds, surplus_groups=len(kept) - need)
        return kept[:need]

    async def store_batch(self, make: Callable[[], Any]) -> int:
        """Store the groups ``await make()`` returns, one batch at a time; returns how many."""
        # One batch at a time: a step's groups are committed in one transaction, so the store's
        # arrival order keeps steps that share a generation version (base-model steps) apart.
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            with TIMER.union("generation"):  # the driver's thread: overlaps the trainer in stale_k / async
                fixed = await make()
            if fixed:
                await asyncio.get_running_loop().run_in_executor(None, lambda: self.store.put_groups(fixed))
            return len(fixed)

    async def generate_and_store(self, ctx: ProducerContext, prompts: list, positions: list[int]) -> int:
        """Generate and store one batch (``rollout.filter`` applied); returns the number of groups stored."""
        return await self.store_batch(lambda: self.generate_filtered(ctx, prompts, positions))

    async def generate_and_store_unordered(self, ctx: ProducerContext, prompts: list, positions: list[int]) -> int:
        """:meth:`generate_and_store` for batches whose arrival order does not matter (async mode's:
        leased by age within ``store.max_staleness``, not by step): generated concurrently with
        other batches, stored in one transaction when done. Returns the number of groups stored."""
        with TIMER.union("generation"):
            fixed = await self.generate_filtered(ctx, prompts, positions)
        if fixed:
            await asyncio.get_running_loop().run_in_executor(None, lambda: self.store.put_groups(fixed))
        return len(fixed)


def oversample_prompts(dataset: Any, seed: int, step: int, start: int, n: int) -> list:
    """The over-sampling prompts of scheduled step ``step`` at positions ``start .. start+n-1``.

    Drawn from a stream of the step's own (a permutation of the dataset seeded by the run seed and
    the step, cycled), not from the main prompt stream: how many a step needs is known only after
    its rollouts are scored, in the background, while the main thread draws later steps' prompts.
    So the main stream (and the dataset position a checkpoint records) never depends on filter
    outcomes, and a resumed step draws the same over-sampling prompts for the same positions.
    ``start`` counts from the step's first position (``prompts_per_step`` for the first round)."""
    items = dataset.items
    order = np.random.default_rng(np.random.SeedSequence([int(seed) % (1 << 64), 0x0D4A90, int(step)])
                                  ).permutation(len(items))
    return [items[int(order[p % len(order)])] for p in range(start, start + n)]


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

    @property
    def filtering(self) -> bool:
        return self.maker.rollout.filter != "none"

    def _step_ids(self, step: int) -> list[str]:
        """Every id a group of ``step`` may have: its own positions, and under ``rollout.filter``
        those of its over-sampling rounds (at most ``filter_max_rounds`` x ``prompts_per_step`` more)."""
        n = self.trainer.prompts_per_step
        return group_ids.step_group_ids(step, n * (1 + self.maker.rollout.filter_max_rounds if self.filtering else 1))

    def _plan(self, step: int) -> Optional[tuple[ProducerContext, list, list[int]]]:
        """Draw this step's prompts now (deterministic order); the groups still to generate, or None."""
        prompts = self.dataset.next_prompts(self.trainer.prompts_per_step)
        if self.filtering:
            # The kept ids are known only after generation: the step is complete or regenerated whole
            # (deterministically; :meth:`_make` stores only the ids the store lacks).
            have = self.store.existing_group_ids(self._step_ids(step))
            if len(have) >= len(prompts):
                return None
            ctx = self.maker.context(group_ids.step_prefix(step), step=step, generated_at=self.maker.engine_version())
            return ctx, prompts, list(range(len(prompts)))
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
        return [s for s in steps if len(self.store.existing_group_ids(self._step_ids(s))) < n]

    async def _make(self, step: int, ctx: ProducerContext, prompts: list, positions: list[int]) -> list[Group]:
        """The step's groups still to store (unstored): as planned, or over-sampled under ``rollout.filter``."""
        if not self.filtering:
            return await self.maker.generate(ctx, prompts, positions)
        seed = self.trainer.seed
        groups = await self.maker.generate_step(
            ctx, prompts, positions, step=step, need=self.trainer.prompts_per_step,
            more=lambda start, k: oversample_prompts(self.dataset, seed, step, start, k))
        have = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.store.existing_group_ids([g.group_id for g in groups]))
        return [g for g in groups if g.group_id not in have]

    def generate_for_step(self, step: int, *, background: bool = True) -> concurrent.futures.Future:
        """Generate and store the step's missing groups (in the background unless ``background=False``)."""
        plan = self._plan(step)
        if plan is None:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(0)
            return done
        fut = self.bg.submit(self.maker.store_batch(lambda: self._make(step, *plan)))
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
        return self.wait(self.bg.submit(self._make(step, *plan)), f"the rollouts of step {step}",
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
        # rollout.filter's cap: groups generated / kept since the trainer last leased a step.
        self._window: dict[str, Any] = {"step": None, "made": 0, "kept": 0}  # step: None before the first lease
        self._window_lock = threading.Lock()

    @property
    def capacity(self) -> int:
        """Groups held unconsumed (stored available + pending, and in flight) at most.

        A batch started when the trainer is at version ``a`` samples at the engines' version
        ``e >= a - S`` (``S = trainer.sync_every_updates``); at most ``capacity`` groups are
        ahead of it, so with ``capacity = m`` steps of data it is leased within the next ``m``
        leases, each of a step of ``U`` updates, and trained on at staleness at most
        ``(m + 1) U - 1 + S``. ``m`` is the largest that keeps this within
        ``store.max_staleness`` (two steps at most, one update's worth at least)."""
        t = self.trainer
        u = t.num_updates_per_step
        steps = (self.store_cfg.max_staleness + 1 - t.sync_every_updates) // u - 1
        horizon_updates = max(1, min(2 * u, steps * u))
        return horizon_updates * t.prompts_per_update

    def start(self) -> None:
        self._stop.clear()
        self._future = self.bg.submit(self._run())

    async def _run(self) -> None:
        """Keep batches of ``prompts_per_update`` prompts in flight while the groups held (stored
        unconsumed + in flight) stay under :attr:`capacity`. Several batches run at once: one at a
        time, a slow batch (long episodes, slow rewards) leaves the engines and then the trainer
        waiting. Each batch is tagged with the engines' version when it starts. Nothing starts
        while the store holds leases recorded for replay (a resumed run re-trains on their groups
        first; data made now would only age behind them). The first batch that fails ends the loop
        with its error after the others are cancelled; a stop lets the batches in flight finish."""
        chunk, cap = self.trainer.prompts_per_update, self.capacity
        seq = 0
        flying: set[asyncio.Task] = set()
        try:
            while not self._stop.is_set():
                for t in [t for t in flying if t.done()]:
                    flying.discard(t)
                    t.result()  # a failed batch ends the loop with its error
                counts = self.store.counts()
                if counts["available"] + counts["pending"] + chunk * len(flying) >= cap or self.store.has_replay():
                    if flying:  # full: wake when a batch finishes, or poll for the trainer's leases
                        await asyncio.wait(flying, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
                    else:
                        await asyncio.sleep(0.05)
                    continue
                prompts = self.dataset.next_prompts(chunk)
                version = self.maker.engine_version()
                ctx = self.maker.context(group_ids.async_prefix(int(time.time() * 1e3), seq), generated_at=version)
                seq += 1
                flying.add(asyncio.ensure_future(self._batch(ctx, prompts)))
            if flying:  # stopped: the batches in flight finish (stop() bounds the wait)
                await asyncio.gather(*flying)
        except BaseException:
            for t in flying:
                t.cancel()
            await asyncio.gather(*flying, return_exceptions=True)
            raise

    async def _batch(self, ctx: ProducerContext, prompts: list) -> None:
        kept = await self.maker.generate_and_store_unordered(ctx, prompts, list(range(len(prompts))))
        self._check_yield(len(prompts), kept)

    def leased(self, step: int) -> None:
        """The trainer leased ``step``'s groups: the over-sampling window restarts for the next step."""
        with self._window_lock:
            self._window = {"step": step + 1, "made": 0, "kept": 0}

    def _check_yield(self, made: int, kept: int) -> None:
        """``rollout.filter``'s cap in async mode: more than ``(1 + filter_max_rounds) x
        prompts_per_step`` groups generated since the last lease and fewer than one step's worth
        kept: the task gives too few informative groups (the leaser re-raises this)."""
        r, n = self.maker.rollout, self.trainer.prompts_per_step
        with self._window_lock:
            w = self._window
            w["made"] += made
            w["kept"] += kept
            if r.filter == "none" or w["kept"] >= n or w["made"] <= (1 + r.filter_max_rounds) * n:
                return
            step, made_all, kept_all = w["step"], w["made"], w["kept"]
        counts = self.store.counts()
        if counts["available"] + counts["pending"] >= n:
            return  # the trainer is not starved: groups kept before the last lease still serve a step
        raise RuntimeError(
            f"{'the first step' if step is None else f'step {step}'}: rollout.filter={r.filter} kept {kept_all} of the {n} informative groups (rewards not "
            f"all equal) the step needs in {made_all} groups generated since the previous step was leased "
            f"(the cap is (1 + rollout.filter_max_rounds={r.filter_max_rounds}) x trainer.prompts_per_step): the "
            "task gives too few informative groups at this policy. Raise rollout.filter_max_rounds, give more "
            "samples per prompt (rollout.n_samples_per_prompt), use prompts of a difficulty the policy solves "
            "sometimes, or set rollout.filter=none")

    def stop(self) -> None:
        """Stop generating (the batches in flight finish first, within ``stop_timeout_s``)."""
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
