"""Client-side dispatch over two CPU engines without sglang-router (``rollout/dispatch.py``).

Two CPU workers started by the fleet with ``rollout.use_router=false`` and
``--enable-return-routed-experts`` on the tiny random Qwen3-MoE of ``test_routed_experts.py``.
Where a request ran is read from the engines themselves: each worker's ``/v1/loads``
``total_prefill_uncached_tokens`` (SGLang 0.5.23 ``LoadSnapshot``: tokens its prefills computed; a
prefix-cache hit computes nothing) and ``num_running_reqs``. Routed experts are checked against the
independent HF reference of ``test_routed_experts.py``. Tests run in file order on one fleet: the
engine killed in ``test_killed_engine...`` is relaunched there and then gets the weight push.
"""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest
import torch

from megatron_m2po.config import RolloutConfig
from megatron_m2po.data.dataset import PromptItem
from megatron_m2po.rollout.dispatch import DispatchClient, split_limits
from megatron_m2po.rollout.engines import EngineFleet
from megatron_m2po.rollout.launcher import FleetError
from megatron_m2po.rollout.producer import ProducerContext, default_producer
from megatron_m2po.weights.disk import DiskWeightSync
from test_routed_experts import LAYERS, TOP_K, _Chars, _reference, _tiny_moe
from waiting import async_wait_until

# One fleet walked through a kill, a relaunch and a weight push: tests keep file order (docs/contributing.md).
pytestmark = pytest.mark.random_order(disabled=True)
pytestmark = [pytestmark, pytest.mark.slow]  # engine processes, routers or multi-rank sweeps in module fixtures: the full suite's lane

PARAMS = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = _tiny_moe(tmp_path_factory.mktemp("tiny_moe"))
    cfg = RolloutConfig(engine="cpu_worker", launcher="local", num_engines=2, base_port=0, use_router=False,
                        return_routed_experts=True, concurrency=8)
    f = EngineFleet(cfg, d, run_dir=str(tmp_path_factory.mktemp("run")), startup_timeout_s=120)
    try:
        f.start()
        yield d, f
    finally:
        f.stop()


class _NoReward:
    """The default producer scores responses; these tests look only at where they were generated."""

    def score_batch(self, texts, answers):
        return type("R", (), {"scores": [0.0] * len(texts)})()


async def _loads(c: DispatchClient) -> dict[str, dict]:
    return {u: await c.client_for(u).loads() for u in c.engine_urls}


def _prompt(g: int) -> list[int]:
    return [5 + g % 50, 9, 14, 3, 22, 7, 40, 11 + g % 40, 2 + (3 * g) % 50]  # distinct for g < 200, ids < 64


def test_fleet_without_router_dispatches_and_splits_concurrency(fleet):
    """The fleet's client is a DispatchClient over both engines with ``rollout.concurrency`` split
    between them; ``fleet.url`` names the way to several engines."""
    _, f = fleet
    assert f.router_url is None and len(f.engine_urls) == 2
    assert f.dispatch_limits() == dict(zip(f.engine_urls, (4, 4)))
    assert split_limits(["a", "b", "c"], 8) == {"a": 3, "b": 3, "c": 2}
    assert split_limits(["a", "b"], 1) == {"a": 1, "b": 1}  # every engine takes at least one
    with pytest.raises(FleetError, match="use fleet.client()"):
        _ = f.url
    c = f.client()
    assert isinstance(c, DispatchClient) and c.engine_urls == f.engine_urls


def test_groups_stay_on_one_engine_spread_over_both_and_return_routed_experts(fleet):
    """Six prompt groups of four samples through the default producer, one group at a time: after
    each, exactly one engine prefilled anything (the group's samples and prompt all ran there), the
    groups went to both engines, and every sample's routed experts equal the HF reference. An
    agentic group (two three-turn episodes) likewise runs on one engine."""
    from test_episodes import Scripted

    from megatron_m2po.rollout.episodes import EpisodeSettings, run_episode

    d, f = fleet
    tok = _Chars()

    async def go():
        landed, groups = [], []
        async with f.client() as c:
            for g in range(6):
                ctx = ProducerContext(client=c, tokenizer=tok, reward=_NoReward(), sampling_params=PARAMS,
                                      n_samples=4, version=0, group_prefix=f"s{g}", seed=g,
                                      routed_experts=(LAYERS, TOP_K))
                before = await _loads(c)
                groups += await default_producer(ctx, [PromptItem(g, "", "", "", _prompt(g))])
                after = await _loads(c)
                landed.append([u for u in c.engine_urls if after[u]["total_prefill_uncached_tokens"]
                               > before[u]["total_prefill_uncached_tokens"]])
            ctx = ProducerContext(client=c, tokenizer=tok, reward=None, n_samples=2, version=0, group_prefix="a",
                                  sampling_params={**PARAMS, "max_new_tokens": 4}, seed=1,
                                  routed_experts=(LAYERS, TOP_K))
            row = PromptItem(index=0, problem="3+4", answer="7", prompt="3+4=", prompt_ids=tok.encode("3+4="))
            before = await _loads(c)
            episodes = await asyncio.gather(*(run_episode(ctx, lambda: Scripted(["xy", "zw"]), row, group="a-g0", j=j,
                                                          settings=EpisodeSettings(max_turns=5, format="raw"))
                                              for j in range(2)))
            after = await _loads(c)
            agentic = [u for u in c.engine_urls if after[u]["total_prefill_uncached_tokens"]
                       > before[u]["total_prefill_uncached_tokens"]]
            return landed, groups, episodes, agentic
    landed, groups, episodes, agentic = asyncio.run(go())
    assert all(len(w) == 1 for w in landed), f"a group's samples ran on several engines: {landed}"
    assert {w[0] for w in landed} == set(f.engine_urls), f"the groups did not spread over both engines: {landed}"
    assert len(agentic) == 1, f"an agentic group's turns ran on several engines: {agentic}"
    assert all(t.metadata["episode"]["turns"] == 3 for t in episodes)
    for t in [g.trajectories[0] for g in groups] + episodes:
        ids = list(t.prompt_ids) + list(t.response_ids)
        np.testing.assert_array_equal(t.routed_experts, _reference(d, ids)[:-1])


