"""Where the time goes: per-step phase timings, the end-of-run table and a Chrome trace.

One :class:`PhaseTimer` per process (:data:`TIMER`), so that the actor, the loop and the driver
time their phases without passing it around. ``with TIMER.phase("push"): ...`` adds the wall
time of the block to the current step's total of that phase; :meth:`PhaseTimer.take_step`
returns those totals as ``time/<phase>_s`` metrics and starts the next step.

Costs: two ``perf_counter`` calls per phase and no device synchronisation. On a GPU the host
returns from a phase before its kernels finish; no sync is added here (the hot path stays as
it is), so a phase's time ends at the first existing sync after it: the forward-backward's
queued work lands in the optimizer phase, whose grad-norm read syncs. The sum over phases of a
step is exact; the split between forward-backward and optimizer is approximate on GPU.

Trace (``logging.trace=true``): every phase is also kept as a Chrome Trace Event Format
complete event (``ph: "X"``, microseconds) with ``pid`` = the global rank and ``tid`` = the
thread; :meth:`PhaseTimer.counters` keeps the engines' load as counter events (``ph: "C"``) of a
separate "engines" process. At the end of a run :meth:`PhaseTimer.write_trace` writes each rank's
events to ``<run_dir>/trace/rank<R>.json`` and rank 0 merges every rank's file into
``<run_dir>/trace.json`` (https://ui.perfetto.dev opens it). The files are the only channel
between the ranks, no collective: the trace is written in a ``finally``, where a rank that
failed must not start a collective the others never join (the run directory is shared:
``check_shared_run_dir``). Timestamps are wall-clock microseconds (one clock for every rank of
a host; across hosts as good as their clock sync), shifted so the merged trace starts at 0.
``python -m megatron_m2po.utils.timing RUN_DIR`` merges the rank files again, e.g. after rank 0
gave up waiting for a slow rank.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

# Phases of the trainer's own time (exclusive of each other; their sum is at most the step's wall
# time). "generation" is the driver's engine-side time: it overlaps the trainer's in stale_k / async.
# Colocated mode (trainer/colocated.py) adds the time-sharing phases: "release" (engines free weights
# and KV, after the generation in flight), "reload" / "offload" (the trainer's state back on / off the
# device, actor/offload.py), "resume" (engines map weights or KV again) and "transfer" (the in-place
# push through memory handles, instead of "push"), and "relaunch" (dead engines started again where
# their memory is free).
TRAINER_PHASES = ("push", "generation_wait", "data_wait", "mask", "forward_backward", "optimizer",
                  "checkpoint", "evaluation", "release", "reload", "resume", "transfer", "offload", "relaunch")
IDLE_PHASES = ("generation_wait", "data_wait")  # the trainer waits for rollouts
ENGINES_PID = 1_000_000  # the trace's "engines" process (counter tracks); ranks are 0..world-1
TRACE_FILE = "trace.json"
RANK_TRACE_DIR = "trace"

log = logging.getLogger(__name__)


class PhaseTimer:
    """Per-step phase totals (seconds) of this process, thread-safe (the driver times its
    generation in its own thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self, *, trace: bool = False, pid: int = 0) -> None:
        """Forget everything; ``trace``: keep every phase as a trace event (``pid``: the rank)."""
        with self._lock:
            self._step: dict[str, float] = defaultdict(float)
            self._run: dict[str, float] = defaultdict(float)
            self._steps = 0
            self._wall = 0.0
            self.trace = trace
            self.pid = pid
            self.events: list[dict] = []
            # union(): blocks of each name running now, and when their running stretch began. Blocks
            # that run across a reset (the driver's producer starts before the trainer's first step)
            # stay counted; their stretch restarts now.
            self._open: dict[str, int] = defaultdict(int, {k: n for k, n in getattr(self, "_open", {}).items() if n > 0})
            self._open_t0: dict[str, float] = {k: time.perf_counter() for k in self._open}
            self._threads: dict[int, str] = {}  # trace tid (an int, as Chrome wants) -> thread name
            self._t0 = time.perf_counter()
            self._t0_us = time.time() * 1e6  # the trace's clock: wall time, so that ranks' events line up

    def _ts(self, perf: float) -> float:
        return self._t0_us + (perf - self._t0) * 1e6

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` of the current step."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0, start=t0)

    @contextmanager
    def union(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` where blocks of that name run concurrently (the async
        producer's batches in flight together): the phase counts the time at least one of them
        runs, not the sum, so ``time/engine_idle_frac`` stays a share of the wall time. A step
        boundary (:meth:`take_step`) splits a running stretch between the two steps."""
        with self._lock:
            if self._open[name] == 0:
                self._open_t0[name] = time.perf_counter()
            self._open[name] += 1
        try:
            yield
        finally:
            with self._lock:
                self._open[name] -= 1
                if self._open[name] == 0:
                    t0 = self._open_t0.pop(name)
                    self._add_locked(name, time.perf_counter() - t0, t0)

    def add(self, name: str, seconds: float, *, start: float | None = None) -> None:
        """Add ``seconds`` to phase ``name`` (``start``: its perf_counter start, for the trace)."""
        with self._lock:
            self._add_locked(name, seconds, start)

    def _add_locked(self, name: str, seconds: float, start: float | None) -> None:
        self._step[name] += seconds
        if self.trace:
            start = time.perf_counter() - seconds if start is None else start
            self.events.append({"name": name, "ph": "X", "ts": self._ts(start), "dur": seconds * 1e6,
                                "pid": self.pid, "tid": threading.get_native_id()})
            self._threads[threading.get_native_id()] = threading.current_thread().name

    def counters(self, values: dict[str, float]) -> dict[str, float]:
        """Keep ``values`` (e.g. the engines' ``engine/*`` load) as counter events of the trace's
        "engines" process, stamped now; returns ``values`` (so a caller can pass them on)."""
        if self.trace and values:
            with self._lock:
                now = self._ts(time.perf_counter())
                self.events += [{"name": k, "ph": "C", "ts": now, "pid": ENGINES_PID, "args": {"value": v}}
                                for k, v in values.items()]
        return values

    def take_step(self, wall_s: float) -> dict[str, float]:
        """The step's metrics (``time/<phase>_s``, ``time/wall_s``, ``time/trainer_idle_frac``)
        for a step of ``wall_s`` seconds; its totals join the run's and the next step starts."""
        with self._lock:
            now = time.perf_counter()
            for name, t0 in self._open_t0.items():  # a union stretch still running: its part so far
                self._add_locked(name, now - t0, t0)
                self._open_t0[name] = now
            step, self._step = dict(self._step), defaultdict(float)
            for k, v in step.items():
                self._run[k] += v
            self._steps += 1
            self._wall += wall_s
        out = {f"time/{k}_s": v for k, v in sorted(step.items())}
        out["time/wall_s"] = wall_s
        out["time/trainer_idle_frac"] = sum(step.get(p, 0.0) for p in IDLE_PHASES) / wall_s if wall_s > 0 else 0.0
        if "generation" in step and wall_s > 0:
            # "generation" is the time at least one batch is being generated (TIMER.union): while
            # it is, the engines have work; the rest of the wall time they wait (for weights or work).
            out["time/engine_idle_frac"] = max(0.0, 1.0 - step["generation"] / wall_s)
        return out

    def finish(self, wall_s: float) -> None:
        """Count time after the last step (the final checkpoint) into the run's totals."""
        with self._lock:
            for k, v in self._step.items():
                self._run[k] += v
            self._step = defaultdict(float)
            self._wall += wall_s

    def totals(self) -> tuple[dict[str, float], float, int]:
        """The run's (phase -> seconds, wall seconds, steps)."""
        with self._lock:
            return dict(self._run), self._wall, self._steps

    def table(self) -> str:
        """The "where the time went" table: per phase its total, share of the wall time and mean
        per step; the trainer's phases first, then "other" (the rest of the wall time), then the
        driver's overlapping generation time."""
        run, wall, steps = self.totals()
        rows = [(p, run[p]) for p in TRAINER_PHASES if p in run]
        rows.append(("other", max(0.0, wall - sum(s for _, s in rows))))
        rows += [(p, s) for p, s in sorted(run.items()) if p not in TRAINER_PHASES]
        lines = [f"where the time went ({steps} steps, {wall:.1f}s wall; generation overlaps in stale_k/async)",
                 f"{'phase':<18}{'total s':>10}{'% wall':>9}{'s/step':>10}"]
        for name, s in rows:
            lines.append(f"{name:<18}{s:>10.2f}{100 * s / wall if wall else 0.0:>8.1f}%{s / max(steps, 1):>10.3f}")
        return "\n".join(lines)

    def trace_events(self) -> list[dict]:
        """The kept events with this process's metadata (process and thread names)."""
        with self._lock:
            events, threads = list(self.events), dict(self._threads)
        meta = [{"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0, "args": {"name": f"rank {self.pid}"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.pid, "tid": t, "args": {"name": n}}
                 for t, n in threads.items()]
        if any(e["pid"] == ENGINES_PID for e in events):
            meta.append({"name": "process_name", "ph": "M", "pid": ENGINES_PID, "tid": 0,
                         "args": {"name": "engines (/v1/loads)"}})
        return meta + events

    def write_trace(self, run_dir: str | os.PathLike, *, world_size: int = 1, wait_s: float = 60.0) -> Path:
        """Write this rank's events to ``<run_dir>/trace/rank<pid>.json``; rank 0 then waits up
        to ``wait_s`` for the other ranks' files and merges them into ``<run_dir>/trace.json``
        (a rank whose file does not come is named in a warning). Returns the file written last."""
        run_dir = Path(run_dir)
        own = _write_json(run_dir / RANK_TRACE_DIR / f"rank{self.pid}.json", {"traceEvents": self.trace_events()})
        if self.pid != 0:
            return own
        deadline = time.monotonic() + wait_s
        paths = [run_dir / RANK_TRACE_DIR / f"rank{r}.json" for r in range(world_size)]
        while not all(p.is_file() for p in paths) and time.monotonic() < deadline:
            time.sleep(0.1)  # poll for the other ranks' files; the deadline only bounds a rank that died
        missing = [r for r, p in enumerate(paths) if not p.is_file()]
        if missing:
            log.warning("trace: no events from rank(s) %s after %.0f s; trace.json has the others (merge again "
                        "later: python -m megatron_m2po.utils.timing %s)", missing, wait_s, run_dir)
        return merge_traces(run_dir)


def _write_json(path: Path, obj: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")  # renamed into place: a reader never sees half a file
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)
    return path


def merge_traces(run_dir: str | os.PathLike) -> Path:
    """Merge ``<run_dir>/trace/rank*.json`` into ``<run_dir>/trace.json``, shifted to start at 0."""
    run_dir = Path(run_dir)
    files = sorted((run_dir / RANK_TRACE_DIR).glob("rank*.json"), key=lambda p: int(p.stem[len("rank"):]))
    if not files:
        raise ValueError(f"no rank trace files in {run_dir / RANK_TRACE_DIR} (written by runs with logging.trace=true)")
    events = [e for p in files for e in json.loads(p.read_text())["traceEvents"]]
    t0 = min((e["ts"] for e in events if "ts" in e), default=0.0)
    for e in events:
        if "ts" in e:
            e["ts"] -= t0
    return _write_json(run_dir / TRACE_FILE, {"traceEvents": events, "displayTimeUnit": "ms",
                                              "otherData": {"t0_unix_s": t0 / 1e6, "ranks": len(files)}})


TIMER = PhaseTimer()


if __name__ == "__main__":  # python -m megatron_m2po.utils.timing RUN_DIR: merge the rank files again
    if len(sys.argv) != 2:
        sys.exit("usage: python -m megatron_m2po.utils.timing RUN_DIR")
    print(merge_traces(sys.argv[1]))
