"""End to end: `m2po train examples/agentic_tools.yaml` for a few steps (rollout.producer=agentic with
the sandboxed calculator), then the stored episodes are read back from the run's SQLite store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_m2po.store import sqlite as store_sqlite

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_tool_episodes_train_and_are_stored_as_masked_versioned_trajectories(tmp_path):
    run = tmp_path / "agentic"
    steps = 2
    cmd = [sys.executable, "-m", "megatron_m2po.cli", "train", str(ROOT / "examples" / "agentic_tools.yaml"),
           f"trainer.run_dir={run}", f"trainer.num_steps={steps}", "trainer.prompts_per_step=4",
           "trainer.prompts_per_update=2", "rollout.n_samples_per_prompt=4", "rollout.num_engines=1",
           "logging.progress=false", "checkpoint.export_hf_at_end=false", "checkpoint.save_every_steps=100"]
    log = tmp_path / "train.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        try:
            rc = proc.wait(timeout=360)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 0, log.read_text(errors="replace")[-4000:]

    conn = store_sqlite.connect(str(run / "rollouts.sqlite"))
    seqs = [r[0] for r in conn.execute("SELECT seq FROM groups ORDER BY seq")]
    groups = store_sqlite.load_groups(conn, seqs)
    assert len(groups) == steps * 4 and all(len(g.trajectories) == 4 for g in groups)
    trajs = [t for g in groups for t in g.trajectories]
    multi = 0
    for t in trajs:
        t.validate()
        ep = t.metadata["episode"]
        # The tool ran on every turn the model took, and its verdict is the reward.
        assert len(ep["steps"]) == ep["turns"] >= 1 and all(s["tool_calls"] == 1 for s in ep["steps"]), ep
        assert t.reward == (1.0 if ep["end"] == "done" else 0.0), (t.reward, ep)
        zero = np.flatnonzero(t.loss_mask == 0)
        if ep["turns"] > 1:  # observations between turns are masked and carry no log-prob
            multi += 1
            assert zero.size and (t.behav_logprobs[zero] == 0).all()
        else:
            assert zero.size == 0
        # Versions: one per token, non-decreasing; the model's tokens carry the generation version.
        gen = int(t.metadata["generated_at"])
        assert t.versions.shape == t.response_ids.shape and (t.versions[t.loss_mask == 1] == gen).all()
    assert multi > 0, "no episode took a second turn: the observation path was not exercised"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    ep_metrics = [r for r in records if "rollout/episode_turns" in r]
    assert len(ep_metrics) == steps and all(r["rollout/episode_end/step_timeout"] == 0 for r in ep_metrics)
