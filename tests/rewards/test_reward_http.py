"""reward.fn=http against a small aiohttp reward server on a loopback port started here: scores in
order over several batches, the concurrency bound, retries of a 503, a server that hangs
(timeouts, counted), malformed answers (errors, counted), and one that is down (a clear error at
start-up and during a run)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Optional

import pytest
from aiohttp import web

from megatron_m2po.config import Config, ConfigError, RewardConfig
from megatron_m2po.rewards import get_reward_fn
from megatron_m2po.rewards.http import HttpReward, RewardServiceError
from megatron_m2po.utils.net import free_port


class RewardServer:
    """``POST /score``: {"responses", "answers"} -> {"scores"}: 1.0 where they are equal. A
    response "hang" never gets an answer; "503-once" is refused once per server; "garbage",
    "short", "nan" and "no-scores" get malformed answers."""

    def __init__(self):
        self.requests: list[list[str]] = []
        self.in_flight = self.max_in_flight = 0
        self.refused_once = False
        # gather=(n, total): a request waits until n are in flight or ``total`` requests have arrived
        # (the last, lone one of a batch), so the client's concurrency shows in max_in_flight
        self.gather: Optional[tuple[int, int]] = None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/score"
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._started.wait(30), "the reward server did not start"

    async def _score(self, request: web.Request) -> web.Response:
        body = await request.json()
        rs, ans = body["responses"], body["answers"]
        self.requests.append(rs)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            async with self._changed:
                self._changed.notify_all()
                if self.gather is not None:
                    n, total = self.gather
                    await self._changed.wait_for(lambda: self.in_flight >= n or len(self.requests) >= total)
            if "hang" in rs:
                await self._release.wait()  # no answer before the server stops: the client times out
            if "503-once" in rs and not self.refused_once:
                self.refused_once = True
                return web.Response(status=503, text="warming up")
            if "garbage" in rs:
                return web.Response(text="<html>oops</html>")
            if "no-scores" in rs:
                return web.json_response({"rewards": [0.0] * len(rs)})
            if "short" in rs:
                return web.json_response({"scores": [1.0]})
            if "nan" in rs:
                return web.Response(text=json.dumps({"scores": [float("nan")] * len(rs)}))
            return web.json_response({"scores": [float(r == a) for r, a in zip(rs, ans)]})
        finally:
            self.in_flight -= 1

    def _serve(self):
        asyncio.set_event_loop(self._loop)
        self._release = asyncio.Event()  # ends the hanging requests when the server stops
        self._changed = asyncio.Condition()  # a request arrived (gather)
        app = web.Application()
        app.router.add_post("/score", self._score)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()

    def stop(self):
        self._loop.call_soon_threadsafe(self._release.set)
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


@pytest.fixture
def server():
    s = RewardServer()
    yield s
    if s._thread.is_alive():
        s.stop()


def _cfg(url: str, **kw) -> RewardConfig:
    return RewardConfig(fn="http", url=url, **{"batch_size": 3, "max_concurrency": 2, "request_timeout_s": 10.0,
                                               "max_retries": 1, **kw})


def test_scores_in_order_over_batches_within_the_concurrency_bound(server):
    reward = get_reward_fn(_cfg(server.url))
    assert isinstance(reward, HttpReward) and server.requests == [[]]  # the start-up check: an empty batch
    rs = [f"r{i}" for i in range(8)]
    ans = [r if i % 2 == 0 else "x" for i, r in enumerate(rs)]
    server.gather = (2, 1 + 3)  # the first two batches wait for each other; the third comes alone
    res = reward.score_batch(rs, ans)
    server.gather = None
    assert res.scores == [1.0, 0.0] * 4 and res.statuses == ["ok"] * 8
    assert (res.n_timeouts, res.n_errors) == (0, 0)
    assert sorted(map(len, server.requests[1:])) == [2, 3, 3]  # batch_size 3
    assert server.max_in_flight == 2  # max_concurrency, used (a client one request at a time times out above)
    res = asyncio.run(reward.score_batch_async(["503-once", "a"], ["x", "a"]))  # refused once, then answered
    assert res.scores == [0.0, 1.0] and reward.n_requests == 1 + 3 + 2
    reward.close()
    with pytest.raises(ValueError, match="closed"):
        reward.score_batch(["a"], ["a"])


def test_a_hanging_server_times_out_counted(server):
    reward = get_reward_fn(_cfg(server.url, request_timeout_s=0.5))
    res = reward.score_batch(["hang", "a", "b", "c"], ["x", "a", "b", "c"])  # batch 1 hangs, batch 2 answers
    assert res.statuses == ["timeout"] * 3 + ["ok"] and res.n_timeouts == 3
    assert res.scores == [0.0, 0.0, 0.0, 1.0]
    assert "request_timeout_s=0.5" in res.messages[0] and "after 2 attempts" in res.messages[0]
    assert sum("hang" in r for r in server.requests) == 2  # retried once


@pytest.mark.parametrize("trigger,message", [
    ("garbage", "not JSON"), ("no-scores", 'no "scores" list'), ("short", "1 scores for 3 responses"),
    ("nan", "not finite numbers"),
])
def test_malformed_answers_are_counted_errors(server, trigger, message):
    reward = get_reward_fn(_cfg(server.url, no_answer=-1.0))
    res = reward.score_batch([trigger, "a", "b", "b"], ["x", "a", "b", "b"])
    assert res.statuses == ["error"] * 3 + ["ok"] and res.n_errors == 3
    assert res.scores == [-1.0] * 3 + [1.0] and message in res.messages[0]


def test_a_server_that_is_down_is_a_clear_error(server):
    down = f"http://127.0.0.1:{free_port()}/score"
    with pytest.raises(ConfigError, match=r"reward.fn=http: the reward server at .* cannot be reached") as e:
        get_reward_fn(_cfg(down))
    assert down in str(e.value) and "start the reward server or fix reward.url" in str(e.value)
    reward = get_reward_fn(_cfg(server.url))
    server.stop()  # goes down during the run
    with pytest.raises(RewardServiceError, match="cannot be reached after 2 attempt"):
        reward.score_batch(["a"], ["a"])


def test_a_server_that_speaks_another_protocol_is_refused_at_start(server):
    with pytest.raises(ValueError, match="HTTP 404"):
        get_reward_fn(_cfg(server.url.replace("/score", "/nothing")))


def test_config_needs_a_url_for_http_and_http_for_a_url():
    cfg = Config()
    cfg.reward.fn = "http"
    with pytest.raises(ConfigError, match="reward.fn=http needs reward.url"):
        cfg.validate()
    cfg.reward.fn, cfg.reward.url = "math", "http://127.0.0.1:1/score"
    with pytest.raises(ConfigError, match="only read with reward.fn=http"):
        cfg.validate()
