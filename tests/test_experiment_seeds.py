"""``--seeds N`` and the sweeps: statistics by hand, planning, resume layout, figures and tables
from hand-made metrics (no training here; the real runs are in test_experiment.py)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from megatron_m2po.config import ConfigError, load_config
from megatron_m2po.experiment import (
    ARMS, FAST_K, SPREAD_Z, ArmSummary, SeedStat, aggregate_seeds, exceeds_spread, format_seed_table, plan,
    plan_staleness_sweep, plan_threshold_sweep, report, seed_stat, write_figures, write_sweep_figure)

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "examples" / "staleness_tiny.yaml")


def _rec(update, step, **kv):
    return {"step": update, "time": 0.0, "train/step": float(step), **kv}


def _run_records(rewards, accs, tr=None, tr_key="loss/clip_frac", U=4):
    out = []
    for s, rew in enumerate(rewards):
        kv = {"rollout/reward_mean": rew, "eval/synthetic/acc": accs[s], "policy/kl_k3": 0.01}
        if tr is not None:
            kv[tr_key] = tr[s]
        out.append(_rec((s + 1) * U, s, **kv))
    return out


# ------------------------------------------------------------------------------ statistics by hand

def test_seed_stat_is_mean_and_sample_std():
    s = seed_stat([0.30, 0.40, 0.50, None, float("nan")])
    assert s.n == 3 and s.mean == pytest.approx(0.40)
    assert s.std == pytest.approx(statistics.stdev([0.30, 0.40, 0.50])) == pytest.approx(0.1)
    one = seed_stat([0.7])
    assert one.mean == 0.7 and one.std is None and one.n == 1
    assert seed_stat([]).mean is None


def test_exceeds_spread_rule_by_hand():
    # se = sqrt(0.1^2/3 + 0.1^2/3) = 0.08165; 2 se = 0.1633
    a = SeedStat(0.40, 0.1, 3)
    assert exceeds_spread(a, SeedStat(0.56, 0.1, 3)) is False   # 0.16 < 0.1633
    assert exceeds_spread(a, SeedStat(0.57, 0.1, 3)) is True    # 0.17 > 0.1633
    assert exceeds_spread(a, SeedStat(0.57, 0.1, 3), z=3.0) is False
    assert exceeds_spread(a, SeedStat(0.9, None, 1)) is None     # one seed: no spread to judge by
    assert exceeds_spread(SeedStat(0.5, 0.0, 2), SeedStat(0.5, 0.0, 2)) is False
    assert exceeds_spread(SeedStat(0.5, 0.0, 2), SeedStat(0.6, 0.0, 2)) is True
    assert SPREAD_Z == 2.0


def _summary(arm, label, final_acc, final_reward, tr, loss="grpo"):
    return ArmSummary(arm=arm, label=label, loss=loss, staleness=8, steps=10, updates=40, best_acc=final_acc + 0.05,
                      final_acc=final_acc, final_reward=final_reward, best_reward=final_reward, mean_tr_frac=tr,
                      collapsed=False)


def test_seed_table_marks_only_differences_beyond_the_spread():
    on = aggregate_seeds([_summary("grpo_s0", "GRPO s=0", a, 0.50, 0.01) for a in (0.44, 0.45, 0.46)], [1, 2, 3])
    st = aggregate_seeds([_summary("grpo_sk", "GRPO s=8", a, r, 0.05)
                          for a, r in ((0.30, 0.49), (0.35, 0.51), (0.40, 0.50))], [1, 2, 3])
    assert on.stats["final_acc"].mean == pytest.approx(0.45) and on.stats["final_acc"].std == pytest.approx(0.01)
    table = format_seed_table([on, st])
    assert "| GRPO s=0 | 8 | 3 | 0.500 ± 0.010 | 0.450 ± 0.010 | 0.500 ± 0.000 |" in table
    assert "| 1.00% ± 0.00% |" in table and "| 0/3 |" in table
    # final acc paired by seed: d = 0.14, 0.10, 0.06; mean 0.10, sd 0.04, se 0.04 / sqrt(3) = 0.0231 -> 4.3 se
    # (Welch's unpaired error would be sqrt(0.01^2/3 + 0.05^2/3) = 0.0294)
    assert "- final held-out acc: GRPO s=0 − GRPO s=8 = +0.1000 (standard error 0.0231, 4.3×)" in table
    # final reward 0.50 vs 0.50: does not
    assert "final reward: GRPO s=0" not in table
    assert "seeds 1–3" in table and "paired by seed" in table
    single = format_seed_table([aggregate_seeds([_summary("a", "A", 0.4, 0.5, 0.0)], [7])])
    assert "not judged" in single


# ------------------------------------------------------------------------------ planning

def test_seeds_plan_one_run_per_arm_and_seed_in_its_own_dir(tmp_path):
    runs, spec = plan(CONFIG, [], ["grpo_s0", "m2po_sk"], None, str(tmp_path), fast=True, seeds=3)
    base_seed = load_config(CONFIG).trainer.seed
    assert spec["seeds"] == [base_seed, base_seed + 1, base_seed + 2]
    assert [(r.arm.name, r.seed) for r in runs] == [(a, base_seed + i) for a in ("grpo_s0", "m2po_sk")
                                                    for i in range(3)]
    for r in runs:
        assert r.run_dir == (tmp_path / r.arm.name / f"seed_{r.seed}").resolve()
        cfg = load_config(CONFIG, r.overrides)
        assert cfg.trainer.seed == r.seed and cfg.trainer.stale_k == (FAST_K if r.arm.name == "m2po_sk" else 0)
        assert "/seed " in r.tag
    assert len({r.run_dir for r in runs}) == 6
    # one seed keeps the single-run layout (and overrides) of earlier versions: their runs resume
    one, _ = plan(CONFIG, [], ["m2po_sk"], None, str(tmp_path), fast=True)
    assert one[0].run_dir == (tmp_path / "m2po_sk").resolve()
    assert not any(o.startswith("trainer.seed=") for o in one[0].overrides)
    with pytest.raises(ConfigError, match="--seeds=0"):
        plan(CONFIG, [], ["m2po_sk"], None, str(tmp_path), fast=True, seeds=0)


def test_sweeps_differ_only_in_the_swept_setting(tmp_path):
    runs, spec = plan_staleness_sweep(CONFIG, ["trainer.num_steps=3"], [16, 0, 4], str(tmp_path), fast=False)
    assert spec["values"] == [0, 4, 16] and [r.arm.name for r in runs] == ["grpo_s0", "grpo_s4", "grpo_s16"]
    cfgs = [load_config(CONFIG, r.overrides) for r in runs]
    assert [c.trainer.stale_k for c in cfgs] == [0, 4, 16] and {c.algo.loss for c in cfgs} == {"grpo"}
    U = cfgs[0].trainer.num_updates_per_step
    assert all(c.store.max_staleness >= 16 + U - 1 for c in cfgs)
    varying = {"trainer.stale_k", "trainer.run_dir"}
    rest = [{k: v for k, v in (o.split("=", 1) for o in r.overrides) if k not in varying} for r in runs]
    assert rest[0] == rest[1] == rest[2]

    runs, spec = plan_threshold_sweep(CONFIG, [], [0.16, 0.01, 0.04], 8, str(tmp_path / "t"), fast=True, seeds=2)
    assert spec["values"] == [0.01, 0.04, 0.16] and len(runs) == 6
    cfgs = [load_config(CONFIG, r.overrides) for r in runs]
    assert [c.algo.m2po.threshold for c in cfgs] == [0.01, 0.01, 0.04, 0.04, 0.16, 0.16]
    assert {c.trainer.stale_k for c in cfgs} == {8} and {c.algo.loss for c in cfgs} == {"m2po"}
    assert runs[0].arm.label == "M2PO τ=0.01 s=8"
    with pytest.raises(ConfigError, match="distinct"):
        plan_staleness_sweep(CONFIG, [], [0, 0], str(tmp_path), fast=True)
    with pytest.raises(ConfigError, match="> 0"):
        plan_threshold_sweep(CONFIG, [], [0.0], 8, str(tmp_path), fast=True)


# ------------------------------------------------------------------------------ report over seeds

def _fake_finished(run, records):
    run.run_dir.mkdir(parents=True, exist_ok=True)
    (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run.done_file.write_text(json.dumps({"overrides": run.overrides, "config_sha256": run.config_sha256}))


def test_report_over_seeds_writes_mean_std_table_bands_and_sweep_figure(tmp_path):
    runs, spec = plan_staleness_sweep(CONFIG, [], [0, 8], str(tmp_path), fast=True, seeds=2)
    accs = {("grpo_s0", 0): 0.50, ("grpo_s0", 1): 0.52, ("grpo_s8", 0): 0.30, ("grpo_s8", 1): 0.31}
    for r in runs:
        i = r.seed - spec["seeds"][0]
        a = accs[(r.arm.name, i)]
        _fake_finished(r, _run_records([0.3, 0.4, a], [0.3, 0.4, a], [0.01, 0.02, 0.03]))
    for r in runs:
        assert r.finished_before()
        r.status = "done"
    aggs = report(runs, spec, tmp_path, tmp_path / "fig", smooth=0)
    assert [a.arm for a in aggs] == ["grpo_s0", "grpo_s8"]
    assert aggs[0].stats["final_acc"].mean == pytest.approx(0.51)
    assert aggs[0].stats["final_acc"].std == pytest.approx(math.sqrt(2) * 0.01)
    md = (tmp_path / "summary.md").read_text()
    assert "0.510 ± 0.014" in md and "final held-out acc: GRPO s=0 − GRPO s=8" in md
    js = json.loads((tmp_path / "summary.json").read_text())
    assert len(js["arms"]) == 4 and {a["extra"]["seed"] for a in js["arms"]} == set(spec["seeds"])
    assert js["aggregate"][1]["stats"]["final_acc"]["values"] == [0.30, 0.31]
    assert (tmp_path / "fig" / "heldout_acc.png").stat().st_size > 5000
    path = write_sweep_figure(list(zip(spec["values"], aggs)), "staleness", tmp_path / "fig" / "sweep.png")
    assert path.stat().st_size > 5000


def test_figure_band_is_min_max_over_seeds(tmp_path, monkeypatch):
    import matplotlib.axes

    fills = []
    orig = matplotlib.axes.Axes.fill_between

    def spy(self, x, y1, y2=0, **kw):
        fills.append((list(x), list(y1), list(y2)))
        return orig(self, x, y1, y2, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "fill_between", spy)
    seeds = [_run_records([0.1, 0.2, 0.3], [0.1, 0.5, 0.3]), _run_records([0.3, 0.2, 0.1], [0.3, 0.1, 0.2])]
    seeds[1].append(_rec(16, 3, **{"eval/synthetic/acc": 0.9}))  # logged by one seed only: not averaged
    write_figures([("grpo_sk", ARMS["grpo_sk"].label(8), "grpo", seeds)], tmp_path,
                  figures=[("heldout_acc", "acc", "eval/synthetic/acc")])
    assert fills == [([4, 8, 12], [0.1, 0.1, 0.2], [0.3, 0.5, 0.3])]


def test_cli_parses_the_new_commands(capsys):
    from megatron_m2po.cli import build_parser, main

    parser = build_parser()
    a = parser.parse_args(["experiment", "sweep-threshold", CONFIG, "--thresholds", "0.01,0.04", "--seeds", "3",
                           "--k", "8"])
    assert a.thresholds == [0.01, 0.04] and a.seeds == 3 and a.k == 8
    a = parser.parse_args(["experiment", "sweep-staleness", CONFIG, "--ks", "0,4,8", "--fast"])
    assert a.ks == [0, 4, 8] and a.fast and a.seeds == 1
    a = parser.parse_args(["experiment", "entropy", "runs/x", "--min-staleness", "4"])
    assert a.min_staleness == 4
    with pytest.raises(SystemExit) as e:
        main(["experiment", "sweep-staleness", CONFIG, "--ks", "0,x"])
    assert e.value.code == 2 and "comma-separated list of ints" in capsys.readouterr().err


def test_trust_region_fraction_on_stale_steps_only():
    from megatron_m2po.experiment import summarize_arm

    recs = [_rec(4 * (s + 1), s, **{"loss/clip_frac": c, "staleness/min": m, "rollout/reward_mean": 0.3})
            for s, (c, m) in enumerate([(0.001, 0), (0.002, 4), (0.02, 8), (0.04, 9)])]
    s = summarize_arm(recs, arm="grpo_sk", label="GRPO s=8", loss="grpo", staleness=8)
    assert s.mean_tr_frac == pytest.approx((0.001 + 0.002 + 0.02 + 0.04) / 4)
    assert s.stale_tr_frac == pytest.approx(0.03)  # steps whose tokens are all >= 8 updates old
    assert summarize_arm(recs, arm="no_tr_sk", label="x", loss="no_tr", staleness=8).stale_tr_frac == 0.0
