"""A process pool for scoring with a hard per-call deadline, worker replacement and counters.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot cancel one running call (a hung
sympy simplification would hold a worker forever) and a crashed worker breaks the whole
executor. Here each worker is a fresh ``python`` subprocess owning one socket; the parent sends
one *call* at a time to an idle worker and waits on all sockets with
``multiprocessing.connection.wait``. A call that passes its deadline gets its worker killed
(SIGKILL) and replaced; a worker that dies mid-call (segfault, ``os._exit``, OOM kill) is
replaced too. Both outcomes are reported per item and counted, never raised: scoring must not
block or crash training. Replacements start in the background; the deadline of a call only
starts when it is sent to a worker that has finished importing (so start-up time is never
charged to a call).

Workers run the scorer in their *main thread*, with no threads of their own, so libraries that
rely on ``signal`` work there; math-verify's own signal timeout is nevertheless disabled
(:mod:`megatron_m2po.rewards.math_grader`) because a Python signal cannot interrupt C-level
sympy loops, while SIGKILL from the parent always works.

Lifecycle: ``ScoringPool(spec, num_workers, timeout_s)`` starts the workers and waits until
all of them have imported the scorer (an import error raises ``ValueError`` with the worker's
traceback) -> ``run(calls)`` any number of times (thread-safe: calls are serialised) ->
``close()`` (idempotent; also on garbage collection / interpreter exit).

A *call* is ``(responses, answers)`` (lists of equal length); the worker applies the scorer
spec to it and returns one ``(score, status, message)`` per item.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait
from typing import Any, Optional

from megatron_m2po.utils import lifeline
from megatron_m2po.utils.aio import gather_or_cancel

logger = logging.getLogger(__name__)

__all__ = ["ScoringPool", "ScorerSpec", "CallOutcome"]

# A worker that has not reported ready after this long is killed and started again.
STARTUP_TIMEOUT_S = 120.0
# Consecutive start-up failures (across the pool) before the pool gives up with an error.
MAX_STARTUP_FAILURES = 3


@dataclass(frozen=True)
class ScorerSpec:
    """What a worker runs. ``kind``: "math" (math-verify grading) or "item"/"batch" (a custom
    function given as ``target`` = "module:function"). ``values``: (correct, wrong, no_answer)."""

    kind: str
    target: str = ""
    values: tuple[float, float, float] = (1.0, 0.1, 0.0)
    coroutine: bool = False  # ``async def`` target: awaited on an event loop in the worker
    item_timeout_s: float = 0.0  # coroutine item targets: each item's own deadline (0 = only the pool's)


@dataclass
class CallOutcome:
    """Result of one call: per item (score or None, status, message); ``status`` per item is
    the scorer's own status, or "timeout" / "error" (worker crashed or the scorer raised)."""

    items: list[tuple[Optional[float], str, str]]


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def load_target(target: str) -> Any:
    """Import ``module:function`` (also accepts ``module.function``)."""
    if ":" in target:
        mod_name, _, attr = target.partition(":")
    else:
        mod_name, _, attr = target.rpartition(".")
    if not mod_name or not attr:
        raise ValueError(f"reward function {target!r} must look like 'package.module:function'")
    mod = importlib.import_module(mod_name)
    obj = mod
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _as_score(x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) and not hasattr(x, "__float__"):
        if isinstance(x, bool):
            return float(x)
        raise TypeError(f"reward function returned {type(x).__name__} {x!r}; it must return a float")
    v = float(x)
    if not math.isfinite(v):
        raise ValueError(f"reward function returned a non-finite score {v!r}")
    return v


