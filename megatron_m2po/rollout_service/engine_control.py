"""The engines' one owner on rank 0: their fleet, the client the producer samples with, the weight
version they serve, their adapters, and every verb that acts on them.

:class:`EngineControl` is built by the rollout service (:meth:`EngineControl.launch` starts the
fleet of ``rollout.*``) and handed, whole, to those that act on the engines:

* the push controller (:class:`~megatron_m2po.weights.push.WeightPushController`) brackets each push
  with :meth:`~EngineControl.hold_for_push` / :meth:`~EngineControl.end_hold` /
  :meth:`~EngineControl.served`, and after a failed push has :meth:`~EngineControl.restart_dead`
  relaunch the engines that died;
* colocated mode's phases (``trainer/colocated.py``) :meth:`~EngineControl.release` and
  :meth:`~EngineControl.resume` the engines' memory, ask for :meth:`~EngineControl.dead` and
  :attr:`~EngineControl.pending` engines and :meth:`~EngineControl.relaunch` them;
* the training loop, before a step, :meth:`~EngineControl.check`\\ s them (dead ones relaunched and
  refit, engines serving another version found) and reads their :meth:`~EngineControl.loads`.

The verbs, and who they act on::

    hold_for_push(version)   drain generation, record the trainer's version, re-read the fleet,
                             hold the engines out of the router's health view for the push
    end_hold()               the hold ends (the push returned, or failed)
    served(version)          the engines hold ``version``: relaunched engines rejoin the router
    refit(url)               one restarted engine gets the served weights (or adapter)
    restart_dead()           dead engines relaunched without weights, out of the router
    check()                  restart_dead + refit where the transport can, + off-version probes
    release(tags) / resume(tags) / relaunch(release)   colocated mode's memory verbs
    dead() / pending         probes
    loads()                  ``/v1/loads`` summed over engines (a metric)

No verb takes part in a collective: every rank reaches rank 0's control through the training loop's
``from_rank0``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_m2po.config import Config
from megatron_m2po.rollout.client import SGLangClient
from megatron_m2po.rollout.dispatch import DispatchClient
from megatron_m2po.rollout.engines import EngineFleet
from megatron_m2po.rollout.placement import cuda_count, node_gpus, placement
from megatron_m2po.utils.background_loop import BackgroundLoop
from megatron_m2po.utils.faults import fault_point
from megatron_m2po.weights.fp8 import export_fp8_dir
from megatron_m2po.weights.lora_export import peft_config
from megatron_m2po.weights.lora_push import AdapterPush
from megatron_m2po.weights.lora_push import engine_args as lora_engine_args

__all__ = ["EngineControl", "ADAPTERS_KEPT"]

# LoRA adapter versions every engine keeps loaded: the newest, and the one requests in flight across a push use
ADAPTERS_KEPT = 2

log = logging.getLogger(__name__)

FleetFactory = Callable[..., EngineFleet]


class EngineControl:
    """Rank 0's engines (module docstring). Built whole:

    ``store``: the rollout store (a push records the trainer's version there first); ``bg``: the
    background event loop engine calls run on; ``transport``: the weight sync of
    ``rollout.weight_sync``, or a callable that builds it from the engines' URLs once they run
    (a restarted engine is refit and told to it); ``fleet``: a callable
    ``fleet(refit_fn=, on_concurrency=, on_engines=)`` returning the (unstarted)
    :class:`~megatron_m2po.rollout.engines.EngineFleet`, None when there are no engines to manage
    (external producers); ``adapters``: the adapter pushes of ``model.lora.push=adapter`` (the
    client then samples with the newest adapter); ``drain``: waits until no scheduled generation
    is in flight; ``control_timeout_s``: the bound of a memory call."""

    def __init__(self, *, store: Any, bg: BackgroundLoop, transport: Any,
                 fleet: Optional[FleetFactory] = None, adapters: Optional[AdapterPush] = None,
                 drain: Callable[[], None] = lambda: None, control_timeout_s: float = 300.0) -> None:
        self._store, self._bg, self._drain = store, bg, drain
        self._adapters = adapters
        self._timeout_s = float(control_timeout_s)
        self.version = 0  # the weight version the engines serve: fresh engines start from the base model
        self._fleet: Optional[EngineFleet] = None
        self._client: Optional[SGLangClient] = None
        self.transport: Any = None
        try:
            if fleet is not None:
                self._fleet = fleet(refit_fn=self.refit, on_concurrency=self._resize_client,
                                    on_engines=self._reset_engines)
                self._fleet.start()
                self._bg.submit(self._open_client()).result()
            self.transport = transport(self.urls) if callable(transport) else transport
        except BaseException:
            self.close()
            raise

    @classmethod
    def launch(cls, cfg: Config, model_path: str, *, run_dir: Path, store: Any, bg: BackgroundLoop,
               transport: Callable[[list[str]], Any], drain: Callable[[], None] = lambda: None) -> "EngineControl":
        """The engines of ``cfg.rollout`` started (none for external producers without
        ``rollout.external_addrs``), their client opened, the transport built on their URLs."""
        r = cfg.rollout
        if r.source == "external" and not r.external_addrs:
            return cls(store=store, bg=bg, transport=transport, drain=drain, control_timeout_s=r.weight_sync_timeout_s)
        adapters = _adapter_push(cfg, model_path, bg)
        # FP8 engines start from a block-FP8 export of the base model: SGLang 0.5.23 reloads
        # only block-FP8 parameters (weights/fp8.py); `--quantization fp8` on the float
        # model would quantise per channel, and the first weight push would fail.
        engine_model = _fp8_base(model_path, run_dir, r.fp8_block_size) if r.fp8_weights else model_path
        # Engines on this node go after the trainer's GPUs; impossible layouts fail here, before
        # anything starts (rollout/placement.py).
        node = node_gpus(count=cuda_count(), trainer_on_gpu=cuda_count() is not None)
        if r.launcher == "local":
            placement(cfg, node)
        extra = lora_engine_args(cfg.model.lora.rank, list(cfg.model.lora.targets), keep=ADAPTERS_KEPT) \
            if adapters is not None else []

        def fleet(**callbacks) -> EngineFleet:
            return EngineFleet(r, engine_model, run_dir=str(run_dir), node=node, extra_engine_args=extra, **callbacks)

        return cls(store=store, bg=bg, transport=transport, fleet=fleet, adapters=adapters, drain=drain,
                   control_timeout_s=r.weight_sync_timeout_s)

    # ------------------------------------------------------------------ what the engines are
    @property
    def urls(self) -> list[str]:
        """Every engine's own URL (the router forwards no control calls)."""
        return self._fleet.engine_urls if self._fleet is not None else []

    @property
    def client(self) -> Optional[SGLangClient]:
        """The client the producer samples with (the router's, or a dispatching client over the
        engines); None without engines."""
        return self._client

    @property
    def adapters(self) -> Optional[AdapterPush]:
        return self._adapters

    @property
    def pending(self) -> list[str]:
        """Relaunched engines that wait for the next push (out of the router until it admits them)."""
        return self._fleet.pending_urls if self._fleet is not None else []

    def dead(self) -> list[str]:
        """The engines that died (a probe; nothing is relaunched)."""
        return self._fleet.dead_urls() if self._fleet is not None else []

    # ------------------------------------------------------------------ around a push
    def hold_for_push(self, version: int) -> list[str]:
        """Before a push of ``version``: generation in flight drains, the store records the trainer's
        ``version`` (tokens an engine samples with the new weights while the push is still returning
        validate against it), the fleet is re-read (a replaced engine may have moved; engines that
        joined a router-discovered fleet get this push) and held out of the router's health view
        (paused by the push: its view is not the truth). Returns the URLs to push to."""
        self._drain()
        if self._fleet is not None and self._fleet.engines:
            # after the drain: the push fails, not a generation in flight (with one engine that
            # generation would be lost, and the run end, as docs/design.md says of any mode)
            fault_point("engine_dies", lambda: self._fleet.engines[0].handle.proc.kill())
        self._store.set_version(version)
        if self._fleet is not None:
            self._fleet.refresh()
            self._fleet.hold(self.urls)
        return self.urls

    def end_hold(self) -> None:
        """The push returned or failed: the router's health view applies again."""
        if self._fleet is not None:
            self._fleet.release()

    def served(self, version: int) -> None:
        """The engines hold ``version``: relaunched engines waiting for it rejoin the router."""
        self.version = int(version)
        if self._fleet is not None:
            self._fleet.admit()

    def prepare_adapters(self, version: int) -> list[str]:
        """Before an adapter push of ``version``: the store records it, the fleet is re-read. Returns
        the URLs to load it on."""
        self._store.set_version(version)
        if self._fleet is not None:
            self._fleet.refresh()
        return self.urls

    def load_adapters(self, tensors, version: int):
        """Every engine loads adapter ``version`` (``weights/lora_push.py``); its SyncStats."""
        if self._adapters is None:
            raise RuntimeError("model.lora.push=adapter, but the engines were started without adapter serving")
        return self._adapters.push(tensors, version, self.urls)

    # ------------------------------------------------------------------ restarts
    def refit(self, url: str) -> None:
        """A restarted engine gets the served weights (or adapter) before it serves again (the
        fleet's ``refit_fn``: only a transport that ``can_refit_alone`` is asked, :meth:`check`)."""
        if self.version == 0:
            return  # it launched from the base model, which is version 0
        if self._adapters is not None:
            self._adapters.refit(url, self.version)
            return
        self.transport.refit(url, self.version)

    def restart_dead(self) -> list[str]:
        """Relaunch dead engines without weights or router registration (after a failed push the
        push is repeated for every engine, which refits them and rebuilds their groups); returns
        their URLs."""
        if self._fleet is None:
            return []
        restarted = self._fleet.check_and_restart(refit=False)
        if restarted:
            log.warning("restarted %d engine(s): %s; they get the weights with the next push",
                        len(restarted), ", ".join(restarted))
            self.transport.on_engines_restarted(restarted)
            if self._adapters is not None:
                self._adapters.on_engines_restarted(restarted)
        return restarted

    def check(self) -> list[str]:
        """Restart dead engines; returns the URLs of those that need the trainer's next push.

        A transport that can refit one engine alone (disk: from the latest version directory)
        refits a relaunched engine here, and it is re-registered. One that cannot (distributed)
        leaves the engine waiting (unregistered) for the trainer's next push from every stage,
        which rebuilds the groups for it and admits it; at version 0 the engine launched from the
        base model and needs no weights. Engines serving another version than the one pushed last
        are named too (:meth:`_off_version`).
        """
        if self._fleet is None:
            return []
        if not self.transport.can_refit_alone and self.version > 0:
            self.restart_dead()
            pending = self._fleet.pending_urls
        else:
            pending = []
            restarted = self._fleet.check_and_restart()  # refit_fn (refit) loaded their weights or adapter
            if restarted:
                log.warning("restarted %d engine(s): %s", len(restarted), ", ".join(restarted))
                self.transport.on_engines_restarted(restarted)
        return pending + self._off_version(set(pending))

    def _off_version(self, skip: set[str]) -> list[str]:
        """Engines whose served weight version is not the one pushed last: restarted by someone
        else (an external or router-discovered engine comes back with the base model), or kept
        from a run that died (they hold weights the re-run does not have). Their tokens would be
        tagged with versions the schedule does not expect; the trainer pushes to every engine."""
        async def versions() -> list[str]:
            out = []
            for url in urls:
                if url in skip:
                    out.append(str(self.version))
                    continue
                async with SGLangClient(url, timeout_s=30.0, max_retries=2) as c:
                    out.append(await c.weight_version())
            return out
        urls = self.urls
        got = self._bg.submit(versions()).result(timeout=120)
        off = [(u, v) for u, v in zip(urls, got) if v != str(self.version)]
        if off:
            log.warning("engine(s) %s serve weight version(s) %s, not version %d pushed last (restarted outside the "
                        "trainer, or kept from a run that died): pushing the current weights to every engine",
                        ", ".join(u for u, _ in off), ", ".join(v for _, v in off), self.version)
        return [u for u, _ in off]

    # ------------------------------------------------------------------ colocated mode
    def release(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> list[str]:
        """Colocated mode: wait for scheduled generation in flight, then every engine frees ``tags``
        (``/release_memory_occupation``; SGLang 0.5.23 asserts an idle engine,
        ``managers/scheduler_components/weight_updater.py`` ``release_memory_occupation``, and kills its
        scheduler otherwise, so nothing may be generating). Returns the engines that failed because
        they are dead (their memory went with their process: :meth:`relaunch`); a failure on an
        engine that is alive raises, naming each."""
        self._drain()
        return self._on_engines(lambda c: c.release_memory_occupation(list(tags), timeout_s=self._timeout_s),
                                f"release_memory_occupation {list(tags)}")

    def resume(self, tags: tuple[str, ...]) -> list[str]:
        """Colocated mode: every engine maps ``tags`` again (``/resume_memory_occupation``). Resumed
        ``weights`` hold nothing usable (no ``--enable-weights-cpu-backup``): push before generating.
        Returns the engines that are dead, as :meth:`release`."""
        return self._on_engines(lambda c: c.resume_memory_occupation(list(tags), timeout_s=self._timeout_s),
                                f"resume_memory_occupation {list(tags)}")

    def relaunch(self, release: tuple[str, ...]) -> list[str]:
        """Colocated mode, with the trainer offloaded (a relaunched engine loads the base model and
        reserves its KV cache at start-up, as SGLang 0.5.23 does with ``--enable-memory-saver``:
        ``model_executor/model_runner.py`` ``initialize``): relaunch the dead engines, out of the
        router until a push admits them, then release ``release`` on them, to match the others.
        Returns their URLs."""
        urls = self.restart_dead()
        if urls and release:
            self._on_engines(lambda c: c.release_memory_occupation(list(release), timeout_s=self._timeout_s),
                             f"release_memory_occupation {list(release)} of the relaunched engine(s)", urls=urls,
                             tolerate_dead=False)
        return urls

    def _on_engines(self, fn, what: str, *, urls: Optional[list[str]] = None, tolerate_dead: bool = True) -> list[str]:
        """``fn(client)`` on every engine (or ``urls``) at once (each engine's own URL: the router
        forwards no memory calls). Returns the engines that failed and are dead (``tolerate_dead``);
        any other failure raises RuntimeError naming each engine that failed."""
        urls = list(self.urls if urls is None else urls)

        async def one(url: str):
            async with SGLangClient(url, max_retries=0, control_timeout_s=self._timeout_s) as c:
                return await fn(c)

        async def each() -> list:
            return await asyncio.gather(*(one(u) for u in urls), return_exceptions=True)

        got = self._bg.submit(each()).result(timeout=self._timeout_s + 30)
        bad = {u: f"{type(r).__name__}: {r}" for u, r in zip(urls, got) if isinstance(r, BaseException)}
        dead = set(self.dead()) & set(bad) if bad and tolerate_dead else set()
        if set(bad) - dead:
            raise RuntimeError(f"{what} failed on {len(bad)}/{len(got)} engine(s):\n  "
                               + "\n  ".join(f"{u}: {m}" for u, m in bad.items()))
        for u in sorted(dead):
            log.warning("%s: engine %s is dead (%s); it is relaunched where its memory is free", what, u, bad[u])
        return sorted(dead)

    # ------------------------------------------------------------------ metrics
    def loads(self) -> dict[str, float]:
        """Metrics of the engines' load now (``/v1/loads``, SGLang 0.5.23 ``entrypoints/v1_loads.py``),
        summed over engines: ``engine/{running,queued}_reqs``, ``engine/used_tokens``; not under
        ``rollout/``, whose metrics describe the rollouts (a re-run reproduces them exactly).
        A snapshot, not an average; {} when there are no engines or one does not answer (a metric
        must not end a run)."""
        async def each() -> list[dict]:
            out = []
            for url in self.urls:
                async with SGLangClient(url, timeout_s=10.0, max_retries=0) as c:
                    out.append(await c.loads())
            return out
        if not self.urls:
            return {}
        try:
            got = self._bg.submit(each()).result(timeout=30)
        except Exception as e:  # noqa: BLE001
            log.debug("engine loads: %s", e)
            return {}
        return {f"engine/{name}": float(sum(int(g.get(key, 0)) for g in got))
                for name, key in (("running_reqs", "num_running_reqs"), ("queued_reqs", "num_waiting_reqs"),
                                  ("used_tokens", "num_used_tokens"))}

    # ------------------------------------------------------------------ the client
    async def _open_client(self) -> None:
        # sglang-router's client, or without a router a DispatchClient over the engines (rollout/dispatch.py)
        adapters = self._adapters
        self._client = self._fleet.client(adapter=(lambda: adapters.current) if adapters is not None else None)

    def _resize_client(self, concurrency: int) -> None:
        """The fleet's derived concurrency changed (engines joined or left): the client follows."""
        if self._client is not None and not isinstance(self._client, DispatchClient):
            self._bg.submit(self._client.set_concurrency(concurrency)).result(timeout=30)

    def _reset_engines(self, limits: dict[str, int]) -> None:
        """No router: the fleet's engines changed (restart, admission) or were re-checked; the
        dispatching client sends requests to these (and to engines it had marked down again)."""
        if isinstance(self._client, DispatchClient):
            self._bg.submit(self._client.set_engines(limits)).result(timeout=30)

    # ------------------------------------------------------------------ teardown
    def close_client(self) -> None:
        """The client closed (on the background loop, before the loop itself closes)."""
        client, self._client = self._client, None
        self._bg.close_quietly(client)

    def close(self) -> None:
        """The client (:meth:`close_client`, if still open), the transport and the engines, each shut
        down whatever the others do."""
        self.close_client()
        closers = []
        if self.transport is not None:
            closers.append(("transport", self.transport.close))
        if self._fleet is not None:
            closers.append(("engines", self._fleet.stop))
        for what, closer in closers:
            try:
                closer()
            except Exception as e:  # noqa: BLE001 - best effort at shutdown
                log.warning("shutdown: the %s failed to close: %s", what, e)
        self.transport = self._fleet = None


def _adapter_push(cfg: Config, model_path: str, bg: BackgroundLoop) -> Optional[AdapterPush]:
    """Rank 0's adapter pushes (``model.lora.push=adapter``, engines of this run's own); the client
    sends every request under the newest adapter and tags its tokens with that adapter's version."""
    from megatron_m2po.weights.lora_push import lora_push_mode

    if lora_push_mode(cfg) != "adapter":
        return None
    r = cfg.rollout
    return AdapterPush(cfg.resolved_path(r.weight_sync_dir, "weights"), peft_config(cfg.model.lora, model_path),
                       client_for=lambda url: SGLangClient(url, timeout_s=r.weight_sync_timeout_s,
                                                           control_timeout_s=r.weight_sync_timeout_s),
                       bg=bg, timeout_s=r.weight_sync_timeout_s, keep=ADAPTERS_KEPT,
                       in_memory=cfg.model.lora.adapter_transport == "memory")


def _fp8_base(model_path: str, run_dir: Path, block_size) -> str:
    """``<run_dir>/engine_base_fp8``: the base model in block FP8 (kept for a resume)."""
    out = run_dir / "engine_base_fp8"
    block = list(block_size)
    try:
        have = json.loads((out / "config.json").read_text())["quantization_config"]["weight_block_size"]
    except (OSError, ValueError, KeyError, TypeError):
        have = None
    if have != block:
        shutil.rmtree(out, ignore_errors=True)
        export_fp8_dir(model_path, out, block=tuple(block))
    return str(out)
