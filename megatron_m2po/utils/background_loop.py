"""An asyncio event loop on a daemon thread, for synchronous code that drives async clients.

    loop = BackgroundLoop("m2po-rollout")
    fut = loop.submit(coro)            # concurrent.futures.Future
    result = loop.run(coro, timeout=5)  # submit and wait
    loop.close()

The rollout driver runs the producer there (generation overlaps training); the weight sync
runs its HTTP calls there while the calling thread blocks in a broadcast.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Coroutine, Optional

__all__ = ["BackgroundLoop"]


class BackgroundLoop:
    """An event loop running forever on its own daemon thread until :meth:`close`."""

    def __init__(self, name: str = "m2po-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Schedule ``coro`` on the loop; returns a thread-safe future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine, timeout: Optional[float] = None) -> Any:
        """Run ``coro`` on the loop and wait for its result (``TimeoutError`` after ``timeout``)."""
        return self.submit(coro).result(timeout)

    def close_quietly(self, client: Any, timeout_s: float = 10.0) -> None:
        """``client.close()`` run on the loop, best effort (shutdown: a failure or timeout is ignored);
        nothing with ``None``."""
        if client is None:
            return
        try:
            self.run(client.close(), timeout_s)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass

    def close(self, join_timeout_s: float = 10.0) -> None:
        """Stop the loop and wait up to ``join_timeout_s`` for its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(join_timeout_s)
