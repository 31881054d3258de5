"""Reward functions: the built-in math reward, custom functions by dotted path, batch scoring.

Trainer-facing API::

    reward = get_reward_fn(cfg.reward)            # starts the scoring pool (checks custom fns)
    res = reward.score_batch(texts, answers)      # RewardResult; never raises on timeout/crash
    res.scores, res.statuses, res.n_timeouts, res.n_errors, res.n_no_answer, res.metrics()
    reward.close()

``cfg.reward.fn`` selects the scorer:

- ``"math"`` (built in, paper appendix B): the last ``\\boxed{}`` of the response verified
  against the ground truth with math-verify; ``correct`` / ``wrong`` / ``no_answer`` scores
  come from :class:`~megatron_m2po.config.RewardConfig` (1.0 / 0.1 / 0.0 by default).
- ``"package.module:function"`` (a custom function), one of two shapes, checked at start-up
  (in the trainer process, before any worker starts) with a ``ValueError`` naming the path and
  the problem:

  * per item: ``fn(response: str, answer: str) -> float``. It must accept exactly these two
    positional arguments (extra parameters need defaults; ``**kw`` is allowed, nothing is
    passed through it today). Each call gets ``reward.timeout_s``.
  * batch: ``fn(responses: list[str], answers: list[str]) -> list[float]``, marked with the
    :func:`batch_reward` decorator (or an attribute ``m2po_batch = True``). The batch is split
    into one chunk per worker; a chunk of ``m`` items gets ``m * reward.timeout_s``, and a
    timeout or error fails the whole chunk.

  Either shape may be a coroutine function (``async def``, e.g. one that asks a service): the
  worker runs it on an event loop; the items of a chunk (one chunk per worker, as for batch
  functions) are awaited concurrently, each under ``reward.timeout_s`` (an item past it is a
  ``"timeout"``; the pool's deadline of ``m * reward.timeout_s`` per chunk still holds).

  The module must be importable in a fresh process (the workers are ``spawn``-ed and receive
  the trainer's ``sys.path``). Scores must be finite numbers; anything else is an ``"error"`` item.
- ``"http"``: a reward model behind HTTP at ``reward.url``
  (:class:`~megatron_m2po.rewards.http.HttpReward`: protocol, batching, timeouts, retries, and
  the error when the server is down), scored in the trainer process (no worker pool).

Every call runs in :class:`~megatron_m2po.rewards.pool.ScoringPool` (``reward.num_workers``
processes). A timeout or a crashed worker scores ``no_answer``, is counted
(``n_timeouts`` / ``n_errors``) and the worker is replaced; scoring never blocks training
beyond the deadline.

Item statuses: ``"correct"``, ``"wrong"``, ``"no_answer"`` (math), ``"ok"`` (custom function
returned a score), ``"timeout"``, ``"error"`` (the scorer raised, returned garbage, or its
worker crashed).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Callable

from megatron_m2po.utils.settings import ConfigError
from megatron_m2po.rewards.pool import ScorerSpec, ScoringPool, load_target
from megatron_m2po.rewards.result import STATUSES, RewardResult  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

__all__ = ["RewardResult", "RewardFunction", "get_reward_fn", "batch_reward", "BUILTIN_REWARDS",
           "check_reward_target"]

BUILTIN_REWARDS = ("math", "http")


def batch_reward(fn: Callable) -> Callable:
    """Mark ``fn(responses: list[str], answers: list[str]) -> list[float]`` as a batch reward."""
    fn.m2po_batch = True  # type: ignore[attr-defined]
    return fn


def _describe(fn: Callable) -> str:
    try:
        return f"{fn.__name__}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return repr(fn)


def check_reward_target(target: str) -> tuple[str, Callable]:
    """Import ``target`` and check its shape; returns ("item" | "batch", fn).

    Raises ValueError naming the path and the problem.
    """
    if ":" not in target and "." not in target:
        raise ValueError(f"reward.fn={target!r} is neither a built-in reward {list(BUILTIN_REWARDS)} nor "
                         "a dotted path 'package.module:function'")
    try:
        fn = load_target(target)
    except ValueError as e:
        raise ValueError(f"reward.fn={target!r}: {e}") from None
    except ImportError as e:
        raise ValueError(f"reward.fn={target!r}: cannot import the module ({e}); is it on PYTHONPATH?") from e
    except AttributeError as e:
        raise ValueError(f"reward.fn={target!r}: the module has no such attribute ({e})") from e
    if not callable(fn):
        raise ValueError(f"reward.fn={target!r} is a {type(fn).__name__}, not a function")
    kind = "batch" if getattr(fn, "m2po_batch", False) else "item"
    shape = ("fn(responses: list[str], answers: list[str]) -> list[float]" if kind == "batch"
             else "fn(response: str, answer: str) -> float")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return kind, fn  # builtins without a signature: trust them
    try:
        sig.bind("response", "answer")
    except TypeError as e:
        raise ValueError(f"reward.fn={target!r} has signature {_describe(fn)}, which cannot be called as "
                         f"{shape} ({e}); give extra parameters defaults") from None
    return kind, fn


def is_coroutine_fn(fn: Callable) -> bool:
    """``async def`` functions, and callable objects whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


