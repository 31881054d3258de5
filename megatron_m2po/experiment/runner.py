"""Running the arms of an experiment: one ``m2po train`` subprocess per arm and seed.

An experiment is a list of :class:`Variant` (an arm: a name, a label, the overrides that make it
out of the shared config) run at one or more seeds. :func:`plan_runs` validates every run's
config and builds its command (nothing runs); :func:`execute` skips the runs that finished
before with the same settings, runs the others (up to ``parallel`` at once, live progress,
SIGTERM forwarded so that each run checkpoints) and :func:`report` turns the runs' metrics into
figures and tables. ``m2po experiment staleness``, ``sweep-staleness`` and ``sweep-threshold``
differ only in their list of variants (``megatron_m2po/experiment/commands.py``).

Run directories: ``<out>/<arm>`` with one seed (the layout of earlier versions, so their runs
are still found), ``<out>/<arm>/seed_<seed>`` with several. Seed ``i`` of ``--seeds N`` is
``trainer.seed + i``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_m2po.experiment.analysis import (
    TR_KEY, ArmAggregate, ArmSummary, CollapseRule, aggregate_seeds, format_seed_table, format_table,
    per_seed, pooled_base_reward, summarize_arm, tr_kind)
from megatron_m2po.experiment.timing import TIME_FILE, TimeLedger, children_cpu, fmt_duration
from megatron_m2po.experiment.environment import run_environment

DONE_FILE = "experiment_done.json"
SPEC_FILE = "experiment.json"


@dataclass(frozen=True)
class Variant:
    """One arm of an experiment: ``overrides`` turn the shared config into it.

    ``k`` is its staleness (``trainer.mode=stale_k``, ``trainer.stale_k=k``); ``loss`` its
    ``algo.loss``; ``color`` its colour in every figure (empty: from the palette, by position).
    """

    name: str
    label: str
    loss: str
    k: int
    overrides: tuple[str, ...] = ()
    color: str = ""

    def all_overrides(self, run_dir: Path, max_staleness: int, seed: Optional[int]) -> list[str]:
        """The overrides of this arm (after the experiment's shared ones); ``seed`` None: the config's."""
        return ["trainer.mode=stale_k", f"trainer.stale_k={self.k}", f"algo.loss={self.loss}", *self.overrides,
                f"store.max_staleness={max_staleness}", *([f"trainer.seed={seed}"] if seed is not None else []),
                f"trainer.run_dir={run_dir}", "logging.progress=false"]


class MetricsTail:
    """Reads the complete lines appended to a ``metrics.jsonl`` since the last poll."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = b""
        self.last: dict[str, Any] = {}  # latest value of every step-level key
        self.steps_done = 0

    def poll(self) -> bool:
        """Read new records; True when a new step was logged."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return False
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        new = False
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "train/step" in rec:
                self.last.update({k: v for k, v in rec.items() if v is not None})
                self.steps_done = max(self.steps_done, int(rec["train/step"]) + 1)
                new = True
        return new

    def describe(self, loss: str) -> str:
        parts = []
        for key, name in (("rollout/reward_mean", "reward"), ("eval/synthetic/acc", "eval acc"),
                          (TR_KEY.get(loss, ""), tr_kind(loss)),
                          ("staleness/mean", "stale")):
            v = self.last.get(key)
            if isinstance(v, (int, float)):
                parts.append(f"{name} {v:.3f}" if name != "stale" else f"{name} {v:.1f}")
        return "  ".join(parts)


@dataclass
class ArmRun:
    """One training run: an arm (:class:`Variant`) at one seed, as an ``m2po train`` subprocess."""

    arm: Variant
    seed: int
    run_dir: Path
    command: list[str]
    overrides: list[str]
    tail: MetricsTail = field(init=False)
    proc: Optional[subprocess.Popen] = None
    log_file: Any = None
    started: float = 0.0
    status: str = "pending"  # pending | skipped | running | done | failed | stopped
    rc: Optional[int] = None
    wall_s: float = 0.0
    cpu_s: Optional[float] = None  # of the ended process and what it reaped (timing.children_cpu)
    expected_steps: int = 0
    config_sha256: str = ""
    parallel: int = 0  # runs at once when it ran (its cost depends on it)
    run_config: Optional[dict] = None  # this run's resolved config (config_to_dict)

    def __post_init__(self) -> None:
        self.tail = MetricsTail(self.run_dir / "metrics.jsonl")

    @property
    def tag(self) -> str:
        """Short name for progress lines: the arm, and the seed when the arm has several."""
        seeded = Path(self.run_dir).name.startswith("seed_")  # the arm runs several seeds
        return self.arm.name + (f"/seed {self.seed}" if seeded else "")

    @property
    def done_file(self) -> Path:
        return self.run_dir / DONE_FILE

    def finished_before(self, strict: bool = True) -> bool:
        """Whether this arm's run finished earlier; with ``strict``, with the same config and overrides."""
        if not self.done_file.is_file():
            return False
        try:
            done = json.loads(self.done_file.read_text())
        except ValueError:
            return False
        then = (done.get("overrides"), done.get("config_sha256"))
        same = then[0] == self.overrides and (then[1] in (None, self.config_sha256)  # None: written before digests
                                              or self._same_as_recorded())
        if strict and not same:
            raise ValueError(
                f"{self.run_dir} holds a finished run of arm {self.arm.name} (seed {self.seed}) with different settings (config "
                f"sha256 {str(then[1])[:12]}, overrides {then[0]}; now {self.config_sha256[:12]}, {self.overrides}); "
                f"use a fresh --out directory or delete {self.run_dir}")
        return True

    def _same_as_recorded(self) -> bool:
        """Whether the finished run's own record of its settings (``config.json``, the resolved config
        the trainer wrote) equals today's config of this run, where the digest does not: a field
        added to the code since, at its default, changes nothing the run did. Every field of today's
        config must be in the record with the same value, or be new and at its default; the tiny
        base (``model.hf_path=tiny``) is recorded as the directory it was built into."""
        if self.run_config is None:
            return False
        try:
            rec = _leaves(json.loads((self.run_dir / "config.json").read_text()))
        except (OSError, ValueError):
            return False
        from megatron_m2po.config import Config, config_to_dict

        defaults = _leaves(json.loads(json.dumps(config_to_dict(Config()), default=str)))
        for k, v in _leaves(json.loads(json.dumps(self.run_config, default=str))).items():
            if k in rec:
                if rec[k] != v and not (k == "model.hf_path" and v == "tiny"):
                    return False
            elif k not in defaults or v != defaults[k]:
                return False
        return True

    def start(self, env: dict[str, str]) -> None:
        from megatron_m2po.utils.lifeline import popen

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_file = open(self.run_dir / "train.log", "ab")
        self.log_file.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.command)}\n".encode())
        self.log_file.flush()
        # Own session: a terminal Ctrl-C reaches only the experiment, which forwards SIGTERM so
        # every arm can checkpoint before it exits. And it dies with the experiment (SIGKILL,
        # its own children with it: utils/lifeline.py): a killed experiment leaves no run behind
        # that would hold its run directory's lock when the experiment is started again.
        self.proc = popen(self.command, stdout=self.log_file, stderr=subprocess.STDOUT, env=env,
                          start_new_session=True)
        self.started = time.monotonic()
        self.status = "running"

    def check(self) -> bool:
        """True when the process has ended (status updated). The only place the process is reaped,
        so that its CPU time is the growth of ``RUSAGE_CHILDREN`` across that ``waitpid``."""
        if self.proc is None:
            return False
        before = children_cpu()
        if self.proc.poll() is None:
            return False
        if self.cpu_s is None:
            self.cpu_s = round(children_cpu() - before, 1)
        self.rc = self.proc.returncode
        self.wall_s = time.monotonic() - self.started
        self.log_file.close()
        self.tail.poll()
        if self.rc == 0 and self.tail.steps_done >= self.expected_steps:
            self.status = "done"
            self.done_file.write_text(json.dumps({
                "arm": self.arm.name, "overrides": self.overrides, "config_sha256": self.config_sha256,
                "command": self.command, "rc": self.rc, "wall_s": round(self.wall_s, 1), "cpu_s": self.cpu_s,
                "parallel": self.parallel, "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                # the machine and base weights it ran on: runs are compared only within one (ladder.py)
                "environment": run_environment(self.run_dir)}, indent=2))
        elif self.rc == 0:
            self.status = "stopped"  # it checkpointed on a signal before the last step
        else:
            self.status = "failed"
        return True


