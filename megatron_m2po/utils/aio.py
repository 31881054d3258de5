"""``gather`` for work that is all-or-nothing: the first failure cancels the rest.

``asyncio.gather(*jobs)`` raises the first exception but leaves the other jobs running: at a failed
rollout step (an engine that stopped answering), hundreds of requests kept waiting for their own
timeouts, each then logged "Task exception was never retrieved" with its traceback, and the ones still
in flight when the process ended wrote "Event loop is closed" from their clean-up. ``TaskGroup``
cancels the siblings but raises an ``ExceptionGroup``, which every caller that catches ``EngineError``
would have to unwrap. :func:`gather_or_cancel` cancels the siblings, waits for them to finish, and
raises the first exception itself.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable


async def gather_or_cancel(*aws: Awaitable[Any]) -> list[Any]:
    """The results of ``aws`` in order, as ``asyncio.gather``; when one raises, the others are cancelled
    and awaited (their outcomes retrieved, so nothing is logged at garbage collection) before the
    exception of the first failed one (in argument order) is raised. A cancellation of the caller
    cancels them all."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return []
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # the caller was cancelled
        await _cancel(tasks)
        raise
    failed = [t for t in tasks if t in done and not t.cancelled() and t.exception() is not None]
    if failed:
        await _cancel(pending)
        for t in done:  # retrieve every outcome: more than one may have failed in the same turn
            if not t.cancelled():
                t.exception()
        raise failed[0].exception()
    return [t.result() for t in tasks]


async def _cancel(tasks) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