def test_control_calls_reach_every_engine_and_an_abort_its_owner(fleet):
    """Without a router nothing fans out for us: pause / continue, health, flush, weight version,
    server info and loads go to every engine; an abort of one rid goes to the engine running it and
    ends it there (SGLang answers it with finish_reason abort); abort_all reaches both."""
    _, f = fleet

    async def go():
        async with f.client() as c:
            urls = c.engine_urls
            paused = await c.pause_generation("in_place")
            assert set(paused) == set(urls)
            *each, whole = await asyncio.gather(*(c.client_for(u).health(1.0) for u in urls), c.health(1.0))
            assert each == [False, False] and not whole  # both paused: no /health answer
            await c.continue_generation()
            assert await c.health() and await c.flush_cache()
            assert await c.weight_version() == "0"
            assert set(await c.get_server_info()) == set(urls)
            assert await c.fleet_max_running() == {u: 64 for u in urls}
            await c.slow_down(0.2)
            job = asyncio.create_task(c.generate(_prompt(30), PARAMS, rid="r-abort", affinity="x"))
            owner = await async_wait_until(lambda: c.engine_of("x"), what="an engine for the request")
            await async_wait_until(lambda: _running(c, owner), what=f"the request running on {owner}")
            assert (await c.loads())["num_running_reqs"] == 1  # summed over both engines
            assert await c.abort("r-abort") == [owner]
            out = await job
            assert out.aborted and len(out.output_ids) < 8
            assert set(await c.abort(abort_all=True)) == set(urls)
            await c.slow_down(None)
    asyncio.run(go())


async def _running(c: DispatchClient, url: str) -> bool:
    return (await c.client_for(url).loads())["num_running_reqs"] == 1


def test_killed_engine_requests_finish_on_the_other_and_a_restart_rejoins(fleet):
    """Ten requests slowed down, at most four in flight per engine (``rollout.concurrency=8`` split):
    each engine runs four by its own count while two wait in the client; one engine is SIGKILLed
    while it runs them: every request still finishes (its engine's on the other, counted there), the
    dead engine is marked down; the fleet's restart announces it and the client sends to it again."""
    _, f = fleet
    victim = f.engines[1]
    loop = asyncio.new_event_loop()  # one client across the restart, which runs on this thread
    c = f.client()

    async def kill():
        await c.slow_down(0.2)
        before = c.engine_stats()
        jobs = [asyncio.create_task(c.generate(_prompt(20 + i), PARAMS, affinity=f"k{i}")) for i in range(10)]
        await async_wait_until(lambda: _running_on_both(c, 4), what="four requests on each engine (its /v1/loads)")
        assert sorted(s["inflight"] for s in c.engine_stats().values()) == [4, 4]  # the other two wait
        await c.set_engines(f.dispatch_limits())  # an announcement while requests run keeps their slots
        on_victim = c.engine_stats()[victim.url]["inflight"]
        os.kill(victim.handle.proc.pid, signal.SIGKILL)
        return before, on_victim, await asyncio.gather(*jobs)

    async def rejoin(limits):
        await c.set_engines(limits)
        sent = c.engine_stats()[victim.url]
        out = await c.generate(_prompt(40), PARAMS, affinity="after-restart")  # fewest sent: the victim
        await c.slow_down(None)
        return sent, out

    announced = []
    try:
        before, on_victim, outs = loop.run_until_complete(kill())
        stats = c.engine_stats()
        survivor = next(u for u in c.engine_urls if u != victim.url)
        assert [o.finish_type for o in outs] == ["length"] * 10 and all(len(o.output_ids) == 8 for o in outs)
        assert stats[victim.url]["down"] and not stats[survivor]["down"]
        assert all(v["inflight"] == 0 for v in stats.values()), stats  # every slot taken was given back
        # the survivor ran its own first attempts and every request the victim had again
        moved = stats[survivor]["sent"] - before[survivor]["sent"] - (10 - (stats[victim.url]["sent"]
                                                                          - before[victim.url]["sent"]))
        assert moved >= on_victim > 0, (moved, on_victim, stats)
        # restart from this thread, as the trainer does from its main one
        f.on_engines = announced.append
        restarted = f.check_and_restart()
        assert restarted == [victim.url] and announced and set(announced[-1]) == set(f.engine_urls)
        sent, out = loop.run_until_complete(rejoin(announced[-1]))
        assert not sent["down"] and out.finish_type == "length"
        assert c.engine_stats()[victim.url]["sent"] == sent["sent"] + 1
    finally:
        f.on_engines = None
        loop.run_until_complete(c.close())
        loop.close()


