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

Integrity on read: every trajectory row carries a SHA-256 ``checksum`` over everything the
trainer receives from it (uid, position, reward, finish reason, metadata, min version and every
array blob, each with its length), written at insert and rewritten with the row when
``set_rewards`` scores it. :func:`load_group` recomputes it (and checks the row count, blob
lengths and the group's version columns) before decoding; a mismatch raises
:class:`CorruptGroupError` naming the group, which the store *quarantines* (state
``quarantined``, a row in ``quarantine`` with the reason) instead of serving it. The group-level
``digest`` is different: it hashes the group *as sent* (idempotency of re-sends) and stays fixed
while rewards are scored.

Schema 1 files (before checksums) are migrated when first opened for writing: the rows are
checksummed as they are then, so damage done before the migration is not detected. Schema 3 adds
the ``routed`` column (MoE routed experts, :func:`routed_blob`): uint16 ``(layers, top_k)`` then
the ids as uint16, ``[P + R - 1, layers, top_k]``; a row's checksum covers it when present, so
rows of schema 2 keep their checksums. Schema 4 adds the ``teacher`` column (a distillation
teacher's float32 log-probs of the response tokens, ``algo.distill.mode=sglang``), written with the
row or later by :func:`set_teacher`; the checksum covers it when present, so older rows keep theirs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import struct
import uuid
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import numpy as np

from megatron_m2po.store.codec import rle_decode, rle_encode
from megatron_m2po.store.types import Group, Trajectory

log = logging.getLogger(__name__)

SCHEMA_VERSION = 4
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
    state TEXT NOT NULL,                 -- pending | available | leased | consumed | retired | quarantined
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
    prompt BLOB, response BLOB, logp BLOB, vruns BLOB, mask BLOB, recomputed BLOB,
    routed BLOB,
    teacher BLOB,                        -- algo.distill.mode=sglang: the teacher's log-probs (<f4 x R)
    checksum TEXT                        -- row_checksum() of the row, NULL once pruned
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
CREATE TABLE IF NOT EXISTS quarantine (
    group_seq INTEGER PRIMARY KEY,       -- a group whose stored data failed its checksum on read
    group_id TEXT NOT NULL,
    prev_state TEXT NOT NULL,
    reason TEXT NOT NULL,
    detected_at REAL NOT NULL
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
        return _connect_readonly(path, busy_timeout_s)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if tables and "meta" not in tables:  # never touch someone else's database (not even its journal mode)
        conn.close()
        raise NotAStoreError(f"{path} is a SQLite database of something else (tables {sorted(tables)[:5]}), "
                             "not a rollout store; check the path")
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
        elif int(row[0]) in (1, 2, 3):
            if int(row[0]) == 1:
                _migrate_1_to_2(conn, path)
            if int(row[0]) <= 2:
                _migrate_2_to_3(conn, path)
            _migrate_3_to_4(conn, path)
        elif int(row[0]) != SCHEMA_VERSION:
            raise RuntimeError(f"rollout store {path!r} has schema version {row[0]}, this code reads "
                               f"{SCHEMA_VERSION}; use the matching megatron_m2po version")
    return conn


class NotAStoreError(RuntimeError):
    """The file is a SQLite database, but not a rollout store."""


def _schema_of(conn: sqlite3.Connection, path: str) -> int:
    try:
        row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    except sqlite3.OperationalError as e:
        if "no such table" not in str(e):
            raise
        row = None
    if row is None:
        raise NotAStoreError(f"{path} is a SQLite database but not a rollout store (no schema version); "
                             "check the path")
    return int(row[0])


def _connect_readonly(path: str, busy_timeout_s: float) -> sqlite3.Connection:
    """``mode=ro``: nothing is written, no schema is created; safe next to a running server.

    A WAL database normally needs its ``-shm`` file to be writable (or creatable) even for reading.
    When the directory is read-only and no write-ahead log is pending (no server has un-checkpointed
    data), the file is opened ``immutable`` instead; with a pending log it cannot be read safely
    without write access, and the error says so."""
    from urllib.parse import quote

    uri = f"file:{quote(os.path.abspath(path))}?mode=ro"

    def open_(u: str) -> sqlite3.Connection:
        c = sqlite3.connect(u, uri=True, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        c.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        return c

    conn = open_(uri)
    try:
        schema = _schema_of(conn, path)
    except sqlite3.OperationalError as e:
        conn.close()
        msg = str(e).lower()
        if "readonly" not in msg and "unable to open" not in msg:
            raise
        wal = path + "-wal"
        if os.path.exists(wal) and os.path.getsize(wal) > 0:
            raise PermissionError(
                f"{path} has a pending write-ahead log ({wal}) and this user cannot write next to it (SQLite "
                "needs that to read it consistently); run this as the user that runs the server, or read a "
                "'m2po store backup' copy") from None
        conn = open_(uri + "&immutable=1")
        schema = _schema_of(conn, path)
    if schema not in (1, 2, 3, SCHEMA_VERSION):  # 1: no checksums yet, 2: no routed experts, 3: no teacher
        conn.close()
        raise RuntimeError(f"rollout store {path!r} has schema version {schema}, this code reads "
                           f"{SCHEMA_VERSION}; use the matching megatron_m2po version")
    return conn


def _migrate_1_to_2(conn: sqlite3.Connection, path: str) -> None:
    """Schema 1 -> 2 (inside the caller's transaction): add and fill the per-row checksums."""
    cols = [r[1] for r in conn.execute("PRAGMA table_info(trajectories)")]
    if "checksum" not in cols:
        conn.execute("ALTER TABLE trajectories ADD COLUMN checksum TEXT")
    rowids = [r[0] for r in conn.execute("SELECT rowid FROM trajectories WHERE response IS NOT NULL")]
    for rowid in rowids:  # one row in memory at a time
        row = conn.execute(f"SELECT {ROW_COLS} FROM trajectories WHERE rowid=?", (rowid,)).fetchone()
        conn.execute("UPDATE trajectories SET checksum=? WHERE rowid=?", (row_checksum(*row), rowid))
    n = len(rowids)
    set_meta(conn, "schema_version", str(SCHEMA_VERSION))
    log.warning("rollout store %s: migrated from schema 1 to %d (checksummed %d stored trajectories as they are "
                "now; damage older than this migration cannot be detected)", path, SCHEMA_VERSION, n)


def _migrate_2_to_3(conn: sqlite3.Connection, path: str) -> None:
    """Schema 2 -> 3 (inside the caller's transaction): the ``routed`` column (NULL in old rows)."""
    if not _has_routed(conn):
        conn.execute("ALTER TABLE trajectories ADD COLUMN routed BLOB")
    set_meta(conn, "schema_version", str(SCHEMA_VERSION))
    log.info("rollout store %s: migrated to schema %d (routed experts column)", path, SCHEMA_VERSION)


def _migrate_3_to_4(conn: sqlite3.Connection, path: str) -> None:
    """Schema 3 -> 4 (inside the caller's transaction): the ``teacher`` column (NULL in old rows)."""
    if not _has_column(conn, "teacher"):
        conn.execute("ALTER TABLE trajectories ADD COLUMN teacher BLOB")
    set_meta(conn, "schema_version", str(SCHEMA_VERSION))
    log.info("rollout store %s: migrated to schema %d (distillation teacher column)", path, SCHEMA_VERSION)


def _has_column(conn: sqlite3.Connection, name: str) -> bool:
    return any(r[1] == name for r in conn.execute("PRAGMA table_info(trajectories)"))


def _has_routed(conn: sqlite3.Connection) -> bool:
    return _has_column(conn, "routed")


def optional_cols(conn: sqlite3.Connection) -> str:
    """``, routed, teacher`` as this file has them (NULL for a column an old read-only file lacks)."""
    return (", routed" if _has_routed(conn) else ", NULL") + (", teacher" if _has_column(conn, "teacher") else ", NULL")


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


def routed_blob(a: Optional[np.ndarray]) -> Optional[bytes]:
    """Routed experts ``[T, layers, top_k]`` -> ``<u2 layers, <u2 top_k, <u2 ids``; None stays None."""
    if a is None:
        return None
    if a.size and int(a.max()) > 0xFFFF:
        raise ValueError(f"expert id {int(a.max())} does not fit the store's uint16 routed experts")
    return struct.pack("<HH", a.shape[1], a.shape[2]) + _b(a, "<u2")


def routed_array(b: Optional[bytes], rows: int) -> Optional[np.ndarray]:
    """Inverse of :func:`routed_blob`; ``ValueError`` when the blob does not hold ``rows`` rows."""
    if b is None:
        return None
    if len(b) < 4:
        raise ValueError("routed experts blob shorter than its header")
    layers, k = struct.unpack("<HH", b[:4])
    if len(b) - 4 != 2 * rows * layers * k:
        raise ValueError(f"routed experts blob of {len(b) - 4} bytes is not {rows} x {layers} x {k} uint16")
    return np.frombuffer(b[4:], "<u2").reshape(rows, layers, k).astype(np.int32)


def checksum_blobs(blobs: Sequence[Optional[bytes]], routed: Optional[bytes], teacher: Optional[bytes] = None) -> tuple:
    """The blobs row_checksum covers: the routed experts only when present (schema-2 rows hash as
    before), the teacher's log-probs only when present (then after the routed slot, absent or not)."""
    if teacher is not None:
        return (*blobs, routed, teacher)
    return tuple(blobs) if routed is None else (*blobs, routed)


# Columns row_checksum() covers, in its argument order.
ROW_COLS = "uid, idx, reward, finish_reason, metadata, min_version, prompt, response, logp, vruns, mask, recomputed"


def row_checksum(uid: str, idx: int, reward: Optional[float], finish_reason: str, metadata: str, min_version: int,
                 *blobs: Optional[bytes]) -> str:
    """SHA-256 of one stored trajectory row: its scalars, then each blob (absent / length + bytes)."""
    h = hashlib.sha256()
    # reward as SQLite returns it (REAL): an int reward written as 1 reads back as 1.0
    scal = json.dumps([uid, idx, None if reward is None else float(reward), finish_reason, metadata,
                       min_version]).encode()
    h.update(struct.pack("<Q", len(scal)) + scal)
    for b in blobs:
        h.update(b"\x00" if b is None else b"\x01" + struct.pack("<Q", len(b)))
        if b is not None:
            h.update(b)
    return h.hexdigest()


class CorruptGroupError(Exception):
    """A stored group fails its integrity check on read (checksum, row count, lengths)."""

    def __init__(self, seq: int, group_id: str, reason: str):
        super().__init__(f"group {group_id!r}: {reason}")
        self.seq = seq
        self.group_id = group_id
        self.reason = reason


def insert_group(conn: sqlite3.Connection, g: Group, *, digest: str, state: str, now: float) -> int:
    """Insert one validated group (inside the caller's transaction); returns its array bytes.

    Each trajectory's blobs are built, checksummed and written one row at a time, so a large
    group never has a second copy of all its arrays in memory."""
    cur = conn.execute(
        "INSERT INTO groups (group_id, digest, gen_version, max_version, n_traj, n_prompt_tokens, "
        "n_response_tokens, nbytes, vruns, state, ingested_at) VALUES (?,?,?,?,?,0,0,0,'[]',?,?)",
        (g.group_id, digest, max(g.min_version, 0), max(g.max_version, 0), len(g.trajectories), state, now))
    seq = cur.lastrowid
    runs_all: dict[int, int] = {}
    nbytes = n_prompt = n_resp = 0
    for i, t in enumerate(g.trajectories):
        runs = rle_encode(t.versions)
        for v, c in runs.tolist():
            runs_all[v] = runs_all.get(v, 0) + c
        mask = None if bool((t.loss_mask == 1).all()) else _b(t.loss_mask, "u1")
        rec = None if t.recomputed_behav_logprobs is None else _b(t.recomputed_behav_logprobs, "<f4")
        blobs = (_b(t.prompt_ids, "<i4"), _b(t.response_ids, "<i4"), _b(t.behav_logprobs, "<f4"),
                 _b(runs, "<i8"), mask, rec)
        routed = routed_blob(t.routed_experts)
        teacher = None if t.teacher_logprobs is None else _b(t.teacher_logprobs, "<f4")
        nbytes += sum(len(x) for x in (*blobs, routed, teacher) if x is not None)
        n_prompt += t.prompt_ids.size
        n_resp += t.response_ids.size
        scal = (t.uid, i, t.reward, t.finish_reason, json.dumps(t.metadata, allow_nan=False), t.min_version)
        conn.execute("INSERT INTO trajectories (uid, group_seq, idx, reward, finish_reason, metadata, "
                     "min_version, prompt, response, logp, vruns, mask, recomputed, routed, teacher, checksum) "
                     "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                     (scal[0], seq, *scal[1:], *blobs, routed, teacher,
                      row_checksum(*scal, *checksum_blobs(blobs, routed, teacher))))
        del blobs, mask, rec, routed, teacher
        conn.execute(
            "INSERT INTO version_stats (version, trajectories, prompt_tokens) VALUES (?, 1, ?) "
            "ON CONFLICT(version) DO UPDATE SET trajectories=trajectories+1, "
            "prompt_tokens=prompt_tokens+excluded.prompt_tokens", (max(t.min_version, 0), int(t.prompt_ids.size)))
    for v, c in runs_all.items():
        conn.execute("INSERT INTO version_stats (version, response_tokens) VALUES (?, ?) "
                     "ON CONFLICT(version) DO UPDATE SET response_tokens=response_tokens+excluded.response_tokens",
                     (v, c))
    conn.execute("UPDATE groups SET n_prompt_tokens=?, n_response_tokens=?, nbytes=?, vruns=? WHERE seq=?",
                 (n_prompt, n_resp, nbytes, json.dumps(sorted(runs_all.items())), seq))
    return nbytes


def load_group(conn: sqlite3.Connection, seq: int) -> Group:
    """Decode the group with this ``seq`` after checking its integrity.

    Raises :class:`CorruptGroupError` when a row's checksum, the row count, a blob's length or
    the group's version columns disagree with what was written; ``ValueError`` for a pruned group.
    """
    row = conn.execute("SELECT group_id, pruned, n_traj, gen_version, max_version FROM groups WHERE seq=?",
                       (seq,)).fetchone()
    if row is None:
        raise LookupError(f"no group with seq {seq} in the store")
    gid, pruned, n_traj, gen_v, max_v = row
    if pruned:
        raise ValueError(f"group {gid!r} was pruned from the store (its data is gone); it cannot be served "
                         "again — restore a cursor newer than the one passed to prune_consumed()")

    def bad(why: str) -> CorruptGroupError:
        return CorruptGroupError(seq, gid, why)

    rows = conn.execute(f"SELECT {ROW_COLS}{optional_cols(conn)}, checksum FROM trajectories WHERE group_seq=? "
                        "ORDER BY idx", (seq,)).fetchall()
    if len(rows) != n_traj:
        raise bad(f"{len(rows)} stored trajectories, {n_traj} written")
    trajs = []
    for i, r in enumerate(rows):
        (uid, idx, reward, fr, md, min_v, prompt, resp, logp, vruns, mask, rec), routed, teacher, cs = \
            r[:-3], r[-3], r[-2], r[-1]
        if idx != i:
            raise bad(f"trajectory positions are not 0..{n_traj - 1} (found {idx} at {i})")
        if cs is None or row_checksum(*r[:6], *checksum_blobs(r[6:12], routed, teacher)) != cs:
            raise bad(f"trajectory {uid!r} fails its checksum (stored data changed since it was written)")
        if any(b is None for b in (prompt, resp, logp, vruns)) or len(prompt) % 4 or len(resp) % 4 or len(vruns) % 16:
            raise bad(f"trajectory {uid!r} has arrays of impossible lengths")
        rl = len(resp) // 4
        if len(logp) != 4 * rl or (mask is not None and len(mask) != rl) or any(
                b is not None and len(b) != 4 * rl for b in (rec, teacher)):
            raise bad(f"trajectory {uid!r} has arrays whose lengths disagree with its {rl} response tokens")
        runs = np.frombuffer(vruns, "<i8").reshape(-1, 2)
        if (runs[:, 1] < 0).any() or int(runs[:, 1].sum()) != rl:
            raise bad(f"trajectory {uid!r} has version runs that do not cover its {rl} response tokens")
        try:
            routed_ids = routed_array(routed, len(prompt) // 4 + rl - 1)
        except ValueError as e:
            raise bad(f"trajectory {uid!r}: {e}") from None
        trajs.append(Trajectory(
            uid=uid, group_id=gid, prompt_ids=np.frombuffer(prompt, "<i4").copy(),
            response_ids=np.frombuffer(resp, "<i4").copy(), behav_logprobs=np.frombuffer(logp, "<f4").copy(),
            versions=rle_decode(runs), reward=reward,
            loss_mask=np.ones(rl, np.uint8) if mask is None else np.frombuffer(mask, "u1").copy(),
            finish_reason=fr, metadata=json.loads(md),
            recomputed_behav_logprobs=None if rec is None else np.frombuffer(rec, "<f4").copy(),
            routed_experts=routed_ids,
            teacher_logprobs=None if teacher is None else np.frombuffer(teacher, "<f4").copy()))
        if trajs[-1].min_version != min_v:
            raise bad(f"trajectory {uid!r} has versions from {trajs[-1].min_version}, recorded {min_v}")
    g = Group(gid, trajs)
    if (max(g.min_version, 0), max(g.max_version, 0)) != (gen_v, max_v):
        raise bad(f"versions {g.min_version}..{g.max_version} disagree with the group's recorded "
                  f"{gen_v}..{max_v}")
    return g


def load_groups(conn: sqlite3.Connection, seqs: Sequence[int]) -> list[Group]:
    """Decode the groups with these ``seq`` numbers, in the given order (see :func:`load_group`)."""
    return [load_group(conn, seq) for seq in seqs]


def quarantine_group(conn: sqlite3.Connection, seq: int, group_id: str, reason: str, now: float) -> bool:
    """Set a group aside (inside the caller's transaction); False if it already was."""
    row = conn.execute("SELECT state FROM groups WHERE seq=?", (seq,)).fetchone()
    if row is None or row[0] == "quarantined":
        return False
    conn.execute("INSERT OR REPLACE INTO quarantine VALUES (?, ?, ?, ?, ?)", (seq, group_id, row[0], reason, now))
    conn.execute("UPDATE groups SET state='quarantined' WHERE seq=?", (seq,))
    return True


def prune_groups(conn: sqlite3.Connection, seqs: Sequence[int]) -> None:
    """Drop the arrays of these groups, keeping their ids (idempotency) and counters (metrics)."""
    for seq in seqs:
        conn.execute("UPDATE trajectories SET prompt=NULL, response=NULL, logp=NULL, vruns=NULL, mask=NULL, "
                     f"recomputed=NULL, {'routed=NULL, ' if _has_routed(conn) else ''}"
                     f"{'teacher=NULL, ' if _has_column(conn, 'teacher') else ''}checksum=NULL "
                     "WHERE group_seq=?", (seq,))
        conn.execute("UPDATE groups SET pruned=1, nbytes=0 WHERE seq=?", (seq,))
