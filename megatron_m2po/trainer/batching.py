"""From stored prompt groups to the actor's batch: GRPO advantages, rollout metrics.

Advantages are computed per group over all its samples (docs/design.md §3) before the step is split
into optimizer mini-batches; a step always holds whole groups, so a mini-batch of
``prompts_per_update`` prompts holds whole groups too.
"""

from __future__ import annotations

import numpy as np

from typing import Any, Callable

from megatron_m2po.actor.batch import BatchPlan, RolloutBatch, Sample, ShardedBatch
from megatron_m2po.algo.advantages import grpo_advantages
from megatron_m2po.rollout.episodes import END_REASONS
from megatron_m2po.store.types import Group, Trajectory


def _group_order_key(g: Group) -> tuple:
    # Deterministic order whatever the arrival order: (step tag, position) from the id.
    return (g.group_id,)


def groups_to_batch(groups: list[Group], *, advantage: str = "grpo", adv_eps: float = 1e-6,
                    use_recomputed: bool = False) -> RolloutBatch:
    """One ``Sample`` per trajectory, groups in id order, advantages by group."""
    trajs = step_trajectories(groups)
    adv = step_advantages(trajs, advantage=advantage, adv_eps=adv_eps)
    return RolloutBatch([trajectory_to_sample(t, a, use_recomputed=use_recomputed) for t, a in zip(trajs, adv)])


def step_trajectories(groups: list[Group]) -> list[Trajectory]:
    """The step's trajectories in the batch's order (groups in id order); unscored ones raise."""
    trajs = [t for g in sorted(groups, key=_group_order_key) for t in g.trajectories]
    if any(t.reward is None for t in trajs):
        missing = [t.uid for t in trajs if t.reward is None][:5]
        raise ValueError(f"unscored trajectories reached the trainer: {missing}")
    return trajs


def step_advantages(trajs: list[Trajectory], *, advantage: str = "grpo", adv_eps: float = 1e-6,
                    penalties: np.ndarray | None = None) -> np.ndarray:
    """GRPO advantages of ``trajs`` by group, from their rewards minus ``penalties`` (one per
    trajectory, ``algo.kl.placement=reward``: trainer/kl_reward.py) when given. The trajectories'
    rewards are never changed."""
    rewards = np.array([float(t.reward) for t in trajs], dtype=np.float64)
    if penalties is not None:
        rewards = rewards - np.asarray(penalties, dtype=np.float64)
    return grpo_advantages(rewards, [t.group_id for t in trajs], eps=adv_eps, normalize_std=(advantage == "grpo"))


def shard_step(batch: RolloutBatch, num_updates: int, shards: Callable[..., list[list[int]]], dp_of: list[int],
               meta: Any) -> tuple[list[list[Sample]], list[tuple[Any, list[ShardedBatch]]]]:
    """A step as each global rank receives it (``parallel/rank0.py`` ``scatter_from_rank0``).

    ``batch`` is split into ``num_updates`` optimizer mini-batches in order; ``shards(plan, uids=...)``
    (the actor's :meth:`~megatron_m2po.actor.actor.MegatronActor.shards`) assigns each mini-batch's
    samples to data-parallel ranks. Returns the mini-batches' samples and, per global rank ``r``,
    ``(meta, [ShardedBatch of data-parallel rank dp_of[r], one per mini-batch])``: the ranks of one
    replica (its TP / PP / CP ranks) share one object, which rank 0 pickles and sends once."""
    minis, per_dp = [], {}
    for mini in batch.split(num_updates):
        plan = BatchPlan.of(mini.samples)
        minis.append((plan, mini.samples, shards(plan, uids=[s.uid for s in mini.samples])))
    for dp in sorted(set(dp_of)):
        per_dp[dp] = (meta, [ShardedBatch(plan, {i: samples[i] for i in parts[dp]}) for plan, samples, parts in minis])
    return [samples for _, samples, _ in minis], [per_dp[dp] for dp in dp_of]


