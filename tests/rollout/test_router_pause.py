"""Engines paused by a long weight update behind the real sglang-router 0.3.2.

A paused SGLang engine answers ``/health`` 503 (after SGLANG_HEALTH_CHECK_TIMEOUT), and the router
marks a worker that fails ``--health-failure-threshold`` checks in a row unhealthy: it keeps it listed
but routes nothing to it, and ``EngineFleet.refresh`` used to drop it from a router-discovered fleet,
so the engine missed the next push. Here the router's checks are scaled down (1 s interval, 1 s
timeout, 2 failures; the CPU worker's health check times out after 2 s), so a pause of a few seconds
stands for a 32B disk load of minutes.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from megatron_m2po.config import RolloutConfig
from megatron_m2po.rollout.client import SGLangClient
from megatron_m2po.rollout.engines import EngineFleet, router_health_flags
from megatron_m2po.rollout.launcher import EngineSpec, LocalLauncher
from megatron_m2po.rollout.sglang_version import SUPPORTED_SGLANG
from megatron_m2po.utils.net import free_port
from rollout_testlib import FakeEngine
from waiting import wait_until

# The worker walks through pauses and registrations test after test: keep file order.
pytestmark = pytest.mark.random_order(disabled=True)
pytestmark = [pytestmark, pytest.mark.slow]  # engine processes, routers or multi-rank sweeps in module fixtures: the full suite's lane

QUICK = ["--health-check-interval-secs", "1", "--health-check-timeout-secs", "1", "--health-failure-threshold", "2"]


def call(url: str, method: str, *args):
    async def go():
        async with SGLangClient(url, max_retries=0) as c:
            return await getattr(c, method)(*args)
    return asyncio.run(go())


def workers(router: str) -> dict[str, bool]:
    return {w["url"]: w["is_healthy"] for w in call(router, "request", "GET", "/workers")["workers"]}


def register(router: str, url: str) -> None:
    call(router, "request", "POST", "/workers", {"url": url})
    wait_until(lambda: workers(router).get(url), what=f"router {router} listing {url} healthy", timeout=60)


class Procs:
    def __init__(self, d) -> None:
        self.d, self.handles = d, []

    def start(self, name: str, cmd: list[str], port: int, env: dict) -> str:
        spec = EngineSpec(len(self.handles), "127.0.0.1", port, cmd, env, self.d / f"{name}.log")
        self.handles.append(LocalLauncher().launch(spec))
        return spec.url

    def router(self, name: str, flags: list[str]) -> str:
        port = free_port()
        url = self.start(name, [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                                str(port), "--log-level", "warn", "--prometheus-port", str(free_port()), *flags],
                         port, {})
        wait_until(lambda: _answers(url), what=f"router {name} up", timeout=60, hopeless=self.hopeless)
        return url

    def hopeless(self):
        return next((f"a process exited; see {self.d}" for h in self.handles if not h.alive()), None)


def _answers(router: str) -> bool:
    try:
        workers(router)
        return True
    except Exception:  # noqa: BLE001 - not listening yet
        return False


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    procs = Procs(tmp_path_factory.mktemp("router_pause"))
    fake = FakeEngine({"version": SUPPORTED_SGLANG, "internal_states": [{"effective_max_running_requests_per_dp": 5}]})
    try:
        router = procs.router("router", QUICK)
        port = free_port()
        worker = procs.start("worker", [sys.executable, "-m", "megatron_m2po.standins.cpu_worker", "--model-path",
                                        tiny_model_dir, "--port", str(port), "--weight-version", "0",
                                        "--max-running-requests", "3"],
                             port, {"OMP_NUM_THREADS": "1", "SGLANG_HEALTH_CHECK_TIMEOUT": "2"})
        wait_until(lambda: call(worker, "health"), what="CPU worker healthy", timeout=120, hopeless=procs.hopeless)
        yield procs, router, worker, fake.url
    finally:
        for h in procs.handles:
            h.stop()
        fake.close()
def test_router_flags_keep_an_engine_paused_for_a_weight_update_routable(env):
    """With router_health_flags(P) the router still lists an engine paused for P seconds healthy; a
    router with 0.3.2's rule scaled down (2 failed checks) marks it unhealthy within that pause."""
    procs, quick, worker, _ = env
    pause_s = 6.0
    ours = procs.router("router_ours", router_health_flags(pause_s, interval_s=1, timeout_s=1))
    register(quick, worker)
    register(ours, worker)
    call(worker, "pause_generation", "in_place")
    t0 = time.monotonic()
    try:
        seen_ours, quick_flipped = [], None
        while time.monotonic() - t0 < pause_s:  # elapsed time is the behaviour under test: the pause length
            seen_ours.append(workers(ours)[worker])
            if quick_flipped is None and not workers(quick)[worker]:
                quick_flipped = time.monotonic() - t0
            time.sleep(0.2)  # elapsed time is the behaviour under test: polls spread over the pause
    finally:
        call(worker, "continue_generation")
    assert quick_flipped is not None, f"the 2-failure router still listed {worker} healthy after a {pause_s} s pause"
    assert all(seen_ours), (f"the router with {router_health_flags(pause_s, interval_s=1, timeout_s=1)} marked the "
                            f"paused engine unhealthy at poll {seen_ours.index(False)}")


def test_refresh_keeps_engines_held_paused_and_drops_engines_that_are_gone(env, tiny_model_dir, caplog):
    procs, router, worker, fake = env
    register(router, worker)
    heard: list[int] = []
    fleet = EngineFleet(RolloutConfig(launcher="external", router_addr=router), tiny_model_dir,
                        run_dir=str(procs.d), on_concurrency=heard.append).start()
    assert fleet.engine_urls == [worker] and fleet.concurrency == 3

    register(router, fake)  # joins: the limit follows
    assert fleet.refresh() == [fake] and fleet.concurrency == 3 + 5 and heard == [3, 8]
    assert call(router, "fleet_max_running") == {worker: 3, fake: 5}  # what `m2po eval` at the router reads

    # A weight push holds the worker paused: the router marks it unhealthy, the fleet keeps it.
    fleet.hold([worker])
    call(worker, "pause_generation", "in_place")
    try:
        wait_until(lambda: not workers(router)[worker], what=f"the router marking paused {worker} unhealthy",
                   timeout=60)
        assert fleet.refresh() == [] and fleet.engine_urls == [worker, fake] and fleet.concurrency == 8
    finally:
        call(worker, "continue_generation")
        fleet.release()
    # Released, whatever the router says now: it answers /health itself.
    assert fleet.refresh() == [] and fleet.engine_urls == [worker, fake]

    # Paused by someone else (not held) and not answering /health: dropped, and the limit follows.
    call(worker, "pause_generation", "in_place")
    try:
        wait_until(lambda: not workers(router)[worker], what=f"the router marking paused {worker} unhealthy",
                   timeout=60)
        with caplog.at_level("WARNING", logger="m2po.engines"):
            assert fleet.refresh() == []
    finally:
        call(worker, "continue_generation")
    assert fleet.engine_urls == [fake] and fleet.concurrency == 5 and heard == [3, 8, 5]
    assert any(worker in r.getMessage() and "not answering /health" in r.getMessage() for r in caplog.records)
