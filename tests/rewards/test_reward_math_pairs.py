"""Hard-to-grade answer pairs: expected grades of the math reward (math-verify 0.9).

Every expectation below was obtained by running the grader and checked by hand. Where
math-verify's behaviour is debatable the pair is marked DEBATABLE with the reason; the test
pins today's behaviour so that a library upgrade that changes it is noticed.

Scores: correct 1.0, wrong (extracted but not equal) 0.1, no answer 0.0 (RewardConfig defaults).
"""

import pytest

from megatron_m2po.config import RewardConfig
from megatron_m2po.rewards import get_reward_fn, grade_math

C, W, N = "correct", "wrong", "no_answer"
SCORE = {C: 1.0, W: 0.1, N: 0.0}

PAIRS = [
    # --- fractions vs decimals -----------------------------------------------------------------
    (r"The answer is \boxed{0.5}.", r"\frac{1}{2}", C),
    (r"\boxed{\frac{1}{2}}", "0.5", C),
    (r"\boxed{0.5}", "1/2", C),
    (r"\boxed{\frac{7}{2}}", "3.5", C),
    (r"\boxed{0.3333333}", r"\frac{1}{3}", C),
    (r"\boxed{0.333}", r"\frac{1}{3}", W),  # floats are compared to 6 decimals
    (r"\boxed{-\frac{1}{2}}", "-0.5", C),
    (r"\boxed{\frac{-1}{2}}", r"-\frac{1}{2}", C),
    # DEBATABLE: a mixed number "3\frac{1}{2}" is read as 3 + 1/2 (not 3 * 1/2).
    (r"\boxed{3\frac{1}{2}}", r"\frac{7}{2}", C),
    # --- LaTeX variants of the same value -----------------------------------------------------
    (r"\boxed{1/2}", r"\frac{1}{2}", C),
    (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", C),
    (r"\boxed{\tfrac{3}{4}}", "0.75", C),
    (r"\boxed{\frac12}", r"\frac{1}{2}", C),
    (r"\boxed{\dfrac{\pi}{4}}", r"\frac{\pi}{4}", C),
    (r"\boxed{\mathbf{5}}", "5", C),
    (r"\boxed{\text{5}}", "5", C),
    (r"\boxed{ 7 }", "7", C),
    (r"\boxed{10^{3}}", "1000", C),
    (r"\boxed{1,000}", "1000", C),  # thousands separator
    (r"\boxed{1{,}000}", "1000", C),
    # --- intervals, \left( \right), sets ------------------------------------------------------
    (r"\boxed{[2,5)}", "[2,5)", C),
    (r"\boxed{(2,5]}", "[2,5)", W),
    (r"\boxed{\left(1, 2\right)}", "(1,2)", C),
    (r"\boxed{\left[ 1, 3 \right]}", "[1,3]", C),
    (r"\boxed{(-\infty, 3]}", r"(-\infty,3]", C),
    (r"\boxed{x \in [0, 1]}", "[0,1]", C),
    # DEBATABLE: a chain inequality is not compared with an interval unless the prediction is
    # a set (math-verify's allow_set_relation_comp=False).
    (r"\boxed{1 < x < 2}", "(1,2)", W),
    (r"\boxed{\{1,2,3\}}", r"\{3,2,1\}", C),
    (r"\boxed{1,2,3}", r"\{1,2,3\}", C),
    (r"\boxed{\{1,2\}}", r"\{1,2,3\}", W),
    # DEBATABLE: the open interval / pair (1,2) verifies against the set {1,2}.
    (r"\boxed{(1,2)}", r"\{1,2\}", C),
    # --- units, text, percent, degrees, currency ----------------------------------------------
    (r"\boxed{5 \text{ cm}}", "5", C),
    (r"\boxed{5\text{cm}}", "5", C),
    (r"\boxed{5 \text{ dollars}}", "5", C),
    (r"\boxed{\frac{1}{2}\text{ m}}", "0.5", C),
    (r"\boxed{\$5}", "5", C),
    (r"\boxed{50\%}", "50", C),
    # DEBATABLE: a percentage also verifies against its fraction (50% == 0.5 and == 50).
    (r"\boxed{50\%}", "0.5", C),
    (r"\boxed{10\%}", "10", C),
    (r"\boxed{90^\circ}", "90", C),
    # Degrees are not converted to radians.
    (r"\boxed{45^\circ}", r"\frac{\pi}{4}", W),
    (r"\boxed{\text{(A)}}", "A", C),
    (r"\boxed{\text{Devon}}", r"\text{Devon}", C),
    (r"\boxed{\text{Devon}}", r"\text{Alice}", W),
    # --- roots, pi, symbolic ------------------------------------------------------------------
    (r"\boxed{\sqrt{2}}", "2^{1/2}", C),
    (r"\boxed{3\sqrt{2}}", r"\sqrt{18}", C),
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", C),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", C),
    (r"\boxed{2\pi}", r"2\pi", C),
    (r"\boxed{6.2832}", r"2\pi", W),  # no numeric approximation of pi
    (r"\boxed{\pi}", "3.14", W),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", C),
    (r"\boxed{2+3i}", "2+3i", C),
    (r"\boxed{\infty}", r"\infty", C),
    (r"\boxed{a}", "a", C),
    # DEBATABLE: an assignment verifies against its right-hand side.
    (r"\boxed{x=5}", "5", C),
    (r"\boxed{y=2x+1}", "2x+1", C),
    # --- negative numbers ---------------------------------------------------------------------
    (r"\boxed{-3}", "-3", C),
    (r"\boxed{-3}", "3", W),
    (r"\boxed{3}", "-3", W),
    # --- multiple boxes: the last one wins; nesting ---------------------------------------------
    (r"First \boxed{4}, then corrected: \boxed{5}", "5", C),
    (r"First \boxed{5}, then changed mind: \boxed{4}", "5", W),
    (r"\boxed{\frac{1}{2}} and also $\boxed{\frac{2}{4}}$", r"\frac{1}{2}", C),
    (r"\boxed{\boxed{7}}", "7", C),
    (r"\fbox{12}", "12", C),
    (r"so the answer is \boxed 5.", "5", C),
    (r"so the answer is \boxed 5.", "6", W),
    # --- the synthetic task's format ----------------------------------------------------------
    (r"3+14-2=15 \boxed{15}", "15", C),
    (r"3+14-2=15 \boxed{16}", "15", W),
    # --- wrong words, no answer ---------------------------------------------------------------
    # DEBATABLE: a word parses as a product of symbols; it is "extracted but wrong" (0.1).
    (r"\boxed{banana}", "5", W),
    (r"The answer is 5.", "5", N),  # no box: no answer even though 5 is right
    (r"I think \boxed{5", "5", N),  # truncated inside the box
    (r"\boxed{}", "5", N),
    (r"\boxed{5} but wait, maybe \boxed{", "5", N),  # the last box is unterminated
]


