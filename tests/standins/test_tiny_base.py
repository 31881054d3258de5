"""The tiny base model: tokenizer layout and loaders, deterministic cached build, HF loading,
the sampler against HF generate, and the default build's accuracy range."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_m2po.rewards.extract import extract_last_boxed
from megatron_m2po.standins import tiny_base as tb

ROOT = Path(__file__).resolve().parents[2]

TASK_STRINGS = ["12+7=", "3-15=", "\\boxed{-12}", "20+20=\\boxed{40}", "0-0=\\boxed{0}",
                "Please solve the following math problem: 12+7. Return the final answer in "
                "\\boxed{} tags, for example \\boxed{1}. Let's solve this step by step.",
                "tabs\tand\nnewlines  and unicode: é, π, 日本"]

# A build that takes seconds: the default model shape, a short warm-up with a tiny eval.
FAST = tb.TinyBaseSpec(warmup=tb.WarmupSpec(max_steps=20, eval_every=20, eval_problems=16,
                                            confirm_problems=16, target_acc=1.0,
                                            final_eval_problems=32, max_new_tokens=8))


def _save_tokenizer_as_qwen2(tmp_path):
    from transformers import Qwen2Config

    tok = tb.build_tokenizer()
    tok.save_pretrained(tmp_path)
    tb._portable_tokenizer_config(tmp_path)
    # A qwen2 config.json makes transformers 5 force its own Qwen2Tokenizer class, which rebuilds
    # the pipeline from the vocab and merges: the ids must not change.
    Qwen2Config(vocab_size=tb.VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(tmp_path)
    return tok


def test_tokenizer_layout_roundtrip_and_loaders(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    built = _save_tokenizer_as_qwen2(tmp_path)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    fast = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    for tok in (built, auto, fast):
        assert len(tok) == tb.VOCAB_SIZE == 384
        assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    for s in TASK_STRINGS:
        ids = [t.encode(s) for t in (built, auto, fast)]
        assert ids[0] == ids[1] == ids[2], s
        assert auto.decode(ids[1]) == s  # lossless; no BOS/EOS added on encode
        assert max(ids[0]) < tb.VOCAB_SIZE
    assert auto.convert_ids_to_tokens(auto.encode("\\boxed{19}")) == ["\\", "boxed", "{", "1", "9", "}"]
    assert auto.convert_ids_to_tokens(auto.encode("=\\boxed{-5}")) == ["=", "\\", "boxed", "{", "-", "5", "}"]
    # digits are always single tokens, whatever surrounds them
    assert auto.convert_ids_to_tokens(auto.encode("120+7")) == ["1", "2", "0", "+", "7"]
    assert auto.apply_chat_template([{"role": "user", "content": "12+7"}], tokenize=False,
                                    add_generation_prompt=True) == "12+7="
    assert auto.decode([1, 300, 2, 0], skip_special_tokens=True) == ""
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "Qwen2Tokenizer"


def test_templates_and_tasks_agree_with_data_module():
    from megatron_m2po.config import DataConfig
    from megatron_m2po.data.templates import SYNTHETIC_TEMPLATE, render_prompt, synthetic_response

    assert tb.PROMPT_TEMPLATE == SYNTHETIC_TEMPLATE
    assert tb.format_prompt("3+14") == render_prompt("3+14", "synthetic") == "3+14="
    assert tb.format_response("17") == synthetic_response("3+14", "17") == "\\boxed{17}"
    d = DataConfig()
    assert (tb.TinyTask().min_operand, tb.TinyTask().max_operand, tb.TinyTask().num_operands,
            tb.TinyTask().ops) == (d.synthetic_min_operand, d.synthetic_max_operand,
                                   d.synthetic_num_operands, d.synthetic_ops)
    rows = tb.make_problems(50, 0, tb.TinyTask())
    assert rows == tb.make_problems(50, 0, tb.TinyTask()) != tb.make_problems(50, 1, tb.TinyTask())
    for r in rows:  # independent check of the answers: split on the operator by hand
        a, op, b = (r["problem"].partition("+") if "+" in r["problem"]
                    else r["problem"].partition("-"))
        assert int(r["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    assert extract_last_boxed("=\\boxed{3} then \\boxed{ -4 }") == "-4"  # the extractor sampled_accuracy uses
    assert extract_last_boxed("no box") is None


def test_fast_build_deterministic_cached_and_hf_loadable(tmp_path, monkeypatch):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p1 = tb.ensure_tiny_base(tmp_path / "a", spec=FAST, progress=False)
    p2 = tb.ensure_tiny_base(tmp_path / "b", spec=FAST, progress=False)
    assert p1.name == p2.name == f"qwen2-tiny-{FAST.digest()}"
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (p1 / name).read_bytes() == (p2 / name).read_bytes(), name
    assert not [x for x in (tmp_path / "a").iterdir() if x.name.startswith(".qwen2")]  # no tmp left

    meta = tb.load_tiny_meta(p1)
    assert meta["digest"] == FAST.digest() and meta["data_template"] == "synthetic"
    assert meta["example"] == {"problem": "12+7", "prompt": "12+7=", "response": "\\boxed{19}"}
    assert meta["task"] == dataclasses.asdict(tb.TinyTask())
    assert 0.0 <= meta["base_accuracy_t1"] <= 1.0 and meta["steps"] == 20
    assert meta["reached_target"] is False

    # Cached: a second call must not build (a build would raise here).
    def no_build(*a, **k):
        raise AssertionError("rebuilt a complete cached model")

    monkeypatch.setattr(tb, "build_tiny_base", no_build)
    assert tb.ensure_tiny_base(tmp_path / "a", spec=FAST) == p1
    # A different seed is a different model directory (and would build).
    other = dataclasses.replace(FAST, seed=1)
    assert tb.tiny_base_path(tmp_path / "a", other) != p1
    with pytest.raises(AssertionError, match="rebuilt"):
        tb.ensure_tiny_base(tmp_path / "a", spec=other)

    model = AutoModelForCausalLM.from_pretrained(p1)
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.vocab_size == 384 and not cfg.tie_word_embeddings
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size) == (128, 2, 4, 2, 256)
    assert cfg.eos_token_id == 2 and cfg.pad_token_id == 0
    with safe_open(str(p1 / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert all(f.get_tensor(k).dtype == torch.float32 for k in keys)
    assert "lm_head.weight" in keys and meta["num_parameters"] == sum(p.numel() for p in model.parameters())

    # The batched, left-padded sampler at (near) zero temperature equals HF greedy decoding
    # per prompt, for prompts of different lengths.
    tok = AutoTokenizer.from_pretrained(p1)
    prompts = ["1+2=", "17-20=", "5+13=", "20-0="]
    ours = tb.sample_responses(model, tok, prompts, max_new_tokens=8, temperature=1e-6, seed=0)
    for prompt, got in zip(prompts, ours):
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, do_sample=False, max_new_tokens=8, pad_token_id=0, eos_token_id=2)
        assert got == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), prompt


def test_a_warm_up_that_reaches_its_target_early_says_so_and_completes_its_bar(caplog, capsys):
    """The warm-up stops at the first check that reaches the target: its bar is completed at that
    step and the reason logged (it used to stay at e.g. ``17% 499/3000``, which reads as a crash)."""
    import logging

    spec = dataclasses.replace(FAST, warmup=dataclasses.replace(FAST.warmup, eval_every=5, target_acc=0.0,
                                                               confirm_problems=0))
    tok = tb.build_tokenizer()
    torch.manual_seed(0)
    model = tb._build_model(spec.model, tok)
    with caplog.at_level(logging.INFO, logger=tb.__name__):
        stats = tb._warmup(model, tok, spec, progress=True)
    assert stats["steps"] == 5 and stats["reached_target"]
    assert ("tiny base warm-up: stopped at step 5 of at most 20: held-out sampled accuracy "
            f"{stats['check_acc']:.3f} reached the target 0.00") in caplog.text
    bar = capsys.readouterr().err
    assert "5/5" in bar and "(done early)" in bar and "5/20" not in bar.split("(done early)")[-1]


def test_the_tool_base_build_says_it_is_one_time_and_how_long(tmp_path, monkeypatch, caplog):
    """The tool-use base's build (a fine-tune of the base, ~3 min on 2 cores) says so before it starts."""
    import logging

    spec = tb.TinyBaseSpec(model=tb.TinyModelSpec(family="qwen2_tools"))
    final = tb.tiny_base_path(tmp_path, spec)
    base = tmp_path / "base"
    monkeypatch.setattr(tb, "ensure_tiny_base", lambda *a, **k: base)  # the qwen2 base, built already

    def build(base_dir, out, spec_, progress):
        assert "one-time" in caplog.text  # said before the build starts
        return {"digest": spec_.digest(), "eval_with_tool": {"accuracy_hard": 0.8},
                "eval_tool_withheld": {"accuracy_hard": 0.1}}

    monkeypatch.setattr(tb, "_build_tool_base", build)
    with caplog.at_level(logging.INFO, logger=tb.__name__):
        assert tb._ensure_tool_base(tmp_path, spec, final, progress=False) == final
    line = next(r.getMessage() for r in caplog.records if "one-time" in r.getMessage())
    assert line.startswith(f"building the tiny tool-use base model into {final}") and "about 3 minutes" in line


