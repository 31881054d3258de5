"""Grade one response against a ground-truth answer with math-verify (paper, appendix B).

``grade_math(response, answer)`` returns ``"correct"``, ``"wrong"`` or ``"no_answer"``:

1. The content of the *last* ``\\boxed{}`` / ``\\fbox{}`` / ``\\boxed X`` of the response is
   extracted (:func:`megatron_m2po.rewards.extract.extract_last_boxed`). None (or empty):
   ``no_answer``.
2. Identical strings (ignoring whitespace) are ``correct`` without invoking sympy (the common
   case of the synthetic task).
3. Otherwise both are parsed by ``math_verify.parse`` — the prediction as ``\\boxed{content}``
   and the ground truth likewise, so both go through the same LaTeX normalisation (units,
   ``\\text``, ``\\left``/``\\right``, ``\\dfrac``, percent, degrees) — and compared with
   ``math_verify.verify(gold, pred)`` (gold first: verify is not symmetric).
   An extracted answer that does not parse, or that does not verify, is ``wrong``.

Timeouts. math-verify's own timeout is ``signal.alarm`` based: it raises inside threads and
cannot interrupt C-level sympy loops. This module disables it (``parsing_timeout=None``,
``timeout_seconds=None``) and is meant to run inside the scoring pool
(:mod:`megatron_m2po.rewards.pool`), whose per-call deadline kills and replaces a worker that
hangs. Calling it directly (tests, debugging) therefore has no timeout.

math-verify behaviours worth knowing (pinned by tests/rewards/test_math_grader.py):
``x=5`` verifies against ``5`` (assignment simplification); ``1,2,3`` against ``\\{1,2,3\\}``;
``50\\%`` against both ``50`` and ``0.5``; degrees are dropped (``90^\\circ`` == ``90``);
floats match fractions to 6 decimals (``\\frac{1}{3}`` == ``0.333333`` but not ``0.333``);
``2\\pi`` does not match ``6.2832``; a word like ``banana`` parses as a product of symbols.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from megatron_m2po.rewards.extract import extract_last_boxed

__all__ = ["grade_math", "Grade", "CORRECT", "WRONG", "NO_ANSWER"]

Grade = Literal["correct", "wrong", "no_answer"]
CORRECT: Grade = "correct"
WRONG: Grade = "wrong"
NO_ANSWER: Grade = "no_answer"

_MV = None  # (parse, verify, extraction configs), imported on first use


def _math_verify():
    global _MV
    if _MV is None:
        import math_verify
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
        import math_verify.grader as _g
        import math_verify.parser as _p

        # We run without math-verify's signal timeout on purpose (see module docstring); its
        # one-time warning about that would only confuse users reading the worker logs.
        _g.TIMEOUT_WARNING_SHOWN = True
        _p.TIMEOUT_WARNING_SHOWN = True
        del math_verify
        cfgs = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
        _MV = (parse, verify, list(cfgs))
    return _MV


def _parse(text: str) -> list:
    parse, _, cfgs = _math_verify()
    return parse("\\boxed{" + text + "}", extraction_config=cfgs, parsing_timeout=None)


@lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> tuple:
    # Ground truths repeat n_samples_per_prompt times in a batch: cache their parse.
    gold = extract_last_boxed(answer) if ("\\boxed" in answer or "\\fbox" in answer) else answer
    return tuple(_parse((gold or answer).strip()))


def _squash(s: str) -> str:
    return "".join(s.split())


def grade_math(response: str, answer: str) -> Grade:
    """Grade ``response`` against the ground truth ``answer`` (no timeout; see module docstring)."""
    if not isinstance(answer, str):
        raise TypeError(f"answer must be a str, got {type(answer).__name__}: {answer!r}")
    content = extract_last_boxed(response)
    if content is None:
        return NO_ANSWER
    if _squash(content) == _squash(answer):
        return CORRECT
    pred = _parse(content)
    if not pred:
        return WRONG
    gold = list(_parse_gold(answer))
    if not gold:
        return WRONG
    _, verify, _ = _math_verify()
    return CORRECT if verify(gold, pred, timeout_seconds=None) else WRONG
