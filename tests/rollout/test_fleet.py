"""The real sglang-router in front of two CPU workers: generation, log-probs, control, weight sync,
restart. One fleet for the module (tests run in file order and share weight versions)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from megatron_m2po.config import RolloutConfig
from megatron_m2po.rollout.client import EngineError, SGLangClient
from megatron_m2po.rollout.engines import EngineFleet
from megatron_m2po.weights.disk import DiskWeightSync
from megatron_m2po.weights.distributed import DistributedWeightSync
from megatron_m2po.weights.errors import WeightSyncError
from rollout_testlib import hf_logprobs
from waiting import async_wait_until

# One fleet walks through weight versions 1 to 5 and killed engines, test after test: keep the
# file order (pytest-random-order still shuffles this module among the others).
pytestmark = pytest.mark.random_order(disabled=True)
pytestmark = [pytestmark, pytest.mark.slow]  # engine processes, routers or multi-rank sweeps in module fixtures: the full suite's lane

PROMPTS = [[2, 3, 4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15], [20], [30, 31, 32, 33, 34, 35, 36, 37, 38]]


class State:
    """The weights the engines should hold now (the test's own HF model)."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.version = 0
        self.refits: list[str] = []

    def perturbed(self, seed: int) -> list[tuple[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        return [(n, p.detach() + 0.1 * torch.randn(p.shape, generator=g)) for n, p in self.model.named_parameters()]

    def accept(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        sd = dict(named)
        self.model.load_state_dict(sd, strict=True)
        self.version = version


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fleet_run")
    state = State(tiny_model_dir)
    cfg = RolloutConfig(engine="cpu_worker", launcher="local", num_engines=2, base_port=0,
                        use_router=True, concurrency=16, engine_max_running_requests=16, weight_sync_timeout_s=30.0)
    holder = {}

    def refit(url: str) -> None:  # push the current weights to a restarted engine
        state.refits.append(url)
        holder["disk"].push(holder["disk"].latest_dir, state.version, engine_urls=[url])

    fleet = EngineFleet(cfg, tiny_model_dir, run_dir=str(run_dir), refit_fn=refit, startup_timeout_s=120)
    fleet.start()
    holder["disk"] = DiskWeightSync(fleet.engine_urls, str(run_dir / "weights"), base_model_dir=tiny_model_dir,
                                    timeout_s=30)
    holder["dist"] = DistributedWeightSync(fleet.engine_urls, backend="gloo", bucket_mb=0.01, timeout_s=20)
    try:
        yield fleet, state, holder
    finally:
        holder["dist"].close()
        holder["disk"].close()
        fleet.stop()


def run(coro):
    return asyncio.run(coro)


def call(url: str, method: str, *args):
    """One client call on a fresh client that is closed afterwards."""
    async def go():
        async with SGLangClient(url) as c:
            return await getattr(c, method)(*args)
    return asyncio.run(go())


async def _gen_all(url, prompts, params, concurrency=16):
    async with SGLangClient(url, concurrency=concurrency, timeout_s=60) as c:
        return await c.generate_many(prompts, params)


async def decoding(c: SGLangClient, n: int) -> dict | None:
    """The engine's load once ``n`` requests are in its running batch and have sampled a token."""
    load = await c.loads()
    return load if load["num_running_reqs"] == n and load["num_generated_tokens"] >= n else None


async def queued(c: SGLangClient, n: int) -> bool:
    """``n`` requests have reached the engine (running or waiting)."""
    load = await c.loads()
    return load["num_running_reqs"] + load["num_waiting_reqs"] == n


async def idle(c: SGLangClient) -> bool:
    load = await c.loads()
    return load["num_running_reqs"] == load["num_waiting_reqs"] == 0


def check_logprobs(state, prompts, outs, temperature):
    for p, o in zip(prompts, outs):
        assert len(o.output_ids) == len(o.output_logprobs) > 0
        ref = hf_logprobs(state.model, p, o.output_ids, temperature)
        torch.testing.assert_close(torch.tensor(o.output_logprobs), ref, atol=1e-5, rtol=0)


def test_router_lists_both_workers_healthy(env):
    fleet, _, _ = env
    workers = call(fleet.url, "request", "GET", "/workers")["workers"]
    assert sorted(w["url"] for w in workers) == sorted(fleet.engine_urls)
    assert all(w["is_healthy"] for w in workers)
    info = call(fleet.url, "get_model_info")  # forwarded to a worker
    assert info["is_generation"] and info["weight_version"] == "0"


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7},
                                    {"temperature": 1.3, "top_p": 0.8}, {"temperature": 0.0}])
def test_logprobs_equal_hf_forward_through_router(env, params):
    fleet, state, _ = env
    prompts = PROMPTS * 4  # 20 concurrent requests: batched prefill + decode with left padding
    outs = run(_gen_all(fleet.url, prompts, {**params, "max_new_tokens": 24, "ignore_eos": True}))
    check_logprobs(state, prompts, outs, params["temperature"])
    assert all(o.finish_reason == {"type": "length", "length": 24} for o in outs)
    assert all(o.weight_version == "0" and o.token_weight_versions == ["0"] * 24 for o in outs)
    if params["temperature"] == 0.0:  # greedy = argmax of the reference logits, same for repeats
        assert outs[0].output_ids == outs[5].output_ids


def test_top_p_restricts_support(env):
    fleet, state, _ = env
    outs = run(_gen_all(fleet.url, [PROMPTS[0]] * 8, {"temperature": 1.0, "top_p": 0.3, "max_new_tokens": 16,
                                                      "ignore_eos": True}))
    for o in outs:  # every sampled token lies in the nucleus of its step
        ids = torch.tensor([PROMPTS[0] + o.output_ids])
        with torch.no_grad():
            probs = torch.softmax(state.model(ids).logits[0, len(PROMPTS[0]) - 1:-1], -1)
        for step, tok in enumerate(o.output_ids):
            p_sorted, idx = probs[step].sort(descending=True)
            nucleus = idx[(p_sorted.cumsum(0) - p_sorted) <= 0.3 + 1e-6].tolist()
            assert tok in nucleus


def test_stop_token_ids_and_eos(env):
    fleet, state, _ = env
    url = fleet.engine_urls[0]
    greedy = run(_gen_all(url, [PROMPTS[0]], {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}))[0]
    stop = greedy.output_ids[3]
    first = greedy.output_ids.index(stop)
    assert 1 not in greedy.output_ids[:first + 1], "the tiny model's greedy prefix has EOS: pick another prompt"
    out = run(_gen_all(url, [PROMPTS[0]], {"temperature": 0.0, "max_new_tokens": 12, "stop_token_ids": [stop]}))[0]
    assert out.output_ids == greedy.output_ids[:first + 1]  # the matched stop token is included
    assert out.finish_reason == {"type": "stop", "matched": stop}
    # SGLang 0.5.23 Req._check_token_based_finish: ignore_eos skips stop_token_ids as well
    out = run(_gen_all(url, [PROMPTS[0]], {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True,
                                           "stop_token_ids": [stop]}))[0]
    assert out.output_ids == greedy.output_ids and out.finish_reason == {"type": "length", "length": 12}
    # EOS (id 1) ends sampling unless ignore_eos
    outs = run(_gen_all(url, PROMPTS * 4, {"temperature": 1.5, "max_new_tokens": 64}))
    for o in outs:
        if o.finish_type == "stop":
            assert o.output_ids[-1] == 1 and 1 not in o.output_ids[:-1]
        else:
            assert o.finish_reason == {"type": "length", "length": 64} and 1 not in o.output_ids


def test_bad_request_is_not_retried(env):
    fleet, _, _ = env
    with pytest.raises(EngineError) as e:
        run(_gen_all(fleet.engine_urls[0], [[1, 2, 999]], {"max_new_tokens": 2}))
    assert e.value.status == 400 and "outside" in str(e.value)
    with pytest.raises(EngineError, match=r"presence_penalty must be in \[-2, 2\]"):
        run(_gen_all(fleet.engine_urls[0], [[1, 2]], {"presence_penalty": 2.5}))


def test_pause_in_place_keeps_inflight_requests(env):
    fleet, state, _ = env
    url = fleet.engine_urls[1]

    async def scenario():
        async with SGLangClient(url, timeout_s=120) as c:
            # 400 decode steps take >= 20 s at 0.05 s each: the requests are still running when
            # the test pauses them right after their first tokens.
            await c.slow_down(0.05)
            task = asyncio.ensure_future(c.generate_many(PROMPTS, {"temperature": 1.0, "max_new_tokens": 400,
                                                                  "ignore_eos": True}))
            await async_wait_until(lambda: decoding(c, len(PROMPTS)),
                                   what=f"{len(PROMPTS)} requests decoding on {url}")
            await c.pause_generation("in_place")
            paused = await c.loads()
            assert paused["num_running_reqs"] == len(PROMPTS) and not task.done()
            assert not await c.flush_cache()  # requests are still in the engine
            assert (await c.loads())["num_generated_tokens"] == paused["num_generated_tokens"]  # no step ran
            await c.slow_down(None)
            await c.continue_generation()
            return await task

    outs = run(scenario())
    assert all(o.finish_reason == {"type": "length", "length": 400} for o in outs)
    check_logprobs(state, PROMPTS, outs, 1.0)


def test_abort_returns_partial_output(env):
    fleet, state, _ = env
    url = fleet.engine_urls[0]

    async def scenario():
        async with SGLangClient(url, timeout_s=60) as c:
            await c.slow_down(0.02)  # 400 tokens take >= 8 s: aborted long before the last
            task = asyncio.ensure_future(c.generate(PROMPTS[0], {"max_new_tokens": 400, "ignore_eos": True},
                                                    rid="to-abort"))
            other = asyncio.ensure_future(c.generate(PROMPTS[1], {"max_new_tokens": 40, "ignore_eos": True}))
            await async_wait_until(lambda: decoding(c, 2), what=f"2 requests decoding on {url}")
            await c.abort("to-abort")
            out = await asyncio.wait_for(task, 10)  # a running request comes back after one more step
            await c.slow_down(None)
            return out, await other

    out, other = run(scenario())
    assert out.aborted and out.rid == "to-abort" and 0 < len(out.output_ids) < 400
    assert out.finish_reason == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert other.finish_reason == {"type": "length", "length": 40}
    # pause(mode=abort) -- SGLang's default -- returns in-flight requests as aborted, with log-probs
    async def abort_mode():
        async with SGLangClient(url, timeout_s=60) as c:
            await c.slow_down(0.02)  # 450 tokens take >= 9 s: paused after the first, long before the last
            task = asyncio.ensure_future(c.generate(PROMPTS[2], {"max_new_tokens": 450, "ignore_eos": True}))
            await async_wait_until(lambda: decoding(c, 1), what=f"a request decoding on {url}")
            await c.pause_generation("abort")
            out = await asyncio.wait_for(task, 10)
            await c.slow_down(None)
            await c.continue_generation()
            return out
    out = run(abort_mode())
    assert out.aborted and 0 < len(out.output_ids) < 450
    check_logprobs(state, [PROMPTS[2]], [out], 1.0)


def test_generate_timeout_aborts_on_engine(env):
    fleet, _, _ = env
    url = fleet.engine_urls[0]

    async def scenario():
        async with SGLangClient(url, timeout_s=0.5, max_retries=3) as c:
            await c.pause_generation("in_place")
            t0 = time.monotonic()
            try:
                with pytest.raises(EngineError, match="timed out"):
                    await c.generate(PROMPTS[0], {"max_new_tokens": 10})
                elapsed = time.monotonic() - t0
                await async_wait_until(lambda: idle(c), what=f"the timed-out request to leave {url}")
                flushed = await c.flush_cache()  # the timed-out request was aborted: engine idle
            finally:
                await c.continue_generation()
            return elapsed, flushed

    elapsed, flushed = run(scenario())
    assert elapsed < 3.0  # not retried after a timeout: elapsed time is the behaviour under test
    assert flushed


def test_connection_errors_retry_with_backoff():
    from megatron_m2po.utils.net import free_port
    url = f"http://127.0.0.1:{free_port()}"

    async def scenario():
        async with SGLangClient(url, max_retries=2, backoff_s=0.2) as c:
            t0 = time.monotonic()
            with pytest.raises(EngineError, match="3 attempt"):
                await c.generate([1, 2], {"max_new_tokens": 1})
            return time.monotonic() - t0, await c.health()
    elapsed, healthy = run(scenario())
    # two backoff sleeps (>= 0.1 + 0.2 s): elapsed time is the behaviour under test
    assert elapsed >= 0.2 * (0.5 + 1.0) and not healthy


def test_disk_weight_sync_changes_outputs_and_version(env):
    fleet, state, holder = env
    before = run(_gen_all(fleet.url, PROMPTS, {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}))
    new = state.perturbed(seed=1)
    stats = holder["disk"].push(iter(new), version=1)
    state.accept(new, 1)
    assert stats.version == 1 and stats.engines == 2 and stats.bytes == sum(t.numel() * 4 for _, t in new)
    for u in fleet.engine_urls:
        assert call(u, "weight_version") == "1"
    after = run(_gen_all(fleet.url, PROMPTS * 2, {"temperature": 0.9, "max_new_tokens": 16, "ignore_eos": True}))
    check_logprobs(state, PROMPTS * 2, after, 0.9)
    assert all(o.weight_version == "1" for o in after)
    greedy = run(_gen_all(fleet.url, PROMPTS, {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}))
    assert [o.output_ids for o in greedy] != [o.output_ids for o in before]


def test_distributed_weight_sync_changes_outputs_and_version(env):
    fleet, state, holder = env
    new = state.perturbed(seed=2)
    stats = holder["dist"].push(iter(new), version=2)  # 0.01 MB buckets: many broadcasts
    state.accept(new, 2)
    assert stats.n_tensors == len(new) and stats.version == 2
    outs = run(_gen_all(fleet.url, PROMPTS * 2, {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}))
    check_logprobs(state, PROMPTS * 2, outs, 1.0)
    assert all(o.weight_version == "2" for o in outs)
    # a second push reuses the group
    new = state.perturbed(seed=3)
    holder["dist"].push(iter(new), version=3)
    state.accept(new, 3)
    outs = run(_gen_all(fleet.url, PROMPTS, {"temperature": 0.5, "max_new_tokens": 8, "ignore_eos": True}))
    check_logprobs(state, PROMPTS, outs, 0.5)
    assert {call(u, "weight_version") for u in fleet.engine_urls} == {"3"}


def test_update_spanning_inflight_request_tags_each_token(env):
    fleet, state, holder = env
    url = fleet.engine_urls[0]
    new = state.perturbed(seed=4)

    async def start():
        c = SGLangClient(url, timeout_s=120)
        # 900 decode steps take >= 45 s at 0.05 s each, longer than the push may take (its
        # timeout is 30 s): the update lands inside the request by construction.
        await c.slow_down(0.05)
        task = asyncio.ensure_future(c.generate(PROMPTS[0], {"max_new_tokens": 900, "ignore_eos": True}))
        await async_wait_until(lambda: decoding(c, 1), what=f"a request decoding on {url}")
        return c, task

    loop = asyncio.new_event_loop()
    try:
        c, task = loop.run_until_complete(start())
        holder["disk"].push(iter(new), version=4, engine_urls=[url])  # pauses in place, updates, continues
        loop.run_until_complete(c.slow_down(None))
        out = loop.run_until_complete(task)
        loop.run_until_complete(c.close())
    finally:
        loop.close()
    holder["disk"].push(iter(new), version=4)  # bring the other engine along
    state.accept(new, 4)
    v = out.token_weight_versions
    assert out.finish_type == "length" and v[0] == "3" and v[-1] == "4" and v == sorted(v)
    assert out.weight_version == "4"


def test_killed_worker_is_restarted_refit_and_reregistered(env):
    fleet, state, holder = env
    victim = fleet.engines[0]
    victim.handle.proc.kill()
    victim.handle.proc.wait(10)
    restarted = fleet.check_and_restart()
    assert restarted == [victim.url] and state.refits == [victim.url] and victim.restarts == 1
    assert call(victim.url, "weight_version") == "4"  # refit before registration
    workers = call(fleet.url, "request", "GET", "/workers")["workers"]
    assert sorted(w["url"] for w in workers) == sorted(fleet.engine_urls) and all(w["is_healthy"] for w in workers)
    outs = run(_gen_all(victim.url, PROMPTS, {"temperature": 1.0, "max_new_tokens": 8}))
    check_logprobs(state, PROMPTS, outs, 1.0)
    outs = run(_gen_all(fleet.url, PROMPTS * 2, {"temperature": 1.0, "max_new_tokens": 8}))
    check_logprobs(state, PROMPTS * 2, outs, 1.0)
    assert fleet.check_and_restart() == []


def test_dead_engine_fails_weight_sync_fast_and_by_name(env):
    fleet, state, holder = env
    victim = fleet.engines[1]
    victim.handle.proc.kill()
    victim.handle.proc.wait(10)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=victim.url.replace(".", r"\.")):
        holder["dist"].push(iter(state.perturbed(seed=5)), version=5)
    assert time.monotonic() - t0 < 30
    with pytest.raises(WeightSyncError, match=victim.url.replace(".", r"\.")):
        holder["disk"].push(iter(state.perturbed(seed=5)), version=5)
    assert fleet.check_and_restart() == [victim.url]
    assert call(victim.url, "weight_version") == "4"


