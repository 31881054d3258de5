"""Named fault points: the process SIGKILLs its own process group where a test says.

The restart rule (docs/design.md §5b) is tested by killing a run at each point of
death it names and running the same command again. A kill timed from outside lands wherever
the scheduler happens to be; a named point lands exactly where the rule says something can be
half done. ``M2PO_FAULT=<point>@<n>`` (n >= 1, default 1) kills at the n-th time this process
reaches ``<point>``; unset, :func:`fault_point` is one dictionary lookup.

Points (each a place where a real crash leaves partial state behind):

* ``step_end``          a step trained and logged, before its checkpoint (every step of a run
                        without one dies here)
* ``checkpoint_write``  inside the checkpoint write: ``<name>.tmp`` written, not yet renamed
* ``weight_push``       the store already records the new version, the engines do not hold it
* ``store_commit``      inside a store put: rows inserted, the transaction not committed
* ``train_update``      after an optimizer update inside a step: the step's lease is open
* ``evaluation``        during held-out evaluation
* ``engine_dies``       at the start of a weight push, once the generation in flight is stored,
                        one engine's process is SIGKILLed (the trainer lives on: its push fails
                        and is retried after a relaunch)
* ``worker_dies``       a step trained and logged: this process alone is SIGKILLed (under
                        torchrun, one worker of the group dies; ``--max-restarts`` restarts the
                        group). Only global rank ``$M2PO_FAULT_RANK`` (default 0) and only in
                        torchrun's first attempt (``TORCHELASTIC_RESTART_COUNT`` 0): the
                        restarted group inherits the environment and must not die again.

The kill is SIGKILL to the whole process group (the trainer, its engines, its router, its
reward workers): what ``kill -9 -PGID`` or an OOM kill of the launcher does; the last two points
say what they kill instead.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional
import os
import signal
import threading

log = logging.getLogger(__name__)

ENV = "M2PO_FAULT"
POINTS = ("step_end", "checkpoint_write", "weight_push", "store_commit", "train_update", "evaluation", "engine_dies",
          "worker_dies")

_hits: dict[str, int] = {}
_lock = threading.Lock()


def _target() -> tuple[str, int] | None:
    spec = os.environ.get(ENV, "")
    if not spec:
        return None
    name, _, n = spec.partition("@")
    if name not in POINTS or (n and not n.isdigit()) or (n and int(n) < 1):
        raise ValueError(f"{ENV}={spec!r}: expected <point>[@<n>] with point one of {', '.join(POINTS)} and n >= 1")
    return name, int(n or 1)


def fault_point(name: str, action: Optional[Callable[[], None]] = None) -> None:
    """SIGKILL this process group if ``$M2PO_FAULT`` names ``name`` and this is its n-th hit
    (``action()`` instead, when given: a fault the process survives)."""
    assert name in POINTS, name
    target = _target()
    if target is None or target[0] != name:
        return
    if name == "worker_dies" and (os.environ.get("RANK", "0") != os.environ.get("M2PO_FAULT_RANK", "0")
                                  or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"):
        return
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        if _hits[name] != target[1]:
            return
    # stderr first: the test reads the log to know the fault happened where it asked.
    if action is not None:
        os.write(2, f"m2po fault point {name}@{target[1]}\n".encode())
        action()
        return
    if name == "worker_dies":
        os.write(2, f"m2po fault point {name}@{target[1]}: SIGKILL to process {os.getpid()}\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
    os.write(2, f"m2po fault point {name}@{target[1]}: SIGKILL to process group {os.getpgrp()}\n".encode())
    os.killpg(os.getpgrp(), signal.SIGKILL)
