"""``m2po store serve|stats|backup``.

* ``m2po store serve --path P [--host 127.0.0.1] [--port 8765] [--token-file F] [--insecure-no-auth]``
  runs the HTTP ingestion service (:mod:`megatron_m2po.ingestion.server`). The token comes from the
  env var ``--token-env`` (default ``M2PO_STORE_TOKEN``) or ``--token-file``.
  ``--producer-token-file`` (alias of ``--token-file``) holds the producer token;
  ``--trainer-token-file`` / ``$M2PO_STORE_TRAINER_TOKEN`` the trainer token (only it may set
  the version). Without a trainer token one token serves both roles (said at start-up).
  A missing ``P`` is created (said at start-up).
* ``m2po store stats --path P [--json]`` prints :meth:`RolloutStore.metrics` of a store file,
  opened read-only (safe next to a running server; in a read-only directory it is opened
  ``immutable`` when no write-ahead log is pending), quarantined groups included.
* ``m2po store backup --path P --out B`` writes a consistent copy with SQLite's online backup
  API while the server runs. Copying ``P`` alone is *not* a backup: the store runs in WAL mode,
  so acknowledged groups may live only in ``P-wal`` until a checkpoint, and a copy taken during a
  write can be torn.

A missing, read-only, truncated, garbage or foreign file (another program's SQLite database,
never written to), or a directory, gives one line naming the file and what to do.

Defaults come from ``StoreConfig``; ``--config file.yaml`` reads the ``store`` section of a run.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys

from megatron_m2po.config import load_config
from megatron_m2po.store.settings import StoreConfig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("store", help="Rollout store: HTTP ingestion service and statistics.")
    ssub = p.add_subparsers(dest="store_command", metavar="ACTION")
    ssub.required = True

    d = StoreConfig()
    s = ssub.add_parser("serve", help="Serve authenticated HTTP ingestion of rollout groups.")
    s.add_argument("--path", help="SQLite store file (default: store.path of --config).")
    s.add_argument("--config", help="Run config YAML whose store section gives the defaults.")
    s.add_argument("--host", default=None, help=f"Bind address (default {d.serve_host}).")
    s.add_argument("--port", type=int, default=None, help=f"Port, 0 = any free one (default {d.serve_port}).")
    s.add_argument("--token-env", default=None, help=f"Env var holding the bearer token (default {d.token_env}).")
    s.add_argument("--token-file", "--producer-token-file", dest="token_file", default=None,
                   help="File holding the producer bearer token (push groups, read the version).")
    s.add_argument("--trainer-token-env", default="M2PO_STORE_TRAINER_TOKEN",
                   help="Env var holding the trainer token (default M2PO_STORE_TRAINER_TOKEN).")
    s.add_argument("--trainer-token-file", default=None,
                   help="File holding the trainer token (set the version, administer). Without one, the "
                        "producer token serves both roles (the server says so at start-up).")
    s.add_argument("--insecure-no-auth", action="store_true", help="Serve without authentication (local tests only).")
    s.add_argument("--max-request-mb", type=float, default=None, help=f"Largest request (default {d.max_request_mb}).")
    s.add_argument("--synchronous", choices=["FULL", "NORMAL"], default=None,
                   help="SQLite sync setting (default FULL: acknowledged groups survive power loss).")
    s.add_argument("--capacity-groups", type=int, default=None,
                   help="Refuse puts (HTTP 429) beyond this many unconsumed groups.")
    s.add_argument("--body-timeout-s", type=float, default=60.0,
                   help="Answer 408 and close when a request body stalls this long (default 60).")
    s.add_argument("--idle-timeout-s", type=float, default=75.0,
                   help="Close keep-alive connections idle this long (default 75).")
    s.add_argument("--access-log", action="store_true",
                   help="Print one access line per request on stderr (debugging; by default requests are "
                        "only counted: server/requests in 'm2po store stats' over HTTP, GET /v1/stats).")
    s.set_defaults(func=run_serve)

    t = ssub.add_parser("stats", help="Print the metrics of a store file.")
    t.add_argument("--path", required=True, help="SQLite store file.")
    t.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    t.set_defaults(func=run_stats)

    b = ssub.add_parser("backup", help="Consistent copy of a store file, safe while the server runs "
                                       "(SQLite online backup; copying the .sqlite file alone misses the WAL).")
    b.add_argument("--path", required=True, help="SQLite store file.")
    b.add_argument("--out", required=True, help="Backup file to write (must not exist).")
    b.set_defaults(func=run_backup)


SQLITE_MAGIC = b"SQLite format 3\x00"


def check_db_file(cmd: str, path: str, *, must_exist: bool, writable: bool) -> None:
    """One clear line (SystemExit) naming the file and what to do, instead of a traceback."""
    if not os.path.exists(path):
        if must_exist:
            raise SystemExit(f"m2po store {cmd}: no rollout store at {path}: no such file; check --path (a store is created by "
                             "'m2po store serve' or the trainer)")
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(parent) and not os.access(parent, os.W_OK):
            raise SystemExit(f"m2po store {cmd}: {path}: cannot create it, the directory {parent} is read-only; "
                             "choose a writable --path")
        return
    if os.path.isdir(path):
        raise SystemExit(f"m2po store {cmd}: {path} is a directory, not a store file; check --path")
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise SystemExit(f"m2po store {cmd}: {path}: cannot read it ({e.strerror}); fix its permissions") from None
    if len(head) < 16 and len(head) > 0 or (head and head != SQLITE_MAGIC):
        raise SystemExit(f"m2po store {cmd}: {path} is not a SQLite rollout store (truncated or a foreign file); "
                         "check --path or restore it from a 'm2po store backup' copy")
    if writable and (not os.access(path, os.W_OK)
                     or not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK)):
        raise SystemExit(f"m2po store {cmd}: {path} (or its directory, which holds the WAL) is read-only; serve "
                         "a writable copy or fix the permissions ('m2po store stats' reads it read-only)")


def _open_error(cmd: str, path: str, e: BaseException) -> SystemExit:
    from megatron_m2po.store.sqlite import NotAStoreError

    if isinstance(e, (NotAStoreError, PermissionError)):  # these already say what to do
        return SystemExit(f"m2po store {cmd}: {e}")
    msg = str(e).splitlines()[0] if str(e) else ""
    return SystemExit(f"m2po store {cmd}: {path}: cannot open it as a rollout store ({type(e).__name__}: {msg}); "
                      "check --path or restore it from a 'm2po store backup' copy")


def _store_cfg(args: argparse.Namespace) -> StoreConfig:
    cfg = load_config(args.config, []).store if args.config else StoreConfig()
    return cfg


def run_serve(args: argparse.Namespace) -> int:
    from megatron_m2po.ingestion.server import load_token, run_server

    cfg = _store_cfg(args)
    path = args.path or cfg.path
    if not path:
        raise SystemExit("m2po store serve: --path (or store.path in --config) is required")
    check_db_file("serve", path, must_exist=False, writable=True)
    if not os.path.exists(path):
        print(f"note: no store at {path}: creating a new one", file=sys.stderr, flush=True)
    try:
        token = load_token(args.token_env or cfg.token_env, args.token_file or cfg.token_file)
        trainer_token = load_token(args.trainer_token_env, args.trainer_token_file or "")
        run_server(path, host=args.host or cfg.serve_host,
                   port=cfg.serve_port if args.port is None else args.port, token=token,
                   insecure_no_auth=args.insecure_no_auth,
                   max_request_mb=args.max_request_mb or cfg.max_request_mb,
                   synchronous=args.synchronous or cfg.synchronous, capacity_groups=args.capacity_groups,
                   trainer_token=trainer_token, body_timeout_s=args.body_timeout_s,
                   idle_timeout_s=args.idle_timeout_s, access_log=args.access_log)
    except ValueError as e:
        raise SystemExit(f"m2po store serve: {e}") from None
    except (sqlite3.DatabaseError, RuntimeError, OSError) as e:
        raise _open_error("serve", path, e) from None
    return 0


def format_metrics(m: dict) -> str:
    lines = [f"current version: {m['current_version']}", "", f"{'state':<10}{'groups':>10}{'trajs':>10}{'resp tokens':>14}"]
    for s, v in m["groups"].items():
        lines.append(f"{s:<10}{v['groups'] or 0:>10}{v['trajectories'] or 0:>10}{v['response_tokens'] or 0:>14}")
    lines += ["", f"{'version':<10}{'trajs':>10}{'prompt tok':>14}{'resp tokens':>14}"]
    for v, r in m["by_version"].items():
        lines.append(f"{v:<10}{r['trajectories']:>10}{r['prompt_tokens']:>14}{r['response_tokens']:>14}")
    st = m["staleness"]
    lines += ["", f"staleness at consumption: mean {st['mean']}, max {st['max']}",
              "  tokens by staleness: " + json.dumps(st["tokens"]),
              "  groups by staleness: " + json.dumps(st["groups"]),
              f"leases: {json.dumps(m['leases'])}",
              f"bytes: arrays {m['bytes']['arrays']:,}, db {m['bytes']['db_file']:,}, wal {m['bytes']['wal_file']:,}"]
    q = m.get("quarantined") or {}
    if q.get("groups"):
        lines.append(f"quarantined (stored data failed its checksum, never served): {q['groups']} groups")
        lines += [f"  {r['group_id']} (was {r['was']}): {r['reason']}" for r in q.get("latest", [])]
    return "\n".join(lines)


def run_stats(args: argparse.Namespace) -> int:
    from megatron_m2po.store.store import RolloutStore

    check_db_file("stats", args.path, must_exist=True, writable=False)
    try:
        store = RolloutStore(args.path, create=False, readonly=True)
    except (sqlite3.DatabaseError, RuntimeError, OSError) as e:
        raise _open_error("stats", args.path, e) from None
    try:
        m = store.metrics()
    finally:
        store.close()
    m.pop("ingest", None)  # per-handle counters: empty for this fresh handle
    print(json.dumps(m, indent=2) if args.json else format_metrics(m))
    return 0


def run_backup(args: argparse.Namespace) -> int:
    """SQLite's online backup API: a consistent snapshot (WAL included) while writers run."""
    check_db_file("backup", args.path, must_exist=True, writable=False)
    from megatron_m2po.store import sqlite as db

    if os.path.exists(args.out):
        raise SystemExit(f"m2po store backup: {args.out} exists; choose a new --out")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        raise SystemExit(f"m2po store backup: cannot write {args.out}: its directory {out_dir} is missing or "
                         "read-only; choose another --out")
    try:
        src = db.connect(args.path, readonly=True)
    except (sqlite3.DatabaseError, RuntimeError, OSError) as e:
        raise _open_error("backup", args.path, e) from None
    try:
        dst = sqlite3.connect(args.out)
        try:
            src.backup(dst, pages=1024)
            (ok,) = dst.execute("PRAGMA integrity_check").fetchone()
        finally:
            dst.close()
    except (sqlite3.DatabaseError, OSError) as e:
        raise SystemExit(f"m2po store backup: copying {args.path} to {args.out} failed ({type(e).__name__}: {e}); "
                         "check that the source is a healthy store and --out is writable with room") from None
    finally:
        src.close()
    if ok != "ok":
        raise SystemExit(f"m2po store backup: the copy {args.out} fails SQLite's integrity check: {ok}")
    print(f"m2po store backup: {args.path} -> {args.out} ({os.path.getsize(args.out):,} bytes, integrity ok)")
    return 0
