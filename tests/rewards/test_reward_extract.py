"""Extraction of the last \\boxed{} answer (pure string code)."""

import pytest

from megatron_m2po.rewards import extract_last_boxed


@pytest.mark.parametrize("text,expected", [
    (r"\boxed{5}", "5"),
    (r"a \boxed{1} b \boxed{2} c", "2"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\frac{\sqrt{a^{2}}}{2}} tail", r"\frac{\sqrt{a^{2}}}{2}"),
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces do not close the box
    (r"\boxed{\}}", r"\}"),
    (r"\fbox{12}", "12"),
    (r"\boxed 5", "5"),
    (r"\boxed 5.", "5"),
    (r"$\boxed 42$ done", "42"),
    (r"\boxed  {  7 }", "7"),  # whitespace before the brace
    (r"\boxed{\boxed{7}}", "7"),  # the innermost box is the last one to open
    (r"no box here", None),
    (r"\boxed{}", None),
    (r"\boxed{  }", None),
    (r"\boxed{12", None),  # unterminated
    (r"\boxed{1} then \boxed{2", None),  # last box unterminated: no answer
    (r"ends with \boxed", None),
    (r"\boxedx{3}", None),  # not a box command
])
def test_extract_last_boxed(text, expected):
    assert extract_last_boxed(text) == expected


def test_extract_rejects_non_strings():
    with pytest.raises(TypeError, match="str"):
        extract_last_boxed(None)  # type: ignore[arg-type]
