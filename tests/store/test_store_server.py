"""`m2po store serve`: auth, malformed payloads, version endpoint, client retries and encodings."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from megatron_m2po.store import RolloutStore, fifo
from megatron_m2po.store.client import AsyncStoreClient, StoreClient, StoreClientError
from megatron_m2po.store.codec import encode_binary, encode_json
from megatron_m2po.utils.net import free_port
from store_testlib import make_group, same_group, start_server, stop

TOKEN = "s3cret"


@pytest.fixture
def server(tmp_path):
    """A fresh server and store per test: tests set versions, which only move forward."""
    path = str(tmp_path / "s.sqlite")
    proc, url = start_server(path, token=TOKEN, extra=("--max-request-mb", "0.05"))
    yield path, url
    stop(proc)


def post(url, body: bytes, ctype="application/json", token=TOKEN, path="/v1/groups"):
    h = {"Content-Type": ctype}
    if token is not None:
        h["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url + path, data=body, method="POST", headers=h)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def n_groups(path):
    s = RolloutStore(path)
    try:
        return sum(s.counts().values())
    finally:
        s.close()


def test_auth(server):
    path, url = server
    body = encode_json([make_group("auth", 0)])
    before = n_groups(path)
    for tok in (None, "wrong", TOKEN + "x"):
        status, doc = post(url, body, token=tok)
        assert status == 401 and "bearer token" in doc["error"]
    with pytest.raises(StoreClientError, match="401"):
        StoreClient(url, token="wrong").stats()
    assert StoreClient(url, token=None, token_env="NO_SUCH_VAR").health() == {"status": "ok"}  # no auth on health
    assert n_groups(path) == before


def _traj(**kw):
    t = {"uid": "m/0", "prompt_ids": [1, 2], "response_ids": [3, 4, 5], "behav_logprobs": [-0.5, -0.1, -2.0],
         "versions": [0, 0, 0]}
    t.update(kw)
    return t


def _doc(*trajs, gid="m"):
    return json.dumps({"groups": [{"group_id": gid, "trajectories": list(trajs)}]}).encode()


MALFORMED = [
    ("bad json", b'{"groups": [', "application/json", 400, "not valid UTF-8 JSON"),
    ("NaN", _doc(_traj()).replace(b"-0.5", b"NaN"), "application/json", 400, "NaN is not allowed"),
    ("short logprobs", _doc(_traj(behav_logprobs=[-1.0, -1.0])), "application/json", 400,
     "behav_logprobs has 2 entries but response_ids has 3"),
    ("wrong type", _doc(_traj(prompt_ids="abc")), "application/json", 400, "prompt_ids must be a list of integers"),
    ("float ids", _doc(_traj(response_ids=[3, 4.5, 5])), "application/json", 400, r"response_ids[1]=4.5"),
    ("reward type", _doc(_traj(reward="high")), "application/json", 400, "reward='high'"),
    ("positive logprob", _doc(_traj(behav_logprobs=[-0.5, 0.3, -1.0])), "application/json", 400,
     "behav_logprobs[1]=0.3"),
    ("missing uid", _doc({k: v for k, v in _traj().items() if k != "uid"}), "application/json", 400,
     "missing the required field 'uid'"),
    ("unknown field", _doc(_traj(advantage=1.0)), "application/json", 400, "unknown field(s) ['advantage']"),
    ("bad mask", _doc(_traj(loss_mask=[1, 2, 1])), "application/json", 400, "loss_mask must hold only 0 and 1"),
    ("decreasing versions", _doc(_traj(versions=[0, 1, 0])), "application/json", 400, "versions decrease"),
    ("future versions", _doc(_traj(versions=9)), "application/json", 400, "versions reach 9, ahead"),
    ("empty groups", b'{"groups": []}', "application/json", 400, "non-empty list"),
    ("binary truncated", encode_binary([make_group("m", 0)])[:-5], "application/x-m2po-groups", 400, "lengths disagree"),
    ("binary trailing", encode_binary([make_group("m", 0)]) + b"x", "application/x-m2po-groups", 400, "trailing"),
    ("content type", encode_json([make_group("m", 0)]), "text/plain", 415, "Content-Type"),
    ("oversize", encode_json([make_group("m", 0, n=8, resp_len=2000)]), "application/json", 413, "exceeds the limit"),
    ("one bad group among good", json.dumps({"groups": [
        json.loads(encode_json([make_group("good", 0)]))["groups"][0],
        {"group_id": "m", "trajectories": [_traj(behav_logprobs=[-1.0])]}]}).encode(), "application/json", 400,
     "behav_logprobs has 1 entries"),
]


@pytest.mark.parametrize("name,body,ctype,status,msg", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_payload_is_refused_and_stores_nothing(server, name, body, ctype, status, msg):
    path, url = server
    StoreClient(url, token=TOKEN).set_version(3)
    before = n_groups(path)
    got, doc = post(url, body, ctype)
    assert got == status, doc
    assert msg in doc["error"], doc["error"]
    assert n_groups(path) == before


def test_ack_after_commit_idempotent_and_conflict(server):
    path, url = server
    c = StoreClient(url, token=TOKEN)
    c.set_version(5)
    groups = [make_group(f"ok{i}", 5, seed=i) for i in range(3)]
    assert c.put_groups(groups) == {"stored": ["ok0", "ok1", "ok2"], "duplicates": [], "pending": []}
    assert StoreClient(url, token=TOKEN, encoding="json").put_groups(groups[:2]) == {
        "stored": [], "duplicates": ["ok0", "ok1"], "pending": []}
    changed = make_group("ok0", 5, seed=0)
    changed.trajectories[0].reward = -3.0
    with pytest.raises(StoreClientError, match="409: group 'ok0' is already stored with different content"):
        c.put_groups([changed])
    # acknowledged means committed: a fresh handle on the file sees the groups, intact
    s = RolloutStore(path)
    try:
        lease = s.lease_exact(generated_at=5, n_groups=3)
        assert all(same_group(a, b) for a, b in zip(lease.groups, groups))
        s.release(lease)
    finally:
        s.close()
    m = c.stats()
    assert m["ingest"]["groups"] >= 3 and m["ingest"]["latency_s"]["max"] > 0


def test_version_endpoint(server):
    _, url = server
    c = StoreClient(url, token=TOKEN)
    c.set_version(11)
    assert c.get_version() == 11
    with pytest.raises(StoreClientError, match="409: version 4 is behind the recorded version 11"):
        c.set_version(4)
    status, doc = post(url, b'{"version": "7"}', path="/v1/version")
    assert status == 400 and "'version' must be an integer" in doc["error"]
    status, _ = post(url, b'{"version": 12}', token=None, path="/v1/version")
    assert status == 401


def test_async_client(server):
    _, url = server

    async def go():
        async with AsyncStoreClient(url, token=TOKEN, encoding="json") as c:
            await c.set_version(20)
            r = await c.put_groups([make_group("async0", 20), make_group("async1", 19)])
            with pytest.raises(StoreClientError, match="400"):
                await c.put_groups([make_group("async2", 25)])
            return r, await c.get_version()

    r, v = asyncio.run(go())
    assert r["stored"] == ["async0", "async1"] and v == 20


def test_4xx_is_not_retried(server):
    _, url = server
    c = StoreClient(url, token="bad", backoff_s=3.0, max_retries=3)
    t0 = time.monotonic()
    with pytest.raises(StoreClientError, match="401"):
        c.put_groups([make_group("x", 0)])
    assert time.monotonic() - t0 < 2.0  # not retried (backoff 3 s): elapsed time is the behaviour under test


def test_client_retries_until_server_is_up(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = {}
    c = StoreClient(url, token=TOKEN, backoff_s=0.1, backoff_max_s=0.5, max_retries=40)
    backing_off = threading.Event()
    delay = c._delay

    def counted_delay(attempt, retry_after):
        backing_off.set()
        return delay(attempt, retry_after)

    c._delay = counted_delay
    th = threading.Thread(target=lambda: out.update(r=c.put_groups([make_group("late", 0)])))
    th.start()
    assert backing_off.wait(60), "the client never failed to connect to the absent server"
    proc, _ = start_server(str(tmp_path / "late.sqlite"), token=TOKEN, port=port)
    try:
        th.join(30)
        assert out["r"]["stored"] == ["late"]
    finally:
        stop(proc)
    with pytest.raises(StoreClientError, match="failed after 3 attempts"):
        StoreClient(url, token=TOKEN, backoff_s=0.01, max_retries=2).health()


def test_refuses_to_start_without_token_and_warns_when_insecure(tmp_path):
    env_cmd = [sys.executable, "-m", "megatron_m2po.cli", "store", "serve", "--path", str(tmp_path / "n.sqlite"),
               "--port", "0", "--token-env", "NO_SUCH_TOKEN_VAR"]
    r = subprocess.run(env_cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no ingestion token" in r.stderr
    proc, url = start_server(str(tmp_path / "open.sqlite"), token=None, extra=("--insecure-no-auth",))
    try:
        assert StoreClient(url, token=None, token_env="NO_SUCH_VAR").put_groups([make_group("o", 0)])["stored"] == ["o"]
    finally:
        stop(proc)
    assert "WITHOUT AUTHENTICATION" in proc.startup_output


def test_stats_cli(tmp_path):
    path = str(tmp_path / "st.sqlite")
    s = RolloutStore(path)
    s.put_groups([make_group("a", 1), make_group("b", 2)])
    s.ack(s.lease(fifo(), n_groups=1, current_version=3))
    s.close()
    cmd = [sys.executable, "-m", "megatron_m2po.cli", "store", "stats", "--path", path]
    m = json.loads(subprocess.run(cmd + ["--json"], capture_output=True, text=True, check=True, timeout=60).stdout)
    assert m["groups"]["consumed"]["groups"] == 1 and m["groups"]["available"]["groups"] == 1
    assert m["staleness"]["groups"] == {"2": 1} and m["by_version"]["2"]["response_tokens"] == 11
    from megatron_m2po.store.cli import format_metrics

    assert "staleness at consumption: mean 2.0, max 2" in format_metrics(m)
    r = subprocess.run(cmd[:-1] + [str(tmp_path / "missing.sqlite")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no rollout store" in r.stderr
