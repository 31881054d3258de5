"""Crash safety (SIGKILL while writing) and concurrent producers with one consumer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np

from megatron_m2po.store import RolloutStore, fifo
from store_testlib import check_store_integrity, crash_group, same_group, start_server, stop
from waiting import wait_until

HERE = os.path.dirname(os.path.abspath(__file__))
TOKEN = "t0ken"


def producer(mode, target, ackfile, prefix, n, seed, resend=False):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "M2PO_STORE_TOKEN": TOKEN}
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "store_producer_proc.py"), mode, target, ackfile, prefix,
                          str(n), str(seed), "1" if resend else "0"], env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def acked(ackfile):
    if not os.path.exists(ackfile):
        return []
    with open(ackfile) as f:
        return [x for x in f.read().split("\n") if x]


def kill_after_acks(victim, ackfile, n, producer_proc):
    """SIGKILL ``victim`` as soon as ``n`` groups are acknowledged in all: mid-write of the next one."""
    wait_until(lambda: len(acked(ackfile)) >= n, what=f"{n} acknowledged groups in {ackfile}", timeout=120,
               hopeless=lambda: producer_proc.poll() is not None and f"producer exited ({producer_proc.returncode})")
    victim.send_signal(signal.SIGKILL)
    victim.wait()


def test_sigkill_producer_loses_no_acknowledged_group(tmp_path):
    path, ackfile = str(tmp_path / "crash.sqlite"), str(tmp_path / "acks")
    rng = np.random.default_rng(1)
    total_acked = 0
    for it in range(4):
        p = producer("direct", path, ackfile, f"it{it}", 10_000, it)
        kill_after_acks(p, ackfile, total_acked + int(rng.integers(1, 40)), p)
        states = check_store_integrity(path)  # no partial group, every stored group intact
        ids = acked(ackfile)
        missing = [g for g in ids if g not in states]
        assert not missing, f"acknowledged but lost after kill -9: {missing[:5]}"
        total_acked = len(ids)
    assert total_acked > 4  # the producer got somewhere before each kill
    s = RolloutStore(path)  # the reopened store is usable and serves the acknowledged groups
    lease = s.lease(fifo(), n_groups=3)
    assert all(same_group(g, crash_group(g.group_id)) for g in lease.groups)
    s.close()


def publish_version(path: str, version: int) -> None:
    s = RolloutStore(path)
    try:
        s.set_version(version)
    finally:
        s.close()


def test_sigkill_server_loses_no_acknowledged_group(tmp_path):
    path, ackfile = str(tmp_path / "srv.sqlite"), str(tmp_path / "acks")
    rng = np.random.default_rng(2)
    publish_version(path, 2)  # crash groups carry versions 0..2 (the server refuses versions not yet published)
    for it in range(2):
        proc, url = start_server(path, token=TOKEN)
        p = producer("http", url, ackfile, f"s{it}", 10_000, it)
        kill_after_acks(proc, ackfile, len(acked(ackfile)) + int(rng.integers(1, 40)), p)
        p.kill()
        p.wait()
        states = check_store_integrity(path)
        ids = acked(ackfile)
        assert ids and not [g for g in ids if g not in states]


def test_concurrent_producers_one_consumer(tmp_path):
    path = str(tmp_path / "multi.sqlite")
    publish_version(path, 2)  # crash groups carry versions 0..2 (the server refuses versions not yet published)
    proc, url = start_server(path, token=TOKEN)
    n_each, procs = 24, []
    try:
        for i in range(3):
            procs.append(producer("http", url, str(tmp_path / f"ack{i}"), f"p{i}", n_each, i, resend=True))
        procs.append(producer("direct", path, str(tmp_path / "ack3"), "p3", n_each, 3, resend=True))
        store = RolloutStore(path)
        consumed = []
        step = 0
        while len(consumed) < 4 * n_each:
            lease = store.lease(fifo(), n_groups=2, step=step, timeout_s=30)
            for g in lease.groups:
                assert same_group(g, crash_group(g.group_id))
            consumed += [g.group_id for g in lease.groups]
            store.ack(lease)
            step += 1
        for p in procs:
            assert p.wait(30) == 0
        expected = {f"p{i}-{j}" for i in range(4) for j in range(n_each)}
        assert len(consumed) == len(set(consumed)) and set(consumed) == expected
        assert sum(store.counts().values()) == len(expected)  # re-sent groups were not stored twice
        store.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        stop(proc)
