"""The in-node transport: weights handed to engines on the same node through memory handles.

``ColocatedWeightSync`` (``rollout.weight_sync=colocated``, engines time-sharing the trainer's GPUs)
moves no weight bytes over a socket. Per push, inside one ``/begin_weight_update`` ...
``/end_weight_update`` session (SGLang 0.5.23 refuses ``update_weights_from_tensor`` outside one:
``managers/scheduler_components/weight_updater.py`` ``update_weights_from_tensor``), each pipeline
stage's sender packs its HF-named tensors into buckets of at most ``bucket_bytes``
(``rollout.weight_sync_bucket_mb``, the distributed transport's setting) and posts each bucket to
every engine as ``/update_weights_from_tensor`` with ``load_format="flattened_bucket"``:

- a bucket is one uint8 tensor, the tensors' bytes back to back, each starting at a multiple of its
  own element size (the reader views each ``[start_idx:end_idx]`` slice as its dtype, which torch
  allows only at such offsets; gaps are never read), and a list of ``FlattenedTensorMetadata``
  (``name, shape, dtype, start_idx, end_idx, numel`` with ``numel`` in bytes), the dict
  ``{"flattened_tensor": ..., "metadata": [...]}`` that ``weight_updater.py``
  ``_update_weights_from_flattened_bucket`` reads (``weight_sync/tensor_bucket.py``);
- the dict is pickled as SGLang's ``MultiprocessingSerializer.serialize`` does (``utils/common.py``:
  a ``ForkingPickler`` dump, torch's reductions), base64 for JSON: a GPU tensor becomes a CUDA IPC
  handle, a CPU tensor a shared-memory file name (``rebuild_storage_filename``; the fd strategy
  would need the receiver to connect back with our process's authkey, which an engine does not
  have). The metadata are pickled as instances of ``sglang.srt.weight_sync.tensor_bucket.
  FlattenedTensorMetadata`` (allowed by SGLang's ``SafeUnpickler``) without importing sglang,
  which the trainer's Python does not have;
- like ``utils/patch_torch.py`` ``_reduce_tensor_modified`` (SGLang's sender side), a CUDA handle
  names its device by UUID, not by index: the engine's ``_rebuild_cuda_tensor_modified`` maps it
  back to its own index, which differs when the two processes see different CUDA_VISIBLE_DEVICES;
- ``serialized_named_tensors`` holds one payload per engine tensor-parallel rank (``tp_worker.py``
  ``deserialize_own_rank`` opens entry ``tp_rank`` only), each a separate reduction, so the
  producer-side CUDA IPC reference counts match one open each.

Lifetime: the handles point into the sender's memory, so each bucket (its flat tensor) is held by
the sender until every engine's HTTP call for it has returned (the engine has loaded it, or
failed; after a failure the sender still waits, bounded, for the buckets in flight). Meanwhile the
next bucket is packed (its copy overlaps the engines' load: on the host into reused shared memory,
``colocated_bucket.HostBuckets``, which takes another bucket only once every engine has loaded the
one it held; on a GPU into fresh memory from the caching allocator) and posted before the previous
one has returned, so each engine finds it queued when done (an engine runs one update at a time,
below); the bucket carrying the version goes only once every other one of its stage has returned
(other stages', below, may still be loading). The bucket format and its pickling are in
``weights/colocated_bucket.py``.

Who serves which engine rank: :func:`colocated_assignment` maps each engine TP rank to the trainer
rank on its GPU and refuses a layout where a trainer rank's GPU has no engine rank (a GPU that does
not time-share) or an engine rank sits on a GPU without a trainer rank. In this transport the
handles are made by each stage's sender (tensor-parallel rank 0 of data-parallel replica 0, as in
every transport): its memory serves every engine rank of the node, for its stage's layers; an
engine rank on another GPU reads it through CUDA peer access (the UUID above). So the engines and
every stage sender must share one node.

Stages post concurrently: SGLang runs one weight update at a time per engine
(``managers/tokenizer_control_mixin.py`` ``update_weights_from_tensor``: under ``is_pause_cond``
while paused, else the ``model_update_lock`` writer lock) and ``update_weights_from_tensor`` has no collective, so no order is
needed between stages (unlike the distributed transport's turns). Only the last bucket of the last
stage carries ``weight_version`` and, unless pausing in place, ``flush_cache`` (as the distributed
transport); an engine may take it before another stage's last bucket, but it is paused for the
whole push and nothing reads its version before :meth:`ColocatedWeightSync.finish`. ``fp8``
quantises like the other transports (``weights/fp8.py`` ``quantize_named`` on the way out).

:func:`~megatron_m2po.weights.stage.push_from_stages` calls every rank's part of the push as the
plan's ``exchange``: :meth:`ColocatedPlan.exchange` runs :func:`exchange_colocated` (every rank hands
its copy to the engine ranks on its GPU) or, in one process, :func:`run_colocated_stage`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from megatron_m2po.weights.errors import WeightSyncError
from megatron_m2po.utils.background_loop import BackgroundLoop
from megatron_m2po.utils.hf_dir import iter_safetensors
from megatron_m2po.weights.fp8 import DEFAULT_BLOCK, is_fp8_config, quantize_named
from megatron_m2po.weights.colocated_bucket import (HOST_BUCKETS, FlattenedTensorMetadata, bucket_layout,
                                                    pack_bucket, serialize_bucket, split_buckets)
from megatron_m2po.weights.stage import PushPlan, StageResult, describe, each_engine, nbytes
from megatron_m2po.weights.transport import SessionWeightSync, SyncStats

__all__ = ["ColocatedWeightSync", "ColocatedPlan", "EngineRank", "colocated_assignment", "pack_bucket",
           "serialize_bucket", "split_buckets", "run_colocated_stage", "Phases", "exchange_colocated",
           "colocated_servers"]


def read_hf_config(path: str) -> dict:
    """``config.json`` of an HF directory ({} when unreadable)."""
    import json

    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


@dataclass(frozen=True, slots=True)
class EngineRank:
    """Tensor-parallel rank ``tp_rank`` of engine ``url``, on the node's GPU ``gpu``."""

    url: str
    tp_rank: int
    gpu: int


