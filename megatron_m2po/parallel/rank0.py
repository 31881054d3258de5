"""Rank 0's results on every rank, without a collective that can time out while rank 0 works.

Global rank 0 owns the rollout side (generation, the store, reward): other ranks wait for what
it produces. Waiting inside a collective would be bounded by the process group's timeout (30
minutes by default under NCCL), and at high staleness or with slow external producers rank 0
can legitimately take longer than that. So non-zero ranks first wait on a key in the launcher's
key-value store (torchrun's TCPStore), polling in short rounds and logging how long they have
waited; only once rank 0 has its result do all ranks enter the broadcast, which then completes
at once. An exception on rank 0 is announced through the same key, so the other ranks fail
with rank 0's message instead of waiting until the launcher kills them (a
:class:`~megatron_m2po.utils.errors.UserError` as a UserError, which ``m2po`` prints in one line).

    groups = from_rank0(lambda: driver.generate_step_groups(step), what=f"step {step}'s rollouts")
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import pickle
import socket
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from megatron_m2po.utils.errors import UserError

log = logging.getLogger(__name__)
T = TypeVar("T")

_calls = itertools.count()  # every rank makes the same sequence of calls: the keys agree
_ERROR = b"error:"
_USER_ERROR = b"user-error:"  # a UserError: the other ranks raise one too, with rank 0's message
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


def _wait_for_rank0(fn: Callable[[], T], what: str, poll_s: float, log_every_s: float) -> Optional[T]:
    """``fn()`` on rank 0 (announced on the launcher's store); other ranks wait for the
    announcement and get None. Every rank then enters the same collective."""
    rank, _ = _world()
    key = f"m2po/from_rank0/{next(_calls)}"
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        try:
            out = fn()
        except BaseException as e:
            if isinstance(e, UserError):  # every rank says it in one line (megatron_m2po/cli.py)
                store.set(key, _USER_ERROR + str(e).encode(errors="replace")[:4000])
            else:
                store.set(key, _ERROR + f"{type(e).__name__}: {e}".encode(errors="replace")[:4000])
            raise
        store.set(key, b"ok")
        return out
    status = _wait_key(store, key, what, poll_s, log_every_s)
    if status.startswith(_USER_ERROR):
        raise UserError(f"rank 0: {status[len(_USER_ERROR):].decode()}")
    if status.startswith(_ERROR):
        raise RuntimeError(f"rank 0 failed while producing {what}: {status[len(_ERROR):].decode()}")
    return None


def from_rank0(fn: Callable[[], T], *, what: str = "rank 0's result", poll_s: float = POLL_S,
               log_every_s: float = LOG_EVERY_S) -> T:
    """``fn()`` evaluated on global rank 0 only; every rank returns its (picklable) result."""
    if _world()[1] == 1:
        return fn()
    box = [_wait_for_rank0(fn, what, poll_s, log_every_s)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def scatter_from_rank0(fn: Callable[[], list[T]], *, what: str = "rank 0's result", poll_s: float = POLL_S,
                       log_every_s: float = LOG_EVERY_S) -> T:
    """``fn()`` evaluated on global rank 0 only, returning one (picklable) object per global rank;
    rank ``r`` returns element ``r`` and receives nothing else (a scatter, not a broadcast).

    Staging: each rank holds at most one part on its accelerator. Rank 0 pickles and sends the
    parts one at a time (a part that is one object for several ranks, e.g. the shard of a
    data-parallel replica, once, to all of them in one batch) and keeps its own; rank ``r``
    receives into a buffer of its part's size (:func:`_send_parts`, :func:`_recv_part`). Not
    ``dist.scatter_object_list``: on NCCL it stages on rank 0's GPU one pickled tensor per rank,
    each ``resize_``-d to the largest (torch ``distributed_c10d.py`` ``scatter_object_list`` /
    ``_object_to_tensor``), ``world x largest`` bytes, which for a step of routed experts is
    100-200 GB (docs/moe.md, "What travels")."""
    rank, world = _world()
    if world == 1:
        return fn()[0]

    def checked() -> list[T]:
        parts = fn()
        if not isinstance(parts, list) or len(parts) != world:
            raise AssertionError(f"scatter_from_rank0 needs a list of one object per rank ({world}), "
                                 f"got {type(parts).__name__}")
        return parts

    parts = _wait_for_rank0(checked, what, poll_s, log_every_s)
    if rank == 0:
        _send_parts(parts)
        return parts[0]
    return _recv_part()


def _p2p(ops: list) -> None:
    """``ops`` as one batch, waited for. Batched, so NCCL runs them on the default group's
    communicator instead of creating a two-rank one per peer (torch ``distributed_c10d.py``
    ``batch_isend_irecv``, and ``send_object_list``'s ``use_batch``: "avoids initializing 2-rank
    communicators"). Its docstring asks that a batch which is a group's first collective involve
    every rank: the trainer's start-up broadcasts (:func:`from_rank0`) come first."""
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _send_parts(parts: list) -> None:
    """Rank 0: ``parts[r]`` to rank ``r >= 1``: its pickled size (int64), then its bytes (uint8), on
    the default group's device. One distinct object at a time, freed before the next."""
    import torch

    from megatron_m2po.parallel.devices import collective_device

    device = collective_device()
    peers: dict[int, list[int]] = {}
    for r in range(1, len(parts)):
        peers.setdefault(id(parts[r]), []).append(r)
    largest = 0
    for ranks in peers.values():
        f = io.BytesIO()
        pickle.dump(parts[ranks[0]], f, protocol=pickle.HIGHEST_PROTOCOL)
        payload = torch.frombuffer(f.getbuffer(), dtype=torch.uint8).to(device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
        _p2p([dist.P2POp(dist.isend, size, r) for r in ranks])
        _p2p([dist.P2POp(dist.isend, payload, r) for r in ranks])
        if device.type == "cuda":  # NCCL's wait only orders streams: finish the sends before staging the next part
            torch.cuda.current_stream(device).synchronize()
        largest = max(largest, payload.numel())
        del payload, size, f
    log.debug("sent %d distinct parts to %d ranks, the largest %.1f MB", len(peers), len(parts) - 1, largest / 1e6)


def _recv_part() -> Any:
    """Rank ``r >= 1``: the part :func:`_send_parts` sends it."""
    import torch

    from megatron_m2po.parallel.devices import collective_device

    device = collective_device()
    size = torch.zeros(1, dtype=torch.int64, device=device)
    _p2p([dist.P2POp(dist.irecv, size, 0)])
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _p2p([dist.P2POp(dist.irecv, buf, 0)])
    return pickle.loads(memoryview(buf.cpu().numpy()))


def any_rank(flag: bool, group: Optional[Any] = None) -> bool:
    """True on every rank when ``flag`` is true on at least one (a quick all-reduce on ``group``'s
    device: under NCCL a CPU tensor is refused)."""
    import torch

    from megatron_m2po.parallel.devices import collective_device

    if _world()[1] == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


MARKER = ".m2po_run_dir"


def check_shared_run_dir(run_dir: str | os.PathLike) -> Path:
    """The run directory (absolute), checked to be one directory for every rank.

    Every rank reads checkpoints and their ``latest`` pointer from the run directory, and rank 0
    alone writes the rest; so on several nodes it must be one directory on a shared filesystem
    (a relative path resolves against each node's working directory). Rank 0 creates it and
    leaves a marker with a fresh nonce; every rank looks for that nonce where *it* resolves the
    path, and a rank that does not find it fails start-up with both paths and hosts named."""
    rank, world = _world()
    path = Path(os.path.expanduser(str(run_dir))).resolve()
    if world == 1:
        path.mkdir(parents=True, exist_ok=True)
        return path

    def mark() -> tuple[str, str]:
        nonce = uuid.uuid4().hex
        path.mkdir(parents=True, exist_ok=True)
        (path / MARKER).write_text(nonce + "\n")
        return str(path), socket.gethostname()

    rank0_path, rank0_host = from_rank0(mark, what="the run directory")
    nonce = (Path(rank0_path) / MARKER).read_text().strip() if rank == 0 else None
    box = [nonce]
    dist.broadcast_object_list(box, src=0)
    try:
        mine = (path / MARKER).read_text().strip()
    except OSError:
        mine = None
    seen = [None] * world
    dist.all_gather_object(seen, (rank, socket.gethostname(), str(path), mine == box[0]))
    bad = [s for s in seen if not s[3]]
    if bad:
        lines = [f"rank {r} on host {h} resolves it to {p}" for r, h, p, _ in bad[:8]]
        raise ValueError(f"trainer.run_dir={str(run_dir)!r} is not one directory for every rank: rank 0 uses "
                         f"{rank0_path} on host {rank0_host}, but " + "; ".join(lines)
                         + (f" (and {len(bad) - 8} more)" if len(bad) > 8 else "")
                         + ". Every rank reads checkpoints from it: give an absolute path on a filesystem "
                           "shared by all training nodes (or start every node from the same shared working "
                           "directory).")
    return path
