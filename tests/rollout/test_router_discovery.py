"""Router-only external fleets behind the real sglang-router 0.3.2: engines are discovered from
its ``GET /workers``, version-checked, refit on every push (disk and distributed), and engines
that join or leave the router are picked up at the next push (``EngineFleet.refresh``, which
``weights/push.py`` ``WeightPushController.begin`` calls before every push)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from megatron_m2po.config import RolloutConfig
from megatron_m2po.rollout.client import SGLangClient
from megatron_m2po.rollout.engines import EngineFleet, FleetError
from megatron_m2po.rollout.launcher import EngineSpec, LocalLauncher
from megatron_m2po.rollout.sglang_version import SUPPORTED_SGLANG
from megatron_m2po.weights.disk import DiskWeightSync
from megatron_m2po.weights.distributed import DistributedWeightSync
from megatron_m2po.utils.net import free_port
from waiting import wait_until

# One router and two workers walk through weight versions 1..4 test after test: keep file order.
pytestmark = pytest.mark.random_order(disabled=True)
pytestmark = [pytestmark, pytest.mark.slow]  # engine processes, routers or multi-rank sweeps in module fixtures: the full suite's lane


def call(url: str, method: str, *args):
    async def go():
        async with SGLangClient(url, max_retries=1) as c:
            return await getattr(c, method)(*args)
    return asyncio.run(go())


def router_workers(router: str) -> list[dict]:
    async def go():
        async with SGLangClient(router, max_retries=1) as c:
            return await c.request("GET", "/workers")
    return asyncio.run(go())["workers"]


def healthy(router: str) -> set[str]:
    return {w["url"] for w in router_workers(router) if w.get("is_healthy")}


def register(router: str, url: str) -> None:
    async def go():
        async with SGLangClient(router, max_retries=1) as c:
            return await c.request("POST", "/workers", {"url": url})
    asyncio.run(go())
    wait_until(lambda: url in healthy(router), what=f"router {router} listing {url} healthy", timeout=60)


def unregister(router: str, url: str) -> None:
    wid = next(w["id"] for w in router_workers(router) if w["url"] == url)

    async def go():
        async with SGLangClient(router, max_retries=1) as c:
            return await c.request("DELETE", f"/workers/{wid}")
    asyncio.run(go())
    wait_until(lambda: url not in {w["url"] for w in router_workers(router)},
               what=f"router {router} dropping {url}", timeout=30)


def perturbed(model_dir: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file
    g = torch.Generator().manual_seed(seed)
    sd = load_file(str(Path(model_dir) / "model.safetensors"))
    return [(n, t + 0.05 * torch.randn(t.shape, generator=g)) for n, t in sorted(sd.items())]


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("router_discovery")
    launcher = LocalLauncher()
    handles = []

    def start(index: int, cmd: list[str], port: int):
        spec = EngineSpec(index, "127.0.0.1", port, cmd, {"OMP_NUM_THREADS": "1"}, d / f"proc_{index}.log")
        handles.append(launcher.launch(spec))
        return spec.url

    try:
        rport = free_port()
        router = start(-1, [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                            "--port", str(rport), "--log-level", "warn", "--prometheus-port", str(free_port()),
                            "--health-check-interval-secs", "1"], rport)
        workers = []
        for i in range(2):
            port = free_port()
            workers.append(start(i, [sys.executable, "-m", "megatron_m2po.standins.cpu_worker", "--model-path",
                                     tiny_model_dir, "--port", str(port), "--weight-version", "0"], port))
        for u in [router, *workers]:
            wait_until(lambda u=u: call(u, "health") if u != router else _up(router), what=f"{u} up",
                       timeout=120, hopeless=lambda: next((f"a process exited; see {d}" for h in handles
                                                           if not h.alive()), None))
        yield d, router, workers
    finally:
        for h in handles:
            h.stop()


def _up(router: str) -> bool:
    try:
        router_workers(router)
        return True
    except Exception:  # noqa: BLE001 - not listening yet
        return False
def test_empty_router_is_a_clear_error(env, tiny_model_dir):
    d, router, _ = env
    cfg = RolloutConfig(launcher="external", router_addr=router)
    fleet = EngineFleet(cfg, tiny_model_dir, run_dir=str(d), startup_timeout_s=0.5)
    with pytest.raises(FleetError, match="lists no healthy engine"):
        fleet.start()


def test_discovered_engines_are_refit_and_joiners_picked_up_at_the_next_push(env, tiny_model_dir):
    d, router, (a, b) = env
    register(router, a)
    fleet = EngineFleet(RolloutConfig(launcher="external", router_addr=router), tiny_model_dir,
                        run_dir=str(d)).start()
    assert fleet.engine_urls == [a] and fleet.url == router
    disk = DiskWeightSync(fleet.engine_urls, str(d / "weights"), base_model_dir=tiny_model_dir, timeout_s=30)
    dist = DistributedWeightSync(fleet.engine_urls, backend="gloo", timeout_s=30)
    try:
        # What WeightPushController.begin does: refresh, then push to the fleet's URLs.
        assert fleet.refresh() == []
        disk.push(iter(perturbed(tiny_model_dir, 1)), 1, engine_urls=fleet.engine_urls)
        assert call(a, "weight_version") == "1" and call(b, "weight_version") == "0"

        register(router, b)  # joins between pushes
        assert fleet.refresh() == [b] and sorted(fleet.engine_urls) == sorted([a, b])
        disk.push(iter(perturbed(tiny_model_dir, 2)), 2, engine_urls=fleet.engine_urls)
        assert {call(u, "weight_version") for u in (a, b)} == {"2"}
        fleet.refresh()
        dist.push(iter(perturbed(tiny_model_dir, 3)), 3, engine_urls=fleet.engine_urls)
        assert {call(u, "weight_version") for u in (a, b)} == {"3"}

        unregister(router, a)  # leaves: the next push no longer reaches it
        assert fleet.refresh() == [] and fleet.engine_urls == [b]
        dist.push(iter(perturbed(tiny_model_dir, 4)), 4, engine_urls=fleet.engine_urls)
        assert call(b, "weight_version") == "4" and call(a, "weight_version") == "3"
        assert fleet.check_and_restart() == []  # restarts nothing: the engines are not ours
    finally:
        dist.close()
        disk.close()
        fleet.stop()
    assert call(a, "health") and call(b, "health")  # stopping a discovered fleet leaves the engines


@pytest.mark.parametrize("sglang, weight_version, why", [
    ("0.5.6", "0", "'0.5.6'"),
    (SUPPORTED_SGLANG, "default", "weight version 'default', not an integer")])
def test_engine_joining_the_router_is_validated_by_name(env, tiny_model_dir, sglang, weight_version, why):
    """A worker the router accepts but whose /server_info names another SGLang, or that was started
    without --weight-version (SGLang's tag is then "default"), is refused by name."""
    from aiohttp import web
    import threading

    d, router, (_, b) = env
    async def health(_):
        return web.Response(status=200)

    async def model_info(_):
        return web.json_response({"is_generation": True, "weight_version": weight_version})

    async def server_info(_):
        return web.json_response({"version": sglang})

    fake = web.Application()
    fake.router.add_get("/health", health)
    fake.router.add_get("/model_info", model_info)
    fake.router.add_get("/server_info", server_info)
    port = free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(fake)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{port}"
    try:
        fleet = EngineFleet(RolloutConfig(launcher="external", router_addr=router), tiny_model_dir,
                            run_dir=str(d)).start()
        assert b in fleet.engine_urls
        register(router, url)
        with pytest.raises(FleetError) as e:
            fleet.refresh()
        assert url in str(e.value) and why in str(e.value) and router in str(e.value)
        unregister(router, url)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
