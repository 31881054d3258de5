"""Reference-model KL on the actor (actor/reference.py, algo/kl.py), CPU / gloo: a train step with
``algo.kl.coef=0.05 algo.kl.estimator=k3`` gives the one-rank result at TP=2, DP=2 and PP=2; at the
first update (policy == reference) the KL is exactly 0; M2PO's mask does not depend on the KL
coefficient; the reference stays frozen, off the device and without gradients. With
``algo.kl.placement=reward`` the actor's reference pass (``reference_logprobs``) is layout-free and
the update has no KL term."""

import os

import numpy as np
import pytest
import torch

import actor_testlib as lib
from megatron_m2po.standins.dist_testing import run_distributed


def _gathered_mask(rec, update):
    objs = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(objs, rec.mask(update))
    out = {}
    for part in objs:
        out.update(part)
    return out


def _kl_layouts(rank, world_size, root, layouts):
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch

    d = os.path.join(root, "qwen3")
    if rank == 0:
        lib.make_tiny_hf("qwen3", d, seed=4)
    torch.distributed.barrier()
    res = []
    for tp, pp, coef, packing in layouts:
        cfg = lib.actor_config(d, tp=tp, pp=pp, mbs=2)
        cfg.parallel.packing = packing
        cfg.algo.m2po.threshold = 0.02
        cfg.algo.kl.coef, cfg.algo.kl.estimator = coef, "k3"
        actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))
        samples = lib.make_samples(8, seed=5)
        rng = np.random.default_rng(0)
        for s, lp in zip(samples, actor.compute_logprobs(RolloutBatch(samples))):  # a stale behaviour policy
            s.behav_logprobs = (lp + 0.5 * rng.standard_normal(lp.shape)).astype(np.float32)
        ref = actor.reference
        frozen = None
        if ref is not None:
            assert all(not p.requires_grad for c in ref.chunks for p in c.parameters())
            frozen = {k: v.clone() for k, v in ref.chunks[0].state_dict().items() if isinstance(v, torch.Tensor)}
        rec = lib.Recorder(actor)
        metrics = actor.train_step(RolloutBatch(samples), num_minibatches=2)
        mask0 = _gathered_mask(rec, 0)  # the last stage's records, from every rank
        if ref is not None:
            assert not ref.resident
            after = ref.chunks[0].state_dict()
            assert all(torch.equal(after[k], v) for k, v in frozen.items()), "the reference changed"
        weights = {k: v.numpy().copy() for k, v in actor.iter_hf_weights()}
        actor.close()
        res.append(((tp, pp, coef, packing), metrics, mask0, weights))
    return res


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_reference_kl_layout_invariance_and_first_update(tmp_path):
    single = run_distributed(_kl_layouts, 1, args=(str(tmp_path), [(1, 1, 0.0, False), (1, 1, 0.05, False)]),
                             timeout_s=240)[0]
    double = run_distributed(_kl_layouts, 2, args=(str(tmp_path), [
        (2, 1, 0.05, False), (1, 1, 0.05, True), (1, 2, 0.05, False)]), timeout_s=300)[0]
    (_, m_off, mask_off, w_off), (_, m0, mask0, w0) = single
    # the first update: policy == reference, so every estimator is exactly 0 (and so is the term)
    for key in ("ref/kl", "ref/kl_k1", "ref/kl_k2", "ref/kl_k3", "loss/kl", "ref/penalty_share"):
        assert m0[0][key] == 0.0, (key, m0[0])
    # the second update runs at weights one step away from the reference: a positive KL that is
    # part of the loss
    assert m0[1]["ref/kl"] > 0 and m0[1]["ref/kl"] == m0[1]["ref/kl_k3"]
    assert m0[1]["loss/kl"] == pytest.approx(0.05 * m0[1]["ref/kl"], rel=1e-6)
    assert m0[1]["loss/total"] == pytest.approx(m0[1]["loss/policy"] + m0[1]["loss/kl"], rel=1e-6, abs=1e-9)
    assert 0 < m0[1]["ref/penalty_share"] < 1
    assert not any(k.startswith("ref/") or k == "loss/kl" for k in m_off[0]), sorted(m_off[0])
    # M2PO's mask comes from the policy ratio only: the same with and without the KL term
    assert sum(not k for k in mask0.values()) > 0 and mask0 == mask_off
    for layout, m, mask, w in double:  # TP=2; DP=2 with packed micro-batches; PP=2
        assert mask == mask0, layout
        for u in range(2):
            for key in ("ref/kl", "ref/kl_k1", "ref/kl_k2", "loss/kl", "loss/policy", "loss/total",
                        "m2po/mask_frac", "optim/grad_norm"):
                assert m[u][key] == pytest.approx(m0[u][key], rel=1e-5, abs=1e-9), (layout, u, key)
        for name in w0:
            np.testing.assert_allclose(w[name], w0[name], rtol=0, atol=5e-5, err_msg=f"{layout} {name}")


