"""``logging.trace=true`` under torchrun (``scripts/train.sh``, 2 trainer processes on gloo): the
merged ``<run_dir>/trace.json`` holds both ranks' phases, rank 0's driver thread, and the
engines' load counters; each rank left its own file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_m2po.utils.net import free_port
from megatron_m2po.utils.timing import ENGINES_PID

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(600)]


def test_trace_of_a_two_rank_run_has_every_rank(tmp_path):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items()
           if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "MODEL_PATH", "DATA_TRAIN", "ROUTER_ADDR",
                        "RUN_DIR", "TORCHRUN")}
    env.update(PYTHON=sys.executable, GPUS_PER_NODE="2", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    cmd = ["bash", str(ROOT / "scripts" / "train.sh"), str(ROOT / "examples" / "tiny_cpu.yaml"),
           f"trainer.run_dir={run}", "trainer.num_steps=2", "trainer.mode=async", "trainer.prompts_per_step=4",
           "trainer.prompts_per_update=4", "trainer.eval_every_steps=0", "rollout.num_engines=1",
           "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=4", "checkpoint.save_every_steps=0",
           "checkpoint.export_hf_at_end=false", "logging.progress=false", "logging.trace=true"]
    log = tmp_path / "train.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert proc.wait(timeout=500) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert sorted(p.name for p in (run / "trace").iterdir()) == ["rank0.json", "rank1.json"]
    events = json.loads((run / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    for rank in (0, 1):  # every rank trains and takes part in every push
        names = {e["name"] for e in spans if e["pid"] == rank}
        assert {"forward_backward", "optimizer", "push"} <= names, (rank, names)
    assert {e["name"] for e in spans if e["name"] in ("generation", "reward")} == {"generation", "reward"}
    assert {e["pid"] for e in spans if e["name"] == "generation"} == {0}  # the driver lives on rank 0
    counters = {e["name"] for e in events if e["ph"] == "C" and e["pid"] == ENGINES_PID}
    assert counters == {"engine/running_reqs", "engine/queued_reqs", "engine/used_tokens", "engine/inflight_reqs"}
    # the requests in flight, at every change: up while generating (every request counts), 0 at the end
    inflight = [e["args"]["value"] for e in sorted((e for e in events if e["ph"] == "C"), key=lambda e: e["ts"])
                if e["name"] == "engine/inflight_reqs"]
    assert max(inflight) >= 1 and inflight[-1] == 0 and min(inflight) >= 0, inflight[:20]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {0: "rank 0", 1: "rank 1", ENGINES_PID: "engines (/v1/loads)"}
    assert min(e["ts"] for e in spans) >= 0 and "trace written to" in log.read_text()
