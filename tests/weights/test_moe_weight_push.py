"""Weight pushes from a Qwen3-MoE actor at EP=2 to a CPU worker (transformers 5 model, fused
experts): distributed and disk updates under the checkpoint's per-expert names, as SGLang 0.5.23's
Qwen3-MoE loader reads them; afterwards the engine's sampling log-probs equal the trainer's.

Before the worker mapped per-expert names onto transformers' fused expert tensors
(``standins/hf_fused_experts.py``) the first push failed: "update_weights_from_distributed failed
... 1 tensors do not fit the model: ['model.layers.0.mlp.experts.0.gate_proj.weight (unknown)']".
"""

from __future__ import annotations

import asyncio
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "actor"))  # actor_testlib
import actor_testlib as lib  # noqa: E402
from megatron_m2po.config import RolloutConfig
from megatron_m2po.rollout.client import SGLangClient
from megatron_m2po.rollout.engines import EngineFleet
from megatron_m2po.standins.dist_testing import run_distributed


@pytest.fixture(scope="module")
def moe_fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_push")
    hf = lib.make_tiny_hf("qwen3_moe", str(root / "qwen3_moe"), seed=6)
    cfg = RolloutConfig(engine="cpu_worker", launcher="local", num_engines=1, base_port=0, use_router=False,
                        weight_sync_timeout_s=60.0)
    f = EngineFleet(cfg, hf, run_dir=str(root / "run"), startup_timeout_s=120).start()
    try:
        yield f, hf
    finally:
        f.stop()


async def _sample(url: str, prompts: list[list[int]]):
    async with SGLangClient(url) as c:
        outs = [await c.generate(p, {"temperature": 1.0, "max_new_tokens": 6}) for p in prompts]
        return [(o.output_ids, o.output_logprobs) for o in outs], await c.weight_version()


def _push_job(rank, world, hf, url, sync_dir):
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch, Sample
    from megatron_m2po.weights.stage import push_from_stages
    from megatron_m2po.weights.disk import DiskWeightSync
    from megatron_m2po.weights.distributed import DistributedWeightSync
    from megatron_m2po.weights.hf_export import stage_hf_weights, stage_layout

    cfg = lib.actor_config(hf)
    cfg.parallel.expert_parallel = 2
    actor = MegatronActor.from_config(ActorConfig.from_config(cfg.validate(), total_updates=10))
    layout = stage_layout()
    dist_sync = DistributedWeightSync([url], backend="gloo", bucket_mb=0.02, timeout_s=60) if rank == 0 else None
    disk_sync = DiskWeightSync([url], sync_dir, base_model_dir=hf, shard_mb=0.05, timeout_s=60) if rank == 0 else None
    prompts = [list(map(int, np.random.default_rng(i).integers(0, 128, 5))) for i in range(4)]
    out = []
    try:
        for version, sync in ((1, dist_sync), (2, disk_sync)):
            g = torch.Generator().manual_seed(version)  # the same draws on both ranks: replicas stay equal
            with torch.no_grad():
                for p in actor.chunks[0].parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=g))
            push_from_stages(sync, stage_hf_weights(actor), version, stage=layout.stage,
                             n_stages=layout.n_stages, sender=layout.sender)
            got = [asyncio.run(_sample(url, prompts))] if rank == 0 else [None]
            torch.distributed.broadcast_object_list(got, src=0)
            gen, engine_version = got[0]
            samples = [Sample(uid=f"v{version}s{i}", prompt_ids=p, response_ids=ids,
                              behav_logprobs=np.zeros(len(ids), np.float32), advantages=np.float32(0),
                              loss_mask=np.ones(len(ids), np.uint8), versions=np.full(len(ids), version))
                       for i, (p, (ids, _)) in enumerate(zip(prompts, gen))]
            trainer = actor.compute_logprobs(RolloutBatch(samples))
            err = max(float(np.abs(np.asarray(lps) - t).max()) for (_, lps), t in zip(gen, trainer))
            out.append((version, engine_version, err))
    finally:
        for s in (dist_sync, disk_sync):
            if s is not None:
                s.close()
        actor.close()
    return out


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_moe_weights_pushed_at_ep2_give_the_engine_the_trainers_logprobs(moe_fleet, tmp_path):
    """EP=2 (each rank 2 of 4 experts; world 2): perturb every weight, push (distributed, then disk),
    sample from the engine: its log-probs equal the trainer's on the sampled tokens (fp32, 1e-5)."""
    f, hf = moe_fleet
    res = run_distributed(_push_job, 2, args=(hf, f.engine_urls[0], str(tmp_path / "weights")), timeout_s=300)
    for version, engine_version, err in res[0]:
        print(f"version {version}: max |engine - trainer| = {err:.2e}")
        assert engine_version == str(version) and err < 1e-5, (version, engine_version, err)


def test_cpu_worker_maps_per_expert_names_and_refuses_fused_ones(tmp_path):
    """The CPU worker's loader (``Engine.load_weights``): per-expert HF names fill the slices of
    transformers' fused expert tensors that SGLang's ``make_expert_params_mapping`` names (gate ->
    first half of w13, up -> second, down -> w2); transformers' fused names, which SGLang's loader
    skips, are refused, as are out-of-range experts and wrong shapes."""
    from megatron_m2po.standins.cpu_worker import Engine

    hf = lib.make_tiny_hf("qwen3_moe", str(tmp_path / "m"), seed=1)
    eng = Engine(hf)
    params = dict(eng.model.named_parameters())
    gu, down = params["model.layers.1.mlp.experts.gate_up_proj"], params["model.layers.1.mlp.experts.down_proj"]
    gate, up, d = torch.randn(32, 64), torch.randn(32, 64), torch.randn(64, 32)
    assert eng.load_weights([("model.layers.1.mlp.experts.2.gate_proj.weight", gate),
                             ("model.layers.1.mlp.experts.2.up_proj.weight", up),
                             ("model.layers.1.mlp.experts.2.down_proj.weight", d)]) == 3
    assert torch.equal(gu[2, :32], gate) and torch.equal(gu[2, 32:], up) and torch.equal(down[2], d)
    with pytest.raises(ValueError, match="experts.gate_up_proj \\(fused expert tensor: SGLang loads per-expert"):
        eng.load_weights([("model.layers.1.mlp.experts.gate_up_proj", gu.detach().clone())])
    with pytest.raises(ValueError, match="experts.4.down_proj.weight \\(unknown\\)"):
        eng.load_weights([("model.layers.1.mlp.experts.4.down_proj.weight", d)])
    with pytest.raises(ValueError, match="experts.0.up_proj.weight \\(shape \\(64, 32\\) != \\(32, 64\\)\\)"):
        eng.load_weights([("model.layers.1.mlp.experts.0.up_proj.weight", d)])
