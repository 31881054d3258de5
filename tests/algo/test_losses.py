"""Each policy loss: value and gradient against numbers computed by hand on a tiny example.

The example (5 loss tokens + 1 padding token, denominator 10):

    r     = [1.5, 0.5, 1.1, 0.9, 4.0]         (logp = behav_logp + ln r)
    A     = [1,  -1,  -2,   3,  -1]
    r * A = [1.5, -0.5, -2.2, 2.7, -4.0]      sum -2.5

The padding token holds NaN log-probs and -inf behaviour log-probs: it must be ignored and get a
zero gradient.
"""

import math

import pytest
import torch

from megatron_m2po.algo.losses import LOSSES, compute_policy_loss, get_loss, tis_weights
from megatron_m2po.algo.metrics import reduce_metrics
from megatron_m2po.config import AlgoConfig, CISPOConfig, GRPOConfig, GSPOConfig

R = [1.5, 0.5, 1.1, 0.9, 4.0]
A = [1.0, -1.0, -2.0, 3.0, -1.0]
BEHAV = [-1.0, -2.0, -0.5, -1.0, -3.0]
D = 10.0


def _inputs(adv=A):
    logp = torch.tensor([b + math.log(r) for b, r in zip(BEHAV, R)] + [float("nan")], dtype=torch.float64,
                        requires_grad=True)
    behav = torch.tensor(BEHAV + [float("-inf")], dtype=torch.float64)
    adv = torch.tensor(list(adv) + [float("nan")], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.uint8)
    return logp, behav, adv, mask


def _run(name, cfg=None, adv=A, **kw):
    logp, behav, adv_t, mask = _inputs(adv)
    loss, metrics = compute_policy_loss(name, logp, behav, adv_t, mask, denominator=D, algo_cfg=cfg or AlgoConfig(),
                                        **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[5].item() == 0.0  # padding
    return loss.item(), grad[:5].tolist(), reduce_metrics(metrics)


def test_no_tr():
    loss, grad, m = _run("no_tr")
    assert loss == pytest.approx(2.5 / 10)  # -(sum r A) / 10
    assert grad == pytest.approx([-0.15, 0.05, 0.22, -0.27, 0.4])  # d/dlogp = -r A / 10
    # shared metrics: ratio mean 8 / 5, max 4; k1 = mean(-ln r), k3 = mean(r - 1 - ln r)
    ln_prod = math.log(1.5 * 0.5 * 1.1 * 0.9 * 4.0)
    assert m["policy/ratio_mean"] == pytest.approx(1.6) and m["policy/ratio_max"] == pytest.approx(4.0)
    assert m["policy/kl_k1"] == pytest.approx(-ln_prod / 5)
    assert m["policy/kl_k3"] == pytest.approx((8.0 - 5.0 - ln_prod) / 5)
    m2 = sum(math.log(r) ** 2 for r in (1.5, 0.5, 1.1, 0.9, 4.0)) / 5  # mean (log r)^2 over loss tokens
    assert m["policy/m2"] == pytest.approx(m2)
    assert m["loss/policy"] == pytest.approx(0.25)


def test_grpo_clip_higher_and_dual_clip():
    cfg = AlgoConfig(grpo=GRPOConfig(eps_low=0.2, eps_high=0.28))
    # clip(r) = [1.28, 0.8, 1.1, 0.9, 1.28]; clip(r) A = [1.28, -0.8, -2.2, 2.7, -1.28]
    # min(r A, clip(r) A) = [1.28, -0.8, -2.2, 2.7, -4.0], sum -3.02; tokens 0, 1 clipped.
    loss, grad, m = _run("grpo", cfg)
    assert loss == pytest.approx(0.302)
    assert grad == pytest.approx([0.0, 0.0, 0.22, -0.27, 0.4])
    assert m["loss/clip_frac"] == pytest.approx(2 / 5)
    # dual clip c = 3: token 4 (A < 0): max(-4.0, 3 * -1) = -3 -> sum -2.02, no gradient there.
    loss, grad, m = _run("grpo", AlgoConfig(grpo=GRPOConfig(eps_low=0.2, eps_high=0.28, dual_clip=3.0)))
    assert loss == pytest.approx(0.202)
    assert grad == pytest.approx([0.0, 0.0, 0.22, -0.27, 0.0])
    assert m["loss/dual_clip_frac"] == pytest.approx(1 / 5) and m["loss/clip_frac"] == pytest.approx(2 / 5)


def test_m2po_with_keep_and_tis():
    keep = torch.tensor([True, True, False, True, True, False])
    # keep r A = [1.5, -0.5, 0, 2.7, -4.0], sum -0.3
    loss, grad, _ = _run("m2po", keep=keep)
    assert loss == pytest.approx(0.03)
    assert grad == pytest.approx([-0.15, 0.05, 0.0, -0.27, 0.4])
    # TIS weights [1, 2, 1, 0.5, 1] (pad: 7, ignored): [1.5, -1.0, 0, 1.35, -4.0], sum -2.15
    tis = torch.tensor([1.0, 2.0, 1.0, 0.5, 1.0, 7.0], dtype=torch.float64)
    loss, grad, m = _run("m2po", keep=keep, tis_weight=tis)
    assert loss == pytest.approx(0.215)
    assert grad == pytest.approx([-0.15, 0.1, 0.0, -0.135, 0.4])
    assert m["tis/weight_mean"] == pytest.approx(5.5 / 5)
    with pytest.raises(ValueError, match="needs keep="):
        _run("m2po")


def test_gspo_sequence_ratio():
    cfg = AlgoConfig(gspo=GSPOConfig(eps_low=0.2, eps_high=0.2))
    adv = [1.0, -0.5, -2.0, 3.0, -1.0]
    seq = torch.tensor([0, 0, 7, 7, 7, 7])
    # s0 = (1.5 * 0.5) ** (1/2) = 0.8660 (inside [0.8, 1.2]); s1 = (1.1 * 0.9 * 4) ** (1/3) = 1.5821 (> 1.2)
    s0, s1 = 0.75**0.5, 3.96 ** (1 / 3)
    # token objectives: [s0, -0.5 s0, -2 s1 (unclipped), min(3 s1, 3 * 1.2) = 3.6 (clipped), -s1]
    loss, grad, m = _run("gspo", cfg, adv=adv, seq_index=seq)
    assert loss == pytest.approx(-(s0 - 0.5 * s0 - 2 * s1 + 3.6 - s1) / 10)
    # d s_j / d logp_i = s_j / L_j. seq 0: -(1 - 0.5) s0 / 2 / 10; seq 1 (token 3 clipped):
    # -(-2 - 1) s1 / 3 / 10 = s1 / 10 for each of its three tokens, token 3 included.
    g0 = -0.5 * s0 / 20
    assert grad == pytest.approx([g0, g0, s1 / 10, s1 / 10, s1 / 10])
    assert m["loss/clip_frac"] == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="needs seq_index="):
        _run("gspo", cfg)