def colocated_assignment(trainer_gpus: Sequence[int], engines: Sequence[tuple[str, Sequence[int]]],
                         ) -> dict[EngineRank, int]:
    """The trainer rank (an index into ``trainer_gpus``, each rank's GPU on this node) that serves
    each engine rank; ``engines``: ``(url, the GPU of each of its TP ranks in order)``. Refuses a
    trainer GPU without an engine rank (it would idle while engines generate) and an engine rank
    on a GPU without a trainer rank (nobody hands it weights in the node)."""
    by_gpu: dict[int, int] = {}
    for rank, gpu in enumerate(trainer_gpus):
        by_gpu.setdefault(int(gpu), rank)
    out, used = {}, set()
    for url, gpus in engines:
        for tp_rank, gpu in enumerate(gpus):
            if int(gpu) not in by_gpu:
                raise ValueError(f"colocated weights: engine {url} TP rank {tp_rank} is on GPU {gpu}, where no "
                                 f"trainer rank runs (trainer GPUs {sorted(by_gpu)}): put every engine on the "
                                 "trainer's GPUs (rollout.engine_gpu_ids) or use a disaggregated weight_sync")
            out[EngineRank(url, tp_rank, int(gpu))] = by_gpu[int(gpu)]
            used.add(int(gpu))
    idle = sorted(set(by_gpu) - used)
    if idle:
        raise ValueError(f"colocated weights: trainer GPU(s) {idle} host no engine rank (engine GPUs {sorted(used)}): "
                         "with rollout.colocate every trainer GPU time-shares with an engine; set num_engines x "
                         "engine_tp to the trainer's GPU count")
    return out


def colocated_servers(urls: Sequence[str], engine_gpus: Sequence[Sequence[int]], trainer_gpus: Sequence[int],
                      world: int) -> dict[str, list[int]]:
    """``ColocatedWeightSync(servers=...)``: per engine URL, the trainer rank serving each TP rank
    (:func:`colocated_assignment`). ``world``: trainer ranks in all; the engines and every trainer
    rank must share one node (handles do not cross nodes)."""
    if world != len(trainer_gpus):
        raise ValueError(f"colocated weights: {world} trainer ranks but {len(trainer_gpus)} on this node: memory "
                         "handles do not cross nodes; run colocated on one node, or use a disaggregated weight_sync")
    got = colocated_assignment(trainer_gpus, list(zip(urls, engine_gpus)))
    return {u.rstrip("/"): [got[EngineRank(u, j, int(g))] for j, g in enumerate(gpus)]
            for u, gpus in zip(urls, engine_gpus)}


