"""A step's samples reach every rank within the planner's headroom at the Qwen3-30B-A3B recipe's shape.

The recipe with routing replay on (``OVERRIDES``): 16 trainer ranks (TP=2 x PP=2 x DP=4), 256
prompts x 8 samples a step in 4 optimizer mini-batches, sequences up to 1024 + 7168 tokens, 48
MoE layers routing each token to 8 of 128 experts. The real path runs on 16 gloo ranks
(``trainer/batching.py`` ``shard_step``, ``parallel/rank0.py`` ``scatter_from_rank0``) with synthetic
routed experts, the recipe's sample counts and every sequence at the longest length divided by
``SCALES``; the collective audit (``standins/collective_audit.py``) counts what each rank's largest
collective call would stage on its GPU under NCCL. A part's bytes are affine in the sequence
length (per-token arrays plus per-sample headers), so the two scales extrapolate exactly to the
recipe's 8192 tokens.

Before the fix this was ``dist.scatter_object_list`` of int64 routed experts: rank 0 staged 17
parts of ~13 GB (~220 GB) against ~11 GiB of headroom.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_m2po.standins.dist_testing import run_distributed

EX = Path(__file__).resolve().parents[2] / "examples"
OVERRIDES = ["algo.routing_replay=rollout", "rollout.return_routed_experts=true", "rollout.use_router=false",
             "rollout.router_addr=null", "rollout.external_addrs=[http://rollout-node-0:30000]"]
NNODES, GPUS_PER_NODE = 2, 8
SCALES = (1024, 512)  # the recipe's prompt and response lengths divided by these


def _recipe():
    from megatron_m2po.config import load_config

    return load_config(EX / "qwen3-30b-a3b.yaml", OVERRIDES)


def _step(cfg, scale: int, layers: int, top_k: int, experts: int):
    """The step rank 0 leases: the recipe's samples, every one at the longest length / ``scale``."""
    import numpy as np

    from megatron_m2po.actor.batch import RolloutBatch, Sample

    rng = np.random.default_rng(scale)
    p, r = cfg.data.max_prompt_tokens // scale, cfg.rollout.max_new_tokens // scale
    n = cfg.trainer.prompts_per_step * cfg.rollout.n_samples_per_prompt
    return RolloutBatch([
        Sample(uid=f"step0-g{i // 8:04d}-s{i % 8}", prompt_ids=rng.integers(0, 151936, p),
               response_ids=rng.integers(0, 151936, r), behav_logprobs=-rng.random(r), advantages=rng.standard_normal(),
               loss_mask=np.ones(r), versions=np.full(r, 3), routed_experts=rng.integers(0, experts, (p + r - 1, layers, top_k)))
        for i in range(n)])


def _lease(rank, world_size, dp_of, hidden, layers, top_k, experts):
    import numpy as np

    from megatron_m2po.actor.batch import balanced_shards
    from megatron_m2po.standins import collective_audit as audit
    from megatron_m2po.trainer.batching import shard_step
    from megatron_m2po.parallel.rank0 import scatter_from_rank0

    audit.install()
    cfg = _recipe()
    dp = max(dp_of) + 1
    out = []
    for scale in SCALES:
        def lease(scale=scale):
            batch = _step(cfg, scale, layers, top_k, experts)
            shards = lambda plan, uids: balanced_shards(plan.lengths.tolist(), dp, hidden)  # noqa: E731
            return shard_step(batch, cfg.trainer.num_updates_per_step, shards, dp_of, {"scale": scale})[1]

        audit.reset_staging()
        meta, minis = scatter_from_rank0(lease, what="the step")
        peak = audit.staging_peak()
        samples = [s for mb in minis for s in mb.samples.values()]
        out.append(dict(length=samples[0].length, staged=peak.bytes, call=peak.call, meta=meta,
                        uids=sorted(s.uid for s in samples),
                        routed=sorted({str(s.routed_experts.dtype) for s in samples})))
        assert np.all([mb.plan.lengths.shape[0] == 512 for mb in minis])
    return out


@pytest.mark.multiproc
def test_step_of_the_30b_a3b_recipe_with_routing_replay_stays_within_the_planners_headroom():
    from megatron_m2po.plan import memory as P

    cfg = _recipe()
    m = P.model_shape(cfg.model.hf_path)
    plan = P.plan_from_config(cfg, m, nnodes=NNODES, gpus_per_node=GPUS_PER_NODE)
    lay = plan.layout
    assert plan.ok and m.layers == 48 and m.top_k == 8 and lay.world_size == 16, (plan.errors, m, lay)
    world, dp = lay.world_size, lay.dp
    dp_of = [(r // (lay.tp * lay.cp)) % dp for r in range(world)]  # Megatron's order: tp, cp, dp, pp
    out = run_distributed(_lease, world, args=(dp_of, m.hidden, m.layers, m.top_k, m.num_experts), timeout_s=300)

    # every rank got its replica's shard of every mini-batch, routed experts still compact
    for scale_i in range(len(SCALES)):
        by_dp: dict = {}
        for r, res in enumerate(out):
            got = res[scale_i]
            assert got["meta"] == {"scale": SCALES[scale_i]} and got["routed"] == ["uint8"], got["routed"]
            assert by_dp.setdefault(dp_of[r], got["uids"]) == got["uids"]
        assert sum(len(u) for u in by_dp.values()) == 2048 and len(set().union(*map(set, by_dp.values()))) == 2048

    # each rank's staged bytes at the recipe's full length, from the two scales
    full = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    staged = []
    for res in out:
        (l1, s1), (l2, s2) = [(x["length"], x["staged"]) for x in res]
        staged.append(s1 + (s2 - s1) * (full - l1) / (l2 - l1))
    stage0 = plan.stages[0]
    headroom = lay.budget_gib * P.GiB - (stage0.total - stage0.lease)  # what stage 0 leaves for transients
    worst = max(range(world), key=lambda r: staged[r])
    calls = {res[-1]["call"] for res in out}
    assert staged[worst] <= headroom, (
        f"rank {worst} stages {staged[worst] / P.GiB:.1f} GiB for the step ({calls}), the plan leaves "
        f"{headroom / P.GiB:.1f} GiB on stage 0")
    # and the planner counts it: its lease term is what the path stages, to within its bounds
    assert 0.95 * stage0.lease <= staged[worst] <= stage0.lease, (staged[worst], stage0.lease)