def _gspo_split(rank, world_size, held):
    """This rank's part of test_gspo_sequence_ratio's tokens (the ``held`` indices), sequence ids
    0..1 shared with the other rank: its loss and the gradient of the summed loss at its tokens."""
    cfg = AlgoConfig(gspo=GSPOConfig(eps_low=0.2, eps_high=0.2))
    logp, behav, adv, mask = _inputs([1.0, -0.5, -2.0, 3.0, -1.0])
    idx = torch.tensor(held[rank])
    seq = torch.tensor([0, 0, 1, 1, 1, 1])[idx]
    mine = logp.detach()[idx].clone().requires_grad_()
    loss, m = compute_policy_loss("gspo", mine, behav[idx], adv[idx], mask[idx], denominator=D, algo_cfg=cfg,
                                  seq_index=seq, seq_group=torch.distributed.group.WORLD, num_seqs=2)
    loss.backward()
    return loss.item(), mine.grad.tolist(), m["gspo/seq_ratio_mean"].value


def test_gspo_sums_a_sequence_over_its_context_parallel_parts():
    """A sequence split over two ranks (as context parallelism splits it) gets the one-rank
    sequence ratio: the ranks' losses add up to test_gspo_sequence_ratio's, and each token's
    gradient of the summed loss is the one-rank gradient (the backward sums over the group too).
    Rank 1 holds no token of sequence 0's loss but the padding row."""
    from megatron_m2po.standins.dist_testing import run_distributed

    held = [[0, 1, 3], [2, 4, 5]]
    s0, s1 = 0.75**0.5, 3.96 ** (1 / 3)
    (l0, g0, r0), (l1, g1, r1) = run_distributed(_gspo_split, 2, args=(held,), timeout_s=60)
    assert l0 + l1 == pytest.approx(-(s0 - 0.5 * s0 - 2 * s1 + 3.6 - s1) / 10)
    g = -0.5 * s0 / 20
    want = [g, g, s1 / 10, s1 / 10, s1 / 10, 0.0]
    assert g0 + g1 == pytest.approx([want[i] for i in held[0] + held[1]])
    assert r0 == r1 == pytest.approx((s0 + s1) / 2)