def test_distributed_update_with_a_request_in_flight_keeps_it_and_tags_spans(env):
    """SGLang 0.5.23: the push runs in a begin/end session, paused with retract so that its cache
    flush is legal; the in-flight request survives (re-prefilled by the new weights) and its
    ``weight_versions`` spans name both versions."""
    fleet, state, holder = env
    url = fleet.engine_urls[0]
    new = state.perturbed(seed=6)

    async def start():
        c = SGLangClient(url, timeout_s=120)
        await c.slow_down(0.05)  # 900 steps >= 45 s: longer than the push may take (timeout 20 s)
        task = asyncio.ensure_future(c.generate(PROMPTS[0], {"max_new_tokens": 900, "ignore_eos": True}))
        await async_wait_until(lambda: decoding(c, 1), what=f"a request decoding on {url}")
        return c, task

    loop = asyncio.new_event_loop()
    try:
        c, task = loop.run_until_complete(start())
        holder["dist"].push(iter(new), version=5)  # retracts, begin, buckets (the last flushes), end, continues
        assert loop.run_until_complete(c.weight_version()) == "5"
        loop.run_until_complete(c.slow_down(None))
        out = loop.run_until_complete(task)
        loop.run_until_complete(c.close())
    finally:
        loop.close()
    state.accept(new, 5)
    v = out.token_weight_versions
    assert out.finish_type == "length" and len(v) == 900 and v[0] == "4" and v[-1] == "5"
    assert set(v) == {"4", "5"} and v == sorted(v) and out.weight_version == "5"


