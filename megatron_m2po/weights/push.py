"""The weight-push controller: which weights the engines hold, and how new ones reach them.

Every rank holds a :class:`WeightPushController`; its ``version`` (the weight version the engines
hold) is the same on all of them, because every rank takes part in every push
(:func:`~megatron_m2po.weights.stage.push_from_stages`: each pipeline stage sends its own
layers) and every rank sees the same outcome. Global rank 0's controller also drives the push
(:meth:`begin` / :meth:`finish`, through the transport of ``rollout.weight_sync``); the engines
themselves are ``EngineControl``'s (``rollout_service/engine_control.py``), which the push asks to
hold them for it, to relaunch those that died, and to admit relaunched ones once they hold the
pushed version; between pushes the training loop has it check them.

A push never changes the engines' weights while a generation that must be tagged with the old
version is in flight: ``EngineControl.hold_for_push`` first waits for it (its ``drain``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional

from megatron_m2po.rollout.settings import RolloutConfig
from megatron_m2po.parallel.rank0 import from_rank0
from megatron_m2po.utils.faults import fault_point
from megatron_m2po.utils.timing import TIMER
from megatron_m2po.weights.colocated import ColocatedWeightSync, colocated_servers
from megatron_m2po.weights.disk import DiskWeightSync
from megatron_m2po.weights.distributed import DistributedWeightSync
from megatron_m2po.weights.errors import NcclVersionMismatch, WeightSyncError
from megatron_m2po.weights.hf_export import stage_hf_weights, stage_layout
from megatron_m2po.weights.stage import PushPlan, push_from_stages

log = logging.getLogger(__name__)


def build_weight_sync(rollout: RolloutConfig, engine_urls: list[str], *, sync_dir: str, base_model_dir: str,
                      external: bool):
    """Rank 0's weight sync of ``rollout.weight_sync`` (disk for external producers, which load the
    published ``v<version>`` directories themselves; colocated: memory handles to the engines on
    this node's GPUs, :mod:`megatron_m2po.weights.colocated`)."""
    r = rollout
    if r.weight_sync == "colocated" and not external:  # engines on the trainer's GPUs: memory handles
        return ColocatedWeightSync(engine_urls, bucket_mb=r.weight_sync_bucket_mb, timeout_s=r.weight_sync_timeout_s,
                                   fp8=r.fp8_weights, fp8_block=tuple(r.fp8_block_size),
                                   servers=_colocated_servers(r, engine_urls))
    if r.weight_sync == "disk" or external:
        return DiskWeightSync(engine_urls, sync_dir, base_model_dir=base_model_dir, timeout_s=r.weight_sync_timeout_s,
                              fp8=r.fp8_weights, fp8_block=tuple(r.fp8_block_size), min_gbps=r.weight_sync_min_gbps)
    import torch

    # Engines must reach every stage's sender: each sender uses M2PO_WEIGHT_SYNC_ADDR of its own
    # node, else the address of its route to the engines (master_address="").
    sync = DistributedWeightSync(engine_urls, master_address="", timeout_s=r.weight_sync_timeout_s,
                                 backend="nccl" if torch.cuda.is_available() else "gloo",
                                 bucket_mb=r.weight_sync_bucket_mb, fp8=r.fp8_weights,
                                 fp8_block=tuple(r.fp8_block_size))
    sync.connect()
    return sync


def _colocated_servers(r: RolloutConfig, engine_urls: list[str]):
    """The trainer rank on each engine rank's GPU (SGLang engines launched here); None for CPU workers,
    which rank 0 serves (host memory)."""
    if r.engine != "sglang" or r.launcher != "local":
        return None
    from megatron_m2po.rollout.placement import engine_gpus, node_gpus

    node = node_gpus()
    return colocated_servers(engine_urls, engine_gpus(r, node), list(range(node.trainer)), node.world)