def _run_arms(runs: list[ArmRun], parallel: int, progress: bool, ledger: Optional[TimeLedger] = None) -> None:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    pending = [r for r in runs if r.status == "pending"]
    active: list[ArmRun] = []

    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    live = progress and sys.stderr.isatty()
    bars = Progress(TextColumn("{task.fields[arm]:<22}"), BarColumn(bar_width=28), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(),
                    TextColumn("{task.fields[status]:<8} {task.fields[info]}"),
                    disable=not live, refresh_per_second=2)
    # One bar for the whole experiment (steps of every run), then one per run while it runs.
    overall = OverallProgress(runs)
    total_task = bars.add_task("", total=overall.total, arm="all runs", status="", info=overall.runs_finished(),
                               completed=overall.done_steps())
    tasks = {id(r): bars.add_task("", total=r.expected_steps, arm=r.tag, status=r.status, info="",
                                  visible=len(runs) <= 8,  # many runs: only the running ones
                                  completed=r.expected_steps if r.status == "skipped" else 0)
             for r in runs}
    last_print: dict[int, float] = {}

    def refresh(r: ArmRun) -> None:
        new = r.tail.poll()
        bars.update(tasks[id(r)], completed=r.tail.steps_done, status=r.status, info=r.tail.describe(r.arm.loss),
                    visible=len(runs) <= 8 or r.status == "running")
        now = time.monotonic()
        if not live and progress and new and now - last_print.get(id(r), 0.0) > 30:
            last_print[id(r)] = now
            print(f"[{r.tag}] step {r.tail.steps_done}/{r.expected_steps}  {r.tail.describe(r.arm.loss)}",
                  file=sys.stderr, flush=True)

    def on_signal(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_signal)
    try:
        with bars:
            while pending or active:
                while pending and len(active) < parallel:
                    r = pending.pop(0)
                    r.parallel = parallel
                    r.start(env)
                    active.append(r)
                    if not live and progress:
                        print(f"[{r.tag}] started: {' '.join(r.command)}", file=sys.stderr, flush=True)
                for r in list(active):
                    refresh(r)
                    if r.check():
                        active.remove(r)
                        refresh(r)
                        if not live and progress:
                            print(f"[{r.tag}] {r.status} (rc={r.rc}) after {r.wall_s:.0f}s; log: "
                                  f"{r.run_dir / 'train.log'}", file=sys.stderr, flush=True)
                            overall.force = True
                bars.update(total_task, completed=overall.done_steps(), info=overall.runs_finished())
                if not live and progress and overall.due():  # every minute and when a run ends
                    print(f"[all runs] {overall.describe()}", file=sys.stderr, flush=True)
                if ledger is not None:
                    ledger.tick([r.proc.pid for r in active if r.proc is not None])
                time.sleep(1.0)  # poll interval of the runs' metrics files and processes
    except KeyboardInterrupt:
        print("experiment: stopping the running arms (each checkpoints first); re-run the same command to "
              "continue", file=sys.stderr, flush=True)
        _stop_all(active)
        raise
    finally:
        signal.signal(signal.SIGTERM, old)


