"""Issue 17: ingestion that no producer can break.

Every hostile request below must be answered with a 4xx naming the field (never a 5xx), store
nothing, and leave the server's memory bounded. ``SENT`` counts the adversarial requests and
``FIVE_XX`` the 5xx answers seen (must stay 0).
"""

from __future__ import annotations

import http.client
import json
import struct
import urllib.error
import urllib.parse
import urllib.request

import psutil
import pytest

from megatron_m2po.store import RolloutStore
from megatron_m2po.store.client import StoreClient, StoreClientError
from megatron_m2po.store.codec import (MAX_GROUPS_PER_REQUEST, MAX_ID_CHARS, MAX_JSON_BYTES, MAX_JSON_CONTAINERS,
                                       MAX_JSON_STRINGS, MAX_TRAJECTORIES_PER_GROUP, encode_binary, encode_json,
                                       group_to_dict)
from store_testlib import make_group, same_group, start_server, stop
from waiting import wait_until

TOKEN = "h0stile"
# What any request below may add to the server's peak resident memory (idle: the CLI imports
# torch through the config, ~300 MiB). The worst known request adds ~120 MiB
# (tools/store_worst_request.py: 8 MiB of JSON floats).
RSS_BOUND = 192 * 1024 * 1024
STATS = {"sent": 0, "5xx": 0, "peak_rss": 0, "peak_added": 0}
_IDLE: dict[int, int] = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hostile") / "h.sqlite")
    proc, url = start_server(path, token=TOKEN, extra=("--max-request-mb", "8", "--capacity-groups", "3"))
    rss(psutil.Process(proc.pid))  # its idle peak
    yield path, url, psutil.Process(proc.pid)
    stop(proc)
    print(f"\nhostile requests sent: {STATS['sent']}, 5xx: {STATS['5xx']}, "
          f"peak server RSS: {STATS['peak_rss'] / 2**20:.1f} MiB ({STATS['peak_added'] / 2**20:.1f} MiB over idle)")


