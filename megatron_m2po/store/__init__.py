"""Staleness-tagged, durable rollout store (docs/design.md §3).

* :mod:`.types` — :class:`Trajectory` / :class:`Group` records (per-token weight versions).
* :mod:`.store` — :class:`RolloutStore`: the API and state machine; consumption policies
  :func:`exact_stale_k`, :func:`bounded`, :func:`fifo`; lease / ack; consumer cursor; metrics.
* :mod:`.sqlite` — the embedded SQLite backend (WAL, ``synchronous=FULL``, compact arrays).
* :mod:`.codec` — JSON and binary wire encodings of groups, strict decoding.
* ``m2po store serve`` (authenticated HTTP ingestion for external producers) lives in
  :mod:`megatron_m2po.ingestion`, with the producer API and the trainer's own endpoint.
* :mod:`.client` — :class:`StoreClient` / :class:`AsyncStoreClient` for producers.

Trainer side::

    store = RolloutStore(path)
    store.set_version(actor.version)                     # published to external producers
    lease = store.lease(exact_stale_k(k), n_groups=G, current_version=u, step=s)
    # or, before version k exists: store.lease_exact(generated_at=0, n_groups=G, current_version=u, step=s)
    train_on(lease.groups); store.ack(lease)
    extra_state["store_cursor"] = store.cursor_state()   # in the checkpoint
    ...
    store.restore_cursor(extra_state["store_cursor"])    # on resume: exact replay

The names below load their module on first use, so importing a section of the config
(``store/settings.py``) does not import the whole package."""

from __future__ import annotations

from megatron_m2po.utils.lazy import lazy_exports

_WHERE = {
    **{n: "store" for n in ('RolloutStore', 'Lease', 'PutResult', 'exact_stale_k', 'bounded', 'fifo', 'ExactStaleK', 'Bounded', 'Fifo', 'NotReadyError', 'ConflictError', 'StoreFullError', 'CorruptGroupError')},
    **{n: "types" for n in ('Group', 'Trajectory')},
}
__all__ = list(_WHERE)
__getattr__ = lazy_exports(__name__, _WHERE)