@dataclass(slots=True)
class ColocatedPlan(PushPlan):
    """A colocated push: ``engine_tp[i]`` payloads per bucket for engine ``urls[i]``; with every rank
    taking part (:func:`exchange_colocated`), ``servers[i][j]`` is the trainer rank (of the push's
    group) whose memory serves engine ``i``'s TP rank ``j``."""

    engine_tp: tuple[int, ...] = ()
    servers: tuple[tuple[int, ...], ...] = ()

    def exchange(self, weights: Iterable[tuple[str, torch.Tensor]], *, stage: int, sender: bool, group=None,
                 store=None) -> Optional["StageResult"]:
        """Every rank's part of a colocated push: with several ranks each hands its copy to the engine
        ranks on its own GPU (:func:`exchange_colocated`); one process is the sender alone and needs no
        collective (:func:`run_colocated_stage`)."""
        import torch.distributed as dist

        if dist.get_world_size(group) > 1:
            return exchange_colocated(self, weights, stage=stage, sender=sender, group=group)
        return run_colocated_stage(self, stage, weights)


@dataclass(slots=True)
class Phases:
    """Where a stage's push time went (seconds): packing buckets (the copy into the bucket),
    pickling the handles, and waiting for the engines (hand-over + their load, the part not
    hidden behind the next bucket's packing)."""

    pack_s: float = 0.0
    serialize_s: float = 0.0
    wait_s: float = 0.0
    buckets: int = 0


class _InFlight:
    """One bucket, packed, then posted to every engine: its flat tensor is held here until all have
    answered, and given back for reuse only if all loaded it."""

    def __init__(self, plan: ColocatedPlan, stage: int, k: int, bucket: list, final: bool, phases: Phases) -> None:
        t0 = time.perf_counter()
        self.flat, metas = pack_bucket(bucket, pool=HOST_BUCKETS, capacity=plan.bucket_bytes)
        t1 = time.perf_counter()
        self.payloads = {u: [serialize_bucket(self.flat, metas) for _ in range(tp)]
                         for u, tp in zip(plan.urls, plan.engine_tp)}
        phases.pack_s += t1 - t0
        phases.serialize_s += time.perf_counter() - t1
        phases.buckets += 1
        self.version, self.flush = (str(plan.version) if final else None), final and plan.flush_last
        self.what = (f"update_weights_from_tensor of stage {stage} bucket {k} ({len(bucket)} tensors, "
                     f"{self.flat.numel() / 2**20:.3g} MiB, {bucket[0][0]} .. {bucket[-1][0]})")
        self.urls, self.timeout_s = list(plan.urls), plan.timeout_s
        self.future = None

    def post(self, io_loop) -> "_InFlight":
        self.future = io_loop.submit(each_engine(self.urls, lambda c: c.update_weights_from_tensor(
            self.payloads[c.base_url], load_format="flattened_bucket", flush_cache=self.flush,
            weight_version=self.version, timeout_s=self.timeout_s), self.what, self.timeout_s))
        return self

    def wait(self, phases: Phases) -> None:
        t0, loaded = time.perf_counter(), False
        try:
            self.future.result(self.timeout_s + 30)
            loaded = True
        except TimeoutError:
            raise WeightSyncError(f"{self.what}: engines {self.urls} did not answer within "
                                  f"{self.timeout_s:.0f}s") from None
        finally:
            phases.wait_s += time.perf_counter() - t0
            flat, self.flat = self.flat, None
            if loaded:  # every engine answered: its memory may take another bucket
                HOST_BUCKETS.give_back(flat)


