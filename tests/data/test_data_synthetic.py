"""Synthetic arithmetic task: exact answers, knobs, determinism, disjoint held-out split."""

import random
import re

import pytest

from megatron_m2po.config import DataConfig
from megatron_m2po.data import SyntheticTask, evaluate_expression, synthetic_response, synthetic_splits
from megatron_m2po.rewards import grade_math


def test_answers_match_python_arithmetic():
    # Independent reference: Python's own integer arithmetic on the problem string.
    task = SyntheticTask(min_operand=0, max_operand=50, num_operands=4, ops="+-*")
    for row in task.generate(300, seed=7):
        assert re.fullmatch(r"\d+([+\-*]\d+){3}", row["problem"])
        assert int(row["answer"]) == eval(row["problem"])  # noqa: S307 - digits and +-* only


def test_evaluate_expression_precedence():
    assert evaluate_expression([2, 3, 4], ["+", "*"]) == 14
    assert evaluate_expression([2, 3, 4], ["*", "-"]) == 2
    assert evaluate_expression([3, 14, 2], ["+", "-"]) == 15
    assert evaluate_expression([1, 5], ["-"]) == -4
    with pytest.raises(ValueError, match="operator"):
        evaluate_expression([1, 2], ["/"])


def test_knobs_are_respected():
    task = SyntheticTask(min_operand=5, max_operand=9, num_operands=3, ops="-")
    for row in task.generate(200, seed=1):
        nums = [int(x) for x in row["problem"].split("-")]
        assert len(nums) == 3 and all(5 <= x <= 9 for x in nums)
        assert int(row["answer"]) == nums[0] - nums[1] - nums[2]
    assert task.space_size == 5 ** 3


def test_deterministic_by_seed():
    task = SyntheticTask()
    assert task.generate(50, seed=3) == task.generate(50, seed=3)
    assert task.generate(50, seed=3) != task.generate(50, seed=4)


def test_invalid_knobs():
    with pytest.raises(ValueError, match="synthetic_ops"):
        SyntheticTask(ops="+/")
    with pytest.raises(ValueError, match="operand range"):
        SyntheticTask(min_operand=5, max_operand=2)
    with pytest.raises(ValueError, match="synthetic_num_operands"):
        SyntheticTask(num_operands=1)


def test_splits_are_disjoint_deterministic_and_sized():
    cfg = DataConfig(synthetic_num_problems=2000, synthetic_eval_size=100)
    train, held = synthetic_splits(cfg, seed=11)
    assert len(train) == 2000 and len(held) == 100
    assert len({r["problem"] for r in held}) == 100  # unique
    assert not {r["problem"] for r in train} & {r["problem"] for r in held}
    assert synthetic_splits(cfg, seed=11) == (train, held)


def test_eval_size_too_large_for_the_space():
    cfg = DataConfig(synthetic_max_operand=3, synthetic_eval_size=20)  # 16 * 2 = 32 problems
    with pytest.raises(ValueError, match="more than half of the 32"):
        synthetic_splits(cfg, seed=0)


def test_canonical_responses_grade_correct_and_wrong():
    rng = random.Random(0)
    for row in SyntheticTask(ops="+-*", num_operands=3).generate(30, seed=5):
        assert grade_math(synthetic_response(row["problem"], row["answer"]), row["answer"]) == "correct"
        off = str(int(row["answer"]) + rng.choice([-2, -1, 1, 2]))
        assert grade_math(synthetic_response(row["problem"], off), row["answer"]) == "wrong"
