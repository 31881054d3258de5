"""The ``m2po`` command.

Each subcommand lives next to the code it drives and exposes ``register(subparsers)``, which
adds its parser and sets ``func``; this file only lists them, so ``m2po --help`` stays cheap
(heavy imports such as Megatron happen inside the chosen subcommand).

Mistakes a user makes end in one line on stderr and exit code 2, no traceback: a
:class:`~megatron_m2po.config.ConfigError` (``m2po train: configuration error: ...``), a
:class:`~megatron_m2po.utils.errors.UserError` found at run time (``m2po train: ...``), and any
other ``ValueError`` (the house convention for user mistakes; the line then says how to see
where it was raised). ``m2po --debug ...`` or ``M2PO_DEBUG=1`` show the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megatron_m2po.utils.settings import ConfigError
from megatron_m2po.utils.errors import UserError, debug_enabled

# name -> module defining register(subparsers)
COMMANDS: dict[str, str] = {
    "train": "megatron_m2po.trainer.cli",
    "eval": "megatron_m2po.rollout_service.evaluation",
    "store": "megatron_m2po.store.cli",
    "convert": "megatron_m2po.weights.convert",
    "plan": "megatron_m2po.plan.search",  # extends plan.memory.register with --search
    "experiment": "megatron_m2po.experiment",
    "config": "megatron_m2po.config_cli",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``m2po`` parser; with ``only`` (a command's name) just that command's module is imported
    (``m2po store ...`` and ``m2po plan ...`` then start without torch)."""
    parser = argparse.ArgumentParser(
        prog="m2po", description="Off-policy RL post-training on Megatron-Core with M2PO.")
    parser.add_argument("--debug", action="store_true",
                        help="Show the traceback of a user error instead of its one line (also M2PO_DEBUG=1).")
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
    # --debug anywhere on the line (no subcommand has an option of that name)
    debug = "--debug" in argv or debug_enabled()
    argv = [a for a in argv if a != "--debug"]
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
    except ValueError as e:
        if debug:
            raise
        if isinstance(e, ConfigError):
            print(f"m2po {args.command}: configuration error: {e}", file=sys.stderr)
        elif isinstance(e, UserError):
            print(f"m2po {args.command}: {e}", file=sys.stderr)
        else:
            print(f"m2po {args.command}: error: {e} (m2po --debug or M2PO_DEBUG=1 shows where)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"m2po {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
