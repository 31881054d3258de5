"""Multi-turn episodes: an environment interface and the episode loop (``rollout.producer=agentic``).

An episode alternates model turns and environment steps::

    prompt = env.reset(row)                 # first observation (the task)
    repeat: turn  = engine.generate(prompt + response so far)   # loss_mask 1, behaviour log-probs, versions
            obs, reward, done = env.step(turn text)            # observation tokens: loss_mask 0
    until done, max_turns, max_episode_tokens, the context limit, or a timeout

and is stored as ONE trajectory (docs/agentic.md): ``prompt_ids`` = the first prompt,
``response_ids`` = every model turn and every observation after it, in order; ``loss_mask`` is 1 on
the model's tokens and 0 on the observations; ``behav_logprobs`` are the engine's sampling log-probs
on the model's tokens (0 on observations, never trained on); ``versions`` are the weight version of
each model token as the engine reports it (SGLang 0.5.23 ``meta_info["weight_versions"]`` spans), so
an episode that lived through weight pushes carries several versions; an observation token carries
the version of the model token before it (the sequence stays non-decreasing, which the store
checks). The reward is the sum of the rewards of the environment's steps, or ``timeout_reward``
when a step or the episode ran out of time.

Prefix cache. Every turn sends the whole conversation so far as ``input_ids``; the engine's radix
cache (SGLang 0.5.23 ``mem_cache/radix_cache.py``; the CPU worker's
``standins/cpu_prefix_cache.py``) finds the previous turn's prompt + output already computed and
prefills only the new observation. The engines report it as ``meta_info.cached_tokens``, summed per
episode into ``metadata["episode"]["cached_tokens"]`` (metric ``rollout/episode_cached_frac``). A
weight push flushes the cache, so a turn after a push recomputes its prefix under the new weights.
Routed experts (MoE routing replay) are asked per turn from where the kept ones stop, each row tagged
with the version that computed it; after a push the kept rows are older than the ones the next
turn is computed over, so the turn after that asks from 0 again, and model tokens computed over rows
other than the stored ones are counted and masked from the loss (``rollout/routing_versions.py``).

Chat templates. ``format=chat`` renders the first prompt with the tokenizer's own chat template
(``apply_chat_template(messages, tools=env.tools, add_generation_prompt=True)``) and each
observation as a ``tool`` message: the tokens the template puts between a finished assistant turn
and the next generation prompt (rendered on a fixed two-message conversation, the prefix checked to
be unchanged). The model's own tokens are never re-rendered: what it sampled is what is trained on.
``format=raw`` uses the dataset's prompt and the observation text as is (tokenizers without a chat
template, base models). A tokenizer without a chat template and ``format=chat`` is refused with
what to set.

Timeouts. Each environment step runs under ``step_timeout_s`` and the whole episode under
``episode_timeout_s`` (both also bound a model turn: a generate cut by the episode deadline is
aborted on the engine). On expiry the pending step is cancelled, ``env.close()`` runs (an
environment kills its processes there; it is also called after every episode), and the episode ends
with ``timeout_reward``, keeping the tokens so far; the ending is counted
(``metadata["episode"]["end"]``, metrics ``rollout/episode_end/<reason>``). An episode cut before
its first token holds one masked end-of-sequence token (a group keeps its ``n`` samples).

Environment errors. An exception from ``env.reset`` / ``env.step`` is a fault of the environment's
code in one episode: the episode ends with ``error_reward`` (ending ``env_error``, the traceback's
last line in ``metadata["episode"]["error"]``, logged once per distinct error with the environment's
name) and the run goes on; ``max_consecutive_env_errors`` such endings in a row stop it
(:class:`EnvErrors`; docs/agentic.md "Environment errors" compares verl and slime).
"""

from __future__ import annotations

import abc
import asyncio
import importlib
import importlib.util
import inspect
import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from megatron_m2po.rollout.settings import AgenticConfig
from megatron_m2po.rollout.group_ids import trajectory_uid
from megatron_m2po.rollout.producer import ProducerContext, sample_one, request_seed, routed_rows
from megatron_m2po.rollout.routing_versions import RoutedRows, keep_replayable, response_routing_version
from megatron_m2po.store.types import Group, Trajectory
from megatron_m2po.utils.aio import gather_or_cancel