def post(url, body: bytes, ctype="application/json", token=TOKEN, path="/v1/groups", hostile=True):
    h = {"Content-Type": ctype}
    if token is not None:
        h["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url + path, data=body, method="POST", headers=h)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, doc = r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        status, doc = e.code, json.loads(e.read())
    if hostile:
        STATS["sent"] += 1
        STATS["5xx"] += status >= 500
    return status, doc


def _peak(proc) -> int:
    """The kernel's peak-RSS mark (VmHWM): no sampling can miss a short peak; RSS where absent."""
    try:
        with open(f"/proc/{proc.pid}/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return proc.memory_info().rss


def rss(proc) -> int:
    """Peak resident memory the requests so far added to this server (over its idle peak)."""
    r = _peak(proc)
    _IDLE.setdefault(proc.pid, r)
    STATS["peak_rss"] = max(STATS["peak_rss"], r)
    STATS["peak_added"] = max(STATS["peak_added"], r - _IDLE[proc.pid])
    return r - _IDLE[proc.pid]


def n_groups(path) -> int:
    s = RolloutStore(path)
    try:
        return sum(s.counts().values())
    finally:
        s.close()


def one_traj_doc(gid="h", **over):
    d = group_to_dict(make_group(gid, 0, n=1))
    d["trajectories"][0].update(over)
    return {"groups": [d]}


def refused(server, doc_or_body, *needles, status=400, ctype="application/json"):
    path, url, proc = server
    before = n_groups(path)
    body = doc_or_body if isinstance(doc_or_body, bytes) else json.dumps(doc_or_body).encode()
    st, doc = post(url, body, ctype=ctype)
    assert st == status, (st, doc)
    for n in needles:
        assert n in doc["error"], (n, doc["error"])
    assert n_groups(path) == before
    assert rss(proc) < RSS_BOUND
    return doc["error"]


def test_version_runs_checked_before_expansion(server):
    d = one_traj_doc("runs", versions={"runs": [[0, 10**9]]})
    body = json.dumps(d).encode()
    assert len(body) < 1000
    refused(server, d, "versions", "1000000000", "runs")
    refused(server, one_traj_doc("runs2", versions={"runs": [[0, 10**18], [0, 10**18]]}), "versions")
    # the binary framing: runs declaring 10^9 tokens for a 5-token response
    g = make_group("binruns", 0, n=1)
    b = bytearray(encode_binary([g]))
    t = g.trajectories[0]
    off = len(b) - t.loss_mask.size - 16  # the single (version, count) run precedes the loss mask
    assert struct.unpack_from("<qq", b, off) == (0, t.response_ids.size)
    struct.pack_into("<qq", b, off, 0, 10**9)
    refused(server, bytes(b), "versions", "1000000000", ctype="application/x-m2po-groups")


def test_logprob_fields_finite_and_nonpositive(server):
    r = make_group("lp", 0, n=1).trajectories[0].response_ids.size
    for bad, needle in ((0.5, "0.5"), (1e39, "inf")):
        refused(server, one_traj_doc("lp", recomputed_behav_logprobs=[bad] + [-0.1] * (r - 1)),
                "recomputed_behav_logprobs[0]", needle)
        refused(server, one_traj_doc("lp", behav_logprobs=[bad] + [-0.1] * (r - 1)), "behav_logprobs[0]")
    for literal in (b"NaN", b"Infinity"):
        body = json.dumps(one_traj_doc("lp", recomputed_behav_logprobs=[-1.0] * r)).encode()
        body = body.replace(b"-1.0", literal, 1)
        refused(server, body, literal.decode())


def test_huge_integers_are_400_naming_the_field(server):
    r = make_group("big", 0, n=1).trajectories[0].response_ids.size
    refused(server, one_traj_doc("big", versions=2**63), "versions", str(2**63))
    refused(server, one_traj_doc("big", versions=[2**63] * r), "versions[0]", "int64")
    refused(server, one_traj_doc("big", reward=10**400), "reward", "401 digits")
    refused(server, one_traj_doc("big", behav_logprobs=[-(10**400)] * r), "behav_logprobs[0]", "401 digits")
    refused(server, one_traj_doc("big", prompt_ids=[10**400]), "prompt_ids[0]", "401 digits")
    refused(server, one_traj_doc("big", versions=10**400), "versions", "401 digits")
    refused(server, one_traj_doc("big", reward=10**39), "reward", "float range")  # 40 digits: converted, refused
    _, url, _ = server
    st, doc = post(url, json.dumps({"version": 2**63}).encode(), path="/v1/version")
    assert st == 400 and "version" in doc["error"]


def test_group_and_request_size_limits(server):
    path, url, proc = server
    g = group_to_dict(make_group("wide", 0, n=1))
    t = g["trajectories"][0]
    n = MAX_TRAJECTORIES_PER_GROUP + 1
    g["trajectories"] = [{**t, "uid": f"wide/{i}"} for i in range(n)]
    refused(server, {"groups": [g]}, "trajectories", str(n), str(MAX_TRAJECTORIES_PER_GROUP))
    m = MAX_GROUPS_PER_REQUEST + 1
    refused(server, {"groups": [{"group_id": f"x{i}", "trajectories": []} for i in range(m)]},
            "groups", str(m), str(MAX_GROUPS_PER_REQUEST))


def test_large_group_uid_lookup_is_batched(tmp_path):
    """A group with more trajectories than SQLite's bound-variable limit stores fine."""
    s = RolloutStore(str(tmp_path / "s.sqlite"))
    try:
        res = s.put_groups([make_group("many", 0, n=MAX_TRAJECTORIES_PER_GROUP, resp_len=1)])
        assert res.stored == ["many"]
        assert s.put_groups([make_group("many", 0, n=MAX_TRAJECTORIES_PER_GROUP, resp_len=1)]).duplicates == ["many"]
    finally:
        s.close()


def test_metadata_depth_and_size_limited(server):
    deep: dict = {}
    cur = deep
    for _ in range(500):
        cur["a"] = {}
        cur = cur["a"]
    refused(server, one_traj_doc("md", metadata=deep), "metadata", "nested", "16")
    refused(server, one_traj_doc("md", metadata={"x": "y" * 100_000}), "metadata", "65536")


def test_json_parse_is_bounded_before_it_allocates(open_server):
    """What the JSON parser itself would build is bounded: size, nesting, integer literals, ids."""
    path, url, proc = open_server
    srv = open_server
    # the worst JSON for the parser (~25 bytes of objects per byte) just over the JSON limit: 413
    # before parsing, although the request limit (24 MiB) would take it
    n = MAX_JSON_BYTES // 3 + 1
    body = b'{"groups": [' + b"[]," * n + b"[]]}"
    refused(srv, body, str(MAX_JSON_BYTES), "binary framing", status=413)
    # the constructs that cost the parser most per byte are counted in the raw bytes first
    refused(srv, b'{"groups": [' + b"[]," * MAX_JSON_CONTAINERS + b"[]]}", "arrays and objects",
            str(MAX_JSON_CONTAINERS))
    refused(srv, b'{"groups": [' + b'"ab",' * MAX_JSON_STRINGS + b'"ab"]}', "strings", str(MAX_JSON_STRINGS))
    # nesting deeper than the parser's recursion: 400, nothing else
    refused(srv, b'{"groups": ' + b"[" * 100_000, "nested too deeply")
    refused(srv, b'{"groups": [{"group_id": "d", "trajectories": [' + b"{\"a\": " * 100_000, "nested too deeply")
    # integer literals longer than any field takes are refused before Python converts them
    r = make_group("h", 0, n=1).trajectories[0].response_ids.size
    body = json.dumps(one_traj_doc("digits", reward=0)).encode().replace(b'"reward": 0', b'"reward": ' + b"9" * 200_000)
    refused(srv, body, "reward", "200000 digits", "limit of 40")
    refused(srv, one_traj_doc("digits", behav_logprobs=[-(10**50)] * r), "behav_logprobs[0]", "51 digits")
    # floats beyond the float range parse as inf and are refused by the field
    body = json.dumps(one_traj_doc("flt", reward=0.5)).encode().replace(b"0.5", b"1e999999")
    refused(srv, body, "reward", "finite")
    # ids are bounded (they are echoed in every message and stored as keys)
    refused(srv, one_traj_doc("uid", uid="u" * (MAX_ID_CHARS + 1)), "uid", str(MAX_ID_CHARS))
    # an error message never echoes a large value back
    err = refused(srv, one_traj_doc("echo", finish_reason=["x" * 10] * 100_000), "finish_reason")
    assert len(err) < 500
    # POST /v1/version is small and never 5xx
    for body, code in ((b"[" * 5000, 413), (b"[" * 900, 400), (b"{\"version\": " + b"9" * 500 + b"}", 400),
                       (b"{\"version\": 1" + b"0" * 30 + b"}", 400), (b"\xff\xfe", 400)):
        st, doc = post(url, body, path="/v1/version")
        assert st == code, (body[:20], st, doc)


def test_request_bytes_in_flight_are_bounded(tmp_path):
    """Bodies being received count against a budget (2x the request limit): beyond it, 429."""
    import socket
    path = str(tmp_path / "inflight.sqlite")
    proc, url = start_server(path, token=TOKEN, extra=("--max-request-mb", "4", "--body-timeout-s", "600"))
    u = urllib.parse.urlparse(url)
    socks = []
    try:
        limit = 4 * 2**20
        for _ in range(2):  # two uploads that declare the limit and stall: the budget is held
            sk = socket.create_connection((u.hostname, u.port), timeout=30)
            sk.sendall(b"POST /v1/groups HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                       + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(limit).encode()
                       + b"\r\n\r\n{")
            socks.append(sk)
        body = encode_json([make_group("fits", 0, n=1)])
        doc = wait_until(lambda: (lambda r: r if r[0] == 429 else None)(post(url, body)),
                         what="a 429 while two stalled uploads hold the in-flight budget", timeout=120)
        assert "in flight" in doc[1]["error"] and "retry" in doc[1]["error"], doc
        for sk in socks:
            sk.close()
        st, doc = wait_until(lambda: (lambda r: r if r[0] == 200 else None)(post(url, body, hostile=False)),
                             what="the budget released after the stalled uploads closed", timeout=120)
        assert doc["stored"] == ["fits"]
        assert proc.poll() is None
    finally:
        for sk in socks:
            sk.close()
        stop(proc)


def _raw(url, data: bytes) -> bytes:
    import socket
    u = urllib.parse.urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as sk:
        sk.sendall(data)
        out = b""
        while b"\r\n" not in out:  # the status line is all we need
            chunk = sk.recv(65536)
            if not chunk:
                break
            out += chunk
    STATS["sent"] += 1
    return out


def test_malformed_http_framing_is_4xx(server):
    _, url, proc = server
    head = (b"POST /v1/groups HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
            + b"\r\nContent-Type: application/json\r\n")
    for raw in (head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
                head + b"Transfer-Encoding: chunked\r\n\r\n" + b"f" * 40 + b"\r\nabc\r\n",
                head + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabcXX0\r\n\r\n",
                head + b"Content-Length: -5\r\n\r\n{}",
                head + b"Content-Length: 99999999999999999999999999\r\n\r\n{}",
                head + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                head + b"X-Long: " + b"a" * 100_000 + b"\r\n\r\n",
                b"POST /v1/groups HTTP/1.1\r\n" + b"X: y\r\n" * 20_000 + b"\r\n"):
        out = _raw(url, raw)
        status = int(out.split(b" ", 2)[1])
        STATS["5xx"] += status >= 500
        assert 400 <= status < 500, (raw[:80], out[:200])
    assert rss(proc) < RSS_BOUND


def test_non_utf8_authorization_header_is_401(server):
    _, url, _ = server
    u = urllib.parse.urlparse(url)
    for raw in (b"Bearer \xff\xfe\x80", b"\xc3\x28", b"Bearer " + TOKEN.encode() + b"\xff"):
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        try:
            conn.putrequest("GET", "/v1/version")
            conn.putheader("Authorization", raw)
            conn.endheaders()
            resp = conn.getresponse()
            STATS["sent"] += 1
            STATS["5xx"] += resp.status >= 500
            assert resp.status in (400, 401), (raw, resp.status, resp.read())
        finally:
            conn.close()


def test_resend_at_capacity_is_duplicate_and_conflict_is_409(server):
    path, url, _ = server
    c = StoreClient(url, token=TOKEN)
    gs = [make_group(f"cap{i}", 0) for i in range(3)]
    free = 3 - sum(v for k, v in RolloutStore(path).counts().items() if k in ("pending", "available", "leased"))
    st, doc = post(url, encode_json(gs[:max(free, 0)]), hostile=False) if free > 0 else (200, {})
    assert st == 200
    # the store is now at capacity: a re-send is a duplicate, a new group a 429
    st, doc = post(url, encode_json(gs[:1]))
    assert st == 200 and doc["duplicates"] == ["cap0"], doc
    st, doc = post(url, encode_json([make_group("cap-new", 0)]))
    assert st == 429, doc
    # same id, different content -> 409, and the client does not retry a 4xx
    other = make_group("cap0", 0, seed=1)
    st, doc = post(url, encode_json([other]))
    assert st == 409 and "cap0" in doc["error"], doc
    with pytest.raises(StoreClientError, match="409"):
        c.put_groups([other])
    assert STATS["5xx"] == 0


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    """No capacity limit: every valid group must be stored. Requests up to 24 MiB (over the JSON limit)."""
    path = str(tmp_path_factory.mktemp("hyp") / "h.sqlite")
    proc, url = start_server(path, token=TOKEN, extra=("--max-request-mb", "24"))
    rss(psutil.Process(proc.pid))  # its idle peak
    yield path, url, psutil.Process(proc.pid)
    stop(proc)


# The property tests run derandomized: the same 60 generated cases on every run, so CI stays
# reproducible; to search further, change derandomize to False and raise max_examples locally.
@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_hypothesis_malformed_and_valid_groups(open_server):
    pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    path, url, proc = open_server
    version = 2
    st_, ans = post(url, json.dumps({"version": version}).encode(), path="/v1/version", hostile=False)
    assert st_ == 200, ans

    base = group_to_dict(make_group("hyp", version, n=1))["trajectories"][0]
    r = len(base["response_ids"])
    junk = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5),
                     st.lists(st.integers(-3, 3), max_size=4), st.dictionaries(st.text(max_size=3), st.none(), max_size=2))
    bad_fields = {
        "versions": st.one_of(junk, st.just({"runs": [[version, 10**12]]}), st.just(2**63),
                              st.just([version + 10**15] * r)),
        "behav_logprobs": st.one_of(junk, st.just([0.5] * r), st.just([-(10**400)] * r), st.just([-0.1] * (r + 1))),
        "recomputed_behav_logprobs": st.one_of(st.just([1.0] * r), st.just([1e39] * r), st.just([-0.1] * (r - 1))),
        "reward": st.one_of(st.just(10**400), st.text(max_size=3), st.just([1])),
        "prompt_ids": st.one_of(st.just([]), st.just([-1]), st.just([2**31]), st.just([10**400])),
        "metadata": st.one_of(st.just([1]), st.just({"x": "y" * 70_000}), st.just(json.loads("[" * 40 + "]" * 40))),
        "finish_reason": st.one_of(st.just("boom"), st.integers()),
        "uid": st.one_of(st.just(""), st.integers()),
    }
    seen_valid: set[str] = set()
    counter = iter(range(10**9))

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(field=st.sampled_from(sorted(bad_fields)), data=st.data(), with_bad=st.booleans(),
           n_good=st.integers(0, 2), binary=st.booleans())
    def check(field, data, with_bad, n_good, binary):
        i = next(counter)
        good = [make_group(f"hyp{i}-{k}", data.draw(st.integers(0, version)), n=data.draw(st.integers(1, 3)),
                           resp_len=data.draw(st.integers(1, 20)), seed=i) for k in range(n_good)]
        if not with_bad and not good:
            with_bad = True
        gdocs = [group_to_dict(g) for g in good]
        if with_bad:
            gid = f"hyp{i}-bad"
            t = {**base, "uid": f"{gid}/0", "group_id": gid}
            val = data.draw(bad_fields[field])
            if field == "versions" and isinstance(val, int) and not isinstance(val, bool) and 0 <= val <= version:
                val = 2**63  # a scalar version inside the range is valid: force an invalid one
            if field in ("reward",) and val is None:
                val = "x"
            t[field] = val
            gdocs.insert(data.draw(st.integers(0, len(gdocs))), {"group_id": gid, "trajectories": [t]})
        before = n_groups(path)
        if binary and not with_bad:
            st_, ans = post(url, encode_binary(good), ctype="application/x-m2po-groups")
        else:
            st_, ans = post(url, json.dumps({"groups": gdocs}).encode())
        if with_bad:  # one invalid group refuses the whole request: nothing stored
            assert 400 <= st_ < 500 and st_ != 429, (field, st_, ans)
            assert n_groups(path) == before, (field, ans)
        else:
            ids = [g.group_id for g in good]
            assert st_ == 200 and ans["stored"] == ids, ans
            assert not seen_valid & set(ids)
            seen_valid.update(ids)
            assert n_groups(path) == before + len(good)
            st_, ans = post(url, encode_json(good), hostile=False)  # a re-send stores nothing again
            assert st_ == 200 and ans["duplicates"] == ids and ans["stored"] == [], ans
            assert n_groups(path) == before + len(good)
            stored = _read_back(path, ids)
            for g in good:
                assert same_group(stored[g.group_id], g)
        assert rss(proc) < RSS_BOUND

    check()
    assert STATS["5xx"] == 0
    print(f"\nafter the property test: hostile requests sent: {STATS['sent']}, 5xx: {STATS['5xx']}, "
          f"peak server RSS: {STATS['peak_rss'] / 2**20:.1f} MiB ({STATS['peak_added'] / 2**20:.1f} MiB over idle)")


