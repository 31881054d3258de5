"""The staleness-tagged rollout store: API, state machine and consumption policies.

Versions (docs/design.md §3): a weight *version* is the number of optimizer updates applied. Every
response token carries the version that produced it. A group's **generation version** is its
*minimum* token version — the version its rollouts started at (a partial rollout that spans a
weight update carries several versions; its oldest token decides its age). At an update ``u``
a group's staleness is ``u - generation version``.

Consumption policies (pass one to :meth:`RolloutStore.lease`):

* :func:`exact_stale_k` ``(k)`` — the step that starts at version ``u`` gets exactly groups
  generated at ``v = u - k``; never earlier, never other data. ``u < k`` is an error: until
  version ``k`` exists the trainer trains on base-model rollouts, which it asks for with
  :meth:`RolloutStore.lease_exact` ``(generated_at=0, ...)``.
* :func:`bounded` ``(max_staleness, order="oldest"|"freshest", retire=False)`` — any groups
  whose staleness is ``<= max_staleness``, oldest generation first or freshest first (arrival
  order within a version). Selecting an over-age group raises ``ValueError`` naming its uids and
  ages; with ``retire=True`` every over-age group is retired (counted in :meth:`metrics`) instead.
* :func:`fifo` — arrival order, no age rule.

Every policy serves whole groups, in a deterministic order, and refuses groups whose versions
are ahead of the ``current_version`` it is given.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Literal, Mapping, Optional, Union

import numpy as np

from megatron_m2po.store import sqlite as db
from megatron_m2po.store.codec import group_digest
from megatron_m2po.store.types import Group, RoutingSpec
from megatron_m2po.utils.faults import fault_point

if TYPE_CHECKING:
    from megatron_m2po.store.settings import StoreConfig

log = logging.getLogger(__name__)

__all__ = ["RolloutStore", "Lease", "PutResult", "Policy", "ExactStaleK", "Bounded", "Fifo",
           "exact_stale_k", "bounded", "fifo", "NotReadyError", "ConflictError", "StoreFullError",
           "CorruptGroupError"]


class NotReadyError(LookupError):
    """The store does not (yet) hold the data a lease asks for."""


class ConflictError(ValueError):
    """A group id or uid is already stored with different content."""


class StoreFullError(RuntimeError):
    """Accepting the put would exceed ``capacity_groups``; retry after the trainer consumed some."""


class CorruptGroupError(RuntimeError):
    """A lease recorded for replay holds a group whose stored data fails its integrity check."""

    def __init__(self, message: str, group_ids: list[str]):
        super().__init__(message)
        self.group_ids = group_ids


STATES = ("pending", "available", "leased", "consumed", "retired", "quarantined")


# ----------------------------------------------------------------------------- policies

@dataclass(frozen=True)
class ExactStaleK:
    k: int

    def spec(self) -> dict:
        return {"name": "exact_stale_k", "k": self.k}


@dataclass(frozen=True)
class Bounded:
    max_staleness: int
    order: Literal["oldest", "freshest"] = "oldest"
    retire: bool = False

    def spec(self) -> dict:
        return {"name": "bounded", "max_staleness": self.max_staleness, "order": self.order, "retire": self.retire}


@dataclass(frozen=True)
class Fifo:
    def spec(self) -> dict:
        return {"name": "fifo"}


@dataclass(frozen=True)
class _Exact:
    generated_at: int

    def spec(self) -> dict:
        return {"name": "exact", "generated_at": self.generated_at}


Policy = Union[ExactStaleK, Bounded, Fifo]


def exact_stale_k(k: int) -> ExactStaleK:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"exact_stale_k: k={k!r} must be an integer >= 0")
    return ExactStaleK(k)


def bounded(max_staleness: int, order: str = "oldest", retire: bool = False) -> Bounded:
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"bounded: max_staleness={max_staleness!r} must be an integer >= 0")
    if order not in ("oldest", "freshest"):
        raise ValueError(f"bounded: order={order!r} must be 'oldest' or 'freshest'")
    return Bounded(max_staleness, order, bool(retire))  # type: ignore[arg-type]


def fifo() -> Fifo:
    return Fifo()


# ----------------------------------------------------------------------------- records

@dataclass(slots=True)
class Lease:
    """Groups handed to the consumer; :meth:`RolloutStore.ack` consumes them.

    ``retired`` lists group ids this lease retired (bounded policy with ``retire=True``);
    ``replayed`` is True when the lease repeats a recorded one (after a restart or a cursor
    restore) — its groups and order are identical to the original. ``quarantined`` lists the
    group ids this lease found corrupt (failed checksum) and set aside instead of serving.
    """

    lease_id: int
    step: Optional[int]
    policy: dict
    n_groups: int
    current_version: Optional[int]
    generated_at: Optional[int]
    groups: list[Group]
    retired: list[str] = field(default_factory=list)
    replayed: bool = False
    quarantined: list[str] = field(default_factory=list)

    @property
    def uids(self) -> list[str]:
        return [t.uid for g in self.groups for t in g.trajectories]

    @property
    def staleness(self) -> list[Optional[int]]:
        """Per group: ``current_version - generation version`` (None without a current version)."""
        cv = self.current_version
        return [None if cv is None else cv - g.min_version for g in self.groups]


@dataclass(slots=True)
class PutResult:
    stored: list[str]
    duplicates: list[str]
    pending: list[str]  # stored but unscored (some reward is None): not served until set_rewards()

    def to_dict(self) -> dict:
        return {"stored": self.stored, "duplicates": self.duplicates, "pending": self.pending}


# ----------------------------------------------------------------------------- the store

class RolloutStore:
    """Durable, staleness-tagged store of prompt groups (SQLite, WAL).

    Lifecycle of a group::

        put_groups ──> pending ──set_rewards──> available ──lease──> leased ──ack──> consumed
        (all rewards set) ────────────────────> available      │          └─release──> available
                                                   └─(bounded, retire=True, over-age)──> retired
        pending / available ──(stored data fails its checksum when read)──> quarantined

    * **Ingest.** :meth:`put_groups` validates every group (lengths, finite log-probs <= 0,
      versions non-decreasing and not ahead of the current version) and then stores all of them
      in **one transaction**: a put is all-or-nothing, so a group is never half stored. Puts are
      idempotent by id: a group already stored with the same content is reported as a
      duplicate and not stored again; the same group id or a known trajectory uid with different
      content raises :class:`ConflictError`. Groups with an unscored trajectory (reward None)
      stay *pending* until :meth:`set_rewards` scores them all.
    * **Capacity.** With ``capacity_groups`` set, a put that would make more than that many
      unconsumed (pending, available, leased) groups raises :class:`StoreFullError` (HTTP 429):
      producer backpressure rather than silent dropping.
    * **Staleness.** Ages are computed at consumption from the consumer's ``current_version``
      (see the module docstring for the policies). Nothing is dropped silently: over-age data
      raises unless the policy retires it, and retired groups are counted.
    * **Lease / ack.** :meth:`lease` moves ``n_groups`` groups to *leased* and returns them;
      :meth:`ack` consumes them; :meth:`release` gives them back. A lease left open by a
      consumer that died is *recorded for replay*: the next consumer's matching lease gets the
      very same groups in the same order (an unmatching request releases them instead).
    * **Cursor.** Every lease is recorded in order. :meth:`cursor_state` (saved in the trainer
      checkpoint) names the consumption that happened so far; :meth:`restore_cursor` rewinds
      everything leased or acknowledged after it — those leases are replayed, identically and in
      order, to the resumed trainer's requests (a request that differs raises, since the run
      would no longer be a resume; :meth:`discard_replay` drops the recorded leases instead).
      Consumed data stays on disk until :meth:`prune_consumed` drops it.
    * **Integrity.** Each stored trajectory row carries a checksum (:mod:`.sqlite`), checked
      every time the group is read to be served (:meth:`lease`, :meth:`pending_groups`) or
      scored (:meth:`set_rewards`). A group that fails it is never handed out: it is
      *quarantined* (kept on disk, its id and the reason logged, in :meth:`metrics` under
      ``quarantined`` and in the lease's ``quarantined``), and the next candidate is served in
      its place. A lease recorded for replay whose group went bad raises
      :class:`CorruptGroupError` (it cannot be repeated identically).
    * **Versions.** :meth:`set_version` records the trainer's weight version (persisted; ``m2po
      store serve`` publishes it to external producers and checks incoming versions against it).

    One consumer at a time: the first lease / cursor call of a handle takes over leases left
    open by earlier handles. Any number of producer handles and processes may write.
    A handle is thread-safe.

    Example:
        >>> store = RolloutStore(path)                     # doctest: +SKIP
        >>> store.put_groups(groups)                       # producer side
        >>> lease = store.lease(exact_stale_k(2), n_groups=64, current_version=10, step=5)
        >>> batch = lease.groups                           # generated at version 8
        >>> store.ack(lease)
        >>> ckpt["store_cursor"] = store.cursor_state()
        >>> store.close()
    """

    def __init__(self, path: str, *, synchronous: str = "FULL", busy_timeout_s: float = 30.0,
                 capacity_groups: Optional[int] = None, allow_empty: bool = False, create: bool = True,
                 readonly: bool = False, routing: Optional[RoutingSpec] = None):
        if capacity_groups is not None and capacity_groups < 1:
            raise ValueError(f"capacity_groups={capacity_groups} must be >= 1 or None")
        self.path = str(path)
        self.capacity_groups = capacity_groups
        self.allow_empty = allow_empty
        self._conn = db.connect(self.path, synchronous=synchronous, busy_timeout_s=busy_timeout_s, create=create,
                                readonly=readonly)
        self._lock = threading.RLock()
        self._session = uuid.uuid4().hex
        self._claimed = False
        self._lat: list[float] = []
        self._ingest = {"puts": 0, "groups": 0, "duplicates": 0}
        self.store_id = db.get_meta(self._conn, "store_id")
        if routing is not None:
            self.set_routing(routing)

    @classmethod
    def from_config(cls, cfg: StoreConfig, run_dir: str = ".", **kw) -> "RolloutStore":
        """Open the store a :class:`~megatron_m2po.config.StoreConfig` describes."""
        return cls(cfg.path or os.path.join(run_dir, "rollouts.sqlite"), synchronous=cfg.synchronous, **kw)

    # -------------------------------------------------------------------- versions

    @property
    def current_version(self) -> Optional[int]:
        """The trainer's weight version as last recorded by :meth:`set_version` (None if never)."""
        with self._lock:
            v = db.get_meta(self._conn, "current_version")
        return None if v is None else int(v)

    def set_version(self, version: int, *, allow_rewind: bool = False) -> None:
        """Record the trainer's current weight version; it only moves forward unless ``allow_rewind``.

        A run resumed from a checkpoint older than the recorded version passes ``allow_rewind=True``
        (and may :meth:`retire_ahead` the data generated by the weights it lost).
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version={version!r} must be an integer >= 0")
        with self._lock, db.transaction(self._conn):
            old = db.get_meta(self._conn, "current_version")
            if old is not None and version < int(old) and not allow_rewind:
                raise ValueError(f"version {version} is behind the recorded version {old}; versions only "
                                 "move forward (a run resumed from an older checkpoint passes allow_rewind=True)")
            db.set_meta(self._conn, "current_version", str(version))

    def retire_ahead(self, version: int) -> list[str]:
        """Retire unconsumed groups with tokens newer than ``version`` (made by weights a resumed run lost).

        Groups held by leases recorded for replay are kept. Returns the retired group ids.
        """
        with self._lock, db.transaction(self._conn) as c:
            rows = c.execute("SELECT seq, group_id FROM groups WHERE state IN ('pending','available') AND max_version>? "
                             "ORDER BY seq", (version,)).fetchall()
            c.executemany("UPDATE groups SET state='retired', lease_id=NULL WHERE seq=?", [(r[0],) for r in rows])
        return [r[1] for r in rows]

    # -------------------------------------------------------------------- ingest

    def set_routing(self, spec: Optional[RoutingSpec]) -> None:
        """Record the routed-experts layout every later put is checked against (``types.RoutingSpec``:
        shape, expert-id range, required or not), in the store file, so a ``m2po store serve``
        process on the same file checks external producers' groups by the same rule."""
        with self._lock, db.transaction(self._conn) as c:
            if spec is None:
                c.execute("DELETE FROM meta WHERE key='routing_spec'")
            else:
                db.set_meta(c, "routing_spec", spec.to_json())

    @property
    def routing(self) -> Optional[RoutingSpec]:
        """The recorded routed-experts layout (:meth:`set_routing`), or None."""
        with self._lock:
            s = db.get_meta(self._conn, "routing_spec")
        return None if s is None else RoutingSpec.from_json(s)

    def put_groups(self, groups: Iterable[Group], *, current_version: Optional[int] = None,
                   received_at: Optional[float] = None) -> PutResult:
        """Validate and store groups in one transaction; returns once committed (durable).

        ``current_version`` bounds the token versions (default: the recorded version, if any).
        ``received_at`` (``time.time()`` of arrival, e.g. of an HTTP request) starts the ingest
        latency clock; by default the call itself.
        """
        t0 = time.time() if received_at is None else received_at
        groups = list(groups)
        if not groups:
            return PutResult([], [], [])
        cv = self.current_version if current_version is None else current_version
        routing = self.routing
        digests: dict[str, str] = {}
        uids: dict[str, str] = {}
        for g in groups:
            if not isinstance(g, Group):
                raise ValueError(f"put_groups takes Group records, got {type(g).__name__}")
            g.validate(current_version=cv, allow_empty=self.allow_empty, routing=routing)
            try:
                d = group_digest(g)
            except (TypeError, ValueError) as e:
                raise ValueError(f"group {g.group_id!r}: metadata must be JSON-serialisable with finite "
                                 f"numbers: {e}") from None
            if digests.setdefault(g.group_id, d) != d:
                raise ConflictError(f"group {g.group_id!r} appears twice in one put with different content")
            for t in g.trajectories:
                if uids.setdefault(t.uid, g.group_id) != g.group_id:
                    raise ConflictError(f"uid {t.uid!r} appears in groups {uids[t.uid]!r} and {g.group_id!r}")
        res = PutResult([], [], [])
        with self._lock, db.transaction(self._conn) as c:
            if self.capacity_groups is not None:
                # Re-sent groups already stored are duplicates (or conflicts), never capacity refusals.
                new_ids = [gid for gid in digests
                           if c.execute("SELECT 1 FROM groups WHERE group_id=?", (gid,)).fetchone() is None]
                (n,) = c.execute("SELECT COUNT(*) FROM groups WHERE state IN ('pending','available','leased')").fetchone()
                if new_ids and n + len(new_ids) > self.capacity_groups:
                    raise StoreFullError(f"store holds {n} unconsumed groups; {len(new_ids)} more would exceed "
                                         f"capacity_groups={self.capacity_groups} — retry after the trainer consumed some")
            done = set()
            for g in groups:
                if g.group_id in done:
                    continue
                done.add(g.group_id)
                row = c.execute("SELECT digest FROM groups WHERE group_id=?", (g.group_id,)).fetchone()
                if row is not None:
                    if row[0] != digests[g.group_id]:
                        raise ConflictError(f"group {g.group_id!r} is already stored with different content "
                                            "(a re-sent group must be byte-identical; use a new group id)")
                    res.duplicates.append(g.group_id)
                    continue
                hit = None
                all_uids = [t.uid for t in g.trajectories]
                for b in range(0, len(all_uids), 500):  # bounded statements: SQLite caps bound variables
                    chunk = all_uids[b:b + 500]
                    q = ",".join("?" * len(chunk))
                    hit = c.execute(f"SELECT t.uid, g.group_id FROM trajectories t JOIN groups g ON g.seq=t.group_seq "
                                    f"WHERE t.uid IN ({q}) LIMIT 1", chunk).fetchone()
                    if hit is not None:
                        break
                if hit is not None:
                    raise ConflictError(f"uid {hit[0]!r} of group {g.group_id!r} is already stored in group {hit[1]!r}")
                pending = any(t.reward is None for t in g.trajectories)
                db.insert_group(c, g, digest=digests[g.group_id], state="pending" if pending else "available",
                                now=time.time())
                res.stored.append(g.group_id)
                if pending:
                    res.pending.append(g.group_id)
            fault_point("store_commit")  # rows inserted, transaction open: a kill here must store nothing
        self._lat.append(time.time() - t0)
        self._lat = self._lat[-10000:]
        self._ingest["puts"] += 1
        self._ingest["groups"] += len(res.stored)
        self._ingest["duplicates"] += len(res.duplicates)
        return res

    def existing_group_ids(self, group_ids: Iterable[str]) -> set[str]:
        """The subset of ``group_ids`` already stored (in any state).

        A resumed trainer uses it to regenerate only the groups a crash kept from being stored.
        """
        ids = list(group_ids)
        found: set[str] = set()
        with self._lock:
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                q = "SELECT group_id FROM groups WHERE group_id IN (%s)" % ",".join("?" * len(chunk))
                found.update(r[0] for r in self._conn.execute(q, chunk))
        return found

    def quarantined_ids(self, prefix: str = "") -> list[str]:
        """Ids of the quarantined groups whose id starts with ``prefix`` (in detection order)."""
        with self._lock:
            return [r[0] for r in self._conn.execute(
                "SELECT group_id FROM groups WHERE state='quarantined' AND substr(group_id, 1, ?) = ? "
                "ORDER BY seq", (len(prefix), prefix))]

    def pending_groups(self, limit: Optional[int] = None) -> list[Group]:
        """Stored groups with unscored trajectories, in arrival order (for an external scorer)."""
        with self._lock, db.transaction(self._conn) as c:
            seqs = [r[0] for r in c.execute(
                "SELECT seq FROM groups WHERE state='pending' ORDER BY seq LIMIT ?", (limit or -1,))]
            bad: list[db.CorruptGroupError] = []
            groups = [self._verified(seq, bad) for seq in seqs]
        return [g for g in groups if g is not None]

    def set_rewards(self, rewards: Mapping[str, float]) -> list[str]:
        """Score pending trajectories by uid; returns the group ids that became available."""
        for uid, r in rewards.items():
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
                raise ValueError(f"reward of {uid!r} = {r!r} must be a finite number")
        out = []
        with self._lock, db.transaction(self._conn) as c:
            seqs = set()
            corrupt: set[int] = set()
            for uid, r in rewards.items():
                row = c.execute("SELECT t.group_seq, g.state, g.group_id FROM trajectories t JOIN groups g "
                                "ON g.seq=t.group_seq WHERE t.uid=?", (uid,)).fetchone()
                if row is None:
                    raise ValueError(f"set_rewards: uid {uid!r} is not in the store")
                if row[1] == "quarantined" or row[0] in corrupt:
                    continue  # set aside: its data is not trusted, scoring it changes nothing
                if row[1] != "pending":
                    raise ValueError(f"set_rewards: uid {uid!r} belongs to a {row[1]} group; only pending groups "
                                     "are scored (rewards of served data never change)")
                # The row checksum covers the reward: check the row as written, then rewrite both.
                cur = c.execute(f"SELECT {db.ROW_COLS}, routed, teacher, checksum FROM trajectories WHERE uid=?",
                                (uid,)).fetchone()
                blobs = db.checksum_blobs(cur[6:12], cur[12], cur[13])
                if db.row_checksum(*cur[:6], *blobs) != cur[-1]:
                    reason = f"trajectory {uid!r} fails its checksum (stored data changed since it was written)"
                    db.quarantine_group(c, row[0], row[2], reason, time.time())
                    log.error("rollout store %s: group %r quarantined while scoring: %s", self.path, row[2], reason)
                    corrupt.add(row[0])
                    continue
                c.execute("UPDATE trajectories SET reward=?, checksum=? WHERE uid=?",
                          (float(r), db.row_checksum(cur[0], cur[1], float(r), *cur[3:6], *blobs), uid))
                seqs.add(row[0])
            for seq in sorted(seqs - corrupt):
                (n_none,) = c.execute("SELECT COUNT(*) FROM trajectories WHERE group_seq=? AND reward IS NULL",
                                      (seq,)).fetchone()
                if n_none == 0:
                    c.execute("UPDATE groups SET state='available' WHERE seq=?", (seq,))
                    out.append(c.execute("SELECT group_id FROM groups WHERE seq=?", (seq,)).fetchone()[0])
        return out

    def set_teacher_logprobs(self, values: Mapping[str, np.ndarray]) -> int:
        """Store a distillation teacher's log-probs of the response tokens (``algo.distill.mode=sglang``)
        by uid, once: a trajectory that has them already keeps them (the same frozen teacher scored the
        same tokens; a resumed or replayed step reads what the first scoring wrote). Any state but
        quarantined or pruned. Returns how many rows were written. Each row's checksum is verified
        before and rewritten after, in one transaction."""
        written = 0
        with self._lock, db.transaction(self._conn) as c:
            for uid, v in values.items():
                arr = np.asarray(v, dtype=np.float32).reshape(-1)
                cols = ", ".join(f"t.{col}" for col in db.ROW_COLS.split(", "))
                cur = c.execute(f"SELECT {cols}, t.routed, t.teacher, t.checksum, t.group_seq, g.state, g.group_id "
                                "FROM trajectories t JOIN groups g ON g.seq=t.group_seq WHERE t.uid=?",
                                (uid,)).fetchone()
                if cur is None:
                    raise ValueError(f"set_teacher_logprobs: uid {uid!r} is not in the store")
                (*row, routed, teacher, cs, seq, state, gid) = cur
                if state == "quarantined" or row[7] is None:
                    continue  # set aside or pruned: nothing will train on it
                if teacher is not None:
                    continue
                if arr.size * 4 != len(row[7]):
                    raise ValueError(f"set_teacher_logprobs: {arr.size} log-probs for trajectory {uid!r} of "
                                     f"{len(row[7]) // 4} response tokens")
                if db.row_checksum(*row[:6], *db.checksum_blobs(row[6:12], routed)) != cs:
                    reason = f"trajectory {uid!r} fails its checksum (stored data changed since it was written)"
                    db.quarantine_group(c, seq, gid, reason, time.time())
                    log.error("rollout store %s: group %r quarantined while storing teacher log-probs: %s",
                              self.path, gid, reason)
                    continue
                blob = arr.astype("<f4").tobytes()
                c.execute("UPDATE trajectories SET teacher=?, checksum=? WHERE uid=?",
                          (blob, db.row_checksum(*row[:6], *db.checksum_blobs(row[6:12], routed, blob)), uid))
                written += 1
        return written

    # -------------------------------------------------------------------- consume

    def lease(self, policy: Policy, *, n_groups: int, current_version: Optional[int] = None,
              step: Optional[int] = None, timeout_s: float = 0.0) -> Lease:
        """Lease ``n_groups`` groups chosen by ``policy``.

        ``current_version`` is the version at the start of the consuming step (required by
        ``exact_stale_k`` and ``bounded``); ``step`` tags the lease in the consumption record.
        Waits up to ``timeout_s`` for the data, then raises :class:`NotReadyError`.
        """
        if policy is fifo:
            policy = Fifo()
        if not isinstance(policy, (ExactStaleK, Bounded, Fifo)):
            raise ValueError(f"policy must come from exact_stale_k(), bounded() or fifo(), got {policy!r}")
        if isinstance(policy, (ExactStaleK, Bounded)) and current_version is None:
            raise ValueError(f"{policy.spec()['name']} needs current_version (the version the step starts at)")
        gen = None
        if isinstance(policy, ExactStaleK):
            gen = current_version - policy.k
            if gen < 0:
                raise ValueError(f"exact_stale_k({policy.k}) at version {current_version}: data for this step would be "
                                 f"generated at version {gen}, which never existed; until version {policy.k} the "
                                 "trainer consumes base-model rollouts via lease_exact(generated_at=0, ...)")
        return self._lease(policy, gen, n_groups, current_version, step, timeout_s)

    def lease_exact(self, *, generated_at: int, n_groups: int, current_version: Optional[int] = None,
                    step: Optional[int] = None, timeout_s: float = 0.0) -> Lease:
        """Lease ``n_groups`` groups generated at exactly version ``generated_at`` (arrival order)."""
        if isinstance(generated_at, bool) or not isinstance(generated_at, int) or generated_at < 0:
            raise ValueError(f"generated_at={generated_at!r} must be an integer >= 0")
        if current_version is not None and generated_at > current_version:
            raise ValueError(f"generated_at={generated_at} is ahead of current_version={current_version}")
        return self._lease(_Exact(generated_at), generated_at, n_groups, current_version, step, timeout_s)

    def _lease(self, policy, gen, n_groups, cv, step, timeout_s) -> Lease:
        if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1:
            raise ValueError(f"n_groups={n_groups!r} must be an integer >= 1")
        spec = policy.spec()
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                self._claim()
                lease = self._replay_or_select(policy, spec, gen, n_groups, cv, step)
            if isinstance(lease, Lease):
                return lease
            if time.monotonic() >= deadline:
                raise NotReadyError(lease)
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _replay_or_select(self, policy, spec, gen, n_groups, cv, step):
        bad: list[db.CorruptGroupError] = []
        try:
            return self._replay_or_select_txn(policy, spec, gen, n_groups, cv, step, bad)
        except BaseException:
            if bad:  # the transaction rolled back: set the corrupt groups aside all the same
                with db.transaction(self._conn) as c:
                    for e in bad:
                        db.quarantine_group(c, e.seq, e.group_id, e.reason, time.time())
            raise

    def _verified(self, seq: int, bad: list) -> Optional[Group]:
        """The group, or None after quarantining it (inside the open transaction) when it is corrupt."""
        try:
            return db.load_group(self._conn, seq)
        except db.CorruptGroupError as e:
            bad.append(e)
            if db.quarantine_group(self._conn, e.seq, e.group_id, e.reason, time.time()):
                log.error("rollout store %s: group %r quarantined, not served: %s", self.path, e.group_id, e.reason)
            return None

    def _replay_or_select_txn(self, policy, spec, gen, n_groups, cv, step, bad):
        c = self._conn
        with db.transaction(c):
            row = c.execute("SELECT lease_id, step, policy, n_groups, current_version, generated_at, replay_reason "
                            "FROM leases WHERE state='replay' ORDER BY lease_id LIMIT 1").fetchone()
            if row is not None:
                lid, r_step, r_spec, r_n, r_cv, r_gen, reason = row
                want = (json.loads(r_spec), r_n, r_cv, r_step)
                got = (spec, n_groups, cv, step)
                if want == got:
                    c.execute("UPDATE leases SET state='open', owner=?, replay_reason=NULL WHERE lease_id=?",
                              (self._session, lid))
                    seqs = [r[0] for r in c.execute("SELECT group_seq FROM lease_groups WHERE lease_id=? AND "
                                                    "role='served' ORDER BY pos", (lid,))]
                    groups = [self._verified(sq, bad) for sq in seqs]
                    if bad:
                        raise CorruptGroupError(
                            f"lease {lid}, recorded for replay, holds group(s) "
                            f"{[e.group_id for e in bad]} whose stored data fails its integrity check "
                            f"({bad[0].reason}); they are quarantined and the lease cannot be repeated "
                            "identically — call discard_replay() to drop the recorded consumption",
                            [e.group_id for e in bad])
                    return self._lease_record(lid, replayed=True, groups=groups)
                if reason == "restore":
                    raise ValueError(
                        f"resumed consumer asked for policy={spec} n_groups={n_groups} current_version={cv} step={step}, "
                        f"but after the restored cursor lease {lid} was policy={want[0]} n_groups={r_n} "
                        f"current_version={r_cv} step={r_step}; a resume must repeat the same requests "
                        "(or call discard_replay() to drop the recorded consumption)")
                self._release_rows(lid)  # a lease of a dead consumer that nobody asks for again
            avail = self._candidates(policy, gen)
            retire: list[tuple] = []
            if isinstance(policy, Bounded):
                over = [r for r in avail if cv - r[2] > policy.max_staleness]
                if policy.retire:
                    retire = sorted(over, key=lambda r: (r[2], r[0]))  # oldest first, then arrival
                    avail = [r for r in avail if cv - r[2] <= policy.max_staleness]
            where = f"generated at version {gen}" if gen is not None else f"under {spec}"
            if len(avail) < n_groups:
                return (f"store holds {len(avail)} available groups {where}, lease asks for {n_groups} "
                        f"(current_version={cv}, step={step})")
            # Integrity on read: every group is checked before it is served; a corrupt one is
            # quarantined and the next candidate takes its place.
            chosen, loaded = [], []
            for r in avail:
                if len(chosen) == n_groups:
                    break
                g = self._verified(r[0], bad)
                if g is not None:
                    chosen.append(r)
                    loaded.append(g)
            if len(chosen) < n_groups:
                return (f"store holds {len(chosen)} available groups {where} after quarantining "
                        f"{[e.group_id for e in bad]} (stored data fails its checksum), lease asks for {n_groups} "
                        f"(current_version={cv}, step={step})")
            if isinstance(policy, Bounded) and not policy.retire:
                bad = [r for r in chosen if cv - r[2] > policy.max_staleness]
                if bad:
                    desc = "; ".join(f"group {r[1]!r} (uids {self._uids(r[0])}) generated at version {r[2]} is "
                                     f"{cv - r[2]} updates old" for r in bad[:5])
                    raise ValueError(f"over-age data at current_version={cv}, max_staleness={policy.max_staleness}: "
                                     f"{desc}{' ...' if len(bad) > 5 else ''} ({len(bad)} groups); raise the bound, "
                                     "produce fresher data, or use bounded(..., retire=True)")
            if cv is not None:
                ahead = [r for r in chosen if r[3] > cv]
                if ahead:
                    r = ahead[0]
                    raise ValueError(f"group {r[1]!r} (uids {self._uids(r[0])}) has tokens of version {r[3]}, ahead of "
                                     f"current_version={cv}: the consumer's version is wrong or the producer lied")
            cur = c.execute("INSERT INTO leases (step, policy, n_groups, current_version, generated_at, state, owner, "
                            "created_at) VALUES (?,?,?,?,?,'open',?,?)",
                            (step, json.dumps(spec), n_groups, cv, gen, self._session, time.time()))
            lid = cur.lastrowid
            for pos, r in enumerate(chosen):
                c.execute("UPDATE groups SET state='leased', lease_id=? WHERE seq=?", (lid, r[0]))
                c.execute("INSERT INTO lease_groups VALUES (?, 'served', ?, ?)", (lid, pos, r[0]))
            for pos, r in enumerate(retire):
                c.execute("UPDATE groups SET state='retired', lease_id=? WHERE seq=?", (lid, r[0]))
                c.execute("INSERT INTO lease_groups VALUES (?, 'retired', ?, ?)", (lid, pos, r[0]))
            return self._lease_record(lid, replayed=False, groups=loaded, quarantined=[e.group_id for e in bad])

    def _candidates(self, policy, gen) -> list[tuple]:
        q = "SELECT seq, group_id, gen_version, max_version FROM groups WHERE state='available'"
        if gen is not None:
            return self._conn.execute(q + " AND gen_version=? ORDER BY seq", (gen,)).fetchall()
        if isinstance(policy, Bounded) and policy.order == "freshest":
            return self._conn.execute(q + " ORDER BY gen_version DESC, seq").fetchall()
        if isinstance(policy, Bounded):
            return self._conn.execute(q + " ORDER BY gen_version, seq").fetchall()
        return self._conn.execute(q + " ORDER BY seq").fetchall()

    def _uids(self, seq: int) -> str:
        u = [r[0] for r in self._conn.execute("SELECT uid FROM trajectories WHERE group_seq=? ORDER BY idx", (seq,))]
        return ", ".join(u[:4]) + (f", ... ({len(u)})" if len(u) > 4 else "")

    def _lease_record(self, lid: int, *, replayed: bool, groups: list[Group],
                      quarantined: Optional[list[str]] = None) -> Lease:
        c = self._conn
        step, spec, n, cv, gen = c.execute("SELECT step, policy, n_groups, current_version, generated_at FROM leases "
                                           "WHERE lease_id=?", (lid,)).fetchone()
        retired = [r[0] for r in c.execute("SELECT g.group_id FROM lease_groups l JOIN groups g ON g.seq=l.group_seq "
                                           "WHERE l.lease_id=? AND l.role='retired' ORDER BY l.pos", (lid,))]
        return Lease(lid, step, json.loads(spec), n, cv, gen, groups, retired, replayed, quarantined or [])

    def _release_rows(self, lid: int) -> None:
        self._conn.execute("UPDATE groups SET state='available', lease_id=NULL WHERE lease_id=? AND state='leased'",
                           (lid,))
        self._conn.execute("UPDATE leases SET state='released', replay_reason=NULL WHERE lease_id=?", (lid,))

    def _claim(self) -> None:
        """Take over as the consumer: leases left open by earlier handles are recorded for replay."""
        if not self._claimed:
            with db.transaction(self._conn):
                self._conn.execute("UPDATE leases SET state='replay', replay_reason='restart' "
                                   "WHERE state='open' AND owner<>?", (self._session,))
            self._claimed = True

    def _lease_state(self, lease: Lease) -> str:
        row = self._conn.execute("SELECT state FROM leases WHERE lease_id=?", (lease.lease_id,)).fetchone()
        if row is None:
            raise ValueError(f"lease {lease.lease_id} is unknown to this store")
        return row[0]

    def ack(self, lease: Lease) -> None:
        """Consume the leased groups (durable on return). Acknowledging twice is a no-op."""
        with self._lock, db.transaction(self._conn) as c:
            st = self._lease_state(lease)
            if st == "acked":
                return
            if st != "open":
                raise ValueError(f"lease {lease.lease_id} is {st}, not open: it was released, or rewound by "
                                 "restore_cursor()/a restart — lease again to get its groups")
            c.execute("UPDATE groups SET state='consumed' WHERE lease_id=? AND state='leased'", (lease.lease_id,))
            c.execute("UPDATE leases SET state='acked', acked_at=? WHERE lease_id=?", (time.time(), lease.lease_id))

    def release(self, lease: Lease) -> None:
        """Give the leased groups back (available again); retired groups stay retired."""
        with self._lock, db.transaction(self._conn):
            st = self._lease_state(lease)
            if st != "open":
                raise ValueError(f"lease {lease.lease_id} is {st}; only an open lease can be released")
            self._release_rows(lease.lease_id)

    # -------------------------------------------------------------------- cursor

    def cursor_state(self) -> dict:
        """JSON-serialisable consumption position, to save with the trainer checkpoint."""
        with self._lock:
            self._claim()
            c = self._conn
            (last,) = c.execute("SELECT COALESCE(MAX(lease_id), 0) FROM leases WHERE state='acked'").fetchone()
            holes = [r[0] for r in c.execute("SELECT lease_id FROM leases WHERE lease_id<=? AND state IN "
                                             "('open','replay') ORDER BY lease_id", (last,))]
        return {"store_id": self.store_id, "acked_through": int(last), "unacked": holes,
                "version": self.current_version}

    def _rewind_set(self, state: Mapping) -> set[int]:
        if not isinstance(state, Mapping) or not {"store_id", "acked_through", "unacked"} <= set(state):
            raise ValueError(f"not a rollout store cursor: {state!r}")
        if state["store_id"] != self.store_id:
            raise ValueError(f"cursor belongs to store {state['store_id']!r}, this is {self.store_id!r} ({self.path})")
        last = int(state["acked_through"])
        (mx,) = self._conn.execute("SELECT COALESCE(MAX(lease_id), 0) FROM leases").fetchone()
        if last > mx:
            raise ValueError(f"cursor is at lease {last} but the store has recorded only {mx} leases")
        return {r[0] for r in self._conn.execute(
            "SELECT lease_id FROM leases WHERE (lease_id>? OR lease_id IN (%s)) AND state IN ('open','acked','replay')"
            % (",".join("?" * len(state["unacked"])) or "NULL"), (last, *[int(x) for x in state["unacked"]]))}

    def restore_cursor(self, state: Mapping, *, strict: bool = True) -> int:
        """Rewind consumption to ``state``; the leases after it are served again, identically.

        The recorded weight version goes back to the one saved in the cursor (the resumed trainer
        republishes its versions from there). Returns the number of leases recorded for replay.
        ``strict=False`` (a run restarted from the base model, whose config may have changed): a
        request that differs from the next recorded lease releases that lease instead of raising.
        """
        with self._lock:
            self._claim()
            c = self._conn
            with db.transaction(c):
                ids = sorted(self._rewind_set(state))
                for lid in ids:
                    for (gid,) in c.execute("SELECT g.group_id FROM lease_groups l JOIN groups g ON g.seq=l.group_seq "
                                            "WHERE l.lease_id=? AND l.role='served' AND g.pruned=1", (lid,)):
                        raise ValueError(f"cannot restore: group {gid!r} consumed by lease {lid} after the cursor was "
                                         "pruned; prune_consumed() must only get cursors of checkpoints you keep")
                    c.execute("UPDATE groups SET state='leased' WHERE lease_id=? AND state='consumed'", (lid,))
                    c.execute("UPDATE leases SET state='replay', replay_reason=?, acked_at=NULL "
                              "WHERE lease_id=?", ("restore" if strict else "restart", lid))
                if state.get("version") is not None:
                    db.set_meta(c, "current_version", str(int(state["version"])))
        return len(ids)

    def has_replay(self) -> bool:
        """Whether a lease recorded for replay waits to be asked for again."""
        with self._lock:
            self._claim()
            return self._conn.execute("SELECT 1 FROM leases WHERE state='replay' LIMIT 1").fetchone() is not None

    def count_available(self, *, generated_at: Optional[int] = None) -> int:
        """Available groups (generated at exactly ``generated_at`` when given)."""
        q, args = "SELECT COUNT(*) FROM groups WHERE state='available'", ()
        if generated_at is not None:
            q, args = q + " AND gen_version=?", (generated_at,)
        with self._lock:
            return int(self._conn.execute(q, args).fetchone()[0])

    def discard_replay(self) -> int:
        """Drop leases recorded for replay; their groups become available. Returns how many."""
        with self._lock, db.transaction(self._conn) as c:
            ids = [r[0] for r in c.execute("SELECT lease_id FROM leases WHERE state='replay'")]
            for lid in ids:
                self._release_rows(lid)
        return len(ids)

    def prune_consumed(self, state: Mapping) -> int:
        """Delete the arrays of groups consumed or retired at or before cursor ``state``.

        Call it with the cursor of the oldest checkpoint you may still resume from. Ids and
        counters stay (idempotency and metrics). Returns the number of groups pruned.
        """
        with self._lock, db.transaction(self._conn) as c:
            later = self._rewind_set(state)
            seqs = [r[0] for r in c.execute(
                "SELECT g.seq, g.lease_id FROM groups g JOIN leases l ON l.lease_id=g.lease_id "
                "WHERE g.state IN ('consumed','retired') AND g.pruned=0 AND l.lease_id<=?",
                (int(state["acked_through"]),)) if r[1] not in later]
            seqs += [r[0] for r in c.execute("SELECT seq FROM groups WHERE state='retired' AND lease_id IS NULL "
                                             "AND pruned=0")]  # retire_ahead(): never served, never replayed
            db.prune_groups(c, seqs)
        return len(seqs)

    # -------------------------------------------------------------------- metrics

    def counts(self) -> dict[str, int]:
        """Number of groups in each state."""
        with self._lock:
            rows = dict(self._conn.execute("SELECT state, COUNT(*) FROM groups GROUP BY state").fetchall())
        return {s: int(rows.get(s, 0)) for s in STATES}

    def metrics(self) -> dict:
        """Counters (JSON-serialisable): states, versions, staleness at consumption, bytes, latency."""
        with self._lock:
            c = self._conn
            by_state = {s: {"groups": 0, "trajectories": 0, "response_tokens": 0}
                        for s in STATES}
            for s, ng, nt, nr in c.execute("SELECT state, COUNT(*), SUM(n_traj), SUM(n_response_tokens) FROM groups "
                                           "GROUP BY state"):
                by_state[s] = {"groups": ng, "trajectories": nt, "response_tokens": nr}
            by_version = {str(v): {"trajectories": t, "prompt_tokens": p, "response_tokens": r} for v, t, p, r in
                          c.execute("SELECT version, trajectories, prompt_tokens, response_tokens FROM version_stats "
                                    "ORDER BY version")}
            tok_hist: dict[int, int] = {}
            grp_hist: dict[int, int] = {}
            for cv, gv, vruns in c.execute(
                    "SELECT l.current_version, g.gen_version, g.vruns FROM leases l JOIN lease_groups lg "
                    "ON lg.lease_id=l.lease_id AND lg.role='served' JOIN groups g ON g.seq=lg.group_seq "
                    "WHERE l.state='acked' AND l.current_version IS NOT NULL"):
                grp_hist[cv - gv] = grp_hist.get(cv - gv, 0) + 1
                for v, n in json.loads(vruns):
                    tok_hist[cv - v] = tok_hist.get(cv - v, 0) + n
            ntok = sum(tok_hist.values())
            (nbytes,) = c.execute("SELECT COALESCE(SUM(nbytes), 0) FROM groups").fetchone()
            leases = dict(c.execute("SELECT state, COUNT(*) FROM leases GROUP BY state").fetchall())
            has_q = c.execute("SELECT 1 FROM sqlite_master WHERE name='quarantine'").fetchone() is not None
            quarantined = [{"group_id": g, "was": w, "reason": r, "at": t} for g, w, r, t in c.execute(
                "SELECT group_id, prev_state, reason, detected_at FROM quarantine ORDER BY detected_at DESC "
                "LIMIT 20")] if has_q else []
            lat = sorted(self._lat)
        size = lambda p: os.path.getsize(p) if os.path.exists(p) else 0  # noqa: E731
        pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None  # noqa: E731
        return {
            "current_version": self.current_version,
            "groups": by_state,
            "by_version": by_version,
            "staleness": {
                "tokens": {str(k): v for k, v in sorted(tok_hist.items())},
                "groups": {str(k): v for k, v in sorted(grp_hist.items())},
                "mean": (sum(k * v for k, v in tok_hist.items()) / ntok) if ntok else None,
                "max": max(tok_hist) if tok_hist else None,
            },
            "retired": by_state["retired"],
            "quarantined": {**by_state["quarantined"], "latest": quarantined},
            "bytes": {"arrays": int(nbytes), "db_file": size(self.path), "wal_file": size(self.path + "-wal")},
            "leases": {s: int(leases.get(s, 0)) for s in ("open", "acked", "replay", "released")},
            "ingest": {**self._ingest, "latency_s": {"mean": sum(lat) / len(lat) if lat else None,
                                                     "p50": pct(0.5), "p99": pct(0.99),
                                                     "max": lat[-1] if lat else None}},
        }

    # -------------------------------------------------------------------- lifetime

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None  # type: ignore[assignment]

    def __enter__(self) -> "RolloutStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
