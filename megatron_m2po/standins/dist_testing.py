"""Run a function on N local processes joined by a gloo process group (tests, benchmarks).

    results = run_distributed(fn, world_size=2, args=(x,))

``fn(rank, world_size, *args)`` runs in each rank's process after
``torch.distributed.init_process_group("gloo")`` on a free loopback port; the list of return
values (one per rank, picklable) comes back. An exception on any rank is re-raised here with
that rank's traceback. ``fn`` must be importable (module level), as it is pickled by name.

Ranks are fresh processes forked from multiprocessing's forkserver, which imports torch and
Megatron-Core once (``PRELOAD``): a rank starts in ~0.1 s instead of paying the ~5 s import
each (spawn). Nothing runs in the server but those imports (no torch op, no thread pool), and
each rank gets the caller's environment as it is at the call, as spawn would give it.
"""

from __future__ import annotations

import datetime
import functools
import os
import pickle
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_m2po.utils.net import free_port

__all__ = ["run_distributed", "free_port"]

# Imported once by the fork server; a module that fails to import is skipped there (and then
# imported by the rank that needs it, as under spawn).
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
           "megatron.core.dist_checkpointing", "transformers", "megatron_m2po.actor.actor"]
# c10's default_rng_seed_val: what torch's CPU generator starts from in a new process.
_TORCH_DEFAULT_SEED = 67280421310721


@functools.cache
def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any,
            env: dict[str, str], pg_timeout_s: float | None = None) -> None:
    os.environ.clear()
    os.environ.update(env)
    import torch
    torch.manual_seed(_TORCH_DEFAULT_SEED)  # a fresh process's generator state, as under spawn
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    try:
        kw = {"timeout": datetime.timedelta(seconds=pg_timeout_s)} if pg_timeout_s else {}
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, **kw)
        except Exception as e:  # noqa: BLE001
            if "EADDRINUSE" in str(e):  # the free port was taken before rank 0's store bound it: run again
                queue.put((rank, None, traceback.format_exc()))
                return
            raise
        out = fn(rank, world_size, *args)
        # By value (plain pickle): through the queue torch's reducers would share a tensor's storage
        # by file descriptor, which the parent fetches from this process's resource sharer, and this
        # process may have exited by then (FileNotFoundError in the parent under load).
        queue.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, args: tuple = (), timeout_s: float = 120.0,
                    env: dict[str, str] | None = None, pg_timeout_s: float | None = None) -> list[Any]:
    """Start ``world_size`` gloo ranks running ``fn(rank, world_size, *args)``; return results.

    ``pg_timeout_s`` sets the default process group's collective timeout (torch's default else)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for attempt in range(3):
        # A port free when picked can be taken before rank 0's store binds it (other tests pick ports
        # too): rank 0 then fails in init_process_group, before fn ran anywhere, and the ranks start
        # again on another port.
        out = _run_once(fn, world_size, args, timeout_s, env, pg_timeout_s)
        if out is not None or attempt == 2:
            break
    if out is None:
        raise RuntimeError("rank 0 could not bind a free port for its store three times (EADDRINUSE)")
    return out


def _run_once(fn: Callable, world_size: int, args: tuple, timeout_s: float, env: dict[str, str],
              pg_timeout_s: float | None) -> list[Any] | None:
    """One start of the ranks; None when rank 0's store could not bind its port."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, env, pg_timeout_s),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    port_taken = False
    try:
        for _ in range(world_size):
            rank, ok, out = queue.get(timeout=timeout_s)
            if ok is None:
                port_taken = True
                break
            if ok:
                results[rank] = pickle.loads(out)
            else:
                errors.append(f"rank {rank} failed:\n{out}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not (errors or port_taken) else 0.5)
            if p.is_alive():
                p.kill()
    if port_taken:
        return None
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
