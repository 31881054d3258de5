"""Engines the trainer starts itself get an explicit environment, not the trainer's.

Under torchrun every trainer process carries ``TORCHELASTIC_USE_AGENT_STORE=True``, ``RANK``,
``MASTER_PORT``, ... and, from ``scripts/train.sh``, ``CUDA_DEVICE_MAX_CONNECTIONS`` and
``TORCH_NCCL_*``. An SGLang engine initialises its own torch.distributed over
``tcp://<host>:<nccl_port>`` at start-up; with the agent-store variable torch makes it a client of a
store nobody hosts and the engine never comes up. The CPU worker does the same init
(``cpu_worker.init_torch_distributed``), so it hangs the same way when it inherits that environment.
"""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from megatron_m2po.rollout.client import SGLangClient
from megatron_m2po.rollout.launcher import (DROPPED_ENV_PREFIXES, DROPPED_ENV_VARS, EngineSpec, LocalLauncher,
                                            engine_env)
from megatron_m2po.utils.net import free_port
from waiting import wait_until

# What torchrun (torch/distributed/elastic/agent/server/api.py, local_elastic_agent.py) sets in each
# worker, plus scripts/train.sh's trainer-only variables.
TORCHRUN_ENV = {
    "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_ERROR_FILE": "/tmp/none.json", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "0", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": "0,1",
}


def _healthy(url: str) -> bool:
    async def go():
        async with SGLangClient(url, max_retries=0) as c:
            return await c.health(2.0)
    return asyncio.run(go())


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
    return {k.decode(): v.decode(errors="replace") for k, v in items}


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_cpu_worker_started_under_a_torchrun_environment_comes_up(tiny_model_dir, tmp_path, monkeypatch):
    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # a port nobody listens on, as an agent store elsewhere
    port = free_port()
    cmd = [sys.executable, "-m", "megatron_m2po.standins.cpu_worker",
           "--model-path", tiny_model_dir, "--host", "127.0.0.1", "--port", str(port), "--weight-version", "0"]
    spec = EngineSpec(0, "127.0.0.1", port, cmd, {"OMP_NUM_THREADS": "1"}, tmp_path / "engine_0.log")
    handle = LocalLauncher().launch(spec)
    try:
        log = spec.log_path

        def exited():
            return None if handle.alive() else f"it exited; log:\n{log.read_text(errors='replace')[-3000:]}"
        # A healthy worker answers in a few seconds; the bound only limits how long a hang takes to fail.
        try:
            wait_until(lambda: _healthy(spec.url), timeout=60, hopeless=exited,
                       what="a CPU worker launched from a torchrun worker's environment answering /health "
                            "(it hangs in torch.distributed's tcp:// rendezvous when it inherits "
                            "TORCHELASTIC_USE_AGENT_STORE=True)")
        except AssertionError as e:
            raise AssertionError(f"{e}; worker log:\n{log.read_text(errors='replace')[-2000:]}") from None
        env = _environ(handle.proc.pid)
        leaked = sorted(k for k in env if k not in spec.env
                        and (k in DROPPED_ENV_VARS or k.startswith(DROPPED_ENV_PREFIXES)))
        assert leaked == [], f"the engine inherited the launcher's {leaked}"
        assert env["OMP_NUM_THREADS"] == "1"  # the spec's own settings win
        assert "init torch.distributed: backend=gloo" in log.read_text()
    finally:
        handle.stop()


def test_engine_env_drops_launcher_variables_and_keeps_the_rest(caplog):
    base = {**TORCHRUN_ENV, "PATH": "/usr/bin", "HOME": "/root", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5",
            "GLOO_SOCKET_IFNAME": "eth0", "SGLANG_PYTHON": "/opt/sglang/bin/python", "HF_HOME": "/hf",
            "TORCH_NCCL_BLOCKING_WAIT": "1", "NCCL_ASYNC_ERROR_HANDLING": "1", "M2PO_WEIGHT_SYNC_ADDR": "10.0.0.1"}
    with caplog.at_level(logging.DEBUG, logger="m2po.launcher"):
        env = engine_env({"CUDA_VISIBLE_DEVICES": "4", "OMP_NUM_THREADS": "1"}, base=base)
    for k in TORCHRUN_ENV:
        if k not in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"):
            assert k not in env, k
    assert "TORCH_NCCL_BLOCKING_WAIT" not in env and "NCCL_ASYNC_ERROR_HANDLING" not in env
    # The spec's own values; the network / cache settings of the node pass through.
    assert env["CUDA_VISIBLE_DEVICES"] == "4" and env["OMP_NUM_THREADS"] == "1"
    for k in ("PATH", "HOME", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "GLOO_SOCKET_IFNAME", "SGLANG_PYTHON", "HF_HOME",
              "M2PO_WEIGHT_SYNC_ADDR"):
        assert env[k] == base[k], k
    # No GPU list in the spec: the trainer's CUDA_VISIBLE_DEVICES is not passed on (placement decides).
    assert "CUDA_VISIBLE_DEVICES" not in engine_env({}, base=base)
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "TORCHELASTIC_USE_AGENT_STORE" in msg and "CUDA_DEVICE_MAX_CONNECTIONS" in msg


@pytest.mark.parametrize("keep", [["CUDA_VISIBLE_DEVICES"], []])
def test_engine_env_keeps_what_the_caller_keeps(keep):
    base = {"CUDA_VISIBLE_DEVICES": "3", "RANK": "1"}
    env = engine_env({}, base=base, keep=keep)
    assert ("CUDA_VISIBLE_DEVICES" in env) == bool(keep) and "RANK" not in env