def _read_back(path, ids) -> dict:
    import sqlite3

    from megatron_m2po.store import sqlite as db
    conn = sqlite3.connect(path)
    try:
        return {gid: db.load_group(conn, conn.execute("SELECT seq FROM groups WHERE group_id=?", (gid,)).fetchone()[0])
                for gid in ids}
    finally:
        conn.close()


@pytest.mark.slow  # over 10 s on the CI machine under load: the full suite's lane
def test_hypothesis_mutated_binary_bodies(open_server):
    """Bytes of a valid binary body flipped, overwritten, cut or appended: 200 (stored exactly once,
    as decoded) or 4xx (nothing stored), never 5xx, memory bounded."""
    pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    path, url, proc = open_server
    counter = iter(range(10**9))
    stored_before: set[str] = set()

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(data=st.data())
    def check(data):
        i = next(counter)
        body = bytearray(encode_binary([make_group(f"bin{i:07d}-{k}", 0, n=2, resp_len=4, seed=i) for k in range(2)]))
        for _ in range(data.draw(st.integers(1, 4))):
            op = data.draw(st.sampled_from(["flip", "set", "cut", "append", "len"]))
            pos = data.draw(st.integers(0, len(body) - 1))
            if op == "flip":
                body[pos] ^= 1 << data.draw(st.integers(0, 7))
            elif op == "set":
                body[pos] = data.draw(st.integers(0, 255))
            elif op == "cut":
                del body[pos:]
                if not body:
                    body += b"M"
            elif op == "append":
                body += data.draw(st.binary(max_size=64))
            else:  # header_len or a declared count overwritten with a large value
                if len(body) < 12:  # a body cut short grows back to hold the field
                    body += bytes(12 - len(body))
                struct.pack_into("<I", body, 8, data.draw(st.integers(0, 2**32 - 1)))
        before = n_groups(path)
        st_, ans = post(url, bytes(body), ctype="application/x-m2po-groups")
        assert st_ == 200 or (400 <= st_ < 500 and st_ != 429), (st_, ans)
        if st_ == 200:
            new = set(ans["stored"])
            assert not new & stored_before and not set(ans["duplicates"]) - stored_before, ans
            stored_before.update(new)
            assert n_groups(path) == before + len(new)
        else:
            assert n_groups(path) == before, ans
        assert rss(proc) < RSS_BOUND

    check()
    assert STATS["5xx"] == 0


