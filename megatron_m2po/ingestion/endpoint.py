"""The store's HTTP ingestion, served by the trainer for external producers (``rollout.source=external``).

Producers push to ``http://store.serve_host:serve_port/v1/groups`` with the ingestion token
(``store.token_env`` / ``store.token_file``); the trainer writes its version straight into the
store, so the HTTP trainer role gets a random token nobody holds: no producer can set the version.
"""

from __future__ import annotations

import logging
import secrets
from typing import Optional

from megatron_m2po.store.settings import StoreConfig
from megatron_m2po.rollout.filters import FilterCounters, split_groups
from megatron_m2po.store.store import RolloutStore
from megatron_m2po.utils.background_loop import BackgroundLoop

log = logging.getLogger(__name__)


def producer_command(url: str, weights_dir: str, base_model: str) -> str:
    """The command line of ``examples/external_producer.py`` that feeds a run serving at ``url``
    (its weights in ``weights_dir``, version 0 = ``base_model``, the resolved directory)."""
    import shlex
    return (f"python examples/external_producer.py --store-url {url} --weights-dir {shlex.quote(str(weights_dir))} "
            f"--base-model {shlex.quote(str(base_model))}")


class IngestionServer:
    """Serves ``store`` over HTTP on ``bg`` from :meth:`start` until :meth:`close`."""

    def __init__(self, store_cfg: StoreConfig, store: RolloutStore, bg: BackgroundLoop, *,
                 group_filter: str = "none", counters: Optional[FilterCounters] = None):
        """``group_filter``: ``rollout.filter``, applied to every pushed group (dropped ones are
        acknowledged in the answer's ``filtered`` list and counted in ``counters``, never stored)."""
        self.cfg, self.store, self.bg = store_cfg, store, bg
        self.group_filter, self.counters = group_filter, counters
        self.url: Optional[str] = None
        self._runner = None

    def start(self, weights_dir: str = "", base_model: str = "") -> str:
        """Start serving; returns the base URL (``http://host:port``). ``weights_dir``: where the
        published weight versions are; ``base_model``: the resolved base model directory (version 0);
        both for the log lines that tell producers where to look."""
        self.bg.submit(self._serve()).result()
        log.info("external rollout: ingestion at %s/v1/groups, current version at %s/v1/version, weights in %s",
                 self.url, self.url, weights_dir)
        log.info("external rollout: the example producer for this run, with $%s set to the ingestion token: %s",
                 self.cfg.token_env, producer_command(self.url, weights_dir, base_model))
        return self.url

    async def _serve(self) -> None:
        from aiohttp import web

        from megatron_m2po.ingestion.server import build_app, load_token
        s = self.cfg
        token = load_token(s.token_env, s.token_file)
        if token is None:
            raise ValueError(f"rollout.source=external: set the ingestion token in ${s.token_env} (or "
                             "store.token_file); producers send it as 'Authorization: Bearer <token>'")
        app = build_app(self.store, token=token, max_request_bytes=int(s.max_request_mb * 2**20),
                        trainer_token=secrets.token_hex(32),
                        group_filter=self._filter if self.group_filter != "none" else None)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, s.serve_host, s.serve_port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{s.serve_host}:{port}"

    def _filter(self, groups: list) -> tuple[list, list]:
        kept, dropped = split_groups(groups, self.group_filter)
        if self.counters is not None:
            self.counters.add(generated_groups=len(groups), filtered_groups=len(dropped))
        return kept, dropped

    def close(self) -> None:
        """Stop serving (best effort at shutdown)."""
        if self._runner is None:
            return
        try:
            self.bg.submit(self._runner.cleanup()).result(timeout=10)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
