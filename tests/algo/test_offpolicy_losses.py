"""icepop, mis, areal_m2po, vcpo (algo/offpolicy_losses.py) against naive implementations written
here from their sources' equations, token by token in float64 Python, with the PPO ratio's old
policy at the forward's weights (``logp_old = logp`` as a constant), as the module docstring says.

Each case: 3 sequences of 6 tokens plus one padding token (NaN log-probs, must get no gradient),
log-ratios spread wide enough that every mask and truncation is active; denominator D = 40.
"""

import math

import pytest
import torch

from megatron_m2po.algo.losses import compute_policy_loss
from megatron_m2po.algo.m2_mask import m2po_mask
from megatron_m2po.algo.metrics import reduce_metrics
from megatron_m2po.algo.offpolicy_losses import ess_lr_scale
from megatron_m2po.config import AlgoConfig, AReaLM2POConfig, IcePopConfig, MISConfig, VCPOConfig

D = 40.0
SEQ = [0] * 6 + [1] * 6 + [2] * 6


def _case(seed=0, spread=1.2):
    g = torch.Generator().manual_seed(seed)
    n = len(SEQ)
    behav = (torch.rand(n, generator=g, dtype=torch.float64) * -3.0).tolist()
    delta = (torch.randn(n, generator=g, dtype=torch.float64) * spread).tolist()
    adv = (torch.randn(n, generator=g, dtype=torch.float64)).tolist()
    return behav, delta, adv