def _make_scorer(spec: ScorerSpec):
    """A function (responses, answers) -> list[(score, status, message)], run in the worker."""
    if spec.kind == "math":
        from megatron_m2po.rewards.math_grader import grade_math

        correct, wrong, no_answer = spec.values
        value = {"correct": correct, "wrong": wrong, "no_answer": no_answer}

        def score_math(responses, answers):
            out = []
            for r, a in zip(responses, answers):
                try:
                    g = grade_math(r, a)
                    out.append((value[g], g, ""))
                except Exception as e:  # noqa: BLE001 - reported per item, never raised
                    out.append((None, "error", f"{type(e).__name__}: {e}"))
            return out

        return score_math

    fn = load_target(spec.target)
    if spec.coroutine and spec.kind == "item":
        return _coroutine_items(fn, spec.item_timeout_s)
    if spec.coroutine:  # a batch coroutine: one event loop per chunk, then the batch checks below
        afn = fn

        def fn(responses, answers):
            return asyncio.run(afn(responses, answers))
    if spec.kind == "item":

        def score_items(responses, answers):
            out = []
            for r, a in zip(responses, answers):
                try:
                    out.append((_as_score(fn(r, a)), "ok", ""))
                except Exception as e:  # noqa: BLE001
                    out.append((None, "error", f"{type(e).__name__}: {e}"))
            return out

        return score_items

    if spec.kind == "batch":

        def score_batch(responses, answers):
            try:
                scores = list(fn(list(responses), list(answers)))
                if len(scores) != len(responses):
                    raise ValueError(f"batch reward function returned {len(scores)} scores for "
                                     f"{len(responses)} responses")
                return [(_as_score(s), "ok", "") for s in scores]
            except Exception as e:  # noqa: BLE001
                return [(None, "error", f"{type(e).__name__}: {e}")] * len(responses)

        return score_batch
    raise ValueError(f"unknown scorer kind {spec.kind!r}")


def _coroutine_items(fn, item_timeout_s: float):
    """Scorer of an ``async def fn(response, answer)``: the items of a chunk are awaited
    concurrently on one event loop (a reward that waits on a service overlaps its requests), each
    under ``item_timeout_s``; an item past it has status "timeout", the others keep their scores."""

    async def one(r, a):
        try:
            return (_as_score(await asyncio.wait_for(fn(r, a), item_timeout_s or None)), "ok", "")
        except asyncio.TimeoutError:
            return (None, "timeout", f"no score within {item_timeout_s:g} s")
        except Exception as e:  # noqa: BLE001 - reported per item, never raised
            return (None, "error", f"{type(e).__name__}: {e}")

    async def run(responses, answers):
        return list(await gather_or_cancel(*(one(r, a) for r, a in zip(responses, answers))))

    return lambda responses, answers: asyncio.run(run(responses, answers))


def _worker_main(conn) -> None:
    """Worker loop: receive (sys.path, spec), import the scorer, report ready, answer calls."""
    try:
        sys_path, spec = conn.recv()
        for p in reversed(sys_path):
            if p not in sys.path:
                sys.path.insert(0, p)
        scorer = _make_scorer(spec)
        if spec.kind == "math":  # warm the sympy / latex parser imports before reporting ready
            scorer(["\\boxed{1}"], ["1"])
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("init_error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        call_id, responses, answers = msg
        conn.send(("done", (call_id, scorer(responses, answers))))


def _worker_entry(fd: int) -> None:
    """``python -c`` entry of a worker process: the parent's socket is inherited as ``fd``."""
    conn = Connection(fd)
    try:
        _worker_main(conn)
    finally:
        conn.close()


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_WORKER_CODE = "import sys; from megatron_m2po.rewards.pool import _worker_entry; _worker_entry(int(sys.argv[1]))"


class _Worker:
    """One scoring process, started with ``subprocess`` rather than ``multiprocessing``:
    ``spawn`` would re-import the trainer's ``__main__`` (torch, Megatron: seconds and hundreds
    of MB per worker, and an error for scripts without a ``__main__`` guard). The two ends talk
    over a socket pair wrapped in ``multiprocessing.connection.Connection``; the kernel closes
    the child's end when it dies, so the parent's end turns readable (EOF): that is the death
    signal, no separate sentinel needed. The other way round, the kernel kills the worker when the
    parent dies (:func:`megatron_m2po.utils.lifeline.popen`)."""

    __slots__ = ("proc", "conn", "ready", "started_at", "call", "deadline")

    def __init__(self, spec: ScorerSpec):
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_PKG_PARENT] + [p for p in [env.get("PYTHONPATH")] if p])
        env.setdefault("OMP_NUM_THREADS", "1")
        try:
            # Dies with the trainer, by any signal: an idle worker would see EOF on its socket, but one
            # inside a hung scorer never reads it (utils/lifeline.py: PR_SET_PDEATHSIG, forked on a
            # thread that lives as long as the process -- replacements start on rollout threads).
            self.proc = lifeline.popen([sys.executable, "-c", _WORKER_CODE, str(child_sock.fileno())],
                                       pass_fds=(child_sock.fileno(),), env=env, stdin=subprocess.DEVNULL)
        finally:
            child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.conn.send((list(sys.path), spec))
        self.ready = False
        self.started_at = time.monotonic()
        self.call: Optional[int] = None  # index of the call in flight
        self.deadline = math.inf

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 - best effort
            pass
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001
            pass


