"""Mistakes a user makes at run time, answered in one line.

A :class:`UserError` says what was wrong (the values) and what to do. The ``m2po`` entry point
(``megatron_m2po/cli.py``) prints it as ``m2po <command>: <message>`` on stderr and exits 2,
without a traceback, as it does for a :class:`~megatron_m2po.config.ConfigError`; ``m2po --debug``
or ``M2PO_DEBUG=1`` re-raise it instead (the traceback then shows where it was raised).

It is a ``ValueError``: callers that catch ``ValueError`` (the house convention for user
mistakes) keep working.

    raise UserError(f"data.train={path!r} does not exist: give a .jsonl / .json / .parquet file "
                    "in the DeepScaleR schema, or data.train=synthetic")
"""

from __future__ import annotations

import os

__all__ = ["UserError", "debug_enabled"]


class UserError(ValueError):
    """A mistake the user can fix: a missing file, a busy run directory, an address nobody
    answers at, a port in use. The message names the values and what to do."""


def debug_enabled() -> bool:
    """``M2PO_DEBUG`` is set to something other than ``""`` / ``0``: show tracebacks of user errors."""
    return os.environ.get("M2PO_DEBUG", "").strip() not in ("", "0")
