"""The distributed transport: each pipeline stage broadcasts its layers to the engines (NCCL or gloo).

``DistributedWeightSync``: each stage's sender and every engine rank form one weight-update group
per stage (SGLang's ``/init_weights_update_group``, group ``<group_name>_<id>_<generation>_s<stage>``,
the sender at rank 0, engine ``i`` at ``rank_offset = 1 + sum(tp of engines before it)``). Per push,
inside one ``/begin_weight_update`` ... ``/end_weight_update`` session (SGLang 0.5.23 refuses
distributed updates outside one), each stage sends buckets of at most ``bucket_mb``: every engine
gets ``/update_weights_from_distributed {names, dtypes, shapes, load_format="flattened_bucket"}``
and the sender broadcasts one uint8 tensor (SGLang's ``FlattenedTensorBucket`` layout). Only the
last bucket of the last stage carries ``weight_version`` and ``flush_cache``. NCCL on GPU tensors, gloo on CPU. The
groups have a timeout and every HTTP call has one, so a dead engine raises ``WeightSyncError``
naming it instead of hanging the trainer. The groups are rebuilt for the next push after a failure,
when the engines change, or when :meth:`DistributedWeightSync.on_engines_restarted` says an engine was
restarted (a restarted engine has lost its groups).

The stage side of the broadcast (turns, buckets, groups) is :mod:`.stage`; the interface, the pause
and the cache flush every push asks for are the shared part's (:mod:`.transport`).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Optional

from megatron_m2po.utils.hf_dir import iter_safetensors
from megatron_m2po.weights.errors import WeightSyncError
from megatron_m2po.weights.fp8 import DEFAULT_BLOCK, is_fp8_config
from megatron_m2po.weights.stage import PushPlan, forget_groups
from megatron_m2po.weights.transport import SessionWeightSync

__all__ = ["DistributedWeightSync"]


class DistributedWeightSync(SessionWeightSync):
    """Broadcast from each pipeline stage's sender to the engines over one group per stage.

    ``master_address``: the senders' address as the engines reach it; ``""`` lets each sender use
    its own (``M2PO_WEIGHT_SYNC_ADDR`` on its node, else the address of its route to the engines).
    ``backend``: ``"nccl"`` for GPU engines (tensors are moved to ``device``), ``"gloo"`` for CPU
    workers. While an earlier stage sends, a stage prepares up to ``prefetch_mb`` (default: one
    bucket) of gathered, converted tensors.
    """

    def __init__(self, engine_urls: list[str], *, master_address: str = "127.0.0.1", master_port: int = 0,
                 backend: str = "gloo", bucket_mb: float = 512.0, timeout_s: float = 300.0,
                 pause_mode: Optional[str] = "retract", group_name: str = "m2po_weight_sync",
                 device: Optional[str] = None, fp8: bool = False, fp8_block: tuple[int, int] = DEFAULT_BLOCK,
                 prefetch_mb: Optional[float] = None, flush_cache: Optional[bool] = None) -> None:
        super().__init__(engine_urls, timeout_s=timeout_s, pause_mode=pause_mode, flush_cache=flush_cache,
                         fp8=fp8, fp8_block=fp8_block)
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}: use 'nccl' (GPU engines) or 'gloo' (CPU workers)")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb={bucket_mb}: must be > 0")
        if master_port:
            raise ValueError(f"master_port={master_port}: every stage's sender picks a free port of its own; "
                             "leave master_port=0")
        self.master_address = master_address
        self.backend, self.bucket_bytes = backend, int(bucket_mb * 2**20)
        self.prefetch_bytes = int((bucket_mb if prefetch_mb is None else prefetch_mb) * 2**20)
        self.group_name, self._generation = group_name, 0
        self.device = device or ("cuda" if backend == "nccl" else "cpu")
        self._prefix = f"{group_name}_{uuid.uuid4().hex[:8]}_"  # this controller's groups
        self._groups: tuple[str, ...] = ()       # the engines hold these groups
        self._members: tuple[str, ...] = ()
        self._stale = False

    def invalidate(self, url: Optional[str] = None) -> None:
        """An engine (``url``, or any) lost its groups (restarted): the next push rebuilds them."""
        self._stale = True

    def on_engines_restarted(self, urls: list[str]) -> None:
        self.invalidate()  # a relaunched engine has lost its weight-update groups

    def connect(self, engine_urls: Optional[list[str]] = None) -> None:
        """Check the engines answer (their tensor-parallel sizes); groups are built by the next push."""
        self._layout(self._urls(engine_urls))

    def _layout(self, urls) -> tuple[int, tuple[int, ...]]:
        infos = self._each(urls, lambda c: c.get_server_info(), "get_server_info")
        tps = [int(i.get("tp_size", 1)) * int(i.get("pp_size", 1) or 1) for i in infos]
        return 1 + sum(tps), tuple(1 + sum(tps[:i]) for i in range(len(urls)))

    def _drop_groups(self) -> None:
        """Forget the current groups on the engines that answer (best effort) and here."""
        names, members = self._groups, self._members
        self._groups, self._members = (), ()
        forget_groups(self._prefix)
        for name in names:
            try:
                self._each(members, lambda c, n=name: c.destroy_weights_update_group(n),
                           "destroy_weights_update_group")
            except WeightSyncError:
                pass

    def begin(self, version: int, n_stages: int, engine_urls: Optional[list[str]] = None) -> PushPlan:
        self._t0 = time.perf_counter()
        urls = self._urls(engine_urls)
        if self._stale or self._members != urls or len(self._groups) != n_stages:
            self._drop_groups()
            self._stale = False
            self._generation += 1
            self._groups = tuple(f"{self._prefix}{self._generation}_s{p}" for p in range(n_stages))
            self._members = urls
            self._world, self._offsets = self._layout(urls)
        plan = PushPlan("distributed", int(version), urls, n_stages, self.timeout_s, fp8=self.fp8,
                        fp8_block=self.fp8_block, groups=self._groups, world=self._world, offsets=self._offsets, backend=self.backend,
                        device=self.device, bucket_bytes=self.bucket_bytes, prefetch_bytes=self.prefetch_bytes,
                        flush_last=self._may_flush, master_address=self.master_address)
        return self._open_session(plan)

    def _session_failed(self) -> None:
        self._stale = True  # a failed collective leaves the groups unusable: new ones for the next push

    def _from_dir(self, path: str, plan: PushPlan):
        if _is_fp8_dir(path):
            plan.fp8 = False  # already quantised
        return iter_safetensors(path)

    def close(self) -> None:
        try:
            self._drop_groups()
        finally:
            super().close()


def _is_fp8_dir(path: str) -> bool:
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return is_fp8_config(cfg)
