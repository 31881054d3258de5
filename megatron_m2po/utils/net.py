"""Network helpers shared by the launchers, the weight sync, the start-up checks and the tests."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from typing import Optional

__all__ = ["free_port", "bind_error", "http_get", "unreachable"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (IPv6 when ``host`` has a colon; "" = any).

    Another process may take it before the caller binds it; callers that can retry should.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host or "0.0.0.0", 0))
        return s.getsockname()[1]


def bind_error(host: str, port: int) -> Optional[str]:
    """Why a server could not listen on ``host:port`` now ("Address already in use", "Cannot assign
    requested address", ...), or None when it could. Binds as the servers do (aiohttp, uvicorn,
    sglang-router set ``SO_REUSEADDR``), so a port whose last connections linger in TIME_WAIT
    counts as free; a socket listening there does not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host or "0.0.0.0", port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def http_get(url: str, path: str, timeout_s: float = 5.0, limit: int = 65536) -> tuple[int, str, bytes]:
    """``GET url + path`` without proxies: (status, content type, the first ``limit`` bytes of the
    body), whatever the status. ``OSError`` / ``ValueError`` when nothing answers."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url.rstrip("/") + path, timeout=timeout_s) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read(limit)
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers.get("Content-Type", "") if e.headers else "", e.read(limit)


def unreachable(url: str, path: str = "/health", timeout_s: float = 5.0) -> Optional[str]:
    """Why nothing answers HTTP at ``url`` (connection refused, unknown host, timed out, not an
    http(s) address), or None when something answers ``GET url + path`` with any status: whether
    it is the right server is for its own client to check. Proxies from the environment are not
    used, as the engine and store clients (aiohttp) do not use them."""
    if not url.startswith(("http://", "https://")):
        return "not an http:// or https:// address"
    try:
        http_get(url, path, timeout_s, limit=0)  # any status: it answered
        return None
    except urllib.error.URLError as e:
        reason = e.reason
        return getattr(reason, "strerror", None) or str(reason)
    except (OSError, ValueError) as e:  # a timeout while reading, a malformed address
        return str(e) or type(e).__name__
