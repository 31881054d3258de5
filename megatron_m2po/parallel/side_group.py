"""Process groups outside the default one: the trainer-to-engine weight-sync groups.

Both ends of a weight-update group are built the way SGLang 0.5.23 builds its end
(``srt/utils/common.py`` ``init_custom_process_group``, called by
``model_runner_components/weight_updater.py`` ``init_weights_update_group`` with
``init_method=tcp://<master_address>:<master_port>`` and no timeout): the ``tcp://`` rendezvous's
store (rank 0 hosts a TCPStore), the store wrapped in ``PrefixStore(group_name, ...)``, then torch's
``_new_process_group_helper`` (which nests its own ``<group_name>/`` prefix). Building one side any
other way (e.g. ``ProcessGroupGloo`` on the prefixed store directly) puts the rendezvous keys under
different names and each side waits for the other until the timeout. The trainer's sender of a
pipeline stage is rank 0 of its group; the CPU worker joins as SGLang does.

Collectives on these groups are called on the ``ProcessGroup`` object directly (:func:`broadcast`)
with an explicit timeout, so a dead peer fails the call instead of hanging it.

NCCL groups are built under ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (CleanUpOnly), whatever the process
has (``scripts/train.sh`` and torchrun set 1, torch's default is 3). torch 2.13 reads the variable in
the ``ProcessGroupNCCL`` constructor, once per group (``ProcessGroupNCCL.hpp``: a per-group
``asyncErrorHandling_``; ``ProcessGroupNCCL.Options`` has no such field). On a failed or timed-out
collective the group's watchdog thread aborts the communicators and then, in modes 1 (TearDown) and
3 (SkipCleanUp), rethrows on its own thread, which terminates the process; in mode 2 it only aborts.
The waiting thread raises either way (``WorkNCCL::wait`` with a timeout aborts and rethrows a
``DistBackendError`` in the caller), so with mode 2 a dead engine during a push is an exception the
trainer handles (relaunch, push again) instead of the end of the trainer. The training groups keep
the process's mode: a hung all-reduce there has no recovery. docs/sglang.md says what to measure on
the first GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
from typing import Iterator, Optional

import torch

__all__ = ["init_custom_process_group", "new_side_group", "destroy_side_group", "broadcast",
           "WEIGHT_SYNC_NCCL_ERROR_HANDLING"]

# torch's ErrorHandlingMode (ProcessGroupNCCL.hpp): 0 NoHandling, 1 TearDown, 2 CleanUpOnly, 3 SkipCleanUp.
WEIGHT_SYNC_NCCL_ERROR_HANDLING = "2"

# The CPU emulation of NCCL's communicator checks (``standins/nccl_emulation.py``) plugs in here:
# ``created(pg, backend, rank, world_size)`` after a group is built, ``before_collective(pg,
# timeout_s)`` before each broadcast. Production leaves both None (real NCCL checks itself).
HOOKS: dict = {"created": None, "before_collective": None}
_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _nccl_error_handling(mode: str) -> Iterator[None]:
    """``TORCH_NCCL_ASYNC_ERROR_HANDLING=mode`` while a group is constructed, then the old value
    (or none) again. One construction at a time in this process (the lock), so two groups built by
    two threads never see each other's value."""
    with _ENV_LOCK:
        old = os.environ.get(_ENV)
        os.environ[_ENV] = mode
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(_ENV, None)
            else:
                os.environ[_ENV] = old


def init_custom_process_group(backend: str, host: str, port: int, world_size: int, rank: int, group_name: str,
                              timeout_s: Optional[float] = None):
    """The same construction as SGLang 0.5.23's ``init_custom_process_group`` with
    ``init_method=tcp://host:port``.

    The store is the one torch's ``tcp://`` rendezvous creates (``rendezvous.py``
    ``_create_c10d_store``: rank 0 hosts a multi-tenant TCPStore), made here directly: under
    torchrun (``TORCHELASTIC_USE_AGENT_STORE``) that rendezvous makes every rank a client of an agent
    store, so a trainer rank would wait for a store nobody hosts. The keys are the same either way.
    ``timeout_s=None`` is SGLang's own choice (torch's ``default_pg_timeout``, 30 minutes); the
    trainer passes its weight-sync timeout so a dead engine fails the sender in bounded time.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    default_pg_timeout)

    if not group_name:
        raise ValueError("group_name must be non-empty (SGLang asserts it)")
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else default_pg_timeout
    store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout, multi_tenant=True)
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # NCCL: a failed weight-update collective must raise, not end the process (module docstring).
    guard = _nccl_error_handling(WEIGHT_SYNC_NCCL_ERROR_HANDLING) if Backend(backend) == Backend.NCCL \
        else contextlib.nullcontext()
    with guard:
        pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                          backend_options=None, timeout=timeout, device_id=None)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    if HOOKS["created"] is not None:
        HOOKS["created"](pg, str(backend), rank, world_size)
    return pg


def new_side_group(backend: str, host: str, port: int, *, rank: int, world_size: int, group_name: str,
                   timeout_s: Optional[float]):
    """Join (rank 0: host) a ``backend`` ("gloo" or "nccl") group of ``world_size`` at ``host:port``."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: use 'nccl' or 'gloo'")
    return init_custom_process_group(backend, host, port, world_size, rank, group_name, timeout_s)


def destroy_side_group(pg) -> None:
    """Release a group built by :func:`init_custom_process_group` (SGLang: ``destroy_process_group(pg)``)."""
    import torch.distributed as dist

    try:
        dist.destroy_process_group(pg)
    except (RuntimeError, ValueError, KeyError):  # already torn down (a peer died): nothing left to free
        pass


def broadcast(pg, tensor: torch.Tensor, timeout_s: float, root: int = 0):
    """``pg.broadcast`` from group rank ``root``; returns the work handle to ``wait()`` on."""
    import torch.distributed as dist

    if HOOKS["before_collective"] is not None:
        HOOKS["before_collective"](pg, timeout_s)
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.timeout = root, datetime.timedelta(seconds=timeout_s)
    return pg.broadcast([tensor], opts)