class WeightPushController:
    """The engines' weight version (every rank) and, on global rank 0, the push itself.

    Rank 0: ``sync`` (the transport of ``rollout.weight_sync``: :class:`DiskWeightSync`,
    :class:`DistributedWeightSync` or :class:`ColocatedWeightSync`) and ``engines`` (the engines'
    owner, ``rollout_service/engine_control.py`` ``EngineControl``: a push is bracketed by its
    ``hold_for_push`` / ``end_hold`` / ``served``, a failed one relaunches the dead engines with its
    ``restart_dead``, adapters load through it). Other ranks: :meth:`follower`, which only tracks
    ``version``. Every rank: ``lora_push`` (``model.lora.push`` as validated, None without LoRA)
    and ``relaunch``: after a failed push, relaunch the dead engines and return their URLs (None:
    rank 0's ``engines.restart_dead``; colocated mode passes its own, the trainer offloaded
    around it: trainer/colocated.py ``ColocatedPhases.relaunch_in_push``).
    """

    def __init__(self, sync: Any = None, *, engines: Any = None, lora_push: Optional[str] = None,
                 relaunch: Optional[Callable[[], list[str]]] = None):
        self.sync, self.engines = sync, engines
        self.version = 0  # fresh engines start from the base model
        self._pushed: list = []  # rank 0: SyncStats of the pushes since take_metrics()
        self._first_push_s: Optional[float] = None  # the first push's seconds (what a slow push is)
        self.relaunch = relaunch
        self.lora_push = lora_push

    @classmethod
    def follower(cls, *, lora_push: Optional[str] = None,
                 relaunch: Optional[Callable[[], list[str]]] = None) -> "WeightPushController":
        """A rank other than global rank 0: takes part in pushes, tracks ``version``."""
        return cls(lora_push=lora_push, relaunch=relaunch)

    @property
    def leads(self) -> bool:
        return self.sync is not None

    # ------------------------------------------------------------------ every rank
    def push(self, weights: Callable[[], Iterable], version: int, *, stage: int, n_stages: int, sender: bool,
             phase: str = "push") -> None:
        """All ranks: every pipeline stage sends its own layers (``weights()``: this rank's stage
        tensors, a fresh iterator per attempt). A push that fails because engines died is repeated
        once after they are relaunched: the repeat loads the current weights into them, then they
        rejoin the router. ``phase``: the timer phase (colocated mode: ``"transfer"``).

        The transport is rank 0's (:func:`build_weight_sync`); its plan reaches every rank, and a
        colocated plan makes every rank hand its copies to the engine ranks on its own GPU
        (:meth:`~megatron_m2po.weights.colocated.ColocatedPlan.exchange`, which
        :func:`~megatron_m2po.weights.stage.push_from_stages` calls on every rank)."""
        def attempt() -> None:
            with TIMER.phase(phase):
                push_from_stages(self if self.leads else None, weights(), version, stage=stage,
                                 n_stages=n_stages, sender=sender)

        def restart() -> list[str]:
            return (self.relaunch() if self.relaunch is not None
                    else from_rank0(lambda: self.engines.restart_dead(), what="engine restarts"))

        self._once_more_after_restart(attempt, restart, f"weight push of version {version}",
                                      "pushing again to every engine")
        # Every rank alike (rank 0's finish() recorded it already, as soon as the engines held it).
        self.version = version

    def push_actor(self, actor, *, phase: str = "push") -> None:
        """All ranks: push ``actor``'s weights at its version, every pipeline stage sending its own
        layers (:func:`~megatron_m2po.weights.hf_export.stage_layout` says who sends); ``phase``:
        the timer phase (:meth:`push`). Under LoRA with ``model.lora.push=adapter`` the adapters
        alone go (:meth:`push_adapters`); with ``merged`` the base with the adapters folded in."""
        if self.lora_push == "adapter":
            self.push_adapters(actor, phase=phase)
            return
        layout = stage_layout()
        self.push(lambda: stage_hf_weights(actor), actor.version, stage=layout.stage, n_stages=layout.n_stages,
                  sender=layout.sender, phase=phase)

    def push_adapters(self, actor, *, phase: str = "push") -> None:
        """All ranks: the adapters of every stage gathered to rank 0 (``lora_export.peft_adapter_tensors``),
        which loads them on every engine as version ``actor.version`` (weights/lora_push.py); a load
        that fails because engines died is repeated once after they are relaunched."""
        from megatron_m2po.weights.lora_export import peft_adapter_tensors

        version = actor.version
        with TIMER.phase(phase):
            tensors = peft_adapter_tensors(actor.chunks, "sglang")  # collective; the list on rank 0
            from_rank0(lambda: self._load_adapters(tensors, version), what=f"the LoRA adapter push of version {version}")
        self.version = version

    def _load_adapters(self, tensors, version: int) -> None:
        self.engines.prepare_adapters(version)  # as begin(): the trainer is at ``version`` first
        stats = self._once_more_after_restart(lambda: self.engines.load_adapters(tensors, version),
                                              self.engines.restart_dead, f"LoRA adapter push of version {version}",
                                              "loading it again on every engine")
        self.engines.served(version)
        self._record(stats)

    def _once_more_after_restart(self, attempt: Callable[[], Any], restart: Callable[[], list], what: str,
                                 again: str) -> Any:
        """``attempt()``; when it fails because engines died (``restart()`` relaunched some), once more:
        the repeat loads the current weights into them. A NCCL build mismatch is not repeated (every
        retry would meet the same two builds)."""
        for n in (1, 2):
            try:
                return attempt()
            except NcclVersionMismatch:
                raise
            except WeightSyncError as e:
                if n == 2 or not restart():
                    raise
                if self.leads:
                    log.warning("%s failed (%s); %s", what, e, again)

    # ------------------------------------------------------------------ rank 0
    def begin(self, version: int, n_stages: int) -> PushPlan:
        """Rank 0's start of a weight push from ``n_stages`` pipeline stages."""
        urls = self.engines.hold_for_push(version)
        try:
            return self.sync.begin(version, n_stages, urls)
        except BaseException:
            self.engines.end_hold()
            raise

    def finish(self, plan: PushPlan, results: list):
        """Rank 0's end of a push: engines at the new version; relaunched engines rejoin the router."""
        fault_point("weight_push")  # the store records plan.version; the engines do not hold it yet
        try:
            stats = self.sync.finish(plan, results)
        finally:
            self.engines.end_hold()
        self.version = plan.version
        self.engines.served(plan.version)
        self._record(stats)
        return stats

    def _record(self, stats) -> None:
        """Log one push (its size, time and GB/s; a disk push's write, load and load timeout too) and
        keep it for :meth:`take_metrics`."""
        if stats is None:
            return
        disk = ""
        if stats.load_s is not None:
            disk = (f"; stages wrote in {stats.write_s:.1f} s, {stats.engines} engine(s) loaded in {stats.load_s:.1f} s "
                    f"of a {stats.timeout_s:.0f} s timeout")
        # One INFO line for the first push, and for a push over twice as slow as the first: every push is
        # in metrics.jsonl (sync/weight_*) and the time table; the rest go to DEBUG (M2PO_DEBUG=1).
        first = self._first_push_s is None
        if first:
            self._first_push_s = stats.seconds
        slow = stats.seconds > 2 * max(self._first_push_s, 0.5)
        note = "; later pushes are logged when over twice as slow (each is in metrics.jsonl, sync/weight_*)" \
            if first else (" (over twice the first push's time)" if slow else "")
        log.log(logging.INFO if first or slow else logging.DEBUG, "weight push of version %d: %.3g GB in %.1f s "
                "(%.3g GB/s%s)%s", stats.version, stats.bytes / 1e9, stats.seconds, stats.gb_per_s, disk, note)
        self._pushed.append(stats)

    def take_metrics(self) -> dict[str, float]:
        """Rank 0: the pushes since the last call, as ``sync/weight_gb`` (sum), ``sync/weight_gbps``
        (their bytes over their seconds) and, for disk pushes, ``sync/weight_load_s`` (the engines'
        load, sum); empty when nothing was pushed."""
        pushed, self._pushed = self._pushed, []
        if not pushed:
            return {}
        nbytes, secs = sum(s.bytes for s in pushed), sum(s.seconds for s in pushed)
        out = {"sync/weight_gb": nbytes / 1e9, "sync/weight_gbps": nbytes / 1e9 / max(secs, 1e-9)}
        loads = [s.load_s for s in pushed if s.load_s is not None]
        if loads:
            out["sync/weight_load_s"] = float(sum(loads))
        return out
