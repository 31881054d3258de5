"""``m2po experiment arena``: its arms and planning, the compute estimate and the time ledger by
hand, the learning-rate calibration's choice, the report over seeds from hand-made metrics, and
one two-arm, two-step, k = 2 miniature killed with SIGKILL and continued."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_m2po.config import ConfigError, load_config
from megatron_m2po.experiment.arena import CORE_ARMS, arena_variants, offpolicy_losses, plan_arena
from megatron_m2po.experiment.arena_calibration import choose_lr, plan_calibration
from megatron_m2po.experiment.arena_report import write_arena_report
from megatron_m2po.experiment.cost import RunCost, estimate, format_estimate, measure_run, plan_probe
from megatron_m2po.experiment.runner import ArmRun, MetricsTail, Variant, report
from megatron_m2po.experiment.timing import TIME_FILE, TimeLedger

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "examples" / "staleness_tiny.yaml")


# ------------------------------------------------------------------------------ arms and plan

def test_arena_has_every_registered_offpolicy_loss_and_the_references():
    from megatron_m2po.algo.registry import LOSSES

    names = offpolicy_losses()
    assert {"icepop", "mis", "areal_m2po", "vcpo"} <= set(names)
    assert all(LOSSES[n].objective.__module__ == "megatron_m2po.algo.offpolicy_losses" for n in names)
    vs = arena_variants(256)
    assert [v.name for v in vs[:4]] == list(CORE_ARMS)
    assert {v.loss for v in vs} == {"grpo", "no_tr", "m2po", *names}
    assert [v.k for v in vs if v.name == "grpo_s0"] == [0] and all(v.k == 256 for v in vs if v.name != "grpo_s0")
    mis = {v.name: v.overrides for v in vs if v.loss == "mis"}
    assert mis == {"mis_sk": ("algo.mis.level=sequence",), "mis_tok_sk": ("algo.mis.level=token",)}
    assert len({v.name for v in vs}) == len(vs) and len({v.color for v in vs}) == len(vs)
    (distill,) = [v for v in arena_variants(256, teacher="/models/t") if v.name == "m2po_distill_sk"]
    assert (distill.loss, distill.k) == ("m2po", 256) and "algo.distill.teacher=/models/t" in distill.overrides


def test_plan_arena_defaults_k256_1024_updates_3_seeds(tmp_path):
    runs, spec = plan_arena(CONFIG, [], out=str(tmp_path))
    cfg = load_config(CONFIG)
    U = cfg.trainer.num_updates_per_step
    assert spec["k"] == 256 and spec["updates"] == 1024 and spec["num_steps"] == 1024 // U
    assert len(spec["seeds"]) == 3 and len(runs) == 3 * len(arena_variants(256))
    assert spec["max_staleness"] >= 256 + U - 1 and spec["lr"] == cfg.optim.lr
    varying = {"algo.loss", "trainer.stale_k", "trainer.run_dir", "trainer.seed", "algo.mis.level",
               "algo.distill.teacher", "algo.distill.coef", "algo.distill.mode"}
    rest = [{k: v for k, v in (o.split("=", 1) for o in r.overrides) if k not in varying} for r in runs]
    assert all(x == rest[0] for x in rest), "arms must differ only in loss (and its setting), staleness, seed"
    for r in runs[::3]:
        c = load_config(CONFIG, r.overrides)
        assert c.algo.loss == r.arm.loss and c.trainer.stale_k == r.arm.k and c.trainer.num_steps == 1024 // U
        assert c.trainer.mode == "stale_k" and r.expected_steps == 1024 // U


def test_plan_arena_lr_subset_and_errors(tmp_path):
    runs, spec = plan_arena(CONFIG, ["optim.lr=1e-3"], k=8, updates=32, seeds=2, lr=2e-5,
                            arms=["grpo_s0", "vcpo_sk"], out=str(tmp_path))
    assert [r.arm.name for r in runs] == ["grpo_s0", "grpo_s0", "vcpo_sk", "vcpo_sk"]
    assert {load_config(CONFIG, r.overrides).optim.lr for r in runs} == {2e-5}  # --lr wins
    assert spec["lr"] == 2e-5 and spec["lr_override"] == 2e-5
    with pytest.raises(ConfigError, match="multiple of the 4"):
        plan_arena(CONFIG, [], k=8, updates=30, out=str(tmp_path))
    with pytest.raises(ConfigError, match="never train on data"):
        plan_arena(CONFIG, [], k=32, updates=32, out=str(tmp_path))
    with pytest.raises(ConfigError, match="unknown arena arm"):
        plan_arena(CONFIG, [], arms=["ppo_sk"], out=str(tmp_path))
    with pytest.raises(ConfigError, match="k >= 1"):
        plan_arena(CONFIG, [], k=0, out=str(tmp_path))


# ------------------------------------------------------------------------------ cost

def _write_run(run_dir: Path, times, done=None, attempts=1):
    run_dir.mkdir(parents=True, exist_ok=True)
    recs = [{"step": 4 * (i + 1), "time": t, "train/step": float(i)} for i, t in enumerate(times)]
    recs.insert(1, {"step": 5, "time": times[0] + 0.5, "update/x": 1.0})  # per-update records do not count
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run_dir / "train.log").write_text("".join(f"\n=== start {i}\nlog\n" for i in range(attempts)))
    if done is not None:
        (run_dir / "experiment_done.json").write_text(json.dumps(done))


def test_dry_run_without_lr_warns_that_the_configs_lr_is_far_too_high(tmp_path, capsys):
    """The plan of 27 runs at the config's lr used to print with no word that the docs call that lr
    far too high for the tiny model; with --lr (or an optim.lr override) nothing is said."""
    from megatron_m2po.cli import main

    assert main(["experiment", "arena", CONFIG, "--dry-run", "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "warning: no --lr: every arm runs at the config's optim.lr=0.0002" in err and "--calibrate-lr" in err
    assert main(["experiment", "arena", CONFIG, "--dry-run", "--out", str(tmp_path / "b"), "--lr", "5e-5"]) == 0
    assert "warning: no --lr" not in capsys.readouterr().err
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").rglob("metrics.jsonl"))


def test_measure_run_by_hand(tmp_path):
    # gaps 2, 2, 46 (a restart: > 10 x the median, left out), 2 -> 2 s per step
    _write_run(tmp_path / "a", [100, 102, 104, 150, 152], {"wall_s": 40.0, "cpu_s": 60.0, "parallel": 2})
    c = measure_run(tmp_path / "a")
    assert c.steps == 5 and c.step_wall_s == pytest.approx(2.0)
    assert c.startup_s == pytest.approx(40.0 - 5 * 2.0) and c.cpu_per_wall == pytest.approx(1.5) and c.parallel == 2
    _write_run(tmp_path / "b", [100, 103, 106], {"wall_s": 40.0}, attempts=2)  # resumed: no start-up
    b = measure_run(tmp_path / "b")
    assert b.step_wall_s == pytest.approx(3.0) and b.startup_s is None and b.cpu_per_wall is None
    _write_run(tmp_path / "c", [100])
    assert measure_run(tmp_path / "c") is None and measure_run(tmp_path / "missing") is None


def test_estimate_schedules_runs_on_parallel_slots(tmp_path):
    runs, _ = plan_arena(CONFIG, [], k=8, updates=40, seeds=1, arms=["grpo_s0", "grpo_sk", "m2po_sk", "no_tr_sk"],
                         out=str(tmp_path))
    runs[0].status = "skipped"  # finished before: costs nothing
    runs[1].tail.steps_done = 4  # a resumed run: 6 of its 10 steps left
    costs = [RunCost(tmp_path, 10, 2.0, 5.0, 1.5, 2), RunCost(tmp_path, 10, 4.0, 7.0, 0.5, 2),
             RunCost(tmp_path, 10, 3.0, None, None, 2)]
    e = estimate(runs, costs, parallel=2, cores=2, updates_per_step=4, source="test")
    assert (e.runs_todo, e.runs_done, e.steps_todo, e.updates_todo) == (3, 1, 26, 104)
    assert e.step_wall_s == 3.0 and e.startup_s == 6.0 and e.cpu_per_wall == 1.0  # medians
    # run walls 6 + 6*3 = 24, 36, 36: slot 0 gets 24 then 36 (frees first) -> 60; slot 1: 36
    assert e.wall_s == pytest.approx(60.0) and e.cpu_s == pytest.approx(96.0)
    # measured at --parallel 4 on 2 cores (twice oversubscribed), run at 1: half the step time
    e1 = estimate(runs, [RunCost(tmp_path, 10, 4.0, 6.0, 1.0, 4)], parallel=1, cores=2, updates_per_step=4,
                  source="test")
    assert e1.step_wall_s == pytest.approx(2.0) and e1.wall_s == pytest.approx(3 * 6.0 + 26 * 2.0)
    text = format_estimate(e)
    assert "3 run(s) to do (1 finished before)" in text and "wall 60 s" in text and "CPU 96 s" in text
    none = estimate(runs, [], parallel=2, cores=2, updates_per_step=4, source="")
    assert none.wall_s is None and "no measurement yet" in format_estimate(none)


def test_probe_plan_is_the_first_arms_for_a_few_steps(tmp_path):
    runs, spec = plan_arena(CONFIG, [], k=8, updates=40, seeds=3, out=str(tmp_path))
    probe, _ = plan_probe(CONFIG, spec["overrides"], [r.arm for r in runs[::3]], tmp_path, parallel=2, steps=6)
    assert [r.arm.name for r in probe] == ["grpo_s0", "grpo_sk"]
    for r in probe:
        c = load_config(CONFIG, r.overrides)
        assert c.trainer.num_steps == 6 and c.checkpoint.save_every_steps == 0
        assert r.run_dir.parent == (tmp_path / "_probe").resolve()
        assert sum(o.startswith("trainer.num_steps=") for o in r.overrides) == 1
    with pytest.raises(ValueError, match="at least 2 steps"):
        plan_probe(CONFIG, spec["overrides"], [runs[0].arm], tmp_path, parallel=1, steps=1)


# ------------------------------------------------------------------------------ time accounting

def test_time_ledger_keeps_every_invocation(tmp_path):
    path = tmp_path / TIME_FILE
    first = TimeLedger(path, parallel=2)
    first.close()
    TimeLedger(path, parallel=1)  # killed: never closed, its last record counts
    entries = TimeLedger.read(path)
    assert [e["ended"] for e in entries] == [True, False] and [e["parallel"] for e in entries] == [2, 1]
    t = TimeLedger.totals(path)
    assert t["invocations"] == 2 and t["killed"] == 1
    assert t["wall_s"] == pytest.approx(sum(e["wall_s"] for e in entries))


def test_run_cpu_time_is_what_the_reaped_process_used(tmp_path):
    """The CPU seconds of a finished run come from RUSAGE_CHILDREN across its reaping (timing.py)."""
    from waiting import wait_until

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\n"
    r = ArmRun(arm=Variant("x", "x", "grpo", 0), seed=0, run_dir=tmp_path / "x",
               command=[sys.executable, "-c", burn], overrides=[])
    r.start(dict(os.environ))
    wait_until(r.check, what="the CPU-burning child to end", timeout=60)
    assert r.rc == 0 and r.cpu_s >= 0.45, r.cpu_s


_EXPERIMENT = """
import os, sys, time
from pathlib import Path
from megatron_m2po.experiment.runner import ArmRun, Variant
# a run that outlives the test unless it dies with its experiment (the sleeps stand for long work)
r = ArmRun(arm=Variant("x", "x", "grpo", 0), seed=0, run_dir=Path(sys.argv[1]), overrides=[],
           command=[sys.executable, "-c", "import time; time.sleep(600)"])  # elapsed time is the behaviour under test (a deliberate hang)
