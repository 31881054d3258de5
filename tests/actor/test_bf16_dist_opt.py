"""A bf16 actor is bf16 throughout (the local spec's norms included), so the distributed
optimizer pairs every parameter with its own state: a float32 norm in a bf16 model put two
dtypes in one optimizer group, and Megatron's dp_reshardable checkpoint then paired norm
states with the wrong norms and asserted on save (TP=2 x DP=2, found by the Qwen2.5-Math-7B
rehearsal)."""

from __future__ import annotations

import os

import pytest

import actor_testlib as lib
from megatron_m2po.standins.dist_testing import run_distributed

pytestmark = pytest.mark.slow  # engine processes, routers or multi-rank sweeps in module fixtures: the full suite's lane


def _bf16_tp2_dp2(rank, world_size, root):
    import multiprocessing

    import torch

    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch

    # Megatron's torch_dist writer starts a multiprocessing Manager (see test_actor._checkpoint_resume).
    multiprocessing.current_process()._config["daemon"] = False
    d = os.path.join(root, "qwen2")
    if rank == 0:
        lib.make_tiny_hf("qwen2", d, tie=False, seed=3)
    torch.distributed.barrier()
    cfg = lib.actor_config(d, tp=2, pp=1, mbs=1, dist_opt=True)
    cfg.model.dtype = "bfloat16"
    cfg.optim.weight_decay = 0.01
    actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=10))
    try:
        dtypes = sorted({str(p.dtype) for c in actor.chunks for p in c.parameters()})
        actor.train_step(RolloutBatch(lib.make_samples(4, seed=5)), 1)
        opt = actor.optimizer.chained_optimizers[0]
        mismatched = []
        for maps in opt.gbuf_ranges:
            for buckets in maps.values():
                for b in buckets:
                    for param, rng in b["param_map"].items():
                        n = rng["gbuf_local"].end - rng["gbuf_local"].start
                        state = opt._get_main_param_and_optimizer_states(param)
                        mismatched += [k for k, v in state.items() if torch.is_tensor(v) and v.dim() and v.numel() != n]
        actor.save_checkpoint(os.path.join(root, "ckpt", "step_1"), {})
        return dtypes, mismatched
    finally:
        actor.close()


def test_bf16_actor_is_bf16_and_its_distributed_optimizer_checkpoint_saves(tmp_path):
    for dtypes, mismatched in run_distributed(_bf16_tp2_dp2, 4, (str(tmp_path),), timeout_s=300):
        assert dtypes == ["torch.bfloat16"] and mismatched == []
