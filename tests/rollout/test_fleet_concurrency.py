"""rollout.concurrency derived from the fleet: the sum of what each engine reports it can run.

SGLang 0.5.23 reports the limit its schedulers use in ``/server_info`` ``internal_states[i]
["effective_max_running_requests_per_dp"]`` (one entry per data-parallel rank); the top-level
``max_running_requests`` is the start-up argument, null unless given. A fleet sized by a fixed
default (64 for the whole fleet) ran a 32B recipe's 2,048 requests 16 per engine.
"""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest
from aiohttp import web

from megatron_m2po.config import RolloutConfig
from megatron_m2po.rollout.client import SGLangClient, max_running_requests
from megatron_m2po.rollout.engines import FALLBACK_MAX_RUNNING, EngineFleet
from megatron_m2po.rollout.launcher import EngineSpec, LocalLauncher
from megatron_m2po.rollout.sglang_version import SUPPORTED_SGLANG
from megatron_m2po.utils.net import free_port
from rollout_testlib import FakeEngine
from waiting import async_wait_until, wait_until

pytestmark = pytest.mark.slow  # engine processes, routers or multi-rank sweeps in module fixtures: the full suite's lane


def sglang_server_info(per_dp: list[int] | None, top: int | None = None) -> dict:
    """The fields of SGLang 0.5.23's /server_info read here (http_server.py server_info)."""
    states = ([{"effective_max_running_requests_per_dp": n, "last_gen_throughput": 0.0} for n in per_dp]
              if per_dp else [{"last_gen_throughput": 0.0}])
    return {"max_running_requests": top, "tp_size": 4, "dp_size": len(per_dp or [1]), "version": SUPPORTED_SGLANG,
            "internal_states": states}


def test_max_running_requests_reads_what_sglang_0523_reports():
    assert max_running_requests(sglang_server_info([256, 256])) == 512  # two DP ranks, no start-up argument
    assert max_running_requests(sglang_server_info([100], top=128)) == 100  # memory capped the argument
    assert max_running_requests(sglang_server_info(None, top=48)) == 48  # only the start-up argument
    assert max_running_requests(sglang_server_info(None)) is None
    assert max_running_requests({"internal_states": [{"effective_max_running_requests_per_dp": 0}]}) is None
    assert max_running_requests({"max_running_requests": True}) is None
    assert max_running_requests("not a dict") is None


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory):
    """A CPU worker running 3 requests at once and an SGLang-shaped engine with two DP ranks of 7."""
    d = tmp_path_factory.mktemp("concurrency")
    port = free_port()
    spec = EngineSpec(0, "127.0.0.1", port, [sys.executable, "-m", "megatron_m2po.standins.cpu_worker",
                                              "--model-path", tiny_model_dir, "--port", str(port),
                                              "--weight-version", "0", "--max-running-requests", "3"],
                      {"OMP_NUM_THREADS": "1"}, d / "worker.log")
    handle = LocalLauncher().launch(spec)
    fake = FakeEngine(sglang_server_info([7, 7]))
    silent = FakeEngine({"version": SUPPORTED_SGLANG, "internal_states": [{}]})

    async def up():
        async with SGLangClient(spec.url, max_retries=0) as c:
            return await c.health(2.0)
    try:
        wait_until(lambda: asyncio.run(up()), what=f"CPU worker {spec.url} healthy", timeout=120,
                   hopeless=lambda: None if handle.alive() else f"it exited; see {spec.log_path}")
        yield d, spec.url, fake.url, silent.url
    finally:
        handle.stop()
        fake.close()
        silent.close()


def _fleet(d, model_dir, addrs, **kw) -> tuple[EngineFleet, list[int]]:
    heard: list[int] = []
    cfg = RolloutConfig(launcher="external", external_addrs=addrs, use_router=False, **kw)
    return EngineFleet(cfg, model_dir, run_dir=str(d), on_concurrency=heard.append), heard
def test_concurrency_is_the_sum_of_the_engines_limits(engines, tiny_model_dir):
    d, worker, fake, _ = engines
    fleet, heard = _fleet(d, tiny_model_dir, [worker, fake])
    fleet.start()
    assert fleet.concurrency == 3 + 2 * 7 and heard == [17]
    assert [e.max_running for e in fleet.engines] == [3, 14]

    async def info():
        async with SGLangClient(worker) as c:
            return await c.get_server_info()
    states = asyncio.run(info())["internal_states"]  # the CPU worker reports where SGLang 0.5.23 does
    assert [s["effective_max_running_requests_per_dp"] for s in states] == [3]


def test_an_integer_rollout_concurrency_is_used_as_given(engines, tiny_model_dir):
    d, worker, fake, _ = engines
    fleet, heard = _fleet(d, tiny_model_dir, [worker, fake], concurrency=40)
    fleet.start()
    assert fleet.concurrency == 40 and heard == [40]


def test_an_engine_that_reports_no_limit_counts_as_the_fallback_with_a_warning(engines, tiny_model_dir, caplog):
    d, worker, _, silent = engines
    fleet, _ = _fleet(d, tiny_model_dir, [worker, silent])
    with caplog.at_level(logging.WARNING, logger="m2po.engines"):
        fleet.start()
    assert fleet.concurrency == 3 + FALLBACK_MAX_RUNNING
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert silent in warning and "rollout.concurrency" in warning and worker not in warning


def test_client_limit_follows_set_concurrency():
    """At most ``concurrency`` generate calls reach the engine; raising the limit lets the waiting ones in."""
    async def scenario():
        arrived, release = [], asyncio.Event()

        async def generate(request):
            arrived.append(await request.json())
            await release.wait()
            return web.json_response({"output_ids": [1], "meta_info": {"weight_version": "0"}})

        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with SGLangClient(f"http://127.0.0.1:{port}", concurrency=2, timeout_s=60) as c:
                tasks = [asyncio.ensure_future(c.generate([1, 2], {"max_new_tokens": 1})) for _ in range(5)]
                await async_wait_until(lambda: len(arrived) == 2, what="2 requests at the engine")
                await async_wait_until(lambda: c._sem.active == 2, what="2 requests holding the client's limit")
                assert len(arrived) == 2 and not any(t.done() for t in tasks)
                await c.set_concurrency(4)
                await async_wait_until(lambda: len(arrived) == 4, what="4 requests at the engine after raising to 4")
                assert c._sem.active == 4
                release.set()
                outs = await asyncio.gather(*tasks)
            return outs, len(arrived)
        finally:
            await runner.cleanup()

    outs, n = asyncio.run(scenario())
    assert n == 5 and all(o.output_ids == [1] for o in outs)


def test_fleet_max_running_at_an_engine_url(engines):
    """What `m2po eval --engine-url` derives from when pointed at an engine (no GET /workers there)."""
    _, worker, fake, silent = engines

    async def limits(url):
        async with SGLangClient(url, max_retries=0) as c:
            return await c.fleet_max_running()
    assert asyncio.run(limits(worker)) == {worker: 3}
    assert asyncio.run(limits(fake)) == {fake: 14}
    assert asyncio.run(limits(silent)) == {silent: None}
