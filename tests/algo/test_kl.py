"""Reference-model KL (algo/kl.py): the three estimators, verl's k3 clamps, the loss term and its
gradient, and the metrics, against values computed by hand."""

import math

import pytest
import torch

from megatron_m2po.algo.kl import kl_penalty, penalty_share, reference_kl
from megatron_m2po.config import KLConfig

# d = logp - ref = 0.2, -0.5, 0; the fourth token is not a loss token (its -inf reference is ignored)
LOGP = [-1.0, -2.0, -0.5, -3.0]
REF = [-1.2, -1.5, -0.5, float("-inf")]
MASK = [1, 1, 1, 0]
K1 = [0.2, -0.5, 0.0]
K2 = [0.02, 0.125, 0.0]
K3 = [math.exp(-0.2) + 0.2 - 1, math.exp(0.5) - 0.5 - 1, 0.0]  # 0.0187308, 0.1487213, 0


@pytest.mark.parametrize("estimator,expected", [("k1", K1), ("k2", K2), ("k3", K3)])
def test_estimators_by_hand(estimator, expected):
    got = kl_penalty(torch.tensor(LOGP[:3], dtype=torch.float64), torch.tensor(REF[:3], dtype=torch.float64),
                     estimator)
    assert got.tolist() == pytest.approx(expected, abs=1e-12)


def test_k3_clamps_as_verl():
    """verl low_var_kl: ref - logp clamped to [-20, 20] before exp, the estimate to [-10, 10]; no
    gradient beyond a clamp."""
    logp = torch.tensor([0.0, -30.0, -5.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-30.0, 0.0, -5.0 + 2.0], dtype=torch.float64)
    k3 = kl_penalty(logp, ref, "k3")
    assert k3[0].item() == 10.0  # exp(-20) + 20 - 1 = 19.0 clamped to 10
    assert k3[1].item() == 10.0  # exp(20) - 20 - 1 clamped to 10
    assert k3[2].item() == pytest.approx(math.exp(2.0) - 2.0 - 1.0)  # 4.389, inside both clamps
    k3.sum().backward()
    assert logp.grad.tolist()[:2] == [0.0, 0.0]
    assert logp.grad[2].item() == pytest.approx(1.0 - math.exp(2.0))
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(logp, ref, "k4")


def test_loss_term_gradient_and_metrics_by_hand():
    """term = coef * sum(mask * k3) / N with the caller's denominator N (here 5: tokens of the
    whole mini-batch, not this micro-batch's 3); d term / d logp = coef / N * (1 - exp(-d))."""
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    term, m = reference_kl(logp, torch.tensor(REF, dtype=torch.float64), torch.tensor(MASK), denominator=5.0,
                           settings=KLConfig(coef=0.1, estimator="k3"))
    assert term.item() == pytest.approx(0.1 * sum(K3) / 5.0, abs=1e-15)  # 0.0033490405
    term.backward()
    expected = [0.1 / 5.0 * (1.0 - math.exp(-0.2)), 0.1 / 5.0 * (1.0 - math.exp(0.5)), 0.0, 0.0]
    assert logp.grad.tolist() == pytest.approx(expected, abs=1e-15)
    assert m["ref/kl"].value == pytest.approx(sum(K3) / 3) and m["ref/kl"].weight == 3.0
    assert m["ref/kl"].reduce == "mean"
    for k, vals in (("k1", K1), ("k2", K2), ("k3", K3)):
        assert m[f"ref/kl_{k}"].value == pytest.approx(sum(vals) / 3), k
    assert m["loss/kl"].reduce == "sum" and m["loss/kl"].value == pytest.approx(term.item())
    # the estimator chooses the term and ref/kl, never the per-estimator metrics
    term1, m1 = reference_kl(logp, torch.tensor(REF, dtype=torch.float64), torch.tensor(MASK), denominator=5.0,
                             settings=KLConfig(coef=0.1, estimator="k1"))
    assert term1.item() == pytest.approx(0.1 * sum(K1) / 5.0) and m1["ref/kl"].value == pytest.approx(-0.1)
    assert m1["ref/kl_k3"].value == m["ref/kl_k3"].value


def test_refuses_non_finite_reference_and_bad_denominator():
    ref = torch.tensor([-1.2, float("nan"), -0.5, -1.0])
    with pytest.raises(ValueError, match="1 non-finite reference log-probs on loss tokens, at token indices \\[1\\]"):
        reference_kl(torch.tensor(LOGP), ref, torch.tensor(MASK), denominator=5.0, settings=KLConfig(coef=0.1))
    with pytest.raises(ValueError, match="denominator=0"):
        reference_kl(torch.tensor(LOGP), torch.tensor(REF), torch.tensor(MASK), denominator=0,
                     settings=KLConfig(coef=0.1))


def test_penalty_share():
    assert penalty_share({"loss/kl": 0.01, "loss/policy": -0.03}) == pytest.approx(0.25)
    assert penalty_share({"loss/kl": 0.0, "loss/policy": 0.0}) == 0.0
