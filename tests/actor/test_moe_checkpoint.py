"""Distributed checkpoints of a Qwen3-MoE actor across expert-parallel layouts (world 2, gloo).

The local-spec experts (``actor/experts.py``) write Megatron's ``TEGroupedMLP`` layout: one
global tensor per expert linear, each EP rank its experts' slices. A checkpoint saved at EP=2
resumes at EP=2 (weights, optimizer, next update identical) and loads at EP=1, and one saved at
EP=1 loads at EP=2, the weights bit-equal each time. Before the experts had Megatron's layout, every
EP rank saved its local experts under the same keys (``...experts.linear_fc1.weight0``), and
loading at EP=1 failed: "KeyError: decoder.layers.mlp.experts.linear_fc1.weight2 from model not in
state dict".
"""

import os

import numpy as np
import pytest

import actor_testlib as lib
from megatron_m2po.standins.dist_testing import run_distributed

pytestmark = pytest.mark.slow  # engine processes, routers or multi-rank sweeps in module fixtures: the full suite's lane


def _weights(actor):
    return {k: v.numpy().copy() for k, v in actor.iter_hf_weights()}


def _diff(a, b):
    """Names whose tensors differ (or exist on one side only)."""
    return sorted(set(a) ^ set(b)) + sorted(k for k in set(a) & set(b) if not np.array_equal(a[k], b[k]))


def _moe_checkpoints(rank, world_size, root, dist_opt):
    import multiprocessing

    from test_actor import _stale_batch
    from test_moe import _moe_config, _moe_dir

    from megatron_m2po.actor.actor import ActorConfig, MegatronActor

    # Megatron's torch_dist writer starts a multiprocessing Manager (see test_actor._checkpoint_resume).
    multiprocessing.current_process()._config["daemon"] = False
    d = _moe_dir(root, seed=5)

    def build(ep):
        cfg = _moe_config(d, ep, 1, 1)
        cfg.parallel.use_distributed_optimizer = dist_opt
        cfg.algo.m2po.threshold = 0.02
        return MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))

    out = {}
    actor = build(2)
    actor.train_step(_stale_batch(actor, lib.make_samples(4, seed=13), noise=0.4, seed=1), 2)
    saved = _weights(actor)
    ck_ep2 = os.path.join(root, "ck_ep2")
    actor.save_checkpoint(os.path.join(ck_ep2, "step_1"), {"cursor": 3})
    b2 = _stale_batch(actor, lib.make_samples(4, seed=14), noise=0.4, seed=2)
    m_a = actor.train_step(b2, 2)
    w_a = _weights(actor)
    actor.close()

    actor = build(2)  # the same layout: full resume, the next update identical
    actor.load_checkpoint(ck_ep2)
    out["ep2->ep2 weights"] = _diff(_weights(actor), saved)
    m_b = actor.train_step(b2, 2)
    out["ep2->ep2 next update"] = (_diff(_weights(actor), w_a), m_a == m_b, actor.version)
    actor.close()

    actor = build(1)  # another expert layout: the weights; the optimizer is refused with a clear error
    try:
        actor.load_checkpoint(ck_ep2)
        out["ep2->ep1 full resume"] = "loaded"
    except ValueError as e:
        out["ep2->ep1 full resume"] = str(e)
    actor.load_checkpoint(ck_ep2, model_only=True)
    out["ep2->ep1 weights"] = _diff(_weights(actor), saved)
    ck_ep1 = os.path.join(root, "ck_ep1")
    actor.save_checkpoint(os.path.join(ck_ep1, "step_1"), {})
    actor.close()

    actor = build(2)
    actor.load_checkpoint(ck_ep1, model_only=True)
    out["ep1->ep2 weights"] = _diff(_weights(actor), saved)
    actor.close()
    return out


@pytest.mark.parametrize("dist_opt", [False, True])
def test_moe_checkpoint_reshards_over_expert_parallel_layouts(tmp_path, dist_opt):
    """Save at EP=2 (DP=2, each rank 2 of the 4 experts), resume at EP=2 (weights bit-equal, the
    next update's weights and metrics identical), load at EP=1 (bit-equal), save there and load at
    EP=2 (bit-equal); with and without the distributed optimizer. A full resume at another EP is
    refused with a ValueError (the optimizer's layout depends on EP)."""
    res = run_distributed(_moe_checkpoints, 2, args=(str(tmp_path), dist_opt), timeout_s=400)
    for out in res:
        assert out["ep2->ep2 weights"] == [], out
        diff, same_metrics, version = out["ep2->ep2 next update"]
        assert diff == [] and same_metrics and version == 4, out
        assert "saved at parallel.expert_parallel=2, this run has parallel.expert_parallel=1" in \
            out["ep2->ep1 full resume"], out
        assert "set parallel.expert_parallel=2, or start a new run" in out["ep2->ep1 full resume"], out
        assert out["ep2->ep1 weights"] == [], out
        assert out["ep1->ep2 weights"] == [], out
