"""End-to-end tiny runs of `m2po train` with ``rollout.filter=zero_variance`` (dynamic sampling) on
CPU, in each run mode: every trained group has rewards that differ, every step is full, the
groups dropped for equal rewards never reach the store and are counted in
``rollout/filtered_groups``; stale-k keeps its exact staleness schedule, and a run killed and
resumed regenerates its groups identically. A recording producer (``dapo_recorder.py``) logs
every group made, before the filter, so the checks do not trust the trainer's own counts."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
from pathlib import Path

import pytest

from megatron_m2po.trainer.schedule import expected_staleness
from test_e2e_tiny import _last_update, _records, _train, _updates
from waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HERE = Path(__file__).resolve().parent
FILTER = ["rollout.filter=zero_variance", "rollout.producer=dapo_recorder:recording_producer"]
N = 8  # prompts per step (test_e2e_tiny.SHORT)


@pytest.fixture
def record(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "groups.jsonl"
    monkeypatch.setenv("M2PO_TEST_DAPO_RECORD", str(path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    return path


def _made(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines() if line.strip()]


def _flat(g: dict) -> bool:
    return len(set(g["rewards"])) == 1


def _served(run: Path) -> list[tuple[int, str]]:
    con = sqlite3.connect(run / "rollouts.sqlite")
    return con.execute("SELECT l.step, g.group_id FROM lease_groups lg JOIN leases l ON l.lease_id=lg.lease_id "
                       "JOIN groups g ON g.seq=lg.group_seq WHERE l.state='acked' AND lg.role='served'").fetchall()


def _check_filtered_run(run: Path, made: list[dict], steps: int) -> None:
    by_id = {g["gid"]: g for g in made}
    served = _served(run)
    # Every step full, every trained group informative.
    assert sorted({s for s, _ in served}) == list(range(steps))
    assert all(sum(1 for s2, _ in served if s2 == s) == N for s in range(steps)), served
    assert not [gid for _, gid in served if _flat(by_id[gid])]
    # Groups with equal rewards never reached the store.
    stored = {r[0] for r in sqlite3.connect(run / "rollouts.sqlite").execute("SELECT group_id FROM groups")}
    flat = {g["gid"] for g in made if _flat(g)}
    assert flat, "the tiny task made no group with equal rewards: nothing was filtered"
    assert not (stored & flat)


@pytest.mark.parametrize("mode", ["sync", "stale_k", "async"])
def test_filtered_runs_train_full_steps_of_informative_groups(tmp_path, record, mode):
    run, steps = tmp_path / mode, 3
    extra = {"sync": ["trainer.mode=sync"], "stale_k": ["trainer.stale_k=3"],
             "async": ["trainer.mode=async", "store.max_staleness=4"]}[mode]
    _train(run, f"trainer.num_steps={steps}", "checkpoint.save_every_steps=0", *FILTER, *extra)
    made = _made(record)
    _check_filtered_run(run, made, steps)
    logged = [r for r in _records(run) if "rollout/filtered_groups" in r]
    assert len(logged) == steps
    dropped = sum(r["rollout/filtered_groups"] for r in logged)
    flat = sum(1 for g in made if _flat(g))
    if mode == "async":
        # Generation goes on while the trainer logs its last step: counted drops are a prefix.
        assert 0 < dropped <= flat
    else:
        # Every step's generation ends before its lease: the counter saw every drop.
        assert dropped == flat
        assert sum(r["rollout/generated_groups"] for r in logged) == len(made)
        assert len(made) == steps * N + flat + sum(r["rollout/surplus_groups"] for r in logged)
    if mode == "stale_k":
        ups = _updates(run)
        for s in range(steps):
            for j in range(2):
                m = ups[s * 2 + j + 1]
                assert m["staleness/min"] == m["staleness/max"] == expected_staleness(s, j, 2, 3), (s, j, m)


def test_filtered_stale_k_run_killed_and_resumed_regenerates_identically(tmp_path, record):
    run, steps = tmp_path / "resume", 5
    args = (f"trainer.num_steps={steps}", "trainer.stale_k=2", "checkpoint.save_every_steps=2", *FILTER)
    proc = _train(run, *args, wait=False)
    latest = run / "checkpoints" / "latest"
    try:
        # Kill after the step-2 checkpoint, once step 3 (updates 5-6) has trained.
        wait_until(lambda: latest.is_file() and latest.read_text().strip() == "step_000002"
                   and _last_update(run) >= 5,
                   what="update 5 after the step-2 checkpoint", timeout=400,
                   hopeless=lambda: proc.poll() is not None and f"the run exited ({proc.returncode}) first")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    before, n_before = _updates(run), len(_made(record))
    _train(run, *args)
    made = _made(record)
    assert len(made) > n_before, "the resumed run generated nothing"
    _check_filtered_run(run, made, steps)
    # Each step consumed exactly its own groups, once.
    served = _served(run)
    assert len(served) == len({gid for _, gid in served}) == steps * N
    assert all(gid.startswith(f"s{step:06d}-") for step, gid in served)
    # A group made both before the kill and after the resume is the same prompt with the same rewards.
    first: dict[str, dict] = {}
    again = 0
    for g in made:
        if g["gid"] in first:
            again += 1
            assert (g["prompt"], g["rewards"]) == (first[g["gid"]]["prompt"], first[g["gid"]]["rewards"]), g["gid"]
        first.setdefault(g["gid"], g)
    # Exact staleness survives the resume; redone updates trained on the same data.
    after = _updates(run)
    for s in range(steps):
        for j in range(2):
            m = after[s * 2 + j + 1]
            assert m["staleness/min"] == m["staleness/max"] == expected_staleness(s, j, 2, 2), (s, j)
    for u in (u for u in before if u > 4):
        assert before[u]["m2po/n_trust"] == after[u]["m2po/n_trust"], u
        assert before[u]["loss/policy"] == pytest.approx(after[u]["loss/policy"], rel=1e-4, abs=1e-6)