def _run(name, algo, behav, delta, adv, keep=None, stash=None):
    """(loss, grad per token, metrics) of the registered loss; the padding token checked."""
    logp = torch.tensor([b + d for b, d in zip(behav, delta)] + [float("nan")], dtype=torch.float64,
                        requires_grad=True)
    b = torch.tensor(behav + [float("-inf")], dtype=torch.float64)
    a = torch.tensor(adv + [float("nan")], dtype=torch.float64)
    mask = torch.tensor([1] * len(behav) + [0], dtype=torch.uint8)
    seq = torch.tensor(SEQ + [2])
    kw = {} if keep is None else {"keep": torch.tensor(keep + [False])}
    loss, m = compute_policy_loss(name, logp, b, a, mask, denominator=D, algo_cfg=algo, seq_index=seq, stash=stash,
                                  **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[-1].item() == 0.0
    return loss.item(), grad[:-1].tolist(), reduce_metrics(m)


def _naive_grad(weights, adv):
    """d/dlogp_t of -(1/D) sum_t sg(w_t) * rho_t * A_t with rho = pi/pi_old (old = these weights):
    -(w_t A_t) / D -- the policy-gradient form every source below reduces to at rho = 1."""
    return [-w * a / D for w, a in zip(weights, adv)]


def _naive_ppo_min(w, a, eps=0.2):
    """w * min(rho A, clip(rho, 1-eps, 1+eps) A) at rho = 1 (value) and its d/dlogp (grad of rho = 1)."""
    return w * min(a, max(min(1.0, 1 + eps), 1 - eps) * a), w * a


def test_icepop_masks_both_sides():
    behav, delta, adv = _case(1, spread=1.5)
    low, high = 0.5, 5.0
    # IcePop: M(k) = k on [alpha, beta], else 0; k = pi_train(old) / pi_infer = r here
    weights = [math.exp(d) if low <= math.exp(d) <= high else 0.0 for d in delta]
    vals = [_naive_ppo_min(w, a) for w, a in zip(weights, adv)]
    loss, grad, m = _run("icepop", AlgoConfig(icepop=IcePopConfig(low=low, high=high)), behav, delta, adv)
    assert loss == pytest.approx(-sum(v for v, _ in vals) / D, rel=1e-12)
    assert grad == pytest.approx([-g / D for _, g in vals], rel=1e-12)
    n_low = sum(math.exp(d) < low for d in delta)
    n_high = sum(math.exp(d) > high for d in delta)
    assert n_low > 0 and n_high > 0  # both sides of the mask are exercised
    assert m["icepop/mask_low_frac"] == pytest.approx(n_low / 18) and m["icepop/mask_high_frac"] == pytest.approx(
        n_high / 18) and m["icepop/mask_frac"] == pytest.approx((n_low + n_high) / 18)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mis_token_and_sequence_level(level):
    behav, delta, adv = _case(2, spread=0.6)
    c = 1.5
    if level == "token":  # w_t = r_t 1[r_t <= C]
        weights = [math.exp(d) if math.exp(d) <= c else 0.0 for d in delta]
    else:  # w = R 1[R <= C], R = prod_t r_t over the whole sequence
        prod = {s: math.prod(math.exp(d) for d, q in zip(delta, SEQ) if q == s) for s in set(SEQ)}
        weights = [prod[s] if prod[s] <= c else 0.0 for s in SEQ]
        assert 0 < sum(prod[s] > c for s in prod) < 3, prod  # one sequence masked at least, not all
    loss, grad, m = _run("mis", AlgoConfig(mis=MISConfig(level=level, threshold=c)), behav, delta, adv)
    assert loss == pytest.approx(-sum(w * a for w, a in zip(weights, adv)) / D, rel=1e-12)
    assert grad == pytest.approx(_naive_grad(weights, adv), rel=1e-12)
    masked = sum(w == 0.0 for w in weights)
    assert 0 < masked < 18 and m["mis/mask_frac"] == pytest.approx(masked / 18)


def test_seq_mis_survives_an_overflowing_sequence_ratio():
    behav, delta, adv = _case(2)
    delta = [19.0] * 6 + delta[6:]  # prod r = e^114 for sequence 0 at the log-ratio clamp's edge: masked
    loss, grad, _ = _run("mis", AlgoConfig(mis=MISConfig(level="sequence", threshold=2.0)), behav, delta, adv)
    assert math.isfinite(loss) and grad[:6] == [0.0] * 6


def _areal_reference(delta, adv, tau, cap, eps=0.2):
    """AReaL PR 480 (c431dd6) for one micro-batch, transcribed: get_m2po_loss_mask over all loss
    tokens of m2 = (old - prox)^2, then ppo_actor_loss_fn (decoupled: ratio vs prox, behaviour
    weight prox/old zeroed above the cap), sum over kept tokens / kept count."""
    m2 = [d * d for d in delta]
    order = sorted(range(len(m2)), key=lambda i: -m2[i])  # descending
    n = len(m2)
    num_to_mask = n - 1
    for k in range(n):  # first k whose suffix (the n - k smallest) has mean < tau
        if sum(m2[i] for i in order[k:]) / (n - k) < tau:
            num_to_mask = k
            break
    keep = [True] * n
    for i in order[:num_to_mask]:
        keep[i] = False
    loss, grad = 0.0, [0.0] * n
    for i in range(n):
        if not keep[i]:
            continue
        w = math.exp(delta[i])  # exp(prox - old): prox = the update's weights
        w = 0.0 if cap is not None and w > cap else w
        # pg_loss = max(-A ratio, -A clip(ratio)) * w at ratio = 1; d/dlogp = -A w
        loss += max(-adv[i], -adv[i] * min(max(1.0, 1 - eps), 1 + eps)) * w
        grad[i] = -adv[i] * w
    kept = sum(keep)
    return keep, loss / kept, [g / kept for g in grad]


@pytest.mark.parametrize("tau", [0.3, 1e-6])  # an ordinary cut; nothing fits (AReaL keeps the smallest)
def test_areal_m2po_matches_the_merged_code(tau):
    behav, delta, adv = _case(3, spread=1.0)
    cap = 2.5
    keep_ref, loss_ref, grad_ref = _areal_reference(delta, adv, tau, cap)
    cfg = AReaLM2POConfig(threshold=tau, behav_imp_weight_cap=cap)
    d = torch.tensor(delta, dtype=torch.float64)
    keep, st = m2po_mask(d, torch.tensor(adv), torch.ones(18, dtype=torch.bool), threshold=tau, region="all",
                         keep_one=True)
    assert keep.tolist() == keep_ref and st.n_trust == 18
    assert 0 < sum(keep_ref) < 18 and (sum(keep_ref) == 1) == (tau < 1e-3)
    loss, grad, m = _run("areal_m2po", AlgoConfig(areal_m2po=cfg), behav, delta, adv, keep=keep.tolist())
    # the same per-token terms; AReaL divides by the kept count, this project by D (module docstring)
    kept = sum(keep_ref)
    assert loss == pytest.approx(loss_ref * kept / D, rel=1e-12)
    assert grad == pytest.approx([g * kept / D for g in grad_ref], rel=1e-12)
    capped = sum(k and math.exp(x) > cap for k, x in zip(keep_ref, delta))
    assert m["areal_m2po/behav_cap_frac"] == pytest.approx(capped / 18)


def _naive_ess_scale(log_w, base=1.0, rule="sqrt"):
    """VCPO README eq. 1: rho = (sum w)^2 / (B sum w^2), lr factor min(1, rho / base) ** (1/2)."""
    w = [math.exp(x) for x in log_w]
    rho = sum(w) ** 2 / sum(x * x for x in w) / len(w)
    f = min(1.0, rho / base)
    return (math.sqrt(f) if rule == "sqrt" else f), rho


def test_vcpo_sequence_tis_and_ess_step_scale():
    behav, delta, adv = _case(4, spread=0.5)
    c = 2.0
    log_w = [sum(d for d, q in zip(delta, SEQ) if q == s) for s in range(3)]
    assert sum(x > math.log(c) for x in log_w) == 1  # one sequence truncated
    weights = [min(math.exp(log_w[s]), c) for s in SEQ]  # sg(min(prod r, C)) per sequence
    stash: list = []
    settings = VCPOConfig(is_threshold=c)
    loss, grad, m = _run("vcpo", AlgoConfig(vcpo=settings), behav, delta, adv, stash=stash)
    assert loss == pytest.approx(-sum(w * a for w, a in zip(weights, adv)) / D, rel=1e-12)
    assert grad == pytest.approx(_naive_grad(weights, adv), rel=1e-12)
    assert m["vcpo/is_trunc_frac"] == pytest.approx(6 / 18)
    for rule, base in (("sqrt", 1.0), ("linear", 0.5)):
        want, rho = _naive_ess_scale(log_w, base, rule)
        scale, sm = ess_lr_scale(stash, VCPOConfig(is_threshold=c, ess_rule=rule, base_ess_ratio=base))
        assert scale == pytest.approx(want, rel=1e-12) and sm["vcpo/ess_ratio"].value == pytest.approx(rho, rel=1e-12)
        assert sm["vcpo/ess"].value == pytest.approx(rho * 3, rel=1e-12) and scale < 1.0
    # ess_clipped: the ESS of min(w, C)
    stash = []
    _run("vcpo", AlgoConfig(vcpo=VCPOConfig(is_threshold=c, ess_clipped=True)), behav, delta, adv, stash=stash)
    want, _ = _naive_ess_scale([min(x, math.log(c)) for x in log_w])
    assert ess_lr_scale(stash, VCPOConfig(is_threshold=c))[0] == pytest.approx(want, rel=1e-12)


def test_vcpo_ess_of_huge_and_empty_weights():
    s = VCPOConfig()
    # w = [e^800, 1, 1]: one sequence carries all the weight, ESS -> 1 (float64 exp would overflow)
    scale, m = ess_lr_scale([torch.tensor([800.0, 0.0]), torch.tensor([0.0], dtype=torch.float64)], s)
    assert m["vcpo/ess"].value == pytest.approx(1.0) and scale == pytest.approx(math.sqrt(1 / 3))
    # equal weights: ESS = B, the LR is untouched; no sequence at all: untouched too
    assert ess_lr_scale([torch.full((5,), -3.0)], s)[0] == pytest.approx(1.0)
    assert ess_lr_scale([], s)[0] == 1.0


def test_losses_that_need_sequence_ids_say_so():
    behav, delta, adv = _case(0)
    logp = torch.tensor([b + d for b, d in zip(behav, delta)], dtype=torch.float64, requires_grad=True)
    for name in ("vcpo", "mis"):
        with pytest.raises(ValueError, match="needs seq_index="):
            compute_policy_loss(name, logp, torch.tensor(behav), torch.tensor(adv), torch.ones(18), denominator=D,
                                algo_cfg=AlgoConfig())
    with pytest.raises(ValueError, match="needs keep="):
        _run("areal_m2po", AlgoConfig(), behav, delta, adv)
