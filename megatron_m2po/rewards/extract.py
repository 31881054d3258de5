"""Find the final answer of a response: the content of its last ``\\boxed`` (or ``\\fbox``).

Pure string code, no math-verify import, so the trainer and tests can call it anywhere.

Rules (docs/design.md §3: "the last \\boxed{} answer"):

- ``\\boxed{...}`` and ``\\fbox{...}`` count; braces nest (``\\boxed{\\frac{1}{2}}`` gives
  ``\\frac{1}{2}``) and escaped braces ``\\{ \\}`` inside do not close the box.
- ``\\boxed 5`` (no braces, as TeX allows) gives the next token ``5``: characters up to
  whitespace, ``$`` or the end, trailing ``.,;`` dropped.
- The *last* box wins, including when it is unterminated: a response cut off inside
  ``\\boxed{12`` has no answer, even if an earlier box was complete (the model had not
  finished committing to a final answer).
- An empty box ``\\boxed{}`` is no answer.
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["extract_last_boxed"]

# \boxed or \fbox not followed by a letter (so \boxedsomething is not a box).
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _braced(text: str, start: int) -> Optional[str]:
    """Content of the brace group opening at ``text[start] == '{'``, or None if unbalanced."""
    depth = 0
    i = start
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":  # skip the escaped character (\{, \}, \\)
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        i += 1
    return None


def extract_last_boxed(text: str) -> Optional[str]:
    """The stripped content of the last ``\\boxed``/``\\fbox`` of ``text``; None when there is none.

    Examples:
        >>> extract_last_boxed(r"so \\boxed{1} ... finally \\boxed{\\frac{1}{2}}.")
        '\\\\frac{1}{2}'
        >>> extract_last_boxed(r"\\boxed 5.") , extract_last_boxed(r"\\boxed{12") , extract_last_boxed("12")
        ('5', None, None)
    """
    if not isinstance(text, str):
        raise TypeError(f"response must be a str, got {type(text).__name__}")
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    i = last.end()
    n = len(text)
    while i < n and text[i] in " \t\n\r":
        i += 1
    if i >= n:
        return None
    if text[i] == "{":
        content = _braced(text, i)
    else:
        m = re.match(r"[^\s$]+", text[i:])
        content = m.group(0).rstrip(".,;") if m else None
    if content is None:
        return None
    content = content.strip()
    return content or None
