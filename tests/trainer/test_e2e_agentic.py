"""End to end: `m2po train examples/agentic_tools.yaml` for a few steps (rollout.producer=agentic with
the sandboxed calculator and the tiny tool base, model.tiny_family=qwen2_tools, built on first use),
then the stored episodes are read back from the run's SQLite store: observation tokens masked, a
version per token, and the tool called by the model's own choice (some episodes, not all)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

import launcher
from megatron_m2po.store import sqlite as store_sqlite

ROOT = Path(__file__).resolve().parents[2]

# A cold cache builds the tool base first (shared with test_tiny_tools.py: one group, one build).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("tool_base")]


def test_tool_episodes_train_and_are_stored_as_masked_versioned_trajectories(tmp_path):
    run = tmp_path / "agentic"
    steps = 2
    launcher.train(run, f"trainer.num_steps={steps}", "trainer.prompts_per_step=4", "trainer.prompts_per_update=2",
                   "rollout.n_samples_per_prompt=4", "rollout.num_engines=1", "logging.progress=false",
                   "checkpoint.export_hf_at_end=false", "checkpoint.save_every_steps=100",
                   config=ROOT / "examples" / "agentic_tools.yaml", timeout=540)

    conn = store_sqlite.connect(str(run / "rollouts.sqlite"))
    seqs = [r[0] for r in conn.execute("SELECT seq FROM groups ORDER BY seq")]
    groups = store_sqlite.load_groups(conn, seqs)
    assert len(groups) == steps * 4 and all(len(g.trajectories) == 4 for g in groups)
    tok = AutoTokenizer.from_pretrained(str(_tool_base_dir()))
    trajs = [t for g in groups for t in g.trajectories]
    called, solved_with_tool = 0, 0
    for t in trajs:
        t.validate()
        ep = t.metadata["episode"]
        calls = sum(s.get("tool_calls", 0) for s in ep["steps"])
        zero = np.flatnonzero(t.loss_mask == 0)
        if calls:  # the model chose to call: the tool's answer came back as a masked observation
            called += 1
            assert zero.size and (t.behav_logprobs[zero] == 0).all()
            obs = tok.decode(t.response_ids[zero])
            assert obs == "".join(f"[{s['tool_out']}]=" for s in ep["steps"] if s.get("tool_calls")), (obs, ep)
            problem = tok.decode(t.prompt_ids).split(";", 1)[1].rstrip("=")
            if "*" in problem and min(int(x) for x in problem.split("*")) >= 2 and t.reward == 1.0:
                solved_with_tool += 1  # a product the model cannot compute itself, answered from the tool
        else:  # answered directly: every response token is the model's
            assert zero.size == 0 and ep["turns"] == 1, ep
        assert t.reward in (0.0, 1.0) and ep["end"] in ("done", "max_turns"), (t.reward, ep)
        # Versions: one per token, non-decreasing; the model's tokens carry the generation version.
        gen = int(t.metadata["generated_at"])
        assert t.versions.shape == t.response_ids.shape and (t.versions[t.loss_mask == 1] == gen).all()
    # The model decides: some episodes call the tool (the products), the others answer directly.
    assert 0 < called < len(trajs), (called, len(trajs))
    assert solved_with_tool > 0, "no product was answered right through the tool"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    ep_metrics = [r for r in records if "rollout/episode_turns" in r]
    assert len(ep_metrics) == steps and all(r["rollout/episode_end/step_timeout"] == 0 for r in ep_metrics)
    assert all(r["rollout/episode_end/env_error"] == 0 for r in ep_metrics)


def _tool_base_dir() -> Path:
    from megatron_m2po.standins.tiny_base import TinyBaseSpec, TinyModelSpec, tiny_base_path
    return tiny_base_path(os.path.expanduser("~/.cache/megatron_m2po/tiny_base"),
                          TinyBaseSpec(model=TinyModelSpec(family="qwen2_tools")))