def test_incomplete_cache_is_rebuilt(tmp_path):
    path = tb.tiny_base_path(tmp_path, FAST)
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")  # a directory without the marker: not trusted
    assert not tb.is_complete(path)
    with pytest.raises(ValueError, match="not a tiny base model directory"):
        tb.load_tiny_meta(tmp_path)
    got = tb.ensure_tiny_base(tmp_path, spec=FAST, progress=False)
    assert got == path and tb.is_complete(path) and json.loads((path / "config.json").read_text())


def _rank_ensure(rank, world_size, cache_dir):
    """One rank of the concurrent build test: counts the builds it performs in a shared file."""
    real_build = tb.build_tiny_base

    def counting_build(out_dir, spec=None, *, progress=True):
        with open(f"{cache_dir}/builds.log", "a") as f:
            f.write(f"rank {rank}\n")
        return real_build(out_dir, spec, progress=progress)

    tb.build_tiny_base = counting_build
    return str(tb.ensure_tiny_base(cache_dir, spec=FAST, progress=False))


@pytest.mark.multiproc
def test_concurrent_ranks_build_once(tmp_path):
    from megatron_m2po.standins.dist_testing import run_distributed

    paths = run_distributed(_rank_ensure, world_size=2, args=(str(tmp_path),), timeout_s=240)
    assert paths[0] == paths[1] == str(tb.tiny_base_path(tmp_path, FAST))
    assert len((tmp_path / "builds.log").read_text().splitlines()) == 1
    assert tb.is_complete(paths[0])


