"""Reference-model KL: per-token estimators and the loss term (docs/design.md §3, "Reference KL").

With ``d_i = logp_i - ref_logp_i`` (policy minus frozen reference, both at the rollout
temperature, on the rollout's tokens), Schulman's estimators of KL(pi_theta || pi_ref), in the
forms and with the clamps of verl's ``verl/trainer/ppo/core_algos.py::kl_penalty``:

* ``k1`` = ``d`` (verl ``kl``),
* ``k2`` = ``d^2 / 2`` (verl ``mse``),
* ``k3`` = ``exp(-d) + d - 1`` with ``-d`` clamped to ``[-20, 20]`` before ``exp`` and the result to
  ``[-10, 10]`` (verl ``low_var_kl``; the gradient is zero beyond either clamp).

The loss term of one micro-batch is ``coef * sum_i loss_mask_i * k_i / N`` with ``N`` the
*policy loss's own denominator* (the mini-batch's response-token count), so the micro-batch terms
of every rank add up to ``coef`` times the token mean over the mini-batch, whatever the layout
(verl ``use_kl_loss`` with ``loss_agg_mode=token-mean``, slime ``--kl-coef``). It is added to the
policy loss as a separate term: no mask, TIS weight or clip of a loss applies to it, and a loss's
token mask (M2PO's) is computed from the policy ratio ``logp - behav_logp`` only, never from it.

``algo.kl.placement=reward`` (verl ``use_kl_in_reward``, :func:`reward_penalties`): the penalty of a
trajectory is ``coef * sum_t loss_mask_t * k(behav_logp_t, ref_logp_t)``, taken from its reward
before the advantages (verl ``apply_kl_penalty`` subtracts ``beta * k`` per response token from the
token-level scores, and its GRPO advantage sums the token-level rewards over the response). No
gradient: the behaviour log-probs are the rollout's, constants of the update.

Metrics (``algo.metrics.Metric``; the trainer logs them under ``update/``): ``ref/kl`` (the
chosen estimator's mean over loss tokens), ``ref/kl_k1``, ``ref/kl_k2``, ``ref/kl_k3`` (each
estimator's mean; all "mean" weighted by loss tokens), ``loss/kl`` (the term, "sum": adds up to
its part of ``loss/total``) and, after the reduction, ``ref/penalty_share`` =
``|loss/kl| / (|loss/policy| + |loss/kl|)`` (:func:`penalty_share`).
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_m2po.algo.loss_settings import KL_ESTIMATORS, KLConfig
from megatron_m2po.algo.metrics import Metric

__all__ = ["KL_ESTIMATORS", "kl_estimates", "kl_penalty", "reference_kl", "penalty_share", "reward_penalties"]

# verl core_algos.kl_penalty, low_var_kl: the log-ratio before exp and the estimate after it
K3_LOGRATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate ``estimator`` (k1 / k2 / k3, module docstring); gradient through ``logp``."""
    d = logp - ref_logp
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        kl = (-d).clamp(-K3_LOGRATIO_CLAMP, K3_LOGRATIO_CLAMP)
        return (torch.exp(kl) - kl - 1.0).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)
    raise ValueError(f"algo.kl.estimator={estimator!r}; use one of {KL_ESTIMATORS}")


