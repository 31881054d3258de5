"""``m2po train`` under torchrun (``scripts/train.sh``, 2 processes on gloo) starts its CPU workers
and router with none of the launcher's variables: read from ``/proc/<pid>/environ`` of the engine
processes while the run is live, then the one-step run finishes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_m2po.rollout.launcher import DROPPED_ENV_PREFIXES, DROPPED_ENV_VARS
from megatron_m2po.utils.net import free_port
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(d.name))
    return out


def _tree(root: int) -> list[int]:
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def _find(root: int, module: str) -> list[int]:
    return [p for p in _tree(root) if module in _cmdline(p)]


@pytest.mark.slow  # m2po train under torchrun, end to end
@pytest.mark.timeout(600)
def test_engines_started_under_torchrun_inherit_none_of_its_environment(tmp_path):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items()
           if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "MODEL_PATH", "DATA_TRAIN", "ROUTER_ADDR",
                        "RUN_DIR", "TORCHRUN")}
    env.update(PYTHON=sys.executable, GPUS_PER_NODE="2", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    cmd = ["bash", str(ROOT / "scripts" / "train.sh"), str(ROOT / "examples" / "tiny_cpu.yaml"),
           f"trainer.run_dir={run}", "trainer.num_steps=1", "trainer.mode=sync", "trainer.prompts_per_step=4",
           "trainer.prompts_per_update=4", "trainer.eval_every_steps=0", "rollout.num_engines=1",
           "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=4", "checkpoint.save_every_steps=0",
           "checkpoint.export_hf_at_end=false", "logging.progress=false"]
    log = tmp_path / "train.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def ended():
            return None if proc.poll() is None else f"the run exited with {proc.poll()}:\n{log.read_text()[-3000:]}"

        def check(pids: list[int], own: tuple[str, ...] = ()) -> None:
            for pid in pids:
                leaked = sorted(k for k in _environ(pid) if k not in own
                                and (k in DROPPED_ENV_VARS or k.startswith(DROPPED_ENV_PREFIXES)))
                assert leaked == [], f"{' '.join(_cmdline(pid)[:4])} inherited {leaked} from the trainer"

        workers = wait_until(lambda: _find(proc.pid, "megatron_m2po.standins.cpu_worker"), hopeless=ended,
                             what="a CPU worker started by trainer rank 0", timeout=240)
        ranks = [p for p in _tree(proc.pid) if "megatron_m2po.cli" in _cmdline(p)
                 and "RANK" in _environ(p) and p not in workers]
        assert ranks, "no torchrun worker found"
        assert _environ(ranks[0])["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # what the engines must not see
        assert _environ(ranks[0])["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
        check(workers, own=("OMP_NUM_THREADS",))  # the worker's own setting (rollout/engines.py)
        routers = wait_until(lambda: _find(proc.pid, "sglang_router.launch_router"), hopeless=ended,
                             what="the sglang-router started by trainer rank 0", timeout=240)
        check(routers)
        assert proc.wait(timeout=420) == 0, log.read_text()[-4000:]
        assert "step 1/1" in log.read_text() or (run / "metrics.jsonl").is_file()
    finally:
        if proc.poll() is None:
            for pid in _tree(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
