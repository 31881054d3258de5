"""The one SGLang version this package speaks (routes, request fields and meta_info keys were
checked against its source; see docs/sglang.md for moving the pin).

Engines report their version in ``/server_info``'s ``"version"`` (SGLang's ``__version__``,
``entrypoints/http_server.py`` ``server_info``); ``EngineFleet.start`` refuses any other.
docker/install.sh installs exactly this version (tests/test_docker.py checks they agree).
"""

from __future__ import annotations

from typing import Any

SUPPORTED_SGLANG = "0.5.23"


def check_sglang_version(url: str, server_info: Any) -> None:
    """Raise ``ValueError`` unless ``server_info`` reports ``SUPPORTED_SGLANG``."""
    found = server_info.get("version") if isinstance(server_info, dict) else None
    if found != SUPPORTED_SGLANG:
        raise ValueError(f"{url} runs SGLang {found!r}; megatron_m2po speaks SGLang {SUPPORTED_SGLANG} only "
                         f"(megatron_m2po/rollout/sglang_version.py; docs/sglang.md says how to move the pin)")