def test_cispo():
    cfg = AlgoConfig(cispo=CISPOConfig(eps_high=2.0))
    # sg(min(r, 3)) = [1.5, 0.5, 1.1, 0.9, 3.0]; loss = -sum(rhat A logp) / 10; grad = -rhat A / 10
    rhat = [1.5, 0.5, 1.1, 0.9, 3.0]
    logp = [b + math.log(r) for b, r in zip(BEHAV, R)]
    loss, grad, m = _run("cispo", cfg)
    assert loss == pytest.approx(-sum(h * a * lp for h, a, lp in zip(rhat, A, logp)) / 10)
    assert grad == pytest.approx([-0.15, 0.05, 0.22, -0.27, 0.3])
    assert m["loss/clip_frac"] == pytest.approx(1 / 5)


def test_log_ratio_clamp_and_non_finite_errors():
    cfg = AlgoConfig(logratio_clamp=20.0)
    logp = torch.tensor([30.0, 0.1], requires_grad=True)
    behav = torch.zeros(2)
    adv = torch.ones(2)
    loss, m = compute_policy_loss("no_tr", logp, behav, adv, torch.ones(2), denominator=2, algo_cfg=cfg)
    loss.backward()
    assert loss.item() == pytest.approx(-(math.exp(20.0) + math.exp(0.1)) / 2, rel=1e-6)
    assert logp.grad.tolist() == pytest.approx([0.0, -math.exp(0.1) / 2])  # clamped token: no gradient
    bad = torch.tensor([0.1, float("nan"), float("inf"), -0.2])
    ok = torch.zeros(4)
    mask = torch.tensor([1, 1, 1, 0])
    with pytest.raises(ValueError, match=r"logp has 2 non-finite values on loss tokens \(of 3\), at token indices \[1, 2\]"):
        compute_policy_loss("grpo", bad, ok, ok, mask, denominator=3, algo_cfg=cfg)
    with pytest.raises(ValueError, match=r"behav_logp has 2 non-finite"):
        compute_policy_loss("grpo", ok, bad, ok, mask, denominator=3, algo_cfg=cfg)
    with pytest.raises(ValueError, match=r"advantages has 2 non-finite"):
        compute_policy_loss("grpo", ok, ok, bad, mask, denominator=3, algo_cfg=cfg)
    with pytest.raises(ValueError, match="denominator=0"):
        compute_policy_loss("grpo", ok, ok, ok, mask, denominator=0, algo_cfg=cfg)
    with pytest.raises(ValueError, match="shapes"):
        compute_policy_loss("grpo", ok, ok[:3], ok, mask, denominator=3, algo_cfg=cfg)
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo'; available: \['areal_m2po', 'cispo', 'grpo'"):
        get_loss("ppo")


def test_denominator_makes_micro_batch_split_irrelevant():
    # Contract: loss = sum over tokens / global denominator, so micro-batch losses add up.
    g = torch.Generator().manual_seed(0)
    n = 50
    logp = (torch.randn(n, generator=g) * 0.3 - 1).requires_grad_()
    behav = torch.randn(n, generator=g) * 0.3 - 1
    adv = torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) < 0.8
    seq = torch.arange(n) // 10
    keep = torch.rand(n, generator=g) < 0.9
    cfg = AlgoConfig(gspo=GSPOConfig(eps_low=0.1, eps_high=0.1))
    for name in LOSSES:
        kw = dict(keep=keep, seq_index=seq)
        whole, _ = compute_policy_loss(name, logp, behav, adv, mask, denominator=40, algo_cfg=cfg, **kw)
        parts = sum(compute_policy_loss(name, logp[s], behav[s], adv[s], mask[s], denominator=40, algo_cfg=cfg,
                                        keep=keep[s], seq_index=seq[s])[0]
                    for s in (slice(0, 20), slice(20, 50)))  # split on a sequence boundary
        assert whole.item() == pytest.approx(parts.item(), rel=1e-6, abs=1e-7), name
        (g1,) = torch.autograd.grad(whole, logp)
        (g2,) = torch.autograd.grad(parts, logp)
        assert torch.allclose(g1, g2, atol=1e-7), name
        assert torch.isfinite(g1).all()


def test_tis_weights():
    w = tis_weights(torch.tensor([-1.0, -1.0, -5.0]), torch.tensor([-1.0, -2.0, -1.0]), cap=2.0)
    assert w.tolist() == pytest.approx([1.0, 2.0, math.exp(-4.0)])  # exp(1) capped at 2
