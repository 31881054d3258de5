"""A last-resort reaper: when the trainer dies, kill what its process tree still holds.

Most children die with the trainer through the kernel (``utils/lifeline.py``: parent-death signal).
Processes started by third-party code further down do not all do so: Ray's per-node agents
(``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``, children of the raylet) outlive their raylet by
~60 s while they try to report its death to a GCS that died too (Ray 2.60
``ray/_private/process_watcher.py``). The reaper is a separate small process, not in the trainer's
process group or session (so a signal to the trainer's group does not reach it), that every
``interval_s`` notes the trainer's descendants (pid and start time, ``psutil``); once the trainer
is gone it SIGKILLs those still alive with the same start time (no pid reuse is hit), then exits.

    python -m megatron_m2po.utils.reaper PID [INTERVAL_S [STATE_FILE]]

``STATE_FILE`` (optional): after every poll, the pids it would kill, one per line (replaced
atomically), so a test or a person can see what it tracks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

__all__ = ["start_reaper"]


def start_reaper(pid: int | None = None, interval_s: float = 0.5, state_file: str = "") -> subprocess.Popen:
    """Start a reaper for ``pid`` (this process by default)."""
    return subprocess.Popen([sys.executable, "-m", "megatron_m2po.utils.reaper", str(pid or os.getpid()),
                             str(interval_s), state_file], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def _watch(pid: int, interval_s: float, state_file: str = "") -> int:
    import psutil

    me = os.getpid()
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return 0
    seen: dict[int, float] = {}
    while True:
        try:
            if not root.is_running() or root.status() == psutil.STATUS_ZOMBIE:
                break
            kids = root.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        now = {}
        for p in kids:
            try:
                now[p.pid] = p.create_time()
            except psutil.NoSuchProcess:
                pass
        now.pop(me, None)
        seen = now
        if state_file:
            tmp = f"{state_file}.tmp"
            with open(tmp, "w") as f:
                f.write("".join(f"{k}\n" for k in sorted(seen)))
            os.replace(tmp, state_file)
        time.sleep(interval_s)
    killed = 0
    for child, started in seen.items():
        try:
            p = psutil.Process(child)
            if p.create_time() == started:
                p.send_signal(signal.SIGKILL)
                killed += 1
        except psutil.NoSuchProcess:
            pass
    return killed


if __name__ == "__main__":
    _watch(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.5, sys.argv[3] if len(sys.argv) > 3 else "")
