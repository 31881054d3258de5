"""Colocated pushes into CPU workers (``/update_weights_from_tensor``, shared memory standing in for
CUDA IPC): the worker's weights equal the trainer's exactly afterwards, at the pushed version;
a failed load names the engine and the bucket. With every rank taking part (gloo ranks), each
engine gets its buckets from the rank assigned to serve it, whichever stage sent them."""

from __future__ import annotations

import asyncio
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
from megatron_m2po.utils.hf_dir import iter_safetensors
from megatron_m2po.weights.colocated import ColocatedWeightSync, Phases, run_colocated_stage
from megatron_m2po.weights.stage import push_from_stages
from megatron_m2po.weights.errors import WeightSyncError

pytestmark = pytest.mark.skipif(not hasattr(SGLangClient, "update_weights_from_tensor"),
                                reason="SGLangClient.update_weights_from_tensor not there yet")
pytestmark = [pytestmark, pytest.mark.slow]  # engine processes, routers or multi-rank sweeps in module fixtures: the full suite's lane


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("colocated_push")
    hf = lib.make_tiny_hf("qwen2", str(root / "qwen2"), seed=5)
    cfg = RolloutConfig(engine="cpu_worker", launcher="local", num_engines=2, base_port=0, use_router=False,
                        weight_sync_timeout_s=60.0)
    f = EngineFleet(cfg, hf, run_dir=str(root / "run"), startup_timeout_s=120).start()
    try:
        yield f, hf
    finally:
        f.stop()


def _trainer_weights(hf: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, t + 0.01 * torch.randn(t.shape, generator=g).to(t.dtype)) for n, t in iter_safetensors(hf)]


async def _engine(url: str, names: list[tuple[str, torch.Tensor]]) -> tuple[str, dict[str, torch.Tensor]]:
    async with SGLangClient(url) as c:
        got = {n: torch.tensor(await c.request("POST", "/get_weights_by_name",
                                               {"name": n, "truncate_size": t.shape[0]}), dtype=t.dtype)
               for n, t in names}
        return await c.weight_version(), got


def test_push_lands_bit_exact_in_every_engine_in_buckets(fleet):
    f, hf = fleet
    weights = _trainer_weights(hf, seed=1)
    sync = ColocatedWeightSync(f.engine_urls, bucket_mb=0.05, timeout_s=60)  # ~50 kB: many buckets
    try:
        plan = sync.begin(3, 1)
        phases = Phases()
        res = run_colocated_stage(plan, 0, iter(weights), phases)
        stats = sync.finish(plan, [res])
    finally:
        sync.close()
    assert not res.error and stats.n_tensors == len(weights) and stats.engines == 2
    assert phases.buckets > 3
    for url in f.engine_urls:
        version, got = asyncio.run(_engine(url, weights))
        assert version == "3"
        for n, t in weights:
            assert torch.equal(got[n].reshape(t.shape), t), n


def test_push_under_the_launch_scripts_allocator_settings_lands(fleet):
    """``scripts/train.sh`` exports ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``; memory from
    expandable segments reaches another process through ``pidfd_getfd`` (ptrace rights over the
    trainer, which engines do not have), so a bucket allocated there cannot be opened (the CPU
    stand-in refuses it the same way, ``colocated_bucket.rebuild_expandable_segment``). Buckets are
    allocated with expandable segments off, and the trainer's setting is back afterwards."""
    from megatron_m2po.weights.colocated_bucket import HOST_BUCKETS, expandable_segments

    f, hf = fleet
    weights = _trainer_weights(hf, seed=2)
    before = torch._C._accelerator_getAllocatorSettings()
    HOST_BUCKETS.clear()  # buckets of earlier pushes would be reused: allocate under the setting
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    try:
        sync = ColocatedWeightSync(f.engine_urls, bucket_mb=0.5, timeout_s=60)
        try:
            plan = sync.begin(4, 1)
            res = run_colocated_stage(plan, 0, iter(weights), Phases())
            stats = sync.finish(plan, [res])
        finally:
            sync.close()
        assert expandable_segments()  # the trainer's own allocations keep the launch script's setting
    finally:
        torch._C._accelerator_setAllocatorSettings(before or "expandable_segments:False")
        HOST_BUCKETS.clear()
    assert not res.error and stats.engines == 2, res.error
    for url in f.engine_urls:
        version, got = asyncio.run(_engine(url, weights[:3]))
        assert version == "4"
        for n, t in weights[:3]:
            assert torch.equal(got[n].reshape(t.shape), t), n


def test_failed_load_names_engine_and_bucket(tiny_model_dir, tmp_path):
    """Its own engine: SGLang's scheduler dies on a failed load, and so does the worker's health."""
    cfg = RolloutConfig(engine="cpu_worker", launcher="local", num_engines=1, base_port=0, use_router=False,
                        weight_sync_timeout_s=30.0)
    f = EngineFleet(cfg, tiny_model_dir, run_dir=str(tmp_path / "run"), startup_timeout_s=120).start()
    try:
        _fail_one_load(f, tiny_model_dir)
    finally:
        f.stop()


