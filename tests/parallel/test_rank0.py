"""Rank 0's results reach every rank without a collective that times out while rank 0 works."""

from __future__ import annotations

import time

import pytest

from megatron_m2po.standins.dist_testing import run_distributed

PG_TIMEOUT_S = 2.0


def _slow_rank0(rank, world_size):
    from megatron_m2po.parallel import rank0

    def work():
        # Longer than the process group's collective timeout: a broadcast entered by the other
        # ranks right away would fail.
        time.sleep(3 * PG_TIMEOUT_S)  # rank 0 outlasting the collective timeout: elapsed time is the behaviour under test
        return {"groups": list(range(5))}

    got = rank0.from_rank0(work, what="slow work", poll_s=0.5, log_every_s=1.0)
    second = rank0.from_rank0(lambda: "again", what="a second call")
    return got, second


def _failing_rank0(rank, world_size):
    from megatron_m2po.parallel import rank0

    def work():
        raise ValueError("the store is full")

    import torch.distributed as dist

    try:
        rank0.from_rank0(work, what="the rollouts of step 3", poll_s=0.5)
        got = "no error"
    except Exception as e:  # noqa: BLE001 - the test inspects what each rank raised
        got = f"{type(e).__name__}: {e}"
    # Under torchrun the key-value store is the launcher agent's and outlives rank 0; here rank 0's
    # process hosts it (run_distributed), so rank 0 must not exit before rank 1 has read the key
    # (under load rank 1 otherwise sees the store go away: DistNetworkError instead of rank 0's message).
    dist.barrier()
    return got


@pytest.mark.multiproc
def test_other_ranks_wait_longer_than_the_collective_timeout():
    out = run_distributed(_slow_rank0, world_size=2, pg_timeout_s=PG_TIMEOUT_S, timeout_s=120)
    assert out[0] == out[1] == ({"groups": [0, 1, 2, 3, 4]}, "again")


@pytest.mark.multiproc
def test_rank0_failure_reaches_the_other_ranks():
    out = run_distributed(_failing_rank0, world_size=2, pg_timeout_s=60, timeout_s=120)
    assert out[0] == "ValueError: the store is full"
    assert out[1] == "RuntimeError: rank 0 failed while producing the rollouts of step 3: ValueError: the store is full"


def _scatter(rank, world_size):
    from megatron_m2po.parallel import rank0

    def work():
        time.sleep(3 * PG_TIMEOUT_S)  # outlasting the collective timeout: elapsed time is the behaviour under test
        return [{"rank": r, "shard": list(range(r * 3, r * 3 + 3))} for r in range(world_size)]

    got = rank0.scatter_from_rank0(work, what="the shards", poll_s=0.5, log_every_s=1.0)
    try:
        rank0.scatter_from_rank0(lambda: ["only one"], what="a short list", poll_s=0.5)
        bad = "no error"
    except Exception as e:  # noqa: BLE001 - the test inspects what each rank raised
        bad = f"{type(e).__name__}: {e}"
    return got, bad


@pytest.mark.multiproc
def test_scatter_sends_each_rank_its_part_only():
    out = run_distributed(_scatter, world_size=2, pg_timeout_s=PG_TIMEOUT_S, timeout_s=120)
    assert [o[0] for o in out] == [{"rank": 0, "shard": [0, 1, 2]}, {"rank": 1, "shard": [3, 4, 5]}]
    assert "one object per rank (2)" in out[0][1] and "rank 0 failed" in out[1][1], out


def _run_dir_per_node(rank, world_size, root, run_dir):
    """Each simulated node starts in its own working directory (nothing shared but ``root``)."""
    import os

    from megatron_m2po.parallel import rank0

    node = os.path.join(root, f"node{rank}")
    os.makedirs(node, exist_ok=True)
    os.chdir(node)
    try:
        return str(rank0.check_shared_run_dir(run_dir))
    except ValueError as e:
        return f"ValueError: {e}"


@pytest.mark.multiproc
def test_run_dir_must_be_one_directory_for_every_rank(tmp_path):
    # A relative run directory resolves against each node's working directory: refused, naming both.
    out = run_distributed(_run_dir_per_node, world_size=2, args=(str(tmp_path), "runs/x"), timeout_s=120)
    for msg in out:
        assert msg.startswith("ValueError: trainer.run_dir='runs/x' is not one directory for every rank")
        assert f"rank 0 uses {tmp_path}/node0/runs/x" in msg and "rank 1 on host" in msg
        assert f"resolves it to {tmp_path}/node1/runs/x" in msg and "shared by all training nodes" in msg
    # An absolute path on a filesystem both "nodes" see is accepted, and is the same for both.
    shared = tmp_path / "shared" / "run"
    out = run_distributed(_run_dir_per_node, world_size=2, args=(str(tmp_path), str(shared)), timeout_s=120)
    assert out == [str(shared), str(shared)]