r.start(dict(os.environ))
Path(sys.argv[2]).write_text(str(r.proc.pid))
time.sleep(600)  # elapsed time is the behaviour under test (a deliberate hang until killed)
"""


def test_runs_die_with_a_killed_experiment(tmp_path):
    """SIGKILL of the experiment takes its runs with it (``ArmRun.start``: utils/lifeline.py), so a
    re-started experiment never finds its run directories held by an orphan."""
    import psutil
    from waiting import wait_until

    pid_file = tmp_path / "pid"
    parent = subprocess.Popen([sys.executable, "-c", _EXPERIMENT, str(tmp_path / "run"), str(pid_file)], cwd=REPO)
    try:
        wait_until(lambda: pid_file.is_file() and pid_file.read_text(), what="the run started", timeout=60,
                   hopeless=lambda: parent.poll() is not None and f"the experiment exited ({parent.returncode})")
        child = psutil.Process(int(pid_file.read_text()))
        parent.kill()
        parent.wait()

        def gone() -> bool:
            try:
                return child.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        wait_until(gone, what="the run gone after its experiment was killed", timeout=30)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if pid_file.is_file():
            try:
                psutil.Process(int(pid_file.read_text())).kill()
            except psutil.Error:
                pass


# ------------------------------------------------------------------------------ calibration

def test_choose_lr_nearest_the_target_in_log_ratio():
    assert choose_lr([(1e-5, 0.008), (2e-5, 0.014), (4e-5, 0.025)], 0.012) == 2e-5
    # 0.006 is a factor 2 below, 0.02 a factor 1.67 above: the latter is nearer
    assert choose_lr([(1e-5, 0.006), (2e-5, 0.02)], 0.012) == 2e-5
    assert choose_lr([(1e-5, None), (2e-5, 0.0), (4e-5, 0.05)], 0.012) == 4e-5
    assert choose_lr([(1e-5, None)], 0.012) is None


def test_calibration_plan(tmp_path):
    runs, spec = plan_calibration(CONFIG, ["optim.lr=3e-4"], k=256, lrs=[2e-5, 5e-6], stale_updates=64,
                                  out=tmp_path, target=0.012)
    U = load_config(CONFIG).trainer.num_updates_per_step
    assert [r.arm.name for r in runs] == ["grpo_sk_lr5e-06", "grpo_sk_lr2e-05"] and spec["lrs"] == [5e-6, 2e-5]
    for r, lr in zip(runs, spec["lrs"]):
        c = load_config(CONFIG, r.overrides)
        assert c.optim.lr == lr and c.trainer.stale_k == 256 and c.algo.loss == "grpo"
        assert c.trainer.eval_every_steps == 0 and c.trainer.num_steps == (256 + 64) // U + 1
    with pytest.raises(ConfigError, match="distinct learning rates"):
        plan_calibration(CONFIG, [], k=8, lrs=[1e-5, 1e-5], stale_updates=8, out=tmp_path, target=0.012)
    with pytest.raises(ConfigError, match="target-clip"):
        plan_calibration(CONFIG, [], k=8, lrs=[1e-5], stale_updates=8, out=tmp_path, target=1.5)


# ------------------------------------------------------------------------------ report over seeds

def _records(accs, rewards, tr_key, tr, k, U=4):
    out = []
    for s, (a, rew, f) in enumerate(zip(accs, rewards, tr)):
        out.append({"step": (s + 1) * U, "time": 100.0 + 2 * s, "train/step": float(s), "eval/synthetic/acc": a,
                    "rollout/reward_mean": rew, tr_key: f, "staleness/min": 0 if s == 0 else k,
                    "policy/kl_k3": 0.01})
    return out


def test_arena_report_mean_std_standard_errors_and_compute(tmp_path):
    runs, spec = plan_arena(CONFIG, [], k=8, updates=12, seeds=2, arms=["grpo_s0", "m2po_sk"], out=str(tmp_path))
    final = {("grpo_s0", 0): 0.50, ("grpo_s0", 1): 0.52, ("m2po_sk", 0): 0.40, ("m2po_sk", 1): 0.44}
    for r in runs:
        i = r.seed - spec["seeds"][0]
        key = "loss/clip_frac" if r.arm.loss == "grpo" else "m2po/mask_frac"
        recs = _records([0.3, 0.6, final[(r.arm.name, i)]], [0.3, 0.4, 0.5], key, [0.01, 0.02, 0.03], r.arm.k)
        r.run_dir.mkdir(parents=True)
        (r.run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
        (r.run_dir / "experiment_done.json").write_text(json.dumps(
            {"overrides": r.overrides, "config_sha256": r.config_sha256, "wall_s": 30.0, "cpu_s": 45.0}))
        r.status = "done"
    TimeLedger(tmp_path / TIME_FILE, parallel=2).close()
    report(runs, spec, tmp_path, tmp_path / "figures", smooth=0)
    md = write_arena_report(tmp_path, spec, runs).read_text()
    # final acc of GRPO s=0: mean 0.51, std 0.01414, standard error 0.01
    assert "| GRPO s=0 | 0 | 2 | 0.600 ± 0.000 (0.000) | 0.510 ± 0.014 (0.010) |" in md
    assert "| M2PO s=8 | 8 | 2 | 0.600 ± 0.000 (0.000) | 0.420 ± 0.028 (0.020) |" in md
    # M2PO − GRPO s=0 in final acc, paired by seed: d = -0.10, -0.08; mean -0.09, sd 0.01414, se 0.01:
    # 9.0 x, bold (Welch's unpaired error would be sqrt(0.01414²/2 + 0.02828²/2) = 0.02236)
    assert "| M2PO s=8 | +0.000 ± 0.000 (0.0×) | **-0.090 ± 0.010 (9.0×)** |" in md
    assert "paired by seed" in md
    # clip / mask on stale steps: GRPO s=0 every step (2 %), M2PO s=8 the steps >= 8 updates old (2.5 %)
    assert "| 2.00% ± 0.00% (0.00%) | 2.00% ± 0.00% (0.00%) | 0/2 |" in md
    assert "| 2.50% ± 0.00% (0.00%) | 2.00% ± 0.00% (0.00%) | 0/2 |" in md
    assert "| arena runs |" in md and "invocations" in md and "CPU 45 s on average" in md
    for stem in ("heldout_acc", "reward", "trust_region"):
        assert f"![{stem}](figures/{stem}.png)" in md and (tmp_path / "figures" / f"{stem}.png").is_file()
    assert math.isclose(json.loads((tmp_path / "summary.json").read_text())["aggregate"][0]["stats"]["final_acc"]
                        ["mean"], 0.51)


# ------------------------------------------------------------------------------ the miniature, killed and continued

MINI = ["--fast", "--k", "2", "--updates", "8", "--seeds", "1", "--arms", "grpo_s0,icepop_sk", "--parallel", "1",
        "--probe-steps", "0", "trainer.eval_every_steps=2", "data.synthetic_eval_size=32",
        "trainer.eval_samples=1"]


def _steps_logged(run: Path) -> int:
    tail = MetricsTail(run / "metrics.jsonl")
    tail.poll()
    return tail.steps_done


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_arena_miniature_killed_and_continued(tmp_path):
    """Two arms (on-policy GRPO, IcePop at k = 2), two steps each, one at a time. The arena is killed
    with SIGKILL once the first run finished and the second one's trainer is alive: every process
    goes with it, the second run unfinished. The same command then skips the first run, runs the
    second, estimates the cost from the first, and writes the report."""
    from leftovers import Tree
    from waiting import wait_until

    out = tmp_path / "arena"
    cmd = [sys.executable, "-m", "megatron_m2po.cli", "experiment", "arena", CONFIG, "--out", str(out), *MINI]
    tree = Tree({**os.environ, "OMP_NUM_THREADS": "1"})
    log = tmp_path / "arena.log"
    first, second = out / "grpo_s0", out / "icepop_sk"
    try:
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, cwd=REPO, env=tree.env, stdout=f, stderr=subprocess.STDOUT)

        def second_alive() -> bool:
            procs = tree.observe(proc.pid).values()
            return (first / "experiment_done.json").is_file() and any(f"run_dir={second.resolve()}" in c
                                                                      for c in procs)

        wait_until(second_alive, what="the first run finished and the second run's trainer alive", timeout=300,
                   hopeless=lambda: proc.poll() is not None and
                   f"the arena exited ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        tree.wait_gone("the arena was killed with SIGKILL", timeout=60)
        assert not (second / "experiment_done.json").is_file() and _steps_logged(second) < 2
        first_metrics = (first / "metrics.jsonl").read_bytes()

        p = tree.run(cmd, timeout=400, cwd=REPO)
    finally:
        tree.kill()
    logs = "".join(f"\n--- {d.name}\n" + (d / "train.log").read_text(errors="replace")[-2000:]
                   for d in (first, second) if (d / "train.log").is_file())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:] + logs
    assert "[grpo_s0] finished before: skipped" in p.stderr
    assert (first / "metrics.jsonl").read_bytes() == first_metrics  # not redone
    assert (first / "train.log").read_text().count("\n=== ") == 1
    assert (second / "train.log").read_text().count("\n=== ") == 2 and (second / "experiment_done.json").is_file()
    assert "measured:" in p.stdout and "from 1 run(s) of this arena's runs" in p.stdout  # the estimate
    assert "[all runs] 4/4 steps (100.0%), 2/2 runs finished" in p.stderr  # the progress over all runs
    md = (out / "arena.md").read_text()
    assert "| GRPO s=0 | 0 | 1 |" in md and "| IcePop s=2 | 2 | 1 |" in md
    for stem in ("heldout_acc", "reward", "trust_region"):
        assert (out / "figures" / f"{stem}.png").stat().st_size > 5000
    ledger = TimeLedger.read(out / TIME_FILE)
    assert [e["ended"] for e in ledger] == [False, True] and "| arena runs |" in md
