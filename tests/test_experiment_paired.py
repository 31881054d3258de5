"""Paired statistics, the late window and the lag correction (experiment/paired.py) against values
computed by hand."""

import math

import pytest

from megatron_m2po.experiment.paired import lag_corrected, late_window, paired, reward_by_generating_version


def test_paired_difference_and_its_standard_error_by_hand():
    a = {1234: 0.50, 1235: 0.60, 1236: 0.70}
    b = {1234: 0.45, 1235: 0.52, 1236: 0.68}
    p = paired(a, b)
    # d = 0.05, 0.08, 0.02; mean 0.05; sd = sqrt((0 + 0.0009 + 0.0009) / 2) = 0.03; se = 0.03 / sqrt(3)
    assert p.n == 3 and p.mean == pytest.approx(0.05)
    assert p.se == pytest.approx(0.03 / math.sqrt(3))
    assert p.exceeds(2.0) is True  # 0.05 > 2 x 0.0173
    # unpaired (Welch) would be sqrt(var_a / 3 + var_b / 3) = 0.0888: the shared seed effect counted as noise
    assert p.per_seed == pytest.approx({1234: 0.05, 1235: 0.08, 1236: 0.02})


def test_paired_uses_only_seeds_both_have_and_says_when_there_is_no_error():
    p = paired({1: 0.3, 2: float("nan"), 3: 0.1}, {1: 0.1, 2: 0.2, 4: 0.0})
    assert p.n == 1 and p.mean == pytest.approx(0.2) and p.se is None and p.exceeds() is None
    assert paired({}, {1: 1.0}).mean is None
    same = paired({1: 0.3, 2: 0.4}, {1: 0.2, 2: 0.3})  # every seed differs by 0.1: se 0
    assert same.se == pytest.approx(0.0, abs=1e-12) and same.exceeds() is True


def test_late_window_is_the_mean_over_the_last_quarter_of_updates():
    evals = [(20, 0.1), (500, 0.2), (768, 0.9), (780, 0.4), (1000, 0.6), (1024, 0.8)]
    assert late_window(evals, 1024) == pytest.approx((0.4 + 0.6 + 0.8) / 3)  # 768 is not after 768
    assert late_window(evals, 1024, frac=0.5) == pytest.approx((0.9 + 0.4 + 0.6 + 0.8) / 4)
    assert late_window([(10, 0.5)], 1024) is None
    with pytest.raises(ValueError):
        late_window(evals, 1024, frac=0)


def _steps(rewards, updates=4):
    return [{"step": (s + 1) * updates, "train/step": s, "rollout/reward_mean": r} for s, r in enumerate(rewards)]


def test_reward_is_indexed_by_the_version_that_generated_it():
    # k = 8, 4 updates a step: steps 0, 1, 2 train on base rollouts (versions 0, 4 - 8 < 0, 8 - 8 = 0),
    # step 3 on version 4, step 4 on version 8
    by_v = reward_by_generating_version(_steps([0.1, 0.2, 0.3, 0.4, 0.5]), k=8)
    assert by_v == pytest.approx({0: 0.2, 4: 0.4, 8: 0.5})
    on = reward_by_generating_version(_steps([0.1, 0.2, 0.3, 0.4, 0.5]), k=0)
    assert on == pytest.approx({0: 0.1, 4: 0.2, 8: 0.3, 12: 0.4, 16: 0.5})
    assert reward_by_generating_version([{"step": 4, "update/x": 1.0}], k=0) == {}


def test_lag_correction_compares_equal_generating_versions():
    # A stale arm that learns exactly as the on-policy one, read k updates late: at the same update
    # it trails, at the same generating version it ties.
    onpolicy = [0.1 + 0.01 * s for s in range(40)]
    stale = [0.1] * 2 + onpolicy[:38]  # k = 8 = two steps late
    on_v = reward_by_generating_version(_steps(onpolicy), k=0)
    st_v = reward_by_generating_version(_steps(stale), k=8)
    a, b = lag_corrected(st_v, on_v)
    assert a == pytest.approx(b)
    same_update = sum(stale[-10:]) / 10 - sum(onpolicy[-10:]) / 10
    assert same_update == pytest.approx(-0.02)  # the "deficit" of reading the curve at the same update
    assert lag_corrected({0: 1.0}, {4: 1.0}) == (None, None)
