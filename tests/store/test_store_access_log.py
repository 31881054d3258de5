"""The ingestion server's request logs: counted by default, printed only behind a debug switch."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request

import pytest
from aiohttp import ClientSession, web

from megatron_m2po.store import RolloutStore
from megatron_m2po.ingestion.server import build_app
from megatron_m2po.utils.logging import setup_logging
from store_testlib import start_server, stop

TOKEN = "s3cret"
N = 5


def _get(url: str, path: str, token: str | None = None) -> bytes:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read()


@pytest.mark.parametrize("switch", [False, True])
def test_store_serve_counts_requests_and_logs_them_only_on_request(tmp_path, switch):
    proc, url = start_server(str(tmp_path / "s.sqlite"), token=TOKEN, extra=("--access-log",) if switch else ())
    try:
        for _ in range(N):
            _get(url, "/health")
        stats = json.loads(_get(url, "/v1/stats", TOKEN))
    finally:
        stop(proc)
    out = proc.stdout.read()
    assert stats["server/requests"] == N + 1, stats  # the N probes and the stats request itself
    access = [line for line in out.splitlines() if "GET /health" in line]
    assert len(access) == (N if switch else 0), out


@pytest.mark.parametrize("switch", [False, True])
def test_trainer_console_has_access_lines_only_with_logging_access_log(tmp_path, capsys, switch):
    """The trainer's own server is an ``AppRunner`` with aiohttp's default access logger
    (ingestion/endpoint.py); ``setup_logging(access_log=...)`` (``logging.access_log``) decides."""
    root = logging.getLogger()
    saved = (root.level, list(root.handlers), logging.getLogger("aiohttp.access").level)
    setup_logging(0, access_log=switch)
    store = RolloutStore(str(tmp_path / "s.sqlite"))

    async def run() -> dict:
        runner = web.AppRunner(build_app(store, token=TOKEN, max_request_bytes=2**20))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with ClientSession() as s:
                for _ in range(N):
                    async with s.get(url + "/health") as r:
                        assert r.status == 200
                async with s.get(url + "/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                    return await r.json()
        finally:
            await runner.cleanup()

    try:
        stats = asyncio.run(run())
    finally:
        store.close()
        root.handlers[:] = saved[1]
        root.setLevel(saved[0])
        logging.getLogger("aiohttp.access").setLevel(saved[2])
    err = capsys.readouterr().err
    assert stats["server/requests"] == N + 1, stats
    access = [line for line in err.splitlines() if "GET /health" in line]
    assert len(access) == (N if switch else 0), err
