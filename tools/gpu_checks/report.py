"""The row record, the printed table (and its parser, for tests) and the per-group guard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class Row:
    """One row of the table: a claim, the shapes it ran at, the measured result, the criterion and its verdict."""

    check: str
    shape: str
    result: str
    criterion: str
    verdict: str            # PASS | FAIL | INFO | SKIP
    values: Optional[dict] = None


COLUMNS = ("check", "shape", "result", "criterion", "verdict")


def guarded(check: str, fn, *args: Any) -> list[Row]:
    """Run one group of rows; an exception becomes a FAIL row (traceback on stderr), so one
    broken path does not hide the others."""
    import gc
    import traceback

    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 -- reported as a failed row
        traceback.print_exc()
        msg = " ".join(str(e).split())
        return [Row(check, "-", f"error: {type(e).__name__}: {msg[:160]} (traceback on stderr)", "-", "FAIL")]
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def format_table(rows: list[Row], header: str) -> str:
    cells = [COLUMNS] + [tuple(getattr(r, c) for c in COLUMNS) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    line = lambda row: " | ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()  # noqa: E731
    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([header, line(cells[0]), sep] + [line(r) for r in cells[1:]])


def parse_table(text: str) -> list[dict[str, str]]:
    """The rows of a printed table (what tests read back)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("check ") and "| verdict" in ln)
    out = []
    for ln in lines[start + 2:]:
        if " | " not in ln:
            break
        parts = [p.strip() for p in ln.split(" | ")]
        out.append(dict(zip(COLUMNS, parts)))
    return out
