"""``m2po experiment staleness``: table / collapse logic by hand, planning, resume bookkeeping,
figures, and one short real run of M2PO s=k vs GRPO s=k (the robust part of the paper's claims)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import launcher

from megatron_m2po.config import ConfigError, load_config
from megatron_m2po.utils.logging import read_metrics
from megatron_m2po.experiment import (
    ARMS, CORE, FAST_K, FAST_OVERRIDES, CollapseRule, MetricsTail, collapse_verdict, format_table, plan,
    pooled_base_reward, step_records, summarize_arm, write_figures)

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "examples" / "staleness_tiny.yaml")


def _step(update, step, **kv):
    return {"step": update, "time": 0.0, "train/step": float(step), **kv}


def _records(rewards, accs=None, tr=None, tr_key="loss/clip_frac", U=4):
    """Step-level records (x = updates) interleaved with per-update records, as the loop logs them."""
    recs = []
    for s, rew in enumerate(rewards):
        u = (s + 1) * U
        for j in range(1, U):
            recs.append({"step": u - U + j, "update/optim/grad_norm": 1.0, "update/" + tr_key: 0.9})
        kv = {"rollout/reward_mean": rew, "policy/kl_k3": 0.01 * (s + 1)}
        if accs is not None and accs[s] is not None:
            kv["eval/synthetic/acc"] = accs[s]
        if tr is not None:
            kv[tr_key] = tr[s]
        recs.append(_step(u, s, **kv))
    return recs


# ------------------------------------------------------------------------------ table logic

def test_step_records_drop_per_update_records():
    recs = _records([0.1, 0.2, 0.3])
    assert [r["step"] for r in step_records(recs)] == [4, 8, 12]


def test_summary_values_by_hand():
    rewards = [0.30, 0.40, 0.50, 0.60, 0.55, 0.50, 0.45, 0.40, 0.35, 0.30]
    accs = [None, 0.40, None, 0.70, None, 0.65, None, 0.50, None, 0.30]
    clip = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    rule = CollapseRule(acc_ratio=0.5, reward_margin=0.05, tail_frac=0.2)
    s = summarize_arm(_records(rewards, accs, clip), arm="grpo_sk", label="GRPO s=8", loss="grpo",
                      staleness=8, rule=rule)
    assert s.steps == 10 and s.updates == 40
    assert s.best_acc == 0.70 and s.best_acc_update == 16  # step 3 ends at update 16
    assert s.final_acc == 0.30
    assert s.base_reward == 0.30  # step 0 by default
    assert s.final_reward == pytest.approx((0.35 + 0.30) / 2)  # last 20 % = 2 steps
    assert s.best_reward == pytest.approx((0.60 + 0.55) / 2)
    assert s.mean_tr_frac == pytest.approx(0.55)  # mean of 0.1 .. 1.0, update-only records ignored
    assert s.mean_kl_k3 == pytest.approx(0.01 * 5.5)
    # final acc 0.30 < 0.5 * 0.70 -> collapsed; reward 0.325 is not below 0.30 - 0.05
    assert s.collapsed is True
    assert "held-out" in s.collapse_reason and "reward" not in s.collapse_reason


def test_collapse_by_reward_only_and_stable_run():
    rule = CollapseRule(reward_margin=0.05, tail_frac=0.25)
    down = summarize_arm(_records([0.40, 0.45, 0.30, 0.20]), arm="no_tr_sk", label="x", loss="no_tr",
                         staleness=8, rule=rule)
    assert down.best_acc is None and down.mean_tr_frac == 0.0
    assert down.final_reward == pytest.approx(0.20)
    assert down.collapsed is True and "reward" in down.collapse_reason
    # a pooled base reward replaces step 0
    up = summarize_arm(_records([0.40, 0.45, 0.50, 0.36]), arm="m2po_sk", label="x", loss="m2po", staleness=8,
                       rule=rule, base_reward=0.40)
    assert up.base_reward == 0.40 and up.collapsed is False  # 0.36 >= 0.40 - 0.05
    assert summarize_arm(_records([0.40, 0.45, 0.50, 0.34]), arm="m2po_sk", label="x", loss="m2po",
                         staleness=8, rule=rule, base_reward=0.40).collapsed is True  # 0.34 < 0.35


def test_collapse_acc_boundary_and_no_data():
    from megatron_m2po.experiment import ArmSummary
    s = ArmSummary(arm="a", label="a", loss="grpo", staleness=0, steps=3, updates=12, best_acc=0.6, final_acc=0.3)
    assert collapse_verdict(s, CollapseRule(acc_ratio=0.5)) == (False, "")  # exactly half is not below
    s.final_acc = 0.299
    assert collapse_verdict(s, CollapseRule(acc_ratio=0.5))[0] is True
    empty = ArmSummary(arm="a", label="a", loss="grpo", staleness=0, steps=0, updates=0)
    assert collapse_verdict(empty) == (None, "no data")
    assert summarize_arm([], arm="a", label="a", loss="grpo", staleness=0).collapsed is None


def test_pooled_base_reward_uses_steps_trained_on_base_rollouts():
    # U=4, k=8: steps 0, 1, 2 train on version-0 rollouts (generation_version = max(0, 4s - 8)).
    stale = _records([0.30, 0.32, 0.34, 0.90, 0.95])
    onpol = _records([0.36, 0.80, 0.85])  # k=0: only step 0
    assert pooled_base_reward([(stale, 8, 4), (onpol, 0, 4)]) == pytest.approx((0.30 + 0.32 + 0.34 + 0.36) / 4)
    assert pooled_base_reward([]) is None


def test_table_markdown():
    rows = [summarize_arm(_records([0.3, 0.5], [0.4, 0.6], [0.1, 0.3]), arm="grpo_sk", label="GRPO s=8",
                          loss="grpo", staleness=8),
            summarize_arm(_records([0.3, 0.1]), arm="no_tr_sk", label="no trust region s=8", loss="no_tr",
                          staleness=8),
            summarize_arm(_records([0.3, 0.5], tr=[0.01, 0.03], tr_key="m2po/mask_frac"), arm="m2po_sk",
                          label="M2PO s=8", loss="m2po", staleness=8)]
    table = format_table(rows, CollapseRule())
    lines = table.splitlines()
    assert lines[0].startswith("| arm |") and len([ln for ln in lines if ln.startswith("| ")]) == 4
    assert "| GRPO s=8 | 8 | 8 | 0.600 (8) | 0.600 |" in table
    assert "20.0% clip" in table and "0.0% (none)" in table and "2.0% mask" in table
    assert lines[3].endswith("| yes |") and lines[2].endswith("| no |")
    assert CollapseRule().describe() in table


# ------------------------------------------------------------------------------ planning / resume

def test_plan_arms_differ_only_in_loss_and_staleness(tmp_path):
    runs, spec = plan(CONFIG, ["optim.lr=2e-4"], list(CORE), None, str(tmp_path), fast=False)
    cfg = load_config(CONFIG, ["optim.lr=2e-4"])
    k = cfg.trainer.stale_k
    assert spec["k"] == k >= 1 and spec["seed"] == cfg.trainer.seed
    U = cfg.trainer.num_updates_per_step
    assert spec["max_staleness"] >= k + U - 1
    varying = {"algo.loss", "trainer.stale_k", "trainer.run_dir"}
    common = None
    for r in runs:
        ov = dict(o.split("=", 1) for o in r.overrides)
        assert ov["algo.loss"] == r.arm.loss and ov["trainer.mode"] == "stale_k"
        assert int(ov["trainer.stale_k"]) == (k if ARMS[r.arm.name].stale else 0) == r.arm.k
        assert Path(ov["trainer.run_dir"]) == (tmp_path / r.arm.name).resolve() == r.run_dir
        assert ov["optim.lr"] == "2e-4"
        rest = {key: v for key, v in ov.items() if key not in varying}
        common = rest if common is None else common
        assert rest == common, "arms must not differ in anything but loss, staleness and run dir"
        assert r.command[:4] == [sys.executable, "-m", "megatron_m2po.cli", "train"]
        assert r.expected_steps == cfg.trainer.num_steps
        arm_cfg = load_config(CONFIG, r.overrides)
        assert arm_cfg.trainer.seed == cfg.trainer.seed and arm_cfg.data == cfg.data


def test_plan_fast_and_errors(tmp_path):
    runs, spec = plan(CONFIG, [], ["m2po_sk", "grpo_sk"], None, str(tmp_path), fast=True)
    assert spec["k"] == FAST_K and [r.arm.name for r in runs] == ["m2po_sk", "grpo_sk"]
    assert all(o in runs[0].overrides for o in FAST_OVERRIDES)
    # user overrides come after the fast ones, so they win
    runs, _ = plan(CONFIG, ["trainer.num_steps=3"], ["m2po_sk"], 4, str(tmp_path), fast=True)
    assert runs[0].expected_steps == 3 and "trainer.stale_k=4" in runs[0].overrides
    with pytest.raises(ConfigError, match="unknown arm"):
        plan(CONFIG, [], ["ppo_sk"], None, str(tmp_path), fast=False)
    with pytest.raises(ConfigError, match="k >= 1"):
        plan(CONFIG, [], ["m2po_sk"], 0, str(tmp_path), fast=False)
    with pytest.raises(ConfigError):
        plan(CONFIG, ["trainer.prompts_per_update=7"], ["m2po_sk"], None, str(tmp_path), fast=False)


def test_finished_arm_is_skipped_only_with_the_same_settings(tmp_path):
    runs, _ = plan(CONFIG, [], ["m2po_sk"], None, str(tmp_path), fast=False)
    r = runs[0]
    assert not r.finished_before()
    r.run_dir.mkdir(parents=True)
    r.done_file.write_text(json.dumps({"overrides": r.overrides, "config_sha256": r.config_sha256}))
    assert r.finished_before()
    edited = tmp_path / "edited.yaml"
    edited.write_text(Path(CONFIG).read_text() + "\n# a comment does not change the settings\n")
    assert plan(str(edited), [], ["m2po_sk"], None, str(tmp_path), fast=False)[0][0].finished_before()
    edited.write_text(Path(CONFIG).read_text().replace("threshold: 0.04", "threshold: 0.05"))
    changed, _ = plan(str(edited), [], ["m2po_sk"], None, str(tmp_path), fast=False)
    with pytest.raises(ValueError, match="different settings"):
        changed[0].finished_before()
    assert changed[0].finished_before(strict=False)  # --report-only reads it anyway
    other, _ = plan(CONFIG, ["optim.lr=1e-3"], ["m2po_sk"], None, str(tmp_path), fast=False)
    with pytest.raises(ValueError, match="different settings"):
        other[0].finished_before()


def test_a_field_added_to_the_code_since_a_run_finished_does_not_make_it_different(tmp_path):
    """A finished run recorded the digest of the config fields of its day and the trainer wrote its
    resolved config (config.json). A field added to the code since, at its default, changes nothing
    the run did: still the same run. Set away from its default, or any recorded setting changed,
    it is a different run."""
    from megatron_m2po.experiment import runner

    runs, _ = plan(CONFIG, [], ["m2po_sk"], None, str(tmp_path), fast=False)
    r = runs[0]
    then = json.loads(json.dumps(r.run_config, default=str))
    del then["model"]["lora"]["push"], then["model"]["lora"]["adapter_transport"]  # "added since"
    then["model"]["hf_path"] = "/cache/tiny_base/qwen2-tiny-0123"  # the trainer records the built tiny base
    r.run_dir.mkdir(parents=True)
    (r.run_dir / "config.json").write_text(json.dumps(then))
    r.done_file.write_text(json.dumps({"overrides": r.overrides, "config_sha256": runner._sha(then)}))
    assert r.config_sha256 != runner._sha(then)
    assert r.finished_before()
    moved, _ = plan(CONFIG, ["model.lora.adapter_transport=memory"], ["m2po_sk"], None, str(tmp_path), fast=False)
    moved[0].overrides = r.overrides  # the same run otherwise
    with pytest.raises(ValueError, match="different settings"):
        moved[0].finished_before()
    then["optim"]["lr"] *= 2  # a setting of its own day, changed
    (r.run_dir / "config.json").write_text(json.dumps(then))
    with pytest.raises(ValueError, match="different settings"):
        r.finished_before()


def test_provenance_names_the_checkouts_commit_and_invocations_accumulate(tmp_path):
    """Pre-registered experiments (docs/measurements/drift_ladder) show from ``experiment.json`` that
    every run started from a commit after the registration: each invocation appends its commit."""
    import subprocess

    from megatron_m2po.experiment import runner

    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    p = runner.provenance()
    assert p["commit"] == (head.stdout.strip() if head.returncode == 0 else None)
    assert p["started_utc"].endswith("+00:00")
    spec_file = tmp_path / runner.SPEC_FILE
    spec_file.write_text(json.dumps({"invocations": [{"commit": "a" * 40}]}))
    assert runner._earlier_invocations(spec_file) == [{"commit": "a" * 40}]
    spec_file.write_text("not json")
    assert runner._earlier_invocations(spec_file) == []


def test_metrics_tail_reads_only_complete_lines(tmp_path):
    p = tmp_path / "metrics.jsonl"
    t = MetricsTail(p)
    assert t.poll() is False and t.steps_done == 0
    first = json.dumps({"step": 4, "train/step": 0.0, "rollout/reward_mean": 0.3}) + "\n"
    second = json.dumps({"step": 8, "train/step": 1.0, "rollout/reward_mean": 0.5, "m2po/mask_frac": 0.01})
    p.write_text(first + json.dumps({"step": 5, "update/x": 1.0}) + "\n" + second[:20])
    assert t.poll() is True and t.steps_done == 1 and t.last["rollout/reward_mean"] == 0.3
    with open(p, "a") as f:
        f.write(second[20:] + "\n")
    assert t.poll() is True and t.steps_done == 2
    assert "reward 0.500" in t.describe("m2po") and "mask 0.010" in t.describe("m2po")


def test_figures_one_png_per_metric(tmp_path):
    runs = {"grpo_s0": _records([0.3, 0.4, 0.5], [0.3, 0.4, 0.5], [0.01, 0.02, 0.03]),
            "no_tr_sk": _records([0.3, 0.4, 0.2], [0.3, 0.4, 0.2]),
            "m2po_sk": _records([0.3, 0.4, 0.5], [0.3, 0.4, 0.5], [0.001, 0.002, 0.001], "m2po/mask_frac")}
    runs["m2po_sk"][-1]["m2po/m2_before"] = 0.05
    written = write_figures([(name, ARMS[name].label(8), ARMS[name].loss, [recs]) for name, recs in runs.items()],
                            tmp_path / "fig")
    names = {p.name for p in written}
    assert {"heldout_acc.png", "reward.png", "trust_region.png", "m2.png", "kl.png"} <= names
    assert "grad_norm.png" not in names  # no arm logged optim/grad_norm at step level
    assert all(p.stat().st_size > 5000 for p in written)


# ------------------------------------------------------------------------------ a real short run

FAST_SEED = 5  # the seed the fast run uses (one of the measured ones); tools/test_margins.py varies it


def fast_experiment_command(out: Path, seed: int = FAST_SEED) -> list[str]:
    """The fast two-arm run (M2PO s=k and GRPO s=k); tools/test_margins.py runs exactly this."""
    return [sys.executable, "-m", "megatron_m2po.cli", "experiment", "staleness", CONFIG, f"trainer.seed={seed}",
            "--fast", "--arms", "m2po_sk", "grpo_sk", "--out", str(out), "--parallel", "2", "--no-progress"]


def fast_experiment_statistics(out: Path) -> dict:
    """What the fast run's assertions look at, from its outputs.

    ``mask`` / ``clip``: M2PO's mask fraction and GRPO's clip fraction averaged over the steps
    whose tokens are all at least k updates old (the same stale data for both arms);
    ``late_minus_base``: M2PO's mean reward over its last three steps minus the base reward
    (pooled over every step trained on base-model rollouts)."""
    summary = json.loads((out / "summary.json").read_text())

    def stale_steps(arm):  # step records whose tokens are all at least k updates old
        return [r for r in step_records(read_metrics(out / arm)) if r["staleness/min"] >= FAST_K]

    m2_stale, grpo_stale = stale_steps("m2po_sk"), stale_steps("grpo_sk")
    mask = sum(r["m2po/mask_frac"] for r in m2_stale) / max(len(m2_stale), 1)
    clip = sum(r["loss/clip_frac"] for r in grpo_stale) / max(len(grpo_stale), 1)
    late = [r["rollout/reward_mean"] for r in step_records(read_metrics(out / "m2po_sk"))][-3:]
    return {"summary": summary, "n_stale": (len(m2_stale), len(grpo_stale)), "mask": mask, "clip": clip,
            "ratio": mask / clip if clip > 0 else float("inf"),
            "late_minus_base": sum(late) / len(late) - summary["spec"]["base_reward"]}


# Thresholds of the fast run (see the test's docstring for the measured distributions).
FAST_MIN_CLIP = 0.003
FAST_MAX_RATIO = 0.25
FAST_MIN_LATE_MINUS_BASE = -0.095


@pytest.mark.slow
def test_fast_experiment_m2po_masks_far_less_than_grpo_clips_and_does_not_collapse(tmp_path):
    """M2PO s=8 against GRPO s=8 on the same stale data, 8 steps at lr 5e-5, seed 5.

    Thresholds from the distributions over seeds 1-20 on a 2-core CPU
    (``python tools/test_margins.py staleness_fast --seeds 1-20``, 9.4 min):

    - ``clip`` (GRPO's clip fraction on stale steps): mean 0.0132, std 0.0043, min 0.0042; it is
      skewed, log-normal-like: log mean -4.386, log std 0.383, so exp(mean - 3.3 std) = 0.0035.
      Threshold > 0.003 (log z = 3.7): only there to make the ratio meaningful.
    - ``ratio`` (M2PO's mask fraction / GRPO's clip fraction): mean 0.030, std 0.034, max 0.108;
      mean + 3.3 std = 0.143. Threshold < 0.25. A broken M2PO (threshold 1e-4 instead of 0.04)
      gives 3.37 +- 0.67 (3 seeds): it fails.
    - ``late_minus_base`` (M2PO's reward over its last three steps minus the base reward): mean
      0.0196, std 0.0331, min -0.040. Threshold >= -0.095 = mean - 3.46 std (false failure
      about 3 in 10^4); a collapsing learner drops by 0.3 (the wrong-sign learner of the
      reward-rise test).
    """
    out = tmp_path / "exp"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = fast_experiment_command(out)[3:]  # `m2po experiment ...`, through tests/launcher.py
    p = launcher.run_captured(cmd, env=env, cwd=REPO, timeout=600)
    logs = "".join((out / a / "train.log").read_text()[-3000:] for a in ("m2po_sk", "grpo_sk")
                   if (out / a / "train.log").is_file())
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:] + logs
    st = fast_experiment_statistics(out)
    summary = st["summary"]
    arms = {a["arm"]: a for a in summary["arms"]}
    m2, grpo = arms["m2po_sk"], arms["grpo_sk"]
    assert m2["steps"] == grpo["steps"] == summary["spec"]["num_steps"]
    assert m2["staleness"] == grpo["staleness"] == FAST_K
    assert st["n_stale"][0] == st["n_stale"][1] >= 3
    # (3) on the same stale data M2PO masks far fewer tokens than GRPO clips.
    assert st["clip"] > FAST_MIN_CLIP and st["ratio"] < FAST_MAX_RATIO, (st["mask"], st["clip"])
    # M2PO at s=k does not collapse: its reward on stale data stays near the base model's (the
    # base reward pools every step trained on base-model rollouts; a collapse drops far below).
    assert st["late_minus_base"] >= FAST_MIN_LATE_MINUS_BASE, st["late_minus_base"]
    # a finished experiment is skipped on re-run and the report is rebuilt
    p2 = launcher.run_captured(cmd, env=env, cwd=REPO, timeout=120)
    assert p2.returncode == 0 and "| M2PO s=8 |" in p2.stdout, p2.stderr[-2000:]
    assert (out / "figures" / "trust_region.png").is_file()


def test_the_distillation_arms_are_their_core_arm_plus_the_teacher(tmp_path):
    """``grpo_distill_s0`` / ``m2po_distill_sk`` (docs/measurements/distill_tiny) run exactly as
    ``grpo_s0`` / ``m2po_sk`` of the same seed, with on-policy distillation from the tiny teacher
    added: the paired comparison differs in nothing else."""
    runs, _ = plan(CONFIG, ["optim.lr=2e-4"], ["grpo_s0", "grpo_distill_s0", "m2po_sk", "m2po_distill_sk"], None,
                   str(tmp_path), fast=False)
    by = {r.arm.name: dict(o.split("=", 1) for o in r.overrides) for r in runs}
    for core, arm in (("grpo_s0", "grpo_distill_s0"), ("m2po_sk", "m2po_distill_sk")):
        a, b = by[arm], by[core]
        extra = {k: v for k, v in a.items() if k.startswith("algo.distill.")}
        assert extra == {"algo.distill.teacher": "tiny-teacher", "algo.distill.coef": "1", "algo.distill.mode": "megatron"}
        assert {k: v for k, v in a.items() if k not in extra and k != "trainer.run_dir"} == \
            {k: v for k, v in b.items() if k != "trainer.run_dir"}
        assert load_config(CONFIG, [o for o in runs if o.arm.name == arm][0].overrides).algo.distill.coef == 1
