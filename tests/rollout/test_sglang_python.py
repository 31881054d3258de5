"""Local engines start with SGLang's own python (``$SGLANG_PYTHON``, as the image sets), not the
trainer's; CPU workers (this package) keep the trainer's. The Ray launcher runs the same command
(tests/rollout/test_ray_launcher.py::test_ray_engine_starts_with_sglang_python)."""

from __future__ import annotations

import sys

import pytest

from megatron_m2po.config import RolloutConfig
from megatron_m2po.rollout.engines import EngineFleet, FleetError
from rollout_testlib import sglang_python_standin


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_local_sglang_engine_runs_under_sglang_python(tiny_model_dir, tmp_path, monkeypatch):
    standin = sglang_python_standin(tmp_path)
    monkeypatch.setenv("SGLANG_PYTHON", standin)
    cfg = RolloutConfig(engine="sglang", launcher="local", num_engines=1, base_port=0, use_router=False)
    fleet = EngineFleet(cfg, tiny_model_dir, run_dir=str(tmp_path / "run"), startup_timeout_s=120)
    try:
        fleet.start()  # healthy and version-checked: it really started through the stand-in
        log = (tmp_path / "run" / "engines" / "engine_0.log").read_text()
    finally:
        fleet.stop()
    assert f"=== launch {standin} -m sglang.launch_server --model-path {tiny_model_dir}" in log
    assert "sglang-python called with: -m sglang.launch_server" in log


def test_cpu_worker_keeps_the_trainer_python(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_PYTHON", sglang_python_standin(tmp_path))
    cfg = RolloutConfig(engine="cpu_worker", num_engines=1)
    spec = EngineFleet(cfg, tiny_model_dir, run_dir=str(tmp_path))._spec(0, 1234)
    assert spec.cmd[:3] == [sys.executable, "-m", "megatron_m2po.standins.cpu_worker"]


def test_unset_sglang_python_is_the_trainer_python_and_a_bad_one_is_named(tiny_model_dir, tmp_path, monkeypatch):
    cfg = RolloutConfig(engine="sglang", num_engines=1)
    monkeypatch.delenv("SGLANG_PYTHON", raising=False)
    assert EngineFleet(cfg, tiny_model_dir, run_dir=str(tmp_path))._spec(0, 1234).cmd[0] == sys.executable
    monkeypatch.setenv("SGLANG_PYTHON", str(tmp_path / "no" / "python"))
    with pytest.raises(FleetError, match=r"SGLANG_PYTHON=.*/no/python is not an executable file"):
        EngineFleet(cfg, tiny_model_dir, run_dir=str(tmp_path)).start()
