"""A parent for tests/utils/test_lifeline.py: starts one child by each mechanism of
``megatron_m2po.utils.lifeline``, prints their pids as one JSON line, then waits to be killed.

- ``thread_child``: ``lifeline.popen`` called on a short-lived thread; after that thread is gone
  (its task left ``/proc/self/task``) the child still answers a line: the parent-death signal is
  tied to a thread that lives as long as the process, not to the caller's.
- ``fork_child``: a multiprocessing ``fork`` child started inside ``forks_die_with_process()``.
- ``manager``: a ``spawn`` SyncManager started with ``die_with_parent`` as its initializer (as
  ``actor/checkpoint.py`` starts Megatron's results queue), from a short-lived thread, and used
  after that thread is gone.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from multiprocessing.managers import SyncManager

from megatron_m2po.utils import lifeline

# Echoes one line, then waits for a signal (EOF on stdin, as when this parent dies, does not end it).
ECHO_THEN_WAIT = "import signal, sys; sys.stdout.write(sys.stdin.readline()); sys.stdout.flush(); signal.pause()"


def on_thread(fn):
    """``fn()`` on a new thread; returns its result once the thread's OS task is gone."""
    out = {}

    def body():
        out["tid"] = threading.get_native_id()
        out["value"] = fn()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    while os.path.exists(f"/proc/self/task/{out['tid']}"):  # join returns just before the task exits
        os.sched_yield()
    return out["value"]


def main() -> None:
    child = on_thread(lambda: lifeline.popen([sys.executable, "-c", ECHO_THEN_WAIT], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, text=True))
    child.stdin.write("alive\n")
    child.stdin.flush()
    assert child.stdout.readline() == "alive\n", "the child died with the thread that started it"

    with lifeline.forks_die_with_process():
        forked = multiprocessing.get_context("fork").Process(target=signal.pause, daemon=True)
        forked.start()

    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    on_thread(lambda: lifeline.on_lifetime_thread(manager.start, lifeline.die_with_parent, (os.getpid(),)))
    q = manager.Queue()
    q.put("alive")
    assert q.get() == "alive"

    print(json.dumps({"thread_child": child.pid, "fork_child": forked.pid, "manager": manager._process.pid}),
          flush=True)
    signal.pause()


if __name__ == "__main__":
    main()