def test_versions_within_known_range_even_before_first_version(tmp_path):
    """Before the trainer publishes a version only version 0 exists; after, versions <= current."""
    path = str(tmp_path / "v.sqlite")
    proc, url = start_server(path, token=TOKEN)
    try:
        srv = (path, url, psutil.Process(proc.pid))
        rss(srv[2])
        refused(srv, {"groups": [group_to_dict(make_group("far", 10**15, n=1))]}, "versions reach", str(10**15),
                "version 0")
        st, doc = post(url, encode_json([make_group("v0", 0, n=1)]), hostile=False)
        assert st == 200 and doc["stored"] == ["v0"]
        st, _ = post(url, json.dumps({"version": 3}).encode(), path="/v1/version", hostile=False)
        assert st == 200
        refused(srv, {"groups": [group_to_dict(make_group("v4", 4, n=1))]}, "versions reach 4", "version 3")
        st, doc = post(url, encode_json([make_group("v3", 3, n=1)]), hostile=False)
        assert st == 200 and doc["stored"] == ["v3"]
    finally:
        stop(proc)


def test_producer_and_trainer_roles(tmp_path):
    path = str(tmp_path / "roles.sqlite")
    (tmp_path / "producer").write_text("prod-tok\n")
    (tmp_path / "trainer").write_text("train-tok\n")
    proc, url = start_server(path, token=None, extra=("--producer-token-file", str(tmp_path / "producer"),
                                                      "--trainer-token-file", str(tmp_path / "trainer")))
    try:
        assert "no role separation" not in proc.startup_output
        st, doc = post(url, json.dumps({"version": 1}).encode(), token="prod-tok", path="/v1/version")
        assert st == 403 and "trainer token" in doc["error"], doc
        with pytest.raises(StoreClientError, match="403"):
            StoreClient(url, token="prod-tok").set_version(1)
        assert StoreClient(url, token="prod-tok").get_version() is None
        StoreClient(url, token="train-tok").set_version(1)
        assert StoreClient(url, token="prod-tok").get_version() == 1
        st, doc = post(url, encode_json([make_group("r1", 1, n=1)]), token="prod-tok", hostile=False)
        assert st == 200 and doc["stored"] == ["r1"]
        st, _ = post(url, encode_json([make_group("r2", 1, n=1)]), token="nope")
        assert st == 401
    finally:
        stop(proc)
    # a single token: both roles, and the server says so at start-up
    proc, url = start_server(str(tmp_path / "one.sqlite"), token=TOKEN)
    try:
        assert "no role separation" in proc.startup_output
    finally:
        stop(proc)


