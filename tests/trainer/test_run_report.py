"""trainer/run_report.py: what the end of a run prints, and when a re-run has nothing to do."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

from megatron_m2po.config import load_config
from megatron_m2po.trainer.run_report import finished_step, metric_movement, run_summary
from megatron_m2po.utils.logging import MetricsLogger, read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"


def _checkpoint(run: Path, step: int) -> Path:
    """A checkpoint as actor/checkpoint.py leaves it: ``step_N/extra_state.json`` and ``latest``."""
    ck = run / "checkpoints" / f"step_{step:06d}"
    ck.mkdir(parents=True)
    (ck / "extra_state.json").write_text(json.dumps({"step": step}))
    (run / "checkpoints" / "latest").write_text(ck.name + "\n")
    return ck


def test_a_run_is_finished_at_its_last_checkpoint_with_its_final_weights_exported_after_it(tmp_path):
    run = tmp_path / "run"

    def cfg(*o: str):
        return load_config(EXAMPLE, [f"trainer.run_dir={run}", "trainer.num_steps=3", *o])

    assert finished_step(cfg()) is None  # nothing there yet
    ck = _checkpoint(run, 3)
    assert finished_step(cfg()) is None  # killed between the last checkpoint and the export
    assert finished_step(cfg("checkpoint.export_hf_at_end=false")) == 3
    final = run / "final_hf"
    final.mkdir()
    (final / "config.json").write_text("{}")
    assert finished_step(cfg()) == 3
    assert finished_step(cfg("trainer.num_steps=4")) is None  # raised: trains on
    assert finished_step(cfg("trainer.num_steps=2")) == 3
    assert finished_step(cfg("checkpoint.resume=false")) is None  # starts over, as asked
    # An export older than the checkpoint is of an earlier finish (num_steps raised, killed before the export).
    t = final.stat().st_mtime
    os.utime(ck, (t + 10, t + 10))
    assert finished_step(cfg()) is None


def _log_run(run: Path, steps: int = 8, U: int = 2) -> None:
    """metrics.jsonl as the trainer writes it: per-update records, then the step's at step=version."""
    with MetricsLogger(run, tensorboard=False) as ml:
        for s in range(steps):
            for j in range(U):
                ml.log({"update/loss/policy": 0.1}, step=s * U + j + 1)
            m = {"train/step": float(s), "rollout/reward_mean": 0.3 + 0.02 * s, "rollout/acc": 0.2 + 0.02 * s}
            if (s + 1) % 4 == 0:
                m["eval/synthetic/acc"] = 0.25 + 0.01 * s
            ml.log(m, step=(s + 1) * U)


def test_movement_of_reward_and_accuracy_from_the_first_to_the_last_steps(tmp_path):
    _log_run(tmp_path)
    line = metric_movement(read_metrics(tmp_path))
    # 8 steps: the mean of 2 steps at each end
    assert line == ("reward 0.310 -> 0.430, acc 0.210 -> 0.330 (training rollouts, mean of steps 1-2 vs 7-8); "
                    "held-out eval/synthetic/acc 0.280 (step 4) -> 0.320 (step 8)")
    assert metric_movement([]) == ""
    # the evaluation before training (trainer.eval_at_start) is the held-out curve's start: step 0
    recs = [{"step": 0, "eval/at_step": 0, "eval/synthetic/acc": 0.25}] + \
        [{"step": 4 * (s + 1), "train/step": s, "rollout/reward_mean": 0.3, **({"eval/synthetic/acc": 0.3}
                                                                             if s == 3 else {})} for s in range(4)]
    assert "held-out eval/synthetic/acc 0.250 (step 0) -> 0.300 (step 4)" in metric_movement(recs)


def test_the_summary_names_every_output_and_its_plot_command_draws_the_plots(tmp_path):
    run = tmp_path / "run"
    _log_run(run)
    (run / "trace.json").write_text('{"traceEvents": []}')
    (run / "final_hf").mkdir()
    text = run_summary(run, trace=run / "trace.json", final_hf=run / "final_hf")
    lines = {ln.split(":", 1)[0].strip(): ln.split(":", 1)[1].strip() for ln in text.splitlines()}
    assert list(lines) == ["moved", "metrics", "plots", "trace", "weights"], text
    assert lines["metrics"] == str(run / "metrics.jsonl")
    assert lines["moved"].startswith("reward 0.310 -> 0.430")
    assert str(run / "trace.json") in lines["trace"] and "plot_trace.py" in lines["trace"]
    assert lines["weights"].startswith(str(run / "final_hf"))
    # the exact command: run as printed, it draws the run's plots where it says
    cmd = shlex.split(lines["plots"])
    assert cmd[1].endswith("tools/plot_metrics.py") and cmd[-2:] == ["--out", str(run / "plots")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert (run / "plots" / "overview.png").is_file() and (run / "plots" / "reward.png").is_file()
    # without a trace or exported weights: not named
    assert [ln.split(":")[0].strip() for ln in run_summary(run).splitlines()] == ["moved", "metrics", "plots"]
    # a LoRA run exports its adapter next to final_hf: named too
    (run / "final_adapter").mkdir()
    adapter = [ln for ln in run_summary(run, final_hf=run / "final_hf").splitlines() if ln.strip().startswith("adapter:")]
    assert len(adapter) == 1 and str(run / "final_adapter") in adapter[0] and "PeftModel" in adapter[0]