def _shutdown(workers: list) -> None:
    for w in workers:
        try:
            w.conn.send(None)
        except Exception:  # noqa: BLE001
            pass
    for w in workers:
        try:
            w.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        w.kill()


class ScoringPool:
    """``num_workers`` scoring processes with a per-call deadline (see module docstring).

    Counters (cumulative, readable at any time): ``n_timeouts``, ``n_crashes``,
    ``n_restarts``.
    """

    def __init__(self, spec: ScorerSpec, num_workers: int, timeout_s: float):
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        self.spec = spec
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._startup_failures = 0
        self._next_call_id = 0
        self.n_timeouts = 0
        self.n_crashes = 0
        self.n_restarts = 0
        self._closed = False
        self._workers = [_Worker(spec) for _ in range(num_workers)]
        self._call_ids: dict[int, int] = {}
        # Kills the workers on close(), garbage collection or interpreter exit.
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        try:
            self._wait_all_ready()
        except BaseException:
            self.close()
            raise

    # -- worker management ---------------------------------------------------------------------

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        nw = _Worker(self.spec)
        self._workers[self._workers.index(w)] = nw
        self.n_restarts += 1
        return nw

    def _on_message(self, w: _Worker, msg: tuple) -> Optional[tuple]:
        kind, payload = msg
        if kind == "ready":
            w.ready = True
            self._startup_failures = 0
            return None
        if kind == "init_error":
            raise ValueError(f"reward worker failed to load scorer {self.spec.kind} "
                             f"{self.spec.target!r}:\n{payload}")
        if kind == "done":
            return payload
        raise AssertionError(f"unexpected worker message {kind!r}")

    def _startup_failed(self, w: _Worker, why: str) -> None:
        self._startup_failures += 1
        logger.warning("reward worker pid %s failed to start (%s); restarting", w.pid, why)
        if self._startup_failures > MAX_STARTUP_FAILURES:
            raise RuntimeError(f"reward workers failed to start {self._startup_failures} times in a "
                               f"row (last: {why}); check the scorer {self.spec.target or self.spec.kind!r} "
                               "imports and the machine's memory")
        self._replace(w)

    def _wait_all_ready(self) -> None:
        while not all(w.ready for w in self._workers):
            self._poll(calls=None, results=None, block_s=1.0)

    # -- the event loop ---------------------------------------------------------------------------

    def _poll(self, calls, results, block_s: float) -> None:
        """Wait for one round of events (messages, deaths, deadlines) and handle them."""
        now = time.monotonic()
        deadlines = [w.deadline for w in self._workers if w.call is not None]
        deadlines += [w.started_at + STARTUP_TIMEOUT_S for w in self._workers if not w.ready]
        timeout = max(0.0, min([block_s] + [d - now for d in deadlines]))
        conns = {w.conn: w for w in self._workers}
        for conn in mp_wait(list(conns), timeout=timeout):
            w = conns[conn]
            if w not in self._workers:
                continue
            # Drain answers first: a worker that answered and then died still delivered.
            try:
                while w.conn.poll():
                    payload = self._on_message(w, w.conn.recv())
                    if payload is not None:
                        self._finish(w, payload, calls, results)
            except (EOFError, OSError):
                self._on_death(w, calls, results)
        now = time.monotonic()
        for w in list(self._workers):
            if w.call is not None and now >= w.deadline:
                i = w.call
                n = len(calls[i][0])
                limit = self._deadline_of(n)
                logger.warning("reward call %d (%d item(s)) gave no result within %.1f s; killing worker "
                               "pid %s and starting a new one", i, n, limit, w.pid)
                self.n_timeouts += 1
                results[i] = CallOutcome([(None, "timeout", f"no result within {limit:.1f} s")] * n)
                self._replace(w)
            elif not w.ready and now >= w.started_at + STARTUP_TIMEOUT_S:
                self._startup_failed(w, f"not ready after {STARTUP_TIMEOUT_S:.0f} s")

    def _deadline_of(self, n_items: int) -> float:
        # One timeout_s per item: item calls carry one item, batch calls a chunk.
        return self.timeout_s * max(1, n_items)

    def _finish(self, w: _Worker, payload, calls, results) -> None:
        call_id, items = payload
        if w.call is None or results is None or call_id != self._call_ids.get(w.call):
            return  # a stale answer (cannot happen with one call per worker; kept defensive)
        results[w.call] = CallOutcome(list(items))
        w.call = None
        w.deadline = math.inf

    def _on_death(self, w: _Worker, calls, results) -> None:
        if w not in self._workers:
            return
        try:
            code = w.proc.wait(timeout=2)  # EOF on the socket: the process is gone or going
        except subprocess.TimeoutExpired:
            code = None
        if w.call is not None:
            i = w.call
            self.n_crashes += 1
            logger.warning("reward worker pid %s died (exit code %s) while scoring call %d; replacing it",
                           w.pid, code, i)
            n = len(calls[i][0])
            results[i] = CallOutcome([(None, "error", f"worker crashed (exit code {code})")] * n)
            self._replace(w)
        elif not w.ready:
            self._startup_failed(w, f"exited with code {code} during start-up")
        else:
            logger.warning("idle reward worker pid %s died (exit code %s); replacing it", w.pid, code)
            self._replace(w)

    def run(self, calls: list[tuple[list[str], list[str]]]) -> list[CallOutcome]:
        """Score every call; returns one outcome per call, in order. Never raises for a timeout
        or a crash (those are per-item statuses); raises RuntimeError only if workers cannot be
        started at all, and ValueError after close()."""
        with self._lock:
            if self._closed:
                raise ValueError("the reward pool is closed; build a new one with get_reward_fn(cfg)")
            results: list[Optional[CallOutcome]] = [None] * len(calls)
            pending = list(range(len(calls)))
            pending.reverse()  # pop() from the end keeps call order
            self._call_ids = {}
            while pending or any(w.call is not None for w in self._workers):
                for w in self._workers:
                    if not pending:
                        break
                    if w.ready and w.call is None:
                        i = pending.pop()
                        resp, ans = calls[i]
                        self._next_call_id += 1
                        self._call_ids[i] = self._next_call_id
                        try:
                            w.conn.send((self._next_call_id, list(resp), list(ans)))
                        except (OSError, EOFError, BrokenPipeError):
                            pending.append(i)  # the worker died while idle; its EOF is handled next
                            continue
                        w.call = i
                        w.deadline = time.monotonic() + self._deadline_of(len(resp))
                self._poll(calls, results, block_s=1.0)
            assert all(r is not None for r in results)
            return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._closed = True
        self._finalizer()