def _cli(*args, env=None):
    import os
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "megatron_m2po.cli", "store", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "M2PO_STORE_TOKEN": TOKEN, **(env or {})})


def test_stats_is_read_only_and_backup_is_consistent_while_serving(tmp_path):
    import hashlib
    path = tmp_path / "live.sqlite"
    proc, url = start_server(str(path), token=TOKEN)
    try:
        c = StoreClient(url, token=TOKEN)
        for i in range(5):
            c.put_groups([make_group(f"b{i}", 0, n=4, resp_len=200)])
        before = hashlib.sha256(path.read_bytes()).hexdigest()
        r = _cli("stats", "--path", str(path), "--json")
        assert r.returncode == 0, r.stderr
        assert sum(v["groups"] for v in json.loads(r.stdout)["groups"].values()) == 5
        assert hashlib.sha256(path.read_bytes()).hexdigest() == before  # stats wrote nothing
        # copying the file alone is not a backup: acknowledged groups still live in the WAL
        import shutil
        import sqlite3
        shutil.copy(path, tmp_path / "copy.sqlite")
        conn = sqlite3.connect(str(tmp_path / "copy.sqlite"))
        try:
            n_copied = conn.execute("SELECT COUNT(*) FROM groups").fetchone()[0]
        except sqlite3.DatabaseError:
            n_copied = 0  # not even the schema reached the main file yet
        conn.close()
        assert n_copied < 5
        out = tmp_path / "backup.sqlite"
        r = _cli("backup", "--path", str(path), "--out", str(out))
        assert r.returncode == 0 and "integrity ok" in r.stdout, r.stdout + r.stderr
        c.put_groups([make_group("after", 0)])
    finally:
        stop(proc)
    b = RolloutStore(str(out))
    try:
        assert b.existing_group_ids([f"b{i}" for i in range(5)] + ["after"]) == {f"b{i}" for i in range(5)}
    finally:
        b.close()