log = logging.getLogger(__name__)

__all__ = ["Environment", "StepResult", "EpisodeSettings", "EpisodeTimeout", "EnvErrors", "load_environment",
           "make_episode_producer", "run_episode", "END_REASONS"]

# Why an episode ended (metadata["episode"]["end"]; metrics rollout/episode_end/<reason>).
END_REASONS = ("done", "max_turns", "max_tokens", "context", "stop", "step_timeout", "episode_timeout", "env_error")


@dataclass
class StepResult:
    """What an environment answers to one model turn.

    ``observation``: text appended after the turn (loss_mask 0; may be empty when ``done``);
    ``reward``: this step's reward (the episode's reward is the sum); ``done``: the episode ends;
    ``info``: JSON-serialisable details kept in the trajectory's ``metadata["episode"]["steps"]``.
    """

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


class Environment(abc.ABC):
    """One episode's environment. A new instance is made for every episode.

    Contract: ``reset(row)`` returns the first user message (text, rendered by the chat template
    with ``format=chat``) or None to use the dataset's rendered prompt as is; ``step(text)`` gets
    the model's turn as text and returns a :class:`StepResult`; ``close()`` releases what the
    environment holds (kills tool processes) and is called once after every episode, also after a
    timeout cancelled a step. All three are coroutines; a step that blocks must block in
    ``await`` (a subprocess, a socket), never in a busy loop, so that its timeout can cancel it.
    ``tools``: OpenAI-style function schemas handed to the chat template (``apply_chat_template(...,
    tools=...)``); ``stop``: extra stop strings of a model turn (SGLang ``sampling_params.stop``).
    """

    tools: Optional[list[dict]] = None
    stop: Optional[list[str]] = None

    @abc.abstractmethod
    async def reset(self, row: Any) -> Optional[str]:
        """Start an episode for ``row`` (a :class:`~megatron_m2po.data.dataset.PromptItem`)."""

    @abc.abstractmethod
    async def step(self, action: str) -> StepResult:
        """Act on the model's turn ``action``."""

    async def close(self) -> None:
        """Release what the episode holds; the default holds nothing."""
        return None


class EpisodeTimeout(Exception):
    """A step or the episode ran past its limit (internal: ends the episode with timeout_reward)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class EpisodeSettings:
    """The episode loop's limits (``rollout.agentic``; fields as in :class:`~megatron_m2po.config.AgenticConfig`)."""

    max_turns: int = 4
    max_episode_tokens: int = 4096
    max_context_tokens: int = 32768
    step_timeout_s: float = 60.0
    episode_timeout_s: float = 3600.0
    reset_timeout_s: float = 60.0
    timeout_reward: float = 0.0
    error_reward: float = 0.0
    max_consecutive_env_errors: int = 64
    format: str = "auto"

    @classmethod
    def from_config(cls, cfg: AgenticConfig) -> "EpisodeSettings":
        return cls(max_turns=cfg.max_turns, max_episode_tokens=cfg.max_episode_tokens,
                   max_context_tokens=cfg.max_context_tokens, step_timeout_s=cfg.step_timeout_s,
                   episode_timeout_s=cfg.episode_timeout_s, reset_timeout_s=cfg.reset_timeout_s,
                   timeout_reward=cfg.timeout_reward, error_reward=cfg.error_reward,
                   max_consecutive_env_errors=cfg.max_consecutive_env_errors, format=cfg.format)


