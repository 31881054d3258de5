"""CPU emulation of NCCL's version check, for the weight-update groups (gloo here).

On GPUs the trainer's senders and the engines meet in NCCL communicators, and NCCL refuses one
whose ranks run different builds: at communicator init every rank all-gathers its peer info
(``NCCL_VERSION_CODE`` included) and ``initTransportsRank`` (NCCL ``src/init.cc``) fails with
``WARN("Mismatched NCCL version detected : rank %d version %d rank %d version %d")`` and
``ncclInvalidUsage``; torch builds the communicator at the group's first collective and raises
a ``DistBackendError`` whose text ends with NCCL's last error. Gloo compares nothing, so without
this module a CPU run with two builds would pass where the image's run fails at its first push.

:func:`enable` makes this process state a version on every weight-update group it builds
(``parallel/side_group.py`` ``HOOKS``) and check, before the group's first broadcast, the versions
every other member stated, failing as torch does on NCCL. Versions (``major.minor.patch``):

- the trainer: ``M2PO_STANDIN_TRAINER_NCCL_VERSION`` (the actor enables it with the CPU platform);
- the CPU worker: ``M2PO_STANDIN_ENGINE_NCCL_VERSION``;

both default to :data:`DEFAULT_VERSION`, so a run mismatches only when one is set apart. The same
versions are what the weight-update handshake states (``rollout/sglang_plugin.py``: the CPU worker
plays an engine with the plugin installed), which catches a mismatch before this check would.
"""

from __future__ import annotations

import os
from typing import Optional

from megatron_m2po.parallel import side_group
from megatron_m2po.rollout import sglang_plugin

__all__ = ["DEFAULT_VERSION", "TRAINER_ENV", "ENGINE_ENV", "trainer_version", "engine_version", "enable",
           "version_code"]

DEFAULT_VERSION = "2.28.9"  # stands for the image's one NCCL build
TRAINER_ENV = "M2PO_STANDIN_TRAINER_NCCL_VERSION"
ENGINE_ENV = "M2PO_STANDIN_ENGINE_NCCL_VERSION"
_PEER = "emulated_nccl/peer_version/{rank}"

_state: dict = {"version": None, "ranks": {}, "checked": set()}


def trainer_version() -> str:
    return sglang_plugin.format_version(os.environ.get(TRAINER_ENV) or DEFAULT_VERSION)


def engine_version() -> str:
    return sglang_plugin.format_version(os.environ.get(ENGINE_ENV) or DEFAULT_VERSION)


def version_code(version: str) -> int:
    """``"2.30.7"`` -> 23007 (NCCL_VERSION_CODE, ``nccl.h``: ``major*10000 + minor*100 + patch``)."""
    major, minor, patch = (int(x) for x in version.split(".")[:3])
    return major * 10000 + minor * 100 + patch


def _created(pg, backend: str, rank: int, world_size: int) -> None:
    if backend != "gloo" or _state["version"] is None:
        return
    sglang_plugin.group_store(pg).set(_PEER.format(rank=rank), str(version_code(_state["version"])))
    _state["ranks"][id(pg)] = (pg, rank, world_size)


def _before_collective(pg, timeout_s: float) -> None:
    """NCCL's peer-info check at the group's first collective, over the versions the members
    stated (a member that runs no emulation states none and is not compared)."""
    entry = _state["ranks"].get(id(pg))
    if entry is None or id(pg) in _state["checked"]:
        return
    _, rank, world = entry
    store = sglang_plugin.group_store(pg)
    mine = version_code(_state["version"])
    for i in range(world):
        key = _PEER.format(rank=i)
        if i == rank or not store.check([key]):
            continue
        theirs = int(store.get(key).decode())
        if theirs != mine:
            raise RuntimeError(
                f"NCCL error in: ProcessGroupNCCL.cpp (emulated on gloo), invalid usage (run with NCCL_DEBUG=WARN "
                f"for details), NCCL version {_state['version']}\nncclInvalidUsage: This usually reflects invalid "
                f"usage of NCCL library.\nLast error:\nMismatched NCCL version detected : rank {i} version {theirs} "
                f"rank {rank} version {mine}")
    _state["checked"].add(id(pg))


def enable(version: Optional[str]) -> None:
    """This process states ``version`` on its gloo weight-update groups and checks its peers'."""
    _state["version"] = None if version is None else sglang_plugin.format_version(version)
    sglang_plugin.set_emulated_version(_state["version"])
    side_group.HOOKS["created"] = _created
    side_group.HOOKS["before_collective"] = _before_collective
