"""``reward.fn=http``: scores from a reward model served over HTTP.

Protocol (one request per batch of at most ``reward.batch_size`` items)::

    POST <reward.url>   {"responses": [str, ...], "answers": [str, ...]}
    200                 {"scores": [float, ...]}      # one finite number per response, in order

Up to ``reward.max_concurrency`` requests are in flight at once. Each request gets
``reward.request_timeout_s``; a request that cannot connect, times out, or is answered 429 / 5xx
is sent again up to ``reward.max_retries`` times (backoff 0.5 s, 1 s, 2 s, ...). What is left
after the retries:

- the server cannot be reached (refused, unknown host, connection dropped):
  :class:`RewardServiceError` naming the URL. A run must not go on training on rewards it never
  got; the trainer stops with that message.
- timeouts: the batch's items score ``reward.no_answer`` with status ``"timeout"``, counted in
  ``reward/n_timeouts`` (a hanging reward model slows the run by the timeout, visibly);
- an error status or a malformed answer (not JSON, no ``scores`` list, wrong length, a score
  that is not a finite number): status ``"error"``, counted in ``reward/n_errors`` and logged
  with the start of the body.

Start-up (:meth:`HttpReward.from_config`) sends an empty batch and expects ``{"scores": []}``:
a server that is down, or speaks another protocol, is a ``ValueError`` before any engine starts.

Scoring runs in the trainer process (no worker pool: the work is waiting on sockets):
``score_batch`` runs its own event loop (callers use it from threads), ``score_batch_async`` runs
on the caller's.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Optional

import aiohttp

from megatron_m2po.rewards.result import RewardResult
from megatron_m2po.utils.aio import gather_or_cancel

logger = logging.getLogger(__name__)

__all__ = ["HttpReward", "RewardServiceError"]

_RETRY_STATUSES = {429, 500, 502, 503, 504}
_BACKOFF_S = 0.5


class RewardServiceError(RuntimeError):
    """The reward server could not be reached after every retry."""


class _Failed(Exception):
    """A request's outcome after its retries: ``status`` is "timeout" or "error"."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


