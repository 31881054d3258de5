"""A disk weight push gives the engines a load timeout that follows the pushed bytes
(rollout/push_timeout.py), and every push is logged with its size, time and GB/s and counted in the
step's metrics (weights/push.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from aiohttp import web

from megatron_m2po.rollout.push_timeout import checkpoint_bytes, disk_push_timeout_s
from megatron_m2po.weights.errors import WeightSyncError
from megatron_m2po.weights.disk import DiskWeightSync
from megatron_m2po.weights.push import WeightPushController
from rollout_testlib import ThreadedApp


def test_the_timeout_adds_the_read_of_the_models_bytes_at_the_floor():
    """64 GB of a 32B bf16 model at 0.2 GB/s: 320 s of reading on top of the configured 300 s; a tiny
    model keeps the configured timeout; a floor <= 0 is refused by name."""
    assert disk_push_timeout_s(64e9, 300.0, 0.2) == pytest.approx(620.0)
    assert disk_push_timeout_s(1e6, 300.0, 0.2) == pytest.approx(300.005)
    with pytest.raises(ValueError, match="rollout.weight_sync_min_gbps=0"):
        disk_push_timeout_s(1e9, 300.0, 0.0)


class _SlowLoadEngine(ThreadedApp):
    """An engine's weight-update surface whose ``/update_weights_from_disk`` takes ``load_s``."""

    def __init__(self, load_s: float) -> None:
        async def ok(_request):
            return web.json_response({"success": True, "message": ""})

        async def load(_request):
            await asyncio.sleep(load_s)  # a slow disk: elapsed time is the behaviour under test
            return web.json_response({"success": True, "message": "Succeeded to update model weights."})

        app = web.Application()
        app.router.add_get("/health", ok)
        for route in ("/pause_generation", "/continue_generation"):
            app.router.add_post(route, ok)
        app.router.add_post("/update_weights_from_disk", load)
        self.serve(app)


class _Store:
    def set_version(self, version: int) -> None:
        self.version = version


WEIGHTS = [(f"model.layers.{i}.mlp.weight", torch.ones(256, 256)) for i in range(4)]  # 4 x 256 KiB fp32
NBYTES = 4 * 256 * 256 * 4


def _controller(sync) -> WeightPushController:
    """Rank 0's controller on ``sync``, with engines owned by no fleet (their URLs are the transport's)."""
    from megatron_m2po.rollout_service.engine_control import EngineControl

    return WeightPushController(sync, engines=EngineControl(store=_Store(), bg=None, transport=sync))
CONFIGURED_S, LOAD_S = 1.0, 2.0


def test_a_load_slower_than_the_configured_timeout_but_within_the_bytes_budget_succeeds(tmp_path, caplog):
    """The configured 1 s would fail a 2 s load; the bytes at a floor that reads them in 3 s give 4 s.
    The push is logged (GB, seconds, GB/s, the stages' write, the engines' load, the timeout) and the
    controller hands its numbers to the step's metrics once."""
    floor = NBYTES / 3.0 / 1e9  # GB/s: the pushed bytes take 3 s at the floor
    engine = _SlowLoadEngine(LOAD_S)
    sync = DiskWeightSync([engine.url], str(tmp_path / "sync"), timeout_s=CONFIGURED_S, min_gbps=floor)
    ctl = _controller(sync)
    try:
        from megatron_m2po.weights.stage import run_stage

        plan = ctl.begin(1, 1)
        with caplog.at_level(logging.INFO, logger="megatron_m2po.weights.push"):
            stats = ctl.finish(plan, [run_stage(plan, 0, iter(WEIGHTS))])
    finally:
        sync.close()
        engine.close()
    assert stats.bytes == NBYTES and checkpoint_bytes(tmp_path / "sync" / "v1") > NBYTES  # + safetensors headers
    assert stats.timeout_s == pytest.approx(disk_push_timeout_s(stats.bytes, CONFIGURED_S, floor)) == pytest.approx(4.0)
    assert stats.load_s >= LOAD_S and stats.write_s >= 0 and stats.seconds >= stats.load_s
    line = next(r.getMessage() for r in caplog.records if "weight push of version 1" in r.getMessage())
    assert f"{stats.bytes / 1e9:.3g} GB in {stats.seconds:.1f} s ({stats.gb_per_s:.3g} GB/s" in line, line
    assert f"loaded in {stats.load_s:.1f} s of a {stats.timeout_s:.0f} s timeout" in line, line
    m = ctl.take_metrics()
    assert m == pytest.approx({"sync/weight_gb": stats.bytes / 1e9, "sync/weight_gbps": stats.gb_per_s,
                               "sync/weight_load_s": stats.load_s})
    assert ctl.take_metrics() == {}  # taken once per step


def test_a_load_beyond_the_bytes_budget_fails_naming_the_timeout(tmp_path):
    """The same 2 s load against bytes a floor reads in 0.3 s (timeout 1.3 s): the push fails, and
    the error names the timeout, the bytes and the floor to raise."""
    floor = NBYTES / 0.3 / 1e9
    engine = _SlowLoadEngine(LOAD_S)
    sync = DiskWeightSync([engine.url], str(tmp_path / "sync"), timeout_s=CONFIGURED_S, min_gbps=floor)
    try:
        with pytest.raises(WeightSyncError) as e:
            sync.push(iter(WEIGHTS), 1)
    finally:
        sync.close()
        engine.close()
    assert "update_weights_from_disk failed" in str(e.value)
    assert f"(the load's timeout: 1 s for 0.00 GB at rollout.weight_sync_min_gbps={floor:g})" in str(e.value)


def test_one_push_line_then_only_slow_pushes(tmp_path, caplog):
    """The first push is logged at INFO (saying that later ones are logged when over twice as slow),
    later pushes at DEBUG unless over twice the first's time; take_metrics still sums all of them."""
    import types

    sync = DiskWeightSync(["http://127.0.0.1:9"], str(tmp_path / "sync"), timeout_s=CONFIGURED_S, min_gbps=1.0)
    ctl = _controller(sync)
    try:
        with caplog.at_level(logging.DEBUG, logger="megatron_m2po.weights.push"):
            for v, secs in ((1, 2.0), (2, 2.5), (3, 4.5)):
                ctl._record(types.SimpleNamespace(version=v, bytes=1e9, seconds=secs, gb_per_s=1 / secs, load_s=None))
    finally:
        sync.close()
    lines = {r.getMessage().split(":")[0]: (r.levelno, r.getMessage()) for r in caplog.records
             if "weight push of version" in r.getMessage()}
    assert lines["weight push of version 1"][0] == logging.INFO and "over twice as slow" in lines["weight push of version 1"][1]
    assert lines["weight push of version 2"][0] == logging.DEBUG
    assert lines["weight push of version 3"][0] == logging.INFO and "over twice the first push's time" in \
        lines["weight push of version 3"][1]
    assert ctl.take_metrics()["sync/weight_gb"] == pytest.approx(3.0)
