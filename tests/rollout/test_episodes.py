"""Multi-turn episodes (rollout/episodes.py) against a real CPU worker serving the tiny base model.

What is pinned down: an episode is one trajectory whose observation tokens are masked (loss_mask 0,
log-prob 0) and whose model tokens are exactly what the engine sampled; each turn re-sends the
conversation and the engine's prefix cache supplies it; a weight push between turns gives the later
turn's tokens the new version (and flushes the cache); a hung tool is killed at step_timeout_s and
the episode ends with timeout_reward; the episode deadline, max_turns and max_episode_tokens end
an episode with the ending counted; chat templates with tools render observations as the model's
template does, and a tokenizer without one is refused with what to set.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_m2po.config import RolloutConfig
from megatron_m2po.data.dataset import PromptItem
from megatron_m2po.rollout.client import SGLangClient
from megatron_m2po.rollout.engines import EngineFleet
from megatron_m2po.rollout.episodes import (EpisodeSettings, Environment, StepResult, _Renderer,
                                            load_environment, make_episode_producer, run_episode)
from megatron_m2po.rollout.group_ids import group_id
from megatron_m2po.rollout.producer import ProducerContext
from megatron_m2po.standins.tiny_base import ensure_tiny_base

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from agentic_tool_env import CalculatorEnv  # noqa: E402

pytestmark = pytest.mark.slow  # engine processes, routers or multi-rank sweeps in module fixtures: the full suite's lane

PARAMS = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def tiny():
    """(model dir, tokenizer) of the tiny base (built once, cached as `model.hf_path=tiny` does)."""
    from transformers import AutoTokenizer
    path = ensure_tiny_base(os.path.expanduser("~/.cache/megatron_m2po/tiny_base"), progress=False)
    return str(path), AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def engine(tiny, tmp_path_factory):
    cfg = RolloutConfig(engine="cpu_worker", launcher="local", num_engines=1, base_port=0, use_router=False,
                        concurrency=16, weight_sync_timeout_s=60.0)
    f = EngineFleet(cfg, tiny[0], run_dir=str(tmp_path_factory.mktemp("episodes_run")), startup_timeout_s=120)
    f.start()
    try:
        yield f.engine_urls[0]
    finally:
        f.stop()


def _row(problem="3+4", answer="7", tok=None) -> PromptItem:
    ids = tok.encode(f"{problem}=", add_special_tokens=False) if tok is not None else []
    return PromptItem(index=0, problem=problem, answer=answer, prompt=f"{problem}=", prompt_ids=ids)


def _ctx(client, tok, version=0, seed=1) -> ProducerContext:
    params = {**PARAMS, "stop_token_ids": [int(tok.eos_token_id)]}
    return ProducerContext(client=client, tokenizer=tok, reward=None, sampling_params=params, n_samples=2,
                           version=version, group_prefix="s000000", seed=seed)


def _two_rows(tok) -> list[PromptItem]:
    return [PromptItem(index=i, problem=p, answer=a, prompt=f"{p}=", prompt_ids=tok.encode(f"{p}=")) for i, (p, a)
            in enumerate([("1+2", "3"), ("5-1", "4")])]


def _produce(engine, producer, tok, rows):
    async def go():
        async with SGLangClient(engine) as c:
            return await producer(_ctx(c, tok), rows)
    return asyncio.run(go())


class Scripted(Environment):
    """Answers each turn with the next scripted observation; done after the last one."""

    def __init__(self, observations, final_reward=1.0, on_step=None):
        self.obs, self.final, self.on_step, self.turns, self.closed = list(observations), final_reward, on_step, [], 0

    async def reset(self, row):
        return f"{row.problem}="

    async def step(self, action):
        self.turns.append(action)
        if self.on_step is not None:
            await self.on_step(len(self.turns))
        if len(self.turns) > len(self.obs):
            return StepResult("", self.final, True, {"n": len(self.turns)})
        return StepResult(self.obs[len(self.turns) - 1], 0.25, False)

    async def close(self):
        self.closed += 1


def _episode(url, tok, env, settings, **kw):
    async def go():
        async with SGLangClient(url) as c:
            return await run_episode(_ctx(c, tok, **kw), lambda: env, _row(tok=tok), group="s000000-g000000", j=0,
                                     settings=settings)
    return asyncio.run(go())


def _segments(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of the mask."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((int(mask[start]), start, i))
            start = i
    return out


def test_episode_layout_masks_observations_and_reuses_the_prefix(engine, tiny):
    tok = tiny[1]
    obs = ["\n1+1=", "\n2+5="]
    env = Scripted(obs)
    t = _episode(engine, tok, env, EpisodeSettings(max_turns=5, format="raw"))
    t.validate(current_version=0)
    ep = t.metadata["episode"]
    assert (ep["turns"], ep["end"], t.finish_reason) == (3, "done", "stop")
    assert t.reward == pytest.approx(0.25 + 0.25 + 1.0)
    assert env.closed == 1
    assert list(t.prompt_ids) == tok.encode("3+4=", add_special_tokens=False)
    segs = _segments(t.loss_mask)
    assert [v for v, _, _ in segs] == [1, 0, 1, 0, 1], segs
    # Observation tokens: exactly the environment's text, masked, log-prob 0.
    for (_v, a, b), text in zip([s for s in segs if s[0] == 0], obs):
        assert list(t.response_ids[a:b]) == tok.encode(text, add_special_tokens=False)
        assert (t.behav_logprobs[a:b] == 0).all()
    # Model tokens: what the engine sampled, decoded as the environment saw them.
    for (_v, a, b), text in zip([s for s in segs if s[0] == 1], env.turns):
        assert tok.decode(t.response_ids[a:b], skip_special_tokens=True) == text
        assert (t.behav_logprobs[a:b] < 0).all() and (t.versions[a:b] == 0).all()
    # Turns 2 and 3 re-sent the conversation; the radix cache supplied all but the new observation.
    assert len(ep["cached_per_turn"]) == 3 and sum(ep["cached_per_turn"]) == ep["cached_tokens"]
    for turn in (1, 2):  # turn k's prefix: the prompt and the response up to its last observation
        sent = len(t.prompt_ids) + segs[2 * turn - 1][1]
        assert ep["cached_per_turn"][turn] >= sent - 1 - len(tok.encode(obs[turn - 1], add_special_tokens=False)), ep


def test_a_weight_push_between_turns_tags_the_later_turn_with_the_new_version(engine, tiny):
    tok = tiny[1]

    async def push(turn):
        if turn == 1:  # between turn 1 and turn 2: the trainer pushes version 1 (same weights, new version)
            async with SGLangClient(engine) as c:
                await c.update_weights_from_disk(tiny[0], weight_version="1", timeout_s=60)

    async def restore():
        async with SGLangClient(engine) as c:
            await c.update_weights_from_disk(tiny[0], weight_version="0", timeout_s=60)

    try:
        t = _episode(engine, tok, Scripted(["\n1+1="], on_step=push), EpisodeSettings(max_turns=4, format="raw"))
    finally:
        asyncio.run(restore())
    t.validate(current_version=1)
    segs = _segments(t.loss_mask)
    assert [v for v, _, _ in segs] == [1, 0, 1], segs
    (_, a1, b1), (_, a0, b0), (_, a2, b2) = segs
    assert (t.versions[a1:b1] == 0).all() and (t.versions[a0:b0] == 0).all(), t.versions
    assert (t.versions[a2:b2] == 1).all(), t.versions
    assert (t.min_version, t.max_version) == (0, 1)
    # The push flushed the prefix cache: turn 2 recomputed its whole prefix under version 1.
    assert t.metadata["episode"]["cached_per_turn"][1] == 0, t.metadata["episode"]


def test_a_hung_tool_is_killed_at_the_step_timeout(engine, tiny):
    hang = [sys.executable, "-I", "-S", "-c", "import time\nwhile True: time.sleep(1)"]  # elapsed time is the behaviour under test (a tool that never answers)
    class AlwaysCalls(CalculatorEnv):  # the tiny base answers; here every turn is sent to the tool
        async def step(self, action):
            return await super().step(f"calculator({action})")

    env = AlwaysCalls(tool_argv=hang, tool_wall_s=600)
    settings = EpisodeSettings(max_turns=3, format="raw", step_timeout_s=1.5, timeout_reward=-1.0)
    t = _episode(engine, tiny[1], env, settings)
    ep = t.metadata["episode"]
    assert (ep["end"], t.reward, t.finish_reason, ep["turns"]) == ("step_timeout", -1.0, "abort", 1), ep
    assert len(env.sandbox.pids) == 1
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left running
        os.kill(env.sandbox.pids[0], 0)
    t.validate()


def test_the_episode_deadline_ends_a_slow_episode_with_the_timeout_reward(engine, tiny):
    class Stuck(Scripted):
        async def step(self, action):
            await asyncio.Event().wait()  # never answers

    settings = EpisodeSettings(max_turns=3, format="raw", step_timeout_s=600, episode_timeout_s=1.5,
                               timeout_reward=-0.5)
    env = Stuck([])
    t = _episode(engine, tiny[1], env, settings)
    ep = t.metadata["episode"]
    assert (ep["end"], t.reward, env.closed) == ("episode_timeout", -0.5, 1), ep
    assert t.loss_mask.sum() == len(t.response_ids) > 0  # the first turn is kept


def test_max_turns_and_max_episode_tokens_end_the_episode(engine, tiny):
    tok = tiny[1]
    t = _episode(engine, tok, Scripted(["\n1+1="] * 10), EpisodeSettings(max_turns=2, format="raw"))
    assert (t.metadata["episode"]["turns"], t.metadata["episode"]["end"], t.finish_reason) == (2, "max_turns", "length")
    assert [v for v, _, _ in _segments(t.loss_mask)] == [1, 0, 1]
    t = _episode(engine, tok, Scripted(["\n1+1="] * 10), EpisodeSettings(max_turns=10, max_episode_tokens=14,
                                                                       format="raw"))
    ep = t.metadata["episode"]
    assert ep["end"] == "max_tokens" and len(t.response_ids) <= 14, (ep, len(t.response_ids))
    t.validate()


def test_the_tool_environment_runs_calls_in_the_sandbox_and_grades_answers():
    from megatron_m2po.standins.tiny_tools import CALCULATOR_TOOLS, parse_tool_call

    async def go():
        env = CalculatorEnv()
        await env.reset(_row("3+4", "7"))
        out = [await env.step(a) for a in (
            "calculator(3*4)", '<tool_call>{"name": "calculator", "arguments": {"expression": "2**10"}}</tool_call>',
            "calculator(__import__('os').system('true'))", "search(3+4)", "\\boxed{7}")]
        await env.close()
        env = CalculatorEnv()
        await env.reset(_row("3+4", "7"))
        out.append(await env.step("\\boxed{6}"))
        return out
    call, hermes, bomb, unknown, right, wrong = asyncio.run(go())
    assert (call.observation, call.reward, call.done, call.info["tool_calls"]) == ("12", 0.0, False, 1)
    assert hermes.observation == "1024" and not hermes.done
    assert bomb.info["tool_out"] == "error: only arithmetic" and not bomb.done
    assert unknown.observation == "error: no tool 'search'" and unknown.info["tool_calls"] == 1
    assert (right.reward, right.done, right.info["tool_calls"]) == (1.0, True, 0)
    assert (wrong.reward, wrong.done) == (0.0, True)
    # The environment and the tiny tool base agree on the tool and the call syntax.
    assert CalculatorEnv.tools == CALCULATOR_TOOLS
    assert parse_tool_call("calculator(12*7)") == ("calculator", "12*7") and parse_tool_call("\\boxed{84}") is None


def test_the_producer_makes_one_group_of_episodes_per_prompt(engine, tiny):
    from megatron_m2po.config import AgenticConfig
    cfg = AgenticConfig(env=f"{ROOT}/examples/agentic_slow_env.py:SlowEnv", env_args={"latency_s": 0.0},
                        format="raw", max_turns=2)
    producer = make_episode_producer(cfg)
    tok = tiny[1]
    rows = _two_rows(tok)
    groups = _produce(engine, producer, tok, rows)
    assert [g.group_id for g in groups] == [group_id("s000000", 0), group_id("s000000", 1)]
    for g, row in zip(groups, rows):
        g.validate(current_version=0)
        assert len(g.trajectories) == 2
        for t in g.trajectories:
            assert list(t.prompt_ids) == row.prompt_ids and t.metadata["answer"] == row.answer
            assert t.reward in (0.0, 1.0) and t.metadata["episode"]["turns"] in (1, 2)


def test_bad_environment_specs_are_refused_with_what_to_set(tmp_path):
    with pytest.raises(ValueError, match="must look like"):
        load_environment("agentic_slow_env.SlowEnv")
    with pytest.raises(ValueError, match="cannot import"):
        load_environment(f"{tmp_path}/missing.py:SlowEnv")
    with pytest.raises(ValueError, match="refused rollout.agentic.env_args"):
        load_environment(f"{ROOT}/examples/agentic_slow_env.py:SlowEnv", {"latency": 1})
    bad = tmp_path / "sync_env.py"
    bad.write_text("class Env:\n    def reset(self, row): pass\n    def step(self, a): pass\n    def close(self): pass\n")
    with pytest.raises(ValueError, match=r"must have async \['reset', 'step', 'close'\]"):
        load_environment(f"{bad}:Env")


QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t['function']['name'] }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_format_follows_the_model_template_with_tools():
    sys.path.insert(0, str(ROOT / "tests" / "data"))
    from m2po_char_tokenizer import build_char_tokenizer
    tok = build_char_tokenizer(QWEN_LIKE)
    r = _Renderer(tok, "auto", CalculatorEnv.tools)
    assert r.format == "chat"
    prompt = r.prompt("3+4=?", _row())
    assert tok.decode(prompt) == ("<|im_start|>system\n# Tools\ncalculator\n<|im_end|>\n<|im_start|>user\n3+4=?"
                                  "<|im_end|>\n<|im_start|>assistant\n")
    obs = r.observation("7")
    assert tok.decode(obs) == "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="has no chat template; set rollout.agentic.format=raw"):
        _Renderer(build_char_tokenizer(None), "chat", None)
    assert _Renderer(build_char_tokenizer(None), "auto", None).format == "raw"


class Raises(Scripted):
    """Raises in ``where`` ('reset' or 'step'); a Scripted environment otherwise."""

    def __init__(self, where, message="the simulator crashed"):
        super().__init__([])
        self.where, self.message = where, message

    async def reset(self, row):
        if self.where == "reset":
            raise ConnectionError(self.message)
        return await super().reset(row)

    async def step(self, action):
        self.turns.append(action)
        if self.where == "step":
            raise ValueError(self.message)
        return StepResult("", 1.0, True)


def test_an_environment_that_raises_ends_its_episode_with_the_error_reward(engine, tiny, caplog):
    """verl's tool agent loop turns a tool's exception into an error observation and goes on; slime's
    examples let it fail the rollout. Here env.reset / env.step are the environment's own code: its
    exception ends that episode with rollout.agentic.error_reward (tokens kept, counted env_error),
    logged once per distinct error with the environment's name, and the next episode runs."""
    from megatron_m2po.rollout.episodes import EnvErrors
    tok = tiny[1]
    settings = EpisodeSettings(max_turns=3, format="raw", error_reward=-0.75, max_consecutive_env_errors=3)
    errors = EnvErrors(settings.max_consecutive_env_errors)

    async def go(env):
        async with SGLangClient(engine) as c:
            return await run_episode(_ctx(c, tok), lambda: env, _row(tok=tok), group="s000000-g000000", j=0,
                                     settings=settings, errors=errors)

    caplog.set_level("WARNING", logger="megatron_m2po.rollout.episodes")
    on_step = [Raises("step"), Raises("step")]
    trajs = [asyncio.run(go(env)) for env in on_step]
    for env, t in zip(on_step, trajs):
        ep = t.metadata["episode"]
        assert (ep["end"], t.reward, t.finish_reason, ep["turns"], env.closed) == ("env_error", -0.75, "abort", 1, 1)
        assert ep["error"] == "ValueError: the simulator crashed"
        assert t.loss_mask.all() and len(t.response_ids) > 0  # the model's turn is kept
        t.validate()
    assert errors.consecutive == 2
    warned = [r.getMessage() for r in caplog.records if "raised in step" in r.getMessage()]
    assert len(warned) == 1 and "Raises" in warned[0] and "ValueError: the simulator crashed" in warned[0], warned
    ok = asyncio.run(go(Scripted([])))  # an episode that finishes resets the count
    assert ok.metadata["episode"]["end"] == "done" and errors.consecutive == 0
    env = Raises("reset")
    t = asyncio.run(go(env))
    ep = t.metadata["episode"]
    assert (ep["end"], t.reward, ep["turns"], env.closed, ep["error"]) == (
        "env_error", -0.75, 0, 1, "ConnectionError: the simulator crashed")
    assert list(t.prompt_ids) == _row(tok=tok).prompt_ids and t.loss_mask.sum() == 0  # one masked token
    t.validate()
    assert errors.total == 3 and errors.consecutive == 1


def test_an_environment_that_always_raises_stops_the_run_naming_it(engine, tiny, tmp_path):
    from megatron_m2po.config import AgenticConfig
    env_file = tmp_path / "broken_env.py"
    env_file.write_text(
        "from megatron_m2po.rollout.episodes import Environment\n"
        "class BrokenEnv(Environment):\n"
        "    async def reset(self, row):\n        return None\n"
        "    async def step(self, action):\n        raise KeyError('no such tool')\n")
    cfg = AgenticConfig(env=f"{env_file}:BrokenEnv", format="raw", max_turns=2, max_consecutive_env_errors=3)
    producer = make_episode_producer(cfg)
    tok = tiny[1]
    with pytest.raises(RuntimeError, match=r"environment BrokenEnv raised in 3 episodes in a row .*max_consecutive_env"
                                           r"_errors=3\), last in step: KeyError: 'no such tool'"):
        _produce(engine, producer, tok, _two_rows(tok))