def load_environment(spec: str, env_args: Optional[dict] = None) -> Callable[[], Environment]:
    """Import ``module:Name`` (or ``path/to/file.py:Name``) and return a factory of fresh
    environments (one is made here to check the interface)."""
    if ":" not in spec:
        raise ValueError(f"rollout.agentic.env={spec!r} must look like 'package.module:Name'")
    mod_name, name = spec.rsplit(":", 1)
    try:
        if mod_name.endswith(".py"):  # a file (examples/agentic_tool_env.py:CalculatorEnv)
            path = os.path.abspath(os.path.expanduser(mod_name))
            if not os.path.isfile(path):
                raise ImportError(f"no such file {path}")
            mod_spec = importlib.util.spec_from_file_location(f"m2po_env_{abs(hash(path))}", path)
            mod = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"rollout.agentic.env={spec!r}: cannot import {mod_name!r}: {e}") from e
    factory = getattr(mod, name, None)
    if factory is None or not callable(factory):
        raise ValueError(f"rollout.agentic.env={spec!r}: module {mod_name!r} has no callable {name!r}")
    args = dict(env_args or {})
    try:
        probe = factory(**args)
    except TypeError as e:
        raise ValueError(f"rollout.agentic.env={spec!r} refused rollout.agentic.env_args={args!r}: {e}") from e
    missing = [m for m in ("reset", "step", "close") if not inspect.iscoroutinefunction(getattr(probe, m, None))]
    if missing:
        raise ValueError(f"rollout.agentic.env={spec!r}: {type(probe).__name__} must have async {missing} "
                         "(megatron_m2po.rollout.episodes.Environment)")
    return lambda: factory(**args)


# ------------------------------------------------------------------------------------------- tokens
class _Renderer:
    """Turns the first prompt and observations into token ids (``raw`` or the model's chat template)."""

    def __init__(self, tokenizer: Any, fmt: str, tools: Optional[list[dict]]) -> None:
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if fmt == "auto":
            fmt = "chat" if has_template else "raw"
        if fmt == "chat" and not has_template:
            raise ValueError(f"rollout.agentic.format=chat but the tokenizer ({type(tokenizer).__name__}) has no chat "
                             "template; set rollout.agentic.format=raw (observations appended as plain text) or use "
                             "a model whose tokenizer_config.json carries a chat_template")
        if fmt not in ("chat", "raw"):
            raise ValueError(f"rollout.agentic.format={fmt!r}: use 'auto', 'chat' or 'raw'")
        self.tok, self.format, self.tools = tokenizer, fmt, tools

    def _chat(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        kw = {"tools": self.tools} if self.tools else {}
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kw)
        return list(self.tok.encode(text, add_special_tokens=False))

    def prompt(self, first: Optional[str], row: Any) -> list[int]:
        if first is None:
            return [int(t) for t in row.prompt_ids]
        if self.format == "raw":
            return list(self.tok.encode(first, add_special_tokens=False))
        return self._chat([{"role": "user", "content": first}], True)

    def observation(self, text: str) -> list[int]:
        if self.format == "raw":
            return list(self.tok.encode(text, add_special_tokens=False)) if text else []
        # The template's tokens between a finished assistant turn and the next generation prompt,
        # rendered on a fixed conversation (the model's own turn is never re-rendered).
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        before = self._chat(base, False)
        after = self._chat(base + [{"role": "tool", "content": text}], True)
        if after[:len(before)] != before:
            raise ValueError("the chat template renders a conversation differently once a tool message follows it; "
                             "it cannot extend an episode turn by turn: set rollout.agentic.format=raw")
        return after[len(before):]


# --------------------------------------------------------------------------------------------- loop
def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise EpisodeTimeout("episode_timeout")
    return left


async def _bounded(coro: Any, limit: float, deadline: float, reason: str) -> Any:
    """``await coro`` within ``limit`` s and the episode deadline; EpisodeTimeout names which ran out."""
    left = _remaining(deadline)
    try:
        return await asyncio.wait_for(coro, min(limit, left))
    except asyncio.TimeoutError:
        raise EpisodeTimeout(reason if limit < left else "episode_timeout") from None


class EnvErrors:
    """The environment-error policy of one producer (shared by its episodes).

    An exception raised by ``env.reset`` / ``env.step`` (or a step that returns no StepResult) is a
    fault of the environment's code in one episode: the episode ends with ``error_reward``, counted
    as ``env_error``, and the run goes on. The traceback's last line is logged once per distinct
    (environment, error). ``max_consecutive`` episodes ending in a row on an environment error
    (no episode finishing in between) means the environment fails everywhere: the next one raises
    RuntimeError naming the environment and the error, which stops the run.
    """

    def __init__(self, max_consecutive: int) -> None:
        self.max_consecutive = int(max_consecutive)
        self.consecutive = 0
        self.total = 0
        self.seen: set[tuple[str, str]] = set()

    def ok(self) -> None:
        self.consecutive = 0

    def failed(self, env_name: str, where: str, exc: BaseException) -> str:
        """Record one episode's error; returns its last traceback line; raises past the bound."""
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        self.consecutive += 1
        self.total += 1
        if (env_name, last) not in self.seen:
            self.seen.add((env_name, last))
            log.warning("environment %s raised in %s: %s (the episode ends with rollout.agentic.error_reward; "
                        "logged once per distinct error)", env_name, where, last)
        if self.consecutive >= self.max_consecutive:
            raise RuntimeError(f"environment {env_name} raised in {self.consecutive} episodes in a row (rollout.agentic."
                               f"max_consecutive_env_errors={self.max_consecutive}), last in {where}: {last}; fix the "
                               "environment (rollout.agentic.env) or raise the bound") from exc
        return last


