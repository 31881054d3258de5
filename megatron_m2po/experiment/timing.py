"""What an experiment cost: wall and CPU time of every invocation, kept across kills and resumes.

CPU time here is user + system of the experiment process and of every process its runs started
(trainer, engines, router, reward workers):

* a run that ended and was reaped by the experiment: its ``RUSAGE_CHILDREN`` share, the growth of
  ``getrusage(RUSAGE_CHILDREN)`` across the ``waitpid`` that reaped it (which includes the
  descendants it reaped itself; :func:`children_cpu`);
* a run still alive: the CPU of its live process tree so far (:func:`tree_cpu`).

:class:`TimeLedger` keeps one entry per invocation in ``<out>/experiment_time.json`` and rewrites
it every ``every_s`` seconds while the experiment runs, so an experiment killed with SIGKILL
loses at most that much of its accounting (its runs die with it: ``runner.ArmRun.start``).
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
from typing import Iterable, Optional

TIME_FILE = "experiment_time.json"


def children_cpu() -> float:
    """User + system seconds of this process's reaped children (and the descendants they reaped)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def tree_cpu(pid: int) -> float:
    """CPU seconds of the live process ``pid`` and its live descendants, including what each of them
    reaped; 0 when it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:  # exited meanwhile: its parent reaps it, counted there later
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


class TimeLedger:
    """Wall and CPU seconds per invocation of one experiment directory (module docstring).

    Example::

        ledger = TimeLedger(out_dir / TIME_FILE, parallel=2)
        ledger.tick([p.pid for p in live])   # in the experiment's loop; writes every every_s
        ledger.close()                        # at the end, however it ends
        TimeLedger.totals(out_dir / TIME_FILE)  # {"wall_s": ..., "cpu_s": ..., "invocations": n}
    """

    def __init__(self, path: Path, *, parallel: int, every_s: float = 10.0):
        self.path, self.every_s = Path(path), every_s
        self.entries = self.read(self.path)
        self._t0, self._cpu0 = time.monotonic(), self_cpu() + children_cpu()
        self._last_write = -float("inf")
        self.entry = {"started_at": time.strftime("%Y-%m-%d %H:%M:%S"), "parallel": parallel,
                      "wall_s": 0.0, "cpu_s": 0.0, "ended": False}
        self.entries.append(self.entry)
        self.tick([], force=True)

    @staticmethod
    def read(path: Path) -> list[dict]:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return []
        return [e for e in data.get("invocations", []) if isinstance(e, dict)]

    @classmethod
    def totals(cls, path: Path) -> dict:
        entries = cls.read(path)
        return {"wall_s": sum(float(e.get("wall_s", 0.0)) for e in entries),
                "cpu_s": sum(float(e.get("cpu_s", 0.0)) for e in entries), "invocations": len(entries),
                "killed": sum(1 for e in entries if not e.get("ended"))}

    def tick(self, live_pids: Iterable[int], force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_write < self.every_s:
            return
        live = sum(tree_cpu(p) for p in live_pids)
        self.entry["wall_s"] = round(now - self._t0, 1)
        self.entry["cpu_s"] = round(self_cpu() + children_cpu() - self._cpu0 + live, 1)
        self._write()
        self._last_write = now

    def close(self) -> None:
        self.entry["ended"] = True
        self.tick([], force=True)

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"invocations": self.entries}, indent=2) + "\n")
        os.replace(tmp, self.path)


def fmt_duration(seconds: Optional[float]) -> str:
    """``1 h 05 min``, ``4.2 min``, ``37 s``; ``—`` for None."""
    if seconds is None:
        return "—"
    if seconds >= 3600:
        h, m = divmod(int(round(seconds / 60)), 60)
        return f"{h} h {m:02d} min"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"
