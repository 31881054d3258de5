"""Wait for a state, never for a time.

Tests here synchronise on what they need (an engine reporting running requests, a counter in
the store, a file, a process exiting), polled with a deadline; the deadline only bounds a
failure, and the failure message names the state that never came. ``tests/`` is on
``sys.path`` (the rootdir conftest), so any test imports these as ``from waiting import ...``.

    wait_until(lambda: latest.is_file(), what="the first checkpoint", timeout=120)
    await async_wait_until(lambda: engine_load(c, running=3), what="3 running requests on engine 1")
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Awaitable, Callable, Optional

POLL_S = 0.02


def wait_until(cond: Callable[[], Any], *, what: str, timeout: float = 60.0,
               hopeless: Optional[Callable[[], Optional[str]]] = None) -> Any:
    """Poll ``cond()`` until it is truthy and return its value.

    Raises ``AssertionError("<what> did not happen within <timeout> s")``. ``hopeless()``, when
    given, is checked on every poll and returns a message when the state can no longer come
    (e.g. the process that should produce it exited): the wait then fails at once with it."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        why = hopeless() if hopeless is not None else None
        assert not why, f"{what} will not happen: {why}"
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(POLL_S)  # poll interval of the wait-for-state helper (cond() decides); its deadline is where elapsed time is the behaviour under test


async def async_wait_until(cond: Callable[[], Any | Awaitable[Any]], *, what: str, timeout: float = 60.0) -> Any:
    """``wait_until`` for coroutines: ``cond`` may be sync or async."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        await asyncio.sleep(POLL_S)  # poll interval of the wait-for-state helper (cond() decides); its deadline is where elapsed time is the behaviour under test
