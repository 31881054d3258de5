"""Network helpers shared by the launchers, the weight sync and the tests."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (IPv6 when ``host`` has a colon; "" = any).

    Another process may take it before the caller binds it; callers that can retry should.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host or "0.0.0.0", 0))
        return s.getsockname()[1]
