"""``algo.kl.placement=reward``: the reference-KL penalty taken from the rewards before the
advantages (verl ``algorithm.use_kl_in_reward``; docs/design.md §3, "Reference KL").

What verl does (``verl/trainer/ppo/ray_trainer.py::apply_kl_penalty``): ``kld =
core_algos.kl_penalty(old_log_probs, ref_log_prob) * response_mask`` and ``token_level_rewards =
token_level_scores - beta * kld``; its GRPO advantage (``core_algos.compute_grpo_outcome_advantage``)
starts from ``scores = token_level_rewards.sum(dim=-1)``, so a trajectory's outcome score becomes
``R - beta * sum_t k_t`` over its response tokens, normalised by group as usual. Our estimators are
``kl_penalty``'s (algo/kl.py). verl's ``old_log_probs`` are the actor's recomputed behaviour
log-probs; here the policy side is the trajectory's behaviour log-probs as the loss uses them
(``Sample.behav_logprobs``: the recomputed ones with ``algo.recompute_behav_logprobs``, else the
engine's, ``trainer/batching.py::trajectory_to_sample``), and the token mask is the loss mask.

How (every rank, :func:`penalise_step`): the step's groups are leased and scattered as usual (rank 0
built the batch with the unpenalised advantages; each rank holds its data-parallel shard of every
optimizer mini-batch). Before the first update every rank runs the frozen reference forward-only
over its shard of each mini-batch (:meth:`~megatron_m2po.actor.actor.MegatronActor.reference_logprobs`:
the micro-batches an update of it uses; one all-reduce gathers the tokens), rank 0 computes each
trajectory's penalty (``algo/kl.py::reward_penalties``, float64, in token order: the same on every
layout) and the group advantages of ``R - penalty`` over the whole step, and broadcasts them; each
rank writes them into the samples of its shards. The trajectories keep their raw reward, nothing is
written to the store: a replayed lease (after a restart) is penalised again when it is trained.

Metrics (the step's, rank 0's): ``ref/kl``, ``ref/kl_{k1,k2,k3}`` (token means of KL(behaviour ||
reference) over the step's loss tokens), ``reward/kl_penalty`` (mean over trajectories of ``coef *
sum_t k_t``), ``reward/mean`` (the raw score, as ``rollout/reward_mean``) and
``reward/penalised_mean`` (the mean of the scores the advantages were computed from).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from megatron_m2po.actor.batch import Sample, ShardedBatch
from megatron_m2po.algo.kl import reward_penalties
from megatron_m2po.algo.settings import AlgoConfig
from megatron_m2po.parallel.rank0 import from_rank0
from megatron_m2po.store.types import Trajectory
from megatron_m2po.trainer.batching import step_advantages

__all__ = ["LeadStep", "penalise_step", "penalised_advantages"]


@dataclass
class LeadStep:
    """Rank 0's whole step: its trajectories and their samples, both in the batch's order (the
    optimizer mini-batches one after another)."""

    trajs: list[Trajectory]
    samples: list[Sample]


def penalise_step(actor, minibatches: list[ShardedBatch], lead: Optional[LeadStep], algo: AlgoConfig
                  ) -> dict[str, float]:
    """All ranks, before the step's first update: the reference pass, then the penalised
    advantages written into this rank's samples (and into ``lead``'s, rank 0's whole step).
    Returns the metrics (module docstring) on every rank. Collective."""
    refs = [lp for mb in minibatches for lp in actor.reference_logprobs(mb)]
    adv, metrics = from_rank0(lambda: penalised_advantages(lead, refs, algo),
                              what="the KL-penalised advantages of the step")
    first = 0
    for mb in minibatches:
        for i, s in mb.samples.items():
            _set_advantage(s, adv[first + i])
        first += len(mb.plan)
    if lead is not None:
        for s, a in zip(lead.samples, adv):
            _set_advantage(s, a)
    return metrics


def penalised_advantages(lead: LeadStep, refs: list[np.ndarray], algo: AlgoConfig
                         ) -> tuple[np.ndarray, dict[str, float]]:
    """Rank 0: the step's float32 advantages of ``reward - penalty`` (by group) and the metrics,
    from the reference log-probs ``refs`` of ``lead.samples``."""
    samples, trajs = lead.samples, lead.trajs
    if len(samples) != len(trajs) or len(refs) != len(samples) or any(
            s.uid != t.uid for s, t in zip(samples, trajs)):
        raise AssertionError(f"the step's samples ({len(samples)}), trajectories ({len(trajs)}) and reference "
                             f"log-probs ({len(refs)}) are not one per trajectory in the batch's order")
    pen, metrics = reward_penalties([s.behav_logprobs for s in samples], refs, [s.loss_mask for s in samples],
                                    settings=algo.kl)
    adv = step_advantages(trajs, advantage=algo.advantage, adv_eps=algo.adv_eps, penalties=pen)
    rewards = np.array([float(t.reward) for t in trajs], dtype=np.float64)
    metrics["reward/mean"] = float(rewards.mean())
    metrics["reward/penalised_mean"] = float((rewards - pen).mean())
    return np.asarray(adv, dtype=np.float32), metrics


def _set_advantage(s: Sample, a: float) -> None:
    # per response token, as Sample holds them (GRPO broadcasts the trajectory's scalar)
    s.advantages = np.full(s.response_ids.shape[0], a, dtype=np.float32)
