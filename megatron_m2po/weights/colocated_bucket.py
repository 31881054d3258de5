"""The colocated transport's bucket: SGLang 0.5.23's flattened bucket, its pickled handles, and the
host memory it is packed into (``weights/colocated.py`` sends it; the format is described there).

Host (CPU) buckets live in shared memory that this process reuses (:class:`HostBuckets`): a fresh
shared-memory page costs a page fault at its first write, which made packing into fresh buckets
about 3x slower than a copy into touched memory (``tools/benchmarks/weight_sync.py --colocated``).
A bucket is leased for one hand-over and given back only once every engine has answered for it
(an engine may read it until then), so concurrent pushes never share a bucket; after a failure the
bucket is not given back (an engine that did not answer may still read it) and is freed when its
last reference goes. GPU buckets come from the caching allocator each time (nothing stays on the
GPU between pushes).
"""

from __future__ import annotations

import base64
import contextlib
import copyreg
import io
import os
import pickle
import threading
from typing import Iterable, Iterator, Optional, Sequence

import torch
from multiprocessing.reduction import ForkingPickler
from torch.multiprocessing import reductions

__all__ = ["FlattenedTensorMetadata", "HostBuckets", "HOST_BUCKETS", "SGLANG_META", "expandable_segments",
           "ipc_exportable", "pack_bucket",
           "serialize_bucket", "serialize_named_tensors", "split_buckets", "bucket_layout", "nbytes"]

SGLANG_META = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class FlattenedTensorMetadata:
    """SGLang's ``FlattenedTensorMetadata`` (``weight_sync/tensor_bucket.py``), pickled under its
    name there; ``numel`` and the indices count bytes of the flat uint8 tensor."""

    def __init__(self, name: str, shape: torch.Size, dtype: torch.dtype, start_idx: int, end_idx: int,
                 numel: int) -> None:
        self.name, self.shape, self.dtype = name, shape, dtype
        self.start_idx, self.end_idx, self.numel = start_idx, end_idx, numel


FlattenedTensorMetadata.__module__, FlattenedTensorMetadata.__qualname__ = SGLANG_META


def _reduce_tensor(t: torch.Tensor):
    """torch's ``reduce_tensor``, with the CUDA device named by UUID (``patch_torch.py``)."""
    fn, args = reductions.reduce_tensor(t)
    if fn is reductions.rebuild_cuda_tensor:
        i = 6  # patch_torch.py _REDUCE_TENSOR_ARG_DEVICE_INDEX
        args = (*args[:i], str(torch.cuda.get_device_properties(args[i]).uuid), *args[i + 1:])
    return fn, args


def _reduce_storage(storage):
    """torch's ``reduce_storage`` under the ``file_system`` strategy whatever the process's setting
    (``torch/multiprocessing/reductions.py``): a shared-memory file any local process can open."""
    if storage.device.type != "cpu":
        return reductions.reduce_storage(storage)
    if storage.data_ptr() in _FROM_EXPANDABLE:
        return rebuild_expandable_segment, (os.getpid(), storage.nbytes())
    metadata = storage._share_filename_cpu_()
    storage._shared_incref()
    reductions.shared_cache[metadata[1]] = reductions.StorageWeakRef(storage)
    return reductions.rebuild_storage_filename, (type(storage),) + metadata


_TABLE: dict = {}


def _dispatch_table() -> dict:
    """``ForkingPickler``'s reducers (torch's, registered by ``init_reductions``) with ours."""
    if not _TABLE:
        reductions.init_reductions()
        table = copyreg.dispatch_table.copy()
        table.update(ForkingPickler._extra_reducers)
        for cls in torch._tensor_classes:
            table[cls] = _reduce_tensor
        table[torch.Tensor] = table[torch.nn.Parameter] = _reduce_tensor
        table[torch.UntypedStorage] = _reduce_storage
        _TABLE.update(table)
    return _TABLE


