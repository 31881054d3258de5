"""RolloutStore state machine: policies, idempotency, lease/ack/restart, cursor replay, metrics."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from megatron_m2po.store import (ConflictError, NotReadyError, RolloutStore, StoreFullError, bounded,
                                 exact_stale_k, fifo)
from store_testlib import make_group, same_group


@pytest.fixture
def store(tmp_path):
    s = RolloutStore(str(tmp_path / "s.sqlite"))
    yield s
    s.close()


def ids(lease):
    return [g.group_id for g in lease.groups]


def test_roundtrip_content_and_order(store):
    groups = [make_group(f"g{i}", version=i % 3, n=3, seed=i) for i in range(6)]
    store.put_groups(groups)
    lease = store.lease(fifo(), n_groups=6)
    assert ids(lease) == [g.group_id for g in groups]
    for a, b in zip(lease.groups, groups):
        assert same_group(a, b)
    assert lease.groups[0].trajectories[0].versions.dtype == np.int64


def test_exact_stale_k_schedule_over_many_steps(store):
    """num_updates_per_step=2, k=4: step s starts at u=2s and trains on data generated at u-4."""
    k, upd, per_step, n_steps = 4, 2, 3, 12
    # base-model rollouts for the steps whose u < k and the first step with u == k (all at version 0)
    warm = [s for s in range(n_steps) if upd * s < k]
    store.put_groups([make_group(f"base{s}-{j}", 0) for s in range(len(warm) + 1) for j in range(per_step)])
    served = set()
    for s in range(n_steps):
        u = upd * s
        store.set_version(u)
        if u < k:
            with pytest.raises(ValueError, match="never existed"):
                store.lease(exact_stale_k(k), n_groups=per_step, current_version=u, step=s)
            lease = store.lease_exact(generated_at=0, n_groups=per_step, current_version=u, step=s)
        else:
            # data for later steps exists already (never served early), plus distractors at odd versions
            lease = store.lease(exact_stale_k(k), n_groups=per_step, current_version=u, step=s)
            assert all(g.min_version == u - k for g in lease.groups), (s, [g.min_version for g in lease.groups])
            assert lease.staleness == [k] * per_step
        assert not served & set(ids(lease))
        served |= set(ids(lease))
        store.ack(lease)
        # the producer, now at version u, generates the data of step s + k/upd; distractors at
        # the odd version u+1 (no step starts there) and one extra group at u must stay unserved
        store.put_groups([make_group(f"v{u}-{j}", u) for j in range(per_step)] + [make_group(f"late{u}", u)])
        store.put_groups([make_group(f"odd{u}", u + 1)], current_version=u + 1)
    # no data was produced at version 24 (the producer stopped at 22, distractors are odd): asking
    # for it raises NotReadyError naming the version
    with pytest.raises(NotReadyError, match="generated at version 24"):
        store.lease(exact_stale_k(k), n_groups=1, current_version=28)
    m = store.metrics()
    # warm-up steps consumed version-0 data at staleness u (0 and 2); the rest at exactly k
    n_tok_group = 5 + 6  # make_group(n=2, resp_len=5): responses of 5 and 6 tokens
    hist = {int(s): n for s, n in m["staleness"]["groups"].items()}
    assert hist == {0: per_step, 2: per_step, k: per_step * (n_steps - 2)}
    assert {int(s): n for s, n in m["staleness"]["tokens"].items()} == {s: n * n_tok_group for s, n in hist.items()}
    # unserved: the base-model groups of one step, late* and odd* of every step, the last 2 steps' data
    assert m["groups"]["available"]["groups"] == per_step + 2 * n_steps + 2 * per_step


def test_exact_stale_k_not_ready_and_waiting(store):
    with pytest.raises(NotReadyError, match="holds 0 available groups generated at version 3"):
        store.lease(exact_stale_k(2), n_groups=2, current_version=5)
    threading.Timer(0.3, lambda: RolloutStore(store.path).put_groups([make_group("a", 3), make_group("b", 3)])).start()
    t0 = time.monotonic()
    lease = store.lease(exact_stale_k(2), n_groups=2, current_version=5, timeout_s=10)
    assert ids(lease) == ["a", "b"] and time.monotonic() - t0 >= 0.25


def _versions_store(store, n=6):
    store.put_groups([make_group(f"v{v}", v) for v in range(n)])


def test_bounded_oldest_refuses_over_age_and_stores_nothing(store):
    _versions_store(store)
    with pytest.raises(ValueError, match=r"group 'v0' \(uids v0/0, v0/1\) generated at version 0 is 5 updates old"):
        store.lease(bounded(3), n_groups=1, current_version=5)
    assert store.counts()["available"] == 6 and store.metrics()["leases"]["open"] == 0


def test_bounded_oldest_retire(store):
    _versions_store(store)
    lease = store.lease(bounded(3, retire=True), n_groups=2, current_version=5)
    assert ids(lease) == ["v2", "v3"] and lease.retired == ["v0", "v1"]
    m = store.metrics()
    assert m["retired"] == {"groups": 2, "trajectories": 4, "response_tokens": 22}
    store.ack(lease)
    assert store.counts() == {"pending": 0, "available": 2, "leased": 0, "consumed": 2, "retired": 2, "quarantined": 0}


def test_bounded_freshest(store):
    _versions_store(store)
    store.put_groups([make_group("v5b", 5)])
    lease = store.lease(bounded(3, order="freshest"), n_groups=3, current_version=5)
    assert ids(lease) == ["v5", "v5b", "v4"]  # newest version first, arrival order within one
    store.release(lease)
    with pytest.raises(ValueError, match="'v1'.*4 updates old"):
        store.lease(bounded(3, order="freshest"), n_groups=6, current_version=5)
    lease = store.lease(bounded(3, order="freshest", retire=True), n_groups=5, current_version=5)
    assert ids(lease) == ["v5", "v5b", "v4", "v3", "v2"] and lease.retired == ["v0", "v1"]
    with pytest.raises(NotReadyError):
        store.lease(bounded(3, order="freshest", retire=True), n_groups=1, current_version=5)


def test_data_ahead_of_consumer_is_refused(store):
    store.put_groups([make_group("future", 7)])
    with pytest.raises(ValueError, match="ahead of current_version=5"):
        store.lease(fifo(), n_groups=1, current_version=5)


def test_partial_rollout_generation_version_is_min(store):
    g = make_group("p", versions=[[2, 2, 3, 3, 3], [3, 3, 3, 4, 4, 4]])
    store.put_groups([g])
    assert store.metrics()["by_version"] == {
        "2": {"trajectories": 1, "prompt_tokens": 3, "response_tokens": 2},
        "3": {"trajectories": 1, "prompt_tokens": 4, "response_tokens": 6},
        "4": {"trajectories": 0, "prompt_tokens": 0, "response_tokens": 3}}
    with pytest.raises(NotReadyError):
        store.lease(exact_stale_k(1), n_groups=1, current_version=4)  # generated at 2, not 3
    lease = store.lease(exact_stale_k(2), n_groups=1, current_version=4)
    store.ack(lease)
    assert store.metrics()["staleness"]["tokens"] == {"0": 3, "1": 6, "2": 2}


def test_idempotent_put_and_conflicts(store):
    a, b = make_group("a", 1), make_group("b", 1)
    assert store.put_groups([a]).stored == ["a"]
    res = store.put_groups([a, b])
    assert res.stored == ["b"] and res.duplicates == ["a"]
    changed = make_group("a", 1)
    changed.trajectories[0].behav_logprobs[0] -= 0.5
    with pytest.raises(ConflictError, match="group 'a' is already stored with different content"):
        store.put_groups([make_group("c", 1), changed])
    stolen = make_group("d", 1)
    stolen.trajectories[1].uid = "b/0"
    with pytest.raises(ConflictError, match="uid 'b/0' of group 'd' is already stored in group 'b'"):
        store.put_groups([stolen])
    assert store.counts()["available"] == 2  # neither 'c' nor 'd' got in: a put is all-or-nothing
    lease = store.lease(fifo(), n_groups=2)
    assert ids(lease) == ["a", "b"]


def test_invalid_groups_rejected_naming_field(store):
    g = make_group("nan", 1)
    g.trajectories[1].behav_logprobs[2] = np.nan
    with pytest.raises(ValueError, match=r"trajectory 'nan/1': behav_logprobs\[2\]=nan is not finite"):
        store.put_groups([make_group("ok", 1), g])
    store.set_version(4)
    with pytest.raises(ValueError, match="versions reach 5, ahead of the trainer's current version 4"):
        store.put_groups([make_group("fut", 5)])
    with pytest.raises(ValueError, match="behind the recorded version 4.*allow_rewind=True"):
        store.set_version(3)
    assert store.counts()["available"] == 0 and store.current_version == 4


def test_resume_rewinds_version_and_retires_lost_future(store):
    store.set_version(9)
    store.put_groups([make_group(f"g{v}", v) for v in (6, 7, 8, 9)])
    store.set_version(7, allow_rewind=True)  # resumed from the checkpoint at version 7
    assert store.current_version == 7
    assert store.retire_ahead(7) == ["g8", "g9"]
    assert store.metrics()["retired"]["groups"] == 2
    assert ids(store.lease(bounded(4), n_groups=2, current_version=7)) == ["g6", "g7"]


def test_restore_cursor_rewinds_version_and_existing_ids(store):
    store.set_version(4)
    store.put_groups([make_group("a", 4), make_group("b", 4)])
    cursor = store.cursor_state()
    store.set_version(6)
    store.ack(store.lease(fifo(), n_groups=1, current_version=6, step=1))
    store.restore_cursor(cursor)
    assert store.current_version == 4
    store.set_version(5)  # the resumed trainer moves on from the checkpoint's version without allow_rewind
    assert store.existing_group_ids(["a", "zz", "b"]) == {"a", "b"}


def test_pending_groups_until_scored(store):
    store.put_groups([make_group("u", 0, reward=None), make_group("s", 0)])
    assert store.counts()["pending"] == 1
    assert ids(store.lease(fifo(), n_groups=1)) == ["s"]
    with pytest.raises(NotReadyError):
        store.lease(fifo(), n_groups=1)
    assert [g.group_id for g in store.pending_groups()] == ["u"]
    assert store.set_rewards({"u/0": 0.5}) == []
    assert store.set_rewards({"u/1": 1.0}) == ["u"]
    lease = store.lease(fifo(), n_groups=1)
    assert [t.reward for t in lease.groups[0].trajectories] == [0.5, 1.0]


def test_capacity(tmp_path):
    s = RolloutStore(str(tmp_path / "c.sqlite"), capacity_groups=3)
    s.put_groups([make_group(f"g{i}") for i in range(3)])
    with pytest.raises(StoreFullError, match="capacity_groups=3"):
        s.put_groups([make_group("g3")])
    s.ack(s.lease(fifo(), n_groups=2))
    s.put_groups([make_group("g3"), make_group("g4")])
    s.close()


def test_unacked_lease_comes_back_after_restart(tmp_path):
    path = str(tmp_path / "r.sqlite")
    s = RolloutStore(path)
    s.put_groups([make_group(f"g{i}", 0) for i in range(5)])
    first = s.lease(fifo(), n_groups=2, step=0)
    s.ack(first)
    lost = s.lease(fifo(), n_groups=2, step=1)
    s.close()  # the consumer dies without acknowledging
    s = RolloutStore(path)
    again = s.lease(fifo(), n_groups=2, step=1)
    assert again.replayed and again.lease_id == lost.lease_id and ids(again) == ids(lost) == ["g2", "g3"]
    s.ack(again)
    # a dead consumer's lease that the new one does not ask for again is released instead
    s.lease(fifo(), n_groups=1, step=2)
    s.close()
    s = RolloutStore(path)
    other = s.lease(fifo(), n_groups=1, step=7)
    assert ids(other) == ["g4"] and not other.replayed
    assert s.counts() == {"pending": 0, "available": 0, "leased": 1, "consumed": 4, "retired": 0,
                        "quarantined": 0}
    s.close()


def _consume(s, requests, steps):
    out = []
    for step in steps:
        pol, n, cv = requests[step]
        lease = s.lease(pol, n_groups=n, current_version=cv, step=step)
        out.append(lease)
        s.ack(lease)
    return out


@pytest.mark.parametrize("reopen", [False, True])
def test_cursor_restore_replays_identically(tmp_path, reopen):
    path = str(tmp_path / "cur.sqlite")
    s = RolloutStore(path)
    rng = np.random.default_rng(0)
    s.put_groups([make_group(f"a{i}", int(v)) for i, v in enumerate(rng.integers(0, 8, 40))])
    requests = {st: (bounded(9, order="freshest" if st % 2 else "oldest", retire=True), int(rng.integers(1, 4)),
                     8 + st // 2)
                for st in range(10)}
    _consume(s, requests, range(4))
    cursor = s.cursor_state()
    original = _consume(s, requests, range(4, 8))
    s.put_groups([make_group(f"b{i}", 8) for i in range(10)])  # new, fresher data after the checkpoint
    tail = s.lease(*requests[8][:1], n_groups=requests[8][1], current_version=requests[8][2], step=8)  # never acked
    if reopen:
        s.close()
        s = RolloutStore(path)
    assert s.restore_cursor(cursor) == 5
    replay = _consume(s, requests, range(4, 9))
    assert any(lease.retired for lease in original)  # the replay covers retirement too
    for a, b in zip(original + [tail], replay):
        assert b.replayed and a.lease_id == b.lease_id and ids(a) == ids(b) and a.retired == b.retired
        assert all(same_group(x, y) for x, y in zip(a.groups, b.groups))
    # after the replay, consumption continues with new leases and never serves a group twice
    more = _consume(s, requests, [9])[0]
    assert not more.replayed
    seen = [g for lease in _all_acked(s) for g in lease]
    assert len(seen) == len(set(seen))
    s.close()


def _all_acked(s):
    c = s._conn
    return [[r[0] for r in c.execute("SELECT group_seq FROM lease_groups WHERE lease_id=? AND role='served'", (lid,))]
            for (lid,) in c.execute("SELECT lease_id FROM leases WHERE state='acked'").fetchall()]


def test_cursor_mismatch_discard_and_foreign_cursor(tmp_path, store):
    store.put_groups([make_group(f"g{i}") for i in range(6)])
    cursor = store.cursor_state()
    store.ack(store.lease(fifo(), n_groups=2, step=0))
    store.restore_cursor(cursor)
    with pytest.raises(ValueError, match="a resume must repeat the same requests"):
        store.lease(fifo(), n_groups=3, step=0)
    assert store.discard_replay() == 1
    assert ids(store.lease(fifo(), n_groups=3, step=0)) == ["g0", "g1", "g2"]
    other = RolloutStore(str(tmp_path / "other.sqlite"))
    with pytest.raises(ValueError, match="cursor belongs to store"):
        other.restore_cursor(cursor)
    other.close()


def test_prune_consumed_keeps_ids_and_counters(store):
    store.put_groups([make_group(f"g{i}") for i in range(4)])
    store.ack(store.lease(fifo(), n_groups=2, step=0))
    old = store.cursor_state()
    store.ack(store.lease(fifo(), n_groups=1, step=1))
    cursor = store.cursor_state()
    assert store.prune_consumed(cursor) == 3
    assert store.metrics()["groups"]["consumed"]["groups"] == 3
    assert store.put_groups([make_group("g0")]).duplicates == ["g0"]  # idempotency survives pruning
    with pytest.raises(ValueError, match="was pruned"):
        store.restore_cursor(old)
    assert ids(store.lease(fifo(), n_groups=1)) == ["g3"]