def test_flush_while_paused_in_place_with_running_requests_fails_the_update(env):
    """0.5.23 weight_updater.py: an update with flush_cache=true (the default) that finds requests
    running fails after loading; a push paused in place therefore sends flush_cache=false (the pushes
    pause with retract instead, which makes the flush legal)."""
    fleet, state, holder = env
    url = fleet.engine_urls[0]

    async def scenario():
        async with SGLangClient(url, timeout_s=120) as c:
            await c.slow_down(0.05)
            task = asyncio.ensure_future(c.generate(PROMPTS[1], {"max_new_tokens": 900, "ignore_eos": True}))
            await async_wait_until(lambda: decoding(c, 1), what=f"a request decoding on {url}")
            await c.pause_generation("in_place")
            with pytest.raises(EngineError) as e:
                await c.update_weights_from_disk(holder["disk"].latest_dir, weight_version="5")
            ok = await c.update_weights_from_disk(holder["disk"].latest_dir, weight_version="5", flush_cache=False)
            await c.continue_generation()
            await c.slow_down(None)
            return e.value, ok, await task
    err, ok, out = run(scenario())
    assert err.status == 400 and "cache was not flushed" in str(err) and ok["success"]
    assert out.finish_type == "length" and len(out.output_ids) == 900


def test_distributed_update_outside_a_session_is_refused(env):
    fleet, _, _ = env
    url = fleet.engine_urls[0]

    async def scenario():
        async with SGLangClient(url) as c:
            with pytest.raises(EngineError) as outside:
                await c.update_weights_from_distributed(["x"], ["float32"], [[1]], weight_version="9")
            with pytest.raises(EngineError) as end_first:
                await c.end_weight_update()
            await c.begin_weight_update()
            with pytest.raises(EngineError) as twice:
                await c.begin_weight_update()
            await c.end_weight_update()
            return outside.value, end_first.value, twice.value, await c.weight_version()
    outside, end_first, twice, version = run(scenario())
    assert outside.status == 400 and "between begin_weight_update() and end_weight_update()" in str(outside)
    assert end_first.status == 400 and "no weight-update session is open" in str(end_first)
    assert twice.status == 400 and "already open" in str(twice)
    assert version == "5"  # the refused update changed nothing