class HttpReward:
    """A reward model over HTTP with the interface of :class:`~megatron_m2po.rewards.registry.RewardFunction`
    (``score_batch``, ``score_batch_async``, ``score``, ``close``). Build with :meth:`from_config`."""

    def __init__(self, url: str, *, batch_size: int, max_concurrency: int, request_timeout_s: float,
                 max_retries: int, no_answer: float):
        self.url = url
        self.name = f"http {url}"
        self.batch_size = int(batch_size)
        self.max_concurrency = int(max_concurrency)
        self.request_timeout_s = float(request_timeout_s)
        self.max_retries = int(max_retries)
        self.no_answer = float(no_answer)
        self.num_workers = 0  # no scoring processes
        self.n_restarts = 0
        self.n_requests = 0   # requests sent, retries included (cumulative)
        self._closed = False

    @classmethod
    def from_config(cls, reward_cfg) -> "HttpReward":
        """From a :class:`~megatron_m2po.config.RewardConfig` with ``fn="http"``; checks that the
        server answers an empty batch (ValueError naming the URL and what came back otherwise)."""
        r = cls(reward_cfg.url, batch_size=reward_cfg.batch_size, max_concurrency=reward_cfg.max_concurrency,
                request_timeout_s=reward_cfg.request_timeout_s, max_retries=reward_cfg.max_retries,
                no_answer=reward_cfg.no_answer)
        try:
            asyncio.run(r._check())
        except (RewardServiceError, _Failed) as e:
            raise ValueError(f"reward.fn=http: {e}; start the reward server or fix reward.url") from None
        return r

    async def _check(self) -> None:
        async with self._session() as session:
            scores = await self._request(session, [], [])
        if scores != []:
            raise _Failed("error", f"{self.url} answered an empty batch with {scores!r}, expected "
                          '{"scores": []} (see megatron_m2po/rewards/http.py for the protocol)')

    def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.request_timeout_s))

    def score_batch(self, responses: list[str], answers: list[str]) -> RewardResult:
        """Score ``responses[i]`` against ``answers[i]`` (see the module docstring for failures)."""
        return asyncio.run(self.score_batch_async(responses, answers))

    async def score_batch_async(self, responses: list[str], answers: list[str]) -> RewardResult:
        responses, answers = list(responses), list(answers)
        if self._closed:
            raise ValueError("the http reward is closed; build a new one with get_reward_fn(cfg)")
        if len(responses) != len(answers):
            raise ValueError(f"score_batch got {len(responses)} responses but {len(answers)} answers")
        t0 = time.perf_counter()
        res = RewardResult()
        if not responses:
            return res
        gate = asyncio.Semaphore(self.max_concurrency)
        bounds = list(range(0, len(responses), self.batch_size))

        async def batch(session, a: int) -> list[float] | _Failed:
            async with gate:
                try:
                    return await self._request(session, responses[a:a + self.batch_size],
                                               answers[a:a + self.batch_size])
                except _Failed as e:
                    return e
        async with self._session() as session:
            outs = await gather_or_cancel(*(batch(session, a) for a in bounds))
        for a, out in zip(bounds, outs):
            n = len(responses[a:a + self.batch_size])
            if isinstance(out, _Failed):
                logger.warning("reward %s: items %d-%d: %s", self.name, a, a + n - 1, out)
                res.scores += [self.no_answer] * n
                res.statuses += [out.status] * n
                res.messages += [str(out)] * n
                res.n_timeouts += n if out.status == "timeout" else 0
                res.n_errors += n if out.status == "error" else 0
            else:
                res.scores += out
                res.statuses += ["ok"] * n
                res.messages += [""] * n
        res.elapsed_s = time.perf_counter() - t0
        return res

    async def _request(self, session: aiohttp.ClientSession, responses: list[str], answers: list[str]) -> list[float]:
        """One batch, retried; raises RewardServiceError (unreachable) or _Failed (timeout / error)."""
        last: Optional[BaseException] = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(_BACKOFF_S * 2 ** (attempt - 1))  # backoff between retries, not synchronisation
            self.n_requests += 1
            try:
                async with session.post(self.url, json={"responses": responses, "answers": answers}) as resp:
                    body = await resp.text()
                    if resp.status in _RETRY_STATUSES:
                        last = _Failed("error", f"HTTP {resp.status}: {body[:200]!r}")
                        continue
                    if resp.status != 200:
                        raise _Failed("error", f"HTTP {resp.status}: {body[:200]!r}")
                    return _parse_scores(body, len(responses))
            except asyncio.TimeoutError:
                last = _Failed("timeout", f"no answer within reward.request_timeout_s={self.request_timeout_s:g} s")
            except aiohttp.ClientConnectionError as e:
                last = e
        if isinstance(last, _Failed):
            raise _Failed(last.status, f"{last} (after {self.max_retries + 1} attempts)")
        raise RewardServiceError(f"the reward server at {self.url} cannot be reached after {self.max_retries + 1} "
                                 f"attempt(s): {type(last).__name__}: {last}")

    def score(self, response: str, answer: str) -> float:
        """Score one response (convenience)."""
        return self.score_batch([response], [answer]).scores[0]

    def close(self) -> None:
        """Refuse further work (idempotent; no connection outlives a call)."""
        self._closed = True

    def __enter__(self) -> "HttpReward":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _parse_scores(body: str, n: int) -> list[float]:
    """The ``scores`` of a 200 answer, checked; _Failed("error") naming what is wrong."""
    import json

    try:
        obj: Any = json.loads(body)
    except ValueError:
        raise _Failed("error", f"the answer is not JSON: {body[:200]!r}") from None
    scores = obj.get("scores") if isinstance(obj, dict) else None
    if not isinstance(scores, list):
        raise _Failed("error", f'the answer has no "scores" list: {body[:200]!r}')
    if len(scores) != n:
        raise _Failed("error", f"the answer has {len(scores)} scores for {n} responses")
    bad = [s for s in scores if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s)]
    if bad:
        raise _Failed("error", f"the answer has scores that are not finite numbers: {bad[:3]!r}")
    return [float(s) for s in scores]
