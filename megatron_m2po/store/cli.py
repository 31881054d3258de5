"""``m2po store serve|stats``.

* ``m2po store serve --path P [--host 127.0.0.1] [--port 8765] [--token-file F] [--insecure-no-auth]``
  runs the HTTP ingestion service (:mod:`megatron_m2po.store.server`). The token comes from the
  env var ``--token-env`` (default ``M2PO_STORE_TOKEN``) or ``--token-file``.
* ``m2po store stats --path P [--json]`` prints :meth:`RolloutStore.metrics` of a store file.

Defaults come from ``StoreConfig``; ``--config file.yaml`` reads the ``store`` section of a run.
"""

from __future__ import annotations

import argparse
import json

from megatron_m2po.config import StoreConfig, load_config


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
    s.add_argument("--token-file", default=None, help="File holding the bearer token.")
    s.add_argument("--insecure-no-auth", action="store_true", help="Serve without authentication (local tests only).")
    s.add_argument("--max-request-mb", type=float, default=None, help=f"Largest request (default {d.max_request_mb}).")
    s.add_argument("--synchronous", choices=["FULL", "NORMAL"], default=None,
                   help="SQLite sync setting (default FULL: acknowledged groups survive power loss).")
    s.add_argument("--capacity-groups", type=int, default=None,
                   help="Refuse puts (HTTP 429) beyond this many unconsumed groups.")
    s.set_defaults(func=run_serve)

    t = ssub.add_parser("stats", help="Print the metrics of a store file.")
    t.add_argument("--path", required=True, help="SQLite store file.")
    t.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    t.set_defaults(func=run_stats)


def _store_cfg(args: argparse.Namespace) -> StoreConfig:
    cfg = load_config(args.config, []).store if args.config else StoreConfig()
    return cfg


def run_serve(args: argparse.Namespace) -> int:
    from megatron_m2po.store.server import load_token, run_server

    cfg = _store_cfg(args)
    path = args.path or cfg.path
    if not path:
        raise SystemExit("m2po store serve: --path (or store.path in --config) is required")
    token = load_token(args.token_env or cfg.token_env, args.token_file or cfg.token_file)
    try:
        run_server(path, host=args.host or cfg.serve_host,
                   port=cfg.serve_port if args.port is None else args.port, token=token,
                   insecure_no_auth=args.insecure_no_auth,
                   max_request_mb=args.max_request_mb or cfg.max_request_mb,
                   synchronous=args.synchronous or cfg.synchronous, capacity_groups=args.capacity_groups)
    except ValueError as e:
        raise SystemExit(f"m2po store serve: {e}") from None
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
    return "\n".join(lines)


def run_stats(args: argparse.Namespace) -> int:
    from megatron_m2po.store.store import RolloutStore

    try:
        store = RolloutStore(args.path, create=False)
    except FileNotFoundError as e:
        raise SystemExit(f"m2po store stats: {e}") from None
    try:
        m = store.metrics()
    finally:
        store.close()
    m.pop("ingest", None)  # per-handle counters: empty for this fresh handle
    print(json.dumps(m, indent=2) if args.json else format_metrics(m))
    return 0