def test_context_overflow_is_a_400_naming_prompt_length_and_limit(env):
    fleet, _, _ = env
    info = call(fleet.engine_urls[0], "get_server_info")
    limit = int(info["context_length"])
    assert info["version"] == "0.5.23"
    with pytest.raises(EngineError) as e:
        call(fleet.url, "generate", PROMPTS[0], {"max_new_tokens": limit})
    msg = str(e.value)
    assert e.value.status == 400 and f"maximum context length of {limit} tokens" in msg
    assert f"{len(PROMPTS[0])} tokens from the input messages" in msg and f"{limit} tokens for the completion" in msg


def test_unsupported_request_fields_are_a_clear_400(env):
    fleet, _, _ = env
    url = fleet.engine_urls[0]
    for body, what in [({"custom_logit_processor": "x"}, "--enable-custom-logit-processor"),
                       ({"top_logprobs_num": 2}, "top_logprobs_num"),
                       ({"sampling_params": {"max_new_tokens": 2, "json_schema": "{}"}}, "json_schema"),
                       ({"sampling_params": {"max_new_tokens": 2, "bogus": 1}}, "unknown field `bogus`")]:
        payload = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}, **body}
        with pytest.raises(EngineError) as e:
            call(url, "request", "POST", "/generate", payload)
        assert e.value.status == 400 and what in str(e.value), (body, str(e.value))


