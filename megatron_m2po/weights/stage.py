"""The stage side of a weight push: every pipeline stage sends (or writes) its own layers.

A push is planned by the transport on trainer rank 0 (:mod:`megatron_m2po.weights.disk`,
:mod:`megatron_m2po.weights.distributed`: pause, session, group names, directories) as a :class:`PushPlan`; each stage's sender (its
tensor-parallel rank 0 of data-parallel replica 0) runs :func:`run_stage` on the stage's own
HF-named tensors and returns a :class:`StageResult`; the controller finishes the push with every
stage's result. :func:`push_from_stages` is that whole exchange over the default process group
(every rank calls it); a single process is the one-stage case.

Distributed (``/update_weights_from_distributed``). Stage ``p`` has its own weight-update group
``plan.groups[p]`` with every engine rank (its sender is group rank 0, engine ``i`` joins at
``plan.offsets[i]``), built as SGLang 0.5.23 builds its end (``parallel/side_group.py``). SGLang runs
one weight-update request at a time per engine (the tokenizer manager holds ``is_pause_cond`` or
``model_update_lock`` around each) and its ``init_custom_process_group`` and broadcasts block, so two
engines that served two stages' requests in different orders would each wait inside a collective
the other has not joined (an NCCL ring relays through every member). The stages therefore take
turns on the engines in stage order, through keys in the launcher's store: stage ``p`` waits for
``turn/p``, (re)builds its group if needed, sends its buckets, then sets ``turn/p+1``. While it
waits, a stage already gathers and converts its first buckets (``prefetch_bytes``), so the
tensor-parallel gathers and conversions of all stages run in parallel and only the wire transfer
is ordered. The last bucket of the last stage carries ``weight_version``: the engines report the new
version once every stage is in. A failed stage passes the turn on as failed; later stages skip
their sends. Every sender iterates its weights to the end whatever happens, because its stage's
other tensor-parallel ranks are gathering with it.

Disk. Stage ``p`` writes ``stage<p>-<j>.safetensors`` files of at most ``shard_bytes`` into
``plan.tmp_dir`` (never more than one shard in host memory); the controller renames them to
``model-0000k-of-0000n.safetensors``, writes ``model.safetensors.index.json`` and renames the
directory to ``v<version>`` once all exist.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import logging
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch

from megatron_m2po.parallel.side_group import broadcast, destroy_side_group, new_side_group
from megatron_m2po.rollout.client import SGLangClient
from megatron_m2po.utils.background_loop import BackgroundLoop
from megatron_m2po.utils.hf_dir import write_stage_shards
from megatron_m2po.utils.net import free_port
from megatron_m2po.weights.errors import NcclVersionMismatch, WeightSyncError, weight_sync_error
from megatron_m2po.weights.fp8 import quantize_named
from megatron_m2po.weights.nccl_handshake import check_group, mismatch_message, nccl_refusal_message

log = logging.getLogger(__name__)

__all__ = ["PushPlan", "StageResult", "run_stage", "push_from_stages", "each_engine", "forget_groups"]


@dataclass(slots=True)
class PushPlan:
    """One push, as every stage sender needs it (picklable: rank 0 makes it, every rank gets it)."""

    kind: str                       # "disk" | "distributed" | "colocated" (weights/colocated.py ColocatedPlan)
    version: int
    urls: tuple[str, ...]
    n_stages: int
    timeout_s: float
    push_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    fp8: bool = False
    fp8_block: tuple[int, int] = (128, 128)  # weight_block_size of the block-FP8 export (weights/fp8.py)
    # disk
    tmp_dir: str = ""
    shard_bytes: int = 0
    reuse_dir: str = ""             # a complete v<version> directory already exists: write nothing
    # distributed
    groups: tuple[str, ...] = ()    # the group of each stage
    world: int = 0
    offsets: tuple[int, ...] = ()   # engine i joins at offsets[i]
    backend: str = "gloo"
    device: str = "cpu"
    bucket_bytes: int = 0
    prefetch_bytes: int = 0
    flush_last: bool = False
    master_address: str = ""        # "" = each sender's own address toward the engines

    def exchange(self, weights: Iterable[tuple[str, torch.Tensor]], *, stage: int, sender: bool, group=None,
                 store=None) -> Optional["StageResult"]:
        """This rank's part of the push (every rank of the push's group calls it): the stage's sender
        runs it (:func:`run_stage`, returning its :class:`StageResult`); any other rank iterates its
        tensors only to take part in the gathers behind them and returns None. Never raises: a
        sender's failure is in its result. A transport every rank takes part in overrides it
        (``weights/colocated.py`` ``ColocatedPlan.exchange``)."""
        if sender:
            return run_stage(self, stage, weights, store)
        for _ in weights:
            pass
        return None


@dataclass(slots=True)
class StageResult:
    stage: int
    error: str = ""
    bytes: int = 0
    n_tensors: int = 0
    seconds: float = 0.0
    files: list = field(default_factory=list)      # disk: [(file name, [tensor names], bytes)]
    skipped: list = field(default_factory=list)    # fp8: decoder linears left unquantised


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def describe(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "no answer (timed out)"
    return f"{type(e).__name__}: {e}"


async def each_engine(urls, fn, what: str, timeout_s: float) -> list:
    """``fn(client)`` on every engine at once; a failure anywhere raises naming each engine that failed."""
    async def one(url):
        async with SGLangClient(url, max_retries=1, control_timeout_s=timeout_s) as c:
            return await asyncio.wait_for(fn(c), timeout_s)
    urls = list(urls)
    res = await asyncio.gather(*(one(u) for u in urls), return_exceptions=True)
    bad = [f"{u}: {describe(r)}" for u, r in zip(urls, res) if isinstance(r, BaseException)]
    if bad:
        raise WeightSyncError(f"{what} failed on {len(bad)}/{len(urls)} engine(s):\n  " + "\n  ".join(bad))
    return res


# Groups this process sends on, by name: they outlive a push (rebuilt when the controller renames them).
_GROUPS: dict[str, object] = {}


def _local_address(urls) -> str:
    """This host's address on the route to the first engine (no packet is sent)."""
    import os
    from urllib.parse import urlparse

    if os.environ.get("M2PO_WEIGHT_SYNC_ADDR"):
        return os.environ["M2PO_WEIGHT_SYNC_ADDR"]
    host = urlparse(urls[0]).hostname or "127.0.0.1"
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class _Turns:
    """Stage order on the engines through a key-value store (``turn/<p>`` = b"ok" or b"fail")."""

    def __init__(self, store, push_id: str, timeout_s: float) -> None:
        import torch.distributed as dist

        self.store = dist.PrefixStore(f"m2po/weight_push/{push_id}", store)
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def ready(self, stage: int) -> bool:
        return stage == 0 or self.store.check([f"turn/{stage}"])

    def wait(self, stage: int) -> bool:
        """True when the previous stages succeeded. Each earlier stage bounds its own sends (every
        bucket within the timeout) and passes the turn on even when it fails; this wait only guards
        against a sender that vanished, so it allows each earlier stage several timeouts."""
        if stage == 0:
            return True
        self.store.wait([f"turn/{stage}"], self.timeout * (4 * stage))
        return self.store.get(f"turn/{stage}") == b"ok"

    def passed(self, stage: int, ok: bool) -> None:
        self.store.set(f"turn/{stage + 1}", b"ok" if ok else b"fail")


