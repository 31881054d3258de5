"""A failed rollout step ends its other requests: ``gather_or_cancel`` (every producer, the evaluator,
the reward pools) cancels and awaits the siblings of the first failure and raises that failure itself,
so nothing runs on to its own timeout and nothing is logged as "never retrieved" afterwards; and an
engine that stopped answering writes one abort warning, not one per request."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from megatron_m2po.rollout.client import EngineError, log_abort_failure
from megatron_m2po.utils.aio import gather_or_cancel


async def _value(v: int) -> int:
    return v


def test_the_first_failure_cancels_the_others_and_is_raised_as_itself():
    ended: list[str] = []
    unretrieved: list[dict] = []
    started: list[asyncio.Event] = []

    async def stuck(i: int) -> int:
        try:
            started[i].set()
            await asyncio.Event().wait()  # an engine that never answers
            return i
        finally:
            ended.append(f"stuck{i}")

    async def fails(exc: BaseException) -> None:
        for e in started:  # the state: both stuck requests are in flight
            await e.wait()
        raise exc

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx))
        started.extend([asyncio.Event(), asyncio.Event()])
        with pytest.raises(EngineError, match="timed out"):
            await gather_or_cancel(stuck(0), fails(EngineError("http://e", "/generate", "timed out")),
                                   stuck(1), fails(RuntimeError("second failure, same turn")))
        assert sorted(ended) == ["stuck0", "stuck1"]  # cancelled and finished before the raise
        gc.collect()
        assert await gather_or_cancel(_value(1), _value(2)) == [1, 2]
        assert await gather_or_cancel() == []

    asyncio.run(main())
    gc.collect()
    assert unretrieved == []


def test_a_cancelled_caller_cancels_its_jobs():
    ended: list[int] = []

    async def main():
        started = [asyncio.Event(), asyncio.Event()]

        async def stuck(i: int) -> None:
            try:
                started[i].set()
                await asyncio.Event().wait()
            finally:
                ended.append(i)

        outer = asyncio.ensure_future(gather_or_cancel(stuck(0), stuck(1)))
        for e in started:  # the state: both jobs running
            await e.wait()
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        assert sorted(ended) == [0, 1]

    asyncio.run(main())


def test_failed_aborts_on_one_engine_are_one_line_then_one_per_hundred(caplog):
    url = "http://127.0.0.1:1/test-aborts"
    with caplog.at_level(logging.DEBUG, logger="m2po.client"):
        for i in range(250):
            log_abort_failure(url, f"rid{i}", EngineError(url, "/abort_request", "not delivered"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and "rid0" in warnings[0] and "100 requests" in warnings[1], warnings
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 247
