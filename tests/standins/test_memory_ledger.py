"""The stand-ins' per-node GPU memory ledger (standins/memory_ledger.py): records per GPU and owner,
the budget refusal, entries of exited processes dropped, no lost update across processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_m2po.standins import memory_ledger
from megatron_m2po.standins.memory_ledger import GpuBudgetExceeded, MemoryLedger
from waiting import wait_until

MIB = 1 << 20


@pytest.fixture
def ledger_env(tmp_path, monkeypatch):
    monkeypatch.setenv(memory_ledger.LEDGER_ENV, str(tmp_path / "ledger"))
    monkeypatch.setenv(memory_ledger.BUDGET_ENV, str(100 * MIB))
    monkeypatch.setenv(memory_ledger.NODE_ENV, "node0")
    return tmp_path / "ledger"


def test_off_unless_the_directory_is_named(monkeypatch):
    monkeypatch.delenv(memory_ledger.LEDGER_ENV, raising=False)
    assert MemoryLedger.from_env() is None
    memory_ledger.record(0, "trainer", 10**15)  # nothing to exceed
    assert memory_ledger.resident(0) == {}


def test_records_per_gpu_and_refuses_past_the_budget(ledger_env):
    memory_ledger.record(0, "engine:weights", 30 * MIB)
    memory_ledger.record(0, "engine:kv_cache", 50 * MIB)
    memory_ledger.record(1, "trainer", 90 * MIB)
    assert memory_ledger.resident(0) == {"engine:weights": 30 * MIB, "engine:kv_cache": 50 * MIB}
    with pytest.raises(GpuBudgetExceeded, match=r"GPU 0 of node 'node0': trainer needs 40.0 MiB.*"
                                                 r"engine:kv_cache=50.0 MiB.*> the budget of 100.0 MiB") as e:
        memory_ledger.record(0, "trainer", 40 * MIB)
    assert e.value.others == {"engine:weights": 30 * MIB, "engine:kv_cache": 50 * MIB}
    assert "trainer" not in memory_ledger.resident(0)  # a refused record records nothing
    memory_ledger.record(0, "engine:kv_cache", 0)  # released -> dropped
    memory_ledger.record(0, "trainer", 40 * MIB)
    assert memory_ledger.resident(0) == {"engine:weights": 30 * MIB, "trainer": 40 * MIB}
    memory_ledger.record(0, "trainer", 20 * MIB)  # shrinking is always fine
    with pytest.raises(ValueError, match="bytes must be >= 0"):
        memory_ledger.record(0, "trainer", -1)
    assert (ledger_env / "node0.json").is_file()
    other = MemoryLedger(ledger_env, "node1", 100 * MIB)  # another node: its own file and budget
    other.record(0, "trainer", 99 * MIB)
    assert memory_ledger.resident(0)["trainer"] == 20 * MIB


CHILD = """
import sys
from megatron_m2po.standins import memory_ledger
for i in range(20):
    memory_ledger.record(0, f"{sys.argv[1]}:{i}", 1024)
print("recorded", flush=True)
sys.stdin.read()
"""


def test_processes_share_it_without_lost_updates_and_exited_ones_leave(ledger_env):
    kids = [subprocess.Popen([sys.executable, "-c", CHILD, f"p{k}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True) for k in range(3)]
    try:
        for k in kids:
            assert k.stdout.readline().strip() == "recorded"
        held = memory_ledger.resident(0)
        assert sorted(held) == sorted(f"p{k}:{i}" for k in range(3) for i in range(20))
        kids[0].stdin.close()
        kids[0].wait(30)
        # an exited process's memory went with it, as a killed process's device memory does
        wait_until(lambda: not any(o.startswith("p0:") for o in memory_ledger.resident(0)),
                   what="the exited process's entries dropped", timeout=10)
        assert len(memory_ledger.resident(0)) == 40
    finally:
        for k in kids:
            if k.poll() is None:
                k.stdin.close()
                k.wait(30)


def test_a_bad_budget_is_a_clear_error(ledger_env, monkeypatch):
    monkeypatch.setenv(memory_ledger.BUDGET_ENV, "80GB")
    with pytest.raises(ValueError, match="M2PO_STANDIN_GPU_BUDGET_BYTES='80GB': a number of bytes"):
        memory_ledger.record(0, "x", 1)
