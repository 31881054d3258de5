"""The collective audit counts what each collective stages on the accelerator (standins/collective_audit.py).

On NCCL torch's object collectives pickle into tensors on the GPU (``distributed_c10d.py``
``_get_object_coll_device``); on gloo they stay in host memory, so only the audit's count shows a
CPU run what a GPU run would hold. Expected values are written out from torch's code for objects
of known pickled sizes, per rank.
"""

from __future__ import annotations

import pytest

from megatron_m2po.standins.dist_testing import run_distributed

WORLD = 3


def _obj(nbytes: int):
    return b"x" * nbytes


def _peaks(rank, world_size):
    import torch
    import torch.distributed as dist

    from megatron_m2po.standins import collective_audit as audit

    audit.install()
    size = {n: audit.pickled_size(_obj(n)) for n in (1000, 5000, 20000)}
    out = {}

    def measure(name, fn):
        audit.reset_staging()
        fn()
        out[name] = audit.staging_peak()

    parts = [_obj(1000), _obj(20000), _obj(5000)]
    got = [None]
    measure("scatter", lambda: dist.scatter_object_list(got, parts if rank == 0 else None, src=0))
    assert got[0] == parts[rank]
    box = [_obj(5000), _obj(1000)] if rank == 1 else [None, None]
    measure("broadcast", lambda: dist.broadcast_object_list(box, src=1))
    gathered = [None] * world_size
    measure("all_gather", lambda: dist.all_gather_object(gathered, parts[rank]))
    measure("gather", lambda: dist.gather_object(parts[rank], gathered if rank == 2 else None, dst=2))
    if rank < 2:
        pair = [_obj(5000)] if rank == 0 else [None]
        measure("p2p", lambda: (dist.send_object_list if rank == 0 else dist.recv_object_list)(pair, 1 - rank))
    host = dist.new_group(list(range(world_size)), backend="gloo")  # gloo on GPUs too: nothing on the accelerator
    measure("host_group", lambda: dist.broadcast_object_list([_obj(5000)], src=0, group=host))
    measure("tensor", lambda: dist.all_reduce(torch.zeros(1000, dtype=torch.float32, device="cpu")))
    return {k: (v.bytes, v.call) for k, v in out.items()}, size


@pytest.mark.multiproc
def test_object_collectives_are_counted_as_torch_stages_them_on_nccl():
    out = run_distributed(_peaks, WORLD, timeout_s=120)
    size = out[0][1]
    small, mid, big = size[1000], size[5000], size[20000]
    peaks = [o[0] for o in out]
    # scatter from rank 0: world tensors padded to the largest, its own receive buffer, the sizes
    assert peaks[0]["scatter"] == (WORLD * big + big + 8 * WORLD + 8, "scatter_object_list")
    assert peaks[1]["scatter"][0] == peaks[2]["scatter"][0] == big + 16   # every receiver: the largest
    # broadcast of two objects from rank 1: the objects, their sizes, both concatenated
    assert peaks[1]["broadcast"][0] == 2 * (mid + small) + 32
    assert peaks[0]["broadcast"][0] == peaks[2]["broadcast"][0] == mid + small + 16
    assert all(p["all_gather"][0] == (WORLD + 1) * big + 8 * WORLD + 8 for p in peaks)
    assert peaks[2]["gather"][0] == big + 8 * WORLD + 8 + WORLD * big
    assert peaks[0]["gather"][0] == peaks[1]["gather"][0] == big + 8 * WORLD + 8
    assert peaks[0]["p2p"] == (mid + 16, "send_object_list") and peaks[1]["p2p"] == (mid + 8, "recv_object_list")
    assert all(p["host_group"][0] == 0 for p in peaks)
    assert all(p["tensor"] == (4000, "all_reduce") for p in peaks)


def test_staging_rules_by_hand():
    from megatron_m2po.standins.collective_audit import object_staging_bytes as rule

    assert rule("scatter_object_list", [10, 30, 20, 5], world=4, me=0, root=0) == 4 * 30 + 30 + 32 + 8
    assert rule("scatter_object_list", [10, 30, 20, 5], world=4, me=3, root=0) == 30 + 16
    assert rule("broadcast_object_list", [7], world=4, me=0, root=0) == 7 + 16   # one object: no concatenation
    assert rule("recv_object_list", [7, 3], world=2, me=1) == 10 + 16
    with pytest.raises(ValueError, match="no staging rule"):
        rule("reduce_scatter_object", [1], world=2, me=0)
