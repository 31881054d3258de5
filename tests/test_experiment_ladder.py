"""``m2po experiment ladder-report`` (experiment/ladder.py): the drift ladder's registered endpoints
and criteria, computed from harvested runs built here with known values, so every number and
verdict below is checked by hand against PREREGISTRATION.md's wording."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from megatron_m2po.experiment import ladder as L

SEEDS = (1234, 1235, 1236)
ON = {1234: 0.50, 1235: 0.52, 1236: 0.48}               # on-policy late-window accuracy per seed
LATE = {  # (arm, k) -> late accuracy offset from on-policy, per seed
    ("grpo_sk", 8): (-0.004, 0.002, -0.001), ("grpo_sk", 32): (-0.05, -0.06, -0.055),
    ("grpo_sk", 128): (-0.08, -0.09, -0.085),
    ("no_tr_sk", 8): (0.0, 0.001, -0.002), ("no_tr_sk", 32): (-0.01, 0.0, -0.005),
    ("no_tr_sk", 128): (-0.30, -0.31, -0.02),
    ("m2po_sk", 8): (0.001, -0.001, 0.0), ("m2po_sk", 32): (-0.008, 0.004, 0.001),
    ("m2po_sk", 128): (-0.012, 0.005, 0.002),
}
DRIFT = {8: 1.0e-3, 32: 4.0e-3, 128: 7.0e-3}


def _run(d: Path, *, late: float, k: int, loss: str, collapse: bool = False, early: float = 0.4,
         tr: float = 0.0, done: bool = True) -> None:
    """256 steps of 4 updates; held-out evaluations every 5 steps: ``late`` after update 768 (and
    0.6 once earlier, the best, when ``collapse``: final < 0.5 x best); rewards ``early`` while the
    rollouts come from versions <= 384, 0.45 after."""
    recs = []
    for s in range(256):
        r = {"train/step": float(s), "step": (s + 1) * 4, "staleness/min": k, "staleness/max": k}
        gen = max(0, s * 4 - k)  # the generating version of this step's rollouts (stale_k, 4 updates a step)
        r["rollout/reward_mean"] = early if gen <= 384 else 0.45
        if (s + 1) % 5 == 0:
            u = (s + 1) * 4
            r["eval/synthetic/acc"] = late if u > 768 else (0.6 if collapse and s == 99 else late - 0.01)
        if loss == "grpo":
            r["loss/clip_frac"] = tr
        if loss == "m2po":
            r["m2po/mask_frac"] = tr
        recs.append(r)
    d.mkdir(parents=True)
    with gzip.open(d / "metrics.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in recs) + "\n")
    if done:
        (d / "experiment_done.json").write_text("{}")


def _results(tmp_path: Path, drop: tuple = ()) -> Path:
    root = tmp_path / "results"
    for i, s in enumerate(SEEDS):
        on = root / "onpolicy" / "grpo_s0" / f"seed_{s}"
        _run(on, late=ON[s], k=0, loss="grpo")
        (on / "drift").mkdir()
        (on / "drift" / "drift.json").write_text(json.dumps(
            {"k": {str(k): {"mean_kl": v * (1 + 0.01 * i), "pairs": []} for k, v in DRIFT.items()}}))
        for (arm, k), offs in LATE.items():
            loss = L.METHODS[arm][0]
            collapse = arm == "no_tr_sk" and k == 128 and i < 2
            _run(root / f"k{k}" / arm / f"seed_{s}", late=ON[s] + offs[i], k=k, loss=loss, collapse=collapse,
                 early=0.42 if arm == "no_tr_sk" else 0.40, tr={"grpo": 0.01, "m2po": 0.0005}.get(loss, 0.0),
                 done=(arm, k, s) not in drop)
    return root


def test_every_endpoint_and_criterion_by_hand(tmp_path):
    lad = L.load(_results(tmp_path))
    assert lad.missing == []
    on = {s: r.late for s, r in lad.runs[("grpo_s0", 0)].items()}
    assert on == pytest.approx(ON)
    p = L.primary(lad, "grpo_sk", 32)
    d = [-0.05, -0.06, -0.055]
    mean = sum(d) / 3
    se = (sum((x - mean) ** 2 for x in d) / 2) ** 0.5 / 3 ** 0.5
    assert p.mean == pytest.approx(mean) and p.se == pytest.approx(se) and p.n == 3
    m, dse, n = L.drift_stat(lad, 32)
    assert n == 3 and m == pytest.approx(4.0e-3 * 1.01) and dse > 0
    # the stale GRPO clips 1 %, M2PO masks 0.05 %: a twentieth
    assert lad.runs[("grpo_sk", 32)][1234].tr_frac == pytest.approx(0.01)
    # lag correction: rewards compared at the same generating versions (the last quarter: 0.45 both)
    lc = L.lag_corrected(lad, "grpo_sk", 128)
    assert lc.mean == pytest.approx(0.0) and lc.n == 3
    # no trust region collapses at k = 128 in seeds 1234 and 1235 (final 0.2 < 0.5 x best 0.6)
    assert [lad.runs[("no_tr_sk", 128)][s].collapsed for s in SEEDS] == [True, True, False]
    v1, first = L.p1(lad)
    assert v1.verdict == "holds" and first == {32: True, 128: True}, v1
    assert L.p2(lad).verdict == "holds"  # k = 128: early reward 0.42 >= 0.40 and collapsed, 2 of 3
    assert L.p3(lad, first).verdict == "holds", L.p3(lad, first)
    assert L.breaks_at(lad, "grpo_sk") == "breaks at k=32 (D = 4.04e-03)"
    assert L.breaks_at(lad, "no_tr_sk").startswith("breaks at k=128")
    assert L.breaks_at(lad, "m2po_sk") == "does not break up to D(128)"
    text = L.report(lad)
    assert "| P1 | **holds** |" in text and "| stale GRPO | 0.450 / 0.460 / 0.425 |" in text
    assert L.figure(lad, tmp_path / "ladder.png") and (tmp_path / "ladder.png").stat().st_size > 0


def test_unfinished_runs_are_missing_and_criteria_say_not_testable(tmp_path, capsys):
    from megatron_m2po.cli import main

    root = _results(tmp_path, drop=(("m2po_sk", 32, 1236), ("grpo_sk", 128, 1235), ("grpo_sk", 128, 1236)))
    lad = L.load(root)
    assert lad.missing == ["k=32 m2po_sk seed 1236", "k=128 grpo_sk seed 1235", "k=128 grpo_sk seed 1236"]
    v1, first = L.p1(lad)
    assert v1.verdict == "not testable" and first[128] is None
    assert L.p3(lad, first).verdict == "not testable"
    assert L.breaks_at(lad, "grpo_sk") == "breaks at k=32 (D = 4.04e-03)"  # k=32 is complete
    assert main(["experiment", "ladder-report", str(root), "--out", str(tmp_path / "r.md")]) == 0
    assert "**Not finished yet (3):** k=32 m2po_sk seed 1236" in (tmp_path / "r.md").read_text()
    assert main(["experiment", "ladder-report", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().out


def test_runs_of_different_base_weights_are_never_paired(tmp_path):
    """Amendment 1: a run's environment is the base-weights fingerprint in its experiment_done.json, or
    for older runs the label environments.json gives it; the report is one per environment, each
    pairing only its own runs. Here on-policy and k=32 M2PO seed 1234 ran from another base: M2PO's
    seed 1234 is paired with nothing in either environment, and a rerun of the on-policy seed under
    reruns/ in M2PO's environment pairs it there."""
    root = _results(tmp_path)
    (root / "environments.json").write_text(json.dumps({"runs": {"k32/m2po_sk/seed_1234": "B"}}))
    done = root / "k32" / "m2po_sk" / "seed_1235" / "experiment_done.json"
    done.write_text(json.dumps({"environment": {"base": "B"}}))  # a recorded fingerprint wins
    envs = L.environments(root)
    assert envs == ["unknown", "B"]
    a, b = L.load(root, "unknown"), L.load(root, "B")
    assert L.primary(a, "m2po_sk", 32).n == 1 and L.primary(b, "m2po_sk", 32).n == 0
    assert sorted(b.runs[("m2po_sk", 32)]) == [1234, 1235] and "on-policy seed 1234" in b.missing
    _run(root / "reruns" / "onpolicy" / "grpo_s0" / "seed_1234", late=ON[1234], k=0, loss="grpo")
    (root / "reruns" / "onpolicy" / "grpo_s0" / "seed_1234" / "experiment_done.json").write_text(
        json.dumps({"environment": {"base": "B"}}))
    b = L.load(root, "B")
    p = L.primary(b, "m2po_sk", 32)
    assert p.n == 1 and p.per_seed == pytest.approx({1234: LATE[("m2po_sk", 32)][0]})
    text = L.report(b)
    assert text.startswith("# The drift ladder: report, environment B")


def test_a_runs_environment_is_its_cpu_and_base_weights(tmp_path):
    from megatron_m2po.experiment.environment import run_environment, weights_fingerprint

    m = tmp_path / "model"
    m.mkdir()
    (m / "model.safetensors").write_bytes(b"\x00" * 64)
    fp = weights_fingerprint(m)
    assert len(fp) == 16 and weights_fingerprint(tmp_path / "none") == "unknown"
    (m / "model.safetensors").write_bytes(b"\x00" * 63 + b"\x01")
    assert weights_fingerprint(m) != fp
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": {"hf_path": str(m)}}))
    env = run_environment(run)
    assert env["base"] == weights_fingerprint(m) and env["base_path"] == str(m) and env["cpu"]
