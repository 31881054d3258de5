"""Kill the trainer at a named point, run the same command again: it finishes (docs/design.md §5b).

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
import sys
from pathlib import Path

import pytest

import launcher
from megatron_m2po.trainer.schedule import expected_staleness

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group("restart_faults")]

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
    """The same command every time (tests/launcher.py); returns (exit code, this run's log)."""
    env = launcher.base_env()
    env.pop("M2PO_FAULT", None)
    if fault:
        env["M2PO_FAULT"] = fault
    log = run.parent / f"{run.name}.{len(list(run.parent.glob(run.name + '.*.log')))}.log"
    return launcher.run_cli(["train", str(EXAMPLE), f"trainer.run_dir={run}", *COMMON, *MODES[mode]], log=log,
                            env=env, timeout=timeout)


def _lines(run: Path) -> list[str]:
    path = run / "metrics.jsonl"
    return path.read_text(errors="replace").splitlines() if path.is_file() else []


def _new_records(run: Path, before: list[str]) -> list[dict]:
    """The records a run added to metrics.jsonl, whose lines were ``before`` when it started: the
    lines after the longest common prefix (a resumed run first drops the records past its resume
    point, then logs those updates again; a record's "time" makes every line unique)."""
    now = _lines(run)
    n = 0
    while n < min(len(now), len(before)) and now[n] == before[n]:
        n += 1
    out = []
    for line in now[n:]:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # the torn last line of a killed run
    return out


def _steps_logged(run: Path, before: list[str]) -> list[int]:
    """``train/step`` of the step records a run added (``before``: the file's lines when it started)."""
    return [int(r["train/step"]) for r in _new_records(run, before) if "train/step" in r]


def _updates(run: Path, before: list[str] | None = None) -> dict[int, dict]:
    """Per-update metrics of the records a run added (all records when ``before`` is None; later
    records win)."""
    out: dict[int, dict] = {}
    for r in _new_records(run, before or []):
        if any(k.startswith("update/") for k in r):
            out[r["step"]] = {k[len("update/"):]: v for k, v in r.items() if k.startswith("update/")}
    return out


def _raw_update_steps(run: Path) -> list[int]:
    """The "step" of every per-update record in metrics.jsonl as it lies on disk, duplicates kept."""
    return [r["step"] for r in _new_records(run, []) if any(k.startswith("update/") for k in r)]


@pytest.mark.parametrize("mode", list(MODES))
def test_killed_anywhere_the_same_command_finishes(tmp_path, mode):
    for seed in _seeds():
        run = tmp_path / f"{mode}-{seed}"
        second = random.Random(f"{mode}-{seed}").choice(KILLS)
        history, logged = [], []
        for fault in ("step_end@2", "%s@%d" % second, None):
            before = _lines(run)
            rc, log = _run(run, mode, fault)
            history.append((fault, rc))
            logged.append(_updates(run, before))
            if fault and rc == -signal.SIGKILL:
                assert f"m2po fault point {fault}: SIGKILL" in log, log[-3000:]
                continue
            # The run finished: at once (the point lay past its end) or after the kills.
            assert rc == 0, f"{mode} seed {seed}, runs {history}: the same command did not finish:\n{log[-5000:]}"
            break
        assert history[0][1] == -signal.SIGKILL, f"the first run was not killed at step_end@2: {history}"
        # The last run logged each step from its resume point on, once.
        steps = _steps_logged(run, before)
        assert steps == list(range(STEPS - len(steps), STEPS)) and steps, (history, steps)
        # metrics.jsonl holds each update once: the records a killed run logged past the checkpoint
        # the next run resumed from were dropped before it logged those updates again.
        assert _raw_update_steps(run) == list(range(1, STEPS * U + 1)), (history, _raw_update_steps(run))
        _check_store(run, mode)
        assert not list((run / "checkpoints").glob("*.tmp")), "a killed checkpoint write was left behind"
        ups = _updates(run)
        assert sorted(ups) == list(range(1, STEPS * U + 1)), (history, sorted(ups))
        for u, m in ups.items():
            s, j = divmod(u - 1, U)
            if mode == "async":
                assert m["staleness/max"] <= 6
            else:  # the data of every step, before or after a kill, is of exactly its scheduled staleness
                k = 2 if mode == "stale_k" else 0
                assert m["staleness/min"] == m["staleness/max"] == expected_staleness(s, j, U, k), (history, u, m)
        if mode != "async":
            _check_redone_updates(logged, history)


def _check_redone_updates(logged: list[dict[int, dict]], history: list) -> None:
    """An update a killed run logged and a later run redid (past the checkpoint it resumed from) trained
    on the same data from the same weights: the same staleness and trust-region count, the same loss.
    (The trust-region count only off-policy: at an on-policy update its sign test is rounding,
    tests/test_reproducibility.py.) step_end@2 lies before the first checkpoint, so updates are redone."""
    redone = 0
    for i, before in enumerate(logged):
        for after in logged[i + 1:]:
            for u in before.keys() & after.keys():
                redone += 1
                b, a = before[u], after[u]
                assert b["staleness/max"] == a["staleness/max"], (history, u)
                if b["staleness/min"] > 0:
                    assert b["m2po/n_trust"] == a["m2po/n_trust"], (history, u)
                assert b["loss/policy"] == pytest.approx(a["loss/policy"], rel=1e-4, abs=1e-6), (history, u)
    assert redone, f"no update was redone after a kill: {history}"


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


# ----------------------------------------------------------------------------- waits and signals

def _external_groups(prefix: str, n: int) -> list:
    """Scored groups as an external harness would push them (version 0, small token ids)."""
    import numpy as np

    from megatron_m2po.store.types import Group, Trajectory

    rng = np.random.default_rng(0)
    out = []
    for g in range(n):
        gid = f"{prefix}-g{g}"
        trajs = [Trajectory(uid=f"{gid}-{i}", group_id=gid, prompt_ids=rng.integers(10, 60, 6),
                            response_ids=rng.integers(10, 60, 5), behav_logprobs=-rng.random(5).astype(np.float32) - 1,
                            versions=np.zeros(5, np.int64), reward=float(i % 2), loss_mask=np.ones(5, np.uint8),
                            finish_reason="stop") for i in range(4)]
        out.append(Group(gid, trajs))
    return out


def test_sigterm_while_waiting_for_data_checkpoints_the_finished_steps_and_exits(tmp_path):
    """An external-producer run gets one step's groups and then none: it says what it waits for and
    what to do; SIGTERM during that wait writes the checkpoint of the finished step and exits 0
    (before: the handler only set a flag the wait never looked at). A second run with
    ``trainer.wait_timeout_s`` small fails at its deadline with a message naming the wait."""
    from megatron_m2po.store.client import StoreClient
    from megatron_m2po.utils.net import free_port
    from waiting import wait_until

    run, port = tmp_path / "ext", free_port()
    argv = ["train", str(EXAMPLE), f"trainer.run_dir={run}", *COMMON, "trainer.mode=async", "rollout.source=external",
            f"store.serve_port={port}", "trainer.eval_every_steps=0", "checkpoint.save_every_steps=0"]
    env = launcher.base_env(M2PO_STORE_TOKEN="tok")
    env.pop("M2PO_FAULT", None)
    log_path = tmp_path / "ext.log"
    proc = launcher.start(argv, log=log_path, env=env)
    try:
        text = lambda: log_path.read_text(errors="replace")  # noqa: E731
        gone = lambda: proc.poll() is not None and f"the trainer exited ({proc.returncode}):\n{text()[-3000:]}"  # noqa: E731
        wait_until(lambda: "waiting for 4 groups for step 1 " in text(), what="the trainer waiting for step 1",
                   timeout=240, hopeless=gone)
        StoreClient(f"http://127.0.0.1:{port}", "tok").put_groups(_external_groups("x0", PROMPTS))
        wait_until(lambda: "waiting for 4 groups for step 2 " in text(), what="the trainer waiting for step 2",
                   timeout=120, hopeless=gone)
        assert "external producers push to http://" in text()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)  # a deadline on the exit, not a pause
    finally:
        if proc.poll() is None:
            proc.kill_tree()
    log = text()
    assert rc == 0, log[-4000:]
    assert "stopped while waiting for the rollouts of step 2" in log
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000001"
    assert _steps_logged(run, []) == [0]

    # The same command with a short deadline: resumes at step 1 and fails at the deadline, naming the wait.
    rc, err = launcher.run_cli([*argv, "trainer.wait_timeout_s=3"], log=tmp_path / "ext_deadline.log", env=env)
    assert rc != 0
    assert "resumed from" in err and "at step 1" in err, err[-3000:]
    assert "step 1: no 4 servable groups within 3s (trainer.wait_timeout_s)" in err, err[-3000:]
    assert "external producers push to http://" in err and "run the same command again to resume" in err