def _every_loss(rank, world_size, root):
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch
    from megatron_m2po.algo.losses import LOSSES

    d = os.path.join(root, "llama")
    lib.make_tiny_hf("llama", d, seed=9)
    res = {}
    for loss in sorted(LOSSES):
        cfg = lib.actor_config(d, mbs=2, loss=loss)
        cfg.algo.kl.coef, cfg.algo.kl.estimator = 0.1, "k2"
        actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))
        samples = lib.make_samples(4, seed=10)
        for s, lp in zip(samples, actor.compute_logprobs(RolloutBatch(samples))):
            s.behav_logprobs = (lp + 0.3 * np.random.default_rng(1).standard_normal(lp.shape)).astype(np.float32)
        res[loss] = actor.train_step(RolloutBatch(samples), 2)
        actor.close()
    return res


@pytest.mark.slow  # over 10 s on the CI machine under load: the full suite's lane
def test_every_registered_loss_takes_the_kl_term(tmp_path):
    """Each loss of the registry: the term is added to its loss (loss/total = loss/policy +
    loss/kl), 0 at the first update, positive after one step away from the reference."""
    (res,) = run_distributed(_every_loss, 1, args=(str(tmp_path),), timeout_s=240)
    assert {"m2po", "grpo", "gspo", "vcpo"} <= set(res)
    for loss, (m0, m1) in res.items():
        assert m0["ref/kl"] == m0["loss/kl"] == 0.0, loss
        assert m1["ref/kl"] == m1["ref/kl_k2"] > 0, loss
        for m in (m0, m1):
            assert m["loss/total"] == pytest.approx(m["loss/policy"] + m["loss/kl"], rel=1e-6, abs=1e-9), (loss, m)
            assert m["loss/kl"] == pytest.approx(0.1 * m["ref/kl"], rel=1e-6), loss


def _reward_placement(rank, world_size, root, layouts):
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import BatchPlan, RolloutBatch, ShardedBatch

    d = os.path.join(root, "qwen3")
    if rank == 0:
        lib.make_tiny_hf("qwen3", d, seed=4)
    torch.distributed.barrier()
    res = []
    for tp, coef, packing in layouts:
        cfg = lib.actor_config(d, tp=tp, mbs=2)
        cfg.parallel.packing = packing
        cfg.algo.m2po.threshold = 0.02
        cfg.algo.kl.coef, cfg.algo.kl.placement = coef, "reward"
        actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))
        samples = lib.make_samples(8, seed=5)
        rng = np.random.default_rng(0)
        policy = actor.compute_logprobs(RolloutBatch(samples))
        for s, lp in zip(samples, policy):  # a stale behaviour policy
            s.behav_logprobs = (lp + 0.5 * rng.standard_normal(lp.shape)).astype(np.float32)
        refs = None
        if coef > 0:  # this rank's data-parallel shard only, as the trainer sends it
            plan = BatchPlan.of(samples)
            mine = actor.shards(plan)[actor.dp_rank]
            refs = actor.reference_logprobs(ShardedBatch(plan, {i: samples[i] for i in mine}))
        rec = lib.Recorder(actor)
        metrics = actor.train_step(RolloutBatch(samples), num_minibatches=2)
        after = actor.reference_logprobs(RolloutBatch(samples)) if coef > 0 else None
        mask0 = _gathered_mask(rec, 0)
        actor.close()
        res.append(((tp, coef, packing), policy, refs, after, metrics, mask0))
    return res


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_reward_placement_reference_pass_and_no_loss_term(tmp_path):
    """``algo.kl.placement=reward`` on the actor: ``reference_logprobs`` (the step's reference pass,
    trainer/kl_reward.py) gives every rank all samples' reference log-probs, the same at DP=2 with
    packing (each rank runs its shard) as on one rank, equal to the policy's at the first update and unchanged
    by training; the update itself has no KL term: the same metrics and M2PO mask as coef=0."""
    single = run_distributed(_reward_placement, 1, args=(str(tmp_path), [(1, 0.0, False), (1, 0.05, False)]),
                             timeout_s=240)[0]
    double = run_distributed(_reward_placement, 2, args=(str(tmp_path), [(1, 0.05, True)]), timeout_s=300)
    (_, _, _, _, m_off, mask_off), (_, policy, refs, after, m_on, mask_on) = single
    assert len(refs) == 8 and [r.shape for r in refs] == [p.shape for p in policy]
    for r, p, a in zip(refs, policy, after):
        np.testing.assert_allclose(r, p, rtol=0, atol=1e-6)  # policy == reference before any update
        np.testing.assert_array_equal(a, r)                  # the reference is frozen
    assert m_on == m_off and not any(k.startswith("ref/") or k == "loss/kl" for k in m_on[0]), sorted(m_on[0])
    # M2PO's mask comes from the policy ratio only: placement=reward leaves it as coef=0 has it
    assert sum(not k for k in mask_on.values()) > 0 and mask_on == mask_off
    for per_rank in double:  # each rank of DP=2 with packing
        for layout, _, r2, _, m2, mask2 in per_rank:
            assert mask2 == mask_on, layout
            for a, b in zip(r2, refs):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=str(layout))
            assert m2[1]["loss/total"] == pytest.approx(m_on[1]["loss/total"], rel=1e-5, abs=1e-9), layout