def test_stalled_body_and_idle_connections_are_closed(tmp_path):
    import socket
    path = str(tmp_path / "stall.sqlite")
    proc, url = start_server(path, token=TOKEN, extra=("--body-timeout-s", "1", "--idle-timeout-s", "1"))
    try:
        u = urllib.parse.urlparse(url)
        # a body that never completes: 408, then the server closes the connection
        with socket.create_connection((u.hostname, u.port), timeout=30) as sk:
            sk.sendall(b"POST /v1/groups HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() +
                       b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"groups\": [")
            data = b""
            while True:  # read until the server closes (bounded by the socket timeout)
                chunk = sk.recv(65536)
                if not chunk:
                    break
                data += chunk
            STATS["sent"] += 1
            assert data.startswith(b"HTTP/1.1 408"), data[:200]
            assert b"stalled" in data
        # an idle keep-alive connection: closed by the server
        with socket.create_connection((u.hostname, u.port), timeout=30) as sk:
            sk.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while True:
                chunk = sk.recv(65536)
                if not chunk:
                    break
                data += chunk
            assert data.startswith(b"HTTP/1.1 200")
        assert n_groups(path) == 0
    finally:
        stop(proc)


def test_version_answered_while_a_large_push_is_written(tmp_path):
    import threading
    import time
    path = str(tmp_path / "big.sqlite")
    proc, url = start_server(path, token=TOKEN, extra=("--max-request-mb", "96"))
    try:
        c = StoreClient(url, token=TOKEN)
        big = make_group("big", 0, n=4, resp_len=1_500_000)  # ~54 MiB binary
        done = threading.Event()
        result = {}

        def push():
            try:
                result["res"] = StoreClient(url, token=TOKEN).put_groups([big])
            finally:
                done.set()

        th = threading.Thread(target=push)
        th.start()
        slowest, polls_during = 0.0, 0
        while not done.is_set():
            t0 = time.monotonic()  # elapsed time is the behaviour under test
            assert c.get_version() is None
            dt = time.monotonic() - t0  # elapsed time is the behaviour under test
            if not done.is_set():
                polls_during += 1
                slowest = max(slowest, dt)
        th.join()
        assert result["res"]["stored"] == ["big"]
        assert polls_during > 0
        assert slowest < 1.0, f"GET /v1/version took {slowest:.2f} s during a large push"
    finally:
        stop(proc)
