"""Qwen3-MoE on Megatron's MoE layer (CPU / gloo): log-probs equal HF transformers' at expert
parallel (EP), EP x tensor parallel (expert tensor parallel = TP, as Megatron defaults it) and
pipeline parallel layouts; a train step is layout-invariant under EP like the dense model's;
the CPU platform's uneven all-gather; config and model-build checks of the expert layout.

The tiny model: 2 layers, 4 experts of intermediate size 32, top-2 with renormalised weights
(``actor_testlib.make_tiny_hf("qwen3_moe")``), random weights, built locally.
"""

import os

import numpy as np
import pytest
import torch

import actor_testlib as lib
from megatron_m2po.utils.dist_testing import run_distributed


def _moe_dir(root, seed=2):
    d = os.path.join(root, f"qwen3_moe_{seed}")
    if torch.distributed.get_rank() == 0:
        lib.make_tiny_hf("qwen3_moe", d, seed=seed)
    torch.distributed.barrier()
    return d


def _moe_config(d, ep, tp, pp, mbs=2):
    cfg = lib.actor_config(d, tp=tp, pp=pp, mbs=mbs)
    cfg.parallel.expert_parallel = ep
    cfg.parallel.sequence_parallel = tp > 1  # Megatron trains MoE under TP only with SP
    return cfg.validate()


def _logprob_errors(rank, world_size, root, layouts):
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch

    d = _moe_dir(root)
    samples = lib.make_samples(6, seed=11)
    out = []
    for ep, tp, pp in layouts:
        actor = MegatronActor.from_config(ActorConfig.from_config(_moe_config(d, ep, tp, pp), total_updates=10))
        lps = actor.compute_logprobs(RolloutBatch(samples))
        actor.close()
        err = max(float(np.abs(lp - lib.hf_logprobs(d, s.prompt_ids, s.response_ids)).max())
                  for lp, s in zip(lps, samples))
        out.append(((ep, tp, pp), err))
    return out


@pytest.mark.parametrize("world_size,layouts", [
    (1, [(1, 1, 1)]),
    (2, [(2, 1, 1), (1, 1, 2)]),
    (4, [(2, 2, 1)]),
])
def test_moe_logprobs_match_hf(tmp_path, world_size, layouts):
    """fp32 log-probs of a tiny Qwen3-MoE equal HF transformers' within 1e-5 at (EP, TP, PP) =
    (1,1,1), (2,1,1), (1,1,2) and (2,2,1) (expert TP = 2, sequence parallel)."""
    res = run_distributed(_logprob_errors, world_size, args=(str(tmp_path), layouts), timeout_s=240)
    for rank_res in res:
        for layout, err in rank_res:
            print(f"EP, TP, PP = {layout}: max |logp - HF| = {err:.2e}")
            assert err < 1e-5, (layout, err)
