"""The CPU worker's prefix cache behaves as SGLang 0.5.23's radix cache: prompt KV computed once and
reused by later requests sharing the prefix (``meta_info.cached_tokens``), the reused KV is the KV
the weights of that time computed, and only a flush (``/flush_cache``, or a weight update with
``flush_cache`` true) drops it. The weight pushes flush, so tokens tagged with a version are computed
by that version alone (docs/design.md §3, "Versions and staleness")."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from megatron_m2po.config import RolloutConfig
from megatron_m2po.rollout.client import SGLangClient
from megatron_m2po.standins.cpu_prefix_cache import PrefixCache
from megatron_m2po.rollout.engines import EngineFleet
from megatron_m2po.weights.disk import DiskWeightSync
from megatron_m2po.weights.distributed import DistributedWeightSync
from rollout_testlib import hf_logprobs
from waiting import async_wait_until

pytestmark = pytest.mark.slow  # engine processes, routers or multi-rank sweeps in module fixtures: the full suite's lane

PROMPT = [5, 9, 14, 3, 22, 7, 31, 40, 2, 17]
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def _model(named):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(_model.base, dtype=torch.float32).eval()
    if named is not None:
        m.load_state_dict(dict(named), strict=True)
    return m


def _perturbed(base, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + 0.1 * torch.randn(p.shape, generator=g)) for n, p in base.named_parameters()]


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    """One CPU worker (no router); each test starts by flushing its cache and leaves it idle."""
    _model.base = tiny_model_dir
    cfg = RolloutConfig(engine="cpu_worker", launcher="local", num_engines=1, base_port=0, use_router=False,
                        concurrency=16, weight_sync_timeout_s=30.0)
    f = EngineFleet(cfg, tiny_model_dir, run_dir=str(tmp_path_factory.mktemp("prefix_run")), startup_timeout_s=120)
    f.start()
    try:
        yield f.engine_urls[0], tmp_path_factory.mktemp("prefix_weights")
    finally:
        f.stop()


async def _post(url: str, route: str, payload=None):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + route, json=payload, timeout=aiohttp.ClientTimeout(total=60)) as r:
            return r.status, (await r.json() if r.content_type == "application/json" else await r.text())


def _gen(url: str, prompt=PROMPT, params=GREEDY, **top) -> dict:
    status, out = asyncio.run(_post(url, "/generate", {"input_ids": prompt, "sampling_params": params,
                                                        "return_logprob": True, **top}))
    assert status == 200, out
    return out


def _logprobs(out: dict) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])


def _flush(url: str) -> None:
    status, text = asyncio.run(_post(url, "/flush_cache"))
    assert status == 200, text


def _old_kv_logprobs(old, new, prompt: list[int], n_cached: int, output: list[int]) -> torch.Tensor:
    """Log-probs of ``output`` when the first ``n_cached`` prompt tokens' KV comes from ``old``
    and everything after is computed by ``new`` on top of it (what a stale prefix cache does)."""
    with torch.no_grad():
        past = old(torch.tensor([prompt[:n_cached]]), use_cache=True).past_key_values
        rest = prompt[n_cached:] + output[:-1]
        pos = torch.arange(n_cached, n_cached + len(rest))[None]
        logits = new(torch.tensor([rest]), past_key_values=past, position_ids=pos).logits[0].float()
    logp = torch.log_softmax(logits, -1)[len(prompt) - n_cached - 1:]
    return logp.gather(1, torch.tensor(output)[:, None])[:, 0]


def test_radix_tree_matches_splits_and_evicts_lru():
    def kv(tokens):  # one layer; the "KV" of a token is its id, so slices are checkable
        t = torch.tensor(tokens, dtype=torch.float32).view(1, -1, 1)
        return [(t, -t)]

    c = PrefixCache(max_bytes=1 << 20)
    assert c.match([1, 2, 3], 2) == (0, None)
    c.insert([1, 2, 3, 4], kv([1, 2, 3, 4]), 0)
    n, got = c.match([1, 2, 3, 9], 3)
    assert n == 3 and got[0][0].flatten().tolist() == [1, 2, 3] and got[0][1].flatten().tolist() == [-1, -2, -3]
    assert c.match([1, 2, 3, 4, 5], 2)[0] == 2  # the limit caps the match
    c.insert([1, 2, 7, 8], kv([7, 8]), 2)  # only the part after the matched prefix is given and stored
    n, got = c.match([1, 2, 7, 8, 0], 5)
    assert n == 4 and got[0][0].flatten().tolist() == [1, 2, 7, 8] and c.tokens == 6
    assert c.match([1, 2, 3, 4, 0], 5)[0] == 4  # the split kept the first branch whole
    # LRU: [1, 2, 3, 4] was used last; a budget of 5 tokens evicts the other leaf ([7, 8]) first.
    per_token = c.bytes // c.tokens
    c.max_bytes = 5 * per_token
    assert c.evict() == 2 and c.tokens == 4 and c.match([1, 2, 7, 8, 0], 5)[0] == 2
    c.reset()
    assert c.tokens == c.bytes == 0 and c.match([1, 2, 3, 4, 0], 5) == (0, None)
    with pytest.raises(ValueError, match="budget"):
        PrefixCache(-1)


def test_prompt_kv_is_reused_until_a_flush(engine):
    url, _ = engine
    _flush(url)
    ref = _model(None)
    first, again = _gen(url), _gen(url)
    # radix cache: the second request reuses all but the last prompt token (Req._compute_max_prefix_len)
    assert first["meta_info"]["cached_tokens"] == 0 and again["meta_info"]["cached_tokens"] == len(PROMPT) - 1
    assert first["output_ids"] == again["output_ids"]
    for out in (first, again):
        torch.testing.assert_close(_logprobs(out), hf_logprobs(ref, PROMPT, out["output_ids"], 0.0),
                                   atol=1e-5, rtol=0)
    branch = PROMPT[:4] + [50, 51, 52]
    out = _gen(url, branch)
    assert out["meta_info"]["cached_tokens"] == 4
    torch.testing.assert_close(_logprobs(out), hf_logprobs(ref, branch, out["output_ids"], 0.0), atol=1e-5, rtol=0)
    # Prompt log-probs from logprob_start_len=2 need the logits from there: at most 2 tokens reused.
    out = _gen(url, PROMPT, logprob_start_len=2)
    assert out["meta_info"]["cached_tokens"] == 2
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([PROMPT])).logits[0], -1)[1:-1].gather(
            1, torch.tensor(PROMPT[2:])[:, None])[:, 0]
    got = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]
    assert got[0] is None
    torch.testing.assert_close(torch.tensor(got[1:]), want[1:], atol=1e-5, rtol=0)
    _flush(url)
    assert _gen(url)["meta_info"]["cached_tokens"] == 0


def test_a_groups_samples_compute_the_prompt_once(engine):
    """n samples of one prompt arrive together: the prompt is computed once (a group's samples
    share it, as SGLang's later batches share the radix cache), each sample still follows HF."""
    url, _ = engine
    _flush(url)
    ref = _model(None)
    prompt = [(7 * i + 3) % 60 + 2 for i in range(40)]

    async def group(n):
        async with SGLangClient(url, concurrency=16, timeout_s=60) as c:
            before = (await c.loads())["total_prefill_uncached_tokens"]
            outs = await c.generate_many([prompt] * n, {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True,
                                                        "sampling_seed": 11})
            return outs, (await c.loads())["total_prefill_uncached_tokens"] - before
    outs, computed = asyncio.run(group(8))
    # Without reuse: 8 x 40 tokens. With it: the prompt once, plus at most the last token per later batch.
    assert computed <= len(prompt) + 8, computed
    for o in outs:
        torch.testing.assert_close(torch.tensor(o.output_logprobs), hf_logprobs(ref, prompt, o.output_ids, 1.0),
                                   atol=1e-5, rtol=0)


def test_an_update_without_flush_keeps_the_old_kv_and_one_with_flush_drops_it(engine):
    """SGLang 0.5.23: ``flush_cache=false`` leaves the radix cache as the old weights filled it; a
    request on a prompt seen before then computes on the *old* prompt KV (the test's reference
    builds exactly that mixture with HF). The default flush drops it."""
    url, root = engine
    _flush(url)
    base = _model(None)
    new = _perturbed(base, seed=1)
    new_model = _model(new)
    new_model.save_pretrained(str(root / "v1"))
    base.save_pretrained(str(root / "v0"))
    _gen(url)  # the prompt's KV at the old weights

    async def update(flush, path="v1", version="1"):
        async with SGLangClient(url, timeout_s=60) as c:
            return await c.update_weights_from_disk(str(root / path), weight_version=version, flush_cache=flush)
    try:
        asyncio.run(update(False))
        stale = _gen(url)
        assert stale["meta_info"]["cached_tokens"] == len(PROMPT) - 1
        fresh_ref = hf_logprobs(new_model, PROMPT, stale["output_ids"], 0.0)
        mixed_ref = _old_kv_logprobs(base, new_model, PROMPT, len(PROMPT) - 1, stale["output_ids"])
        torch.testing.assert_close(_logprobs(stale), mixed_ref, atol=1e-5, rtol=0)
        assert (_logprobs(stale) - fresh_ref).abs().max() > 1e-3
        asyncio.run(update(True))
        flushed = _gen(url)
        assert flushed["meta_info"]["cached_tokens"] == 0
        torch.testing.assert_close(_logprobs(flushed), hf_logprobs(new_model, PROMPT, flushed["output_ids"], 0.0),
                                   atol=1e-5, rtol=0)
    finally:
        asyncio.run(update(True, "v0", "0"))  # back to the base weights for the other tests


@pytest.mark.parametrize("kind,options", [("disk", {}), ("distributed", {}),
                                          ("disk", {"pause_mode": "in_place", "flush_cache": True})])
def test_a_weight_push_leaves_no_old_prompt_kv_in_use(engine, kind, options):
    """After a push, a prompt seen before is computed by the new weights alone: the engine's
    log-probs equal a fresh forward at the new weights (the version tag is true). An in-place
    pause flushes only when told the engines are idle (``flush_cache=True``)."""
    url, root = engine
    _flush(url)
    base = _model(None)
    sync = (DiskWeightSync([url], str(root / f"sync_{kind}"), base_model_dir=_model.base, timeout_s=30, **options)
            if kind == "disk" else DistributedWeightSync([url], backend="gloo", timeout_s=30, **options))
    try:
        _gen(url)  # fills the cache at the current weights
        new = _perturbed(base, seed=2)
        sync.push(iter(new), version=2)
        out = _gen(url)
        ref = hf_logprobs(_model(new), PROMPT, out["output_ids"], 0.0)
        torch.testing.assert_close(_logprobs(out), ref, atol=1e-5, rtol=0)
    finally:
        sync.push(iter([(n, p.detach()) for n, p in base.named_parameters()]), version=0)  # back to the base
        sync.close()


def test_a_request_in_flight_across_an_async_push_continues_on_new_kv_only(engine):
    """Async mode: a request decoding while weights are pushed. Its tokens tagged with the new
    version are computed by the new weights over the whole context (prompt and its earlier
    output recomputed): their log-probs equal a fresh forward at the new weights."""
    url, _ = engine
    _flush(url)
    base = _model(None)
    new = _perturbed(base, seed=3)
    sync = DistributedWeightSync([url], backend="gloo", timeout_s=30)

    async def start():
        c = SGLangClient(url, timeout_s=120)
        await c.slow_down(0.05)
        task = asyncio.ensure_future(c.generate(PROMPT, {"temperature": 0.0, "max_new_tokens": 400,
                                                         "ignore_eos": True}))

        async def decoding():
            load = await c.loads()
            return load["num_running_reqs"] == 1 and load["num_generated_tokens"] >= 2
        await async_wait_until(decoding, what=f"a request decoding on {url}")
        return c, task

    loop = asyncio.new_event_loop()
    try:
        c, task = loop.run_until_complete(start())
        sync.push(iter(new), version=7)
        loop.run_until_complete(c.slow_down(None))
        out = loop.run_until_complete(task)
        loop.run_until_complete(c.close())
        sync.push(iter([(n, p.detach()) for n, p in base.named_parameters()]), version=0)
    finally:
        sync.close()
        loop.close()
    v = out.token_weight_versions
    k = v.index("7")
    assert 0 < k and set(v[:k]) == {"0"} and set(v[k:]) == {"7"}
    lp = torch.tensor(out.output_logprobs)
    torch.testing.assert_close(lp[:k], hf_logprobs(base, PROMPT, out.output_ids[:k], 0.0), atol=1e-5, rtol=0)
    ref_new = hf_logprobs(_model(new), PROMPT, out.output_ids, 0.0)[k:]
    torch.testing.assert_close(lp[k:], ref_new, atol=1e-5, rtol=0)


def test_a_bad_flush_cache_setting_is_refused():
    with pytest.raises(ValueError, match="flush_cache='yes'"):
        DistributedWeightSync([], flush_cache="yes")


def test_a_deferred_flush_waits_for_idle_or_times_out(engine):
    """flush_wrapper.py: ``/flush_cache?timeout=s`` waits until nothing runs or waits, then flushes;
    past the timeout it is refused ("Timed out waiting for idle state.")."""
    url, _ = engine
    _flush(url)

    async def scenario():
        async with SGLangClient(url, timeout_s=120) as c:
            await c.slow_down(0.05)
            task = asyncio.ensure_future(c.generate(PROMPT, {"temperature": 0.0, "max_new_tokens": 60,
                                                             "ignore_eos": True}))

            async def decoding():
                return (await c.loads())["num_running_reqs"] == 1
            await async_wait_until(decoding, what=f"a request decoding on {url}")
            # elapsed time is the behaviour under test: 0.1 s is far below the request's 3 s
            timed_out = await _post(url, "/flush_cache?timeout=0.1")
            # sent while the request runs (a flush without timeout would be refused now)
            waited = await _post(url, "/flush_cache?timeout=60")
            load = await c.loads()
            await c.slow_down(None)
            return timed_out, waited, load, await task
    timed_out, waited, load, out = asyncio.run(scenario())
    assert timed_out == (400, "Timed out waiting for idle state.")
    assert waited[0] == 200 and load["num_running_reqs"] == 0 and len(out.output_ids) == 60
    assert out.finish_type == "length"
    assert _gen(url)["meta_info"]["cached_tokens"] == 0  # the deferred flush dropped the prompt's KV