def kl_estimates(logp: torch.Tensor, ref_logp: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"k1": ..., "k2": ..., "k3": ...}`` per token, without gradient."""
    lp, ref = logp.detach(), ref_logp.detach()
    return {k: kl_penalty(lp, ref, k) for k in KL_ESTIMATORS}


def reference_kl(logp: torch.Tensor, ref_logp: torch.Tensor, loss_mask: torch.Tensor, *, denominator: float,
                 settings: KLConfig) -> tuple[torch.Tensor, dict[str, Metric]]:
    """``(term, metrics)`` of one micro-batch: ``term = coef * sum(mask * k) / denominator``.

    ``logp`` carries the gradient, ``ref_logp`` is a constant (the frozen reference); both 1-D of
    the micro-batch's response tokens. Non-finite reference log-probs on loss tokens raise
    ValueError; values on non-loss tokens are ignored (zero term, zero gradient).
    """
    if logp.shape != ref_logp.shape or logp.shape != loss_mask.shape or logp.dim() != 1:
        raise ValueError(f"reference_kl: expects 1-D tensors of equal length, got logp {tuple(logp.shape)}, "
                         f"ref_logp {tuple(ref_logp.shape)}, loss_mask {tuple(loss_mask.shape)}")
    denom = float(denominator)
    if not denom > 0 or denom == float("inf"):
        raise ValueError(f"reference_kl: denominator={denominator!r}; pass the policy loss's denominator (the "
                         "positive global number of response tokens of the mini-batch)")
    mask = loss_mask.to(torch.bool)
    bad = mask & ~torch.isfinite(ref_logp)
    if bool(bad.any()):
        idx = bad.nonzero().flatten()
        raise ValueError(f"reference_kl: {idx.numel()} non-finite reference log-probs on loss tokens, at token "
                         f"indices {idx[:10].tolist()}; check the reference model's weights (model.hf_path)")
    dtype = logp.dtype if logp.dtype == torch.float64 else torch.float32
    lp = torch.where(mask, logp.to(dtype), 0.0)
    ref = torch.where(mask, ref_logp.detach().to(dtype), 0.0)
    w = mask.to(dtype)
    term = settings.coef * (kl_penalty(lp, ref, settings.estimator) * w).sum() / denom
    n = float(mask.sum())
    means = {k: Metric(float((v * w).sum()) / max(n, 1.0), "mean", n) for k, v in kl_estimates(lp, ref).items()}
    metrics = {f"ref/kl_{k}": m for k, m in means.items()}
    metrics["ref/kl"] = means[settings.estimator]
    metrics["loss/kl"] = Metric(float(term.detach()), "sum")
    return term, metrics


def penalty_share(reduced: dict[str, float]) -> float:
    """The KL term's share of the update's loss magnitude, from reduced metrics:
    ``|loss/kl| / (|loss/policy| + |loss/kl|)`` in [0, 1] (0 when both are 0)."""
    kl, policy = abs(reduced.get("loss/kl", 0.0)), abs(reduced.get("loss/policy", 0.0))
    return kl / (kl + policy) if kl + policy > 0 else 0.0


def reward_penalties(behav: list[np.ndarray], ref: list[np.ndarray], masks: list[np.ndarray], *,
                     settings: KLConfig) -> tuple[np.ndarray, dict[str, float]]:
    """``algo.kl.placement=reward``: ``(penalties, metrics)`` of a step's trajectories.

    ``behav[i]``, ``ref[i]``, ``masks[i]``: trajectory ``i``'s behaviour log-probs, reference
    log-probs and loss mask over its response tokens. ``penalties[i] = coef * sum_t mask_t *
    k(behav_t, ref_t)`` in float64 (``settings.estimator``), summed in token order, so the result
    depends on the per-token values only (the same on every layout). Metrics, over the step's
    loss tokens: ``ref/kl`` (the chosen estimator's token mean), ``ref/kl_{k1,k2,k3}``, and
    ``reward/kl_penalty`` (the mean penalty per trajectory). Non-finite log-probs on loss tokens
    raise ValueError naming the trajectory; values on other tokens are ignored.
    """
    if not len(behav) == len(ref) == len(masks):
        raise ValueError(f"reward_penalties: {len(behav)} behaviour, {len(ref)} reference and {len(masks)} mask "
                         "arrays; pass one of each per trajectory")
    if not behav:
        return np.zeros(0), {}
    for i, (b, r, m) in enumerate(zip(behav, ref, masks)):
        if not np.shape(b) == np.shape(r) == np.shape(m):
            raise ValueError(f"reward_penalties: trajectory {i} has behaviour {np.shape(b)}, reference "
                             f"{np.shape(r)} and mask {np.shape(m)} log-probs / entries; they must be equal")
    mask = np.concatenate([np.asarray(m).reshape(-1) for m in masks]) > 0
    lp = np.concatenate([np.asarray(b, np.float64).reshape(-1) for b in behav])
    rf = np.concatenate([np.asarray(r, np.float64).reshape(-1) for r in ref])
    seq = np.repeat(np.arange(len(behav)), [np.size(b) for b in behav])
    bad = mask & ~(np.isfinite(lp) & np.isfinite(rf))
    if bad.any():
        which = sorted(set(seq[bad].tolist()))
        raise ValueError(f"reward_penalties: non-finite behaviour or reference log-probs on {int(bad.sum())} loss "
                         f"tokens of trajectories {which[:10]} (by index in the step); check the reference model "
                         "(model.hf_path) and the rollout's log-probs")
    w = mask.astype(np.float64)
    est = kl_estimates(torch.from_numpy(np.where(mask, lp, 0.0)), torch.from_numpy(np.where(mask, rf, 0.0)))
    k = {name: v.numpy() * w for name, v in est.items()}
    n = max(float(w.sum()), 1.0)
    penalties = settings.coef * np.bincount(seq, weights=k[settings.estimator], minlength=len(behav))
    metrics = {f"ref/kl_{name}": float(v.sum() / n) for name, v in k.items()}
    metrics["ref/kl"] = metrics[f"ref/kl_{settings.estimator}"]
    metrics["reward/kl_penalty"] = float(penalties.mean())
    return penalties, metrics
