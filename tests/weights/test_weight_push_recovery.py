"""An engine killed in the middle of a distributed weight push, behind the real sglang-router: the
push fails naming it, the fleet relaunches it without admitting it, the repeated push rebuilds the
weight-update groups (the new process has none) and refits it, and only then does it rejoin the
router. The fleet ends with every engine at the new version, serving the pushed weights."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_m2po.config import RolloutConfig
from megatron_m2po.rollout.client import SGLangClient
from megatron_m2po.rollout.engines import EngineFleet
from megatron_m2po.weights.disk import DiskWeightSync
from megatron_m2po.weights.distributed import DistributedWeightSync
from megatron_m2po.weights.errors import WeightSyncError


def _call(url: str, method: str, *args):
    async def go():
        async with SGLangClient(url) as c:
            return await getattr(c, method)(*args)
    return asyncio.run(go())


def _weights(url: str, name: str, rows: int) -> torch.Tensor:
    out = _call(url, "request", "POST", "/get_weights_by_name", {"name": name, "truncate_size": rows})
    return torch.tensor(out, dtype=torch.float32)


def _perturbed(model_dir: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + 0.1 * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]


def _killing(named, victim, after: int):
    """Yield ``named``; after ``after`` tensors (several buckets already sent) kill ``victim``."""
    for i, item in enumerate(named):
        if i == after:
            victim.handle.proc.kill()
            victim.handle.proc.wait(30)
        yield item


@pytest.mark.slow  # a fleet and a push killed mid-way, end to end
@pytest.mark.parametrize("kind", ["distributed", "disk"])
def test_engine_killed_mid_push_is_replaced_refit_and_readmitted(tiny_model_dir, tmp_path, kind):
    cfg = RolloutConfig(engine="cpu_worker", launcher="local", num_engines=2, base_port=0, use_router=True,
                        weight_sync_timeout_s=30.0)
    fleet = EngineFleet(cfg, tiny_model_dir, run_dir=str(tmp_path / "run"), startup_timeout_s=120).start()
    sync = (DistributedWeightSync(fleet.engine_urls, backend="gloo", bucket_mb=0.05, timeout_s=20)
            if kind == "distributed" else
            DiskWeightSync(fleet.engine_urls, str(tmp_path / "weights"), base_model_dir=tiny_model_dir, timeout_s=20))
    try:
        first = _perturbed(tiny_model_dir, 1)
        sync.push(iter(first), 1, engine_urls=fleet.engine_urls)  # groups built, version 1 everywhere
        victim = fleet.engines[1]
        new = _perturbed(tiny_model_dir, 2)
        # disk: the engine dies after the version is written, before or while engines load it
        with pytest.raises(WeightSyncError) as err:
            sync.push(_killing(new, victim, after=len(new) // 2 if kind == "distributed" else len(new) - 1), 2,
                      engine_urls=fleet.engine_urls)
        assert victim.url in str(err.value)
        restarted = fleet.check_and_restart(refit=False)
        assert restarted == [victim.url] and fleet.pending_urls == [victim.url]
        workers = _call(fleet.url, "request", "GET", "/workers")["workers"]
        assert [w["url"] for w in workers] == [fleet.engines[0].url]  # not admitted before its refit
        sync.on_engines_restarted([victim.url])  # distributed: its groups are gone; disk: nothing to do
        stats = sync.push(iter(new), 2, engine_urls=fleet.engine_urls)  # no failure on the lost groups
        assert stats.engines == 2
        assert fleet.admit() == [victim.url]
        workers = _call(fleet.url, "request", "GET", "/workers")["workers"]
        assert sorted(w["url"] for w in workers) == sorted(fleet.engine_urls) and all(w["is_healthy"] for w in workers)
        for url in fleet.engine_urls:
            assert _call(url, "weight_version") == "2"
            for name, t in new:
                assert torch.equal(_weights(url, name, t.shape[0]), t), (url, name)
        if kind == "distributed":  # killed between pushes: the next push rebuilds its groups, no failure
            victim.handle.proc.kill()
            victim.handle.proc.wait(30)
            assert fleet.check_and_restart(refit=False) == [victim.url]
            sync.on_engines_restarted([victim.url])  # what WeightPushController.restart_dead_engines does
            sync.push(iter(first), 3, engine_urls=fleet.engine_urls)
            assert fleet.admit() == [victim.url]
            assert {_call(u, "weight_version") for u in fleet.engine_urls} == {"3"}
    finally:
        sync.close()
        fleet.stop()
