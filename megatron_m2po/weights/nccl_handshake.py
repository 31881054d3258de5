"""The trainer's side of the NCCL handshake on a weight-update group.

Why a handshake: see :mod:`megatron_m2po.rollout.sglang_plugin` (NCCL refuses ranks of different
versions, but only at the first collective, as a long error on every member). When a stage's
sender has built its group and every engine has answered ``/init_weights_update_group``, the engine
ranks with the plugin have stated their NCCL version in the group's store
(``m2po/nccl_version/<rank>``); :func:`check_group` states the sender's and compares. The caller
fails the push with :func:`mismatch_message` (one line, both versions, what to rebuild) before
anything is broadcast; the push is not retried, since a relaunched engine runs the same build.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from megatron_m2po.rollout.sglang_plugin import KEY, local_nccl_version, publish

__all__ = ["GroupVersions", "check_group", "mismatch_message", "nccl_refusal_message", "MISMATCH"]

MISMATCH = "NCCL version mismatch"  # every mismatch message starts with it (the error's kind, across ranks)


@dataclass(slots=True)
class GroupVersions:
    """What one group's members stated: the sender's version, engine ranks that differ, and
    engine ranks that stated nothing (no plugin there)."""

    mine: Optional[str]
    differ: list[tuple[str, int, str]] = field(default_factory=list)   # (engine url, group rank, version)
    unknown: list[tuple[str, int]] = field(default_factory=list)      # (engine url, group rank)


def check_group(pg, backend: str, urls, offsets, world: int) -> GroupVersions:
    """State the sender's (group rank 0) NCCL version in ``pg``'s store and read each engine
    rank's. Engine ``i`` holds group ranks ``offsets[i]`` up to the next engine's offset (``world``
    for the last). Call it after every engine answered its join, so a stated version is there."""
    from megatron_m2po.rollout.sglang_plugin import group_store

    mine = local_nccl_version(backend)
    publish(pg, 0, mine)
    store = group_store(pg)
    out = GroupVersions(mine)
    bounds = list(offsets) + [world]
    for i, url in enumerate(urls):
        for rank in range(bounds[i], bounds[i + 1]):
            key = KEY.format(rank=rank)
            if not store.check([key]):
                out.unknown.append((url, rank))
                continue
            theirs = store.get(key).decode()
            if mine is not None and theirs != mine:
                out.differ.append((url, rank, theirs))
    return out


def mismatch_message(group: str, v: GroupVersions) -> str:
    """One line: the group, both versions, and what to rebuild."""
    engines = "; ".join(f"{url} (group rank {rank}) has {ver}" for url, rank, ver in v.differ[:4])
    more = f" and {len(v.differ) - 4} more rank(s)" if len(v.differ) > 4 else ""
    return (f"{MISMATCH} in weight-update group {group}: the trainer's sender has NCCL {v.mine}, engine {engines}{more}. "
            "NCCL refuses a communicator whose ranks run different builds, so no weight can reach these engines: "
            "give the trainer and the engines one NCCL (build the image with docker/install.sh, which preloads the "
            "engines' NCCL for the trainer and stops on a mismatch; outside the image, install the same "
            "nvidia-nccl version in both Pythons), or use rollout.weight_sync=disk")


def nccl_refusal_message(group: str, error: str) -> str:
    """One line from NCCL's own refusal (``init.cc``: "Mismatched NCCL version detected : rank i
    version a rank j version b", NCCL_VERSION_CODEs), for engines that stated no version."""
    from megatron_m2po.rollout.sglang_plugin import format_version

    m = re.search(r"rank (\d+) version (\d+) rank (\d+) version (\d+)", error)
    if m is None:
        return f"{MISMATCH} in weight-update group {group}: NCCL refused the communicator ({error.splitlines()[-1]})"
    (r1, v1), (r2, v2) = sorted([(int(m[1]), int(m[2])), (int(m[3]), int(m[4]))])
    versions = GroupVersions(format_version(v1) if r1 == 0 else None)
    if r1 == 0:
        versions.differ.append(("(no plugin)", r2, format_version(v2)))
        return mismatch_message(group, versions)
    return (f"{MISMATCH} in weight-update group {group}: NCCL saw group rank {r1} at {format_version(v1)} and rank "
            f"{r2} at {format_version(v2)}; give the trainer and the engines one NCCL (docker/install.sh)")
