"""The rollout engine fleet: launch, health, sglang-router registration, restart and refit.

    fleet = EngineFleet(cfg.rollout, model_path, run_dir="runs/x", refit_fn=push_current_weights)
    fleet.start()            # engines healthy, router up, workers registered
    client = fleet.client()  # the router, or a DispatchClient over the engines (use_router=false)
    ...
    fleet.check_and_restart()  # dead engine -> relaunch -> refit_fn(url) -> register again
    fleet.stop()

Engines come from a ``Launcher`` (:mod:`.launcher`: ``LocalLauncher`` starts subprocesses;
:mod:`.ray_launcher` implements the same protocol with Ray actors) or, with ``rollout.launcher == "external"``, from
``rollout.external_addrs`` (validated at start-up: health, model info, server info; each
problem is reported with the address), or -- ``rollout.router_addr`` alone -- from the workers a
running sglang-router lists (``GET /workers``; sglang-router 0.3.2 has no ``/list_workers``).
A router-discovered fleet is re-read by :meth:`EngineFleet.refresh` before every weight push:
engines that joined the router since are validated the same way and get the push, engines it no
longer lists are dropped, and so are engines it lists as unhealthy unless this process holds them
paused (:meth:`EngineFleet.hold`) or they answer ``/health`` themselves (the router's view lags: it
marks a paused engine unhealthy after ``--health-failure-threshold`` failed checks and healthy again
only after ``--health-success-threshold`` good ones). ``rollout.engine == "sglang"`` launches
``$SGLANG_PYTHON -m sglang.launch_server`` (SGLang's own venv; this interpreter when unset);
``"cpu_worker"`` launches the CPU worker stand-in (``standin_module("cpu_worker")``,
``standins/cpu_worker.py``).
Each engine logs to ``<run_dir>/engines/engine_<i>.log``; a failed start raises with the
log's last lines. The router (sglang-router 0.3.2) is started with no workers and workers are
added with ``POST /workers``; a restarted engine is removed from the router first and added back
only after ``refit_fn`` pushed the current weights, so it never serves stale weights.

Without a router (``rollout.use_router=false``) :meth:`EngineFleet.client` is a
:class:`~megatron_m2po.rollout.dispatch.DispatchClient` that dispatches ``/generate`` over the engines
itself (sglang-router 0.3.2 drops ``return_routed_experts``); the fleet tells it its engines
(``on_engines`` with :meth:`EngineFleet.dispatch_limits`) on start, every restart check and admission. A
relaunched engine that waits for its weights (``pending``) is in neither the router nor that set.

``EngineFleet.concurrency`` is the trainer client's bound on in-flight requests: ``rollout.concurrency``
when set, else the sum over engines of what each reports it can run (``client.max_running_requests``
of its ``/server_info``), re-derived whenever the engines change; ``on_concurrency`` hears each new
value.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import aiohttp

from megatron_m2po.rollout.settings import RolloutConfig
from megatron_m2po.rollout.client import EngineError, SGLangClient, max_running_requests
from megatron_m2po.rollout.dispatch import DispatchClient, split_limits
from megatron_m2po.rollout.sglang_version import check_sglang_version
from megatron_m2po.rollout.launcher import (EngineHandle, EngineSpec, FleetError, FleetSetupError, Launcher, LocalHandle,
                                            LocalLauncher, sglang_python)
from megatron_m2po.rollout.placement import NodeGPUs, cuda_count, engine_gpus, node_gpus, ray_local_gpus
from megatron_m2po.rollout.push_timeout import checkpoint_bytes, disk_push_timeout_s
from megatron_m2po.utils.net import free_port
from megatron_m2po.utils.standin import standin_module

log = logging.getLogger("m2po.engines")

# An engine whose /server_info reports no limit counts as this many running requests.
FALLBACK_MAX_RUNNING = 64

# sglang-router 0.3.2 health checks (sglang_router/router_args.py; defaults 60 s interval, 5 s
# timeout, 3 failures). A paused SGLang 0.5.23 engine answers /health 503 after
# SGLANG_HEALTH_CHECK_TIMEOUT (20 s), so the router marks it unhealthy after 3 checks and routes
# nothing to it until it passes --health-success-threshold (2) checks after the pause. The timeout
# here outlasts SGLang's 20 s, so a slow but healthy answer never counts as a failure.
ROUTER_HEALTH_INTERVAL_S = 30
ROUTER_HEALTH_TIMEOUT_S = 25


def router_health_flags(max_pause_s: float, *, interval_s: int = ROUTER_HEALTH_INTERVAL_S,
                        timeout_s: int = ROUTER_HEALTH_TIMEOUT_S) -> list[str]:
    """sglang-router 0.3.2 flags under which an engine paused for up to ``max_pause_s`` (a weight
    update: a 32B disk load takes minutes) is never marked unhealthy.

    Checks start every ``interval_s``; every check that starts during the pause, or up to
    ``timeout_s`` before it, can fail: at most ``floor((max_pause_s + timeout_s) / interval_s) + 1``
    in a row. The failure threshold is one more. A dead engine is then marked unhealthy after about
    ``threshold * interval_s`` (the router's circuit breaker stops routing to it sooner, after
    ``--cb-failure-threshold`` failed requests)."""
    if max_pause_s < 0 or interval_s < 1 or timeout_s < 1:
        raise ValueError(f"router_health_flags: max_pause_s={max_pause_s} (>= 0), interval_s={interval_s} "
                         f"(>= 1), timeout_s={timeout_s} (>= 1)")
    failures = math.floor((max_pause_s + timeout_s) / interval_s) + 2
    return ["--health-check-interval-secs", str(interval_s), "--health-check-timeout-secs", str(timeout_s),
            "--health-failure-threshold", str(failures)]


def tail(path: Optional[Path], n: int = 30) -> str:
    if path is None or not Path(path).exists():
        return "(no log)"
    lines = Path(path).read_text(errors="replace").splitlines()
    return "\n".join(lines[-n:])


def _run(coro):
    return asyncio.run(coro)


async def _get_json(url: str, timeout_s: float = 5.0):
    async with aiohttp.ClientSession() as s:
        async with s.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                raise EngineError(url, "", await r.text(), r.status)
            return await r.json(content_type=None)


async def _probe(url: str, timeout_s: float = 5.0) -> bool:
    async with SGLangClient(url, max_retries=0) as c:
        return await c.health(timeout_s)


@dataclass
class _Engine:
    index: int
    url: str
    handle: Optional[EngineHandle]
    spec: Optional[EngineSpec] = None
    restarts: int = 0
    router_id: Optional[str] = None
    pending: bool = False  # relaunched, not yet refit nor registered
    max_running: Optional[int] = None  # from its /server_info (None: it does not say)


@dataclass
class EngineFleet:
    """N engines (launched or external) and optionally sglang-router in front.

    ``refit_fn(url)`` is called for a restarted engine before it is registered with the router
    again (push the current weights; e.g. ``DiskWeightSync.push(dir, version, engine_urls=[url])``).
    ``node``: the trainer's node (:func:`~megatron_m2po.rollout.placement.node_gpus`): locally launched
    SGLang engines go on the GPUs :func:`~megatron_m2po.rollout.placement.engine_gpus` gives (after the
    trainer's when ``rollout.engine_gpu_ids`` is empty), and a Ray cluster started here gets only the
    GPUs after the trainer's. Default: this process's environment with no trainer on its GPUs
    unless it runs under torchrun (``LOCAL_WORLD_SIZE``). ``on_concurrency(n)`` is called with every new value of
    :attr:`concurrency` (from :meth:`start` on). ``on_engines(limits)`` (no router) is called with
    :meth:`dispatch_limits` whenever the engines may have changed (start, every
    :meth:`check_and_restart`, :meth:`admit`): pass it to :meth:`DispatchClient.set_engines`.
    """

    cfg: RolloutConfig
    model_path: str
    run_dir: str = "runs/default"
    launcher: Optional[Launcher] = None
    refit_fn: Optional[Callable[[str], None]] = None
    startup_timeout_s: float = 900.0
    node: Optional[NodeGPUs] = None
    weight_version: str = "0"
    extra_engine_args: list[str] = field(default_factory=list)
    on_concurrency: Optional[Callable[[int], None]] = None
    on_engines: Optional[Callable[[dict[str, int]], None]] = None
    # "teacher": a distillation teacher's fleet (rollout_service/teacher.py): it only scores, so its
    # engines need no integer weight version, and its errors name algo.distill.teacher_addrs
    role: str = "rollout"
    engines: list[_Engine] = field(default_factory=list, init=False)
    concurrency: int = field(default=0, init=False)
    _held: set = field(default_factory=set, init=False)
    router_url: Optional[str] = field(default=None, init=False)
    _router: Optional[LocalHandle] = field(default=None, init=False)
    _gpus: list[list[int]] = field(default_factory=list, init=False)

    # ------------------------------------------------------------------ public
    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    @property
    def url(self) -> str:
        """The router when one is used, else the single engine."""
        if self.router_url:
            return self.router_url
        if len(self.engines) != 1:
            raise FleetError(f"{len(self.engines)} engines and no router: use fleet.client() (it dispatches "
                             "over fleet.engine_urls itself) or set rollout.use_router=true")
        return self.engines[0].url

    def dispatch_limits(self) -> dict[str, int]:
        """``{url: in-flight bound}`` of the engines that take requests (not ``pending``): what each
        reports it can run, or ``rollout.concurrency`` split evenly over them."""
        live = [e for e in self.engines if not e.pending]
        if self.cfg.concurrency is not None:
            return split_limits([e.url for e in live], self.cfg.concurrency)
        return {e.url: e.max_running or FALLBACK_MAX_RUNNING for e in live}

    def client(self, *, timeout_s: Optional[float] = None, max_retries: Optional[int] = None,
               adapter: Optional[Callable[[], Optional[tuple[str, int]]]] = None) -> SGLangClient:
        """The trainer's generation client: an :class:`SGLangClient` of the router, or without one a
        :class:`DispatchClient` over :meth:`dispatch_limits` (module docstring). Create it on the event
        loop that uses it; with a DispatchClient, route ``on_engines`` to its ``set_engines``.
        ``adapter``: the LoRA adapter requests run under (``SGLangClient``'s)."""
        timeout_s = self.cfg.request_timeout_s if timeout_s is None else timeout_s
        retries = self.cfg.max_retries if max_retries is None else max_retries
        if self.router_url:
            return SGLangClient(self.router_url, concurrency=max(1, self.concurrency), timeout_s=timeout_s,
                                max_retries=retries, adapter=adapter)
        return DispatchClient(self.dispatch_limits(), timeout_s=timeout_s, max_retries=retries, adapter=adapter)

    def _announce(self) -> None:
        """Tell a dispatching client the engines (no router: it is the router)."""
        if self.router_url is None and self.on_engines is not None and self.engines:
            limits = self.dispatch_limits()
            if limits:
                self.on_engines(limits)

    @property
    def discovered(self) -> bool:
        """Engines come from the router's worker list (launcher=external with router_addr alone)."""
        return self.cfg.launcher == "external" and not self.cfg.external_addrs

    def start(self) -> "EngineFleet":
        cfg = self.cfg
        if self.discovered:
            if not cfg.router_addr:
                raise FleetSetupError("rollout.launcher=external needs rollout.external_addrs (http://host:port) "
                                 "or rollout.router_addr (an sglang-router the engines are registered with)")
            self._start_router()
            self._discover_initial()
            self._derive_concurrency()
            return self
        if cfg.launcher == "external":
            self.engines = [_Engine(i, a.rstrip("/"), None) for i, a in enumerate(cfg.external_addrs)]
            self._validate_external(self.engines, " (algo.distill.teacher_addrs)" if self.role == "teacher" else "")
        else:
            if cfg.num_engines < 1:
                raise FleetSetupError(f"rollout.num_engines={cfg.num_engines}: launch at least one engine")
            self._place()
            self.launcher = self.launcher or self._default_launcher()
            try:
                for i in range(cfg.num_engines):
                    spec = self._spec(i, self._engine_port(i))
                    handle = self.launcher.launch(spec)  # its url: a Ray actor may land on another node
                    self.engines.append(_Engine(i, handle.url, handle, spec))
                for e in self.engines:
                    self._wait_healthy(e)
                    self._check_version(e)
            except BaseException:
                self.stop()
                raise
        if cfg.use_router:
            try:
                self._start_router()
                for e in self.engines:
                    self._register(e)
            except BaseException:
                self.stop()
                raise
        self._derive_concurrency()
        self._announce()
        return self

    def refresh(self) -> list[str]:
        """A router-discovered fleet: re-read the router's workers (new healthy ones validated, gone
        ones dropped); returns the URLs that joined. Other fleets: nothing to do.

        An engine of the fleet that the router still lists but as unhealthy stays when this process
        holds it paused (:meth:`hold`: a paused SGLang engine fails the router's ``/health`` checks)
        or when it answers ``/health`` itself (the router re-marks it healthy only after
        ``--health-success-threshold`` checks); otherwise it is dropped with a warning."""
        if not self.discovered or self.router_url is None:
            return []
        workers = self._router_worker_health()
        known = {e.url for e in self.engines}
        joined = [_Engine(self._next_index(), u, None) for u, ok in workers.items() if ok and u not in known]
        self._validate_external(joined, where=f" (registered with the router {self.router_url})")
        kept, left = [], []
        for e in self.engines:
            if e.url not in workers:
                left.append(f"{e.url} (no longer registered)")
            elif workers[e.url] or e.url in self._held:
                kept.append(e)
            elif _run(_probe(e.url, 5.0)):
                log.info("the router lists %s as unhealthy but it answers /health (the router's checks lag "
                         "behind a pause); kept", e.url)
                kept.append(e)
            else:
                left.append(f"{e.url} (unhealthy in the router and not answering /health)")
        if left:
            log.warning("engines dropped from the fleet: %s", ", ".join(left))
        if joined:
            log.info("engines that joined the router: %s", ", ".join(e.url for e in joined))
        self.engines = kept + joined
        if not self.engines:
            raise FleetError(f"the router {self.router_url} lists no healthy engine (GET /workers): "
                             "start engines and register them with it (scripts/launch_sglang_fleet.sh)")
        self._derive_concurrency()
        return [e.url for e in joined]

    def hold(self, urls: Iterable[str]) -> None:
        """Note that this process pauses these engines (a weight push): :meth:`refresh` keeps them
        whatever the router says of their health until :meth:`release`."""
        self._held.update(u.rstrip("/") for u in urls)

    def release(self) -> None:
        """The pause of :meth:`hold` is over."""
        self._held.clear()

    def check_and_restart(self, *, refit: bool = True) -> list[str]:
        """Probe every engine; relaunch, refit and re-register dead ones. Returns their URLs.

        ``refit=False``: relaunched engines are neither refit nor registered; the caller loads the
        current weights into them (e.g. with the next weight push, which must rebuild distributed
        weight-update groups for them) and then calls :meth:`admit`.

        A router-discovered fleet restarts nothing (its engines belong to whoever runs the
        router): it is re-read from the router instead (:meth:`refresh`).
        """
        if self.discovered:
            self.refresh()
            return []
        restarted = []
        for e in self.engines:
            alive = e.handle.alive() if e.handle is not None else True
            if not self._dead(e, alive):
                continue
            if e.handle is None or e.spec is None:
                raise FleetSetupError(f"external engine {e.url} is not healthy; restart it and call again")
            log.warning("engine %d at %s is dead (process alive=%s); restarting", e.index, e.url, alive)
            if self.router_url and e.router_id:
                self._unregister(e)
            e.handle.stop()
            e.handle = self.launcher.launch(e.spec)
            e.url = e.handle.url
            e.restarts += 1
            self._wait_healthy(e)
            restarted.append(e.url)
            if not refit:
                e.pending = True
                continue
            if self.refit_fn is not None:
                self.refit_fn(e.url)
            if self.router_url:
                self._register(e)
        self._announce()  # listed engines were just probed healthy: a dispatching client uses them again
        return restarted

    def dead_urls(self) -> list[str]:
        """The engines :meth:`check_and_restart` would relaunch now (process exited, or no answer to
        ``/health``); nothing is restarted. Colocated mode asks first: a relaunched engine loads its
        whole memory at start-up, so the trainer offloads before (``trainer/colocated.py``)."""
        return [e.url for e in self.engines if self._dead(e)]

    @staticmethod
    def _dead(e: _Engine, alive: Optional[bool] = None) -> bool:
        if alive is None:
            alive = e.handle.alive() if e.handle is not None else True
        return not (alive and _run(_probe(e.url, 5.0)))

    @property
    def pending_urls(self) -> list[str]:
        """Relaunched engines waiting for their weights (``check_and_restart(refit=False)``)."""
        return [e.url for e in self.engines if e.pending]

    def admit(self) -> list[str]:
        """Register the relaunched engines that now hold the current weights with the router."""
        admitted = []
        for e in self.engines:
            if e.pending:
                if self.router_url:
                    self._register(e)
                e.pending = False
                admitted.append(e.url)
        if admitted:
            self._announce()
        return admitted

    def stop(self) -> None:
        """Terminate the router and every launched engine (in parallel), kill stragglers."""
        handles = [e.handle for e in self.engines if e.handle is not None]
        if self._router is not None:
            handles.append(self._router)
            self._router = None
        threads = [threading.Thread(target=h.stop) for h in handles]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def __enter__(self) -> "EngineFleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ launch
    def _place(self) -> list[list[int]]:
        """Each engine's visible-GPU indices on this node (``rollout/placement.py``), computed once."""
        if self.node is None:
            self.node = node_gpus(count=cuda_count(), trainer_on_gpu=False)
        if self.cfg.launcher != "local":  # Ray assigns each actor its GPUs
            return [[] for _ in range(self.cfg.num_engines)]
        if not self._gpus:
            try:
                self._gpus = engine_gpus(self.cfg, self.node)
            except ValueError as ex:
                raise FleetError(str(ex)) from None
        return self._gpus

    def _default_launcher(self) -> Launcher:
        if self.cfg.launcher == "ray":
            from megatron_m2po.rollout.ray_launcher import RayLauncher
            try:
                local = ray_local_gpus(self.cfg, self.node)
            except ValueError as ex:
                raise FleetError(str(ex)) from None
            return RayLauncher.from_config(self.cfg, local_gpus=local)
        return LocalLauncher()

    def _engine_port(self, i: int) -> int:
        return free_port(self.cfg.host) if self.cfg.base_port == 0 else self.cfg.base_port + i

    def _spec(self, i: int, port: int) -> EngineSpec:
        cfg = self.cfg
        logp = Path(self.run_dir) / "engines" / f"engine_{i}.log"
        if cfg.engine == "cpu_worker":
            cmd = [sys.executable, "-m", standin_module("cpu_worker"), "--model-path", self.model_path,
                   "--host", cfg.host, "--port", str(port), "--weight-version", self.weight_version,
                   "--dist-timeout-s", str(cfg.weight_sync_timeout_s)]
            env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        else:
            cmd = [sglang_python(), "-m", "sglang.launch_server", "--model-path", self.model_path,
                   "--tp-size", str(cfg.engine_tp), "--mem-fraction-static", str(cfg.engine_mem_fraction),
                   "--host", cfg.host, "--port", str(port), "--weight-version", self.weight_version]
            # Visible-GPU indices -> this node's CUDA_VISIBLE_DEVICES entries (rollout/placement.py).
            gpus = self._place()[i]
            env = {"CUDA_VISIBLE_DEVICES": ",".join(self.node.physical(g) for g in gpus)} if gpus else {}
        if cfg.engine_max_running_requests is not None:
            cmd += ["--max-running-requests", str(cfg.engine_max_running_requests)]
        if cfg.return_routed_experts:  # SGLang captures routed experts only with this server flag
            cmd += ["--enable-return-routed-experts"]
        if cfg.colocate:
            # Time-sharing: /release_memory_occupation frees weights and KV only with the memory saver
            # (SGLang 0.5.23 utils/torch_memory_saver_adapter.py: without it the adapter is a no-op). No
            # --enable-weights-cpu-backup: every resume of "weights" is followed by a full push.
            cmd += ["--enable-memory-saver"]
            # /health must not generate while weights / KV are released (a forward on unmapped memory
            # kills SGLang's scheduler): SGLang 0.5.23 entrypoints/http_server.py health_generate
            # answers 200 without one when this is false (environ.py, default true).
            env = {**env, "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}
        return EngineSpec(i, cfg.host, port, cmd + list(self.extra_engine_args), env, logp)

    def _wait_healthy(self, e: _Engine, what: str = "engine") -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if e.handle is not None and not e.handle.alive():
                raise FleetError(f"{what} {e.index} ({e.url}) exited during start-up. Last log lines "
                                 f"({e.handle.log_path}):\n{tail(e.handle.log_path)}")
            if _run(_probe(e.url, 2.0)):
                return
            time.sleep(0.25)
        raise FleetError(f"{what} {e.index} ({e.url}) not healthy after {self.startup_timeout_s:.0f}s. "
                         f"Last log lines:\n{tail(e.handle.log_path if e.handle else None)}")

    def _check_version(self, e: _Engine) -> None:
        info = _run(_get_json(e.url + "/server_info"))
        try:
            check_sglang_version(e.url, info)
        except ValueError as ex:
            raise FleetError(f"engine {e.index}: {ex}") from None
        e.max_running = max_running_requests(info)

    def _derive_concurrency(self) -> None:
        """:attr:`concurrency` from ``rollout.concurrency`` or the engines' limits; logged and passed to
        ``on_concurrency`` when it changes."""
        silent = []
        if self.cfg.concurrency is not None:
            n, how = self.cfg.concurrency, "rollout.concurrency"
        else:
            silent = [e.url for e in self.engines if e.max_running is None]
            n = sum(e.max_running or FALLBACK_MAX_RUNNING for e in self.engines)
            how = "derived: " + " + ".join(f"{e.max_running or FALLBACK_MAX_RUNNING} ({e.url}"
                                           + (", assumed)" if e.max_running is None else ")") for e in self.engines)
        if n != self.concurrency:
            if silent:
                log.warning("engines that report no max_running_requests in /server_info (neither "
                            "internal_states[*].effective_max_running_requests_per_dp nor max_running_requests): "
                            "%s; counting %d running requests for each. Set rollout.concurrency to choose the "
                            "fleet's in-flight requests yourself", ", ".join(silent), FALLBACK_MAX_RUNNING)
            log.info("rollout concurrency %d in-flight requests over %d engine(s) (%s)", n, len(self.engines), how)
            self.concurrency = n
            if self.on_concurrency is not None:
                self.on_concurrency(n)

    def _discover_initial(self) -> None:
        """Wait (up to ``startup_timeout_s``) until the router lists a healthy engine, then validate all."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            urls = self._healthy_router_urls()
            if urls or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if not urls:
            raise FleetSetupError(f"rollout.router_addr={self.cfg.router_addr}: the router lists no healthy engine "
                             f"after {self.startup_timeout_s:.0f}s (GET /workers); start the engines and register "
                             "them with it (scripts/launch_sglang_fleet.sh), or list them in rollout.external_addrs")
        self.engines = [_Engine(i, u, None) for i, u in enumerate(urls)]
        self._validate_external(self.engines, where=f" (registered with the router {self.router_url})")
        log.info("%d engine(s) discovered from the router %s: %s", len(urls), self.router_url, ", ".join(urls))

    def _healthy_router_urls(self) -> list[str]:
        """URLs of the workers the router lists as healthy, in its order (sglang-router 0.3.2
        lists a worker under ``GET /workers`` once its background add job has health-checked it)."""
        return [u for u, ok in self._router_worker_health().items() if ok]

    def _router_worker_health(self) -> dict[str, bool]:
        """``{url: is_healthy}`` of every worker the router lists, in its order. sglang-router 0.3.2
        keeps a worker that fails its health checks listed, with ``is_healthy`` false."""
        try:
            workers = self._router_workers()
        except (aiohttp.ClientError, EngineError, asyncio.TimeoutError) as ex:
            raise FleetError(f"sglang-router at {self.router_url}: GET /workers failed: {ex}") from None
        return {w["url"].rstrip("/"): bool(w.get("is_healthy", False)) for w in workers if w.get("url")}

    def _next_index(self) -> int:
        return max((e.index for e in self.engines), default=-1) + 1

    def _validate_external(self, engines: list[_Engine], where: str = "") -> None:
        problems = []
        for e in engines:
            if not e.url.startswith(("http://", "https://")):
                problems.append(f"{e.url}: not an http(s):// address")
                continue
            try:
                if not _run(_probe(e.url, 5.0)):
                    problems.append(f"{e.url}: /health is not 200 (down or still loading?)")
                    continue
                info = _run(_get_json(e.url + "/model_info"))
                if not info.get("is_generation", True):
                    problems.append(f"{e.url}: serves a non-generation model ({info.get('model_path')})")
                wv = str(info.get("weight_version", "0"))
                if not wv.isdigit() and self.role != "teacher":
                    # SGLang 0.5.23 tags weights "default" unless --weight-version is given
                    # (srt/arg_groups/fields/serving.py); token versions must be integers for the store.
                    problems.append(f"{e.url}: reports weight version {wv!r}, not an integer: start it with "
                                    "--weight-version 0 (scripts/launch_sglang_fleet.sh does)")
                server_info = _run(_get_json(e.url + "/server_info"))
                check_sglang_version(e.url, server_info)
                if self.cfg.return_routed_experts and not server_info.get("enable_return_routed_experts"):
                    # without it SGLang 0.5.23 silently drops return_routed_experts from every request
                    problems.append(f"{e.url}: rollout.return_routed_experts=true but the engine was started "
                                    "without --enable-return-routed-experts")
                e.max_running = max_running_requests(server_info)
            except (aiohttp.ClientError, EngineError, asyncio.TimeoutError, ValueError) as ex:
                problems.append(f"{e.url}: {type(ex).__name__}: {ex}")
        if problems:
            raise FleetSetupError(f"external engines{where} failed validation:\n  " + "\n  ".join(problems))

    # ------------------------------------------------------------------ router
    def _max_pause_s(self) -> float:
        """The longest a weight update may pause the engines: a disk push's load timeout follows the
        model's bytes (rollout/push_timeout.py), the base model's here."""
        cfg = self.cfg
        if cfg.weight_sync != "disk":
            return cfg.weight_sync_timeout_s
        return disk_push_timeout_s(checkpoint_bytes(self.model_path), cfg.weight_sync_timeout_s,
                                   cfg.weight_sync_min_gbps)

    def _start_router(self) -> None:
        cfg = self.cfg
        if cfg.router_addr:
            self.router_url = cfg.router_addr.rstrip("/")
            try:
                _run(_get_json(self.router_url + "/workers"))
            except (aiohttp.ClientError, EngineError, asyncio.TimeoutError) as ex:
                raise FleetSetupError(f"rollout.router_addr={cfg.router_addr}: not a reachable sglang-router "
                                 f"(GET /workers failed: {ex})") from None
            return
        port = free_port(cfg.host) if cfg.base_port == 0 else cfg.base_port - 1
        logp = Path(self.run_dir) / "engines" / "router.log"
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", cfg.host, "--port", str(port),
               "--policy", "cache_aware", "--prometheus-host", cfg.host,
               "--prometheus-port", str(free_port(cfg.host)), "--log-level", "warn",
               "--shutdown-grace-period-secs", "1",
               "--request-timeout-secs", str(int(cfg.request_timeout_s)),
               # engines paused by a weight update (up to its timeout) stay routable
               *router_health_flags(self._max_pause_s())]
        spec = EngineSpec(-1, cfg.host, port, cmd, {}, logp)
        self._router = LocalLauncher().launch(spec)
        self.router_url = spec.url
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not self._router.alive():
                raise FleetError(f"sglang-router exited at start-up. Last log lines:\n{tail(logp)}")
            try:
                _run(_get_json(self.router_url + "/workers", 2.0))
                return
            except (aiohttp.ClientError, EngineError, asyncio.TimeoutError):
                time.sleep(0.25)
        raise FleetError(f"sglang-router at {self.router_url} not up after 60s:\n{tail(logp)}")

    def _router_workers(self) -> list[dict]:
        return _run(_get_json(self.router_url + "/workers")).get("workers", [])

    def _register(self, e: _Engine, timeout_s: float = 60.0) -> None:
        async def post():
            async with SGLangClient(self.router_url, max_retries=2) as c:
                return await c.request("POST", "/workers", {"url": e.url})
        out = _run(post())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for w in self._router_workers():
                if w.get("url", "").rstrip("/") == e.url and w.get("is_healthy", False):
                    e.router_id = w.get("id") or (out or {}).get("worker_id")
                    return
            time.sleep(0.2)
        raise FleetError(f"sglang-router did not activate worker {e.url} within {timeout_s:.0f}s "
                         f"(POST /workers answered {out}); router log:\n{tail(Path(self.run_dir) / 'engines' / 'router.log')}")

    def _unregister(self, e: _Engine, timeout_s: float = 30.0) -> None:
        async def delete():
            async with SGLangClient(self.router_url, max_retries=2) as c:
                return await c.request("DELETE", f"/workers/{e.router_id}")
        _run(delete())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(w.get("id") != e.router_id for w in self._router_workers()):
                e.router_id = None
                return
            time.sleep(0.2)
        raise FleetError(f"sglang-router did not remove worker {e.url} within {timeout_s:.0f}s")
