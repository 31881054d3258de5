"""Rank 0's bounded waits: for generation, for a step's data, for an evaluation.

Every wait of the rollout side is bounded by ``trainer.wait_timeout_s``, says in the log what it
waits for (after 5 s, then every minute) and, when interruptible, ends at once on a stop request
(SIGINT / SIGTERM set the shared ``stop_event``) by raising :class:`StopRequested`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often a wait looks at the stop request and its deadline
_FIRST_NOTE_S, _NOTE_EVERY_S = 5.0, 60.0  # a wait says what it waits for after 5 s, then every minute


class StopRequested(Exception):
    """A wait for data ended because the trainer was asked to stop (SIGINT / SIGTERM)."""


class WaitNotes:
    """The log lines of one wait: what it waits for, how long so far, what to do."""

    def __init__(self, what: str, hint: str, timeout_s: float):
        self.what, self.hint, self.timeout_s = what, hint, timeout_s
        self.t0 = time.monotonic()
        self.next = self.t0 + _FIRST_NOTE_S

    def tick(self, detail: str = "") -> None:
        now = time.monotonic()
        if now >= self.next:
            self.next = now + _NOTE_EVERY_S
            log.warning("waiting for %s%s (%.0fs of trainer.wait_timeout_s=%.0f): %s; SIGINT / SIGTERM stops the run "
                        "(checkpointing the finished steps)", self.what, f" ({detail})" if detail else "",
                        now - self.t0, self.timeout_s, self.hint)


def wait_future(fut: concurrent.futures.Future, what: str, *, timeout_s: float, run_dir: str,
                stop_event: threading.Event, interruptible: bool) -> Any:
    """``fut.result()`` within ``timeout_s`` (``trainer.wait_timeout_s``), the stop request looked at
    every ``POLL_S`` when ``interruptible`` (then :class:`StopRequested`). ``run_dir``: where the
    engine logs are, for the messages."""
    deadline = time.monotonic() + timeout_s
    notes = WaitNotes(what, f"the engines generate it (logs in {run_dir}/engines)", timeout_s)
    while True:
        try:
            return fut.result(timeout=POLL_S)
        except concurrent.futures.TimeoutError:
            notes.tick()
        if interruptible and stop_event.is_set():
            raise StopRequested(f"stopped while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"waited {timeout_s:.0f}s (trainer.wait_timeout_s) for {what}, which did not finish: check the "
                f"engine logs in {run_dir}/engines and their load; raise trainer.wait_timeout_s "
                "if generation is just slow. Run the same command again to resume")
