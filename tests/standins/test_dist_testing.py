"""standins/dist_testing.run_distributed, the rank pool every multi-rank test uses."""

from __future__ import annotations

import socket

from megatron_m2po.standins import dist_testing


def _rank_sum(rank: int, world_size: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t.item())


def test_a_port_taken_before_the_store_binds_it_starts_the_ranks_again(monkeypatch):
    """The port picked for rank 0's store is taken by someone else before it binds (another test's
    server; seen as EADDRINUSE under five xdist workers): the ranks start again on another port
    instead of failing the test."""
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    ports = iter([squatter.getsockname()[1]])
    real = dist_testing.free_port
    monkeypatch.setattr(dist_testing, "free_port", lambda *a: next(ports, None) or real(*a))
    try:
        assert dist_testing.run_distributed(_rank_sum, world_size=2) == [3, 3]
    finally:
        squatter.close()
