"""MetricsLogger (JSONL + TensorBoard + W&B gate), read_metrics, TrainProgress, setup_logging."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import sys

import numpy as np
import pytest
import torch

from megatron_m2po.utils.logging import (MetricsLogger, TrainProgress, format_progress,
                                         read_metrics, setup_logging)


def _tb_events(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_jsonl_records_values_and_resume_append(tmp_path):
    run = tmp_path / "run"
    with MetricsLogger(run, config_dict={"algo": {"loss": "m2po", "tau": 0.04}}) as ml:
        ml.log({"rollout/reward_mean": np.float32(0.25), "policy/kl_k3": torch.tensor(1e-3),
                "bad": float("nan"), "flag": True, "staleness/hist": np.array([0, 3, 5]),
                "note": "warm"}, step=1)
        ml.log({"rollout/reward_mean": 0.5}, step=2)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])  # strict JSON: NaN became null
    assert first["step"] == 1 and first["rollout/reward_mean"] == pytest.approx(0.25)
    assert first["policy/kl_k3"] == pytest.approx(1e-3) and first["bad"] is None
    assert first["flag"] == 1 and first["staleness/hist"] == [0, 3, 5] and first["note"] == "warm"
    assert isinstance(first["time"], float)
    assert json.loads((run / "config.json").read_text())["algo"]["tau"] == 0.04

    # Resume: append, and a step logged again after a crash keeps the later record.
    with MetricsLogger(run, config_dict={"algo": {"loss": "m2po", "tau": 0.04}}) as ml:
        ml.log({"rollout/reward_mean": 0.75}, step=2)
        ml.log({"rollout/reward_mean": 1.0}, step=3)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rollout/rew')  # torn last line of a killed run
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 5
    recs = read_metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert [r["rollout/reward_mean"] for r in recs] == pytest.approx([0.25, 0.75, 1.0])

    # Different metric sets at one step (per-update and per-step records) merge.
    with MetricsLogger(run, tensorboard=False) as ml:
        ml.log({"update/loss": 0.5}, step=3)
    recs = read_metrics(run / "metrics.jsonl")
    assert recs[-1]["update/loss"] == 0.5 and recs[-1]["rollout/reward_mean"] == 1.0


def test_tensorboard_scalars_and_histograms(tmp_path):
    run = tmp_path / "run"
    with MetricsLogger(run) as ml:
        for step in (1, 2):
            ml.log({"m2po/mask_frac": 0.1 * step, "skip_me": float("inf"),
                    "staleness/hist": [0, 2, 0, 6], "policy/ratio_samples": [0.9, 1.0, 1.1]},
                   step=step)
    acc = _tb_events(run)
    tags = acc.Tags()
    assert "skip_me" not in tags["scalars"]
    vals = [(e.step, e.value) for e in acc.Scalars("m2po/mask_frac")]
    assert vals == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2))]
    assert {"staleness/hist", "policy/ratio_samples"} <= set(tags["histograms"])
    h = acc.Histograms("staleness/hist")[-1].histogram_value
    # counts of integer bins 0..3 -> 8 tokens, staleness 1 (x2) and 3 (x6): sum = 20
    assert h.num == 8 and h.sum == 20 and h.min == 1 and h.max == 3
    assert h.sum_squares == 2 * 1 + 6 * 9
    s = acc.Histograms("policy/ratio_samples")[-1].histogram_value
    assert s.num == 3 and s.sum == pytest.approx(3.0)


def test_tensorboard_counts_steps_like_the_console_and_metrics_jsonl_keeps_versions(tmp_path):
    """The trainer's step records (``_Lead._record``, 4 updates a step) go to TensorBoard at the
    training step 1, 2 (the console's and plot_metrics' count) and the update/* records at updates
    1..8; metrics.jsonl keeps the weight version in "step"."""
    import types

    from megatron_m2po.trainer.loop import _Lead

    run = tmp_path / "run"
    with MetricsLogger(run) as ml:
        lead = types.SimpleNamespace(logger=ml, progress=types.SimpleNamespace(update=lambda *a: None))
        for step in (0, 1):
            _Lead._record(lead, step, 4 * (step + 1), {"train/step": float(step), "rollout/reward_mean": 0.5 + step},
                           [{"loss": float(j)} for j in range(4)])
    acc = _tb_events(run)
    assert [(e.step, e.value) for e in acc.Scalars("rollout/reward_mean")] == [(1, 0.5), (2, 1.5)]
    assert [e.step for e in acc.Scalars("update/loss")] == list(range(1, 9))
    assert [r["step"] for r in read_metrics(run) if "train/step" in r] == [4, 8]


def test_rewind_keeps_each_update_once_after_a_resume(tmp_path):
    """A run killed after logging versions 1-6 (a torn last line) resumes from its version-4
    checkpoint: rewind drops 5, 6 and the torn line, so the re-logged 5, 6 appear once in the
    raw file; a run killed before its first checkpoint rewinds to 0 and keeps nothing."""
    run = tmp_path / "run"
    with MetricsLogger(run, tensorboard=False) as ml:
        for v in range(1, 7):
            ml.log({"loss": float(v)}, step=v)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')
    with MetricsLogger(run, tensorboard=False) as ml:
        assert ml.rewind(4) == 3
        for v in (5, 6):
            ml.log({"loss": 10.0 + v}, step=v)
    raw = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in raw] == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 15), (6, 16)]
    with MetricsLogger(run, tensorboard=False) as ml:
        assert ml.rewind(0) == 6 and ml.rewind(0) == 0
    assert (run / "metrics.jsonl").read_text() == ""


def test_disabled_logger_writes_nothing(tmp_path):
    ml = MetricsLogger(tmp_path / "rank1", config_dict={"a": 1}, enabled=False)
    ml.log({"x": 1.0}, step=1)
    ml.close()
    assert not (tmp_path / "rank1").exists()


def test_bad_values_and_log_after_close(tmp_path):
    ml = MetricsLogger(tmp_path / "r", tensorboard=False)
    with pytest.raises(ValueError, match="not loggable"):
        ml.log({"x": object()}, step=1)
    ml.close()
    with pytest.raises(ValueError, match="after close"):
        ml.log({"x": 1.0}, step=2)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb installed")
def test_wandb_configured_but_missing_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"wandb_project='proj'.*pip install wandb"):
        MetricsLogger(tmp_path / "r", wandb_project="proj")


def test_format_progress_picks_present_metrics():
    line = format_progress({"rollout/reward_mean": 0.4123, "rollout/acc": 0.31,
                            "m2po/mask_frac": 0.0031, "staleness/mean": 4.0, "staleness/max": 7,
                            "perf/tokens_per_s": 1234.4, "policy/kl_k3": float("nan")})
    assert line == "reward 0.412 | acc 0.310 | mask 0.31% | stale 4.0 | max 7 | tok/s 1234"
    assert format_progress({"loss/clip_frac": 0.25, "eval/acc": 0.5}) == "acc 0.500 | clip 25.00%"
    assert format_progress({}) == ""
    # every masking loss's mask (icepop's, not its low / high parts; mis; areal_m2po), the reference KL
    assert format_progress({"icepop/mask_low_frac": 0.01, "icepop/mask_frac": 0.03, "ref/kl": 2e-3}) == \
        "mask 3.00% | ref kl 2.00e-03"
    assert format_progress({"mis/mask_frac": 0.5}) == "mask 50.00%"
    assert format_progress({"areal_m2po/mask_frac": 0.001, "rollout/reward_mean": 0.5}) == "reward 0.500 | mask 0.10%"


def test_progress_plain_lines_when_not_a_tty(caplog):
    with caplog.at_level(logging.INFO, logger="megatron_m2po"):
        p = TrainProgress(4, enabled=True, live=False, min_interval_s=3600)
        p.update(1, {"rollout/reward_mean": 0.5, "loss/clip_frac": 0.1})
        p.update(2, {"rollout/reward_mean": 0.6})  # throttled by min_interval_s
        p.update(4, {"rollout/reward_mean": 0.7})  # the last step always prints
        p.close()
        q = TrainProgress(4, enabled=False, live=True)  # disabled: lines even on a terminal
        assert not q.is_live
        q.update(2, {"rollout/reward_mean": 0.1})
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0].startswith("step 1/4 | reward 0.500 | clip 10.00% | eta ")
    assert msgs[1] == "step 4/4 | reward 0.700"
    assert msgs[2].startswith("step 2/4 | reward 0.100 | eta ")
    assert len(msgs) == 3


def test_progress_eta_after_a_resume_counts_only_this_process_steps(caplog, monkeypatch):
    """A run resumed at step 30 of 40 whose steps take 10 s each: the ETA after its first step is
    10 steps x 10 s, and stays so (it used to divide the time by all 31 steps: "6 s", then 10, 14, 17 s)."""
    import megatron_m2po.utils.logging as L

    now = [1000.0]
    monkeypatch.setattr(L.time, "monotonic", lambda: now[0])
    with caplog.at_level(logging.INFO, logger="megatron_m2po"):
        p = TrainProgress(40, enabled=True, live=False)
        for step in (31, 32, 33):
            now[0] += 10.0
            p.update(step, {})
    etas = [r.getMessage().split("| eta ")[1] for r in caplog.records]
    assert etas == ["1m30s", "1m20s", "1m10s"], etas
    # the live bar: rich's speed estimate sees this process's steps only
    now[0] = 2000.0
    q = TrainProgress(40, enabled=True, live=True)
    q._progress.console.file = io.StringIO()
    q.update(31, {})
    task = q._progress.tasks[0]
    assert task.completed == 31 and [s.completed for s in task._progress] == [1]
    q.close()


def test_progress_live_rich_bar_renders():
    p = TrainProgress(10, enabled=True, live=True)
    buf = io.StringIO()
    p._progress.console.file = buf  # render into a buffer instead of the terminal
    p.update(3, {"rollout/reward_mean": 0.42, "m2po/mask_frac": 0.002})
    p.message("weights pushed")
    p.close()
    out = buf.getvalue()
    assert p.is_live is False
    assert "3/10" in out and "reward 0.420" in out and "mask 0.20%" in out
    assert "weights pushed" in out


def test_setup_logging_rank_prefix_and_levels(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    try:
        setup_logging(0)
        setup_logging(0)  # idempotent: one handler
        logging.getLogger("megatron_m2po.test").info("hello %d", 1)
        setup_logging(3)
        logging.getLogger("megatron_m2po.test").info("not shown on rank 3")
        logging.getLogger("megatron_m2po.test").warning("shown")
        with pytest.raises(ValueError, match="unknown log level"):
            setup_logging(0, level="LOUD")
    finally:
        for h in list(root.handlers):
            if h not in before[0]:
                root.removeHandler(h)
        root.setLevel(before[1])
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("[rank 0] ") and lines[0].endswith("INFO megatron_m2po.test: hello 1")
    assert lines[1].startswith("[rank 3] ") and lines[1].endswith("WARNING megatron_m2po.test: shown")
