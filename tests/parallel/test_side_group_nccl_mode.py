"""The weight-update group's NCCL error handling: built under TORCH_NCCL_ASYNC_ERROR_HANDLING=2.

torch 2.13 reads the variable once per ``ProcessGroupNCCL``, in its constructor (called by
``_new_process_group_helper``); modes 1 (what scripts/train.sh and torchrun set) and 3 (torch's
default) make the group's watchdog end the whole process when a collective fails or times out, so
the trainer's "engine died mid-push -> relaunch -> push again" would never run on GPUs. NCCL cannot
be built here (CPU torch), so the test records the environment the constructor would read: the
helper is replaced by one that records it.
"""

from __future__ import annotations

import pytest
import torch.distributed.distributed_c10d as c10d

from megatron_m2po.parallel import side_group
from megatron_m2po.utils.net import free_port

VAR = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


@pytest.fixture
def recorded(monkeypatch):
    seen: list = []

    def helper(world_size, rank, ranks, backend, store, **kw):
        import os
        seen.append((str(backend), os.environ.get(VAR)))
        return object(), None

    monkeypatch.setattr(c10d, "_new_process_group_helper", helper)
    yield seen
    for pg in [k for k in c10d._world.pg_group_ranks if type(k) is object]:
        del c10d._world.pg_group_ranks[pg]


@pytest.mark.parametrize("process_value", ["1", "3", None])
def test_nccl_weight_group_is_built_under_cleanup_only(monkeypatch, recorded, process_value):
    if process_value is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, process_value)
    side_group.new_side_group("nccl", "127.0.0.1", free_port(), rank=0, world_size=1, group_name="w_nccl",
                              timeout_s=5)
    import os
    assert recorded == [("nccl", "2")], f"the NCCL weight group was built under {VAR}={recorded[0][1]}"
    assert os.environ.get(VAR) == process_value  # the training groups' mode is left as it was


def test_gloo_group_keeps_the_process_mode(monkeypatch, recorded):
    monkeypatch.setenv(VAR, "1")
    side_group.new_side_group("gloo", "127.0.0.1", free_port(), rank=0, world_size=1, group_name="w_gloo",
                              timeout_s=5)
    assert recorded == [("gloo", "1")]
