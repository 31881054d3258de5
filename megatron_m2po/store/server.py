"""HTTP ingestion service for external rollout producers (``m2po store serve``).

Endpoints (all but ``/health`` need ``Authorization: Bearer <token>``):

=======================  ==================================================================
``GET  /health``         ``{"status": "ok"}`` — liveness, no auth, no data.
``POST /v1/groups``      a batch of groups, JSON or the binary framing of :mod:`.codec`
                         (by ``Content-Type``). Answers ``200 {"stored": [...],
                         "duplicates": [...], "pending": [...]}`` only after the SQLite
                         commit, so an acknowledged group is durable. Idempotent by id.
``GET  /v1/stats``       :meth:`RolloutStore.metrics`.
``GET  /v1/version``     ``{"version": v}``: the trainer's current weight version (null until set).
``POST /v1/version``     ``{"version": v}``: the trainer publishes its version.
=======================  ==================================================================

Errors are JSON ``{"error": message}`` naming the offending field: 400 malformed payload or
invalid trajectory (NaN, wrong lengths, versions ahead of the trainer's, wrong types), 401
missing / wrong token, 409 a known id with different content, 413 body over the size limit,
415 unknown content type, 429 store at capacity (with ``Retry-After``), 500 anything else.
A request that fails stores nothing.

Security: binds 127.0.0.1 unless told otherwise; refuses to start without a token unless
``--insecure-no-auth`` is given (then it warns loudly). Tokens are compared in constant time.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from aiohttp import web

from megatron_m2po.store.codec import PayloadError, decode_payload
from megatron_m2po.store.store import ConflictError, RolloutStore, StoreFullError

log = logging.getLogger(__name__)

__all__ = ["load_token", "build_app", "run_server"]


def load_token(token_env: str = "M2PO_STORE_TOKEN", token_file: str = "") -> Optional[str]:
    """The bearer token: the env var ``token_env`` if set and non-empty, else ``token_file``."""
    tok = os.environ.get(token_env, "").strip() if token_env else ""
    if tok:
        return tok
    if token_file:
        try:
            with open(token_file) as f:
                tok = f.read().strip()
        except OSError as e:
            raise ValueError(f"cannot read the store token file {token_file!r}: {e}") from None
        if not tok:
            raise ValueError(f"store token file {token_file!r} is empty")
        return tok
    return None


def _err(status: int, msg: str, **headers: str) -> web.Response:
    return web.json_response({"error": msg}, status=status, headers=headers or None)


def build_app(store: RolloutStore, *, token: Optional[str], max_request_bytes: int) -> web.Application:
    """The aiohttp application; store calls run on one worker thread (SQLite is blocking)."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-db")

    async def in_pool(fn: Callable, *a, **kw):
        return await asyncio.get_running_loop().run_in_executor(pool, lambda: fn(*a, **kw))

    @web.middleware
    async def auth(request: web.Request, handler):
        if token is not None and request.path != "/health":
            got = request.headers.get("Authorization", "")
            if not got.startswith("Bearer ") or not hmac.compare_digest(got[7:].strip().encode(), token.encode()):
                return _err(401, "missing or wrong bearer token (send 'Authorization: Bearer <token>')",
                            **{"WWW-Authenticate": "Bearer"})
        return await handler(request)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def post_groups(request: web.Request) -> web.Response:
        t0 = time.time()
        if request.content_length is not None and request.content_length > max_request_bytes:
            return _err(413, f"request body of {request.content_length} bytes exceeds the limit of "
                             f"{max_request_bytes} bytes; send smaller batches")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _err(413, f"request body exceeds the limit of {max_request_bytes} bytes; send smaller batches")
        try:
            groups = await in_pool(decode_payload, body, request.headers.get("Content-Type", ""))
            res = await in_pool(store.put_groups, groups, received_at=t0)
        except PayloadError as e:
            return _err(415 if str(e).startswith("Content-Type") else 400, str(e))
        except ConflictError as e:
            return _err(409, str(e))
        except StoreFullError as e:
            return _err(429, str(e), **{"Retry-After": "1"})
        except ValueError as e:
            return _err(400, str(e))
        except Exception as e:  # the store failed: the producer retries
            log.exception("ingestion failed")
            return _err(500, f"store error: {type(e).__name__}: {e}")
        return web.json_response(res.to_dict())

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(await in_pool(store.metrics))

    async def get_version(_: web.Request) -> web.Response:
        return web.json_response({"version": await in_pool(lambda: store.current_version)})

    async def post_version(request: web.Request) -> web.Response:
        try:
            doc = json.loads(await request.text())
        except (ValueError, UnicodeDecodeError) as e:
            return _err(400, f"body is not JSON: {e}")
        v = doc.get("version") if isinstance(doc, dict) else None
        if isinstance(v, bool) or not isinstance(v, int):
            return _err(400, f"'version' must be an integer, got {v!r}")
        try:
            await in_pool(store.set_version, v)
        except ValueError as e:
            return _err(409, str(e))
        return web.json_response({"version": v})

    async def on_cleanup(_: web.Application) -> None:
        pool.shutdown(wait=True)

    app = web.Application(middlewares=[auth], client_max_size=max_request_bytes)
    app.add_routes([web.get("/health", health), web.post("/v1/groups", post_groups), web.get("/v1/stats", stats),
                    web.get("/v1/version", get_version), web.post("/v1/version", post_version)])
    app.on_cleanup.append(on_cleanup)
    return app


def run_server(path: str, *, host: str = "127.0.0.1", port: int = 8765, token: Optional[str],
               insecure_no_auth: bool = False, max_request_mb: float = 256.0, synchronous: str = "FULL",
               capacity_groups: Optional[int] = None) -> None:
    """Serve until SIGINT / SIGTERM. Prints ``serving ... on http://HOST:PORT`` once listening."""
    if token is None and not insecure_no_auth:
        raise ValueError("no ingestion token: set the env var named by store.token_env (default M2PO_STORE_TOKEN) "
                         "or store.token_file; --insecure-no-auth serves without one (never on a shared network)")
    if token is None:
        print("WARNING: m2po store serve runs WITHOUT AUTHENTICATION (--insecure-no-auth): anyone who can "
              f"reach {host}:{port} can write training data", file=sys.stderr, flush=True)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"note: binding {host}: the store is reachable from other machines", file=sys.stderr, flush=True)
    store = RolloutStore(path, synchronous=synchronous, capacity_groups=capacity_groups)
    max_bytes = int(max_request_mb * 1024 * 1024)

    async def main() -> None:
        runner = web.AppRunner(build_app(store, token=token, max_request_bytes=max_bytes), access_log=None)
        await runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        site = web.SockSite(runner, sock)
        await site.start()
        bound = sock.getsockname()[1]
        print(f"m2po store: serving {path} on http://{host}:{bound}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        store.close()
