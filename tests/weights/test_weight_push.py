"""Weight pushes from every pipeline stage (gloo, CPU workers): what the engines hold afterwards is
bit-equal to the full-model HF export of the actor (mbridge's convert path), for PP=2 and TP=2 x PP=2,
distributed and disk.

Every stage's sender (its tensor-parallel rank 0) sends or writes its own layers; nothing gathers
the model on one rank. The engines are read back through SGLang 0.5.23's ``/get_weights_by_name``
(whole tensors: ``truncate_size`` = rows), the disk version is also loaded by HF transformers.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "actor"))  # actor_testlib
import actor_testlib as lib  # noqa: E402
from megatron_m2po.config import RolloutConfig
from megatron_m2po.rollout.client import SGLangClient
from megatron_m2po.rollout.engines import EngineFleet
from megatron_m2po.standins.dist_testing import run_distributed

pytestmark = pytest.mark.slow  # engine processes, routers or multi-rank sweeps in module fixtures: the full suite's lane


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_push")
    hf = lib.make_tiny_hf("llama", str(root / "llama_tied"), tie=True, seed=3)
    cfg = RolloutConfig(engine="cpu_worker", launcher="local", num_engines=2, base_port=0, use_router=False,
                        weight_sync_timeout_s=60.0)
    f = EngineFleet(cfg, hf, run_dir=str(root / "run"), startup_timeout_s=120).start()
    try:
        yield f, hf, root
    finally:
        f.stop()


async def _engine_tensor(url: str, name: str, rows: int) -> torch.Tensor:
    async with SGLangClient(url) as c:
        out = await c.request("POST", "/get_weights_by_name", {"name": name, "truncate_size": rows})
    return torch.tensor(out, dtype=torch.float32)


def _perturb(actor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 1000 * torch.distributed.get_rank())
    with torch.no_grad():
        for chunk in actor.chunks:
            for p in chunk.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))


def _push_job(rank, world, hf, urls, sync_dir, tp, pp):
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.weights.stage import push_from_stages
    from megatron_m2po.weights.disk import DiskWeightSync
    from megatron_m2po.weights.distributed import DistributedWeightSync
    from megatron_m2po.weights.hf_export import export_hf, stage_hf_weights, stage_layout

    actor = MegatronActor.from_config(ActorConfig.from_config(lib.actor_config(hf, tp=tp, pp=pp), total_updates=10))
    layout = stage_layout()
    out = {"layout": (layout.stage, layout.n_stages, layout.exports, layout.sender), "checks": []}
    dist_sync = DistributedWeightSync(urls, backend="gloo", bucket_mb=0.02, timeout_s=60) if rank == 0 else None
    disk_sync = (DiskWeightSync(urls, sync_dir, base_model_dir=hf, shard_mb=0.05, timeout_s=60)
                 if rank == 0 else None)
    try:
        for version, sync in ((1, dist_sync), (2, disk_sync), (3, dist_sync)):
            _perturb(actor, version)
            # the reference: the full model through mbridge's export (every rank iterates)
            ref = {n: t.to("cpu", copy=True) for n, t in actor.iter_hf_weights()}
            stats = push_from_stages(sync, stage_hf_weights(actor), version, stage=layout.stage,
                                     n_stages=layout.n_stages, sender=layout.sender)
            if rank != 0:
                continue
            for url in urls:
                for name, t in ref.items():
                    got = asyncio.run(_engine_tensor(url, name, t.shape[0]))
                    out["checks"].append((version, url, name, bool(torch.equal(got, t.float()))))
                out["checks"].append((version, url, "weight_version",
                                      asyncio.run(_version(url)) == str(version)))
            out[f"stats{version}"] = (stats.stages, stats.n_tensors, stats.bytes)
            if version == 2:
                out["disk_dir"] = disk_sync.latest_dir
                out["ref2"] = {n: t.numpy() for n, t in ref.items()}  # tensors do not cross the queue
        # the final HF export: every stage writes its own shards as well
        export_dir = os.path.join(os.path.dirname(sync_dir), f"export_tp{tp}_pp{pp}")
        export_hf(actor, export_dir)
        if rank == 0:
            got = lib.read_safetensors_dir(export_dir)
            out["export"] = (sorted(got) == sorted(ref), all(torch.equal(got[n], ref[n]) for n in ref),
                             os.path.isfile(os.path.join(export_dir, "model.safetensors.index.json")))
    finally:
        for s in (dist_sync, disk_sync):
            if s is not None:
                s.close()
        actor.close()
    return out


async def _version(url: str) -> str:
    async with SGLangClient(url) as c:
        return await c.weight_version()


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)])
def test_every_stage_sends_its_layers_bit_exact(fleet, tmp_path, tp, pp):
    f, hf, _ = fleet
    res = run_distributed(_push_job, tp * pp, args=(hf, f.engine_urls, str(tmp_path / "weights"), tp, pp),
                          timeout_s=240)
    layouts = sorted(r["layout"] for r in res)
    senders = [lay for lay in layouts if lay[3]]
    assert [s[0] for s in senders] == list(range(pp)) and all(s[1] == pp for s in senders)  # one per stage
    r0 = res[0]
    assert r0["export"] == (True, True, True)
    bad = [c for c in r0["checks"] if not c[3]]
    assert not bad, bad[:5]
    n_ref = len(r0["ref2"])
    assert len(r0["checks"]) == 3 * 2 * (n_ref + 1)
    for v in (1, 2, 3):
        stages, n, nbytes = r0[f"stats{v}"]
        assert stages == pp and n == n_ref and nbytes == sum(t.size * 4 for t in r0["ref2"].values())
    # disk: sharded safetensors (several per stage at 0.05 MB) + one index, loadable by HF transformers
    d = r0["disk_dir"]
    files = sorted(x for x in os.listdir(d) if x.endswith(".safetensors"))
    assert len(files) > pp and files == [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                                         for i in range(len(files))]
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    assert set(index["weight_map"]) == set(r0["ref2"]) and set(index["weight_map"].values()) == set(files)
    import transformers as tr
    model = tr.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    sd = model.state_dict()
    for name, t in r0["ref2"].items():
        assert torch.equal(sd[name], torch.from_numpy(t)), name
