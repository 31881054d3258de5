"""Read prompt rows in the DeepScaleR schema from local files.

Schema: every row is an object with ``problem`` (non-empty string), ``answer`` (string; ints
and floats are accepted and converted with ``str``, as some benchmark files store AIME
answers as numbers) and an optional ``solution``. Other columns are ignored.

Formats, by suffix: ``.jsonl`` (one JSON object per line, blank lines skipped), ``.json``
(a list of objects), ``.parquet`` (pyarrow). A row that breaks the schema raises :class:`~megatron_m2po.utils.errors.UserError` (a ValueError)
naming the file, the row (0-based index; for jsonl also the line number) and the problem.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from megatron_m2po.utils.errors import UserError

__all__ = ["PromptRow", "load_rows", "validate_rows", "write_jsonl"]

REQUIRED = ("problem", "answer")


class PromptRow(dict):
    """A validated row: ``row["problem"]``, ``row["answer"]`` (str), ``row.get("solution")``."""


def _answer_str(v: Any) -> Optional[str]:
    if isinstance(v, bool):
        return None
    if isinstance(v, str):
        return v
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float) and math.isfinite(v):
        return str(int(v)) if v.is_integer() else repr(v)
    return None


def validate_rows(raw: list[Any], source: str, line_numbers: Optional[list[int]] = None) -> list[PromptRow]:
    """Check the schema of ``raw`` rows; returns PromptRow objects (see module docstring)."""
    rows = []
    for i, r in enumerate(raw):
        where = f"{source}: row {i}" + (f" (line {line_numbers[i]})" if line_numbers else "")
        if not isinstance(r, dict):
            raise UserError(f"{where} is a {type(r).__name__}, expected an object with fields {list(REQUIRED)}")
        missing = [k for k in REQUIRED if k not in r or r[k] is None]
        if missing:
            raise UserError(f"{where} lacks field(s) {missing} (has {sorted(r)}); the DeepScaleR schema needs "
                            f"'problem' and 'answer' (rename your columns)")
        problem = r["problem"]
        if not isinstance(problem, str) or not problem.strip():
            raise UserError(f"{where}: 'problem' must be a non-empty string, got {problem!r}")
        answer = _answer_str(r["answer"])
        if answer is None or not answer.strip():
            raise UserError(f"{where}: 'answer' must be a non-empty string (or number), got {r['answer']!r}")
        row = PromptRow(problem=problem, answer=answer.strip())
        sol = r.get("solution")
        if sol is not None:
            row["solution"] = str(sol)
        rows.append(row)
    return rows


def load_rows(path: str | Path) -> list[PromptRow]:
    """Rows of a .jsonl / .json / .parquet file in the DeepScaleR schema."""
    p = Path(path).expanduser()
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise UserError(f"prompt file {str(p)!r} {what}: give a .jsonl / .json / .parquet file in the DeepScaleR "
                        "schema (problem, answer)")
    try:
        return _load_rows(p)
    except OSError as e:
        raise UserError(f"prompt file {str(p)!r} cannot be read ({e.strerror or e}): fix its permissions, or copy "
                        "it somewhere readable") from None
    except UnicodeDecodeError as e:
        raise UserError(f"prompt file {str(p)!r} is not UTF-8 text ({e.reason} at byte {e.start}): give a .jsonl / "
                        ".json file in UTF-8, or a .parquet file") from None


def _load_rows(p: Path) -> list[PromptRow]:
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        raw, lines = [], []
        with p.open("r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    raw.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise UserError(f"{p}: line {lineno} is not valid JSON ({e.msg} at column {e.colno})") from None
                lines.append(lineno)
        rows = validate_rows(raw, str(p), lines)
    elif suffix == ".json":
        try:
            raw = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise UserError(f"{p} is not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(raw, list):
            raise UserError(f"{p} must hold a JSON list of objects, got {type(raw).__name__}")
        rows = validate_rows(raw, str(p))
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(p)
        missing = [k for k in REQUIRED if k not in table.column_names]
        if missing:
            raise UserError(f"{p} lacks column(s) {missing} (has {table.column_names}); the DeepScaleR schema "
                            "needs 'problem' and 'answer'")
        cols = [c for c in ("problem", "answer", "solution") if c in table.column_names]
        rows = validate_rows(table.select(cols).to_pylist(), str(p))
    else:
        raise UserError(f"prompt file {str(p)!r}: unsupported format {suffix!r}; use .jsonl, .json or .parquet")
    if not rows:
        raise UserError(f"prompt file {str(p)!r} holds no rows")
    return rows


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    """Write rows as jsonl (used for synthetic benchmark files and tests)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(dict(r), ensure_ascii=False) + "\n")
    return p
