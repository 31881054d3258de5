"""``m2po experiment distill-report`` (experiment/distill_report.py): the registered endpoints and
criteria of docs/measurements/distill_tiny, computed from harvested runs built here with known
values (controls in the ladder's layout, distillation arms in their own), checked by hand."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from megatron_m2po.experiment import distill_report as D

SEEDS = (1234, 1235, 1236)


def _run(d: Path, *, early: float, late: float, rkl: float | None = None, done: bool = True) -> None:
    """256 steps of 4 updates, held-out evaluations every 5 steps: ``early`` up to update 512,
    ``late`` after 768, their mean between; a distillation run's reverse KL falls from ``rkl``."""
    recs = []
    for s in range(256):
        r = {"train/step": float(s), "step": (s + 1) * 4, "rollout/reward_mean": 0.5}
        if rkl is not None:
            r["distill/reverse_kl"] = rkl * (1 - s / 512)
        if (s + 1) % 5 == 0:
            u = (s + 1) * 4
            r["eval/synthetic/acc"] = early if u <= 512 else (late if u > 768 else (early + late) / 2)
        recs.append(r)
    d.mkdir(parents=True)
    with gzip.open(d / "metrics.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in recs) + "\n")
    if done:
        (d / "experiment_done.json").write_text("{}")


EARLY = {("grpo_s0", 0): (0.40, 0.42, 0.41), ("grpo_distill_s0", 0): (0.45, 0.46, 0.47),
         ("m2po_sk", 32): (0.40, 0.41, 0.42), ("m2po_distill_sk", 32): (0.41, 0.40, 0.42)}


def _tree(tmp_path: Path, missing: tuple = ()) -> tuple[Path, Path]:
    ladder, results = tmp_path / "ladder", tmp_path / "distill"
    where = {("grpo_s0", 0): ladder / "onpolicy" / "grpo_s0", ("m2po_sk", 32): ladder / "k32" / "m2po_sk",
             ("grpo_distill_s0", 0): results / "k0" / "grpo_distill_s0",
             ("m2po_distill_sk", 32): results / "k32" / "m2po_distill_sk"}
    for key, vals in EARLY.items():
        for i, s in enumerate(SEEDS):
            _run(where[key] / f"seed_{s}", early=vals[i], late=0.5 - (0.01 if "distill" in key[0] else 0.0),
                 rkl=0.2 if "distill" in key[0] else None, done=(key[0], s) not in missing)
    return results, ladder


def test_endpoints_and_criteria_by_hand(tmp_path):
    runs, missing = D.load(*_tree(tmp_path))
    assert missing == []
    p = D._diff(runs, 0, "early")
    d = [0.05, 0.04, 0.06]
    assert p.mean == pytest.approx(0.05) and p.se == pytest.approx((sum((x - 0.05) ** 2 for x in d) / 2) ** 0.5 / 3 ** 0.5)
    r = runs[("grpo_distill_s0", 0)][1234]
    assert r.late == pytest.approx(0.49) and r.rkl_first > r.rkl_last > 0
    v = {x.name: x.verdict for x in D.criteria(runs)}
    # k = 0: +0.05 over an SE of 0.0058: holds; k = 32: +0.0 (0.01, -0.01, 0.0): fails; late -0.01 every
    # seed (SE 0) is not above -2 SE = 0: D3 fails
    assert v == {"D1 (k = 0)": "holds", "D2 (k = 32)": "fails", "D3": "fails"}
    text = D.report(runs, missing)
    assert "| D1 (k = 0) | **holds** |" in text and "0.450 / 0.460 / 0.470" in text


def test_a_missing_run_is_named_and_its_criterion_not_testable(tmp_path):
    runs, missing = D.load(*_tree(tmp_path, missing=(("m2po_distill_sk", 1235), ("m2po_distill_sk", 1236))))
    assert missing == ["k=32 m2po_distill_sk seed 1235", "k=32 m2po_distill_sk seed 1236"]
    v = {x.name: x.verdict for x in D.criteria(runs)}
    assert v["D2 (k = 32)"] == "not testable" and v["D3"] == "not testable" and v["D1 (k = 0)"] == "holds"
    assert "**Not finished yet (2):**" in D.report(runs, missing)