def run_colocated_stage(plan: ColocatedPlan, stage: int, weights: Iterable[tuple[str, torch.Tensor]],
                        phases: Optional[Phases] = None) -> StageResult:
    """Send stage ``stage``'s tensors bucket by bucket (``stage.run_stage``'s contract: never
    raises, the error is in the result; always iterates ``weights`` to the end).

    Bucket ``k`` is packed while the engines load bucket ``k - 1`` and posted before that load has
    answered, so each engine finds it queued when it is done (SGLang runs one update at a time:
    ``is_pause_cond`` / ``model_update_lock``); then the sender waits for bucket ``k - 1``, whose
    memory takes bucket ``k + 1``. At most two packed buckets and one gathered bucket exist at once.
    The bucket carrying the version (the last stage's last) is posted only once every other one of
    its stage has answered. ``phases`` (optional) accumulates where the time went.
    """
    t0 = time.perf_counter()
    res, phases = StageResult(stage), phases if phases is not None else Phases()
    it = iter(weights)
    if plan.fp8:
        it = quantize_named(it, block=plan.fp8_block, skipped=res.skipped)
    io_loop = BackgroundLoop(f"colocated-push-s{stage}")
    posted: list[_InFlight] = []  # in order; at most two
    try:
        buckets = split_buckets(it, plan.bucket_bytes, _first(plan))
        nxt, k = next(buckets, None), 0
        while nxt is not None:
            bucket, nxt = nxt, next(buckets, None)  # look ahead: is this the last bucket?
            final = stage == plan.n_stages - 1 and nxt is None  # it carries the version
            packed = _InFlight(plan, stage, k, bucket, final, phases)
            if final:  # after every other bucket of this stage has answered
                _wait(posted, 0, phases)
            posted.append(packed.post(io_loop))
            _wait(posted, 1, phases)  # bucket k - 1 loaded (its load overlapped this one's packing)
            k += 1
            res.bytes += sum(nbytes(t) for _, t in bucket)
            res.n_tensors += len(bucket)
        _wait(posted, 0, phases)
    except BaseException as e:  # noqa: BLE001 - reported in the result, raised by the controller
        res.error = f"stage {stage}: {describe(e)}"
        for p in posted:  # engines may still read them
            _drain(p)
    finally:
        for _ in it:  # the stage's other tensor-parallel ranks gather with this one
            pass
        io_loop.close(join_timeout_s=5.0)
    res.seconds = time.perf_counter() - t0
    return res


