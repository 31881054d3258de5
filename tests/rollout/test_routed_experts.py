"""Routed experts from the CPU worker (``standins/routed_capture.py``) as SGLang 0.5.23 returns them.

One worker started with ``--enable-return-routed-experts`` and one without, both on a tiny
random Qwen3-MoE (2 layers, 4 experts, top-2). The reference is independent of the worker: an
HF forward over the whole prompt + output in one pass, with the top-k recomputed in the test from
each MoE layer's input (``softmax(x W_gate^T)`` in float32, ``torch.topk``). The response is decoded
with SGLang's own ``extract_routed_experts_from_meta_info`` taken from the pinned wheel. The tests
of routing across a weight push (new router weights pushed as the trainer pushes) give the worker
its base weights back when they end.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import types

import numpy as np
import pytest
import torch

from megatron_m2po.config import RolloutConfig
from megatron_m2po.rollout.client import EngineError, SGLangClient
from megatron_m2po.rollout.engines import EngineFleet
from sglang_source import wheel as _wheel
from waiting import async_wait_until

pytestmark = pytest.mark.slow  # engine processes, routers or multi-rank sweeps in module fixtures: the full suite's lane

LAYERS, TOP_K = 2, 2
PROMPT = [5, 9, 14, 3, 22, 7, 40]


def _tiny_moe(path) -> str:
    import transformers as tr

    cfg = tr.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                            num_experts=4, num_experts_per_tok=TOP_K, moe_intermediate_size=16, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
    torch.manual_seed(7)
    model = tr.Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():  # a router with clear margins: sampled tokens, not ties, decide the experts
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    d = _tiny_moe(tmp_path_factory.mktemp("tiny_moe"))
    fleets = []
    try:
        for flag in (True, False):
            cfg = RolloutConfig(engine="cpu_worker", launcher="local", num_engines=1, base_port=0, use_router=False,
                                return_routed_experts=flag)
            f = EngineFleet(cfg, d, run_dir=str(tmp_path_factory.mktemp("run")), startup_timeout_s=120)
            fleets.append(f)
            f.start()
        yield d, fleets[0].engine_urls[0], fleets[1].engine_urls[0]
    finally:
        for f in fleets:
            f.stop()


@pytest.fixture(scope="module")
def sglang_extract():
    """SGLang 0.5.23's ``extract_routed_experts_from_meta_info``, compiled from the wheel's source."""
    with _wheel() as z:
        src = z.read("sglang/srt/state_capturer/routed_experts.py").decode()
    fn = next(n for n in ast.parse(src).body
              if isinstance(n, ast.FunctionDef) and n.name == "extract_routed_experts_from_meta_info")
    ns = {"np": np, "pybase64": types.SimpleNamespace(b64decode=base64.b64decode)}
    exec(compile(ast.Module([fn], []), "routed_experts.py", "exec"), ns)
    return ns["extract_routed_experts_from_meta_info"]


def _reference(hf_dir, ids) -> np.ndarray:
    """[len(ids), layers, top_k] top-k of every position from one HF forward (the test's own top-k)."""
    import transformers as tr

    model = tr.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    seen = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        model(torch.tensor(ids)[None])
    out = []
    for i, layer in enumerate(model.model.layers):
        probs = torch.softmax(seen[i] @ layer.mlp.gate.weight.T, -1, dtype=torch.float32)
        out.append(torch.topk(probs, TOP_K, dim=-1).indices)
    return torch.stack(out, 1).numpy()


def _generate(url, ids, **kw):
    async def go():
        async with SGLangClient(url) as c:
            return await c.generate(ids, {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 3,
                                          "ignore_eos": True}, **kw)
    return asyncio.run(go())


def test_routed_experts_equal_hf_router_in_sglang_layout(workers, sglang_extract):
    """Rows ``[0, seqlen - 1)`` (prompt and output, not the last token), int32 base64 decoded by
    SGLang's own function, equal the reference top-k; ``routed_experts_start_len=s`` returns rows
    ``[s, seqlen - 1)``; a follow-up request on the same conversation, served partly from the
    prefix cache, still returns the routing of every position."""
    d, url, _ = workers
    out = _generate(url, PROMPT, return_routed_experts=True)
    seq = PROMPT + out.output_ids
    ref = _reference(d, seq)
    got = sglang_extract({"meta_info": {"routed_experts": out.routed_experts}}).reshape(-1, LAYERS, TOP_K)
    assert got.shape == (len(seq) - 1, LAYERS, TOP_K)
    np.testing.assert_array_equal(got, ref[:-1])  # torch.topk order, as SGLang captures it
    np.testing.assert_array_equal(got, out.routed_experts_array(LAYERS, TOP_K, len(seq) - 1))
    assert len(np.unique(ref[:-1].reshape(-1, TOP_K), axis=0)) > 2  # the routing varies over tokens

    part = _generate(url, PROMPT, return_routed_experts=True, routed_experts_start_len=4)
    assert part.output_ids == out.output_ids  # same seed: same tokens
    np.testing.assert_array_equal(part.routed_experts_array(LAYERS, TOP_K, len(seq) - 5), got[4:])

    turn2 = seq + [11, 12]  # the conversation so far plus an observation
    nxt = _generate(url, turn2, return_routed_experts=True)
    assert nxt.cached_tokens > 0
    seq2 = turn2 + nxt.output_ids
    got2 = nxt.routed_experts_array(LAYERS, TOP_K, len(seq2) - 1)
    np.testing.assert_array_equal(got2, _reference(d, seq2)[:-1])


def test_start_len_out_of_range_is_refused_as_sglang_does(workers):
    """scheduler.py handle_generate_request: ``routed_experts_start_len`` outside [0, prompt tokens]
    aborts the request with SGLang's message (HTTP 400)."""
    _, url, _ = workers
    for bad, words in ((len(PROMPT) + 1, "is higher than the number of input tokens"), (-1, "is lower than 0")):
        with pytest.raises(EngineError, match=words):
            _generate(url, PROMPT, return_routed_experts=True, routed_experts_start_len=bad)


def test_engine_without_the_server_flag_returns_none_and_the_client_says_why(workers):
    """Without ``--enable-return-routed-experts`` SGLang 0.5.23 drops the request field silently
    (no capturer); ``server_info`` tells the flag; the client's decoding names the flag."""
    _, on, off = workers

    async def info(url):
        async with SGLangClient(url) as c:
            return await c.get_server_info()
    assert asyncio.run(info(on))["enable_return_routed_experts"] is True
    assert asyncio.run(info(off))["enable_return_routed_experts"] is False
    out = _generate(off, PROMPT, return_routed_experts=True)
    assert out.routed_experts is None and out.output_ids
    with pytest.raises(EngineError, match="--enable-return-routed-experts"):
        out.routed_experts_array(LAYERS, TOP_K, len(PROMPT) + len(out.output_ids) - 1)


def test_request_fields_and_server_flag_exist_in_sglang():
    """The names the client sends and the launcher passes are SGLang 0.5.23's, and its ``get_topk``
    slices ``[start_len : seqlen - 1]``."""
    with _wheel() as z:
        io = z.read("sglang/srt/managers/io_struct.py").decode()
        exec_ = z.read("sglang/srt/arg_groups/fields/exec_.py").decode()
        base = z.read("sglang/srt/state_capturer/base.py").decode()
        tm = z.read("sglang/srt/managers/tokenizer_manager.py").decode()
    assert "return_routed_experts: bool = False" in io and "routed_experts_start_len: int = 0" in io
    assert "enable_return_routed_experts: A[" in exec_  # the --enable-return-routed-experts server arg
    assert "[start_len : seqlen - 1]" in base
    assert 'meta_info["routed_experts"]' in tm


class _Chars:
    """A stand-in tokenizer for the tiny MoE's 64 ids: one id per character."""

    eos_token_id = 1

    def encode(self, text, add_special_tokens=False):
        return [2 + ord(c) % 60 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids if i != self.eos_token_id)


def test_agentic_episode_routing_covers_every_position(workers):
    """A three-turn episode (observations between turns, each turn asking from where the previous
    one stopped, the prefix served by the cache) carries routing for every position but the last,
    equal to one HF forward over the whole episode."""
    from test_episodes import Scripted

    from megatron_m2po.data.dataset import PromptItem
    from megatron_m2po.rollout.episodes import EpisodeSettings, run_episode
    from megatron_m2po.rollout.producer import ProducerContext

    d, url, _ = workers
    tok = _Chars()

    async def go():
        async with SGLangClient(url) as c:
            ctx = ProducerContext(client=c, tokenizer=tok, reward=None, n_samples=1, version=0, group_prefix="s0",
                                  sampling_params={"temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True},
                                  seed=1, routed_experts=(LAYERS, TOP_K))
            row = PromptItem(index=0, problem="3+4", answer="7", prompt="3+4=", prompt_ids=tok.encode("3+4="))
            return await run_episode(ctx, lambda: Scripted(["xy", "zw"]), row, group="s0-g0", j=0,
                                     settings=EpisodeSettings(max_turns=5, format="raw"))
    t = asyncio.run(go())
    assert t.metadata["episode"]["turns"] == 3 and t.metadata["episode"]["cached_tokens"] > 0
    ids = list(t.prompt_ids) + list(t.response_ids)
    assert t.routed_experts.shape == (len(ids) - 1, LAYERS, TOP_K)
    np.testing.assert_array_equal(t.routed_experts, _reference(d, ids)[:-1])


# ------------------------------------------------------------------ routing across a weight push
# The trainer pushes with a retract pause and a cache flush (weights/transport.py). SGLang 0.5.23
# then prefills a retracted request again under the new weights and returns only the rows captured
# from that prefill on (schedule_batch.py Req.reset_for_retract, state_capturer/base.py get_topk);
# an agentic turn after a push finds nothing cached. Tokens sampled before the push were computed
# over routing the response no longer holds: rollout/routing_versions.py tags rows with their version.

class _NoReward:
    def score_batch(self, texts, answers):
        return types.SimpleNamespace(scores=[0.0] * len(texts))


@pytest.fixture(scope="module")
def new_gates(workers, tmp_path_factory):
    """The tiny MoE with other router weights (version 1 of the pushes below): it routes differently."""
    import transformers as tr

    model = tr.AutoModelForCausalLM.from_pretrained(workers[0], dtype=torch.float32)
    torch.manual_seed(11)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    path = tmp_path_factory.mktemp("tiny_moe_v1")
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


@pytest.fixture
def push(workers, tmp_path):
    """``push(path, version)`` with the trainer's disk sync (retract pause, flush); the engine gets the
    base weights back afterwards, so the module's other tests see them."""
    from megatron_m2po.weights.disk import DiskWeightSync

    d, url, _ = workers
    sync = DiskWeightSync([url], str(tmp_path / "sync"), base_model_dir=d, timeout_s=60)
    try:
        yield lambda path, version: sync.push(path, version)
    finally:
        sync.push(d, 0)
        sync.close()


def test_a_request_retracted_at_a_push_keeps_only_routing_that_produced_its_trained_tokens(workers, new_gates, push):
    """Async mode: one sample decoding when new router weights are pushed. The engine (SGLang's retract:
    the request is prefilled again) returns the new weights' routing for every position, also those
    whose tokens the old weights sampled over the old routing. The stored trajectory keeps those rows,
    tagged with version 1; the tokens of version 0 are not trained (loss_mask 0) and are counted
    (``metadata["routing"]``, ``rollout/routing_version_mismatch``); the tokens of version 1 are,
    over exactly the rows their log-probs were computed with."""
    from megatron_m2po.data.dataset import PromptItem
    from megatron_m2po.rollout.producer import ProducerContext, default_producer
    from megatron_m2po.trainer.batching import rollout_metrics

    d, url, _ = workers

    async def go():
        async with SGLangClient(url, timeout_s=120) as c:
            await c.slow_down(0.05)  # 200 tokens take >= 10 s: the push lands while the request decodes
            try:
                ctx = ProducerContext(client=c, tokenizer=_Chars(), reward=_NoReward(), n_samples=1, version=0,
                                      sampling_params={"temperature": 1.0, "max_new_tokens": 200, "ignore_eos": True},
                                      group_prefix="r", seed=5, routed_experts=(LAYERS, TOP_K), routing_replay=True)
                task = asyncio.ensure_future(default_producer(ctx, [PromptItem(0, "", "", "", PROMPT)]))

                async def decoding():
                    load = await c.loads()
                    return load["num_running_reqs"] == 1 and load["num_generated_tokens"] >= 3
                await async_wait_until(decoding, what=f"a request decoding 3 tokens on {url}")
                await asyncio.to_thread(push, new_gates, 1)
            finally:
                await c.slow_down(None)
            return await task
    groups = asyncio.run(go())
    t = groups[0].trajectories[0]
    k = int((t.versions == 0).sum())
    assert 3 <= k < len(t.versions) and set(t.versions[k:].tolist()) == {1}, f"no push in flight: {t.versions}"
    ids = list(t.prompt_ids) + list(t.response_ids)
    new, old = _reference(new_gates, ids)[:-1], _reference(d, ids)[:-1]
    np.testing.assert_array_equal(t.routed_experts, new)  # what SGLang returns after the re-prefill
    # The old weights' routing of the prompt and the first tokens is not what was stored: replaying it
    # for the version-0 tokens would replay routing that did not produce them.
    assert not np.array_equal(old[:len(PROMPT) + k - 1], new[:len(PROMPT) + k - 1])
    np.testing.assert_array_equal(t.loss_mask, (t.versions == 1).astype(np.uint8))
    assert t.metadata["routing"] == {"row_versions": [[1, 0, len(ids) - 1]], "model_tokens": len(t.versions),
                                     "mismatched_tokens": k}
    m = rollout_metrics(groups, correct_reward=1.0)
    assert m["rollout/routing_version_mismatch"] == k
    assert m["rollout/routing_version_mismatch_frac"] == pytest.approx(k / len(t.versions))


@pytest.mark.parametrize("observations", [["xy"], ["xy", "zw"]], ids=["push_before_last_turn", "turn_after"])
def test_an_agentic_turn_after_a_push_trains_only_tokens_whose_routing_is_stored(workers, new_gates, push,
                                                                                 observations):
    """An episode with a push between turn 1 and turn 2 (in the environment's step). Turn 2 is computed
    over its whole prefix re-prefilled by the new weights, while the rows kept from turn 1 are the old
    weights' (it asks only from where they stop). With two turns, turn 2's tokens are not trained and
    turn 1's are, over the old rows that produced them. With a third turn, the mixed rows make it ask
    from 0 again: every row is the new weights', turns 2 and 3 are trained and turn 1 is not."""
    from test_episodes import Scripted

    from megatron_m2po.data.dataset import PromptItem
    from megatron_m2po.rollout.episodes import EpisodeSettings, run_episode
    from megatron_m2po.rollout.producer import ProducerContext
    from megatron_m2po.store.types import Group
    from megatron_m2po.trainer.batching import rollout_metrics

    d, url, _ = workers
    tok = _Chars()

    async def on_step(turn):
        if turn == 1:
            await asyncio.to_thread(push, new_gates, 1)

    async def go():
        async with SGLangClient(url) as c:
            ctx = ProducerContext(client=c, tokenizer=tok, reward=None, n_samples=1, version=0, group_prefix="s0",
                                  sampling_params={"temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True},
                                  seed=1, routed_experts=(LAYERS, TOP_K), routing_replay=True)
            row = PromptItem(index=0, problem="3+4", answer="7", prompt="3+4=", prompt_ids=tok.encode("3+4="))
            return await run_episode(ctx, lambda: Scripted(observations, on_step=on_step), row, group="s0-g0", j=0,
                                     settings=EpisodeSettings(max_turns=5, format="raw"))
    t = asyncio.run(go())
    turns = len(observations) + 1
    assert t.metadata["episode"]["turns"] == turns
    model = t.behav_logprobs < 0  # observation tokens carry log-prob 0
    turn1 = model & (t.versions == 0)
    assert turn1.sum() == 5 and (model & (t.versions == 1)).sum() == 5 * (turns - 1)
    ids = list(t.prompt_ids) + list(t.response_ids)
    new, old = _reference(new_gates, ids)[:-1], _reference(d, ids)[:-1]
    first = len(t.prompt_ids) + 5 - 1  # rows turn 1 returned: the prompt and its tokens but the last
    assert not np.array_equal(old[:first], new[:first]), "the new gates route like the old ones here"
    if turns == 2:
        trained, mismatched = turn1, model & ~turn1
        np.testing.assert_array_equal(t.routed_experts[:first], old[:first])
        np.testing.assert_array_equal(t.routed_experts[first:], new[first:])
    else:
        trained, mismatched = model & ~turn1, turn1
        np.testing.assert_array_equal(t.routed_experts, new)
    np.testing.assert_array_equal(t.loss_mask.astype(bool), trained)
    assert t.metadata["routing"]["mismatched_tokens"] == int(mismatched.sum())
    groups = [Group("s0-g0", [t])]
    assert rollout_metrics(groups, correct_reward=1.0)["rollout/routing_version_mismatch"] == mismatched.sum()


def test_a_retracted_request_loses_the_routing_captured_before(workers):
    """SGLang 0.5.23 ``Req.reset_for_retract`` drops a retracted request's routed experts with its KV:
    aborted while it waits to be prefilled again, it answers without ``meta_info.routed_experts``
    (``_handle_abort_req`` builds no such field), not with the rows captured before the pause."""
    _, url, _ = workers

    async def go():
        async with SGLangClient(url) as c:
            await c.slow_down(0.05)
            try:
                task = asyncio.ensure_future(c.generate(PROMPT, {"max_new_tokens": 200, "ignore_eos": True},
                                                        return_routed_experts=True))

                async def decoding():
                    load = await c.loads()
                    return load["num_running_reqs"] == 1 and load["num_generated_tokens"] >= 3
                await async_wait_until(decoding, what=f"a request decoding 3 tokens on {url}")
                await c.pause_generation("retract")
                await c.abort(abort_all=True)
                return await task
            finally:
                await c.slow_down(None)
                await c.continue_generation()
    out = asyncio.run(go())
    assert out.finish_reason == {"type": "abort", "message": "Abort in waiting queue"}
    assert len(out.output_ids) >= 3 and out.routed_experts is None
