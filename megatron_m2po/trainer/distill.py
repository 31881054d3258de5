"""``algo.distill.placement=advantage``: the teacher's per-token reverse KL in the advantages
(algo/distill.py says what and why).

How (every rank, :func:`distill_step`, before the step's first update, like the reference pass of
``algo.kl.placement=reward``, trainer/kl_reward.py): the frozen teacher runs forward-only over this
rank's shard of each optimizer mini-batch (:meth:`~megatron_m2po.actor.actor.MegatronActor.teacher_logprobs`,
the micro-batches an update uses; one all-reduce gathers the tokens, so every rank holds the teacher
log-probs of every sample); rank 0 computes the step's metrics from the whole step (the task
advantages before the teacher term) and every rank gets them; then each rank writes
``A_t - coef * (behav_t - teacher_t)`` into the samples it holds (rank 0: the whole step, which its
token dumps read). Nothing is written to the store: a replayed lease (after a restart) is scored
again by the same frozen teacher, so a resumed step trains on the same numbers.

With ``algo.distill.mode=sglang`` there is no teacher pass here: the teacher engines scored the
step's trajectories when rank 0 leased them and the store keeps the values
(rollout_service/teacher.py), so each sample arrives with its ``teacher_logprobs``; the metrics and
the advantages are then computed the same way, after the KL penalty as in the other mode.
"""

from __future__ import annotations

from typing import Optional

from megatron_m2po.actor.batch import Sample, ShardedBatch
from megatron_m2po.algo.distill import distill_step_metrics, distilled_advantages
from megatron_m2po.algo.settings import AlgoConfig
from megatron_m2po.parallel.rank0 import from_rank0

__all__ = ["distill_step"]


def distill_step(actor, minibatches: list[ShardedBatch], lead: Optional[list[Sample]], algo: AlgoConfig
                 ) -> dict[str, float]:
    """All ranks, before the step's first update: the teacher pass, the metrics, then the distilled
    advantages written into this rank's samples (and into ``lead``, rank 0's whole step in the
    batch's order). Returns the metrics on every rank. Collective."""
    coef = algo.distill.coef
    if algo.distill.mode == "sglang":
        return _stored_teacher_step(minibatches, lead, coef)
    teachers = [lp for mb in minibatches for lp in actor.teacher_logprobs(mb)]

    def metrics() -> dict[str, float]:
        if lead is None or len(lead) != len(teachers):
            raise AssertionError(f"the step's samples ({None if lead is None else len(lead)}) and teacher log-probs "
                                 f"({len(teachers)}) are not one per trajectory in the batch's order")
        return distill_step_metrics([s.advantages for s in lead], [s.behav_logprobs for s in lead], teachers,
                                    [s.loss_mask for s in lead], coef)

    out = from_rank0(metrics, what="the distillation metrics of the step")
    done: set[int] = set()  # rank 0's shards hold some of lead's very samples: each is written once

    def write(s: Sample, teacher) -> None:
        if id(s) not in done:
            done.add(id(s))
            s.advantages = distilled_advantages(s.advantages, s.behav_logprobs, teacher, s.loss_mask, coef)

    first = 0
    for mb in minibatches:
        for i, s in mb.samples.items():
            write(s, teachers[first + i])
        first += len(mb.plan)
    for s, t in zip(lead or [], teachers):
        write(s, t)
    return out


def _stored_teacher_step(minibatches: list[ShardedBatch], lead: Optional[list[Sample]], coef: float
                         ) -> dict[str, float]:
    """:func:`distill_step` with the teacher's log-probs the samples carry (mode=sglang). Collective."""
    def missing(samples) -> list[str]:
        return [s.uid for s in samples if s.teacher_logprobs is None][:5]

    def metrics() -> dict[str, float]:
        if lead is None or missing(lead):
            raise AssertionError(f"samples without teacher log-probs reached the step: {missing(lead or [])}")
        return distill_step_metrics([s.advantages for s in lead], [s.behav_logprobs for s in lead],
                                    [s.teacher_logprobs for s in lead], [s.loss_mask for s in lead], coef)

    out = from_rank0(metrics, what="the distillation metrics of the step")
    done: set[int] = set()
    for s in [s for mb in minibatches for s in mb.samples.values()] + list(lead or []):
        if id(s) not in done:
            done.add(id(s))
            s.advantages = distilled_advantages(s.advantages, s.behav_logprobs, s.teacher_logprobs, s.loss_mask, coef)
    return out