def _first(plan) -> int:
    """The first bucket's size: a quarter of the others. Nothing overlaps its packing (the engines
    wait for it), so a small one starts their loads sooner (``tools/benchmarks/weight_sync.py
    --colocated``: push by push median +0.03-0.07 of the copy with 128 MiB buckets)."""
    return max(plan.bucket_bytes // 4, 1)


def _wait(posted: list[_InFlight], keep: int, phases: Phases) -> None:
    """Wait, oldest first, until at most ``keep`` of the posted buckets are unanswered (a bucket
    leaves ``posted`` once answered; on an error it stays there, to be drained)."""
    while len(posted) > keep:
        posted[0].wait(phases)
        posted.pop(0)


def _drain(pending: _InFlight) -> None:
    """After a failure, wait (bounded) for a bucket still posted: an engine may be reading it."""
    if pending.future is not None:
        try:
            pending.wait(Phases())
        except BaseException:  # noqa: BLE001 - the first error is the one reported
            pass


# ------------------------------------------------------------------------ every rank of the node
def _bucket_meta(bucket: list) -> tuple:
    """What the other ranks need to receive a bucket: (name, shape, dtype, byte offset) each, and its size."""
    metas, size = bucket_layout(bucket)
    return tuple((m.name, tuple(m.shape), str(m.dtype).replace("torch.", ""), m.start_idx) for m in metas), size


def _metas(meta: tuple) -> list[FlattenedTensorMetadata]:
    out = []
    for name, shape, dtype, start in meta:
        dt = getattr(torch, dtype)
        n = torch.Size(shape).numel() * dt.itemsize
        out.append(FlattenedTensorMetadata(name, torch.Size(shape), dt, start, start + n, n))
    return out


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _global(group, group_rank: int) -> int:
    import torch.distributed as dist

    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def exchange_colocated(plan: ColocatedPlan, weights: Iterable[tuple[str, torch.Tensor]], *, stage: int,
                       sender: bool, group=None) -> Optional[StageResult]:
    """Every rank of the push's group (one node): each engine rank gets its bucket from the trainer
    rank on its own GPU (``plan.servers``, group ranks).

    Stage by stage, each bucket of the stage's sender is broadcast over ``group`` into every rank's
    memory on its own device (:func:`_exchange_bucket`); the stage's other ranks cut their own
    tensors into the same buckets in step (their tensor-parallel gathers go with the sender's).
    Rank 0 posts bucket ``k`` before it waits for bucket ``k - 1``'s answers, so the engines load
    ``k - 1`` while ``k`` is packed, broadcast and gathered (as :func:`run_colocated_stage`).
    Returns this rank's :class:`StageResult` when it is a sender, else None; never raises (errors
    are in the results, rank 0's ``finish`` raises them)."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    roles: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(roles, (stage, sender), group=group)
    res = StageResult(stage)
    it = iter(weights)
    if plan.fp8:  # every rank of the stage: the same sizes, so the same buckets as the sender's
        it = quantize_named(it, block=plan.fp8_block, skipped=res.skipped)
    t0 = time.perf_counter()
    io_loop = BackgroundLoop("colocated-exchange") if rank == 0 else None
    try:
        for p in range(plan.n_stages):
            _exchange_stage(plan, p, roles.index((p, True)), it if p == stage else None, res, rank, io_loop, group)
    except BaseException as e:  # noqa: BLE001 - reported in the result, raised by the controller
        res.error = res.error or f"stage {stage}: {describe(e)}"
    finally:
        for _ in it:  # the stage's other tensor-parallel ranks gather with this one
            pass
        if io_loop is not None:
            io_loop.close(join_timeout_s=5.0)
    res.seconds = time.perf_counter() - t0
    return res if sender else None


def _exchange_stage(plan: ColocatedPlan, p: int, src: int, it, res: StageResult, rank: int, io_loop, group) -> None:
    """Stage ``p``'s buckets, from group rank ``src``; ``it``: this rank's tensors when it is one of
    the stage's ranks. The sender stops after its first failed bucket (``res.error``)."""
    import torch.distributed as dist

    buckets = split_buckets(it, plan.bucket_bytes, _first(plan)) if it is not None else iter(())
    nxt, k, prev = next(buckets, None), 0, None

    def note(err: str) -> None:
        if rank == src:
            res.error = res.error or err
    while True:
        bucket, nxt = nxt, (next(buckets, None) if nxt is not None else None)
        ok = rank != src or (bucket is not None and not res.error)
        meta = [(_bucket_meta(bucket), p == plan.n_stages - 1 and nxt is None) if rank == src and ok else None]
        dist.broadcast_object_list(meta, src=_global(group, src), group=group)
        if meta[0] is None:
            break
        cur = _exchange_bucket(plan, p, k, bucket if rank == src else None, meta[0], src, rank, group)
        if meta[0][1]:  # the last bucket (the version): after every other one has answered
            note(_settle(prev, plan, group))
            prev = None
        cur.post(io_loop, plan)
        note(_settle(prev, plan, group))
        prev, k = cur, k + 1
        if rank == src:
            res.bytes += meta[0][0][1]
            res.n_tensors += len(meta[0][0][0])
    note(_settle(prev, plan, group))


@dataclass
class _Held:
    """A bucket every rank holds until rank 0 has heard every engine on it; rank 0 also holds the
    payloads, then the answers' future."""

    flat: torch.Tensor
    stage: int
    final: bool
    what: str = ""
    payloads: Optional[dict] = None
    future: object = None

    def post(self, io_loop, plan: ColocatedPlan) -> None:
        if self.payloads is None:  # not rank 0
            return
        self.future = io_loop.submit(each_engine(plan.urls, lambda c: c.update_weights_from_tensor(
            self.payloads[c.base_url], load_format="flattened_bucket", flush_cache=self.final and plan.flush_last,
            weight_version=str(plan.version) if self.final else None, timeout_s=plan.timeout_s), self.what,
            plan.timeout_s))


def _settle(held: Optional[_Held], plan: ColocatedPlan, group) -> str:
    """Rank 0 waits for every engine's answer on ``held``; every rank hears the outcome and gives
    the bucket back for reuse when all loaded it. Returns the error ("" when loaded)."""
    import torch.distributed as dist

    if held is None:
        return ""
    out = [""]
    if held.future is not None:
        try:
            held.future.result(plan.timeout_s + 30)
        except TimeoutError:
            out[0] = f"stage {held.stage}: {held.what}: engines {plan.urls} did not answer within {plan.timeout_s:.0f}s"
        except BaseException as e:  # noqa: BLE001 - every rank hears of it
            out[0] = f"stage {held.stage}: {describe(e)}"
    dist.broadcast_object_list(out, src=_global(group, 0), group=group)
    if not out[0]:
        HOST_BUCKETS.give_back(held.flat)
    return out[0]


def _exchange_bucket(plan: ColocatedPlan, p: int, k: int, bucket: Optional[list], meta: tuple, src: int, rank: int,
                     group) -> _Held:
    """One bucket: broadcast from ``src`` into every rank's memory, each serving rank's payloads to
    rank 0 (which :meth:`_Held.post` s them to every engine)."""
    import torch.distributed as dist

    (named_meta, size), final = meta
    if bucket is not None:
        flat = pack_bucket(bucket, pool=HOST_BUCKETS, capacity=plan.bucket_bytes)[0]
    else:
        flat = HOST_BUCKETS.lease(size, _device(), plan.bucket_bytes)
    dist.broadcast(flat, src=_global(group, src), group=group)
    metas = _metas(named_meta)
    mine = {(i, j): serialize_bucket(flat, metas)
            for i, ranks in enumerate(plan.servers) for j, r in enumerate(ranks) if r == rank}
    gathered: Optional[list] = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(mine, gathered, dst=_global(group, 0), group=group)
    held = _Held(flat, p, final)
    if rank == 0:
        payloads = {key: v for d in gathered for key, v in d.items()}
        held.payloads = {u: [payloads[(i, j)] for j in range(tp)]
                         for i, (u, tp) in enumerate(zip(plan.urls, plan.engine_tp))}
        held.what = (f"update_weights_from_tensor of stage {p} bucket {k} ({len(metas)} tensors, "
                     f"{size / 2**20:.3g} MiB, {metas[0].name} .. {metas[-1].name})")
    return held


class ColocatedWeightSync(SessionWeightSync):
    """Hand each stage's buckets to the engines of this node through memory handles (module docstring).

    ``bucket_mb``: the most bytes one bucket (one extra copy on the sender) holds.
    """

    def __init__(self, engine_urls: list[str], *, bucket_mb: float = 512.0, timeout_s: float = 300.0,
                 pause_mode: Optional[str] = "retract", flush_cache: Optional[bool] = None, fp8: bool = False,
                 fp8_block: tuple[int, int] = DEFAULT_BLOCK,
                 servers: Optional[dict[str, Sequence[int]]] = None) -> None:
        super().__init__(engine_urls, timeout_s=timeout_s, pause_mode=pause_mode, flush_cache=flush_cache,
                         fp8=fp8, fp8_block=fp8_block)
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb={bucket_mb}: must be > 0")
        self.bucket_bytes = int(bucket_mb * 2**20)
        # url -> the trainer rank serving each of its TP ranks (colocated_assignment); absent: rank 0
        # (CPU workers: host memory, any local process opens it).
        self.servers = {u.rstrip("/"): tuple(r) for u, r in (servers or {}).items()}

    def _engine_tp(self, urls) -> tuple[int, ...]:
        """Each engine's TP size (payloads per bucket); an engine with data-parallel replicas is
        refused as SGLang 0.5.23 refuses it (``tokenizer_control_mixin.py``: ``dp_size == 1`` asserted)."""
        infos = self._each(urls, lambda c: c.get_server_info(), "get_server_info")
        dp = [(u, int(i.get("dp_size", 1) or 1)) for u, i in zip(urls, infos)]
        if any(n != 1 for _, n in dp):
            raise WeightSyncError(f"colocated weights: engines {[u for u, n in dp if n != 1]} run data-parallel "
                                  "replicas (dp_size > 1), which SGLang 0.5.23's update_weights_from_tensor refuses: "
                                  "launch one engine per replica")
        return tuple(int(i.get("tp_size", 1) or 1) for i in infos)

    def _servers(self, urls, engine_tp) -> tuple[tuple[int, ...], ...]:
        out = []
        for url, tp in zip(urls, engine_tp):
            ranks = self.servers.get(url, (0,) * tp)
            if len(ranks) != tp:
                raise WeightSyncError(f"colocated weights: engine {url} has {tp} TP rank(s) but {len(ranks)} trainer "
                                      f"rank(s) {list(ranks)} were assigned to serve it")
            out.append(tuple(ranks))
        return tuple(out)

    def begin(self, version: int, n_stages: int, engine_urls: Optional[list[str]] = None) -> ColocatedPlan:
        self._t0 = time.perf_counter()
        urls = self._urls(engine_urls)
        plan = ColocatedPlan("colocated", int(version), urls, n_stages, self.timeout_s, fp8=self.fp8,
                             fp8_block=self.fp8_block, bucket_bytes=self.bucket_bytes, flush_last=self._may_flush)

        def prepare() -> None:  # asks the engines: inside the session's error handling
            plan.engine_tp = self._engine_tp(urls)
            plan.servers = self._servers(urls, plan.engine_tp)
        return self._open_session(plan, prepare)

    def _from_dir(self, path: str, plan: PushPlan):
        if is_fp8_config(read_hf_config(path)):
            plan.fp8 = False  # already quantised
        return iter_safetensors(path)

    def push(self, weights, version: int, engine_urls: Optional[list[str]] = None) -> SyncStats:
        """The whole push from this process (one stage)."""
        plan = self.begin(version, 1, engine_urls)
        if isinstance(weights, (str, os.PathLike)):
            weights = self._from_dir(str(weights), plan)
        return self.finish(plan, [run_colocated_stage(plan, 0, weights)])
