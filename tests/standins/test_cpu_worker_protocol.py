"""The CPU worker speaks SGLang 0.5.23's /generate and control semantics, behind the real
sglang-router: sampling fields against HF transformers and naive re-implementations, stop
strings, n > 1, prompt log-probs, streaming, health while paused, retract, abort.

One small fleet (router + 2 workers on a tiny Qwen2 with a character tokenizer) for the module;
every test leaves the engines idle, unpaused and at full speed.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
import torch

from megatron_m2po.config import RolloutConfig
from megatron_m2po.standins import sglang_sampling as sampling
from megatron_m2po.rollout.client import EngineError, SGLangClient
from megatron_m2po.rollout.engines import EngineFleet
from rollout_testlib import build_tiny_qwen2
from waiting import async_wait_until

HEALTH_TIMEOUT_S = 2  # SGLANG_HEALTH_CHECK_TIMEOUT of the workers (SGLang's default is 20)
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789.,!?-:;'ABCDEFGHIJKLMNOPQRS"
PROMPT = [5, 9, 14, 3, 22, 7]


def build_char_tokenizer(model_dir: str) -> None:
    """One token per character (ids 2..63), <s> = 0, </s> = 1 (the model's EOS)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(CHARS[:62])}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>").save_pretrained(model_dir)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    model_dir = build_tiny_qwen2(tmp_path_factory.mktemp("tiny_chars"), seed=3)
    build_char_tokenizer(model_dir)
    cfg = RolloutConfig(engine="cpu_worker", launcher="local", num_engines=2, base_port=0, use_router=True,
                        concurrency=16, engine_max_running_requests=16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", str(HEALTH_TIMEOUT_S))
        f = EngineFleet(cfg, model_dir, run_dir=str(tmp_path_factory.mktemp("proto_run")), startup_timeout_s=120)
        f.start()
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        f.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        f.tok = AutoTokenizer.from_pretrained(model_dir)
        yield f
    finally:
        f.stop()


def run(coro):
    return asyncio.run(coro)


async def raw(url: str, route: str, payload=None, method: str = "POST"):
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url + route, json=payload, timeout=aiohttp.ClientTimeout(total=60)) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text


def gen(url: str, params: dict, prompt=PROMPT, **top):
    status, out = run(raw(url, "/generate", {"input_ids": prompt, "sampling_params": params, **top}))
    assert status == 200, out
    return out


def hf_step_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def naive_penalties(logits: torch.Tensor, output: list[int], freq: float, pres: float, rep: float) -> torch.Tensor:
    """SGLang's penaltylib written out token by token: subtract freq * count and pres once seen, then
    scale seen tokens by rep (divide positive logits, multiply negative ones)."""
    out = logits.clone()
    for t in set(output):
        c = output.count(t)
        v = float(out[t]) - freq * c - pres
        out[t] = v * rep if v < 0 else v / rep
    return out


def test_penalties_match_a_naive_implementation():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g) * 3
    output = [3, 3, 7, 3, 11, 7, 49]
    for freq, pres, rep in [(0.5, 0.0, 1.0), (0.0, -0.7, 1.0), (0.0, 0.0, 1.6), (1.3, 0.4, 0.7)]:
        sp = sampling.parse({"frequency_penalty": freq, "presence_penalty": pres, "repetition_penalty": rep},
                            None, 50)
        got = sampling.penalise(sp, logits, output, frozenset([1]))
        torch.testing.assert_close(got, naive_penalties(logits, output, freq, pres, rep), rtol=0, atol=1e-6)
    sp = sampling.parse({"min_new_tokens": 2}, object(), 50)  # a tokenizer is required; any object will do
    row = sampling.penalise(sp, logits, [4], frozenset([1, 9]))
    assert row[1] == row[9] == float("-inf") and torch.equal(row[2:9], logits[2:9])
    assert torch.equal(sampling.penalise(sp, logits, [4, 5], frozenset([1, 9])), logits)


