"""``m2po config``: print the resolved config of a YAML file + overrides, or every field's doc."""

from __future__ import annotations

import argparse

from megatron_m2po.config import describe, dump_config, load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="Validate and print a resolved config, or list all fields.")
    p.add_argument("config", nargs="?", help="YAML config file (omit for the defaults).")
    p.add_argument("overrides", nargs="*", help="Dotted overrides, e.g. algo.m2po.threshold=0.02")
    p.add_argument("--fields", action="store_true", help="List every field with its default and help.")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.fields:
        for key, default, help_ in describe():
            print(f"{key:40s} {default:24s} {help_}")
        return 0
    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path:  # no file given, only overrides
        path, overrides = None, [path] + overrides
    print(dump_config(load_config(path, overrides)), end="")
    return 0