@dataclass
class _Tape:
    """The episode so far: the response tokens and their per-token fields, and the counters."""

    resp: list = field(default_factory=list)
    logps: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    mask: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    per_turn_cached: list = field(default_factory=list)
    routed: RoutedRows = field(default_factory=RoutedRows)  # routed experts and their versions (return_routed_experts)
    reward: float = 0.0
    end: str = "max_turns"
    turns: int = 0
    sent: int = 0
    env_s: float = 0.0


class _EnvError(Exception):
    """An exception of the environment's own code (internal: ends the episode with error_reward)."""

    def __init__(self, where: str, exc: BaseException) -> None:
        super().__init__(where)
        self.where, self.exc = where, exc


async def _env_call(coro: Any, limit: float, deadline: float, reason: str, where: str) -> Any:
    """``_bounded`` around an environment coroutine; its exceptions become ``_EnvError``."""
    try:
        return await _bounded(coro, limit, deadline, reason)
    except (EpisodeTimeout, asyncio.CancelledError):
        raise
    except Exception as e:
        raise _EnvError(where, e) from e


async def _turns(ctx: ProducerContext, env: Environment, render: "_Renderer", prompt: list[int], tape: _Tape, *,
                 group: str, j: int, s: EpisodeSettings, deadline: float) -> None:
    """Model turns and environment steps until the episode ends (``tape.end`` says why)."""
    tok = ctx.tokenizer
    while tape.turns < s.max_turns:
        room = min(s.max_episode_tokens - len(tape.resp), s.max_context_tokens - len(prompt) - len(tape.resp))
        if room <= 0:
            tape.end = "max_tokens" if s.max_episode_tokens - len(tape.resp) <= 0 else "context"
            return
        params = dict(ctx.sampling_params_for(group, j))
        params["max_new_tokens"] = int(min(room, params.get("max_new_tokens", room)))
        if ctx.seed is not None:  # a distinct, reproducible seed per turn
            params["sampling_seed"] = request_seed(ctx.seed, f"{group}/turn{tape.turns}", j)
        if getattr(env, "stop", None):
            params["stop"] = list(env.stop)
        start = tape.routed.ask_from()
        out = await _bounded(sample_one(ctx, prompt + tape.resp, params, routed_start=start, affinity=group), float("inf"),
                             deadline, "episode_timeout")
        floor = tape.versions[-1] if tape.versions else ctx.version
        if ctx.routed_experts is not None:  # this turn's prefill and decode: up to its last token
            stop = len(prompt) + len(tape.resp) + len(out.output_ids) - 1
            tape.routed.add(routed_rows(ctx, out, start, stop), start, response_routing_version(out, floor))
        tape.turns += 1
        tape.sent += len(prompt) + len(tape.resp)
        tape.per_turn_cached.append(int(getattr(out, "cached_tokens", 0) or 0))
        tape.resp.extend(int(t) for t in out.output_ids)
        tape.logps.extend(float(x) for x in out.output_logprobs)
        tape.versions.extend(_turn_versions(out, floor))
        tape.mask.extend([1] * len(out.output_ids))
        text = tok.decode(out.output_ids, skip_special_tokens=True)
        t_step = time.monotonic()
        try:
            res = await _env_call(env.step(text), s.step_timeout_s, deadline, "step_timeout", "step")
        finally:
            tape.env_s += time.monotonic() - t_step
        if not isinstance(res, StepResult):
            raise _EnvError("step", TypeError(f"{type(env).__name__}.step returned {type(res).__name__}; "
                                              "return a StepResult"))
        tape.reward += float(res.reward)
        tape.steps.append({"reward": float(res.reward), **(res.info or {})})
        if res.done:
            tape.end = "done"
            return
        if tape.turns >= s.max_turns:  # no model turn follows: the last observation is not kept
            return
        obs = render.observation(res.observation)
        room = min(s.max_episode_tokens - len(tape.resp), s.max_context_tokens - len(prompt) - len(tape.resp))
        if len(obs) > room:  # an observation that does not fit ends the episode (never truncated)
            tape.end = "max_tokens" if s.max_episode_tokens - len(tape.resp) < len(obs) else "context"
            return
        tape.resp.extend(obs)
        tape.logps.extend([0.0] * len(obs))
        tape.versions.extend([tape.versions[-1] if tape.versions else ctx.version] * len(obs))
        tape.mask.extend([0] * len(obs))