class RewardFunction:
    """A reward scorer backed by a process pool. Build with :func:`get_reward_fn`."""

    def __init__(self, spec: ScorerSpec, *, num_workers: int, timeout_s: float, no_answer: float,
                 correct: float = 1.0):
        self.spec = spec
        self.name = spec.target or spec.kind
        self.no_answer = float(no_answer)
        self.correct = float(correct)
        self.timeout_s = float(timeout_s)
        self._pool = ScoringPool(spec, num_workers=num_workers, timeout_s=timeout_s)

    @property
    def num_workers(self) -> int:
        return self._pool.num_workers

    @property
    def n_restarts(self) -> int:
        """Workers replaced so far (after timeouts or crashes)."""
        return self._pool.n_restarts

    def score_batch(self, responses: list[str], answers: list[str]) -> RewardResult:
        """Score ``responses[i]`` against ``answers[i]``; thread-safe (calls are serialised)."""
        responses, answers = list(responses), list(answers)
        if len(responses) != len(answers):
            raise ValueError(f"score_batch got {len(responses)} responses but {len(answers)} answers")
        for name, seq in (("responses", responses), ("answers", answers)):
            for i, x in enumerate(seq):
                if not isinstance(x, str):
                    raise ValueError(f"score_batch: {name}[{i}] is {type(x).__name__} {x!r}, expected str")
        t0 = time.perf_counter()
        res = RewardResult()
        if not responses:
            return res
        if self.spec.kind == "batch" or self.spec.coroutine:  # coroutine items: awaited together per chunk
            n_chunks = min(self.num_workers, len(responses))
            bounds = [len(responses) * k // n_chunks for k in range(n_chunks + 1)]
            calls = [(responses[a:b], answers[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        else:
            calls = [([r], [a]) for r, a in zip(responses, answers)]
        for outcome in self._pool.run(calls):
            for score, status, msg in outcome.items:
                if status in ("timeout", "error"):
                    score = self.no_answer
                    if status == "timeout":
                        res.n_timeouts += 1
                    else:
                        res.n_errors += 1
                        logger.warning("reward %s: error while scoring: %s", self.name, msg)
                elif status == "no_answer":
                    res.n_no_answer += 1
                elif status == "correct":
                    res.n_correct += 1
                elif status == "wrong":
                    res.n_wrong += 1
                res.scores.append(float(score))
                res.statuses.append(status)
                res.messages.append(msg)
        res.elapsed_s = time.perf_counter() - t0
        return res

    async def score_batch_async(self, responses: list[str], answers: list[str]) -> RewardResult:
        """``score_batch`` in a thread, for asyncio producers (the pool itself needs no signals)."""
        return await asyncio.to_thread(self.score_batch, responses, answers)

    def score(self, response: str, answer: str) -> float:
        """Score one response (convenience; batches are much cheaper per item)."""
        return self.score_batch([response], [answer]).scores[0]

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._pool.close()

    def __enter__(self) -> "RewardFunction":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def get_reward_fn(reward_cfg) -> RewardFunction:
    """Build the reward of ``reward_cfg`` (a :class:`~megatron_m2po.config.RewardConfig`).

    Starts ``reward_cfg.num_workers`` processes and waits until they have loaded the scorer
    (about a second each). Raises ConfigError (a ValueError: ``m2po train`` prints it as one line)
    for an unknown name, a bad custom function or a reward server that is down.
    """
    try:
        return _build(reward_cfg)
    except ConfigError:
        raise
    except ValueError as e:  # the user's reward settings: one line, not a traceback
        raise ConfigError(str(e)) from None


def _build(reward_cfg) -> RewardFunction:
    values = (float(reward_cfg.correct), float(reward_cfg.wrong), float(reward_cfg.no_answer))
    fn_name = str(reward_cfg.fn).strip()
    if fn_name == "math":
        spec = ScorerSpec("math", "", values)
    elif fn_name == "http":
        from megatron_m2po.rewards.http import HttpReward

        return HttpReward.from_config(reward_cfg)  # type: ignore[return-value]  # the same interface
    else:
        kind, fn = check_reward_target(fn_name)
        spec = ScorerSpec(kind, fn_name, values, coroutine=is_coroutine_fn(fn),
                          item_timeout_s=float(reward_cfg.timeout_s))
    return RewardFunction(spec, num_workers=int(reward_cfg.num_workers), timeout_s=float(reward_cfg.timeout_s),
                          no_answer=values[2], correct=values[0])
