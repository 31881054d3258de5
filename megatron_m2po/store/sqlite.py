"""Durable embedded SQLite backend of the rollout store.

Journal mode and sync setting:

* **WAL** journal: one writer at a time plus concurrent readers, so producer processes can
  append while the trainer reads; a commit appends to the log instead of rewriting pages.
* ``synchronous=FULL`` (the default): the log is fsynced at every commit, so a group whose
  ``put`` returned (and whose HTTP request was acknowledged) survives ``kill -9`` *and* power
  loss / a kernel crash. The cost is one fsync per ``put`` call, which is why a put carries many
  groups in one transaction. ``synchronous=NORMAL`` in WAL mode fsyncs only at checkpoints: it
  still survives a process crash (the log is in the OS page cache), but the last transactions
  before a power loss can vanish — acceptable for throw-away runs, not for an acknowledged
  ingestion API. Either way the database is never corrupted.
* ``busy_timeout``: several processes (the trainer, ``m2po store serve``, in-process producers)
  open the same file; a writer waits for the lock instead of failing. Write transactions start
  with ``BEGIN IMMEDIATE`` so two writers never deadlock upgrading a read lock.

Pages are 64 KiB (set at creation). Arrays are stored compactly, one row per trajectory: token ids as little-endian int32, log-probs
as float32, the loss mask as uint8 (NULL when all ones) and the per-token versions run-length
encoded as (version, count) int64 pairs. A ``meta`` table holds the schema version, a random
store id (so a cursor from another store is refused) and the trainer's current weight version.
"""

from __future__ import annotations

import json
import os
import sqlite3
import uuid
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import numpy as np

from megatron_m2po.store.codec import rle_decode, rle_encode
from megatron_m2po.store.types import Group, Trajectory

SCHEMA_VERSION = 1
SYNC_MODES = ("FULL", "NORMAL", "EXTRA")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    group_id TEXT NOT NULL UNIQUE,
    digest TEXT NOT NULL,
    gen_version INTEGER NOT NULL,        -- min token version: the version the rollout started at
    max_version INTEGER NOT NULL,
    n_traj INTEGER NOT NULL,
    n_prompt_tokens INTEGER NOT NULL,
    n_response_tokens INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    vruns TEXT NOT NULL,                 -- JSON [[version, response tokens], ...] over the group
    state TEXT NOT NULL,                 -- pending | available | leased | consumed | retired
    lease_id INTEGER,                    -- holder (leased), consumer (consumed) or retirer (retired)
    ingested_at REAL NOT NULL,
    pruned INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS groups_by_state ON groups (state, gen_version, seq);
