"""`m2po eval` aggregation: avg@k / pass@k against hand-computed values, table and JSON."""

import json

import pytest
from rich.console import Console

from megatron_m2po.evaluation import (
    BenchmarkResult,
    average_of,
    avg_at_k,
    is_correct,
    pass_at_k,
    results_table,
    results_to_json,
    summarize_benchmark,
)


def test_avg_and_pass_at_k_hand_computed():
    grid = [[True, True, True, True], [False, True, False, False], [False, False, False, False]]
    assert avg_at_k(grid) == pytest.approx((1 + 0.25 + 0) / 3)
    assert pass_at_k(grid) == pytest.approx(2 / 3)
    assert avg_at_k([[True]]) == 1.0 and pass_at_k([[False]]) == 0.0


def test_ragged_or_empty_grids_are_rejected():
    with pytest.raises(ValueError, match="same number k"):
        avg_at_k([[True, False], [True]])
    with pytest.raises(ValueError, match="no problems"):
        pass_at_k([])


def test_summarize_benchmark_problem_major_layout():
    # 2 problems x k=3: problem 0 -> correct, wrong, correct; problem 1 -> no_answer, timeout, correct.
    statuses = ["correct", "wrong", "correct", "no_answer", "timeout", "correct"]
    scores = [1.0, 0.1, 1.0, 0.0, 0.0, 1.0]
    r = summarize_benchmark("aime24", statuses, scores, 3, response_tokens=[10, 20, 30, 40, 50, 60],
                            truncated=[False, False, False, True, False, False])
    assert r.correct_per_problem == [2, 1]
    assert r.avg_at_k == pytest.approx((2 / 3 + 1 / 3) / 2)
    assert r.pass_at_k == 1.0
    assert r.mean_reward == pytest.approx(3.1 / 6)
    assert r.mean_response_tokens == 35.0
    assert (r.n_timeouts, r.n_errors, r.n_no_answer, r.n_truncated) == (1, 0, 1, 1)
    with pytest.raises(ValueError, match="do not form problems of k=4"):
        summarize_benchmark("x", statuses, scores, 4)


def test_is_correct_for_math_and_custom_rewards():
    assert is_correct("correct", 1.0, 1.0)
    assert not is_correct("wrong", 0.1, 1.0)
    assert not is_correct("timeout", 0.0, 1.0)
    assert is_correct("ok", 1.0, 1.0) and not is_correct("ok", 0.5, 1.0)


def _result(name, acc):
    return BenchmarkResult(name=name, n_problems=10, k=4, avg_at_k=acc, pass_at_k=min(1.0, 2 * acc),
                           mean_reward=acc, mean_response_tokens=100.0)


def test_table_and_json_have_every_benchmark_and_the_average():
    results = {"math500": _result("math500", 0.8), "aime24": _result("aime24", 0.1), "amc23": _result("amc23", 0.45)}
    assert average_of(results) == pytest.approx(0.45)
    console = Console(record=True, width=140)
    console.print(results_table(results))
    text = console.export_text()
    for needle in ("math500", "aime24", "amc23", "80.0", "10.0", "Average", "45.0"):
        assert needle in text
    doc = json.loads(json.dumps(results_to_json(results, {"k": 4})))
    assert doc["average_avg_at_k"] == pytest.approx(0.45)
    assert list(doc["benchmarks"]) == ["math500", "aime24", "amc23"]
    assert doc["benchmarks"]["aime24"]["avg_at_k"] == 0.1 and doc["settings"] == {"k": 4}


def test_eval_cli_parses():
    import argparse

    from megatron_m2po.evaluation import register, run

    parser = argparse.ArgumentParser(prog="m2po")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", "cfg.yaml", "data.eval=a.jsonl", "--k", "4", "--engine-url",
                                      "http://127.0.0.1:1", "--out", "r.json"])
    assert (args.config, args.overrides, args.k, args.engine_url, args.out) == (
        "cfg.yaml", ["data.eval=a.jsonl"], 4, "http://127.0.0.1:1", "r.json")
    assert args.temperature == 1.0 and args.func is run
