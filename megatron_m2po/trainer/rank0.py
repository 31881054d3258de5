"""Rank 0's results on every rank, without a collective that can time out while rank 0 works.

Global rank 0 owns the rollout side (generation, the store, reward): other ranks wait for what
it produces. Waiting inside a collective would be bounded by the process group's timeout (30
minutes by default under NCCL), and at high staleness or with slow external producers rank 0
can legitimately take longer than that. So non-zero ranks first wait on a key in the launcher's
key-value store (torchrun's TCPStore), polling in short rounds and logging how long they have
waited; only once rank 0 has its result do all ranks enter the broadcast, which then completes
at once. An exception on rank 0 is announced through the same key, so the other ranks fail
with rank 0's message instead of waiting until the launcher kills them.

    groups = from_rank0(lambda: driver.generate_step_groups(step), what=f"step {step}'s rollouts")
"""

from __future__ import annotations

import itertools
import logging
import time
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

log = logging.getLogger(__name__)
T = TypeVar("T")

_calls = itertools.count()  # every rank makes the same sequence of calls: the keys agree
_ERROR = b"error:"
POLL_S = 30.0
LOG_EVERY_S = 300.0


def _world() -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _wait_key(store: Any, key: str, what: str, poll_s: float, log_every_s: float) -> bytes:
    t0 = last_log = time.monotonic()
    while True:
        try:
            store.wait([key], timedelta(seconds=poll_s))
            return store.get(key)
        except RuntimeError as e:  # DistStoreError (a RuntimeError) on a round's timeout
            if "timeout" not in str(e).lower() and "wait" not in str(e).lower():
                raise
        now = time.monotonic()
        if now - last_log >= log_every_s:
            last_log = now
            log.info("still waiting for rank 0: %s (%.0f min so far)", what, (now - t0) / 60)


def from_rank0(fn: Callable[[], T], *, what: str = "rank 0's result", poll_s: float = POLL_S,
               log_every_s: float = LOG_EVERY_S) -> T:
    """``fn()`` evaluated on global rank 0 only; every rank returns its (picklable) result."""
    rank, world = _world()
    if world == 1:
        return fn()
    key = f"m2po/from_rank0/{next(_calls)}"
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        try:
            out = fn()
        except BaseException as e:
            store.set(key, _ERROR + f"{type(e).__name__}: {e}".encode(errors="replace")[:4000])
            raise
        store.set(key, b"ok")
    else:
        status = _wait_key(store, key, what, poll_s, log_every_s)
        if status.startswith(_ERROR):
            raise RuntimeError(f"rank 0 failed while producing {what}: {status[len(_ERROR):].decode()}")
        out = None
    box = [out]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool, group: Optional[Any] = None) -> bool:
    """True on every rank when ``flag`` is true on at least one (a quick all-reduce)."""
    import torch

    if _world()[1] == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
