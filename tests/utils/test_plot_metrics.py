"""tools/plot_metrics.py: panels that exist, overlays of several runs, valid PNGs, the CLI."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_m2po.utils.logging import MetricsLogger

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("plot_metrics", ROOT / "tools" / "plot_metrics.py")
plot_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_mod)
plot_metrics = plot_mod.plot_metrics


def _write_run(run_dir: Path, trust_key: str, seed: int, steps: int = 30) -> Path:
    rng = np.random.default_rng(seed)
    with MetricsLogger(run_dir, tensorboard=False) as ml:
        for s in range(1, steps + 1):
            ml.log({"rollout/reward_mean": 0.3 + 0.01 * s + 0.02 * rng.standard_normal(),
                    "rollout/acc": 0.2 + 0.01 * s, trust_key: 0.01 * rng.random(),
                    "m2po/m2_before": 0.1 * rng.random(), "m2po/m2_after": 0.03,
                    "policy/kl_k3": 1e-3 * s, "policy/entropy": 1.0 - 0.01 * s,
                    "staleness/mean": 17.5, "staleness/max": 19, "staleness/hist": [0, 1, 2],
                    "optim/grad_norm": float(rng.random()),
                    "policy/kl_k1": float("nan") if s == 3 else 1e-3 * s}, step=s)
    return run_dir / "metrics.jsonl"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _ink_fraction(path: Path) -> float:
    """Fraction of non-white pixels: a blank canvas scores ~0."""
    import matplotlib.image as mpimg

    img = mpimg.imread(path)[..., :3]
    return float((img.min(axis=-1) < 0.9).mean())


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_default_panels_overlay_two_runs(tmp_path, monkeypatch):
    a = _write_run(tmp_path / "m2po_s16", "m2po/mask_frac", 0)
    _write_run(tmp_path / "grpo_s16", "loss/clip_frac", 1)
    import matplotlib.figure

    seen = []
    orig = matplotlib.figure.Figure.savefig

    def record(fig, path, *args, **kw):  # inspect the real figure, then write it
        for ax in fig.axes:
            leg = ax.get_legend()
            seen.append((Path(path).name, [t.get_text() for t in leg.get_texts()] if leg else [],
                         [len(line.get_xdata()) for line in ax.get_lines()]))
        return orig(fig, path, *args, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    out = tmp_path / "plots"
    written = plot_metrics([a, tmp_path / "grpo_s16"], out)  # a file and a run dir
    names = [p.name for p in written]
    assert names == ["reward.png", "trust_region.png", "m2.png", "kl.png", "entropy.png",
                     "staleness.png", "grad_norm.png", "overview.png"]
    for p in written:
        w, h = _png_size(p)
        assert w >= 500 and h >= 300 and p.stat().st_size > 10_000
        assert _ink_fraction(p) > 0.01
    assert _png_size(out / "overview.png")[0] > _png_size(out / "reward.png")[0]

    by_file = {name: (legend, npts) for name, legend, npts in seen if name != "overview.png"}
    assert by_file["entropy.png"] == (["m2po_s16", "grpo_s16"], [30, 30])
    assert by_file["trust_region.png"][0] == ["m2po_s16: m2po/mask_frac", "grpo_s16: loss/clip_frac"]
    # kl_k1 has a NaN at step 3: the point is skipped (29 of 30), not drawn
    assert by_file["kl.png"] == (["m2po_s16: policy/kl_k1", "m2po_s16: policy/kl_k3",
                                  "grpo_s16: policy/kl_k1", "grpo_s16: policy/kl_k3"],
                                 [29, 30, 29, 30])
    assert sum(name == "overview.png" for name, _, _ in seen) == 9  # 7 panels + 2 blank axes


def test_explicit_metrics_patterns_and_errors(tmp_path):
    a = _write_run(tmp_path / "run", "m2po/mask_frac", 0, steps=5)
    written = plot_metrics([a], tmp_path / "p", metrics=["policy/*", "rollout/acc"],
                           labels=["mine"])
    assert [p.name for p in written] == ["policy_kl_k3.png", "policy_entropy.png",
                                         "policy_kl_k1.png", "rollout_acc.png", "overview.png"]
    with pytest.raises(ValueError, match="none of the metrics"):
        plot_metrics([a], tmp_path / "p", metrics=["nope/*"])
    with pytest.raises(ValueError, match="2 labels for 1 files"):
        plot_metrics([a], tmp_path / "p", labels=["x", "y"])
    with pytest.raises(ValueError, match="no metrics file"):
        plot_metrics([tmp_path / "missing"], tmp_path / "p")


def test_cli(tmp_path):
    a = _write_run(tmp_path / "run_a", "loss/clip_frac", 2, steps=8)
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_metrics.py"), str(a),
                          "--out", str(tmp_path / "cli"), "--metrics", "loss/clip_frac",
                          "--smooth", "3"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    printed = [Path(line) for line in res.stdout.split()]
    assert [p.name for p in printed] == ["loss_clip_frac.png", "overview.png"]
    assert all(p.is_file() and p.stat().st_size > 5_000 for p in printed)
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_metrics.py"), str(a),
                          "--out", str(tmp_path / "cli"), "--metrics", "zzz"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "available:" in bad.stderr


def test_where_the_time_goes_panels(tmp_path, monkeypatch):
    with MetricsLogger(tmp_path / "run", tensorboard=False) as ml:
        for s in range(1, 6):
            ml.log({"time/wall_s": 2.0, "time/data_wait_s": 0.5, "time/forward_backward_s": 1.0,
                    "time/optimizer_s": 0.1, "time/generation_s": 1.5, "time/trainer_idle_frac": 0.25,
                    "time/engine_idle_frac": 0.25}, step=s)
    import matplotlib.figure

    seen = {}
    orig = matplotlib.figure.Figure.savefig

    def record(fig, path, *args, **kw):
        ax = fig.axes[0]
        seen[Path(path).name] = ([t.get_text() for t in ax.get_legend().get_texts()],
                                 {line.get_color() for line in ax.get_lines()})
        return orig(fig, path, *args, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    written = plot_metrics([tmp_path / "run"], tmp_path / "p")
    assert [p.name for p in written] == ["time.png", "idle.png", "overview.png"]
    legend, colors = seen["time.png"]
    assert legend == ["time/wall_s", "time/data_wait_s", "time/forward_backward_s", "time/optimizer_s",
                      "time/generation_s"]
    assert len(colors) == 5  # one run: each phase its own colour
    assert seen["idle.png"][0] == ["time/trainer_idle_frac", "time/engine_idle_frac"]


def _trainer_like_run(run_dir: Path, steps: int = 4, U: int = 2) -> None:
    """As the trainer logs (trainer/loop.py ``_Lead._record``): per-update records at step = the
    weight version after the update, then the step's record at the step's last version."""
    with MetricsLogger(run_dir, tensorboard=False) as ml:
        for s in range(steps):
            for j in range(U):
                ml.log({"update/loss/policy": 0.1 * (s * U + j)}, step=s * U + j + 1)
            ml.log({"train/step": float(s), "rollout/reward_mean": 0.3 + 0.01 * s}, step=(s + 1) * U)


def test_the_x_axis_counts_training_steps_as_the_console_does(tmp_path, monkeypatch):
    """The console says ``step 4/4``; metrics.jsonl's ``step`` counts optimizer updates (U=2 per
    step): the plots' x-axis is the console's step, per-update metrics at fractions of their step
    (they used to be drawn at update 1..8 under a label "step")."""
    _trainer_like_run(tmp_path / "run")
    import matplotlib.figure

    seen = {}
    orig = matplotlib.figure.Figure.savefig

    def record(fig, path, *args, **kw):
        ax = fig.axes[0]
        seen[Path(path).name] = (ax.get_xlabel(), [list(line.get_xdata()) for line in ax.get_lines()])
        return orig(fig, path, *args, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    plot_metrics([tmp_path / "run"], tmp_path / "p", metrics=["rollout/reward_mean", "update/loss/policy"])
    label, xs = seen["rollout_reward_mean.png"]
    assert label == "training step (as the console counts them)" and xs == [[1.0, 2.0, 3.0, 4.0]]
    assert seen["update_loss_policy.png"][1] == [[0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]]
    plot_metrics([tmp_path / "run"], tmp_path / "q", metrics=["rollout/reward_mean"], x_key="step")
    assert seen["rollout_reward_mean.png"] == ("optimizer update (weight version)", [[2.0, 4.0, 6.0, 8.0]])


def test_cli_writes_one_run_s_plots_next_to_it(tmp_path, monkeypatch):
    _trainer_like_run(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    assert plot_mod.main([str(tmp_path / "run"), "--metrics", "rollout/reward_mean"]) == 0
    assert (tmp_path / "run" / "plots" / "overview.png").is_file()
    with pytest.raises(SystemExit):  # several runs: where to is not obvious
        plot_mod.main([str(tmp_path / "run"), str(tmp_path / "run")])


def test_m2_against_its_target_and_every_losss_mask(tmp_path, monkeypatch):
    """An areal_m2po run with tau 0.05 in its config: the trust-region panel draws its mask, the M2
    panel its M2 with a dashed line at 0.05 (the run's target), M2PO's |log r| cut is a panel of its
    own (its 1-3.5 would flatten M2 to zero), and the time panel's many lines get the legend beside
    the axes."""
    import json

    import matplotlib.figure

    run = tmp_path / "areal"
    with MetricsLogger(run, tensorboard=False, config_dict={"algo": {"loss": "areal_m2po",
                                                                     "areal_m2po": {"threshold": 0.05}}}) as ml:
        for s in range(1, 6):
            ml.log({"areal_m2po/mask_frac": 0.01 * s, "areal_m2po/m2_before": 0.1, "areal_m2po/m2_after": 0.049,
                    "m2po/threshold_value": 2.5, **{f"time/{k}_s": float(s) for k in
                                                    ("wall", "generation_wait", "data_wait", "push", "optimizer")}},
                   step=s)
    assert json.loads((run / "config.json").read_text())["algo"]["areal_m2po"]["threshold"] == 0.05
    seen = {}
    orig = matplotlib.figure.Figure.savefig

    def record(fig, path, *args, **kw):
        out = orig(fig, path, *args, **kw)  # drawn: the legend's place is known
        ax = fig.axes[0]
        leg = ax.get_legend()
        beside = leg is not None and leg.get_window_extent().x0 >= ax.get_window_extent().x1
        seen[Path(path).stem] = (ax.get_legend_handles_labels()[1], beside,
                                 [tuple(line.get_ydata()) for line in ax.get_lines()])
        return out

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    plot_metrics([run], tmp_path / "plots")
    assert "areal_m2po/mask_frac" in seen["trust_region"][0]
    labels, _, ys = seen["m2"]
    assert labels == ["areal_m2po/m2_before", "areal_m2po/m2_after", "target 0.05"] and (0.05, 0.05) in ys
    assert seen["m2_cut"][0] == ["m2po/threshold_value"]
    assert seen["time"][1] and not seen["m2"][1]  # many lines: the legend beside the axes; few: inside