def _fail_one_load(f, hf: str) -> None:
    weights = _trainer_weights(hf, seed=2)
    bad = [(n, torch.zeros(t.numel() + 1) if n == "model.norm.weight" else t) for n, t in weights]
    sync = ColocatedWeightSync(f.engine_urls, bucket_mb=0.05, timeout_s=60)
    try:
        with pytest.raises(WeightSyncError) as e:
            sync.push(iter(bad), 4)
        msg = str(e.value)
        assert "bucket" in msg and "model.norm.weight" in msg, msg
        assert all(u in msg for u in f.engine_urls), msg
    finally:
        sync.close()


async def _greedy(url: str) -> list[list[float]]:
    """Greedy log-probs of two prompts, one request at a time: two requests in flight together may
    or may not share a batch, and a batch's padding moves the last bits of a log-prob."""
    out = []
    async with SGLangClient(url, concurrency=1, timeout_s=60) as c:
        for prompt in ([2, 3, 4, 5], [9, 10, 11]):
            got = await c.generate_many([prompt], {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True})
            out.append(got[0].output_logprobs)
    return out


def test_fp8_push_lands_what_the_distributed_fp8_push_lands(tiny_model_dir, tmp_path):
    """``fp8=True`` quantises to block FP8 on the way out as the distributed transport does: the
    block-FP8 engine then serves exactly what the distributed push of the same weights gives it
    (tiny buckets split weights from their scales)."""
    from megatron_m2po.weights.distributed import DistributedWeightSync
    from megatron_m2po.weights.fp8 import export_fp8_dir

    block = (16, 16)  # the tiny model's k/v projections have 16 outputs
    fp8_dir = export_fp8_dir(tiny_model_dir, tmp_path / "base_fp8", block=block)
    cfg = RolloutConfig(engine="cpu_worker", launcher="local", num_engines=1, base_port=0, use_router=False,
                        weight_sync_timeout_s=30.0)
    f = EngineFleet(cfg, fp8_dir, run_dir=str(tmp_path / "run"), startup_timeout_s=120).start()
    colo = ColocatedWeightSync(f.engine_urls, bucket_mb=0.002, timeout_s=30, fp8=True, fp8_block=block)
    dist = DistributedWeightSync(f.engine_urls, backend="gloo", bucket_mb=0.002, timeout_s=30, fp8=True,
                                 fp8_block=block)
    try:
        weights = _trainer_weights(tiny_model_dir, seed=7)
        colo.push(iter(weights), 1)
        served = asyncio.run(_greedy(f.engine_urls[0]))
        dist.push(iter(_trainer_weights(tiny_model_dir, seed=8)), 2)  # something else in between
        assert asyncio.run(_greedy(f.engine_urls[0])) != served
        dist.push(iter(weights), 3)
        assert asyncio.run(_greedy(f.engine_urls[0])) == served
    finally:
        dist.close()
        colo.close()
        f.stop()


def _ranks_job(rank, world, hf, urls, layout, servers, version):
    """``layout``: (stage, sender) of each rank; stage ``p`` holds every ``n_stages``-th tensor."""
    stage, sender = layout[rank]
    n_stages = len({s for s, _ in layout})
    mine = [w for i, w in enumerate(_trainer_weights(hf, seed=version)) if i % n_stages == stage]
    sync = ColocatedWeightSync(urls, bucket_mb=0.03, timeout_s=60, servers=servers) if rank == 0 else None
    try:
        stats = push_from_stages(sync, iter(mine), version, stage=stage, n_stages=n_stages, sender=sender)
    finally:
        if sync is not None:
            sync.close()
    return None if stats is None else (stats.n_tensors, stats.stages)


@pytest.mark.parametrize("layout", [((0, True), (1, True)), ((0, True), (0, False))], ids=["pp2", "tp2"])
def test_every_rank_serves_the_engine_on_its_gpu_bit_exact(fleet, layout):
    """Two stages (each its own sender), or one stage of two ranks (the second cuts the same buckets in
    step): engine 0 is served by rank 1's memory, engine 1 by rank 0's."""
    f, hf = fleet
    version = 10 + len({s for s, _ in layout})
    servers = {f.engine_urls[0]: [1], f.engine_urls[1]: [0]}
    out = run_distributed(_ranks_job, 2, args=(hf, f.engine_urls, layout, servers, version), timeout_s=60)
    weights = _trainer_weights(hf, seed=version)
    assert out[0] == (len(weights), len({s for s, _ in layout}))
    for url in f.engine_urls:
        got_version, got = asyncio.run(_engine(url, weights))
        assert got_version == str(version)
        for n, t in weights:
            assert torch.equal(got[n].reshape(t.shape), t), (url, n)
