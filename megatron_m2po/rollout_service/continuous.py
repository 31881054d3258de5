"""Continuous generation (async mode): batches kept in flight from start to stop.

:class:`ContinuousGeneration` generates on the rollout side's background event loop, admitting no
more unconsumed data than the trainer can use before it is too stale (its :attr:`capacity`), with
several batches in flight at once. It answers :meth:`~ContinuousGeneration.raise_failed` and
:meth:`~ContinuousGeneration.idle`, which the leaser (:mod:`.leaser`) asks while it waits for data,
and hears :meth:`~ContinuousGeneration.leased` from it (``rollout.filter``'s cap counts from the
last lease).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any, Optional

from megatron_m2po.store.settings import StoreConfig
from megatron_m2po.trainer.settings import TrainerConfig
from megatron_m2po.rollout import group_ids
from megatron_m2po.rollout.producer import ProducerContext
from megatron_m2po.rollout_service.groups import GroupSampler
from megatron_m2po.store.store import RolloutStore
from megatron_m2po.utils.background_loop import BackgroundLoop
from megatron_m2po.utils.timing import TIMER

log = logging.getLogger(__name__)


class ContinuousGeneration:
    """Continuous generation (async mode) from :meth:`start` until :meth:`stop`.

    Admission control: never hold more unconsumed data than the trainer can use within
    ``store.max_staleness`` updates (nor more than two steps' worth), so nothing is generated only
    to be refused as too old."""

    def __init__(self, trainer: TrainerConfig, store_cfg: StoreConfig, *, sampler: GroupSampler, dataset: Any,
                 store: RolloutStore, bg: BackgroundLoop, stop_timeout_s: float):
        self.trainer, self.store_cfg, self.sampler, self.dataset = trainer, store_cfg, sampler, dataset
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
                version = self.sampler.engine_version()
                ctx = self.sampler.context(group_ids.async_prefix(int(time.time() * 1e3), seq), generated_at=version)
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
        """One batch, generated concurrently with the others and stored in one transaction when
        done: its arrival order does not matter (async data is leased by age within
        ``store.max_staleness``, not by step)."""
        with TIMER.union("generation"):
            kept = await self.sampler.sample_kept(ctx, prompts, list(range(len(prompts))))
        self._check_yield(len(prompts), await self.sampler.put(kept))

    def leased(self, step: int) -> None:
        """The trainer leased ``step``'s groups: the over-sampling window restarts for the next step."""
        with self._window_lock:
            self._window = {"step": step + 1, "made": 0, "kept": 0}

    def _check_yield(self, made: int, kept: int) -> None:
        """``rollout.filter``'s cap in async mode: more than ``(1 + filter_max_rounds) x
        prompts_per_step`` groups generated since the last lease and fewer than one step's worth
        kept: the task gives too few informative groups (the leaser re-raises this)."""
        r, n = self.sampler.rollout, self.trainer.prompts_per_step
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
                log.warning("continuous generation stopped with: %s", e)
            self._future = None

    def idle(self) -> bool:
        """The loop is not running (never started, or stopped)."""
        return self._future is None

    def raise_failed(self) -> None:
        """Re-raise the loop's error if it ended with one."""
        if self._future is not None and self._future.done():
            self._future.result()
