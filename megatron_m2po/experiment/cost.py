"""An experiment's compute, estimated before it starts, from measured runs.

A measured run (:func:`measure_run`) is any run directory with at least two step records in its
``metrics.jsonl``: earlier runs of the same experiment (a resumed one measures itself), a short
probe (:func:`plan_probe`: the experiment's first arms for a few steps, as many at once as it
will run), or other experiments' directories (``--cost-from``). From each:

* ``step_wall_s``: mean wall seconds between consecutive step records (evaluations included
  at their frequency; gaps over ``GAP_FACTOR`` x the median -- a restart -- left out);
* ``startup_s``: the rest of its wall time (start-up, shutdown), from its done file, when it
  ran in one attempt;
* ``cpu_per_wall``: CPU seconds (``runner.ArmRun.cpu_s``) per wall second, from its done file.

The estimate (:func:`estimate`) takes the medians, gives each unfinished run ``startup_s +
remaining steps x step_wall_s`` and schedules the runs in order on ``parallel`` slots, as the
runner does: wall = the last slot's end, CPU = the sum of the runs' wall times x
``cpu_per_wall``. Per-step times measured at another ``--parallel`` are scaled by the ratio of
``max(1, parallel / cores)``: an approximation that holds when the runs are CPU-bound.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

from megatron_m2po.experiment.timing import fmt_duration

GAP_FACTOR = 10.0
PROBE_DIR = "_probe"


@dataclass(frozen=True)
class RunCost:
    """What one measured run cost (module docstring)."""

    run_dir: Path
    steps: int
    step_wall_s: float
    startup_s: Optional[float] = None
    cpu_per_wall: Optional[float] = None
    parallel: Optional[int] = None


def measure_run(run_dir: Path) -> Optional[RunCost]:
    """The cost of the run in ``run_dir``; None with fewer than two step records."""
    from megatron_m2po.experiment.analysis import step_records
    from megatron_m2po.utils.logging import read_metrics

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    times = [float(r["time"]) for r in step_records(read_metrics(path)) if isinstance(r.get("time"), (int, float))]
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= a]
    if not gaps:
        return None
    median = statistics.median(gaps)
    kept = [g for g in gaps if g <= GAP_FACTOR * max(median, 1e-3)]
    step_wall = sum(kept) / len(kept)
    startup = cpu_per_wall = parallel = None
    try:
        done = json.loads((Path(run_dir) / "experiment_done.json").read_text())
    except (OSError, ValueError):
        done = {}
    wall, cpu = done.get("wall_s"), done.get("cpu_s")
    if isinstance(wall, (int, float)) and wall > 0:
        if _attempts(Path(run_dir)) == 1:
            startup = max(0.0, wall - len(times) * step_wall)
        if isinstance(cpu, (int, float)) and cpu > 0:
            cpu_per_wall = cpu / wall
    if isinstance(done.get("parallel"), int) and done["parallel"] > 0:
        parallel = done["parallel"]
    return RunCost(Path(run_dir), len(times), step_wall, startup, cpu_per_wall, parallel)


def _attempts(run_dir: Path) -> int:
    """How many times the runner started this run (one ``=== `` header per start in train.log)."""
    try:
        return sum(1 for line in (run_dir / "train.log").read_text(errors="replace").splitlines()
                   if line.startswith("=== "))
    except OSError:
        return 0


def measure_dirs(dirs: Iterable[Path]) -> list[RunCost]:
    """Every measurable run directory under ``dirs`` (a run directory holds a ``metrics.jsonl``)."""
    out, seen = [], set()
    for d in dirs:
        for m in sorted(Path(d).rglob("metrics.jsonl")):
            rd = m.parent.resolve()
            if rd in seen:
                continue
            seen.add(rd)
            c = measure_run(rd)
            if c is not None:
                out.append(c)
    return out


@dataclass
class Estimate:
    runs_todo: int
    runs_done: int
    steps_todo: int
    updates_todo: int
    parallel: int
    cores: int
    source: str
    measured: int = 0  # runs measured
    step_wall_s: Optional[float] = None  # at this parallelism
    startup_s: Optional[float] = None
    startup_assumed: bool = False
    cpu_per_wall: Optional[float] = None
    wall_s: Optional[float] = None
    cpu_s: Optional[float] = None


def _load(parallel: int, cores: int) -> float:
    return max(1.0, parallel / max(cores, 1))


def estimate(runs: Sequence, costs: Sequence[RunCost], *, parallel: int, cores: int, updates_per_step: int,
             source: str, default_startup_s: float = 25.0) -> Estimate:
    """The compute of the runs not finished yet (``runs``: :class:`~.runner.ArmRun`, with ``status``
    ``skipped`` for those that finished before), from ``costs`` (module docstring)."""
    todo = [r for r in runs if r.status not in ("skipped", "done")]
    remaining = [max(0, r.expected_steps - min(r.tail.steps_done, r.expected_steps)) for r in todo]
    est = Estimate(runs_todo=len(todo), runs_done=len(runs) - len(todo), steps_todo=sum(remaining),
                   updates_todo=sum(remaining) * updates_per_step, parallel=parallel, cores=cores, source=source,
                   measured=len(costs))
    if not costs:
        return est
    scaled = [c.step_wall_s * _load(parallel, cores) / _load(c.parallel or parallel, cores) for c in costs]
    est.step_wall_s = statistics.median(scaled)
    startups = [c.startup_s for c in costs if c.startup_s is not None]
    est.startup_s = statistics.median(startups) if startups else default_startup_s
    est.startup_assumed = not startups
    ratios = [c.cpu_per_wall for c in costs if c.cpu_per_wall is not None]
    est.cpu_per_wall = statistics.median(ratios) if ratios else None
    walls = [est.startup_s + n * est.step_wall_s for n in remaining]
    slots = [0.0] * parallel
    for w in walls:  # in order, each into the slot that frees first: the runner's queue
        i = min(range(parallel), key=slots.__getitem__)
        slots[i] += w
    est.wall_s = max(slots) if walls else 0.0
    est.cpu_s = sum(walls) * est.cpu_per_wall if est.cpu_per_wall is not None else None
    return est


NO_MEASUREMENT = ("run without --dry-run to measure a short probe first, or pass --cost-from DIR with earlier runs "
                  "on this machine")


def format_estimate(e: Estimate, hint: str = NO_MEASUREMENT) -> str:
    head = (f"compute estimate: {e.runs_todo} run(s) to do ({e.runs_done} finished before), {e.steps_todo} steps = "
            f"{e.updates_todo} optimizer updates, --parallel {e.parallel} on {e.cores} core(s)")
    if e.step_wall_s is None:
        return head + f"\n  no measurement yet, nothing to estimate from: {hint}"
    startup = fmt_duration(e.startup_s) + (" (assumed)" if e.startup_assumed else "")
    cpu = (f"CPU {fmt_duration(e.cpu_s)} ({e.cpu_per_wall:.2f} CPU-s per run-second)" if e.cpu_s is not None
           else "CPU not measured (no finished measured run with CPU accounting)")
    return (head + f"\n  measured: {e.step_wall_s:.2f} s per step per run, start-up {startup} per run; from "
            f"{e.measured} run(s) of {e.source}\n  estimated: wall {fmt_duration(e.wall_s)}, {cpu}")


def probe_steps(eval_every_steps: int, requested: Optional[int]) -> int:
    """Steps of the probe: ``requested``, else one evaluation interval plus one (so that the mean step
    time holds one evaluation per ``eval_every_steps`` steps), at least 4."""
    if requested is not None:
        if requested < 0:
            raise ValueError(f"--probe-steps={requested}: give 0 (no probe) or a number of steps >= 2")
        return requested
    return max(4, eval_every_steps + 1)


def plan_probe(config: str, base_overrides: Sequence[str], variants: Sequence, out: Path, *, parallel: int,
               steps: int):
    """The probe: the first ``parallel`` of ``variants`` for ``steps`` steps in ``out/_probe`` (no
    checkpoints), to be run at ``parallel`` at once like the experiment."""
    from megatron_m2po.experiment.runner import plan_runs

    if steps < 2:
        raise ValueError(f"--probe-steps={steps}: a probe needs at least 2 steps (one step time); 0 skips it")
    own = {"trainer.num_steps": str(steps), "checkpoint.save_every_steps": "0", "checkpoint.export_hf_at_end": "false"}
    ov = [o for o in base_overrides if o.split("=", 1)[0] not in own] + [f"{k}={v}" for k, v in own.items()]
    return plan_runs(config, ov, list(variants)[:parallel], str(Path(out) / PROBE_DIR), 1,
                     spec={"experiment": "probe", "steps": steps})