def test_pair_count():
    assert len(PAIRS) >= 40


@pytest.mark.parametrize("response,answer,expected", PAIRS, ids=[f"{i:02d}" for i in range(len(PAIRS))])
def test_grade_math_pairs(response, answer, expected):
    assert grade_math(response, answer) == expected


def test_pairs_through_the_pool_score_as_configured():
    """The same pairs through get_reward_fn + score_batch give the configured scores."""
    responses = [p[0] for p in PAIRS]
    answers = [p[1] for p in PAIRS]
    expected = [p[2] for p in PAIRS]
    with get_reward_fn(RewardConfig(num_workers=2, timeout_s=20.0)) as reward:
        res = reward.score_batch(responses, answers)
    assert res.statuses == expected
    assert res.scores == [SCORE[e] for e in expected]
    assert res.n_correct == expected.count(C)
    assert res.n_wrong == expected.count(W)
    assert res.n_no_answer == expected.count(N)
    assert res.n_timeouts == 0 and res.n_errors == 0
    m = res.metrics()
    assert m["reward/acc"] == pytest.approx(expected.count(C) / len(PAIRS))
    assert m["reward/mean"] == pytest.approx(sum(SCORE[e] for e in expected) / len(PAIRS))


def test_custom_score_values_come_from_config():
    cfg = RewardConfig(num_workers=1, correct=2.0, wrong=-0.5, no_answer=-1.0)
    with get_reward_fn(cfg) as reward:
        res = reward.score_batch([r"\boxed{2}", r"\boxed{3}", "nothing"], ["2", "2", "2"])
    assert res.scores == [2.0, -0.5, -1.0]
    assert res.statuses == [C, W, N]
