"""HTTP ingestion service for external rollout producers (``m2po store serve``).

Endpoints (all but ``/health`` need ``Authorization: Bearer <token>``). Two roles: the
*producer* token pushes groups and reads the version and stats; the *trainer* token may do
everything, and only it may ``POST /v1/version`` (a producer token gets 403). ``m2po store
serve --producer-token-file F --trainer-token-file G`` (or ``$M2PO_STORE_TOKEN`` /
``$M2PO_STORE_TRAINER_TOKEN``); without a trainer token one token serves both roles and the
server says so at start-up:

=======================  ==================================================================
``GET  /health``         ``{"status": "ok"}`` — liveness, no auth, no data.
``POST /v1/groups``      a batch of groups, JSON or the binary framing of :mod:`megatron_m2po.store.codec`
                         (by ``Content-Type``). Answers ``200 {"stored": [...],
                         "duplicates": [...], "pending": [...]}`` only after the SQLite
                         commit, so an acknowledged group is durable. Idempotent by id.
                         With a group filter (the trainer's ``rollout.filter``) also
                         ``"filtered": [...]``: acknowledged, never stored.
``GET  /v1/stats``       :meth:`RolloutStore.metrics`.
``GET  /v1/version``     ``{"version": v}``: the trainer's current weight version (null until set).
``POST /v1/version``     ``{"version": v}``: the trainer publishes its version.
=======================  ==================================================================

Errors are JSON ``{"error": message}`` naming the offending field: 400 malformed payload or
invalid trajectory (NaN, wrong lengths, versions ahead of the trainer's — before the trainer
published a version only version 0 is accepted —, wrong types, sizes over the limits of
:mod:`megatron_m2po.store.codec`: groups per request, trajectories per group, tokens per array, metadata depth
and size; declared sizes are checked before anything is allocated), 401
missing / wrong token, 403 a producer token on a trainer route, 408 a body that stalls, 409 a
known id with different content, 413 body over the size limit (or JSON over
:data:`~megatron_m2po.store.codec.MAX_JSON_BYTES`: larger batches use the binary framing), 415 unknown content
type, 429 store at capacity or too many request bytes in flight (with ``Retry-After``), 500 a
failure of the store itself (never for anything a client sends). A request that fails stores
nothing.

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
from aiohttp.http_exceptions import HttpProcessingError

from megatron_m2po.store.codec import PayloadError, PayloadTooLarge, decode_payload
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


TRAINER_ROUTES = {("POST", "/v1/version")}


def build_app(store: RolloutStore, *, token: Optional[str], max_request_bytes: int,
              trainer_token: Optional[str] = None, body_timeout_s: float = 60.0,
              max_inflight_bytes: Optional[int] = None,
              group_filter: Optional[Callable[[list], tuple[list, list]]] = None) -> web.Application:
    """The aiohttp application; store calls run on one worker thread (SQLite is blocking).

    Memory: at most ``max_inflight_bytes`` (default twice ``max_request_bytes``) of request
    bodies are held at once (more gets 429 + ``Retry-After``), and one body at a time is decoded
    and stored, JSON at most :data:`~megatron_m2po.store.codec.MAX_JSON_BYTES` of it.

    Roles: ``token`` is the *producer* credential (push groups, read the version, stats);
    ``trainer_token`` the *trainer* credential (everything, including ``POST /v1/version``).
    Without ``trainer_token`` there is no role separation: ``token`` serves both roles.

    ``group_filter(groups) -> (kept, dropped)`` (the trainer's ``rollout.filter``): only the kept
    groups of a push are stored; the dropped ones are acknowledged in the answer's ``filtered``
    list (a producer must not resend them) and never reach the store."""
    if trainer_token is not None and token is not None and hmac.compare_digest(trainer_token.encode(), token.encode()):
        raise ValueError("the trainer token equals the producer token: role separation needs two different tokens")
    if max_inflight_bytes is None:
        max_inflight_bytes = 2 * max_request_bytes
    srv = _Ingestion(store, token=token, trainer_token=trainer_token, max_request_bytes=max_request_bytes,
                     max_inflight_bytes=max_inflight_bytes, body_timeout_s=body_timeout_s, group_filter=group_filter)
    app = web.Application(middlewares=[srv.count, srv.auth], client_max_size=max_request_bytes)
    app.add_routes([web.get("/health", srv.health), web.post("/v1/groups", srv.post_groups),
                    web.get("/v1/stats", srv.stats), web.get("/v1/version", srv.get_version),
                    web.post("/v1/version", srv.post_version)])
    app.on_cleanup.append(srv.on_cleanup)
    return app


class _Ingestion:
    """The handlers of :func:`build_app` and the state they share: the store's worker thread, the
    control thread and its read-only connection, the request bytes in flight, the request count."""

    def __init__(self, store: RolloutStore, *, token: Optional[str], trainer_token: Optional[str],
                 max_request_bytes: int, max_inflight_bytes: int, body_timeout_s: float,
                 group_filter: Optional[Callable[[list], tuple[list, list]]] = None):
        self.store, self.token, self.trainer_token = store, token, trainer_token
        self.group_filter = group_filter
        self.max_request_bytes, self.max_inflight_bytes = max_request_bytes, max_inflight_bytes
        self.body_timeout_s = body_timeout_s
        self.inflight = 0
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-db")
        # Control routes (the version) are answered on their own thread and read-only connection, so a
        # large push being decoded or written never delays them (WAL readers do not wait for the writer).
        self.control = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-control")
        self.control_conn: list = []
        # Every request is counted (``server/requests`` in ``GET /v1/stats``) instead of logged: one
        # aiohttp access line per push buried a trainer's step lines. Access lines are a debug switch
        # (``m2po store serve --access-log``; ``logging.access_log`` for the trainer's own server).
        self.served = 0

    def _read_version(self) -> Optional[int]:
        from megatron_m2po.store import sqlite as db
        if not self.control_conn:
            try:
                self.control_conn.append(db.connect(self.store.path, readonly=True))
            except Exception:  # e.g. an in-memory store: fall back to the store's own handle
                self.control_conn.append(None)
        c = self.control_conn[0]
        if c is None:
            return self.store.current_version
        v = db.get_meta(c, "current_version")
        return None if v is None else int(v)

    async def _in_pool(self, fn: Callable, *a, **kw):
        return await asyncio.get_running_loop().run_in_executor(self.pool, lambda: fn(*a, **kw))

    @staticmethod
    def _matches(got: str, want: Optional[str]) -> bool:
        try:  # header parsing never 5xx: undecodable bytes are a wrong token
            return want is not None and got.startswith("Bearer ") and hmac.compare_digest(
                got[7:].strip().encode("utf-8", "surrogateescape"), want.encode())
        except (UnicodeError, ValueError, TypeError):
            return False

    # -- middlewares ---------------------------------------------------------------------------

    @web.middleware
    async def count(self, request: web.Request, handler):
        self.served += 1
        return await handler(request)

    @web.middleware
    async def auth(self, request: web.Request, handler):
        token, trainer_token = self.token, self.trainer_token
        if token is not None and request.path != "/health":
            got = request.headers.get("Authorization", "")
            is_trainer = self._matches(got, trainer_token)
            ok = is_trainer or self._matches(got, token)
            if ok and trainer_token is not None and not is_trainer and (request.method, request.path) in TRAINER_ROUTES:
                return _err(403, f"{request.method} {request.path} needs the trainer token; this is a producer "
                                 "token (producers push groups and read the version)")
            if not ok:
                return _err(401, "missing or wrong bearer token (send 'Authorization: Bearer <token>')",
                            **{"WWW-Authenticate": "Bearer"})
        return await handler(request)

    # -- routes --------------------------------------------------------------------------------

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def post_groups(self, request: web.Request) -> web.Response:
        t0 = time.time()
        max_request_bytes = self.max_request_bytes
        if request.content_length is not None and request.content_length > max_request_bytes:
            return _err(413, f"request body of {request.content_length} bytes exceeds the limit of "
                             f"{max_request_bytes} bytes; send smaller batches")
        # Bodies held in memory at once are bounded: a body counts with its declared length (the
        # limit when it declares none) until its request is answered; beyond the budget, 429.
        held = max_request_bytes if request.content_length is None else request.content_length
        if self.inflight + held > self.max_inflight_bytes and self.inflight > 0:
            return _err(429, f"{self.inflight} request bytes are already in flight (being received or stored; "
                             f"budget {self.max_inflight_bytes}); retry shortly", **{"Retry-After": "1"})
        self.inflight += held
        try:
            return await self._post_groups(request, t0)
        finally:
            self.inflight -= held

    async def _post_groups(self, request: web.Request, t0: float) -> web.Response:
        store, body_timeout_s = self.store, self.body_timeout_s
        try:
            body = await asyncio.wait_for(request.read(), timeout=body_timeout_s)
        except asyncio.TimeoutError:
            return _err(408, f"request body not received within {body_timeout_s:g} s (stalled upload); "
                             "the connection is closed", Connection="close")
        except web.HTTPRequestEntityTooLarge:
            return _err(413, f"request body exceeds the limit of {self.max_request_bytes} bytes; send smaller "
                             "batches")
        except (ConnectionError, HttpProcessingError) as e:  # the client went away or framed the body wrongly
            return _err(400, f"request body not received: {type(e).__name__}: {e}", Connection="close")
        try:
            groups = await self._in_pool(decode_payload, body, request.headers.get("Content-Type", ""))
            dropped: list = []
            if self.group_filter is not None:  # after decoding: only valid groups are judged (and counted)
                groups, dropped = self.group_filter(groups)
            # Versions must lie in the store's known range [0, current version]; before the trainer
            # published a version only the initial weights (version 0) exist.
            res = await self._in_pool(lambda: store.put_groups(groups, received_at=t0,
                                                               current_version=store.current_version or 0))
        except PayloadTooLarge as e:
            return _err(413, str(e))
        except PayloadError as e:
            return _err(415 if str(e).startswith("Content-Type") else 400, str(e))
        except ConflictError as e:
            return _err(409, str(e))
        except StoreFullError as e:
            return _err(429, str(e), **{"Retry-After": "1"})
        except (ValueError, OverflowError, RecursionError) as e:
            return _err(400, f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e))
        except Exception as e:  # the store failed: the producer retries
            log.exception("ingestion failed")
            return _err(500, f"store error: {type(e).__name__}: {e}")
        out = res.to_dict()
        if self.group_filter is not None:
            out["filtered"] = [g.group_id for g in dropped]
        return web.json_response(out)

    async def stats(self, _: web.Request) -> web.Response:
        return web.json_response({**await self._in_pool(self.store.metrics), "server/requests": self.served})

    async def get_version(self, _: web.Request) -> web.Response:
        v = await asyncio.get_running_loop().run_in_executor(self.control, self._read_version)
        return web.json_response({"version": v})

    async def post_version(self, request: web.Request) -> web.Response:
        body_timeout_s = self.body_timeout_s
        if request.content_length is None or request.content_length > 1024:
            return _err(413 if request.content_length else 411,
                        f"POST /v1/version takes a small JSON body with a Content-Length (at most 1024 bytes), "
                        f"got {request.content_length}")
        try:
            raw = await asyncio.wait_for(request.read(), timeout=body_timeout_s)
            doc = json.loads(raw.decode("utf-8"), parse_int=lambda x: int(x) if len(x) <= 20 else None)
        except asyncio.TimeoutError:
            return _err(408, f"request body not received within {body_timeout_s:g} s", Connection="close")
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            return _err(400, f"body is not JSON: {type(e).__name__}: {str(e)[:200]}")
        v = doc.get("version") if isinstance(doc, dict) else None
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < (1 << 63):
            return _err(400, f"'version' must be an integer in [0, 2^63), got {str(v)[:80]}")
        try:
            await self._in_pool(self.store.set_version, v)
        except ValueError as e:
            return _err(409, str(e))
        return web.json_response({"version": v})

    async def on_cleanup(self, _: web.Application) -> None:
        self.pool.shutdown(wait=True)
        self.control.shutdown(wait=True)
        for c in self.control_conn:
            if c is not None:
                c.close()


def run_server(path: str, *, host: str = "127.0.0.1", port: int = 8765, token: Optional[str],
               insecure_no_auth: bool = False, max_request_mb: float = 256.0, synchronous: str = "FULL",
               capacity_groups: Optional[int] = None, trainer_token: Optional[str] = None,
               body_timeout_s: float = 60.0, idle_timeout_s: float = 75.0, access_log: bool = False) -> None:
    """Serve until SIGINT / SIGTERM. Prints ``serving ... on http://HOST:PORT`` once listening.

    ``access_log=True`` prints aiohttp's access line of every request on stderr (debugging); by
    default requests are only counted (``server/requests`` in ``GET /v1/stats``)."""
    if token is None and not insecure_no_auth:
        raise ValueError("no ingestion token: set the env var named by store.token_env (default M2PO_STORE_TOKEN) "
                         "or store.token_file; --insecure-no-auth serves without one (never on a shared network)")
    if token is None:
        print("WARNING: m2po store serve runs WITHOUT AUTHENTICATION (--insecure-no-auth): anyone who can "
              f"reach {host}:{port} can write training data", file=sys.stderr, flush=True)
    if token is not None and trainer_token is None:
        print("note: no role separation: one token serves producers and the trainer (any producer can set the "
              "version); give --trainer-token-file or $M2PO_STORE_TRAINER_TOKEN to separate them",
              file=sys.stderr, flush=True)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"note: binding {host}: the store is reachable from other machines", file=sys.stderr, flush=True)
    store = RolloutStore(path, synchronous=synchronous, capacity_groups=capacity_groups)
    max_bytes = int(max_request_mb * 1024 * 1024)

    access_logger = None
    if access_log:
        from aiohttp.log import access_logger
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s access: %(message)s"))
        access_logger.addHandler(h)
        access_logger.setLevel(logging.INFO)

    async def main() -> None:
        runner = web.AppRunner(build_app(store, token=token, max_request_bytes=max_bytes, trainer_token=trainer_token,
                                         body_timeout_s=body_timeout_s),
                               access_log=access_logger, keepalive_timeout=idle_timeout_s, lingering_time=1.0)
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