class _Pickler(pickle._Pickler):
    """``ForkingPickler``'s reductions (torch's included) with the two above, writing SGLang's
    metadata class by name (the pure-Python pickler lets :meth:`save_global` skip the import)."""

    def __init__(self, buf) -> None:
        super().__init__(buf, protocol=pickle.DEFAULT_PROTOCOL)
        self.dispatch_table = _dispatch_table()

    def save_global(self, obj, name=None):
        if obj is not FlattenedTensorMetadata:
            return super().save_global(obj, name)
        module, qualname = SGLANG_META
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


def serialize_bucket(flat: torch.Tensor, metadata: list[FlattenedTensorMetadata]) -> str:
    """``MultiprocessingSerializer.serialize({"flattened_tensor", "metadata"}, output_str=True)``."""
    buf = io.BytesIO()
    _Pickler(buf).dump({"flattened_tensor": flat, "metadata": metadata})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """``MultiprocessingSerializer.serialize({name: tensor}, output_str=True)``, CPU tensors as
    shared-memory files: what ``/load_lora_adapter_from_tensors`` takes per TP rank (0.5.23
    ``tp_worker.py`` deserializes a ``Dict[str, Tensor]``); the caller keeps the tensors alive until
    the engine answered."""
    buf = io.BytesIO()
    _Pickler(buf).dump({n: t for n, t in named})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _allocator_settings() -> dict[str, str]:
    """The caching allocator's settings now (``PYTORCH_CUDA_ALLOC_CONF`` as changed at run time)."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    text = get() if get is not None else os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    out = {}
    for item in text.split(","):
        if ":" in item:
            k, v = item.split(":", 1)
            out[k.strip()] = v.strip()
    return out


def expandable_segments() -> bool:
    """Whether new allocations come from expandable segments (``scripts/train.sh`` turns them on)."""
    return _allocator_settings().get("expandable_segments", "False").lower() == "true"


@contextlib.contextmanager
def ipc_exportable():
    """Allocations in this block are memory CUDA IPC exports without ptrace rights.

    Memory from expandable segments is shared as a POSIX file descriptor that the receiving
    process takes with ``pidfd_getfd`` (torch ``CUDACachingAllocator.cpp``,
    ``ExpandableSegment::share`` / ``fromShared``), which needs ptrace rights over the trainer:
    absent under Ubuntu's default Yama setting and in a container without ``CAP_SYS_PTRACE``, so an
    engine could not open the first bucket. A bucket is therefore allocated with expandable
    segments off (a classic ``cudaMalloc`` block, opened by ``cudaIpcOpenMemHandle``), and the
    setting is restored for everything else (what verl does around its colocated update).
    """
    if not expandable_segments():
        yield
        return
    torch._C._accelerator_setAllocatorSettings("expandable_segments:False")
    try:
        yield
    finally:
        torch._C._accelerator_setAllocatorSettings("expandable_segments:True")


# CPU stand-in of the failure above: shared-memory buckets allocated while expandable segments were on
# (by data pointer); the engines cannot open them, as on GPUs (:func:`_reduce_storage`)
_FROM_EXPANDABLE: set[int] = set()


def _empty_flat(n: int, device: torch.device) -> torch.Tensor:
    with ipc_exportable():
        if device.type == "cpu":  # born in shared memory: handing it over copies nothing more
            # Made on ``device`` (the trainer's; the CPU platform's stand-in for a GPU): the bucket is
            # broadcast on a group that is NCCL on GPUs, where only device tensors may go.
            shm = torch.UntypedStorage._new_using_filename_cpu(max(n, 1))
            (_FROM_EXPANDABLE.add if expandable_segments() else _FROM_EXPANDABLE.discard)(shm.data_ptr())
            return torch.empty(0, dtype=torch.uint8, device=device).set_(shm)[:n]
        return torch.empty(n, dtype=torch.uint8, device=device)


def rebuild_expandable_segment(pid: int, nbytes: int):
    """What an engine meets when it opens memory from the trainer's expandable segments without
    ptrace rights over it (the CPU stand-in of ``pidfd_getfd`` failing with EPERM)."""
    raise RuntimeError(f"pidfd_getfd: Operation not permitted: the weight bucket ({nbytes} bytes) of process {pid} "
                       "comes from expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), which "
                       "CUDA IPC shares as a file descriptor this process may only take with ptrace rights over "
                       "the trainer")


class HostBuckets:
    """This process's reusable shared-memory buckets (module docstring). :meth:`lease` a bucket,
    :meth:`give_back` it once every engine has answered for it; at most ``keep`` free ones are kept
    (the largest). Thread-safe: pushes may run side by side."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def lease(self, n: int, device: torch.device, capacity: int = 0) -> torch.Tensor:
        """``n`` bytes, a free bucket's when one is large enough; a new one holds at least
        ``capacity`` bytes (the bucket size: virtual until written, so a later larger bucket
        reuses it). Not host memory: a fresh device tensor."""
        if device.type != "cpu":
            return _empty_flat(n, device)
        with self._lock:
            fits = [b for b in self._free if b.numel() >= n]
            if fits:
                buf = min(fits, key=lambda b: b.numel())
                self._free = [b for b in self._free if b is not buf]
                return buf[:n]
        return _empty_flat(max(n, capacity), device)[:n]

    def give_back(self, flat: Optional[torch.Tensor]) -> None:
        """``flat`` (a leased bucket) may be rewritten: every engine has answered for it."""
        if flat is None or flat.device.type != "cpu":
            return
        # on the bucket's device, named: a reused bucket is the device tensor it was when leased
        whole = torch.empty(0, dtype=torch.uint8, device=flat.device).set_(flat.untyped_storage())
        with self._lock:
            if not any(b.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr() for b in self._free):
                self._free = sorted(self._free + [whole], key=lambda b: -b.numel())[:self.keep]

    def clear(self) -> None:
        with self._lock:
            self._free = []


