"""Process groups outside the default one: the trainer-to-engine weight-sync group.

SGLang's ``init_custom_process_group`` joins the trainer's rank 0 and every engine rank in a
group of its own, rendezvousing on a TCP store that rank 0 hosts. Both sides of that
rehearsal live here: the trainer's weight sync (rank 0) and the CPU worker (the engine
ranks). The group is a bare ``ProcessGroup`` object, not registered with
``torch.distributed``: collectives are called on it directly (:func:`broadcast`) and fail
after ``timeout_s`` instead of hanging.
"""

from __future__ import annotations

import datetime

import torch

__all__ = ["new_side_group", "broadcast"]


def new_side_group(backend: str, host: str, port: int, *, rank: int, world_size: int, group_name: str,
                   timeout_s: float):
    """Join (rank 0: host) a ``backend`` ("gloo" or "nccl") group of ``world_size`` at ``host:port``."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False)
    prefix = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
    raise ValueError(f"backend={backend!r}: use 'nccl' or 'gloo'")


def broadcast(pg, tensor: torch.Tensor, timeout_s: float, root: int = 0):
    """``pg.broadcast`` from ``root`` on a bare ProcessGroup; returns the work handle to ``wait()`` on."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank, opts.timeout = root, datetime.timedelta(seconds=timeout_s)
    return pg.broadcast([tensor], opts)
