"""Policy losses: a registry of pure tensor functions (docs/design.md §3, "M2PO" and "Baselines").

Every loss is token-level over the 1-D tokens of one micro-batch:

    loss = -(1 / denominator) * sum_i loss_mask_i * w_i * obj_i

with ``w_i`` the optional TIS weight (paper eq. 6, no gradient) and ``denominator`` given by the
caller: the global number of response tokens of the optimizer mini-batch (all DP ranks, all
micro-batches, masked M2PO tokens included -- paper footnote 2). Summing the micro-batch losses
of all ranks therefore gives the token mean over the mini-batch, however it is split.

``delta_i = clamp(logp_i - behav_logp_i, -c, c)`` with ``c = algo_cfg.logratio_clamp`` (20) and
``r_i = exp(delta_i)``; the clamp keeps ``exp`` finite on very stale data (its gradient is zero
beyond the clamp).

Registry (``algo/registry.py``, re-exported here): a loss is a :class:`LossSpec` -- its
objective, its own settings dataclass (config section ``algo.<name>``; ``algo.loss_options`` for a
plugin loss) and what it needs from the trainer (a per-token mask before the loss, a global pre-pass for it, sequence ids). Plugins
register more with :func:`register_loss` from modules listed in ``algo.plugins``; the actor only
asks the spec, it never branches on a loss name.

Per-token objectives ``obj_i`` (settings in brackets):

* ``m2po`` [``algo.m2po``]: ``keep_i * r_i * A_i`` (``keep`` from ``algo.m2_mask.m2po_mask``,
  required; the spec's ``token_mask``, global by default, i.e. over the whole mini-batch after a
  forward-only pre-pass).
* ``grpo`` [``algo.grpo``]: PPO clip ``min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``
  (clip-higher when ``eps_high > eps_low``); with ``dual_clip`` = c, for ``A < 0`` also
  ``max(., c A)``.
* ``no_tr``: ``r A`` (no trust region).
* ``gspo`` [``algo.gspo``]: sequence ratio ``s = exp(mean_{i in seq} delta_i)`` (geometric mean of the token
  ratios over the sequence's loss tokens in this call, gradient through the mean), per token
  ``min(s A, clip(s, 1 - eps_low, 1 + eps_high) A)``. Needs ``seq_index``. Under context
  parallelism a sequence's tokens are split over the CP ranks: with ``seq_group`` (the CP group)
  and ``num_seqs`` the per-sequence sums and counts are summed over the group first (backward: the
  gradient of the sums summed over the group as well), so every rank uses the whole sequence's
  ratio.
* ``cispo`` [``algo.cispo``]: ``sg(min(r, 1 + eps_high)) * A * logp`` (stop-gradient clipped ratio).
* ``icepop``, ``mis``, ``areal_m2po``, ``vcpo`` [``algo.<name>``]: the off-policy corrections of
  ``algo/offpolicy_losses.py`` (registered when this module is imported; their sources and
  equations are in that module's docstring).

Non-finite ``logp``, ``behav_logp``, ``advantages`` (or TIS weights) on loss tokens raise
ValueError saying how many and where; values on non-loss tokens (padding) are ignored and get
zero gradient.

Metrics (``algo.metrics.Metric``): ``loss/policy`` (sum: adds up to the mini-batch loss),
``policy/ratio_mean`` (token mean), ``policy/ratio_max`` (max), ``policy/kl_k1`` = mean(-delta),
``policy/kl_k3`` = mean(r - 1 - delta) (estimates of KL(behav || theta) from behaviour samples),
``loss/clip_frac`` (token mean; grpo, gspo, cispo), ``loss/dual_clip_frac`` (grpo with dual
clip), ``tis/weight_mean`` (with TIS). Means are weighted by the number of loss tokens.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_m2po.algo.diagnostics import drift_metrics
from megatron_m2po.algo.sequences import sequence_sums
from megatron_m2po.algo.loss_settings import CISPOConfig, GRPOConfig, GSPOConfig, M2POConfig
from megatron_m2po.algo.m2_mask import DELTA_CLAMP, m2po_mask, trust_region
from megatron_m2po.algo.metrics import Metric
from megatron_m2po.algo.registry import (LOSSES, LossFn, LossInputs, LossSpec, MaskFn, Objective, get_loss,  # noqa: F401
                                         load_plugins, loss_settings, register_loss, resolve_loss)


# ------------------------------------------------------------------------------ built-in losses


def _m2po_mask(delta: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor, *, order_key, group,
               settings: M2POConfig) -> tuple[torch.Tensor, dict[str, Metric]]:
    stats: Any
    keep, stats = m2po_mask(delta, advantages, loss_mask, threshold=settings.threshold, rule=settings.rule,
                            group=group, order_key=order_key)
    return keep, {
        "m2po/mask_frac": Metric(stats.mask_frac, "mean", stats.n_valid),
        "m2po/m2_before": Metric(stats.m2_before, "mean", stats.n_trust),
        "m2po/m2_after": Metric(stats.m2_after, "mean", stats.n_trust - stats.n_masked),
        "m2po/threshold_value": Metric(stats.threshold_value, "max"),
        "m2po/n_trust": Metric(stats.n_trust, "sum")}


def _m2po_scope(settings: M2POConfig) -> str:
    return settings.scope


def _m2po_provisional_keep(delta: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor, *, order_key,
                           seen, settings: M2POConfig) -> torch.Tensor:
    """Algorithm 1 (or the cap rule) over this rank's tokens seen so far in the update -- the
    earlier micro-batches (``seen``) and this one -- applied to this micro-batch: the running
    estimate of the global cut, ties broken by ``order_key`` as the exact mask breaks them. On one
    rank's last micro-batch it sees every token of the mini-batch; elsewhere its cut is a sample
    estimate of the global one. A guess, so plain float sums and one sort (not ``m2po_mask``'s
    exact fixed-point selection): a wrong guess costs recomputation, never exactness."""
    def trust(d, a, m, key):
        m = m.to(torch.bool)
        d = torch.where(m, d.detach().to(torch.float64), 0.0).clamp(-DELTA_CLAMP, DELTA_CLAMP)
        t = trust_region(d, a, m)
        return d, t, d[t].square(), key[t]

    valid = loss_mask.to(torch.bool)
    d, t, v_cur, k_cur = trust(delta, advantages, valid, order_key)
    earlier = [trust(*x) for x in seen]
    v_all = torch.cat([x[2] for x in earlier] + [v_cur])
    n, tau = v_all.numel(), float(settings.threshold)
    if n == 0 or float(v_all.sum()) <= tau * n:
        return valid.clone()
    keys = torch.cat([x[3] for x in earlier] + [k_cur]).to(torch.int64)
    by_key = torch.argsort(keys, stable=True)  # ascending v, equal v by ascending key
    order = by_key[torch.argsort(v_all[by_key], stable=True)]
    v = v_all[order]
    csum = torch.cumsum(v, 0)
    i = torch.arange(1, n + 1, dtype=v.dtype, device=v.device)
    if settings.rule == "remove":  # keep the longest ascending prefix whose mean is <= tau
        kept = torch.zeros(n, dtype=torch.bool, device=v.device)
        kept[order[:int((csum <= tau * i).sum())]] = True
        masked_cur = ~kept[n - v_cur.numel():]
    else:  # the largest v whose capped mean mean(min(v, c)) is <= tau (0: mask every trust token)
        ok = (csum + v * (n - i)) <= tau * n
        masked_cur = v_cur > (float(v[ok].max()) if bool(ok.any()) else 0.0)
    keep = valid.clone()
    keep[t.nonzero().flatten()[masked_cur]] = False
    return keep


@register_loss("m2po", settings=M2POConfig, token_mask=_m2po_mask, mask_scope=_m2po_scope,
               provisional_keep=_m2po_provisional_keep)
def _m2po(x: LossInputs, cfg) -> Objective:
    if x.keep is None:
        raise ValueError("loss 'm2po' needs keep= (the mask from algo.m2_mask.m2po_mask over the mini-batch)")
    return x.keep.to(x.ratio.dtype) * x.ratio * x.advantages, {}


@register_loss("no_tr")
def _no_tr(x: LossInputs, cfg) -> Objective:
    return x.ratio * x.advantages, {}


@register_loss("grpo", settings=GRPOConfig)
def _grpo(x: LossInputs, cfg: GRPOConfig) -> Objective:
    a, r = x.advantages, x.ratio
    unclipped = r * a
    clipped = r.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * a
    obj = torch.minimum(unclipped, clipped)
    metrics = {"loss/clip_frac": x.frac(clipped < unclipped)}
    if cfg.dual_clip is not None:
        floor = cfg.dual_clip * a
        dual = (a < 0) & (obj < floor)
        obj = torch.where(dual, floor, obj)
        metrics["loss/dual_clip_frac"] = x.frac(dual)
    return obj, metrics


@register_loss("gspo", settings=GSPOConfig, needs_seq_index=True)
def _gspo(x: LossInputs, cfg: GSPOConfig) -> Objective:
    if x.seq_index is None:
        raise ValueError("loss 'gspo' needs seq_index= (an integer sequence id per token)")
    if x.seq_group is not None and x.num_seqs is None:
        raise ValueError("loss 'gspo' with seq_group= needs num_seqs= (the same on every rank of the group)")
    # ids shared by the CP ranks under seq_group: each sequence's parts are summed over them
    sums, counts, inv = sequence_sums(x.delta, x.mask, x.seq_index, x.seq_group, x.num_seqs)
    s = torch.exp(sums / counts.clamp_min(1.0))[inv]
    a = x.advantages
    unclipped = s * a
    clipped = s.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * a
    seq_has = counts > 0
    seq_ratio = torch.exp(sums / counts.clamp_min(1.0))[seq_has].detach()
    metrics = {"loss/clip_frac": x.frac(clipped < unclipped),
               "gspo/seq_ratio_mean": Metric(seq_ratio.double().mean() if seq_ratio.numel() else 0.0, "mean",
                                             weight=float(seq_ratio.numel()))}
    return torch.minimum(unclipped, clipped), metrics


@register_loss("cispo", settings=CISPOConfig)
def _cispo(x: LossInputs, cfg: CISPOConfig) -> Objective:
    bound = 1.0 + cfg.eps_high
    weight = x.ratio.detach().clamp(max=bound)
    return weight * x.advantages * x.logp, {"loss/clip_frac": x.frac(x.ratio.detach() > bound)}


def _check_finite(name: str, t: torch.Tensor, mask: torch.Tensor) -> None:
    bad = mask & ~torch.isfinite(t)
    if bool(bad.any()):
        idx = bad.nonzero().flatten()
        raise ValueError(f"compute_policy_loss: {name} has {idx.numel()} non-finite values on loss tokens "
                         f"(of {int(mask.sum())}), at token indices {idx[:10].tolist()} with values "
                         f"{t.detach()[idx[:10]].tolist()}; check the rollout log-probs / rewards of those samples")


def compute_policy_loss(name: str, logp: torch.Tensor, behav_logp: torch.Tensor, advantages: torch.Tensor,
                        loss_mask: torch.Tensor, *, denominator, algo_cfg, keep: Optional[torch.Tensor] = None,
                        seq_index: Optional[torch.Tensor] = None, tis_weight: Optional[torch.Tensor] = None,
                        seq_group=None, num_seqs: Optional[int] = None, stash: Optional[list] = None
                        ) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Loss ``name`` on one micro-batch; returns ``(loss, metrics)`` (see the module docstring).

    ``logp`` carries the gradient; ``behav_logp``, ``advantages``, ``keep``, ``tis_weight`` are
    treated as constants. ``algo_cfg`` is a ``megatron_m2po.config.AlgoConfig``: the loss reads its
    own settings from it (:func:`loss_settings`) and ``logratio_clamp``. ``seq_group`` / ``num_seqs``:
    the context-parallel group a sequence-level loss (GSPO) reduces its per-sequence sums over, and
    the number of sequences ``seq_index`` counts (the same on every rank of the group); collective
    over that group when the loss is sequence-level. ``stash``: the update's accumulator for a
    loss with ``step_scale`` (:class:`LossSpec`), which the objective appends to.
    """
    spec = get_loss(name)
    settings = loss_settings(spec, algo_cfg)
    mask = loss_mask.to(torch.bool)
    shapes = {"logp": tuple(logp.shape), "behav_logp": tuple(behav_logp.shape),
              "advantages": tuple(advantages.shape), "loss_mask": tuple(loss_mask.shape)}
    for k, t in (("keep", keep), ("seq_index", seq_index), ("tis_weight", tis_weight)):
        if t is not None:
            shapes[k] = tuple(t.shape)
    if logp.dim() != 1 or len(set(shapes.values())) != 1:
        raise ValueError(f"compute_policy_loss: expects 1-D tensors of equal length, got shapes {shapes}")
    denom = float(denominator)
    if not denom > 0 or denom == float("inf"):
        raise ValueError(f"compute_policy_loss: denominator={denominator!r}; pass the (positive) global number "
                         "of response tokens of the mini-batch")
    _check_finite("logp", logp, mask)
    _check_finite("behav_logp", behav_logp, mask)
    _check_finite("advantages", advantages, mask)
    if tis_weight is not None:
        _check_finite("tis_weight", tis_weight, mask)
        if bool((mask & (tis_weight < 0)).any()):
            raise ValueError("compute_policy_loss: tis_weight must be >= 0")

    dtype = logp.dtype if logp.dtype == torch.float64 else torch.float32
    lp = torch.where(mask, logp.to(dtype), 0.0)
    blp = torch.where(mask, behav_logp.detach().to(dtype), 0.0)
    adv = torch.where(mask, advantages.detach().to(dtype), 0.0)
    clamp = float(algo_cfg.logratio_clamp)
    delta = (lp - blp).clamp(-clamp, clamp)
    ratio = torch.exp(delta)
    x = LossInputs(logp=lp, behav_logp=blp, advantages=adv, mask=mask, delta=delta, ratio=ratio,
                   n_tokens=int(mask.sum()), keep=None if keep is None else keep.to(torch.bool),
                   seq_index=seq_index, seq_group=seq_group, num_seqs=num_seqs, stash=stash)
    obj, metrics = spec.objective(x, settings)
    w = mask.to(dtype)
    if tis_weight is not None:
        tw = torch.where(mask, tis_weight.detach().to(dtype), 0.0)
        w = w * tw
        metrics["tis/weight_mean"] = x.token_mean(tw)
    loss = -(torch.where(mask, obj, 0.0) * w).sum() / denom

    r = ratio.detach()
    metrics["loss/policy"] = Metric(loss.detach(), "sum")
    metrics["policy/ratio_mean"] = x.token_mean(r)
    metrics["policy/ratio_max"] = Metric(r[mask].max() if x.n_tokens else torch.zeros(()), "max")
    metrics["policy/kl_k1"] = x.token_mean(-delta)
    metrics["policy/kl_k3"] = x.token_mean(r - 1.0 - delta.detach())
    # Second moment of the log-ratio over all loss tokens, for every loss (M2PO's m2po/m2_* are
    # over the trust-region tokens only): lets GRPO / no-TR runs be compared on the same axis.
    metrics["policy/m2"] = x.token_mean(delta.detach() ** 2)
    # |log r| percentile and sequence ESS (algo/diagnostics.py; finished after the update's reduction)
    metrics.update(drift_metrics(delta, mask, seq_index, seq_group, num_seqs))
    return loss, metrics


def tis_weights(train_behav_logp: torch.Tensor, engine_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weight ``min(p_train_behav / p_engine_behav, cap)`` per token (paper eq. 6)."""
    d = (train_behav_logp.detach().double() - engine_logp.detach().double()).clamp(max=50.0)
    return torch.exp(d).clamp(max=cap).to(train_behav_logp.dtype)


# The off-policy corrections (icepop, mis, areal_m2po, vcpo) register themselves on import.
from megatron_m2po.algo import offpolicy_losses  # noqa: E402,F401
