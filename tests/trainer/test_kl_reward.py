"""``algo.kl.placement=reward`` (trainer/kl_reward.py, algo/kl.py ``reward_penalties``): the
advantages of a tiny step from given behaviour and reference log-probs, against values computed by
hand; the behaviour side is the recomputed log-probs when they are used; the trajectories keep
their raw rewards; on two data-parallel ranks each rank's shard gets its advantages."""

import math

import numpy as np
import pytest

from megatron_m2po.algo.kl import reward_penalties
from megatron_m2po.config import Config
from megatron_m2po.standins.dist_testing import run_distributed
from megatron_m2po.store.types import Group, Trajectory
from megatron_m2po.trainer.batching import groups_to_batch, shard_step, step_trajectories
from megatron_m2po.trainer.kl_reward import LeadStep, penalise_step, penalised_advantages

# group "a": three responses, group "b": two. d = behav - ref per loss token.
BEHAV = {"a0": [-1.0, -2.0], "a1": [-0.5, -3.0, -1.0], "a2": [-0.1], "b0": [-0.4, -0.2], "b1": [-0.3]}
REF = {"a0": [-1.2, -1.5], "a1": [-0.5, float("-inf"), -0.7], "a2": [-0.1], "b0": [-0.4, -0.6], "b1": [-0.3]}
MASK = {"a1": [1, 0, 1]}  # a1's middle token is not a loss token: its -inf reference is ignored
REWARD = {"a0": 1.0, "a1": 0.0, "a2": 1.0, "b0": 1.0, "b1": 1.0}
COEF = 0.5


def _k3(d):  # exp(-d) + d - 1
    return math.exp(-d) + d - 1


# sum_t k3 over loss tokens, by hand: a0 d = 0.2, -0.5; a1 d = 0, -0.3; b0 d = 0, 0.4
K3_SUM = {"a0": _k3(0.2) + _k3(-0.5), "a1": _k3(-0.3), "a2": 0.0, "b0": _k3(0.4), "b1": 0.0}


def _groups(recomputed: bool = False):
    out = []
    for gid in ("a", "b"):
        trajs = []
        for uid in (u for u in BEHAV if u[0] == gid):
            n = len(BEHAV[uid])
            # with recompute, the engine's log-probs are off by 0.3: the penalty must not see them
            engine = [x - 0.3 for x in BEHAV[uid]] if recomputed else BEHAV[uid]
            trajs.append(Trajectory(uid=uid, group_id=gid, prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)),
                                    behav_logprobs=engine, versions=0, reward=REWARD[uid],
                                    loss_mask=MASK.get(uid, [1] * n),
                                    recomputed_behav_logprobs=BEHAV[uid] if recomputed else None))
        out.append(Group(gid, trajs))
    return out


def _algo(advantage="grpo", recomputed=False):
    algo = Config().algo
    algo.kl.coef, algo.kl.estimator, algo.kl.placement = COEF, "k3", "reward"
    algo.advantage, algo.recompute_behav_logprobs = advantage, recomputed
    return algo


def _by_hand(uids, advantage="grpo"):
    """(R - coef * sum k3 - mean_group) / (std_group + 1e-6), sample std (ddof 1)."""
    scores = {u: REWARD[u] - COEF * K3_SUM[u] for u in uids}
    out = {}
    for gid in ("a", "b"):
        members = [u for u in uids if u[0] == gid]
        mean = sum(scores[u] for u in members) / len(members)
        std = math.sqrt(sum((scores[u] - mean) ** 2 for u in members) / (len(members) - 1))
        for u in members:
            out[u] = (scores[u] - mean) / ((std + 1e-6) if advantage == "grpo" else 1.0)
    return out


