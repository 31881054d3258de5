"""The ``store`` config section: the rollout store's file, staleness policy and HTTP ingestion.

Read by ``store/`` (the SQLite store, ``m2po store serve``) and by the rank-0 leaser and
ingestion server; it imports only the settings machinery.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_m2po.utils.settings import check_ranges
from megatron_m2po.utils.settings import setting as _f

__all__ = ["StoreConfig"]

@dataclass
class StoreConfig:
    """The staleness-tagged rollout store.

    The consumption policy follows ``trainer.mode``: sync and stale_k lease exactly the groups
    generated for the step (exact stale-k); async leases under the bounded policy configured by
    ``max_staleness``, ``order`` and ``retire_overage``.
    """

    path: str = _f("", help="SQLite file (default: <run_dir>/rollouts.sqlite).")
    max_staleness: int = _f(256, ge=0, help="Data older than this many updates is never trained on.")
    retire_overage: bool = _f(False, help="async: retire (and count) over-age data instead of raising.")
    order: Literal["oldest", "freshest"] = _f("oldest", help="async: which available groups the bounded policy serves first.")
    synchronous: Literal["FULL", "NORMAL"] = _f("FULL", help="SQLite synchronous setting (FULL: an acknowledged group survives power loss).")
    serve_host: str = _f("127.0.0.1", help="Bind address of `m2po store serve`.")
    serve_port: int = _f(8765, ge=0, le=65535, help="Port of `m2po store serve` (0 = any free port).")
    token_env: str = _f("M2PO_STORE_TOKEN", help="Environment variable holding the ingestion bearer token.")
    token_file: str = _f("", help="File holding the ingestion bearer token (used when the env var is unset).")
    max_request_mb: float = _f(256.0, gt=0, help="Largest accepted ingestion request.")

    def validate(self) -> None:
        check_ranges(self, "store")
