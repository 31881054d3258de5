"""Children that die with this process, whatever kills it (SIGKILL included).

The kernel does it: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` in a child makes Linux SIGKILL the child
when its parent dies (prctl(2)). Two catches, both handled here:

- The "parent" is the *thread* that forked the child, not the process: a child forked by a
  short-lived thread (a rollout thread replacing a reward worker) would be killed when that
  thread ends. :func:`on_lifetime_thread` runs a start on a thread that lives as long as the
  process: the main thread when called on it, else one daemon thread of this module.
- The parent may die between the fork and the ``prctl``: the child then checks that its parent
  is still the process that started it and exits at once otherwise.

What uses what (docs/design.md §5, the table "Nothing outlives the trainer"):

- :func:`popen` -- ``subprocess.Popen`` with the signal set in ``preexec_fn``: engines, the router
  (``rollout/launcher.py``, ``rollout/ray_launcher.py``), reward workers (``rewards/pool.py``).
- :func:`die_with_parent` -- for a multiprocessing child whose start we do not write but whose
  initializer we choose: Megatron's checkpoint-writer results queue (``actor/checkpoint.py``).
- :func:`forks_die_with_process` -- ``os.fork`` children of the main thread inside the block
  (Megatron's per-file writer processes during a synchronous save).

Not Linux: the functions do what they can without the signal (no ``prctl``); the callers' own
cleanup (``stop()``, ``close()``, ``atexit``) still runs on a clean exit.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
from typing import Any, Callable, Iterator, Optional, TypeVar

__all__ = ["popen", "die_with_parent", "set_parent_death_signal", "on_lifetime_thread", "forks_die_with_process"]

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _load_prctl() -> Optional[Callable[..., int]]:
    # Resolved here, in the parent: a dlopen in a child forked from a threaded process could wait on
    # a loader lock another thread held at the fork.
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return fn


_PRCTL = _load_prctl()


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """In a child: ask the kernel for ``sig`` when the thread that forked this process dies.
    False where there is no ``prctl`` (not Linux)."""
    return _PRCTL is not None and _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with_parent(parent_pid: int) -> None:
    """In a child started by ``parent_pid``: SIGKILL when the parent dies; exit now if it already
    has (the child was re-parented to init or a subreaper before it got here).

    Used as a multiprocessing initializer (``BaseManager.start(initializer=...)``): module-level, so
    a ``spawn`` child can unpickle it. The thread that started the child must live as long as the
    parent process (start it through :func:`on_lifetime_thread`)."""
    set_parent_death_signal()
    if os.getppid() != parent_pid:
        os._exit(1)


def popen(cmd: list[str], *, preexec_fn: Optional[Callable[[], None]] = None, **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kwargs)`` whose child dies with this process (SIGKILL).

    The child is forked on a thread that lives as long as this process (:func:`on_lifetime_thread`)
    and sets the parent-death signal before exec; ``preexec_fn`` (if any) runs after that.
    ``start_new_session=True`` (the child's own session, so its whole tree can be signalled) is
    done by Popen itself before ``preexec_fn``. The signal reaches the child only, not the
    processes the child starts: those need their own (SGLang sets it in its schedulers)."""
    parent = os.getpid()

    def setup() -> None:
        die_with_parent(parent)
        if preexec_fn is not None:
            preexec_fn()

    return on_lifetime_thread(subprocess.Popen, cmd, preexec_fn=setup, **kwargs)


# ------------------------------------------------------------------ the lifetime thread

class _LifetimeThread:
    """One daemon thread that runs calls in order. A daemon thread is never joined at interpreter
    exit, so it lives until the process itself ends (a ThreadPoolExecutor's threads are joined
    before ``atexit`` handlers run: children they forked would die before those handlers stop
    them)."""

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="m2po-lifeline", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            fut, fn, args, kwargs = self.calls.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                    fut.set_exception(e)

    def call(self, fn: Callable[..., T], args: tuple, kwargs: dict) -> T:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.calls.put((fut, fn, args, kwargs))
        return fut.result()


_lock = threading.Lock()
_thread: Optional[_LifetimeThread] = None


def on_lifetime_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a thread that lives as long as this process: here when called on
    the main thread (it ends only with the process) or on this module's daemon thread, else on
    that daemon thread (calls wait for each other there). Exceptions propagate to the caller."""
    global _thread
    here = threading.current_thread()
    if here is threading.main_thread() or (_thread is not None and here is _thread.thread):
        return fn(*args, **kwargs)
    with _lock:
        if _thread is None:
            _thread = _LifetimeThread()
    return _thread.call(fn, args, kwargs)


# ------------------------------------------------------------------ forks

_fork_scope = 0  # > 0 while the main thread is inside forks_die_with_process()
_fork_tied = False  # set by the fork hook in the parent, read in the child
_fork_parent = 0


@contextlib.contextmanager
def forks_die_with_process() -> Iterator[None]:
    """Children ``os.fork``-ed by the main thread inside this block die with this process.

    For forks we do not write (multiprocessing's ``fork`` context inside a library call). Only the
    main thread's forks: it lives as long as the process, so the parent-death signal fires exactly
    when the process dies. On another thread the block does nothing (that thread may end before
    its children). Not for ``subprocess`` starts (they run the fork hooks only with a
    ``preexec_fn``): use :func:`popen`."""
    global _fork_scope
    main = threading.current_thread() is threading.main_thread()
    if main:
        _fork_scope += 1
    try:
        yield
    finally:
        if main:
            _fork_scope -= 1


def _before_fork() -> None:
    global _fork_tied, _fork_parent
    _fork_tied = _fork_scope > 0 and threading.current_thread() is threading.main_thread()
    _fork_parent = os.getpid()


def _after_fork_in_child() -> None:
    global _thread, _fork_scope, _lock
    # The child has none of the parent's other threads: a new lifetime thread on first use.
    _thread, _fork_scope, _lock = None, 0, threading.Lock()
    if _fork_tied:
        die_with_parent(_fork_parent)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