CREATE TABLE IF NOT EXISTS trajectories (
    uid TEXT PRIMARY KEY,
    group_seq INTEGER NOT NULL,
    idx INTEGER NOT NULL,
    reward REAL,
    finish_reason TEXT NOT NULL,
    metadata TEXT NOT NULL,
    min_version INTEGER NOT NULL,
    prompt BLOB, response BLOB, logp BLOB, vruns BLOB, mask BLOB, recomputed BLOB
);
CREATE INDEX IF NOT EXISTS trajectories_by_group ON trajectories (group_seq, idx);
CREATE TABLE IF NOT EXISTS leases (
    lease_id INTEGER PRIMARY KEY AUTOINCREMENT,
    step INTEGER,
    policy TEXT NOT NULL,                -- JSON spec of the consumption policy
    n_groups INTEGER NOT NULL,
    current_version INTEGER,
    generated_at INTEGER,
    state TEXT NOT NULL,                 -- open | acked | replay | released
    replay_reason TEXT,                  -- restart | restore
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    acked_at REAL
);
CREATE INDEX IF NOT EXISTS leases_by_state ON leases (state, lease_id);
CREATE TABLE IF NOT EXISTS lease_groups (
    lease_id INTEGER NOT NULL,
    role TEXT NOT NULL,                  -- served | retired
    pos INTEGER NOT NULL,
    group_seq INTEGER NOT NULL,
    PRIMARY KEY (lease_id, role, pos)
);
CREATE TABLE IF NOT EXISTS version_stats (
    version INTEGER PRIMARY KEY,
    trajectories INTEGER NOT NULL DEFAULT 0,   -- counted at the trajectory's min version
    prompt_tokens INTEGER NOT NULL DEFAULT 0,  -- counted at the trajectory's min version
    response_tokens INTEGER NOT NULL DEFAULT 0 -- counted at each token's own version
);
"""


def connect(path: str, *, synchronous: str = "FULL", busy_timeout_s: float = 30.0,
            create: bool = True, readonly: bool = False) -> sqlite3.Connection:
    """Open (and if needed create) the store database with the pragmas described above.

    ``readonly`` opens an existing store with ``mode=ro`` (nothing is written, no schema is
    created): what ``m2po store stats`` uses, safe next to a running server."""
    sync = synchronous.upper()
    if sync not in SYNC_MODES:
        raise ValueError(f"synchronous={synchronous!r} must be one of {list(SYNC_MODES)}")
    if (readonly or not create) and not os.path.exists(path):
        raise FileNotFoundError(f"no rollout store at {path!r}")
    if readonly:
        from urllib.parse import quote
        conn = sqlite3.connect(f"file:{quote(os.path.abspath(path))}?mode=ro", uri=True, timeout=busy_timeout_s,
                               isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row is None or int(row[0]) != SCHEMA_VERSION:
            raise RuntimeError(f"rollout store {path!r} has schema version {row and row[0]}, this code reads "
                               f"{SCHEMA_VERSION}; use the matching megatron_m2po version")
        return conn
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
    # Trajectory arrays are 10 KB - 1 MB blobs: 64 KiB pages cut their overflow-page chains (~20% faster
    # ingest than 4 KiB pages). Only takes effect when the file is new (before WAL is switched on).
    conn.execute("PRAGMA page_size=65536")
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if mode.lower() != "wal":
        raise RuntimeError(f"could not put {path!r} in WAL mode (got {mode!r}); is it on a network filesystem?")
    conn.execute(f"PRAGMA synchronous={sync}")
    conn.execute("PRAGMA journal_size_limit=67108864")  # truncate the WAL back to 64 MiB after checkpoints
    with transaction(conn):
        for stmt in _SCHEMA.split(";"):  # executescript() would COMMIT the open transaction
            if stmt.strip():
                conn.execute(stmt)
        row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row is None:
            conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            conn.execute("INSERT INTO meta VALUES ('store_id', ?)", (uuid.uuid4().hex,))
        elif int(row[0]) != SCHEMA_VERSION:
            raise RuntimeError(f"rollout store {path!r} has schema version {row[0]}, this code reads "
                               f"{SCHEMA_VERSION}; use the matching megatron_m2po version")
    return conn


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (rolled back on any exception)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def get_meta(conn: sqlite3.Connection, key: str) -> Optional[str]:
    row = conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
    return None if row is None else row[0]


def set_meta(conn: sqlite3.Connection, key: str, value: str) -> None:
    conn.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                 (key, value))


def _b(a: np.ndarray, dt: str) -> bytes:
    return np.ascontiguousarray(a, dtype=dt).tobytes()


def insert_group(conn: sqlite3.Connection, g: Group, *, digest: str, state: str, now: float) -> int:
    """Insert one validated group (inside the caller's transaction); returns its array bytes."""
    runs_all: dict[int, int] = {}
    rows = []
    nbytes = n_prompt = n_resp = 0
    for i, t in enumerate(g.trajectories):
        runs = rle_encode(t.versions)
        for v, c in runs.tolist():
            runs_all[v] = runs_all.get(v, 0) + c
        mask = None if bool((t.loss_mask == 1).all()) else _b(t.loss_mask, "u1")
        rec = None if t.recomputed_behav_logprobs is None else _b(t.recomputed_behav_logprobs, "<f4")
        blobs = (_b(t.prompt_ids, "<i4"), _b(t.response_ids, "<i4"), _b(t.behav_logprobs, "<f4"),
                 _b(runs, "<i8"), mask, rec)
        nbytes += sum(len(x) for x in blobs if x is not None)
        n_prompt += t.prompt_ids.size
        n_resp += t.response_ids.size
        rows.append((t.uid, i, t.reward, t.finish_reason, json.dumps(t.metadata, allow_nan=False),
                     t.min_version, *blobs))
        conn.execute(
            "INSERT INTO version_stats (version, trajectories, prompt_tokens) VALUES (?, 1, ?) "
            "ON CONFLICT(version) DO UPDATE SET trajectories=trajectories+1, "
            "prompt_tokens=prompt_tokens+excluded.prompt_tokens", (max(t.min_version, 0), int(t.prompt_ids.size)))
    for v, c in runs_all.items():
        conn.execute("INSERT INTO version_stats (version, response_tokens) VALUES (?, ?) "
                     "ON CONFLICT(version) DO UPDATE SET response_tokens=response_tokens+excluded.response_tokens",
                     (v, c))
    cur = conn.execute(
        "INSERT INTO groups (group_id, digest, gen_version, max_version, n_traj, n_prompt_tokens, "
        "n_response_tokens, nbytes, vruns, state, ingested_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        (g.group_id, digest, max(g.min_version, 0), max(g.max_version, 0), len(g.trajectories), n_prompt,
         n_resp, nbytes, json.dumps(sorted(runs_all.items())), state, now))
    seq = cur.lastrowid
    conn.executemany("INSERT INTO trajectories (uid, group_seq, idx, reward, finish_reason, metadata, "
                     "min_version, prompt, response, logp, vruns, mask, recomputed) "
                     "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", [(r[0], seq, *r[1:]) for r in rows])
    return nbytes