# ----------------------------------------------------------------------------- engines

def _check_stale_k_updates(run: Path, k: int) -> None:
    ups = _updates(run)
    assert sorted(ups) == list(range(1, STEPS * U + 1)), sorted(ups)
    for u, m in ups.items():
        s, j = divmod(u - 1, U)
        assert m["staleness/min"] == m["staleness/max"] == expected_staleness(s, j, U, k), (u, m)


def test_a_failed_weight_push_is_retried_after_the_dead_engine_is_relaunched(tmp_path):
    """The trainer's own retry (``Trainer._push_weights``): the only engine is SIGKILLed just
    before the second push; the push fails, the engine is relaunched, the push is repeated to it,
    and the run goes on with the schedule's exact staleness."""
    run = tmp_path / "push"
    rc, log = _run(run, "stale_k", "engine_dies@2")
    assert rc == 0, log[-5000:]
    assert "m2po fault point engine_dies@2" in log
    assert "restarted 1 engine(s)" in log and "pushing again to every engine" in log, log[-5000:]
    _check_stale_k_updates(run, 2)
    _check_store(run, "stale_k")


def test_engines_restarted_outside_the_trainer_are_brought_to_its_version(tmp_path):
    """External engines outlive the trainer. An async run dies before its first checkpoint (its
    engines keep the weights it pushed, which the re-run does not have), and one engine is
    restarted by its operator (base weights, version 0). The same command then finds engine 0 off
    the version it pushed last and pushes its own weights to every engine before generating;
    without that the re-run's producer samples with the lost weights, whose tokens carry a version
    ahead of the re-run's and are refused by the store (the run fails)."""
    from megatron_m2po.rollout.launcher import EngineSpec, LocalLauncher
    from megatron_m2po.utils.net import free_port
    from megatron_m2po.standins.tiny_base import ensure_tiny_base
    from waiting import wait_until

    tiny_model_dir = str(ensure_tiny_base(os.path.expanduser("~/.cache/megatron_m2po/tiny_base"), progress=False))
    launcher, handles, urls = LocalLauncher(), {}, []

    def start(i: int, port: int) -> None:
        spec = EngineSpec(i, "127.0.0.1", port, [sys.executable, "-m", "megatron_m2po.standins.cpu_worker",
                                                  "--model-path", tiny_model_dir, "--port", str(port),
                                                  "--weight-version", "0"],
                          {"OMP_NUM_THREADS": "1"}, tmp_path / f"engine_{i}_{len(handles)}.log")
        handles[i] = launcher.launch(spec)
        wait_until(lambda: _healthy(spec.url), what=f"engine {spec.url} healthy", timeout=120,
                   hopeless=lambda: not handles[i].alive() and f"engine {i} exited; see {spec.log_path}")

    try:
        ports = [free_port(), free_port()]
        for i, p in enumerate(ports):
            start(i, p)
            urls.append(f"http://127.0.0.1:{p}")
        extra = ["rollout.launcher=external", f"rollout.external_addrs=[{','.join(urls)}]"]
        run = tmp_path / "ext_engines"
        MODES["async_external"] = ["trainer.mode=async", *extra]
        try:
            rc, log = _run(run, "async_external", "step_end@2")
            assert rc == -signal.SIGKILL, log[-3000:]
            assert {_version(u) for u in urls} != {"0"}  # they kept the lost run's weights
            handles[1].stop()  # the operator restarts engine 1: base weights, version 0
            start(1, ports[1])
            rc, log = _run(run, "async_external", None)
        finally:
            MODES.pop("async_external")
        assert rc == 0, log[-5000:]
        assert "not version 0 pushed last (restarted outside the trainer, or kept from a run that died)" in log
        ups = _updates(run)
        assert sorted(ups) == list(range(1, STEPS * U + 1)) and all(m["staleness/max"] <= 6 for m in ups.values())
        _check_store(run, "async")
    finally:
        for h in handles.values():
            h.stop()


def _healthy(url: str) -> bool:
    try:
        return _version(url) is not None
    except Exception:  # noqa: BLE001 - not listening yet
        return False


def _version(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url + "/model_info", timeout=5) as r:
        return str(json.loads(r.read())["weight_version"])