async def run_episode(ctx: ProducerContext, make_env: Callable[[], Environment], row: Any, *, group: str, j: int,
                      settings: EpisodeSettings, errors: Optional[EnvErrors] = None) -> Trajectory:
    """One episode of ``row`` as one trajectory (sample ``j`` of group ``group``); ``errors``: the
    producer's environment-error policy (a fresh one when not given)."""
    s = settings
    errors = errors if errors is not None else EnvErrors(s.max_consecutive_env_errors)
    env = make_env()
    name = type(env).__name__
    t0 = time.monotonic()
    deadline = t0 + s.episode_timeout_s
    tok = ctx.tokenizer
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    tape = _Tape()
    prompt: list[int] = []
    render: Optional[_Renderer] = None
    error: Optional[str] = None
    try:
        first = await _env_call(env.reset(row), s.reset_timeout_s, deadline, "reset_timeout", "reset")
        render = _Renderer(tok, s.format, getattr(env, "tools", None))
        prompt = render.prompt(first, row)
        if not prompt:
            raise _EnvError("reset", ValueError(f"{name}.reset gave an empty first prompt for row "
                                                f"{getattr(row, 'index', '?')}"))
        await _turns(ctx, env, render, prompt, tape, group=group, j=j, s=s, deadline=deadline)
    except EpisodeTimeout as e:
        tape.end, tape.reward = e.reason, float(s.timeout_reward)
        log.warning("episode %s/%d ended by %s after %d turn(s); reward %s", group, j, e.reason, tape.turns, tape.reward)
        if e.reason == "reset_timeout":
            raise RuntimeError(f"{name}.reset did not answer within rollout.agentic.reset_timeout_s="
                               f"{s.reset_timeout_s}") from None
    except _EnvError as e:
        tape.end, tape.reward = "env_error", float(s.error_reward)
        error = errors.failed(name, e.where, e.exc)  # raises once every episode fails
    finally:
        await _close(env, name, s, errors)
    if tape.end != "env_error":
        errors.ok()
    if not prompt:  # reset failed: the dataset's prompt stands in for the first prompt
        prompt = [int(t) for t in getattr(row, "prompt_ids", [])] or [int(eos)]
    return _trajectory(ctx, tape, prompt, row, group=group, j=j, eos=int(eos), error=error, t0=t0,
                       fmt=render.format if render is not None else s.format)


async def _close(env: Environment, name: str, s: EpisodeSettings, errors: EnvErrors) -> None:
    limit = max(s.step_timeout_s, 1.0)
    try:
        await asyncio.wait_for(env.close(), limit)
    except asyncio.TimeoutError:
        log.warning("%s.close did not finish within %.0f s", name, limit)
    except Exception as e:  # the episode is over; a failing close is logged (once per distinct error)
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        if (name, "close:" + last) not in errors.seen:
            errors.seen.add((name, "close:" + last))
            log.warning("environment %s raised in close: %s (logged once per distinct error)", name, last)