def test_get_weight_version_route_is_gone(env):
    fleet, _, _ = env
    with pytest.raises(EngineError) as e:
        call(fleet.engine_urls[0], "request", "GET", "/get_weight_version")
    assert e.value.status == 404


def test_external_engines_are_validated_by_address(env, tmp_path):
    from megatron_m2po.rollout.engines import FleetError
    from megatron_m2po.utils.net import free_port
    fleet, _, _ = env
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = RolloutConfig(engine="cpu_worker", launcher="external", use_router=False,
                        external_addrs=[fleet.engine_urls[0], dead, "127.0.0.1:1"])
    with pytest.raises(FleetError) as e:
        EngineFleet(cfg, "unused", run_dir=str(tmp_path)).start()
    msg = str(e.value)
    assert dead in msg and "127.0.0.1:1: not an http" in msg and fleet.engine_urls[0] not in msg
    ok = EngineFleet(RolloutConfig(launcher="external", use_router=False, external_addrs=[fleet.engine_urls[0]]),
                     "unused", run_dir=str(tmp_path)).start()
    assert ok.url == fleet.engine_urls[0]
    ok.stop()  # external engines are not ours to stop
    assert call(fleet.engine_urls[0], "health")
    bad_router = RolloutConfig(launcher="external", use_router=True, router_addr=dead,
                               external_addrs=[fleet.engine_urls[0]])
    with pytest.raises(FleetError, match="not a reachable sglang-router"):
        EngineFleet(bad_router, "unused", run_dir=str(tmp_path)).start()