class OverallProgress:
    """Steps done over all runs of one invocation, and an ETA from this invocation's own rate."""

    def __init__(self, runs: list[ArmRun], every_s: float = 60.0):
        self.runs, self.every_s = runs, every_s
        self.total = sum(r.expected_steps for r in runs)
        self.t0 = time.monotonic()
        self.start_steps = self.done_steps()
        self._last = self.t0
        self.force = False  # print at the next due() whatever the time

    def done_steps(self) -> int:
        return sum(r.expected_steps if r.status in ("skipped", "done") else min(r.tail.steps_done, r.expected_steps)
                   for r in self.runs)

    def runs_finished(self) -> str:
        return f"{sum(1 for r in self.runs if r.status in ('skipped', 'done'))}/{len(self.runs)} runs finished"

    def describe(self) -> str:
        done = self.done_steps()
        elapsed = time.monotonic() - self.t0
        rate = (done - self.start_steps) / elapsed if elapsed > 0 else 0.0
        eta = f", eta {fmt_duration((self.total - done) / rate)}" if rate > 0 and done < self.total else ""
        pct = 100.0 * done / self.total if self.total else 100.0
        return f"{done}/{self.total} steps ({pct:.1f}%), {self.runs_finished()}, elapsed {fmt_duration(elapsed)}{eta}"

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.every_s and not self.force:
            return False
        self._last, self.force = now, False
        return True