def test_greedy_and_truncated_sampling_rules():
    """sampler.py: greedy (temperature 0 or top_k 1) returns log_softmax of the raw logits; top-k /
    top-p / min-p sample from the truncated distribution but return the untruncated log-prob."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, generator=g) * 2
    for params in ({"temperature": 0.0}, {"temperature": 0.5, "top_k": 1}):
        tok, lp = sampling.sample(sampling.parse(params, None, 40), logits, g)
        assert tok == int(logits.argmax()) and abs(lp - float(torch.log_softmax(logits, -1)[tok])) < 1e-6
    sp = sampling.parse({"temperature": 0.7, "top_k": 5, "top_p": 0.6, "min_p": 0.2}, None, 40)
    p = torch.softmax(logits / 0.7, -1)
    order = p.argsort(descending=True).tolist()
    cum, allowed = 0.0, set()
    for rank, t in enumerate(order):  # naive: top-k, then top-p over what precedes, then min-p
        if rank < 5 and cum <= 0.6 and p[t] >= p[order[0]] * 0.2:
            allowed.add(t)
        cum += float(p[t])
    seen = set()
    for _ in range(300):
        tok, lp = sampling.sample(sp, logits, g)
        seen.add(tok)
        assert abs(lp - float(torch.log(p[tok]))) < 1e-5
    assert seen == allowed, (seen, allowed)


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_greedy_with_penalties_equals_hf_with_naive_penalties(fleet):
    url = fleet.router_url
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True, "frequency_penalty": 0.8,
              "presence_penalty": 0.3, "repetition_penalty": 1.4}
    got = gen(url, params, return_logprob=True)
    out, lps = [], []
    for _ in range(16):
        row = naive_penalties(hf_step_logits(fleet.hf, PROMPT + out), out, 0.8, 0.3, 1.4)
        tok = int(row.argmax())
        lps.append(float(torch.log_softmax(row, -1)[tok]))  # greedy: log_softmax of the penalised logits
        out.append(tok)
    assert got["output_ids"] == out
    torch.testing.assert_close(torch.tensor([x[0] for x in got["meta_info"]["output_token_logprobs"]]),
                               torch.tensor(lps), rtol=0, atol=1e-4)
    plain = gen(url, {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True})
    assert plain["output_ids"] != out, "the penalties changed nothing: pick stronger ones"


def test_top_k_min_p_and_temperature_follow_hf(fleet):
    url, T = fleet.router_url, 0.8
    got = gen(url, {"temperature": T, "top_k": 4, "min_p": 0.35, "max_new_tokens": 24, "ignore_eos": True},
              return_logprob=True)
    out = got["output_ids"]
    for i, tok in enumerate(out):
        logits = hf_step_logits(fleet.hf, PROMPT + out[:i])
        p = torch.softmax(logits / T, -1)
        top = p.topk(4)
        allowed = {int(t) for v, t in zip(top.values, top.indices) if v >= top.values[0] * 0.35}
        assert tok in allowed, (i, tok, allowed)
        # the returned log-prob is the temperature-scaled one before truncation (sampler.py)
        assert abs(got["meta_info"]["output_token_logprobs"][i][0] - float(torch.log(p[tok]))) < 1e-4


def test_stop_strings_and_trimming(fleet):
    url = fleet.router_url
    base = gen(url, {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True})
    ids = base["output_ids"]
    k = next(i for i in range(3, len(ids) - 1) if ids[i] > 1 and ids[i + 1] > 1)
    stop = fleet.tok.decode(ids[k:k + 2])
    end = next(j for j in range(1, len(ids) + 1) if stop in fleet.tok.decode(ids[:j]))
    full = fleet.tok.decode(ids[:end], skip_special_tokens=True)
    out = gen(url, {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True, "stop": [stop, "@@"]})
    assert out["output_ids"] == ids[:end]  # the ids keep the stop string's tokens
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full[:full.index(stop)]  # the text ends before it
    kept = gen(url, {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True, "stop": stop,
                     "no_stop_trim": True})
    assert kept["text"] == full[:full.index(stop) + len(stop)]
    # a stop token: in output_ids, not in the text unless no_stop_trim
    tok = ids[k]
    first = ids.index(tok)
    out = gen(url, {"temperature": 0.0, "max_new_tokens": 20, "stop_token_ids": [tok]})
    if 1 not in ids[:first + 1]:
        assert out["output_ids"] == ids[:first + 1]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
        assert out["text"] == fleet.tok.decode(ids[:first], skip_special_tokens=True)
        kept = gen(url, {"temperature": 0.0, "max_new_tokens": 20, "stop_token_ids": [tok], "no_stop_trim": True})
        assert kept["text"] == fleet.tok.decode(ids[:first + 1], skip_special_tokens=True)


def test_n_samples_are_a_list_under_new_rids(fleet):
    url = fleet.router_url
    params = {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True, "sampling_seed": 11}
    single = gen(url, params, return_logprob=True)
    many = gen(url, {**params, "n": 3}, rid="mine", return_logprob=True)
    assert isinstance(many, list) and len(many) == 3
    # seeded sampling depends on seed and position only (sampler.py multinomial_with_seed): all equal
    for o in many:
        assert o["output_ids"] == single["output_ids"]
        torch.testing.assert_close(torch.tensor([x[0] for x in o["meta_info"]["output_token_logprobs"]]),
                                   torch.tensor([x[0] for x in single["meta_info"]["output_token_logprobs"]]),
                                   rtol=0, atol=1e-5)  # a batch of 3 rows vs one: float rounding only
    rids = {o["meta_info"]["id"] for o in many}
    assert len(rids) == 3 and "mine" not in rids and not any(r.startswith("mine") for r in rids)
    # a batch of 2 prompts with n = 2: prompt-major order
    outs = gen(url, {"max_new_tokens": 3, "n": 2}, prompt=[PROMPT, PROMPT[:2]])
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [6, 6, 2, 2]
    status, out = run(raw(fleet.engine_urls[0], "/generate", {"input_ids": PROMPT, "sampling_params": {"n": 2},
                                                              "return_logprob": [True]}))
    assert status == 400 and "Cannot use list return_logprob with parallel_sample_num > 1" in out["error"]["message"]


def test_prompt_logprobs_from_logprob_start_len(fleet):
    url = fleet.router_url
    with torch.no_grad():
        lp = torch.log_softmax(fleet.hf(torch.tensor([PROMPT])).logits[0].float(), -1)
    for start in (0, 2):
        out = gen(url, {"max_new_tokens": 2}, return_logprob=True, logprob_start_len=start)
        got = out["meta_info"]["input_token_logprobs"]
        assert [x[1] for x in got] == PROMPT[start:] and got[0][0] is None and all(x[2] is None for x in got)
        want = [float(lp[j - 1, PROMPT[j]]) for j in range(start + 1, len(PROMPT))]
        torch.testing.assert_close(torch.tensor([x[0] for x in got[1:]]), torch.tensor(want), rtol=0, atol=1e-4)
    only = gen(url, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=3, return_text_in_logprobs=True)
    assert only["output_ids"] == [] and [x[2] for x in only["meta_info"]["input_token_logprobs"]] == [
        fleet.tok.decode([t]) for t in PROMPT[3:]]
    assert gen(url, {"max_new_tokens": 2}, return_logprob=True)["meta_info"]["input_token_logprobs"] == []
    status, out = run(raw(url, "/generate", {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 7}))
    assert status == 400 and "is higher than the number of input tokens" in out["error"]["message"]


def test_refusals_have_sglangs_shape(fleet):
    url = fleet.engine_urls[0]
    for body, status, what in [
            ({"sampling_params": {"nope": 1}}, 400, "unknown field `nope`, expected one of `max_new_tokens`"),
            ({"sampling_params": {"temperature": "hot"}}, 400, 'invalid type: string "hot", expected f64'),
            ({"sampling_params": {"top_p": 0}}, 400, "top_p must be in (0, 1], got 0.0."),
            ({"sampling_params": {"repetition_penalty": 0}}, 400, "repetition_penalty must be in (0, 2]"),
            ({"sampling_params": {"regex": "a+"}}, 400, "sampling_params.regex is not supported"),
            ({"custom_logit_processor": "{}"}, 400, "--enable-custom-logit-processor")]:
        code, out = run(raw(url, "/generate", {"input_ids": PROMPT, **body}))
        msg = out["error"] if isinstance(out["error"], str) else out["error"]["message"]
        assert code == status and what in msg, (body, out)
    code, out = run(raw(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"nope": 1}}))
    assert isinstance(out["error"], str)  # the JSON-contract gate answers {"error": "<text>"}
    ok = gen(url, {"max_new_tokens": 2, "custom_params": {"anything": [1, "x"]}})
    assert len(ok["output_ids"]) == 2


def test_stream_is_sse_with_cumulative_chunks(fleet):
    url = fleet.router_url
    params = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 5}
    whole = gen(url, params)

    async def stream(payload):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/generate", json=payload) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                return [line for line in (await r.text()).split("\n\n") if line]
    events = run(stream({"input_ids": PROMPT, "sampling_params": params, "stream": True}))
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5, 6]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    bad = run(stream({"input_ids": PROMPT, "sampling_params": {"top_p": 0}, "stream": True}))
    err = json.loads(bad[0][len("data: "):])["error"]
    assert bad[-1] == "data: [DONE]" and err["code"] == 400 and "top_p" in err["message"]


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_health_while_paused(fleet, mode):
    url = fleet.engine_urls[0]

    async def scenario():
        assert (await raw(url, "/health", method="GET"))[0] == 200
        assert (await raw(url, "/pause_generation", {"mode": mode}))[0] == 200
        t0 = time.monotonic()
        health, ready = (await raw(url, "/health", method="GET"))[0], (await raw(url, "/ready", method="GET"))[0]
        waited = time.monotonic() - t0
        # a scheduler message (here a cache flush) during the wait makes the check pass
        check = asyncio.ensure_future(raw(url, "/health_generate", method="GET"))
        while not check.done():  # until the check answers (it may start after a flush)
            await raw(url, "/flush_cache")
        passed = (await check)[0]
        await raw(url, "/continue_generation", {})
        return health, ready, waited, passed, (await raw(url, "/health", method="GET"))[0], \
            (await raw(url, "/ready", method="GET"))[0]
    health, ready, waited, passed, after, ready_after = run(scenario())
    # elapsed time is the behaviour under test: 503 only after SGLANG_HEALTH_CHECK_TIMEOUT
    assert health == 503 and ready == 503 and waited >= HEALTH_TIMEOUT_S
    assert passed == 200 and after == 200 and ready_after == 200


async def _loads(c: SGLangClient, running: int, waiting: int = 0, generated: int = 1):
    load = await c.loads()
    ok = load["num_running_reqs"] == running and load["num_waiting_reqs"] == waiting \
        and load["num_generated_tokens"] >= generated
    return load if ok else None


def test_retract_requeues_and_allows_a_flush(fleet):
    url = fleet.engine_urls[1]

    async def scenario():
        async with SGLangClient(url, timeout_s=60) as c:
            await c.slow_down(0.05)
            task = asyncio.ensure_future(c.generate(PROMPT, {"temperature": 0.0, "max_new_tokens": 40,
                                                             "ignore_eos": True}))
            await async_wait_until(lambda: _loads(c, 1), what=f"a request decoding on {url}")
            await c.pause_generation("in_place")
            in_place_flush = await c.flush_cache()
            await c.continue_generation()
            await c.pause_generation("retract")
            load = await c.loads()
            retract_flush = await c.flush_cache()
            await c.slow_down(None)
            await c.continue_generation()
            return in_place_flush, load, retract_flush, await task
    in_place_flush, load, retract_flush, out = run(scenario())
    assert not in_place_flush and retract_flush  # scheduler.py flush_cache: is_fully_idle(ignore_waiting=paused)
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 1
    greedy = gen(url, {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True})
    assert out.output_ids == greedy["output_ids"]  # re-prefilled with its output: the same continuation


def test_abort_through_the_router_reaches_the_owner(fleet):
    url = fleet.router_url

    async def scenario():
        engines = [SGLangClient(u) for u in fleet.engine_urls]
        async with SGLangClient(url, timeout_s=60) as c:
            for e in engines:
                await e.slow_down(0.05)
            status = (await raw(url, "/abort_request", {"rid": "x"}))[0]  # sglang-router 0.3.2 has no route
            task = asyncio.ensure_future(c.generate(PROMPT, {"max_new_tokens": 200, "ignore_eos": True},
                                                    rid="owned"))
            await async_wait_until(lambda: _busy(engines), what="the request decoding on one engine")
            took = await c.abort("owned")
            out = await asyncio.wait_for(task, 30)
            for e in engines:
                await e.slow_down(None)
                await e.close()
            return status, took, out
    status, took, out = run(scenario())
    assert status == 404 and sorted(took) == sorted(fleet.engine_urls)
    assert out.aborted and out.rid == "owned" and 0 < len(out.output_ids) < 200
    assert out.finish_reason == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def test_a_generate_that_times_out_behind_the_router_is_aborted_on_its_engine(fleet):
    async def scenario():
        engines = [SGLangClient(u) for u in fleet.engine_urls]
        for e in engines:
            # 900 tokens take >= 180 s: the engines can only be idle within the 60 s wait if the
            # client's abort reached the one that runs the request
            await e.slow_down(0.2)
        async with SGLangClient(fleet.router_url, timeout_s=1.0, max_retries=0) as c:
            with pytest.raises(EngineError, match="timed out"):
                await c.generate(PROMPT, {"max_new_tokens": 900, "ignore_eos": True}, rid="too-slow")
        await async_wait_until(lambda: _idle(engines), what="both engines idle after the abort", timeout=60)
        for e in engines:
            await e.slow_down(None)
            await e.close()
    run(scenario())


async def _idle(engines) -> bool:
    loads = [await e.loads() for e in engines]
    return all(x["num_running_reqs"] == 0 and x["num_waiting_reqs"] == 0 for x in loads)


def test_client_generate_refuses_n_above_1():
    async def go():
        async with SGLangClient("http://127.0.0.1:9") as c:
            await c.generate([1, 2], {"n": 2})
    with pytest.raises(ValueError, match="send n requests with n=1"):
        run(go())


def test_an_abort_nobody_takes_is_an_error():
    """A base URL that answers 404 to /abort_request and is no router: raised, not swallowed."""
    from aiohttp import web

    async def scenario():
        runner = web.AppRunner(web.Application())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with SGLangClient(url) as c:
                with pytest.raises(EngineError, match="not an sglang-router"):
                    await c.abort("r")
            async with SGLangClient(url, engine_urls=[url]) as c:
                with pytest.raises(EngineError, match="abort not delivered"):
                    await c.abort("r")
        finally:
            await runner.cleanup()
    run(scenario())


async def _busy(engines) -> bool:
    loads = [await e.loads() for e in engines]
    return any(x["num_running_reqs"] == 1 and x["num_generated_tokens"] >= 1 for x in loads)


def test_abort_rules(fleet):
    """rid prefix matching, unknown rids, requests held by a pause, waiting-queue aborts."""
    url = fleet.engine_urls[0]

    async def scenario():
        async with SGLangClient(url, timeout_s=60) as c:
            await c.slow_down(0.05)
            # a batch request "B" is B_0, B_1 on the server: "B" names none, "B_1" names one
            batch = asyncio.ensure_future(raw(url, "/generate", {
                "input_ids": [PROMPT, PROMPT[:3]], "rid": "B",
                "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}))
            await async_wait_until(lambda: _loads(c, 2, generated=2), what=f"2 requests decoding on {url}")
            await c.abort("B")
            await c.abort("unknown-rid")
            await c.abort("B_1")
            await c.slow_down(None)
            _, b = await batch
            # a request sent while paused waits in the tokenizer manager: an abort by rid is lost
            await c.pause_generation("in_place")
            held = asyncio.ensure_future(c.generate(PROMPT, {"max_new_tokens": 5, "ignore_eos": True}, rid="held"))
            await async_wait_until(lambda: held_on(url), what="the held request registered")
            await c.abort("held")
            await c.continue_generation()
            held_out = await held
            # retracted requests wait in the queue: abort_all answers them "Abort in waiting queue"
            await c.slow_down(0.05)
            w = asyncio.ensure_future(c.generate(PROMPT, {"max_new_tokens": 60, "ignore_eos": True}, rid="w"))
            await async_wait_until(lambda: _loads(c, 1), what=f"a request decoding on {url}")
            await c.pause_generation("retract")
            await c.abort(abort_all=True)
            w_out = await w
            await c.slow_down(None)
            await c.continue_generation()
            return b, held_out, w_out
    b, held_out, w_out = run(scenario())
    assert [o["meta_info"]["id"] for o in b] == ["B_0", "B_1"]
    assert b[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 60}
    assert b[1]["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(b[1]["output_ids"]) < 60
    assert held_out.finish_reason == {"type": "length", "length": 5}
    assert w_out.finish_reason == {"type": "abort", "message": "Abort in waiting queue"}
    assert 0 < len(w_out.output_ids) < 60 and w_out.prompt_tokens == 0  # no prompt_tokens in that meta_info


async def held_on(url: str) -> bool:
    """A request waits in the tokenizer manager for continue_generation (the worker's
    ``num_held_reqs``; SGLang's load snapshot does not count such requests)."""
    async with SGLangClient(url) as c:
        return (await c.loads())["num_held_reqs"] == 1
