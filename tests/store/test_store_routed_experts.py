"""Routed experts in the store (MoE routing replay): compact storage, both wire encodings, the
layout recorded in the store file and checked on every put, from the trainer and from external
producers through ``m2po store serve``; bad routing is refused with a message naming it and
nothing of the put is stored."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from megatron_m2po.store import sqlite as db
from megatron_m2po.store.codec import decode_binary, decode_json, encode_binary, encode_json, PayloadError
from megatron_m2po.store.store import Fifo, RolloutStore
from megatron_m2po.store.types import Group, RoutingSpec
from store_testlib import make_group, same_group, start_server, stop

LAYERS, TOP_K, EXPERTS = 3, 2, 8
SPEC = RoutingSpec(LAYERS, TOP_K, EXPERTS, required=True)


def _routed(g: Group, seed: int = 0) -> Group:
    """``g`` with random distinct top-k ids per position and layer."""
    rng = np.random.default_rng(seed)
    for t in g.trajectories:
        n = t.num_tokens - 1
        t.routed_experts = np.argsort(rng.random((n, LAYERS, EXPERTS)), -1)[..., :TOP_K].astype(np.int32)
    return g


def _same_routing(a: Group, b: Group) -> bool:
    return all(np.array_equal(x.routed_experts, y.routed_experts) for x, y in zip(a.trajectories, b.trajectories))


def test_round_trip_through_both_encodings_and_sqlite(tmp_path):
    """JSON and binary encodings and the SQLite rows give back the ids exactly (uint16 on disk:
    2 bytes per id); the spec is recorded in the file, so a second handle on it (a store server)
    checks by the same rule."""
    g = _routed(make_group("r0", 0, n=3))
    for enc, dec in ((encode_json, decode_json), (encode_binary, decode_binary)):
        back = dec(enc([g]))[0]
        assert same_group(g, back) and _same_routing(g, back)
    path = str(tmp_path / "s.sqlite")
    s = RolloutStore(path, routing=SPEC)
    s.put_groups([g])
    assert RolloutStore(path).routing == SPEC
    lease = s.lease(Fifo(), n_groups=1)
    assert same_group(g, lease.groups[0]) and _same_routing(g, lease.groups[0])
    rows = sqlite3.connect(path).execute("SELECT routed FROM trajectories ORDER BY idx").fetchall()
    assert [len(r[0]) for r in rows] == [4 + 2 * (t.num_tokens - 1) * LAYERS * TOP_K for t in g.trajectories]
    s.close()


@pytest.mark.parametrize("damage,words", [
    (lambda t: t.routed_experts[:-1], r"shape \[\d+, 3, 2\], expected \[\d+, layers, top_k\]"),
    (lambda t: t.routed_experts[:, :2], "has 2 layers x 2 experts per token, the model has 3 layers x top_k=2"),
    (lambda t: np.where(t.routed_experts == t.routed_experts[0, 0, 0], EXPERTS, t.routed_experts),
     r"is not an expert id in \[0, 8\)"),
    (lambda t: np.concatenate([t.routed_experts[..., :1]] * 2, -1), "repeat an expert"),
    (lambda t: None, "routed_experts are missing"),
])
def test_bad_routing_is_refused_and_nothing_is_stored(tmp_path, damage, words):
    """Wrong row count, wrong layer count, an id out of range, a repeated id, or none at all while
    replay needs them: ValueError naming the trajectory and the fault; the good group of the same
    put is not stored either (a put is one transaction)."""
    s = RolloutStore(str(tmp_path / "s.sqlite"), routing=SPEC)
    good, bad = _routed(make_group("good", 0)), _routed(make_group("bad", 0), seed=1)
    t = bad.trajectories[1]
    t.routed_experts = damage(t)
    with pytest.raises(ValueError, match=words) as e:
        s.put_groups([good, bad])
    assert "trajectory 'bad/1'" in str(e.value)
    assert sum(s.counts().values()) == 0
    s.close()


def test_routing_is_optional_unless_required(tmp_path):
    """A store without a spec (or with ``required=False``) takes groups without routing; a group
    with routing is still checked for what holds for any model (rank, row count, distinct ids)."""
    s = RolloutStore(str(tmp_path / "s.sqlite"))
    s.put_groups([make_group("plain", 0)])
    s.set_routing(RoutingSpec(LAYERS, TOP_K, EXPERTS, required=False))
    s.put_groups([make_group("plain2", 0), _routed(make_group("r", 0))])
    s.set_routing(None)
    g = _routed(make_group("short", 0))
    g.trajectories[0].routed_experts = g.trajectories[0].routed_experts[1:]
    with pytest.raises(ValueError, match="trajectory 'short/0': routed_experts has shape"):
        s.put_groups([g])
    assert s.counts()["available"] == 3
    s.close()


def test_wire_decoding_refuses_malformed_routing():
    """The JSON and binary decoders refuse ragged / non-integer / oversized routing before any
    array is built, naming the field."""
    import json

    doc = json.loads(encode_json([_routed(make_group("w", 0, n=1))]))
    t = doc["groups"][0]["trajectories"][0]
    for bad in ([[[0, 1], [2]]] * 3, [[[0.5, 1]] * 3], "AAAA", [[[70000, 1]] * 3]):
        t["routed_experts"] = bad
        with pytest.raises(PayloadError, match=r"routed_experts"):
            decode_json(json.dumps(doc).encode())
    body = bytearray(encode_binary([_routed(make_group("b", 0, n=1))]))
    with pytest.raises(PayloadError, match="lengths disagree"):
        decode_binary(bytes(body[:-2]))


def test_schema_2_store_is_migrated_and_keeps_its_checksums(tmp_path):
    """A store written before routed experts (schema 2: no ``routed`` column) opens, its rows still
    pass their checksums, and new rows carry routing."""
    path = str(tmp_path / "old.sqlite")
    s = RolloutStore(path)
    s.put_groups([make_group("old", 0)])
    s.close()
    c = sqlite3.connect(path)
    c.execute("ALTER TABLE trajectories DROP COLUMN routed")
    c.execute("UPDATE meta SET value='2' WHERE key='schema_version'")
    c.commit()
    c.close()
    s = RolloutStore(path, routing=RoutingSpec(LAYERS, TOP_K, EXPERTS))
    s.put_groups([_routed(make_group("new", 0))])
    lease = s.lease(Fifo(), n_groups=2)
    assert [g.group_id for g in lease.groups] == ["old", "new"] and not lease.quarantined
    assert lease.groups[0].trajectories[0].routed_experts is None
    assert db.get_meta(s._conn, "schema_version") == str(db.SCHEMA_VERSION)
    s.close()


def test_external_producer_through_the_store_server(tmp_path):
    """``m2po store serve`` on a store whose trainer recorded the layout checks an external
    producer's groups by it: a bad one is a 400 naming it, a good one is stored with its routing."""
    from megatron_m2po.store.client import StoreClient, StoreClientError

    path = str(tmp_path / "s.sqlite")
    RolloutStore(path, routing=SPEC).close()
    proc, url = start_server(path, token="t0k")
    try:
        c = StoreClient(url, token="t0k")
        bad = _routed(make_group("ext_bad", 0))
        bad.trajectories[0].routed_experts = bad.trajectories[0].routed_experts[:, :1]
        with pytest.raises(StoreClientError, match="400.*ext_bad/0.*1 layers x 2 experts per token"):
            c.put_groups([bad])
        good = _routed(make_group("ext_good", 0), seed=4)
        c.put_groups([good])
    finally:
        stop(proc)
    s = RolloutStore(path)
    lease = s.lease(Fifo(), n_groups=1)
    assert [g.group_id for g in lease.groups] == ["ext_good"] and _same_routing(good, lease.groups[0])
    s.close()