async def _running_on_both(c: DispatchClient, n: int = 0) -> bool:
    """Each engine reports requests running (exactly ``n`` running or waiting there, when given)."""
    snaps = (await _loads(c)).values()
    if n:
        return all(s["num_running_reqs"] + s["num_waiting_reqs"] == n for s in snaps)
    return all(s["num_running_reqs"] > 0 for s in snaps)


def test_weight_push_reaches_both_engines(fleet, tmp_path):
    """A disk push of new gate weights to the fleet's engine URLs while requests run on both: nothing
    is lost, every engine serves version 1 (each asked alone, and the client's fleet-wide check),
    and fresh requests on both engines route as the HF reference of the new weights does."""
    import transformers as tr

    d, f = fleet
    model = tr.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    torch.manual_seed(11)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    new_dir = tmp_path / "v1"
    model.save_pretrained(str(new_dir), safe_serialization=True)
    sync = DiskWeightSync(f.engine_urls, str(tmp_path / "sync"), base_model_dir=d, timeout_s=60)

    async def go():
        async with f.client() as c:
            await c.slow_down(0.05)
            jobs = [asyncio.create_task(c.generate(_prompt(50 + i), PARAMS, affinity=f"p{i}")) for i in range(4)]
            await async_wait_until(lambda: _running_on_both(c), what="requests running on both engines")
            await asyncio.to_thread(sync.push, str(new_dir), 1)
            await c.slow_down(None)
            during = await asyncio.gather(*jobs)
            versions = {u: await c.client_for(u).weight_version() for u in c.engine_urls}
            fleet_version = await c.weight_version()
            before = c.engine_stats()
            fresh = await asyncio.gather(*(c.generate(_prompt(60 + i), PARAMS, affinity=f"q{i}",
                                                      return_routed_experts=True) for i in range(4)))
            after = c.engine_stats()
            return during, versions, fleet_version, fresh, before, after
    try:
        during, versions, fleet_version, fresh, before, after = asyncio.run(go())
    finally:
        sync.close()
    assert all(o.finish_type == "length" for o in during)
    assert versions == {u: "1" for u in f.engine_urls} and fleet_version == "1"
    assert all(after[u]["sent"] > before[u]["sent"] for u in f.engine_urls)  # fresh requests on both
    changed = False
    for i, out in enumerate(fresh):
        seq = _prompt(60 + i) + out.output_ids
        got = out.routed_experts_array(LAYERS, TOP_K, len(seq) - 1)
        assert out.weight_version == "1"
        np.testing.assert_array_equal(got, _reference(str(new_dir), seq)[:-1])
        changed |= not np.array_equal(got, _reference(d, seq)[:-1])
    assert changed, "the new gate weights route like the old ones: the test cannot tell the push happened"


def test_a_key_moves_when_its_engine_is_past_the_routers_balance_thresholds():
    """sglang-router 0.3.2's cache_aware defaults (``balance_abs_threshold=64``,
    ``balance_rel_threshold=1.5``): a key stays on its engine while that engine runs at most 64 more
    requests than the least busy one (hand-counted: the 66th request of the key sees 65 vs 0 and
    moves); no engine is contacted (the policy alone)."""
    c = DispatchClient({"http://a:1": 100, "http://b:1": 100})

    async def go():
        slots = [await c._acquire("k") for _ in range(65)]
        assert {s.url for s in slots} == {"http://a:1"} and c.engine_of("k") == "http://a:1"
        moved = await c._acquire("k")
        assert moved.url == "http://b:1" and c.engine_of("k") == "http://b:1"
        other = await c._acquire(None)  # least in-flight: b (1) before a (65)
        assert other.url == "http://b:1"
        for s in [*slots, moved, other]:
            await c._release(s)
        assert all(v["inflight"] == 0 for v in c.engine_stats().values())
    asyncio.run(go())