@pytest.mark.parametrize("recomputed,advantage", [(False, "grpo"), (True, "grpo"), (False, "grpo_no_std")])
def test_penalised_advantages_by_hand(recomputed, advantage):
    algo = _algo(advantage, recomputed)
    groups = _groups(recomputed)
    batch = groups_to_batch(groups, advantage=advantage, use_recomputed=recomputed)
    uids = [s.uid for s in batch.samples]
    assert uids == ["a0", "a1", "a2", "b0", "b1"]
    # the raw rewards would give group b (all 1.0) exactly 0; its penalties tell b0 from b1
    assert not batch.samples[3].advantages.any()
    refs = [np.array(REF[u], np.float32) for u in uids]
    adv, metrics = penalised_advantages(LeadStep(step_trajectories(groups), batch.samples), refs, algo)
    want = _by_hand(uids, advantage)
    assert adv.dtype == np.float32
    assert adv.tolist() == pytest.approx([want[u] for u in uids], rel=1e-6, abs=1e-6)
    assert adv[3] < 0 < adv[4]  # b0 drifted from the reference, b1 did not
    n_tokens = 8  # loss tokens of the step
    assert metrics["ref/kl"] == metrics["ref/kl_k3"] == pytest.approx(sum(K3_SUM.values()) / n_tokens, rel=1e-6)
    assert metrics["ref/kl_k1"] == pytest.approx((0.2 - 0.5 + 0 - 0.3 + 0 + 0 + 0.4) / n_tokens, rel=1e-5)
    assert metrics["reward/kl_penalty"] == pytest.approx(COEF * sum(K3_SUM.values()) / 5, rel=1e-6)
    assert metrics["reward/mean"] == pytest.approx(0.8)
    assert metrics["reward/penalised_mean"] == pytest.approx(0.8 - metrics["reward/kl_penalty"])
    # the trajectories (what the store holds) keep their raw rewards
    assert [t.reward for g in groups for t in g.trajectories] == [REWARD[u] for u in uids]


def test_reward_penalties_refuses_a_non_finite_loss_token():
    with pytest.raises(ValueError, match=r"1 loss tokens of trajectories \[1\]"):
        reward_penalties([np.zeros(2), np.zeros(2)], [np.zeros(2), np.array([0.0, np.nan])],
                         [np.ones(2), np.ones(2)], settings=Config().algo.kl)


class _Reference:
    """The actor's ``reference_logprobs`` as the trainer sees it: every sample of the mini-batch."""

    def __init__(self, minis):
        self.minis = iter(minis)

    def reference_logprobs(self, mb):
        return [np.array(REF[uid], np.float32) for uid in next(self.minis)]


def _two_ranks(rank, world_size):
    groups = _groups()
    batch = groups_to_batch(groups)
    uids = [s.uid for s in batch.samples][:4]  # two mini-batches of two (a0 a1 | a2 b0); b1 left out
    batch.samples = batch.samples[:4]
    groups[1].trajectories = groups[1].trajectories[:1]
    # DP=2: sample 0 of each mini-batch to rank 0, sample 1 to rank 1
    minis, parts = shard_step(batch, 2, lambda plan, uids: [[0], [1]], [0, 1], {})
    lead = LeadStep(step_trajectories(groups), [s for m in minis for s in m]) if rank == 0 else None
    _, mine = parts[rank]
    metrics = penalise_step(_Reference([uids[:2], uids[2:]]), mine, lead, _algo())
    return {s.uid: s.advantages.tolist() for mb in mine for s in mb.samples.values()}, metrics


def test_two_data_parallel_ranks_get_their_shards_advantages():
    """``penalise_step`` on 2 gloo ranks: rank 0 computes the step's advantages, each rank writes
    them into the samples of its own shards (a0, a2 on rank 0; a1, b0 on rank 1)."""
    (adv0, m0), (adv1, m1) = run_distributed(_two_ranks, 2, timeout_s=60)
    assert sorted(adv0) == ["a0", "a2"] and sorted(adv1) == ["a1", "b0"] and m0 == m1
    scores = {u: REWARD[u] - COEF * K3_SUM[u] for u in ("a0", "a1", "a2")}
    mean = sum(scores.values()) / 3
    std = math.sqrt(sum((v - mean) ** 2 for v in scores.values()) / 2)
    for u, a in {**adv0, **adv1}.items():
        want = 0.0 if u == "b0" else (scores[u] - mean) / (std + 1e-6)  # b0 is alone in its group
        assert a == pytest.approx([want] * len(BEHAV[u]), rel=1e-6, abs=1e-6), u
