"""The engine side of the weight-update handshake, as an SGLang 0.5.23 general plugin.

NCCL refuses a communicator whose ranks run different NCCL builds: every rank all-gathers its
``ncclPeerInfo`` (which carries ``NCCL_VERSION_CODE``) and ``initTransportsRank`` (NCCL
``src/init.cc``) fails with "Mismatched NCCL version detected : rank i version a rank j version b"
and ``ncclInvalidUsage``. torch creates the communicator lazily, so on a weight-update group the
refusal only comes at the first broadcast of the first push, on every engine, as a long
``DistBackendError``; a relaunch-and-retry fails the same way. The trainer (the NGC image's torch
and NCCL) and the engines (SGLang's own torch, which finds its pinned ``nvidia-nccl`` wheel through
its RPATH) are two builds unless the image unifies them (``docker/install.sh``).

So both ends of a weight-update group state their NCCL version through the group's own store
(the ``tcp://`` rendezvous store, under the group's prefix) as soon as the group forms:

- each engine rank sets ``m2po/nccl_version/<group rank>`` (this plugin, an ``AFTER`` hook on
  ``WeightUpdater.init_weights_update_group``, ``model_runner_components/weight_updater.py``; it
  runs before the HTTP answer of ``/init_weights_update_group`` goes back);
- the trainer's sender (group rank 0) sets its own key and, once every engine has answered,
  compares (:func:`megatron_m2po.weights.nccl_handshake.check_group`): a mismatch fails the push at
  once with one line naming both versions, before any collective runs.

An engine without the plugin states nothing; the trainer then says so once and NCCL's own check
still decides at the first broadcast.

This file is the plugin itself: it imports only the standard library and torch (the engine venv
has no megatron_m2po). ``docker/install.sh`` installs it into the engine venv as the module
``m2po_sglang_plugin`` with the entry point ``sglang.srt.plugins: m2po_nccl_handshake =
m2po_sglang_plugin:register``; SGLang's ``load_plugins`` (``srt/plugins/__init__.py``, called in
every scheduler process) runs ``register`` and applies the hook (``srt/plugins/hook_registry.py``).
``python -m m2po_sglang_plugin --nccl-version`` prints the NCCL version this Python's torch loads.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional

__all__ = ["KEY", "TARGET", "format_version", "local_nccl_version", "publish", "group_store", "register",
           "set_emulated_version"]

log = logging.getLogger("m2po_sglang_plugin")

# Where each rank states its NCCL version, relative to the group's store.
KEY = "m2po/nccl_version/{rank}"
# The method SGLang 0.5.23 runs on every tensor-parallel rank of an engine to join a group.
TARGET = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater.init_weights_update_group"

# The version a gloo (CPU) group states: set by the CPU emulation, which stands in for NCCL there.
_EMULATED: dict[str, Optional[str]] = {"version": None}


def format_version(v: Any) -> str:
    """``(2, 30, 7)`` / ``23007`` / ``"2.30.7"`` -> ``"2.30.7"`` (NCCL_VERSION_CODE is
    ``major*10000 + minor*100 + patch`` from 2.9 on)."""
    if isinstance(v, (tuple, list)):
        return ".".join(str(int(x)) for x in v[:3])
    if isinstance(v, int):
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 20900 else f"{v // 1000}.{v // 100 % 10}.{v % 100}"
    return str(v).strip()


def set_emulated_version(version: Optional[str]) -> None:
    """The NCCL version this process states on gloo groups (the CPU stand-ins only)."""
    _EMULATED["version"] = None if version is None else format_version(version)


def local_nccl_version(backend: str) -> Optional[str]:
    """The NCCL build this process's torch runs (``backend="nccl"``), or the emulated one on gloo
    (None when nothing stands in for NCCL there)."""
    if backend != "nccl":
        return _EMULATED["version"]
    import torch

    return format_version(torch.cuda.nccl.version())


def group_store(pg):
    """The store a process group was built on (torch keeps it in ``_world.pg_map[pg]``)."""
    from torch.distributed import distributed_c10d as c10d

    getter = getattr(c10d, "_get_process_group_store", None)
    return getter(pg) if getter is not None else c10d._world.pg_map[pg][1]


def publish(pg, rank: int, version: Optional[str]) -> None:
    """State ``version`` for group rank ``rank`` in ``pg``'s store (nothing when unknown)."""
    if version is not None:
        group_store(pg).set(KEY.format(rank=rank), version)


def _after_init_weights_update_group(result, updater, master_address, master_port, rank_offset, world_size,
                                     group_name, backend="nccl"):
    """``AFTER`` hook: on success, state this engine rank's NCCL version in the new group's store."""
    ok = result[0] if isinstance(result, tuple) else bool(result)
    if not ok:
        return None
    try:
        pg = updater._model_update_group[group_name]
        publish(pg, int(rank_offset) + int(updater.tp_rank), local_nccl_version(str(backend)))
    except Exception as e:  # noqa: BLE001 - never fail a join the engine itself accepted
        log.warning("m2po NCCL handshake: could not state this engine's NCCL version in group %s: %s",
                    group_name, e)
    return None


def register() -> None:
    """SGLang general-plugin entry point: hook the join of a weight-update group."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, _after_init_weights_update_group, HookType.AFTER)


if __name__ == "__main__":
    if sys.argv[1:] != ["--nccl-version"]:
        sys.exit("usage: python -m m2po_sglang_plugin --nccl-version")
    print(local_nccl_version("nccl"))
