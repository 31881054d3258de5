"""The exact global M2 mask without a forward-only pre-pass (``algo.m2po.mask_strategy``).

Why it is exact (docs/design.md §3): the weights do not change inside an optimizer mini-batch and
M2PO's loss is linear in the per-token keep weights, ``L(keep) = -(1/N) sum_i keep_i w_i r_i A_i``.
So for any provisional mask ``g``, ``grad L(keep) = grad L(g) + grad L(keep - g)``, and
``keep - g`` (+1 where the exact mask keeps a token the guess masked, -1 the other way) is
non-zero only on the tokens where the two differ. The actor

1. runs forward-backward over every micro-batch with ``g`` (the loss spec's ``provisional_keep``:
   for M2PO, Algorithm 1 over the tokens this rank has seen so far in the update, a running
   estimate of the global cut), recording each token's log-ratio from that forward;
2. selects the exact global mask from the recorded log-ratios (the same ``token_mask`` call, on
   the same values, as after a pre-pass);
3. for the sequences holding a token whose keep changed, runs one more forward-backward whose
   loss is ``L(keep - g)``, on those sequences only, each cut after its last changed response
   token (a causal model's log-probs of a prefix do not depend on what follows it);
4. finalises the gradients (TP / SP, tied-embedding and data-parallel reductions) once, over the
   accumulated provisional + correction gradients, and steps the optimizer.

When the exact mask equals the guess (nothing masked; or one rank with one micro-batch, where the
running estimate has seen every token) there is no step 3. The result equals the pre-pass strategy's to floating-point rounding (the
two sum the same terms in a different order); dropout would make the forwards differ, so the
strategy needs dropout 0 (``check_dropout``).

This module holds the layout-free parts: which sequences to recompute, their truncated samples
and weights, and the cost model that ``auto`` uses. ``actor/global_mask.py`` runs them in the actor.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from megatron_m2po.actor.batch import MicroBatch, Sample

__all__ = ["FORWARD_SHARE", "choose_strategy", "check_dropout", "changed_lengths", "truncate", "diff_by_sample",
           "pad_for_schedule", "schedule_count"]

# A forward pass as a share of forward + backward, the unit the pre-pass costs against the
# correction's forward-backward: backward ~ 2 forwards; full recompute runs the forward once more
# inside the backward. Selective recompute re-runs only attention's core (small at these lengths).
FORWARD_SHARE = {"none": 1.0 / 3.0, "selective": 1.0 / 3.0, "full": 1.0 / 4.0}


def check_dropout(strategy: str, attention_dropout: float, hidden_dropout: float, lora_dropout: float = 0.0) -> None:
    """ValueError for ``mask_strategy=correct`` with dropout: the correction's forward would draw
    other dropout masks than the provisional one, so the sum would not be one gradient."""
    if strategy == "correct" and lora_dropout > 0:
        raise ValueError(f"algo.m2po.mask_strategy='correct' needs model.lora.dropout=0 (got {lora_dropout}): the "
                         "correction's forward must see the provisional forward's adapter inputs; use "
                         "mask_strategy=prepass or auto")
    if strategy == "correct" and (attention_dropout > 0 or hidden_dropout > 0):
        raise ValueError(f"algo.m2po.mask_strategy='correct' needs model.attention_dropout=0 and "
                         f"model.hidden_dropout=0 (got {attention_dropout}, {hidden_dropout}): the correction's "
                         "forward must see the provisional forward's activations; use mask_strategy=prepass or "
                         "auto (which takes the pre-pass when dropout is on)")


def choose_strategy(configured: str, hint: Optional[dict], *, recompute: str, dropout: bool) -> str:
    """``"prepass"`` or ``"correct"`` for the next update; a pure function of values that are the
    same on every rank (the previous update's reduced metrics), so every rank takes the same one.

    ``auto``: the pre-pass with dropout, or without a measurement yet (its log-ratios measure what
    a correction would have cost, for free); else correction while its measured cost -- the share
    of this update's tokens the previous update's correction re-ran (``mask/correction_token_frac``,
    forward-backward) -- is below the pre-pass's (a forward over every token, ``FORWARD_SHARE``).
    """
    if configured != "auto":
        return configured
    if dropout or not hint or "mask/correction_token_frac" not in hint:
        return "prepass"
    return "correct" if hint["mask/correction_token_frac"] < FORWARD_SHARE[recompute] else "prepass"


def diff_by_sample(mbs: list[MicroBatch], keep_guess: list[torch.Tensor], keep_exact: list[torch.Tensor]
                   ) -> dict[int, torch.Tensor]:
    """``{mini-batch index: int8 [R_i] keep_exact - keep_guess}`` for the samples of ``mbs`` that
    hold a changed token (micro-batch tokens are the samples' response tokens, in order)."""
    out: dict[int, torch.Tensor] = {}
    for mb, g, k in zip(mbs, keep_guess, keep_exact):
        d = k.to(torch.int8) - g.to(torch.int8)
        if not bool(d.any()):
            continue
        counts = torch.bincount(mb.seq_index.cpu(), minlength=len(mb.sample_index)).tolist()
        for i, part in zip(mb.sample_index, torch.split(d.cpu(), counts)):
            if bool(part.any()):
                out[i] = part
    return out


def changed_lengths(diffs: dict[int, torch.Tensor]) -> dict[int, int]:
    """Response tokens to recompute per changed sample: up to and including its last changed one."""
    return {i: int(d.nonzero().max()) + 1 for i, d in diffs.items()}


def truncate(s: Sample, r: int) -> Sample:
    """``s`` with its response cut to the first ``r`` tokens (same uid and prompt)."""
    cut = lambda a: None if a is None else np.ascontiguousarray(a[:r])  # noqa: E731
    return Sample(uid=s.uid, prompt_ids=s.prompt_ids, response_ids=cut(s.response_ids),
                  behav_logprobs=cut(s.behav_logprobs), advantages=cut(s.advantages), loss_mask=cut(s.loss_mask),
                  versions=cut(s.versions), engine_logprobs=cut(s.engine_logprobs),
                  routed_experts=None if s.routed_experts is None else
                  np.ascontiguousarray(s.routed_experts[:s.prompt_ids.shape[0] + r - 1]))


def schedule_count(n: int, multiple: int) -> int:
    """The micro-batches a correction of ``n`` runs: ``n`` filled up to a multiple of ``multiple``
    (:func:`pad_for_schedule`)."""
    return n + (-n % multiple)


def pad_for_schedule(groups: list[list[int]], weights: list, target: int, lengths: list[int],
                     cut: dict[int, int], spare: Optional[int] = None, *, last: bool = True
                     ) -> tuple[list[list[int]], list, dict[int, int]]:
    """``groups`` (and their per-token ``weights``) filled up to ``target`` micro-batches with the
    shortest changed sample (by ``lengths``, cut after ``cut[i]`` response tokens) at weight 0;
    with no changed sample, with ``spare`` cut after its first response token. Returns the groups,
    the weights and the cuts (``cut`` plus ``spare: 1`` when the spare was used).

    Two reasons to fill. Megatron's interleaved schedule (megatron-core 0.16.1
    ``pipeline_parallel/schedules.py``, ``forward_backward_pipelining_with_interleaving``) runs
    micro-batches in groups of ``microbatch_group_size_per_vp_stage`` (default: the pipeline
    size), and refuses fewer micro-batches than that or a last group shorter than the pipeline
    size; a correction often has one micro-batch (``target`` = :func:`schedule_count`). Under
    expert parallelism every MoE layer's token dispatch is an all-to-all over the expert-parallel
    group, whose ranks hold different data-parallel shards: all of them run the same number of
    micro-batches, ``target`` being the largest any of them needs, also on a rank with nothing to
    correct. A filler's loss is ``0 * (...)``: it adds exactly 0 to every gradient and to
    ``loss/*``. Weights are None off the ``last`` stage (no loss there)."""
    fill = target - len(groups)
    if fill < 0:
        raise ValueError(f"cannot fill {len(groups)} correction micro-batches up to {target}")
    if not fill:
        return groups, weights, cut
    cut = dict(cut)
    if cut:
        i = min((i for g in groups for i in g), key=lambda i: (lengths[i], i))
    elif spare is None:
        raise ValueError("a correction with no changed sample needs a spare sample to fill with")
    else:
        i, cut[spare] = spare, 1
    zero = torch.zeros(cut[i], dtype=torch.int8) if last else None  # the dtype of keep - guess
    return groups + [[i]] * fill, weights + [zero] * fill, cut