def _stop_all(active: list[ArmRun], grace_s: float = 180.0) -> None:
    """SIGTERM (finish the step, checkpoint, exit); a second SIGTERM, then SIGKILL, if it hangs.
    Waits by polling :meth:`ArmRun.check`, the one place a run is reaped (its CPU time)."""
    def wait(runs: list[ArmRun], timeout: float) -> list[ArmRun]:
        deadline = time.monotonic() + timeout
        left = [r for r in runs if r.proc is not None and not r.check()]
        while left and time.monotonic() < deadline:
            time.sleep(0.2)  # poll interval; check() decides
            left = [r for r in left if not r.check()]
        return left

    for r in active:
        if r.proc is not None and not r.check():
            r.proc.send_signal(signal.SIGTERM)
    left = wait(active, grace_s)
    for r in left:
        r.proc.send_signal(signal.SIGTERM)  # the trainer's second signal aborts the step
    left = wait(left, 30.0)
    for r in left:
        r.proc.kill()
    wait(left, 30.0)


# --------------------------------------------------------------------------------------------
# Plan, execute, report


def config_digest(cfg) -> str:
    """Of the resolved config, so that editing a comment does not invalidate finished runs (a field
    added to the code later is matched by :meth:`ArmRun._same_as_recorded`)."""
    from megatron_m2po.config import config_to_dict

    return _sha(config_to_dict(cfg))


