"""VCPO's ESS step size through the real MegatronActor: each update's optimizer step runs at the
scheduler's LR times ``vcpo/lr_scale`` -- and only that update (a linear-decay schedule keeps its
own values) -- with the same ESS, factor, weights at DP=2 and PP=2 as on one rank.

Adam's first step moves every parameter with a gradient by the LR (``m / sqrt(v) = +-1`` after
bias correction; weight decay 0), so the largest weight change of the first update *is* the LR
the optimizer used."""

import os

import numpy as np
import pytest
import torch

import actor_testlib as lib
from megatron_m2po.standins.dist_testing import run_distributed

pytestmark = pytest.mark.multiproc


def _vcpo_updates(rank, world_size, root, layouts):
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch

    d = os.path.join(root, "qwen2")
    if rank == 0:
        lib.make_tiny_hf("qwen2", d, seed=5)
    torch.distributed.barrier()
    out = []
    for tp, pp in layouts:
        cfg = lib.actor_config(d, tp=tp, pp=pp, mbs=2, loss="vcpo", lr=1e-3)
        cfg.optim.lr_schedule = "linear"
        actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=4))
        samples = lib.make_samples(8, seed=6)
        rng = np.random.default_rng(0)
        for s, lp in zip(samples, actor.compute_logprobs(RolloutBatch(samples))):
            s.behav_logprobs = (lp + 0.4 * rng.standard_normal(lp.shape)).astype(np.float32)  # a stale policy
        metrics, moved, scheduled = [], [], []
        for mini in RolloutBatch(samples).split(2):
            before = {k: v.clone() for k, v in actor.iter_hf_weights()}
            metrics.append(actor.train_update(mini))
            moved.append(max(float((v - before[k]).abs().max()) for k, v in actor.iter_hf_weights()))
            scheduled.append(actor.scheduler.get_lr(actor.optimizer.param_groups[0]))
        weights = {k: v.numpy().copy() for k, v in actor.iter_hf_weights()}  # collective: every rank iterates
        out.append(((tp, pp), metrics, moved, scheduled, weights if rank == 0 else None))
        actor.close()
    return out


@pytest.mark.slow  # over 10 s on the CI machine under load: the full suite's lane
def test_vcpo_scales_each_updates_lr_alike_on_every_layout(tmp_path):
    (ref,) = run_distributed(_vcpo_updates, 1, args=(str(tmp_path), [(1, 1)]), timeout_s=240)[0]
    others = run_distributed(_vcpo_updates, 2, args=(str(tmp_path), [(1, 1), (1, 2)]), timeout_s=300)[0]
    _, m0, moved0, sched0, w0 = ref
    assert sched0[1] < sched0[0]  # the linear schedule decays between the two updates
    for u in range(2):
        scale = m0[u]["vcpo/lr_scale"]
        assert 0.2 < scale < 0.99, m0[u]  # the noise makes the ESS ratio < 1
        assert m0[u]["optim/lr"] == pytest.approx(sched0[u] * scale, rel=1e-12)
        assert m0[u]["vcpo/ess_ratio"] == pytest.approx(scale**2, rel=1e-9)  # sqrt rule, base 1
    assert moved0[0] == pytest.approx(sched0[0] * m0[0]["vcpo/lr_scale"], rel=1e-3)  # Adam's first step
    for layout, m, _, sched, w in others:  # DP=2 (one rank's shard each), PP=2
        assert sched == pytest.approx(sched0, rel=1e-12), layout
        for u in range(2):
            for key in ("vcpo/ess", "vcpo/lr_scale", "optim/lr", "loss/policy", "vcpo/is_trunc_frac"):
                assert m[u][key] == pytest.approx(m0[u][key], rel=1e-5, abs=1e-9), (layout, u, key)
        for name in w0:
            np.testing.assert_allclose(w[name], w0[name], rtol=0, atol=5e-5, err_msg=f"{layout} {name}")
