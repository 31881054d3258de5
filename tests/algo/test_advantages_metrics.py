"""GRPO advantages and metric reduction (local and over gloo ranks)."""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_m2po.algo.advantages import grpo_advantages
from megatron_m2po.algo.metrics import Metric, merge_metrics, reduce_metrics
from megatron_m2po.standins.dist_testing import run_distributed


def test_grpo_advantages_hand_example():
    # group "a": rewards [1, 0, 0, 1] mean 0.5, sample std sqrt(1/3) -> +-0.5 / (0.57735 + 1e-6)
    # group "b": [0.1, 0.1] zero variance -> 0; group "c": single sample -> 0
    # group "d": [1, 0, 0.1] mean 1.1/3, std = sqrt(((0.6333)^2 + (0.3667)^2 + (0.2667)^2) / 2)
    rewards = [1.0, 0.1, 0.0, 0.0, 1.0, 0.1, 0.7, 1.0, 0.0, 0.1]
    gid = ["a", "b", "a", "a", "a", "b", "c", "d", "d", "d"]
    adv = grpo_advantages(rewards, gid)
    sa = math.sqrt(1 / 3)
    md = 1.1 / 3
    sd = math.sqrt(((1 - md) ** 2 + md**2 + (0.1 - md) ** 2) / 2)
    expect = [0.5 / (sa + 1e-6), 0.0, -0.5 / (sa + 1e-6), -0.5 / (sa + 1e-6), 0.5 / (sa + 1e-6), 0.0, 0.0,
              (1 - md) / (sd + 1e-6), -md / (sd + 1e-6), (0.1 - md) / (sd + 1e-6)]
    assert adv.dtype == np.float32
    assert adv.tolist() == pytest.approx(expect, rel=1e-6)
    assert adv[1] == 0.0 and adv[5] == 0.0 and adv[6] == 0.0  # exactly zero
    # Dr. GRPO: mean only
    adv = grpo_advantages(rewards, gid, normalize_std=False)
    assert adv.tolist() == pytest.approx([0.5, 0, -0.5, -0.5, 0.5, 0, 0, 1 - md, -md, 0.1 - md], rel=1e-6)


def test_grpo_advantages_tensor_and_errors():
    r = torch.tensor([0.3, 0.3, 0.3, 2.0, 4.0], dtype=torch.float64)
    adv = grpo_advantages(r, torch.tensor([5, 5, 5, 9, 9]))
    assert adv.dtype == torch.float64
    assert adv.tolist() == pytest.approx([0, 0, 0, -1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6)])
    with pytest.raises(ValueError, match="1 non-finite rewards at indices \\[1\\]"):
        grpo_advantages([0.0, float("nan")], [0, 0])
    with pytest.raises(ValueError, match="equal length"):
        grpo_advantages([0.0, 1.0], [0])
    assert grpo_advantages([], []).shape == (0,)


def test_merge_and_reduce_locally():
    a = {"x": Metric(1.0, "mean", weight=1), "s": Metric(2.0, "sum"), "hi": Metric(3.0, "max"),
         "lo": Metric(torch.tensor(-1.0), "min")}
    b = {"x": Metric(torch.tensor(4.0), "mean", weight=3), "s": Metric(5.0, "sum"), "hi": Metric(1.0, "max"),
         "lo": Metric(0.5, "min")}
    out = reduce_metrics([a, b])
    assert out == {"x": pytest.approx((1 + 12) / 4), "s": 7.0, "hi": 3.0, "lo": -1.0}
    assert merge_metrics([a, b])["x"].weight == 4
    assert reduce_metrics({"e": Metric(5.0, "mean", weight=0)}) == {"e": 0.0}
    with pytest.raises(ValueError, match="reduce='avg'"):
        Metric(1.0, "avg")
    with pytest.raises(ValueError, match="declared as 'mean' and 'sum'"):
        merge_metrics([{"x": Metric(1.0)}, {"x": Metric(1.0, "sum")}])


def _reduce_worker(rank, world):
    calls = []
    orig = dist.all_reduce

    def counted(t, *a, **kw):
        calls.append(t.numel())
        return orig(t, *a, **kw)

    dist.all_reduce = counted
    try:
        metrics = {f"m{i}": Metric(float(rank + i), "mean", weight=rank + 1) for i in range(20)}
        metrics.update({f"s{i}": Metric(float(rank * i), "sum") for i in range(5)})
        metrics["max"] = Metric(float(10 - rank), "max")
        metrics["min"] = Metric(float(10 - rank), "min")
        out = reduce_metrics(metrics, group=dist.group.WORLD)
        bad = None
        try:
            reduce_metrics({"only_rank_%d" % rank: Metric(1.0)}, group=dist.group.WORLD)
        except ValueError as e:
            bad = str(e)
        return out, calls, bad
    finally:
        dist.all_reduce = orig


@pytest.mark.multiproc
def test_reduce_metrics_over_ranks_batches_collectives():
    world = 3
    res = run_distributed(_reduce_worker, world, timeout_s=120)
    weights = [1, 2, 3]
    for out, calls, bad in res:
        for i in range(20):
            assert out[f"m{i}"] == pytest.approx(sum((r + i) * w for r, w in zip(range(3), weights)) / 6)
        assert out["s3"] == 0 + 3 + 6 and out["max"] == 10 and out["min"] == 8
        assert calls[:3] == [2, 2 * 25, 2]  # name check, one SUM for 25 metrics, one MAX for max + min
        assert "ranks report different metric names" in bad
