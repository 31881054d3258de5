"""Kill the trainer at a named point, run the same command again: it finishes (docs/design.md §5, "Restarts").

For each mode the run is killed twice and then run to the end, always with the same command:

1. after step 2 is logged and before any checkpoint exists (``step_end@2``; the first
   ``checkpoint.save_every_steps`` steps of every run are like this), then
2. at a point drawn by a seeded generator from :data:`KILLS` (the points of death the restart
   rule names), then
3. with no fault.

The trainer kills its own process group at the point (``M2PO_FAULT``, :mod:`megatron_m2po.utils.faults`):
the test waits on the process exiting, never on a time. Then it checks that the run finished, that
the last run logged each step from its resume point once, that each step consumed exactly one
lease and no group was consumed twice, and that the store's counts add up: every group stored is
consumed, retired or available (none left leased, pending or quarantined). More seeds:
``M2PO_FAULT_SEEDS=0-9 pytest tests/trainer/test_restart_faults.py``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_m2po.trainer.schedule import expected_staleness

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, PROMPTS, U = 4, 4, 2
COMMON = [f"trainer.num_steps={STEPS}", f"trainer.prompts_per_step={PROMPTS}", f"trainer.prompts_per_update={PROMPTS // U}",
          "rollout.num_engines=1", "rollout.n_samples_per_prompt=4", "logging.progress=false",
          "checkpoint.export_hf_at_end=false", "checkpoint.save_every_steps=3", "trainer.eval_every_steps=2",
          "data.synthetic_eval_size=8", "store.max_staleness=6"]
MODES = {"sync": ["trainer.mode=sync"],
         "stale_k": ["trainer.mode=stale_k", "trainer.stale_k=2"],
         "async": ["trainer.mode=async"]}
# (point, n-th time this process reaches it): every point of death of the restart rule, each
# reached in every mode by a run of STEPS steps.
KILLS = [("step_end", 1), ("step_end", 3), ("checkpoint_write", 1), ("weight_push", 2), ("store_commit", 2),
         ("train_update", 3), ("evaluation", 1)]


def _seeds() -> list[int]:
    spec = os.environ.get("M2PO_FAULT_SEEDS", "0")
    lo, _, hi = spec.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def _run(run: Path, mode: str, fault: str | None, timeout: float = 300) -> tuple[int, str]:
    """The same command every time; returns (exit code, this run's log)."""
    cmd = [sys.executable, "-m", "megatron_m2po.cli", "train", str(EXAMPLE), f"trainer.run_dir={run}",
           *COMMON, *MODES[mode]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("M2PO_FAULT", None)
    if fault:
        env["M2PO_FAULT"] = fault
    log = run.parent / f"{run.name}.{len(list(run.parent.glob(run.name + '.*.log')))}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return rc, log.read_text(errors="replace")


def _steps_logged(run: Path, offset: int) -> list[int]:
    """``train/step`` of the step records appended after byte ``offset`` of metrics.jsonl."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    data = path.read_bytes()[offset:].decode(errors="replace")
    out = []
    for line in data.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue  # the torn last line of a killed run
        if "train/step" in r:
            out.append(int(r["train/step"]))
    return out


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def _updates(run: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if any(k.startswith("update/") for k in r):
            out[r["step"]] = {k[len("update/"):]: v for k, v in r.items() if k.startswith("update/")}
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_killed_anywhere_the_same_command_finishes(tmp_path, mode):
    for seed in _seeds():
        run = tmp_path / f"{mode}-{seed}"
        second = random.Random(f"{mode}-{seed}").choice(KILLS)
        history = []
        for fault in ("step_end@2", "%s@%d" % second, None):
            offset = _size(run / "metrics.jsonl")
            rc, log = _run(run, mode, fault)
            history.append((fault, rc))
            if fault and rc == -signal.SIGKILL:
                assert f"m2po fault point {fault}: SIGKILL" in log, log[-3000:]
                continue
            # The run finished: at once (the point lay past its end) or after the kills.
            assert rc == 0, f"{mode} seed {seed}, runs {history}: the same command did not finish:\n{log[-5000:]}"
            break
        assert history[0][1] == -signal.SIGKILL, f"the first run was not killed at step_end@2: {history}"
        # The last run logged each step from its resume point on, once.
        steps = _steps_logged(run, offset)
        assert steps == list(range(STEPS - len(steps), STEPS)) and steps, (history, steps)
        _check_store(run, mode)
        ups = _updates(run)
        assert sorted(ups) == list(range(1, STEPS * U + 1)), (history, sorted(ups))
        for u, m in ups.items():
            s, j = divmod(u - 1, U)
            if mode == "async":
                assert m["staleness/max"] <= 6
            else:  # the data of every step, before or after a kill, is of exactly its scheduled staleness
                k = 2 if mode == "stale_k" else 0
                assert m["staleness/min"] == m["staleness/max"] == expected_staleness(s, j, U, k), (history, u, m)


def _check_store(run: Path, mode: str) -> None:
    con = sqlite3.connect(run / "rollouts.sqlite")
    try:
        states = dict(con.execute("SELECT state, COUNT(*) FROM groups GROUP BY state").fetchall())
        (stored,) = con.execute("SELECT COUNT(*) FROM groups").fetchone()
        consumed, retired, available = (states.get(k, 0) for k in ("consumed", "retired", "available"))
        assert stored == consumed + retired + available, states
        assert consumed == STEPS * PROMPTS, states
        if mode != "async":
            assert retired == 0 and available == 0, states
        # One acknowledged lease per step; no group in two of them.
        leases = con.execute("SELECT step, COUNT(*) FROM leases WHERE state='acked' GROUP BY step").fetchall()
        assert leases == [(s, 1) for s in range(STEPS)], leases
        served = con.execute("SELECT l.step, g.group_id FROM lease_groups lg JOIN leases l ON l.lease_id=lg.lease_id "
                             "JOIN groups g ON g.seq=lg.group_seq WHERE l.state='acked' AND lg.role='served'").fetchall()
        assert len(served) == len({gid for _, gid in served}) == STEPS * PROMPTS
        if mode != "async":
            assert all(gid.startswith(f"s{step:06d}-") for step, gid in served)
    finally:
        con.close()
