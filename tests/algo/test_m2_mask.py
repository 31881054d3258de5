"""m2po_mask (single process) against literal loop references with exact arithmetic."""

import math

import pytest
import torch

from megatron_m2po.algo.m2_mask import m2po_mask
from m2_reference import cap_rule, random_case, remove_rule


def _check(got, stats, ref):
    assert torch.equal(got, ref["keep"])
    assert stats.n_trust == ref["n_trust"]
    assert stats.n_masked == ref["n_masked"]
    assert stats.threshold_value == ref["threshold_value"]
    assert stats.mask_frac == pytest.approx(ref["mask_frac"], rel=1e-12, abs=0)
    assert stats.m2_before == pytest.approx(ref["m2_before"], rel=1e-12, abs=1e-24)
    assert stats.m2_after == pytest.approx(ref["m2_after"], rel=1e-12, abs=1e-24)


def test_remove_rule_matches_literal_algorithm_1_on_600_random_cases():
    g = torch.Generator().manual_seed(1234)
    kinds = {"masked_some": 0, "masked_none": 0, "all_masked": 0, "empty_T": 0, "tie_cut": 0}
    for _ in range(600):
        delta, adv, valid, tau, key = random_case(g)
        keep, stats = m2po_mask(delta, adv, valid, threshold=tau, order_key=key)
        ref = remove_rule(delta, adv, valid, tau, key)
        _check(keep, stats, ref)
        kinds["empty_T"] += ref["n_trust"] == 0
        kinds["masked_none"] += ref["n_trust"] > 0 and ref["n_masked"] == 0
        kinds["all_masked"] += ref["n_trust"] > 0 and ref["n_masked"] == ref["n_trust"]
        kinds["masked_some"] += 0 < ref["n_masked"] < ref["n_trust"]
        if 0 < ref["n_masked"] < ref["n_trust"]:
            tv = ref["threshold_value"]
            d = delta.double().clamp(-20, 20)
            removed_same = ((d.square() == tv) & valid & ~ref["keep"]).any()
            kinds["tie_cut"] += bool(removed_same)
    # The generator must actually exercise every regime.
    assert all(v >= 10 for v in kinds.values()), kinds


def test_cap_rule_matches_literal_port_of_released_loop_on_500_random_cases():
    g = torch.Generator().manual_seed(99)
    n_masked = 0
    for _ in range(500):
        delta, adv, valid, tau, _ = random_case(g)
        keep, stats = m2po_mask(delta, adv, valid, threshold=tau, rule="cap")
        ref = cap_rule(delta, adv, valid, tau)
        _check(keep, stats, ref)
        n_masked += ref["n_masked"] > 0
    assert n_masked > 100


def test_hand_example_remove_and_cap():
    # v over T = [0.01, 0.04, 0.09, 0.16, 0.25] (deltas 0.1 .. 0.5 with A > 0), tau = 0.04.
    # remove: prefix means 0.01, 0.025, 0.0467 -> keep 2 tokens, mask 3; threshold_value 0.04.
    # cap: capped means with c = 0.01: 0.01; c = 0.04: (0.01 + 4 * 0.04) / 5 = 0.034;
    #      c = 0.09: (0.05 + 3 * 0.09) / 5 = 0.064 > 0.04 -> c = 0.04, mask 3 (same tokens here).
    delta = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, -0.3, 0.7], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])  # last two outside T
    valid = torch.ones(7, dtype=torch.bool)
    keep, st = m2po_mask(delta, adv, valid, threshold=0.04)
    assert keep.tolist() == [True, True, False, False, False, True, True]
    assert (st.n_trust, st.n_masked) == (5, 3)
    assert st.m2_before == pytest.approx(0.11) and st.m2_after == pytest.approx(0.025)
    assert st.threshold_value == pytest.approx(0.04) and st.mask_frac == pytest.approx(3 / 7)
    keep_c, st_c = m2po_mask(delta, adv, valid, threshold=0.04, rule="cap")
    assert keep_c.tolist() == keep.tolist() and st_c.threshold_value == pytest.approx(0.04)
    # tau = 0.02: remove keeps [0.01] (mean 0.025 > 0.02 with two); cap: c = 0.01 -> 0.01 <= 0.02,
    # c = 0.04 -> 0.034 > 0.02 -> c = 0.01: also one kept.
    keep, st = m2po_mask(delta, adv, valid, threshold=0.02)
    assert keep.tolist() == [True, False, False, False, False, True, True]
    # Where the rules differ: v = [0.01, 0.02, 0.03, 0.3, 0.3], tau = 0.1. remove: prefix means
    # 0.01, 0.015, 0.02, 0.09, 0.132 -> keep 4 (one of the tied 0.3). cap: c = 0.03 ->
    # (0.06 + 2 * 0.03) / 5 = 0.024; c = 0.3 -> 0.66 / 5 = 0.132 > 0.1 -> c = 0.03, both 0.3 masked.
    d2 = torch.tensor([0.01, 0.02, 0.03, 0.3, 0.3], dtype=torch.float64).sqrt()
    a2 = torch.ones(5)
    v2 = torch.ones(5, dtype=torch.bool)
    k_r, s_r = m2po_mask(d2, a2, v2, threshold=0.1)
    k_c, s_c = m2po_mask(d2, a2, v2, threshold=0.1, rule="cap")
    assert k_r.tolist() == [True, True, True, True, False]  # the tie at 0.3: the lower index is kept
    assert k_c.tolist() == [True, True, True, False, False]
    assert s_c.threshold_value == pytest.approx(0.03) and s_r.threshold_value == pytest.approx(0.3)


