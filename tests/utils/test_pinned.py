"""utils/pinned.py: host buffers page-locked at exactly their size, unlocked when the last tensor
over them is gone. CUDA is absent here, so the runtime is a recorder with the two calls of
``torch.cuda.cudart()`` the module uses; what is proven is the module's own logic (the exact size,
the lifetime of a registration through views and storages, the error that names what to check),
which is the part torch's pinned allocator got wrong for us (power-of-two rounding)."""

from __future__ import annotations

import gc

import pytest
import torch

from megatron_m2po.utils import pinned


class _Runtime:
    def __init__(self, fail: bool = False) -> None:
        self.live: dict[int, int] = {}
        self.fail = fail

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        if self.fail:
            return 2  # cudaErrorMemoryAllocation
        assert ptr not in self.live and flags == 0
        self.live[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        del self.live[ptr]
        return 0


def test_registered_at_exactly_its_size_and_released_with_the_last_view():
    rt = _Runtime()
    n = 70 * 2**20 + 12  # a 32B model's MLP shard: torch's pinned allocator would lock 128 MiB
    buf = pinned.host_empty(n, pin=True, cudart=rt)
    assert buf.dtype == torch.uint8 and buf.numel() == n
    assert rt.live == {buf.data_ptr(): n} and pinned.pinned_bytes() == n
    view = buf[1024:2048].view(torch.bfloat16)
    del buf
    gc.collect()
    assert list(rt.live.values()) == [n]  # a view still reads the memory: still locked
    view.fill_(1.0)
    del view
    gc.collect()
    assert rt.live == {} and pinned.pinned_bytes() == 0
    # host_like: the shape and dtype of a device tensor, its exact bytes
    t = torch.empty(3, 5, dtype=torch.bfloat16)
    h = pinned.host_like(t, pin=True, cudart=rt)
    assert h.shape == t.shape and h.dtype == t.dtype and list(rt.live.values()) == [30]
    del h
    gc.collect()
    assert rt.live == {}


def test_unpinned_buffers_touch_no_runtime_and_a_failed_lock_says_what_to_check():
    assert pinned.host_empty(10, pin=False, cudart=object()).numel() == 10
    with pytest.raises(RuntimeError, match="ulimit -l.*m2po plan"):
        pinned.host_empty(2**30, pin=True, cudart=_Runtime(fail=True))
    assert pinned.pinned_bytes() == 0
