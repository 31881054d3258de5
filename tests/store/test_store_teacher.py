"""A distillation teacher's log-probs in the store (``algo.distill.mode=sglang``): written once with
the row's checksum rewritten, read back exactly after the file is closed and reopened (a resumed or
replayed step trains on the same numbers), never overwritten, refused when their length is wrong;
damage to them is caught by the checksum; a schema-3 store migrates and keeps its checksums."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from megatron_m2po.store import sqlite as db
from megatron_m2po.store.store import Fifo, NotReadyError, RolloutStore
from megatron_m2po.store.types import Trajectory
from store_testlib import make_group


def _teacher(t: Trajectory, shift: float = 0.0) -> np.ndarray:
    return (-np.linspace(0.1, 2.0, t.response_ids.size) - shift).astype(np.float32)


def test_written_once_kept_across_reopen_and_served_with_the_group(tmp_path):
    path = str(tmp_path / "s.sqlite")
    s = RolloutStore(path)
    g = make_group("g0", 0, n=3)
    s.put_groups([g])
    first = {t.uid: _teacher(t) for t in g.trajectories}
    assert s.set_teacher_logprobs(first) == 3
    # a second scoring (a resumed step, another engine) never replaces what a step may have trained on
    assert s.set_teacher_logprobs({t.uid: _teacher(t, 1.0) for t in g.trajectories}) == 0
    with pytest.raises(ValueError, match="2 log-probs for trajectory 'g0/1' of 6 response tokens"):
        RolloutStore(str(tmp_path / "t.sqlite")).close()
        s2 = RolloutStore(str(tmp_path / "t.sqlite"))
        s2.put_groups([make_group("g0", 0, n=3)])
        s2.set_teacher_logprobs({"g0/1": np.zeros(2, np.float32)})
    s.close()
    s = RolloutStore(path)
    lease = s.lease(Fifo(), n_groups=1)
    assert not lease.quarantined
    for t in lease.groups[0].trajectories:
        assert t.teacher_logprobs.dtype == np.float32 and np.array_equal(t.teacher_logprobs, first[t.uid])
    s.close()


def test_a_trajectory_put_with_teacher_log_probs_round_trips_and_a_bad_one_is_refused(tmp_path):
    s = RolloutStore(str(tmp_path / "s.sqlite"))
    g = make_group("g1", 0, n=2)
    for t in g.trajectories:
        t.teacher_logprobs = _teacher(t)
    s.put_groups([g])
    got = s.lease(Fifo(), n_groups=1).groups[0]
    assert all(np.array_equal(a.teacher_logprobs, b.teacher_logprobs) for a, b in zip(g.trajectories, got.trajectories))
    bad = make_group("g2", 0, n=1)
    t = bad.trajectories[0]
    t.loss_mask[:] = 1
    t.teacher_logprobs = _teacher(t)
    t.teacher_logprobs[2] = np.nan
    with pytest.raises(ValueError, match=r"teacher_logprobs\[2\]=nan on a trained token"):
        s.put_groups([bad])
    s.close()


def test_damaged_teacher_log_probs_quarantine_the_group(tmp_path):
    path = str(tmp_path / "s.sqlite")
    s = RolloutStore(path)
    g = make_group("g0", 0, n=2)
    s.put_groups([g])
    s.set_teacher_logprobs({t.uid: _teacher(t) for t in g.trajectories})
    s.close()
    c = sqlite3.connect(path)
    blob = bytearray(c.execute("SELECT teacher FROM trajectories WHERE uid='g0/1'").fetchone()[0])
    blob[0] ^= 0x40
    c.execute("UPDATE trajectories SET teacher=? WHERE uid='g0/1'", (bytes(blob),))
    c.commit()
    c.close()
    s = RolloutStore(path)
    with pytest.raises(NotReadyError, match=r"after quarantining \['g0'\] \(stored data fails its checksum\)"):
        s.lease(Fifo(), n_groups=1, timeout_s=0)
    s.close()


def test_schema_3_store_is_migrated_and_keeps_its_checksums(tmp_path):
    path = str(tmp_path / "old.sqlite")
    s = RolloutStore(path)
    old = make_group("old", 0)
    s.put_groups([old])
    s.close()
    c = sqlite3.connect(path)
    c.execute("ALTER TABLE trajectories DROP COLUMN teacher")
    c.execute("UPDATE meta SET value='3' WHERE key='schema_version'")
    c.commit()
    c.close()
    s = RolloutStore(path)
    assert db.get_meta(s._conn, "schema_version") == str(db.SCHEMA_VERSION)
    assert s.set_teacher_logprobs({t.uid: _teacher(t) for t in old.trajectories}) == 2
    lease = s.lease(Fifo(), n_groups=1)
    assert not lease.quarantined and lease.groups[0].trajectories[1].teacher_logprobs is not None
    s.close()
