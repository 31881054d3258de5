"""Start-up checks: what a user can get wrong at run time, found before anything starts.

Global rank 0 runs :func:`check_data` (the data files read and every row validated) before the
run directory is touched, then the other checks of :func:`check_start` inside
:func:`~megatron_m2po.trainer.run_lock.claim_run_dir` (:func:`claim_checked_run_dir`: the run
directory locked, nothing in it read or written yet, no engine, store or actor started); a
failure removes what the claim created. A single process does it before Megatron-Core is
imported (``trainer/cli.py``); under torchrun rank 0 does it in the trainer, and its failure reaches every
rank (``parallel/rank0.py``). Each check looks and creates nothing: a
data file's rows, a trial bind of a port, HTTP GETs with a 5 s deadline (an external engine's ``/health``
and ``/model_info``: a ready SGLang engine, not another server).
Each failure is one :class:`~megatron_m2po.utils.errors.UserError` naming the setting, its
value, what is wrong and what to do. What cannot be seen in advance (an
engine that fails to load its model, a port taken after the check) is still reported where it
happens.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from megatron_m2po.config import Config
from megatron_m2po.data.io import load_rows
from megatron_m2po.data.settings import DataConfig
from megatron_m2po.rollout.settings import RolloutConfig
from megatron_m2po.store.settings import StoreConfig
from megatron_m2po.trainer.run_lock import RunDirLock, claim_run_dir
from megatron_m2po.utils.errors import UserError
from megatron_m2po.utils.net import bind_error, http_get, unreachable

__all__ = ["claim_checked_run_dir", "check_start", "check_data", "check_ingestion", "check_engines"]

log = logging.getLogger(__name__)


def claim_checked_run_dir(cfg: Config) -> RunDirLock:
    """The run directory created if needed and locked (:func:`~.run_lock.claim_run_dir`), and
    :func:`check_start` passed; nothing is left behind when it fails. The data files are read
    first, before the claim: a bad row leaves no run directory and no lock behind."""
    check_data(cfg.data, evaluating=bool(cfg.trainer.eval_every_steps))
    lock = claim_run_dir(cfg.trainer.run_dir, check=lambda: check_start(cfg, data=False))
    log.info("run dir: %s", lock.run_dir)
    return lock


def check_start(cfg: Config, *, data: bool = True) -> None:
    """Every check below for ``cfg`` (the data files' unless ``data=False``: checked already); the
    first failure raises :class:`UserError`."""
    if data:
        check_data(cfg.data, evaluating=bool(cfg.trainer.eval_every_steps))
    if cfg.model.hf_path != "tiny":  # the tiny base is built on first use; anything else must exist
        from megatron_m2po.utils.hf_dir import resolve_model_path
        resolve_model_path(cfg.model)
    if cfg.rollout.source == "external":
        check_ingestion(cfg.store)
    check_engines(cfg.rollout)


def check_data(data: DataConfig, *, evaluating: bool) -> None:
    """``data.train`` (unless ``synthetic``) and, when the run evaluates, every ``data.eval``
    file exist, can be read and hold rows of the DeepScaleR schema (every row validated, as the
    dataset will read it: a bad row is named by its number and field)."""
    files = [("data.train", data.train)] if data.train != "synthetic" else []
    if evaluating:
        files += [("data.eval", p) for p in data.eval]
    for key, path in files:
        p = Path(path).expanduser()
        where = f"{key}={path!r}" + (f" ({p.resolve()})" if not p.is_absolute() else "")
        if not p.exists():
            raise UserError(f"{where} does not exist: give a .jsonl / .json / .parquet file in the DeepScaleR "
                            "schema (problem, answer)" + (", or data.train=synthetic" if key == "data.train" else ""))
        if not p.is_file():
            raise UserError(f"{where} is not a file: give a .jsonl / .json / .parquet file in the DeepScaleR schema")
        try:
            with open(p, "rb") as f:
                f.read(1)
        except OSError as e:
            raise UserError(f"{where} cannot be read ({e.strerror}): fix its permissions, or copy it somewhere "
                            "readable") from None
        load_rows(p)  # every row, as the dataset reads them; its UserError names the row and the field


def check_ingestion(store: StoreConfig) -> None:
    """``rollout.source=external``: the ingestion token is set, and the trainer can serve on
    ``store.serve_host:serve_port``."""
    from megatron_m2po.ingestion.server import load_token

    fix = (f"set ${store.token_env} (or store.token_file) to a secret of your choice; external producers send it "
           "as 'Authorization: Bearer <token>'")
    try:
        token = load_token(store.token_env, store.token_file)
    except ValueError as e:  # an unreadable or empty token file
        raise UserError(f"rollout.source=external: {e}; {fix}") from None
    if token is None:
        raise UserError(f"rollout.source=external needs the ingestion token, and neither ${store.token_env} nor "
                        f"store.token_file gives one: {fix}")
    if store.serve_port:
        why = bind_error(store.serve_host, store.serve_port)
        if why:
            raise UserError(f"store.serve_port={store.serve_port}: the trainer cannot serve ingestion on "
                            f"{store.serve_host}:{store.serve_port} ({why}): stop what listens there, or choose "
                            "another store.serve_port (0 = any free port, logged at start)")


def check_engines(rollout: RolloutConfig) -> None:
    """The engines' addresses answer (``launcher=external``), the router's does
    (``rollout.router_addr``), and the ports of the engines and router this node will start are
    free (``rollout.base_port`` > 0)."""
    r = rollout
    if not r.has_engines:
        return  # no engines: external producers push on their own
    external = r.launcher == "external"
    discovered = external and not r.external_addrs  # engines listed by the router
    if external:
        for addr in r.external_addrs:
            why = unreachable(addr)
            if why:
                raise UserError(f"rollout.external_addrs: nothing answers at {addr} ({why}): start the engine there "
                                "(scripts/launch_sglang_fleet.sh) or correct the address")
            why = not_an_sglang_engine(addr)
            if why:
                raise UserError(f"rollout.external_addrs: {addr} {why}")
    if r.router_addr and (r.use_router or discovered):
        why = unreachable(r.router_addr)
        if why:
            raise UserError(f"rollout.router_addr={r.router_addr}: nothing answers there ({why}): start the router "
                            "(scripts/launch_sglang_fleet.sh) or correct the address")
    if not r.base_port:
        return  # free ports are picked when the engines start
    ports = []
    if r.launcher == "local":
        ports += [(f"engine {i}'s port", r.base_port + i) for i in range(r.num_engines)]
    if r.use_router and not r.router_addr and not discovered:  # this node starts the router at base_port - 1
        ports.append(("the router's port", r.base_port - 1))
    for what, port in ports:
        why = bind_error(r.host, port)
        if why:
            raise UserError(f"rollout.base_port={r.base_port}: {what} {r.host}:{port} cannot be used ({why}): stop "
                            "what listens there (engines of another run?), choose another rollout.base_port, or 0 "
                            "for free ports")


def _said(status: int, ctype: str, body: bytes) -> str:
    text = " ".join(body[:120].decode("utf-8", "replace").split())
    return f"{status} {ctype or 'no content type'}" + (f" {text!r}" if text else "")


def not_an_sglang_engine(addr: str) -> str | None:
    """Why the server answering at ``addr`` is not a ready SGLang engine (None when it is): SGLang
    0.5.23 answers ``GET /health`` with 200 once its model is loaded (``srt/entrypoints/http_server.py``
    ``health_generate``: 503 while it starts or is unhealthy) and ``GET /model_info`` with a JSON object holding ``model_path``.
    What it answered is quoted, so a wrong port (another web server) reads differently from an
    engine still loading."""
    try:
        status, ctype, body = http_get(addr, "/health")
        if status == 503:
            return ("answers GET /health with 503: an SGLang engine that is still loading its model (or an "
                    "unhealthy one); wait until its log says the server is fired up and run the same command again")
        if status != 200:
            return (f"answers GET /health with {_said(status, ctype, body)}, where an SGLang engine answers 200: "
                    "is this the engine's port? Correct the address (scripts/launch_sglang_fleet.sh prints them)")
        status, ctype, body = http_get(addr, "/model_info")
    except (OSError, ValueError) as e:
        return f"stopped answering during the check ({e}): is the engine restarting? Run the same command again"
    try:
        info = json.loads(body) if status == 200 else None
    except ValueError:
        info = None
    if not isinstance(info, dict) or "model_path" not in info:
        return (f"answers GET /model_info with {_said(status, ctype, body)}, where an SGLang engine answers a JSON "
                "object with model_path: it is not an SGLang engine; correct the address (wrong port?)")
    return None