def trajectory_to_sample(t: Trajectory, advantage: float = 0.0, *, use_recomputed: bool = False) -> Sample:
    """The actor's view of one trajectory (the only Trajectory -> Sample conversion).

    ``use_recomputed``: the trainer's recomputed behaviour log-probs are the behaviour policy and
    the engine's become ``engine_logprobs`` (TIS, mismatch KL).
    """
    behav, engine = t.behav_logprobs, None
    if use_recomputed:
        if t.recomputed_behav_logprobs is None:
            raise ValueError(f"trajectory {t.uid!r} has no recomputed behaviour log-probs but "
                             "algo.recompute_behav_logprobs=true")
        behav, engine = t.recomputed_behav_logprobs, t.behav_logprobs
    return Sample(uid=t.uid, prompt_ids=t.prompt_ids, response_ids=t.response_ids, behav_logprobs=behav,
                  advantages=np.float32(advantage), loss_mask=t.loss_mask, versions=t.versions,
                  engine_logprobs=engine, routed_experts=t.routed_experts, teacher_logprobs=t.teacher_logprobs)


def rollout_metrics(groups: list[Group], *, correct_reward: float) -> dict[str, float]:
    """rollout/{reward_mean, acc, response_len, ...} of a step's groups."""
    trajs = [t for g in groups for t in g.trajectories]
    if not trajs:
        return {}
    rewards = np.array([float(t.reward) for t in trajs])
    lens = np.array([t.response_ids.shape[0] for t in trajs])
    finish = [t.finish_reason for t in trajs]
    per_group = np.array([[float(t.reward) for t in g.trajectories] for g in groups], dtype=object)
    solved_all = np.mean([all(r >= correct_reward for r in row) for row in per_group])
    solved_none = np.mean([all(r < correct_reward for r in row) for row in per_group])
    return {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/acc": float((rewards >= correct_reward).mean()),
        "rollout/response_len": float(lens.mean()),
        "rollout/response_len_max": float(lens.max()),
        "rollout/truncated_frac": float(np.mean([f == "length" for f in finish])),
        "rollout/groups_all_correct": float(solved_all),
        "rollout/groups_all_wrong": float(solved_none),
        "rollout/num_trajectories": float(len(trajs)),
        **episode_metrics(trajs),
        **routing_metrics(trajs),
    }


def routing_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """``rollout/routing_version_mismatch`` (a sum) and ``..._frac`` (of the model tokens): model
    tokens whose stored routed experts are not the routing their behaviour log-prob was computed over
    (``metadata["routing"]``, rollout/routing_versions.py: sampled before a weight push retracted the
    request, or an agentic turn over rows kept from before a push); masked from the loss when routing
    is replayed. Empty when no trajectory keeps routed experts."""
    recs = [t.metadata.get("routing") for t in trajs if isinstance(t.metadata.get("routing"), dict)]
    if not recs:
        return {}
    bad = sum(int(r.get("mismatched_tokens", 0)) for r in recs)
    model = sum(int(r.get("model_tokens", 0)) for r in recs)
    return {"rollout/routing_version_mismatch": float(bad),
            "rollout/routing_version_mismatch_frac": float(bad / max(model, 1))}


def episode_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """Multi-turn episodes (``metadata["episode"]``, rollout/episodes.py): turns, how episodes ended
    (a count per reason: timeouts are never silent), environment time, prefix-cache reuse."""
    eps = [t.metadata.get("episode") for t in trajs if isinstance(t.metadata.get("episode"), dict)]
    if not eps:
        return {}
    sent = sum(int(e.get("sent_tokens", 0)) for e in eps)
    out = {"rollout/episode_turns": float(np.mean([e.get("turns", 0) for e in eps])),
           "rollout/episode_env_s": float(np.mean([e.get("env_s", 0.0) for e in eps])),
           "rollout/episode_wall_s": float(np.mean([e.get("wall_s", 0.0) for e in eps])),
           "rollout/episode_cached_frac": float(sum(int(e.get("cached_tokens", 0)) for e in eps) / max(sent, 1))}
    for reason in END_REASONS:
        out[f"rollout/episode_end/{reason}"] = float(sum(e.get("end") == reason for e in eps))
    return out
