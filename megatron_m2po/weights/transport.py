"""The transports' shared part: the interface every weight sync offers rank 0's push controller.

Two transports today, :class:`~megatron_m2po.weights.disk.DiskWeightSync` and
:class:`~megatron_m2po.weights.distributed.DistributedWeightSync`, both subclasses of
:class:`WeightSync`, run on trainer rank 0 with the same interface:

- ``begin(version, n_stages) -> PushPlan`` and ``finish(plan, stage_results) -> SyncStats``: a push
  from every pipeline stage in parallel (:func:`~megatron_m2po.weights.stage.push_from_stages`,
  called by every trainer rank; each stage's sender sends or writes its own layers, see
  :mod:`megatron_m2po.weights.stage`);
- ``push(weights, version, engine_urls=None) -> SyncStats``: the same push from this one process
  (one stage), where ``weights`` is an iterator of ``(hf_name, full_tensor)`` or an HF checkpoint
  directory (a refit, a benchmark, the tests);
- ``can_refit_alone`` / ``refit(url, version)`` / ``on_engines_restarted(urls)``: what a relaunched
  engine needs. The disk sync refits one engine alone from the latest version directory; the
  distributed one cannot (the engine waits for the next push from every stage) and rebuilds its
  groups at that push, since a relaunched engine has lost them.

Pause and cache flush (docs/sglang.md, "Weight updates and the prefix cache"). SGLang keeps prompt KV
in its radix cache across requests until the cache is flushed; an update that does not flush leaves
the KV the old weights computed in use, and tokens tagged with the new version are then partly
computed by older weights. So every push flushes: the engines pause with ``retract`` (the default
``pause_mode``), which moves running requests back to the waiting queue and frees their KV
(``scheduler.py`` ``pause_generation``), so the flush that the update asks for is legal
(``flush_cache`` is refused only while requests run, or wait on an unpaused scheduler); on
``/continue_generation`` the retracted requests are prefilled again, output included, by the new
weights. In sync and stale_k mode the engines are idle at a push (the driver waits for the
generation first) and nothing is retracted; in async mode the in-flight requests pay one prefill
each. ``pause_mode="in_place"`` keeps running requests and their KV, so 0.5.23 refuses the flush
while any runs: it sends ``flush_cache=false`` unless ``flush_cache=True`` is given (the caller
knows the engines are idle), and then the tokens after the push are conditioned on older KV.

``fp8=True`` (``rollout.fp8_weights``) quantises the linears of the decoder blocks to block FP8 on
the way out (:mod:`megatron_m2po.weights.fp8`: ``.weight`` in float8_e4m3fn plus a float32
``.weight_scale_inv`` per ``fp8_block`` block, and ``quantization_config`` with
``weight_block_size`` in each exported config.json), for engines that serve FP8: SGLang 0.5.23
reloads block-FP8 parameters in place, while per-tensor FP8 replaces them after the first load and
fails every later update.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Union

import torch

from megatron_m2po.utils.background_loop import BackgroundLoop
from megatron_m2po.utils.hf_dir import iter_safetensors
from megatron_m2po.weights.fp8 import DEFAULT_BLOCK, check_block
from megatron_m2po.weights.errors import WeightSyncError, weight_sync_error
from megatron_m2po.weights.nccl_handshake import MISMATCH
from megatron_m2po.weights.stage import PushPlan, StageResult, each_engine, run_stage

__all__ = ["WeightSync", "SessionWeightSync", "SyncStats", "WeightSyncError", "push_stats"]

Weights = Union[str, os.PathLike, Iterable[tuple[str, torch.Tensor]]]


@dataclass(slots=True)
class SyncStats:
    """One push: ``bytes`` of weights to ``engines`` in ``seconds`` (from :meth:`begin` to the engines
    holding them). A disk push also says how long the stages took to write (``write_s``), the engines
    to load (``load_s``), and the load's timeout (``timeout_s``,
    :mod:`megatron_m2po.rollout.push_timeout`)."""

    version: int
    bytes: int
    seconds: float
    n_tensors: int
    engines: int
    stages: int = 1
    write_s: Optional[float] = None
    load_s: Optional[float] = None
    timeout_s: Optional[float] = None

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / max(self.seconds, 1e-9)


class WeightSync:
    """The base of every transport: pause and continue the engines, name the dead ones in a failed
    push's error, push from this one process; subclasses plan (:meth:`begin`) and complete
    (:meth:`finish`) a push."""

    def __init__(self, engine_urls: list[str], *, timeout_s: float, pause_mode: Optional[str],
                 flush_cache: Optional[bool] = None, fp8: bool = False,
                 fp8_block: tuple[int, int] = DEFAULT_BLOCK) -> None:
        if pause_mode not in (None, "in_place", "retract", "abort"):
            raise ValueError(f"pause_mode={pause_mode!r}: use 'retract' (default), 'in_place', 'abort' or None")
        if flush_cache not in (None, True, False):
            raise ValueError(f"flush_cache={flush_cache!r}: use None (flush unless pausing in place), True or False")
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.timeout_s, self.pause_mode, self.flush_cache = timeout_s, pause_mode, flush_cache
        self.fp8, self.fp8_block = fp8, check_block(fp8_block)
        # HTTP calls run on this loop while the calling thread blocks in a broadcast.
        self._io = BackgroundLoop("weight-sync-http")
        self._t0 = 0.0

    def _urls(self, engine_urls: Optional[list[str]]) -> tuple[str, ...]:
        return tuple(u.rstrip("/") for u in (engine_urls or self.engine_urls))

    def _each(self, urls, fn, what: str, timeout_s: Optional[float] = None) -> list:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        return self._io.run(each_engine(urls, fn, what, timeout_s), timeout=timeout_s + 30)

    @property
    def _may_flush(self) -> bool:
        """Whether the update asks SGLang to flush its prefix cache (module docstring). 0.5.23
        fails the update when the flush finds requests running, or waiting on an unpaused
        scheduler (scheduler_components/weight_updater.py ``flush_cache_after_weight_update``,
        scheduler.py ``flush_cache``): after a retract or abort pause none run; paused in place
        they may, so only an explicit ``flush_cache=True`` flushes then; with no pause SGLang's
        model-update lock waits for the running requests."""
        if self.flush_cache is not None:
            return self.flush_cache
        return self.pause_mode != "in_place"

    def _pause(self, urls) -> None:
        if self.pause_mode:
            self._each(urls, lambda c: c.pause_generation(self.pause_mode), "pause_generation")

    def _continue_quietly(self, urls) -> None:
        """Continue every engine that can answer (after a failure some cannot)."""
        if self.pause_mode:
            try:
                self._each(urls, lambda c: c.continue_generation(), "continue_generation")
            except WeightSyncError:
                pass

    def _end_quietly(self, urls) -> None:
        """Close the weight-update session where it is open (after a failure), so the next push can begin."""
        try:
            self._each(urls, lambda c: c.end_weight_update(timeout_s=self.timeout_s), "end_weight_update")
        except WeightSyncError:
            pass

    def _session_errors(self, plan: PushPlan, results: list[StageResult]) -> list[str]:
        """What went wrong with a push of every stage inside a ``/begin_weight_update`` session: the
        stages' own errors, missing stages, an empty push, else ``/end_weight_update``'s failure
        (SGLang 0.5.23 ``weight_updater.py``: the session closes only after the last tensor loaded)."""
        errors = [r.error for r in results if r.error]
        if len(results) != plan.n_stages:
            errors.append(f"{len(results)} of {plan.n_stages} stages reported")
        if not errors and sum(r.n_tensors for r in results) == 0:
            errors.append("the stages sent no tensors")
        if not errors:
            try:
                self._each(plan.urls, lambda c: c.end_weight_update(timeout_s=self.timeout_s), "end_weight_update")
            except WeightSyncError as e:
                errors.append(str(e))
        return errors

    def _dead(self, urls) -> list[str]:
        """The engines that do not answer ``/health`` now (named in a failed push's error)."""
        async def probe(c):
            if not await c.health(min(self.timeout_s, 5.0)):
                raise WeightSyncError("unhealthy")
        try:
            self._each(urls, probe, "health")
            return []
        except WeightSyncError as e:
            return [u for u in urls if f"{u}:" in str(e)]

    def _failed(self, plan: PushPlan, errors: list[str]) -> WeightSyncError:
        dead = self._dead(plan.urls)
        fatal = [e for e in errors if MISMATCH in e]
        if fatal:  # one line, and not worth a relaunch: the relaunched engine runs the same build
            return weight_sync_error(fatal[0])
        msg = f"weight push of version {plan.version} failed:\n  " + "\n  ".join(errors)
        if dead:
            msg += "\nengines not answering /health: " + ", ".join(dead)
        return WeightSyncError(msg)

    def push(self, weights: Weights, version: int, engine_urls: Optional[list[str]] = None) -> SyncStats:
        """The whole push from this process (one stage)."""
        plan = self.begin(version, 1, engine_urls)
        if isinstance(weights, (str, os.PathLike)):
            weights = self._from_dir(str(weights), plan)
        return self.finish(plan, [run_stage(plan, 0, weights)])

    def _from_dir(self, path: str, plan: PushPlan):
        return iter_safetensors(path)

    #: Whether :meth:`refit` loads the current weights into one relaunched engine from this process
    #: alone. When not, a relaunched engine waits (unregistered) for the next push from every stage.
    can_refit_alone = False

    def refit(self, url: str, version: int) -> None:
        """Load the weights of ``version`` (the last pushed) into the relaunched engine ``url``."""
        raise WeightSyncError(f"{type(self).__name__} cannot refit engine {url} alone: it gets version {version} "
                              "with the next push from every stage")

    def on_engines_restarted(self, urls: list[str]) -> None:
        """Engines ``urls`` were relaunched: what this controller set up with them is gone."""

    def begin(self, version: int, n_stages: int, engine_urls: Optional[list[str]] = None) -> PushPlan:
        raise NotImplementedError

    def finish(self, plan: PushPlan, results: list[StageResult]) -> SyncStats:
        raise NotImplementedError

    def close(self) -> None:
        self._io.close(join_timeout_s=5.0)


def push_stats(plan: PushPlan, results: list[StageResult], seconds: float) -> SyncStats:
    """The :class:`SyncStats` of a push whose stages reported ``results``, ``seconds`` after it began."""
    return SyncStats(int(plan.version), sum(r.bytes for r in results), seconds,
                     sum(r.n_tensors for r in results), len(plan.urls), plan.n_stages)


class SessionWeightSync(WeightSync):
    """A transport that sends tensors into SGLang's weight-update session (the distributed and the
    colocated ones): 0.5.23 refuses ``/update_weights_from_distributed`` and
    ``/update_weights_from_tensor`` outside a ``/begin_weight_update ... /end_weight_update`` session
    (``scheduler_components/weight_updater.py``). A subclass's :meth:`begin` builds its plan and calls
    :meth:`_open_session`; :meth:`finish` closes the session. A failure on either side closes what
    opened, continues the engines, calls :meth:`_session_failed` and raises the push's error."""

    def _open_session(self, plan: PushPlan, prepare: Optional[Callable[[], None]] = None) -> PushPlan:
        """``prepare()`` (what must be known of the engines first), pause, ``/begin_weight_update`` on each."""
        urls = plan.urls
        try:
            if prepare is not None:
                prepare()
            self._pause(urls)
            self._each(urls, lambda c: c.begin_weight_update(timeout_s=self.timeout_s), "begin_weight_update")
        except WeightSyncError as e:
            self._session_failed()
            self._end_quietly(urls)
            self._continue_quietly(urls)
            raise self._failed(plan, [str(e)]) from None
        return plan

    def finish(self, plan: PushPlan, results: list[StageResult]) -> SyncStats:
        urls = plan.urls
        try:
            errors = self._session_errors(plan, results)
            if errors:
                self._session_failed()
                self._end_quietly(urls)  # close the session where it is open, so the next push can begin
                raise self._failed(plan, errors)
        finally:
            self._continue_quietly(urls)
        return push_stats(plan, results, time.perf_counter() - self._t0)

    def _session_failed(self) -> None:
        """What a failed session leaves unusable (the distributed transport's groups); nothing here."""
