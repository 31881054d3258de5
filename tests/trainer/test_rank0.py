"""Rank 0's results reach every rank without a collective that times out while rank 0 works."""

from __future__ import annotations

import time

import pytest

from megatron_m2po.utils.dist_testing import run_distributed

PG_TIMEOUT_S = 2.0


def _slow_rank0(rank, world_size):
    from megatron_m2po.trainer import rank0

    def work():
        # Longer than the process group's collective timeout: a broadcast entered by the other
        # ranks right away would fail. Elapsed time is the behaviour under test.
        time.sleep(3 * PG_TIMEOUT_S)
        return {"groups": list(range(5))}

    got = rank0.from_rank0(work, what="slow work", poll_s=0.5, log_every_s=1.0)
    second = rank0.from_rank0(lambda: "again", what="a second call")
    return got, second


def _failing_rank0(rank, world_size):
    from megatron_m2po.trainer import rank0

    def work():
        raise ValueError("the store is full")

    try:
        rank0.from_rank0(work, what="the rollouts of step 3", poll_s=0.5)
    except Exception as e:  # noqa: BLE001 - the test inspects what each rank raised
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.multiproc
def test_other_ranks_wait_longer_than_the_collective_timeout():
    out = run_distributed(_slow_rank0, world_size=2, pg_timeout_s=PG_TIMEOUT_S, timeout_s=120)
    assert out[0] == out[1] == ({"groups": [0, 1, 2, 3, 4]}, "again")


@pytest.mark.multiproc
def test_rank0_failure_reaches_the_other_ranks():
    out = run_distributed(_failing_rank0, world_size=2, pg_timeout_s=60, timeout_s=120)
    assert out[0] == "ValueError: the store is full"
    assert out[1] == "RuntimeError: rank 0 failed while producing the rollouts of step 3: ValueError: the store is full"
