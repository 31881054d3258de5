"""utils/reaper.py: what the trainer's tree still holds when it dies is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from waiting import wait_until

# A "trainer" that starts a reaper and a child that would outlive it (its own session, no
# parent-death signal, as Ray's agents), prints the child's pid, then waits to be killed.
PARENT = """
import subprocess, sys, time
from megatron_m2po.utils.reaper import start_reaper
start_reaper(interval_s=0.1, state_file=sys.argv[1])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)  # elapsed time is the behaviour under test (a deliberate hang)
print(child.pid, flush=True)
time.sleep(300)  # elapsed time is the behaviour under test (a deliberate hang until SIGKILLed)
"""


def _tracked(state) -> set[int]:
    try:
        return {int(x) for x in state.read_text().split()}
    except (OSError, ValueError):
        return set()


def test_what_outlives_a_killed_trainer_is_reaped(tmp_path):
    """The orphan (which a SIGKILLed parent leaves to init) is gone within seconds; without the
    reaper it sleeps on for 300 s."""
    state = tmp_path / "reaper.state"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(state)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    child = int(parent.stdout.readline())
    try:
        wait_until(lambda: child in _tracked(state), timeout=30, what=f"the reaper tracking child {child}")
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        wait_until(lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE,
                   timeout=15, what=f"the orphan {child} killed by the reaper")
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
        parent.kill()