def run_stage(plan: PushPlan, stage: int, weights: Iterable[tuple[str, torch.Tensor]], store=None) -> StageResult:
    """Send (distributed) or write (disk) stage ``stage``'s tensors; never raises (errors are in the
    result) and always iterates ``weights`` to the end. ``store``: the turn keys' store (one
    process: None)."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    res = StageResult(stage)
    it = iter(weights)
    if plan.fp8:
        it = quantize_named(it, block=plan.fp8_block, skipped=res.skipped)
    try:
        if plan.kind == "disk":
            _write_stage(plan, stage, it, res)
        else:
            _send_stage(plan, stage, it, res, store if store is not None else dist.HashStore())
    except BaseException as e:  # noqa: BLE001 - reported in the result, raised by the controller
        res.error = f"stage {stage}: {describe(e)}"
    finally:
        for _ in it:  # the stage's other tensor-parallel ranks gather with this one
            pass
    res.seconds = time.perf_counter() - t0
    return res


# ------------------------------------------------------------------------ disk
def _write_stage(plan: PushPlan, stage: int, it: Iterator, res: StageResult) -> None:
    if plan.reuse_dir:
        return

    def counted():
        for name, t in it:
            res.bytes += nbytes(t)
            res.n_tensors += 1
            yield name, t
    res.files = write_stage_shards(counted(), plan.tmp_dir, stage, plan.shard_bytes)


# ------------------------------------------------------------------------ distributed
def _send_stage(plan: PushPlan, stage: int, it: Iterator, res: StageResult, store) -> None:
    turns = _Turns(store, plan.push_id, plan.timeout_s)
    io = BackgroundLoop(f"weight-push-s{stage}")
    ok = False
    try:
        buckets: collections.deque = collections.deque()
        state = {"done": False, "ready": 0}

        def fill() -> None:
            """Gather + convert the next bucket (collective within the stage's tensor-parallel group)."""
            bucket, size = [], 0
            for name, t in it:
                t = t.detach()
                bucket.append((name, t))
                size += nbytes(t)
                if size >= plan.bucket_bytes:
                    break
            else:
                state["done"] = True
            if bucket:
                buckets.append((bucket, size))
                state["ready"] += size

        # Prepare ahead while an earlier stage holds the engines.
        while not state["done"] and state["ready"] < plan.prefetch_bytes and not turns.ready(stage):
            fill()
        if not turns.wait(stage):
            res.error = f"stage {stage}: skipped (an earlier stage failed)"
            return
        group = _ensure_group(plan, stage, io)
        last_stage = stage == plan.n_stages - 1
        while True:
            if not buckets and not state["done"]:
                fill()
            if not buckets:
                break
            if len(buckets) == 1 and not state["done"]:
                fill()  # look ahead: is this the stage's last bucket?
            bucket, size = buckets.popleft()
            state["ready"] -= size
            final = last_stage and not buckets and state["done"]
            _send_bucket(plan, group, plan.groups[stage], bucket, io, final)
            res.bytes += size
            res.n_tensors += len(bucket)
        ok = True
    finally:
        turns.passed(stage, ok and not res.error)
        io.close(join_timeout_s=5.0)


def _ensure_group(plan: PushPlan, stage: int, io: BackgroundLoop):
    name = plan.groups[stage]
    if name in _GROUPS:
        return _GROUPS[name]
    prefix, generation = _split(name)
    for old in [n for n in _GROUPS if _split(n)[0] == prefix and _split(n)[1] != generation]:
        destroy_side_group(_GROUPS.pop(old))  # an earlier generation of the same controller's groups
    addr = plan.master_address or _local_address(plan.urls)
    port = free_port(addr)
    fut = io.submit(each_engine(plan.urls, lambda c: c.init_weights_update_group(
        addr, port, plan.offsets[plan.urls.index(c.base_url)], plan.world, group_name=name,
        backend=plan.backend, timeout_s=plan.timeout_s), f"init_weights_update_group {name}", plan.timeout_s))
    try:
        pg = new_side_group(plan.backend, addr, port, rank=0, world_size=plan.world, group_name=name,
                            timeout_s=plan.timeout_s)
    except Exception as e:  # the engines' answers name the culprit better than the store error
        try:
            fut.result(plan.timeout_s + 10)
        except WeightSyncError as we:
            raise WeightSyncError(f"joining weight-sync group {name} failed: {we}") from e
        raise WeightSyncError(f"joining weight-sync group {name} ({addr}:{port}, world {plan.world}) "
                              f"failed: {e}") from e
    fut.result(plan.timeout_s + 10)
    # Every engine has joined (and stated its NCCL version where the plugin runs): compare before
    # the first collective, which NCCL would fail on every member.
    versions = check_group(pg, plan.backend, plan.urls, plan.offsets, plan.world)
    if versions.differ:
        destroy_side_group(pg)
        raise NcclVersionMismatch(mismatch_message(name, versions))
    if versions.unknown and name.rsplit("_s", 1)[-1] == "0":
        log.warning("weight-update group %s: engine(s) %s did not state their NCCL version (the m2po SGLang plugin "
                    "is not installed in their Python; docker/install.sh installs it): a different NCCL build would "
                    "only show as an NCCL error at the first broadcast", name,
                    ", ".join(sorted({u for u, _ in versions.unknown})))
    _GROUPS[name] = pg
    return pg


def _split(name: str) -> tuple[str, str]:
    """``<prefix><generation>_s<stage>`` -> (prefix, generation)."""
    head = name.rsplit("_s", 1)[0]
    gen = head.rsplit("_", 1)[-1]
    return head[:len(head) - len(gen)], gen


def _send_bucket(plan: PushPlan, pg, name: str, bucket: list, io: BackgroundLoop, final: bool) -> None:
    import concurrent.futures

    names = [n for n, _ in bucket]
    dtypes = [str(t.dtype).replace("torch.", "") for _, t in bucket]
    shapes = [list(t.shape) for _, t in bucket]
    version = str(plan.version) if final else None
    fut = io.submit(each_engine(plan.urls, lambda c: c.update_weights_from_distributed(
        names, dtypes, shapes, group_name=name, weight_version=version, load_format="flattened_bucket",
        flush_cache=final and plan.flush_last, timeout_s=plan.timeout_s),
        "update_weights_from_distributed", plan.timeout_s))
    # SGLang's FlattenedTensorBucket layout: the tensors' bytes back to back, one uint8 tensor.
    device = torch.device(plan.device)
    flat = torch.cat([t.to(device).contiguous().view(-1).view(torch.uint8) for _, t in bucket])
    try:
        broadcast(pg, flat, plan.timeout_s).wait(datetime.timedelta(seconds=plan.timeout_s))
    except Exception as e:
        _GROUPS.pop(name, None)  # a failed collective leaves the group unusable
        if "Mismatched NCCL version detected" in str(e):  # engines without the plugin: NCCL's own check
            try:
                fut.result(plan.timeout_s + 10)  # the engines fail the same communicator
            except Exception:  # noqa: BLE001 - their answer adds nothing to NCCL's
                pass
            raise NcclVersionMismatch(nccl_refusal_message(name, str(e))) from None
        try:
            fut.result(plan.timeout_s + 10)
        except (WeightSyncError, concurrent.futures.TimeoutError) as we:
            raise WeightSyncError(f"weight broadcast on {name} failed: {we}") from e
        raise WeightSyncError(f"weight broadcast on {name} to {list(plan.urls)} failed: {e}") from e
    try:
        fut.result(plan.timeout_s + 10)
    except concurrent.futures.TimeoutError:
        _GROUPS.pop(name, None)
        raise WeightSyncError(f"engines {list(plan.urls)} did not confirm the weight update within "
                              f"{plan.timeout_s:.0f}s") from None
    except WeightSyncError:
        _GROUPS.pop(name, None)
        raise


def forget_groups(prefix: str) -> None:
    """Drop this process's sender groups named ``<prefix>...`` (the controller will rebuild them)."""
    for name in [n for n in _GROUPS if n.startswith(prefix)]:
        destroy_side_group(_GROUPS.pop(name))


# ------------------------------------------------------------------------ the collective
def push_from_stages(controller, weights: Iterable[tuple[str, torch.Tensor]], version: int, *, stage: int,
                     n_stages: int, sender: bool, group=None):
    """Every rank of the default group calls this; returns the controller's stats on rank 0 (else None).

    ``controller`` (rank 0 only; None elsewhere): ``begin(version, n_stages) -> PushPlan`` and
    ``finish(plan, [StageResult]) -> stats``. ``weights``: this rank's stage tensors (HF names,
    tensor-parallel shards gathered); ranks that are not their stage's ``sender`` iterate them
    only to take part in the gathers. Every rank raises the same :class:`WeightSyncError` when the
    push fails. Each rank's part is the plan's :meth:`PushPlan.exchange` (the colocated plan's
    hands every rank's copy to the engine ranks on its GPU).
    """
    import torch.distributed as dist

    rank = dist.get_rank(group)
    box: list = [None]
    if rank == 0:
        try:
            box[0] = controller.begin(version, n_stages)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            box[0] = str(e) if isinstance(e, WeightSyncError) else f"weight push of version {version} could not start: {describe(e)}"
    dist.broadcast_object_list(box, src=0, group=group)
    plan = box[0]
    if isinstance(plan, str):
        for _ in weights:
            pass
        raise weight_sync_error(plan)
    store = dist.distributed_c10d._get_default_store()
    result = plan.exchange(weights, stage=stage, sender=sender, group=group, store=store)
    results: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(results, result, group=group)
    results = sorted((r for r in results if r is not None), key=lambda r: r.stage)
    out: list = [None]
    stats = None
    if rank == 0:
        try:
            stats = controller.finish(plan, results)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            out[0] = str(e) if isinstance(e, WeightSyncError) else describe(e)
    dist.broadcast_object_list(out, src=0, group=group)
    if out[0] is not None:
        raise weight_sync_error(out[0])
    return stats
