"""`m2po eval` aggregation: avg@k / pass@k against hand-computed values, table and JSON."""

import json
from pathlib import Path

import pytest
from rich.console import Console

from megatron_m2po.rollout_service.evaluation import (
    BenchmarkResult,
    average_of,
    avg_at_k,
    is_correct,
    pass_at_k,
    results_table,
    results_to_json,
    summarize_benchmark,
)

ROOT = Path(__file__).resolve().parents[1]


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

    from megatron_m2po.rollout_service.evaluation import register, run

    parser = argparse.ArgumentParser(prog="m2po")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", "cfg.yaml", "data.eval=a.jsonl", "--k", "4", "--engine-url",
                                      "http://127.0.0.1:1", "--out", "r.json"])
    assert (args.config, args.overrides, args.k, args.engine_url, args.out) == (
        "cfg.yaml", ["data.eval=a.jsonl"], 4, "http://127.0.0.1:1", "r.json")
    assert args.temperature == 1.0 and args.func is run


def test_eval_names_the_model_on_the_lines_that_mention_it(tmp_path, monkeypatch, capsys):
    """`m2po eval` without --model: the model is the config's (``tiny``), named on the launch line and
    in the table's title. The resolved cache path used to be printed there, and on an 80-column
    console rich moved it to a line of its own: "launching 2 cpu_worker engine(s) for " read as an
    empty name. The engines and their answers are stand-ins: what is checked is what is printed."""
    import argparse
    import os

    import megatron_m2po.rollout_service.evaluation as ev
    import megatron_m2po.rollout.engines as engines
    from megatron_m2po.standins.tiny_base import ensure_tiny_base

    ensure_tiny_base(os.path.expanduser("~/.cache/megatron_m2po/tiny_base"), progress=False)  # cached: no build here

    class Fleet:
        url, router_url, engines = "http://127.0.0.1:1", "http://127.0.0.1:1", ["e0", "e1"]

        def __init__(self, *a, **k):
            pass

        def start(self):
            return self

        def stop(self):
            pass

    async def answers(url, cfg, sets, k, *a, **kw):
        return {name: BenchmarkResult(name, len(items), k, 0.5, 0.5, 0.5, 6.0) for name, items in sets.items()}

    monkeypatch.setattr(engines, "EngineFleet", Fleet)
    monkeypatch.setattr(ev, "_evaluate_at", answers)
    parser = argparse.ArgumentParser()
    ev.register(parser.add_subparsers())
    args = parser.parse_args(["eval", "examples/tiny_cpu.yaml", f"trainer.run_dir={tmp_path}", "--limit", "2",
                              "--k", "1"])
    monkeypatch.chdir(ROOT)
    assert args.func(args) == 0
    out = capsys.readouterr().out.splitlines()
    launch = next(ln for ln in out if ln.startswith("launching"))
    assert launch.startswith("launching 2 cpu_worker engine(s) for tiny (qwen2-tiny-"), out
    assert any("pass@1 as avg@1 (T=1) - tiny (qwen2-tiny-" in ln for ln in out), out
    doc = json.loads((tmp_path / "eval_results.json").read_text())
    assert doc["settings"]["model_name"].startswith("tiny (qwen2-tiny-")
    assert ev.model_name("/models/Qwen2.5-Math-7B", "/models/Qwen2.5-Math-7B") == "/models/Qwen2.5-Math-7B"


# --------------------------------------------------------------------------------------------
# End to end: a real CPU worker (launched by the engine fleet) serving a tiny random Qwen2
# model with a character tokenizer built here; rewards through the real scoring pool.
# --------------------------------------------------------------------------------------------


def _tiny_model_dir(root):
    import sys
    from pathlib import Path

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(Path(__file__).parent / "data"))
    from m2po_char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    Qwen2ForCausalLM(cfg).save_pretrained(str(root / "model"))
    tok.save_pretrained(str(root / "model"))
    return root / "model"


@pytest.mark.slow
def test_eval_end_to_end_against_a_cpu_worker(tmp_path):
    pytest.importorskip("megatron_m2po.standins.cpu_worker")
    pytest.importorskip("megatron_m2po.rollout.engines")
    import argparse

    from megatron_m2po.data import write_jsonl
    from megatron_m2po.rollout_service.evaluation import register
    model = _tiny_model_dir(tmp_path)
    write_jsonl([{"problem": f"{i}+1", "answer": str(i + 1)} for i in range(4)], tmp_path / "math500.jsonl")
    write_jsonl([{"problem": "2*3", "answer": "6"}, {"problem": "9-4", "answer": 5}], tmp_path / "aime24.jsonl")

    def eval_with(reward_fn, k, out):
        (tmp_path / "cfg.yaml").write_text(
            f"model: {{hf_path: {model}}}\n"
            f"data: {{train: {tmp_path / 'math500.jsonl'}, template: raw,"
            f" eval: [{tmp_path / 'math500.jsonl'}, {tmp_path / 'aime24.jsonl'}]}}\n"
            "rollout: {max_new_tokens: 8, use_router: false, num_engines: 2, base_port: 0}\n"  # client dispatch

            f"reward: {{num_workers: 1, fn: '{reward_fn}'}}\n"
            f"trainer: {{run_dir: {tmp_path / 'run'}}}\n")
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers())
        args = parser.parse_args(["eval", str(tmp_path / "cfg.yaml"), "--k", str(k), "--save-responses",
                                  "--out", str(out)])
        assert args.func(args) == 0
        return json.loads(out.read_text())

    # A custom reward with a non-trivial hit rate: avg@k / pass@k recomputed from the responses.
    doc = eval_with("m2po_eval_test_fns:has_digit", 4, tmp_path / "digits.json")
    assert list(doc["benchmarks"]) == ["math500", "aime24"]
    assert doc["settings"]["k"] == 4 and doc["settings"]["sampling_params"]["temperature"] == 1.0
    per_bench = []
    for name, n in (("math500", 4), ("aime24", 2)):
        b = doc["benchmarks"][name]
        assert b["n_problems"] == n and b["k"] == 4 and len(b["samples"]) == n
        hits = [[any(c.isdigit() for c in r) for r in s["responses"]] for s in b["samples"]]
        assert all(len(h) == 4 for h in hits)
        assert b["avg_at_k"] == pytest.approx(sum(sum(h) / 4 for h in hits) / n)
        assert b["pass_at_k"] == pytest.approx(sum(any(h) for h in hits) / n)
        assert b["correct_per_problem"] == [sum(h) for h in hits]
        assert [s["answer"] for s in b["samples"]] == ([str(i + 1) for i in range(4)] if n == 4 else ["6", "5"])
        per_bench.append(b["avg_at_k"])
    assert doc["average_avg_at_k"] == pytest.approx(sum(per_bench) / 2)