HOST_BUCKETS = HostBuckets()


def bucket_layout(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[FlattenedTensorMetadata], int]:
    """Each tensor's metadata in the bucket (starting at a multiple of its element size) and the
    bucket's size in bytes."""
    metas, offset = [], 0
    for name, t in named:
        offset = -(-offset // t.element_size()) * t.element_size()
        metas.append(FlattenedTensorMetadata(name, t.shape, t.dtype, offset, offset + nbytes(t), nbytes(t)))
        offset += nbytes(t)
    return metas, offset


def pack_bucket(named: Sequence[tuple[str, torch.Tensor]], device: Optional[torch.device] = None, *,
                pool: Optional[HostBuckets] = None, capacity: int = 0,
                ) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """One flat uint8 tensor on ``device`` (default: the first tensor's; CPU ones in shared memory)
    and its metadata. With ``pool`` the host bucket is leased from it (give it back when every
    engine has answered); ``capacity``: see :meth:`HostBuckets.lease`."""
    if not named:
        raise ValueError("cannot pack an empty bucket")
    device = torch.device(device) if device is not None else named[0][1].device
    metas, size = bucket_layout(named)
    flat = pool.lease(size, device, capacity) if pool is not None else _empty_flat(size, device)
    for m, (_, t) in zip(metas, named):
        # straight from the tensor when it is contiguous (a view, no copy); else torch's strided copy
        src = t.detach()
        dst = flat[m.start_idx:m.end_idx]
        if src.is_contiguous():
            dst.copy_(src.reshape(-1).view(torch.uint8))
        else:
            dst.view(t.dtype).view(t.shape).copy_(src)
    return flat, metas


def split_buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                  first_bytes: Optional[int] = None) -> Iterator[list]:
    """Lists of ``(name, tensor)`` of at most ``bucket_bytes`` (a larger tensor goes alone); the
    first of at most ``first_bytes`` (default ``bucket_bytes``)."""
    bucket, size, limit = [], 0, first_bytes or bucket_bytes
    for name, t in weights:
        n = nbytes(t) + t.element_size()  # with its worst alignment gap
        if bucket and size + n > limit:
            yield bucket
            bucket, size, limit = [], 0, bucket_bytes
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


