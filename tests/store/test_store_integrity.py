"""Integrity on read: a stored array that changed after it was written is never served.

The damage is done the way it happens: bits flipped in the SQLite file itself (SQLite keeps no
page checksums, so it hands the changed bytes back), or a blob rewritten behind the store's
back. The store must quarantine the group (kept on disk, counted, reported by id), serve the
others, and never pass the damaged data to the consumer.
"""

from __future__ import annotations

import logging
import sqlite3
import threading

import numpy as np
import pytest

from megatron_m2po.store import CorruptGroupError, NotReadyError, RolloutStore, bounded, fifo
from megatron_m2po.store import sqlite as db
from store_testlib import make_group, same_group


def _fill(path, gids, **kw):
    s = RolloutStore(str(path))
    try:
        s.put_groups([make_group(g, 0, n=2, resp_len=200, **kw) for g in gids])
    finally:
        s.close()  # the last connection checkpoints the WAL into the file


def _flip_in_file(path, gid: str, field: str = "behav_logprobs", bit: int = 3) -> None:
    """Flip one bit of trajectory ``gid/0``'s array inside the database file (not through SQLite)."""
    t = make_group(gid, 0, n=2, resp_len=200).trajectories[0]
    needle = getattr(t, field).astype("<f4" if field.endswith("logprobs") else "<i4").tobytes()
    raw = bytearray(path.read_bytes())
    at = raw.find(needle)
    assert at > 0 and raw.find(needle, at + 1) < 0, "array not found exactly once in the file"
    raw[at + len(needle) // 2] ^= 1 << bit
    path.write_bytes(bytes(raw))


def _flip_blob_sql(path, uid: str, column: str = "response") -> None:
    conn = sqlite3.connect(str(path))
    try:
        (b,) = conn.execute(f"SELECT {column} FROM trajectories WHERE uid=?", (uid,)).fetchone()
        b = bytearray(b)
        b[len(b) // 3] ^= 0x10
        conn.execute(f"UPDATE trajectories SET {column}=? WHERE uid=?", (bytes(b), uid))
        conn.commit()
    finally:
        conn.close()


def test_bit_flipped_in_the_file_is_quarantined_and_the_others_served(tmp_path, caplog):
    path = tmp_path / "s.sqlite"
    _fill(path, ["a", "b", "c", "d"])
    _flip_in_file(path, "b")
    s = RolloutStore(str(path))
    try:
        with caplog.at_level(logging.ERROR, logger="megatron_m2po.store.store"):
            lease = s.lease(fifo(), n_groups=3)
        assert [g.group_id for g in lease.groups] == ["a", "c", "d"]
        for g in lease.groups:  # what is served is exactly what was sent
            assert same_group(g, make_group(g.group_id, 0, n=2, resp_len=200))
        assert lease.quarantined == ["b"]
        assert "'b'" in caplog.text and "checksum" in caplog.text
        assert s.counts()["quarantined"] == 1
        q = s.metrics()["quarantined"]
        assert q["groups"] == 1 and q["latest"][0]["group_id"] == "b" and q["latest"][0]["was"] == "available"
        assert "b/0" in q["latest"][0]["reason"]
        s.ack(lease)
        # kept aside, never served again, not deleted
        assert s.existing_group_ids(["b"]) == {"b"}
        with pytest.raises(NotReadyError):
            s.lease(fifo(), n_groups=1)
    finally:
        s.close()


@pytest.mark.parametrize("column", ["prompt", "response", "logp", "vruns", "mask", "metadata"])
def test_any_changed_column_is_caught(tmp_path, column):
    path = tmp_path / "s.sqlite"
    _fill(path, ["a", "b"])
    if column == "metadata":
        conn = sqlite3.connect(str(path))
        conn.execute("UPDATE trajectories SET metadata=? WHERE uid='a/1'", ('{"i": 7, "gid": "a"}',))
        conn.commit()
        conn.close()
    else:
        _flip_blob_sql(path, "a/1", column)
    s = RolloutStore(str(path))
    try:
        lease = s.lease(fifo(), n_groups=1)
        assert [g.group_id for g in lease.groups] == ["b"] and lease.quarantined == ["a"]
    finally:
        s.close()


def test_group_columns_and_missing_rows_are_caught(tmp_path):
    path = tmp_path / "s.sqlite"
    _fill(path, ["a", "b", "c"])
    conn = sqlite3.connect(str(path))
    conn.execute("UPDATE groups SET gen_version=1, max_version=1 WHERE group_id='a'")  # would change its staleness
    conn.execute("DELETE FROM trajectories WHERE uid='b/1'")  # a partial group
    conn.commit()
    conn.close()
    s = RolloutStore(str(path))
    try:
        with pytest.raises(NotReadyError, match=r"after quarantining \['a', 'b'\]"):
            s.lease(fifo(), n_groups=2)
        lease = s.lease(fifo(), n_groups=1)
        assert [g.group_id for g in lease.groups] == ["c"]
        reasons = {q["group_id"]: q["reason"] for q in s.metrics()["quarantined"]["latest"]}
        assert "versions 0..0 disagree" in reasons["a"] and "1 stored trajectories, 2 written" in reasons["b"]
    finally:
        s.close()


def test_quarantine_survives_a_refused_lease(tmp_path):
    """A lease that raises (over-age data) rolls back, but the corrupt group stays set aside."""
    path = tmp_path / "s.sqlite"
    _fill(path, ["a", "b"])
    _flip_in_file(path, "a")
    s = RolloutStore(str(path))
    try:
        s.set_version(5)
        with pytest.raises(ValueError, match="over-age"):
            s.lease(bounded(max_staleness=1), n_groups=1, current_version=5)
        assert s.counts()["quarantined"] == 1 and s.counts()["available"] == 1
    finally:
        s.close()


def test_scoring_checks_the_row_and_pending_reads_skip_corrupt_groups(tmp_path):
    path = tmp_path / "s.sqlite"
    s = RolloutStore(str(path))
    s.put_groups([make_group(g, 0, n=2, resp_len=200, reward=None) for g in ("p", "q", "r")])
    s.close()
    _flip_in_file(path, "p")
    _flip_blob_sql(path, "q/1", "prompt")
    s = RolloutStore(str(path))
    try:
        # scoring a damaged row does not re-checksum (launder) it: the group is quarantined instead
        assert s.set_rewards({"q/0": 1.0, "q/1": 0.0, "r/0": 1.0, "r/1": 0.5}) == ["r"]
        # the scorer's read of pending groups sets the damaged one aside
        assert s.pending_groups() == []
        assert s.counts()["quarantined"] == 2 and s.counts()["available"] == 1
        assert {q["group_id"]: q["was"] for q in s.metrics()["quarantined"]["latest"]} == {"p": "pending",
                                                                                          "q": "pending"}
        lease = s.lease(fifo(), n_groups=1)
        assert [t.reward for t in lease.groups[0].trajectories] == [1.0, 0.5]  # rewritten with its checksum
    finally:
        s.close()


def test_replayed_lease_with_a_damaged_group_raises_naming_it(tmp_path):
    path = tmp_path / "s.sqlite"
    _fill(path, ["a", "b", "c"])
    s = RolloutStore(str(path))
    first = s.lease(fifo(), n_groups=2, step=0)
    assert [g.group_id for g in first.groups] == ["a", "b"]
    s.close()  # the consumer dies with the lease open: it is replayed to the next one
    _flip_in_file(path, "b")
    s = RolloutStore(str(path))
    try:
        with pytest.raises(CorruptGroupError, match="'b'") as e:
            s.lease(fifo(), n_groups=2, step=0)
        assert e.value.group_ids == ["b"]
        assert s.counts()["quarantined"] == 1
        assert s.discard_replay() == 1
        lease = s.lease(fifo(), n_groups=2, step=0)
        assert [g.group_id for g in lease.groups] == ["a", "c"]
    finally:
        s.close()


def _downgrade_to_schema_1(path) -> None:
    conn = sqlite3.connect(str(path))
    conn.execute("ALTER TABLE trajectories DROP COLUMN checksum")
    conn.execute("DROP TABLE quarantine")
    conn.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
    conn.commit()
    conn.close()


def test_schema_1_store_is_migrated_and_then_checked(tmp_path):
    path = tmp_path / "old.sqlite"
    _fill(path, ["a", "b", "c"])
    _downgrade_to_schema_1(path)
    ro = RolloutStore(str(path), create=False, readonly=True)  # stats reads an old file as it is
    try:
        assert ro.metrics()["groups"]["available"]["groups"] == 3
        assert ro.metrics()["quarantined"]["latest"] == []
    finally:
        ro.close()
    s = RolloutStore(str(path))  # first writable open migrates
    s.close()
    conn = sqlite3.connect(str(path))
    assert conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(db.SCHEMA_VERSION)
    assert conn.execute("SELECT COUNT(*) FROM trajectories WHERE checksum IS NULL").fetchone()[0] == 0
    conn.close()
    _flip_in_file(path, "a")
    s = RolloutStore(str(path))
    try:
        lease = s.lease(fifo(), n_groups=2)
        assert [g.group_id for g in lease.groups] == ["b", "c"] and lease.quarantined == ["a"]
    finally:
        s.close()


def test_newer_schema_is_refused_by_name(tmp_path):
    path = tmp_path / "new.sqlite"
    _fill(path, ["a"])
    conn = sqlite3.connect(str(path))
    conn.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(RuntimeError, match="schema version 99"):
        RolloutStore(str(path))


def test_checksum_covers_what_the_trainer_gets():
    """Independent of the store: every field fed to row_checksum changes it."""
    base = ("u", 0, 1.0, "stop", "{}", 3, b"\x01\x00\x00\x00", b"\x02\x00\x00\x00", b"\x00\x00\x80\xbf",
            np.array([3, 1], "<i8").tobytes(), None, None)
    ref = db.row_checksum(*base)
    assert db.row_checksum(*base[:2], 1, *base[3:]) == ref  # an int reward reads back as REAL 1.0
    for i in range(len(base)):
        changed = list(base)
        changed[i] = {str: "v", int: 9, float: 0.5, bytes: b"\x09" * 4, type(None): b""}[type(base[i])]
        if i == 4:
            changed[i] = '{"x": 1}'
        assert db.row_checksum(*changed) != ref, i


def test_stats_reports_quarantined_groups(tmp_path):
    import subprocess
    import sys
    path = tmp_path / "s.sqlite"
    _fill(path, ["a", "b"])
    _flip_in_file(path, "a", field="response_ids")
    s = RolloutStore(str(path))
    s.lease(fifo(), n_groups=1)
    s.close()
    r = subprocess.run([sys.executable, "-m", "megatron_m2po.cli", "store", "stats", "--path", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "quarantined (stored data failed its checksum, never served): 1 groups" in r.stdout
    assert "  a (was available): trajectory 'a/0' fails its checksum" in r.stdout


def test_trainer_step_with_a_quarantined_group_fails_at_once_naming_it(tmp_path):
    """Exact stale-k cannot serve a step one of whose groups is quarantined: the driver says so at
    once (which group, what to do) instead of waiting for the step's timeout."""
    from megatron_m2po.config import Config
    from megatron_m2po.rollout_service.leaser import Leaser

    path = tmp_path / "s.sqlite"
    gids = [f"s000003-g{i:05d}" for i in range(4)]
    _fill(path, gids)
    _flip_blob_sql(path, f"{gids[2]}/1")
    cfg = Config()
    cfg.trainer.prompts_per_step = 4
    store = RolloutStore(str(path))
    # The real leaser over a real store; no generation feeds it (none in flight).
    leaser = Leaser(cfg.trainer, cfg.store, store, stop_event=threading.Event())
    try:
        with pytest.raises(RuntimeError) as e:
            leaser.take_step(3, version=4, generated_at=0, timeout_s=600)
        msg = str(e.value)
        assert gids[2] in msg and "quarantined" in msg and "did not arrive" not in msg
        assert "m2po store backup" in msg
        assert store.quarantined_ids("s000003-") == [gids[2]] and store.quarantined_ids("s000004-") == []
    finally:
        store.close()
