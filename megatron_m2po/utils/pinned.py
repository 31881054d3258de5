"""Host buffers for the device <-> host copies, page-locked at exactly their size.

torch's pinned allocator (``pin_memory=True``, ``Tensor.pin_memory()``: ATen's
``CachingHostAllocator``) rounds every allocation up to the next power of two and keeps the
block cached (torch 2.13 and 2.14.1, ``ATen/core/CachingHostAllocator.h`` ``allocate``:
``c10::llvm::PowerOf2Ceil(size)`` unless the size is above ``pinned_max_round_threshold_mb``,
which is unset by default). One pinned copy per tensor wastes up to half of each (a 70 MB shard of
a 32B model's MLP weight pins 128 MB), and one buffer for everything can double the total (40 GB
pins 64 GB): on a node of eight trainer processes that is hundreds of GB of locked memory that
the planner would not see.

:func:`host_empty` takes ordinary host memory of the exact size (a NumPy array) and page-locks it
in place with ``cudaHostRegister`` (``torch.cuda.cudart()``, the CUDA runtime's call for memory
allocated elsewhere); ``cudaHostUnregister`` runs when the last tensor over the memory is gone
(a finalizer on the array, which the tensor's storage holds; NumPy clears weak references before
it frees the data). Copies from and to it are asynchronous like any pinned memory: torch's
``is_pinned`` asks the driver (``cudaPointerGetAttributes`` reports registered memory as host
memory the device can reach). Off CUDA -- the CPU build -- the buffer is plain host memory and
nothing is pinned. ``plan/host.py`` counts these buffers at their exact size.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import numpy as np
import torch

__all__ = ["host_empty", "host_like", "pinned_bytes"]

_registered: dict[int, int] = {}  # data pointer -> bytes, of the buffers registered now (this process)


def pinned_bytes() -> int:
    """Bytes this process has page-locked through :func:`host_empty` and not yet released."""
    return sum(_registered.values())


def _check(err: Any, what: str, nbytes: int) -> None:
    code = int(getattr(err, "value", err))
    if code != 0:
        raise RuntimeError(
            f"{what} of {nbytes / 2**30:.2f} GiB of host memory failed (CUDA error {code}, {err}): the node may "
            f"be out of lockable memory; check `ulimit -l` (unlimited in docker/README.md's run line) and the "
            f"node's RAM against `m2po plan`'s host-memory line")


def host_empty(nbytes: int, *, pin: bool, cudart: Optional[Any] = None) -> torch.Tensor:
    """A uint8 host tensor of exactly ``nbytes``, page-locked when ``pin`` (module docstring).

    ``cudart`` is the CUDA runtime module (default ``torch.cuda.cudart()``)."""
    arr = np.empty(int(nbytes), dtype=np.uint8)
    buf = torch.from_numpy(arr)
    if pin and nbytes > 0:
        rt = cudart if cudart is not None else torch.cuda.cudart()
        ptr = arr.ctypes.data
        _check(rt.cudaHostRegister(ptr, int(nbytes), 0), "cudaHostRegister", nbytes)
        _registered[ptr] = int(nbytes)
        weakref.finalize(arr, _unregister, rt, ptr)
    return buf


def _unregister(rt: Any, ptr: int) -> None:
    nbytes = _registered.pop(ptr, 0)
    _check(rt.cudaHostUnregister(ptr), "cudaHostUnregister", nbytes)


def host_like(t: torch.Tensor, *, pin: bool, cudart: Optional[Any] = None) -> torch.Tensor:
    """An uninitialised host tensor of ``t``'s shape and dtype, from :func:`host_empty`."""
    n = t.numel() * t.element_size()
    return host_empty(n, pin=pin, cudart=cudart).view(t.dtype).view(t.shape)