PLATFORMS = Path(__file__).with_name("tiny_base_platforms.json")
BASE_BAND = (0.21, 0.42)  # measured over 20 build seeds; see test_default_build_accuracy_and_reward


def platform_key() -> str:
    """What decides the bits of a CPU build: architecture, torch's kernel level, torch, CPU flags."""
    import hashlib
    import platform

    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    flag_hash = hashlib.sha256(" ".join(sorted(flags.split(":")[-1].split())).encode()).hexdigest()[:8]
    return (f"{platform.machine()}|{torch.backends.cpu.get_cpu_capability()}|torch {torch.__version__}"
            f"|cpu flags {flag_hash}")


@pytest.mark.slow
def test_default_build_accuracy_and_reward():
    """The real default: lands in the RL-friendly accuracy band, and its sampled responses get
    full reward from the math grader exactly when the boxed answer is right.

    Checks the build the trainer uses (``model.tiny_cache_dir``, or ``$M2PO_TINY_CACHE`` when set),
    building it there when no test did yet (~40 s on 2 idle cores): one build per run of the suite,
    shared with the end-to-end runs (the directory name pins every build parameter; determinism is
    tested by the fast build). CI starts from an empty cache, so this is the build a newcomer gets.

    The build is bit-reproducible on one platform but not across CPUs and torch versions (the
    kernels round differently, and the warm-up stops on a sampled-accuracy rule). Where this
    platform is recorded in ``tiny_base_platforms.json`` the build must match it exactly (model
    hash and base accuracy); elsewhere the base accuracy must lie in the band measured over 20
    build seeds (``python tools/test_margins.py tiny_base --seeds 0-19``, a stand-in for the
    spread across platforms): mean 0.3152, std 0.0316 (min 0.2617, max 0.3633), band mean +-
    3.3 std = [0.21, 0.42]. The build on this machine (seed 0) gives 0.3525.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_m2po.rewards.math_grader import grade_math

    from megatron_m2po.config import load_config

    cache = Path(os.environ.get("M2PO_TINY_CACHE") or load_config(None).model.tiny_cache_dir).expanduser()
    path = tb.ensure_tiny_base(cache, progress=False)
    meta = tb.load_tiny_meta(path)
    assert meta["digest"] == tb.TinyBaseSpec().digest()
    assert meta["reached_target"] is True
    known = json.loads(PLATFORMS.read_text())["platforms"].get(platform_key())
    if known is not None:
        got = {k: meta[k] for k in known}
        assert got == known, (f"the default tiny base built on this platform ({platform_key()}) differs from the "
                              f"recorded build {known}: got {got}; if the build procedure changed on purpose, "
                              f"bump FORMAT_VERSION and re-record {PLATFORMS.name}")
    assert BASE_BAND[0] <= meta["base_accuracy_t1"] <= BASE_BAND[1], (meta["base_accuracy_t1"], BASE_BAND)

    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    rows = tb.make_problems(48, "test", tb.TinyTask())
    resp = tb.sample_responses(model, tok, [tb.format_prompt(r["problem"]) for r in rows],
                               max_new_tokens=12, seed=1)
    boxed = [extract_last_boxed(t) for t in resp]
    assert sum(b is not None for b in boxed) >= 40  # the format is learned
    grades = [grade_math(t, r["answer"]) for t, r in zip(resp, rows)]
    assert [g == "correct" for g in grades] == [b == r["answer"] for b, r in zip(boxed, rows)]
    assert 0 < sum(g == "correct" for g in grades) < len(rows)
    # raw prompts (no "=") work too: the model emits "=" first
    raw = tb.sample_responses(model, tok, [r["problem"] for r in rows[:16]], max_new_tokens=12, seed=2)
    assert sum(t.startswith("=\\boxed{") for t in raw) >= 14

    # The CLI finds the cached build (no rebuild: it returns at once) and prints its path.
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_base.py"),
                          "--cache-dir", str(cache), "--no-progress"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == str(path)
    assert "base accuracy" in res.stderr and "data.template=synthetic" in res.stderr


def test_the_tiny_teacher_is_the_base_trained_further_in_its_own_cache_entry(tmp_path, monkeypatch):
    """``tiny-teacher`` (algo.distill.teacher on the tiny task) resolves to the base's spec with only
    the warm-up's target raised (same model, tokenizer, task and seed, so the base's first steps),
    under its own digest; the MoE and tool bases have none. (Its build: 700 steps, sampled accuracy
    0.52 against the base's 0.35, measured once; the distillation run uses it.)"""
    from megatron_m2po.actor.settings import ModelConfig
    from megatron_m2po.utils import hf_dir

    base = tb.TinyBaseSpec()
    teacher = tb.teacher_spec(base)
    assert teacher.warmup.target_acc == tb.TEACHER_TARGET_ACC > base.warmup.target_acc
    assert dataclasses.replace(teacher, warmup=base.warmup) == base and teacher.digest() != base.digest()
    for family in ("qwen3_moe", "qwen2_tools"):
        with pytest.raises(ValueError, match="dense families"):
            tb.teacher_spec(tb.TinyBaseSpec(model=tb.TinyModelSpec(family=family)))
    asked = []
    monkeypatch.setattr(tb, "ensure_tiny_base", lambda cache, *, spec, progress: asked.append(spec) or tmp_path)
    model = ModelConfig(tiny_cache_dir=str(tmp_path), tiny_family="qwen3")
    assert hf_dir.resolve_model_path(model, override="tiny-teacher") == str(tmp_path)
    assert hf_dir.resolve_model_path(model, override="tiny") == str(tmp_path)
    assert asked[0] == tb.teacher_spec(asked[1]) and asked[1].model.family == "qwen3"