def _sha(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


def _leaves(d: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a.b.c": value}`` of a nested dict's leaves."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def plan_runs(config: str, base_overrides: Sequence[str], variants: Sequence[Variant], out: Optional[str],
              seeds: int = 1, spec: Optional[dict] = None) -> tuple[list[ArmRun], dict[str, Any]]:
    """Every run of every variant at ``seeds`` seeds, each config validated (nothing runs).

    ``base_overrides`` apply to every run (the experiment's and the user's, in that order);
    ``spec`` is merged into the returned experiment description.
    """
    from megatron_m2po.config import config_to_dict, load_config
    from megatron_m2po.utils.settings import ConfigError

    if seeds < 1:
        raise ConfigError(f"--seeds={seeds}: run each arm at least once")
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ConfigError(f"arm names must be unique, got {names}")
    cfg = load_config(config, list(base_overrides))
    U = cfg.trainer.num_updates_per_step
    digest = config_digest(cfg)
    out_dir = Path(out if out else cfg.trainer.run_dir)
    max_staleness = max([cfg.store.max_staleness] + [v.k + U - 1 for v in variants])
    seed_list = [cfg.trainer.seed + i for i in range(seeds)]
    runs = []
    for v in variants:
        for seed in seed_list:
            run_dir = (out_dir / v.name if seeds == 1 else out_dir / v.name / f"seed_{seed}").resolve()
            ov = list(base_overrides) + v.all_overrides(run_dir, max_staleness, seed if seeds > 1 else None)
            run_cfg = load_config(config, ov)  # fail before anything starts
            cmd = [sys.executable, "-m", "megatron_m2po.cli", "train", str(config), *ov]
            r = ArmRun(arm=v, seed=seed, run_dir=run_dir, command=cmd, overrides=ov, config_sha256=digest,
                       run_config=config_to_dict(run_cfg))
            r.expected_steps = run_cfg.trainer.num_steps
            runs.append(r)
    out_spec = {"config": str(config), "overrides": list(base_overrides), "updates_per_step": U,
                "num_steps": cfg.trainer.num_steps, "seed": cfg.trainer.seed, "seeds": seed_list,
                "arms": names, "arm_labels": {v.name: v.label for v in variants},
                "arm_overrides": {v.name: [f"trainer.stale_k={v.k}", f"algo.loss={v.loss}", *v.overrides]
                                  for v in variants},
                "max_staleness": max_staleness, "out": str(out_dir), **(spec or {})}
    return runs, out_spec


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def resolve_parallel(parallel: Optional[int]) -> int:
    """``--parallel``: runs at once (default ``max(1, cores // 2)``)."""
    parallel = parallel if parallel is not None else max(1, usable_cores() // 2)
    if parallel < 1:
        raise ValueError(f"--parallel={parallel}: run at least one arm at a time")
    return parallel


def skip_finished(runs: list[ArmRun], progress: bool) -> None:
    """Mark the runs that finished before with the same settings ``skipped`` (ValueError for a
    finished run with other settings: :meth:`ArmRun.finished_before`)."""
    for r in runs:
        if r.status == "pending" and r.finished_before():
            r.status = "skipped"
            r.tail.poll()
            if progress:
                print(f"[{r.tag}] finished before: skipped ({r.done_file})", file=sys.stderr)


def provenance() -> dict[str, Any]:
    """Where this invocation's code came from: the git commit of the package's checkout (and whether
    it had uncommitted changes), or ``None`` outside a git checkout, and when it started (UTC).
    Pre-registered experiments use it to show that their runs started after the registration."""
    import datetime

    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> Optional[str]:
        try:
            r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    dirty = None if commit is None else bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": commit, "dirty": dirty,
            "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _earlier_invocations(path: Path) -> list[dict[str, Any]]:
    try:
        return list(json.loads(path.read_text()).get("invocations", []))
    except (OSError, ValueError, AttributeError):
        return []


def execute(runs: list[ArmRun], spec: dict[str, Any], *, parallel: Optional[int], progress: bool) -> None:
    """Run every run that did not finish before (resumable; see the module docstring). Each
    invocation's wall and CPU time go to ``<out>/experiment_time.json`` (:class:`TimeLedger`)."""
    out_dir = Path(spec["out"])
    parallel = resolve_parallel(parallel)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec["invocations"] = _earlier_invocations(out_dir / SPEC_FILE) + [provenance()]
    (out_dir / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")
    skip_finished(runs, progress)
    t0 = time.monotonic()
    ledger = TimeLedger(out_dir / TIME_FILE, parallel=parallel)
    try:
        _run_arms(runs, parallel, progress=progress, ledger=ledger)
    finally:
        ledger.close()
    spec["last_invocation_wall_s"] = round(time.monotonic() - t0, 1)
    (out_dir / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")


def mark_finished(runs: list[ArmRun]) -> None:
    """For ``--report-only``: which runs finished (whatever their settings)."""
    for r in runs:
        r.status = "done" if r.finished_before(strict=False) else "incomplete"


def report(runs: list[ArmRun], spec: dict[str, Any], out_dir: Path, figures_dir: Path,
           rule: Optional[CollapseRule] = None, smooth: int = 5,
           figures: Optional[Sequence[tuple[str, str, str]]] = None, title: str = "") -> list[ArmAggregate]:
    """Figures and the table (markdown + JSON) from the runs' metrics files; prints the table.

    One seed per arm: the per-arm table (:func:`format_table`). Several: mean ± std per arm and
    the differences that exceed the seed spread (:func:`format_seed_table`), and the per-seed rows
    in ``summary.json``.
    """
    from megatron_m2po.experiment.figures import FIGURES, write_figures
    from megatron_m2po.utils.logging import read_metrics

    rule = rule or CollapseRule()
    data: dict[int, list[dict]] = {}
    for r in runs:
        mpath = r.run_dir / "metrics.jsonl"
        if mpath.is_file():
            data[id(r)] = read_metrics(mpath)
    U = spec["updates_per_step"]
    base = pooled_base_reward([(data[id(r)], r.arm.k, U) for r in runs if id(r) in data])
    spec["base_reward"] = base
    by_arm: dict[str, list[tuple[ArmRun, ArmSummary]]] = {}
    for r in runs:
        if id(r) not in data:
            continue
        s = summarize_arm(data[id(r)], arm=r.arm.name, label=r.arm.label, loss=r.arm.loss, staleness=r.arm.k,
                          rule=rule, base_reward=base)
        s.extra = {"seed": r.seed, "status": r.status, "wall_s": _done_value(r, "wall_s", r.wall_s),
                   "cpu_s": _done_value(r, "cpu_s", r.cpu_s), "expected_steps": r.expected_steps}
        by_arm.setdefault(r.arm.name, []).append((r, s))
    if not by_arm:
        raise ValueError(f"no run of {out_dir} has a metrics.jsonl yet; run the experiment first")
    variants = {r.arm.name: r.arm for r in runs}
    order = [n for n in variants if n in by_arm]
    aggs = [aggregate_seeds([s for _, s in by_arm[n]], [r.seed for r, _ in by_arm[n]]) for n in order]
    several = len(spec.get("seeds", [])) > 1
    figs = write_figures([(n, variants[n].label, variants[n].loss, [data[id(r)] for r, _ in by_arm[n]]) for n in order],
                         figures_dir, smooth=smooth, figures=figures or FIGURES,
                         colors={n: variants[n].color for n in order if variants[n].color})
    table = format_seed_table(aggs, rule) if several else format_table([a.rows[0] for a in aggs], rule)
    if title:
        table = f"{title}\n\n{table}"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.md").write_text(table + "\n")
    (out_dir / "summary.json").write_text(json.dumps(
        {"spec": spec, "rule": {**asdict(rule), "text": rule.describe()},
         "arms": [asdict(s) for a in aggs for s in a.rows],
         "aggregate": [{"arm": a.arm, "label": a.label, "loss": a.loss, "staleness": a.staleness, "seeds": a.seeds,
                        "collapsed": a.collapsed, "judged": a.judged,
                        "stats": {k: asdict(v) for k, v in a.stats.items()},
                        "per_seed": {k: {str(seed): v for seed, v in per_seed(a, k).items()} for k in a.stats}}
                       for a in aggs],
         "figures": [str(p) for p in figs]}, indent=2) + "\n")
    print(table)
    print(f"\nfigures: {figures_dir}\ntable: {out_dir / 'summary.md'}, {out_dir / 'summary.json'}")
    return aggs


def _done_value(r: ArmRun, key: str, now: Optional[float]) -> Optional[float]:
    """``key`` of this invocation's run (``now``), else of its done file (a run finished before)."""
    if now:
        return round(now, 1)
    try:
        return json.loads(r.done_file.read_text()).get(key)
    except (OSError, ValueError):
        return None
