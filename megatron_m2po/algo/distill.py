"""On-policy distillation's math (``algo.distill``): the teacher's token log-probs as dense feedback.

The student samples; a teacher scores every sampled response token; the per-token reverse KL
``d_t = log pi_student(y_t) - log pi_teacher(y_t)`` (its expectation under the student's samples is
KL(student || teacher) of the token) is the feedback:

* ``placement=advantage`` (:func:`distilled_advantages`): ``A_t - coef * d_t`` on every loss token,
  with the student's log-prob *at sampling time* (the trajectory's behaviour log-probs), as slime's
  ``--opd-type`` and prime-rl do. The teacher's log-probs never go stale; the behaviour log-probs
  are those the loss already uses, so a stale step is corrected by the loss (M2PO's mask included,
  which is computed on the policy ratio only) exactly as the task advantage is.
* ``placement=loss`` (:func:`distill_loss_term`): ``coef * sum_t mask_t k(logp_t, teacher_t) / N``
  on the *current* log-probs, ``k`` the configured estimator (``algo/kl.py`` ``kl_penalty``), masked
  and normalised like the policy loss.

Metrics: ``distill/reverse_kl`` (token mean of ``d_t`` over loss tokens), ``distill/teacher_logprob``
(token mean of the teacher's log-probs), ``distill/advantage_share`` (advantage placement: the
teacher term's share of the advantages' magnitude, ``sum |coef d| / (sum |A| + sum |coef d|)``),
``loss/distill`` (loss placement: the term).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from megatron_m2po.algo.kl import kl_penalty
from megatron_m2po.algo.metrics import Metric

__all__ = ["distilled_advantages", "distill_step_metrics", "distill_loss_term", "check_teacher_logprobs"]


def check_teacher_logprobs(teacher: np.ndarray, loss_mask: np.ndarray, what: str = "") -> None:
    """Non-finite teacher log-probs on loss tokens are refused with where they are."""
    bad = np.flatnonzero((np.asarray(loss_mask) > 0) & ~np.isfinite(np.asarray(teacher, dtype=np.float64)))
    if bad.size:
        raise ValueError(f"{bad.size} non-finite teacher log-probs on loss tokens{what}, at token indices "
                         f"{bad[:10].tolist()}; check the teacher's weights (algo.distill.teacher)")


def distilled_advantages(advantages: np.ndarray, behav: np.ndarray, teacher: np.ndarray, loss_mask: np.ndarray,
                         coef: float) -> np.ndarray:
    """float32 ``A_t - coef * (behav_t - teacher_t)`` where ``loss_mask`` is set, ``A_t`` elsewhere."""
    check_teacher_logprobs(teacher, loss_mask)
    adv = np.asarray(advantages, dtype=np.float64)
    d = np.asarray(behav, dtype=np.float64) - np.asarray(teacher, dtype=np.float64)
    on = np.asarray(loss_mask) > 0
    return np.where(on, adv - float(coef) * np.where(on, d, 0.0), adv).astype(np.float32)


def distill_step_metrics(advantages: Sequence[np.ndarray], behav: Sequence[np.ndarray],
                         teacher: Sequence[np.ndarray], masks: Sequence[np.ndarray], coef: float) -> dict[str, float]:
    """The step's metrics (module docstring) over every sample's loss tokens; ``advantages`` are the
    task advantages before the teacher term."""
    n = adv_abs = term_abs = rkl = tlp = 0.0
    for a, b, t, m in zip(advantages, behav, teacher, masks):
        on = np.asarray(m) > 0
        if not on.any():
            continue
        d = np.asarray(b, np.float64)[on] - np.asarray(t, np.float64)[on]
        n += float(on.sum())
        rkl += float(d.sum())
        tlp += float(np.asarray(t, np.float64)[on].sum())
        adv_abs += float(np.abs(np.asarray(a, np.float64)[on]).sum())
        term_abs += float(np.abs(coef * d).sum())
    out = {"distill/reverse_kl": rkl / max(n, 1.0), "distill/teacher_logprob": tlp / max(n, 1.0)}
    out["distill/advantage_share"] = term_abs / (adv_abs + term_abs) if adv_abs + term_abs > 0 else 0.0
    return out


def distill_loss_term(logp: torch.Tensor, teacher_logp: torch.Tensor, loss_mask: torch.Tensor, *,
                      denominator: float, coef: float, estimator: str) -> tuple[torch.Tensor, dict[str, Metric]]:
    """``(term, metrics)`` of one micro-batch (placement=loss): ``coef * sum(mask * k) / denominator``;
    ``logp`` carries the gradient, ``teacher_logp`` is a constant. 1-D tensors of equal length."""
    if logp.shape != teacher_logp.shape or logp.shape != loss_mask.shape or logp.dim() != 1:
        raise ValueError(f"distill_loss_term: expects 1-D tensors of equal length, got logp {tuple(logp.shape)}, "
                         f"teacher_logp {tuple(teacher_logp.shape)}, loss_mask {tuple(loss_mask.shape)}")
    if not float(denominator) > 0:
        raise ValueError(f"distill_loss_term: denominator={denominator!r}; pass the policy loss's denominator")
    mask = loss_mask.to(torch.bool)
    bad = mask & ~torch.isfinite(teacher_logp)  # on the device: one sync, no host copy (as algo/kl.py reference_kl)
    if bool(bad.any()):
        check_teacher_logprobs(teacher_logp.detach().cpu().numpy(), mask.cpu().numpy())  # says where
    dtype = logp.dtype if logp.dtype == torch.float64 else torch.float32
    lp = torch.where(mask, logp.to(dtype), 0.0)
    tl = torch.where(mask, teacher_logp.detach().to(dtype), 0.0)
    w = mask.to(dtype)
    term = coef * (kl_penalty(lp, tl, estimator) * w).sum() / float(denominator)
    n = float(mask.sum())
    metrics = {"distill/reverse_kl": Metric(float(((lp.detach() - tl) * w).sum()) / max(n, 1.0), "mean", n),
               "distill/teacher_logprob": Metric(float((tl * w).sum()) / max(n, 1.0), "mean", n),
               "loss/distill": Metric(float(term.detach()), "sum")}
    return term, metrics