def load_groups(conn: sqlite3.Connection, seqs: Sequence[int]) -> list[Group]:
    """Decode the groups with these ``seq`` numbers, in the given order."""
    out = []
    for seq in seqs:
        gid, pruned = conn.execute("SELECT group_id, pruned FROM groups WHERE seq=?", (seq,)).fetchone()
        if pruned:
            raise ValueError(f"group {gid!r} was pruned from the store (its data is gone); it cannot be served "
                             "again — restore a cursor newer than the one passed to prune_consumed()")
        trajs = []
        for (uid, reward, fr, md, prompt, resp, logp, vruns, mask, rec) in conn.execute(
                "SELECT uid, reward, finish_reason, metadata, prompt, response, logp, vruns, mask, recomputed "
                "FROM trajectories WHERE group_seq=? ORDER BY idx", (seq,)):
            r = np.frombuffer(resp, "<i4")
            trajs.append(Trajectory(
                uid=uid, group_id=gid, prompt_ids=np.frombuffer(prompt, "<i4").copy(), response_ids=r.copy(),
                behav_logprobs=np.frombuffer(logp, "<f4").copy(),
                versions=rle_decode(np.frombuffer(vruns, "<i8").reshape(-1, 2)),
                reward=reward,
                loss_mask=np.ones(r.size, np.uint8) if mask is None else np.frombuffer(mask, "u1").copy(),
                finish_reason=fr, metadata=json.loads(md),
                recomputed_behav_logprobs=None if rec is None else np.frombuffer(rec, "<f4").copy()))
        out.append(Group(gid, trajs))
    return out


def prune_groups(conn: sqlite3.Connection, seqs: Sequence[int]) -> None:
    """Drop the arrays of these groups, keeping their ids (idempotency) and counters (metrics)."""
    for seq in seqs:
        conn.execute("UPDATE trajectories SET prompt=NULL, response=NULL, logp=NULL, vruns=NULL, mask=NULL, "
                     "recomputed=NULL WHERE group_seq=?", (seq,))
        conn.execute("UPDATE groups SET pruned=1, nbytes=0 WHERE seq=?", (seq,))