def test_engine_that_fails_to_start_reports_its_log(tmp_path):
    from megatron_m2po.rollout.engines import FleetError
    cfg = RolloutConfig(engine="cpu_worker", num_engines=1, base_port=0, use_router=False)
    fleet = EngineFleet(cfg, str(tmp_path / "no_such_model"), run_dir=str(tmp_path), startup_timeout_s=60)
    with pytest.raises(FleetError) as e:
        fleet.start()
    assert "exited during start-up" in str(e.value) and "not an HF model directory" in str(e.value)
    assert (tmp_path / "engines" / "engine_0.log").exists()


def test_engine_of_another_sglang_version_is_refused_at_start(tmp_path):
    """EngineFleet.start reads each engine's /server_info version and names found and supported."""
    from aiohttp import web
    from megatron_m2po.rollout.engines import FleetError
    from megatron_m2po.rollout.sglang_version import SUPPORTED_SGLANG
    from megatron_m2po.utils.net import free_port

    app = web.Application()
    app.router.add_get("/health", lambda r: web.Response(status=200))
    app.router.add_get("/model_info", lambda r: web.json_response({"is_generation": True, "weight_version": "0"}))
    app.router.add_get("/server_info", lambda r: web.json_response({"version": "0.5.6"}))
    port = free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    import threading
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        cfg = RolloutConfig(launcher="external", use_router=False, external_addrs=[f"http://127.0.0.1:{port}"])
        with pytest.raises(FleetError) as e:
            EngineFleet(cfg, "unused", run_dir=str(tmp_path)).start()
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
    assert "'0.5.6'" in str(e.value) and f"SGLang {SUPPORTED_SGLANG} only" in str(e.value)


def test_supported_sglang_is_the_docker_pin():
    from pathlib import Path
    from megatron_m2po.rollout.sglang_version import SUPPORTED_SGLANG
    install = (Path(__file__).resolve().parents[2] / "docker" / "install.sh").read_text()
    assert f'SGLANG_REQS=("sglang=={SUPPORTED_SGLANG}")' in install


def test_weight_version_spans_expand_per_token():
    from megatron_m2po.rollout.client import GenerateOutput
    meta = {"weight_version": "5", "weight_versions": [{"version": "4", "start": 0, "end": 3},
                                                       {"version": "5", "start": 3, "end": 5}]}
    out = GenerateOutput.from_json({"output_ids": [1, 2, 3, 4, 5], "meta_info": meta})
    assert out.token_weight_versions == ["4", "4", "4", "5", "5"]
    lists = GenerateOutput.from_json({"output_ids": [1, 2], "meta_info": {"weight_version": "1",
                                                                           "weight_versions": [["1", 0, 2]]}})
    assert lists.token_weight_versions == ["1", "1"]
    assert GenerateOutput.from_json({"output_ids": [1], "meta_info": {"weight_version": "1"}}).token_weight_versions is None
