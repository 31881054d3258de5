"""The ``m2po`` command.

Each subcommand lives next to the code it drives and exposes ``register(subparsers)``, which
adds its parser and sets ``func``; this file only lists them, so ``m2po --help`` stays cheap
(heavy imports such as Megatron happen inside the chosen subcommand).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megatron_m2po.config import ConfigError

# name -> module defining register(subparsers)
COMMANDS: dict[str, str] = {
    "train": "megatron_m2po.trainer.cli",
    "eval": "megatron_m2po.evaluation",
    "store": "megatron_m2po.store.cli",
    "convert": "megatron_m2po.actor.convert",
    "plan": "megatron_m2po.plan.search",  # extends plan.memory.register with --search
    "experiment": "megatron_m2po.experiment",
    "config": "megatron_m2po.config_cli",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``m2po`` parser; with ``only`` (a command's name) just that command's module is imported
    (``m2po store ...`` and ``m2po plan ...`` then start without torch)."""
    parser = argparse.ArgumentParser(
        prog="m2po", description="Off-policy RL post-training on Megatron-Core with M2PO.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module in COMMANDS.items():
        if only is not None and name != only:
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:  # subcommand not shipped in this build
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    # Options may come after the dotted overrides (`m2po plan x.yaml a.b=1 --tp 4`): argparse
    # stops filling a `nargs="*"` positional at the first option, so collect the rest here.
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = list(args.overrides or []) + extra
    try:
        rc = args.func(args)
    except ConfigError as e:
        print(f"m2po {args.command}: configuration error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"m2po {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
