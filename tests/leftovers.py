"""Find every process a command's tree started, orphans included, and wait for none to be left.

Two ways to find them, used together:

- a mark in the environment of the root: every descendant inherits it (subprocesses, ``spawn`` /
  ``fork`` children, multiprocessing's resource tracker, engines: ``rollout/launcher.py``
  ``engine_env`` passes unknown names through) and ``/proc/<pid>/environ`` keeps it after the
  process was re-parented to init -- except in a process that rewrote its title over its
  environment (``setproctitle``: sglang-router's ``sglang::router``);
- the descendants seen while the root was alive (:meth:`Tree.observe`, a ``psutil`` walk), by pid
  and start time, so a pid reused by an unrelated process does not count.

    tree = Tree(os.environ)
    proc = subprocess.Popen(cmd, env=tree.env)
    wait_until(lambda: tree.observe(proc.pid) ..., what=...)
    os.kill(proc.pid, signal.SIGKILL)
    tree.wait_gone("the trainer's processes after SIGKILL", timeout=30)
    tree.kill()  # in a finally: nothing left for the next test either way
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Mapping

import psutil

from waiting import wait_until

MARK_VAR = "M2PO_TEST_TREE"


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()) or p.name()
    except psutil.Error:
        return "?"


class Tree:
    """The processes of one command's tree (module docstring). ``env``: the root's environment."""

    def __init__(self, base_env: Mapping[str, str]):
        self.mark = uuid.uuid4().hex
        self.env = {**base_env, MARK_VAR: self.mark}
        self.seen: dict[int, float] = {}  # pid -> start time

    def observe(self, root: int) -> dict[int, str]:
        """Record the live descendants of ``root`` (and ``root``); returns ``{pid: command line}`` of them."""
        try:
            top = psutil.Process(root)
            procs = [top, *top.children(recursive=True)]
        except psutil.Error:
            return {}
        out = {}
        for p in procs:
            try:
                self.seen[p.pid] = p.create_time()
                out[p.pid] = _cmdline(p)
            except psutil.Error:
                continue
        return out

    def run(self, cmd: list[str], *, timeout: float, **popen_kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run(cmd, env=self.env, capture_output=True, text=True)``, observing the tree
        while it runs (every 0.2 s: long-lived processes are what this is looking for)."""
        proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                **popen_kwargs)
        deadline = time.monotonic() + timeout
        try:
            while True:
                self.observe(proc.pid)
                try:
                    out, err = proc.communicate(timeout=0.2)
                    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
                except subprocess.TimeoutExpired:
                    if time.monotonic() > deadline:
                        raise
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

    def alive(self) -> dict[int, str]:
        """``{pid: command line}`` of the tree's processes alive now (zombies do not count)."""
        out = {}
        needle = f"{MARK_VAR}={self.mark}".encode()
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            pid = int(d.name)
            try:
                p = psutil.Process(pid)
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                if self.seen.get(pid) == p.create_time() or needle in (d / "environ").read_bytes().split(b"\0"):
                    out[pid] = _cmdline(p)
            except (psutil.Error, OSError):  # exited meanwhile, or not ours to read
                continue
        return out

    def wait_gone(self, what: str, *, timeout: float = 30.0) -> None:
        """Wait until none of the tree's processes is alive; the failure names each one still alive."""
        left: dict[int, str] = {}

        def gone() -> bool:
            left.clear()
            left.update(self.alive())
            return not left

        try:
            wait_until(gone, what=f"{what}: every process gone", timeout=timeout)
        except AssertionError as e:
            alive = "\n  ".join(f"{pid}: {cmd[:200]}" for pid, cmd in sorted(left.items()))
            raise AssertionError(f"{e}; still alive:\n  {alive}") from None

    def kill(self) -> None:
        """SIGKILL every process of the tree still alive (cleanup after a failure)."""
        for pid in self.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