def _trajectory(ctx: ProducerContext, tape: _Tape, prompt: list[int], row: Any, *, group: str, j: int, eos: int,
                error: Optional[str], t0: float, fmt: str) -> Trajectory:
    if not tape.resp:  # cut before its first token: one masked token keeps the group whole
        tape.resp, tape.logps, tape.versions, tape.mask = [eos], [0.0], [ctx.version], [0]
    finish = {"done": "stop", "max_turns": "length", "max_tokens": "length", "context": "length"}.get(tape.end, "abort")
    episode = {"turns": tape.turns, "end": tape.end, "env_s": round(tape.env_s, 4),
               "wall_s": round(time.monotonic() - t0, 4), "cached_tokens": sum(tape.per_turn_cached),
               "sent_tokens": tape.sent, "cached_per_turn": tape.per_turn_cached, "format": fmt, "steps": tape.steps}
    if error is not None:
        episode["error"] = error
    meta = {"prompt_index": int(getattr(row, "index", -1)), "answer": getattr(row, "answer", None), **ctx.metadata,
            "episode": episode}
    rows = len(prompt) + len(tape.resp) - 1
    versions, mask = np.asarray(tape.versions, dtype=np.int64), np.asarray(tape.mask, dtype=np.uint8)
    if ctx.routed_experts is not None:  # model tokens computed over other rows than the stored ones
        mask, meta["routing"] = keep_replayable(len(prompt), versions, mask, tape.routed.row_versions(rows),
                                                replay=ctx.routing_replay)
    return Trajectory(uid=trajectory_uid(group, j), group_id=group, prompt_ids=np.asarray(prompt),
                      response_ids=np.asarray(tape.resp), behav_logprobs=np.asarray(tape.logps, dtype=np.float32),
                      versions=versions, reward=float(tape.reward), loss_mask=mask, finish_reason=finish,
                      metadata=meta, routed_experts=_episode_routing(ctx, tape.routed, rows))


def _episode_routing(ctx: Any, routed: RoutedRows, rows: int) -> Optional[np.ndarray]:
    """An episode's routed experts ``[rows, layers, top_k]``: each model turn's (asked from where the
    previous one stopped: the observation before it is run in its prefill, the earlier tokens keep
    the routing of their first forward, as the engine's cache does; asked from 0 after a push made the
    kept rows older than the engine's, ``RoutedRows.ask_from``). Positions after the last
    model token (an observation that no turn followed, the masked token of an episode cut before
    its first turn, or the dataset prompt standing in after a failed reset) were never run by the
    engine: they get experts ``0 .. top_k - 1``. Only they and the masked tokens after them see that
    choice (causal attention), so no trained token does."""
    if ctx.routed_experts is None:
        return None
    layers, k = ctx.routed_experts
    have = np.concatenate(routed.pieces) if routed.pieces else np.zeros((0, layers, k), np.int32)
    fill = np.broadcast_to(np.arange(k, dtype=np.int32), (rows - have.shape[0], layers, k))
    return np.concatenate([have[:rows], fill])


def _turn_versions(out: Any, floor: int) -> list[int]:
    """Per-token versions of one turn: the engine's spans; without spans, ``floor`` (the version of
    the conversation's previous token, or the batch's submission version): the oldest the turn's
    tokens may come from, so measured staleness is an upper bound (as rollout/producer.py does)."""
    n = len(out.output_ids)
    tv = out.token_weight_versions
    if tv is not None and len(tv) == n:
        return [int(v) for v in tv]
    return [int(floor)] * n


def make_episode_producer(cfg: AgenticConfig) -> Callable:
    """The ``rollout.producer=agentic`` producer for ``cfg`` (a ``rollout.agentic`` section)."""
    make_env = load_environment(cfg.env, cfg.env_args)
    settings = EpisodeSettings.from_config(cfg)
    errors = EnvErrors(settings.max_consecutive_env_errors)  # counts across batches: a run whose env always fails stops

    async def episode_producer(ctx: ProducerContext, prompts: list) -> list[Group]:
        """``ctx.n_samples`` concurrent episodes per prompt, one group per prompt."""
        gids = [ctx.group_id(p) for p in range(len(prompts))]
        jobs = [run_episode(ctx, make_env, item, group=gids[p], j=j, settings=settings, errors=errors)
                for p, item in enumerate(prompts) for j in range(ctx.n_samples)]
        trajs = await gather_or_cancel(*jobs)
        n = ctx.n_samples
        return [Group(gids[p], list(trajs[p * n:(p + 1) * n])) for p in range(len(prompts))]

    episode_producer.settings = settings  # for inspection in tests and logs
    episode_producer.errors = errors
    return episode_producer