def test_ties_at_boundary_follow_order_key():
    # 6 tied tokens v = 0.25 plus 4 tokens v = 2^-20; tau = 0.1 -> keep k with
    # (4 * 2^-20 + 0.25 j) / (4 + j) <= 0.1 -> j <= 2.67 -> 2 of the 6 ties kept.
    delta = torch.tensor([0.5] * 6 + [2.0**-10] * 4)
    adv = torch.ones(10)
    valid = torch.ones(10, dtype=torch.bool)
    key = torch.tensor([50, 10, 40, 5, 30, 20, 1, 2, 3, 4])
    keep, st = m2po_mask(delta, adv, valid, threshold=0.1, order_key=key)
    assert keep[:6].tolist() == [False, True, False, True, False, False]  # keys 5 and 10 kept
    assert st.n_masked == 4
    keep, _ = m2po_mask(delta, adv, valid, threshold=0.1)  # default: lowest index first
    assert keep[:6].tolist() == [True, True, False, False, False, False]
    dup = key.clone()
    dup[0] = 10  # tie keys 5, 10, 10, ...: the cut after 2 falls between the two 10s -> ambiguous
    with pytest.raises(ValueError, match="order_key 10"):
        m2po_mask(delta, adv, valid, threshold=0.1, order_key=dup)
    dup[3] = 60  # tie keys 10, 10, 20, ...: both 10s kept, not ambiguous
    keep, _ = m2po_mask(delta, adv, valid, threshold=0.1, order_key=dup)
    assert keep[:6].tolist() == [True, True, False, False, False, False]


def test_special_regimes():
    valid = torch.tensor([True, True, True, True, False])
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0])
    # threshold 0: every T token masked, zero deltas (outside T) kept.
    delta = torch.tensor([1e-30, -0.2, 0.0, 3.0, 5.0])
    keep, st = m2po_mask(delta, adv, valid, threshold=0.0)
    assert keep.tolist() == [False, False, True, False, False] and st.n_trust == 3 and st.threshold_value == 0.0
    keep, st = m2po_mask(delta, adv, valid, threshold=0.0, rule="cap")
    assert keep.tolist() == [False, False, True, False, False] and st.n_masked == 3
    # all-zero deltas: empty trust region, nothing masked.
    keep, st = m2po_mask(torch.zeros(5), adv, valid)
    assert keep.tolist() == valid.tolist() and st.n_trust == 0 and st.m2_before == 0.0 and st.mask_frac == 0.0
    # clamp: delta 1e4 counts as 20 (v = 400).
    keep, st = m2po_mask(torch.tensor([1e4, 0.1]), torch.ones(2), torch.ones(2, dtype=torch.bool), threshold=1e3)
    assert st.m2_before == pytest.approx((400 + 0.01) / 2) and keep.all()
    # no tokens at all
    keep, st = m2po_mask(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.bool))
    assert keep.numel() == 0 and st.n_valid == 0 and st.mask_frac == 0.0


def test_errors_name_the_problem():
    d, a, v = torch.tensor([0.1, float("nan"), float("inf")]), torch.ones(3), torch.tensor([True, True, False])
    with pytest.raises(ValueError, match=r"1 non-finite values on valid tokens, at indices \[1\]"):
        m2po_mask(d, a, v)
    m2po_mask(torch.tensor([0.1, 0.2, float("nan")]), a, v)  # invalid tokens may hold anything
    with pytest.raises(ValueError, match="threshold=-0.1"):
        m2po_mask(torch.zeros(3), a, v, threshold=-0.1)
    with pytest.raises(ValueError, match="rule='paper'"):
        m2po_mask(torch.zeros(3), a, v, rule="paper")
    with pytest.raises(ValueError, match="shapes"):
        m2po_mask(torch.zeros(3), torch.ones(2), v)
    with pytest.raises(ValueError, match="order_key must be >= 0"):
        m2po_mask(torch.zeros(3), a, v, order_key=torch.tensor([0, -1, 2]))


def test_fast_path_scales_and_is_vectorised():
    # 2e5 tokens: the reference loop would be slow; check invariants of the result instead.
    g = torch.Generator().manual_seed(5)
    n = 200_000
    delta = torch.distributions.StudentT(2.0).sample((n,)) * 0.2
    adv = torch.randn(n, generator=g)
    valid = torch.rand(n, generator=g) < 0.95
    keep, st = m2po_mask(delta, adv, valid)
    d = delta.double()
    tr = valid & (((adv > 0) & (d > 0)) | ((adv < 0) & (d < 0)))
    v = d.square()
    kept = tr & keep
    assert 0 < st.n_masked < st.n_trust
    assert v[kept].mean().item() <= 0.04 and math.isclose(v[kept].mean().item(), st.m2_after, rel_tol=1e-9)
    # Maximality: adding back the smallest removed value breaks the budget.
    smallest_removed = v[tr & ~keep].min()
    assert ((v[kept].sum() + smallest_removed) / (kept.sum() + 1)).item() > 0.04
    assert v[kept].max().item() == st.threshold_value <= smallest_removed.item()
