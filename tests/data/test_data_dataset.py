"""PromptDataset: deterministic per-epoch order, resume across epoch boundaries, length checks."""

import json

import pytest

from megatron_m2po.config import DataConfig
from megatron_m2po.data import (
    PromptDataset,
    build_eval_sets,
    build_prompt_dataset,
    render_prompt,
    write_jsonl,
)


def rows(n):
    return [{"problem": f"{i}+{i}", "answer": str(2 * i)} for i in range(n)]


def make(tok, n=7, seed=5, **kw):
    kw.setdefault("template", "synthetic")
    return PromptDataset(rows(n), tok, seed=seed, **kw)


def test_items_carry_prompt_and_ids(char_tokenizer):
    ds = make(char_tokenizer, template="paper")
    item = ds[3]
    assert (item.index, item.problem, item.answer) == (3, "3+3", "6")
    assert item.prompt == render_prompt("3+3", "paper")
    assert item.prompt_ids == char_tokenizer(item.prompt)["input_ids"]


def test_each_epoch_is_a_permutation_and_epochs_differ(char_tokenizer):
    ds = make(char_tokenizer, n=7)
    seq = [it.index for it in ds.next_prompts(21)]
    epochs = [seq[0:7], seq[7:14], seq[14:21]]
    for e in epochs:
        assert sorted(e) == list(range(7))
    assert len({tuple(e) for e in epochs}) == 3
    assert ds.state_dict() == {"epoch": 2, "position": 7, "seed": 5, "num_items": 7}
    # The next call rolls into epoch 3.
    ds.next_prompts(1)
    assert ds.state_dict()["epoch"] == 3 and ds.state_dict()["position"] == 1


def test_same_seed_same_order_other_seed_other_order(char_tokenizer):
    a = [it.index for it in make(char_tokenizer, n=20, seed=1).next_prompts(60)]
    b = [it.index for it in make(char_tokenizer, n=20, seed=1).next_prompts(60)]
    c = [it.index for it in make(char_tokenizer, n=20, seed=2).next_prompts(60)]
    assert a == b and a != c


def test_resume_mid_epoch_gives_the_same_sequence_across_epoch_boundaries(char_tokenizer):
    ref = make(char_tokenizer, n=7)
    full = [it.index for it in ref.next_prompts(40)]

    ds = make(char_tokenizer, n=7)
    head = [it.index for it in ds.next_prompts(10)]  # epoch 1, position 3
    state = json.loads(json.dumps(ds.state_dict()))  # as saved in a checkpoint
    assert state["epoch"] == 1 and state["position"] == 3

    resumed = make(char_tokenizer, n=7, seed=999)  # constructor seed is overridden by the state
    resumed.load_state_dict(state)
    tail = [it.index for it in resumed.next_prompts(30)]
    assert head + tail == full


def test_resume_at_exact_epoch_end(char_tokenizer):
    full = [it.index for it in make(char_tokenizer).next_prompts(14)]
    ds = make(char_tokenizer)
    ds.next_prompts(7)
    resumed = make(char_tokenizer)
    resumed.load_state_dict(ds.state_dict())
    assert [it.index for it in resumed.next_prompts(7)] == full[7:]


def test_no_shuffle_is_storage_order(char_tokenizer):
    ds = make(char_tokenizer, n=4, shuffle=False)
    assert [it.index for it in ds.next_prompts(6)] == [0, 1, 2, 3, 0, 1]


def test_load_state_dict_errors(char_tokenizer):
    ds = make(char_tokenizer, n=7)
    with pytest.raises(ValueError, match="taken over 8 prompts but the dataset now has 7"):
        ds.load_state_dict({"epoch": 0, "position": 0, "seed": 5, "num_items": 8})
    with pytest.raises(ValueError, match=r"lacks \['seed'\]"):
        ds.load_state_dict({"epoch": 0, "position": 0})
    with pytest.raises(ValueError, match="invalid data cursor"):
        ds.load_state_dict({"epoch": 0, "position": 9, "seed": 5})
    with pytest.raises(ValueError, match="n must be >= 0"):
        ds.next_prompts(-1)


def test_max_prompt_tokens_names_the_rows(char_tokenizer):
    data = rows(3) + [{"problem": "x" * 50, "answer": "1"}, {"problem": "1", "answer": "1"}]
    with pytest.raises(ValueError, match=r"1 prompt\(s\) exceed data.max_prompt_tokens=20: row 3 \(51 tokens\)"):
        PromptDataset(data, char_tokenizer, template="synthetic", seed=0, max_prompt_tokens=20)
    ds = PromptDataset(data, char_tokenizer, template="synthetic", seed=0, max_prompt_tokens=20, drop_long=True)
    assert ds.n_dropped == 1 and [it.index for it in ds.items] == [0, 1, 2, 4]


def test_build_prompt_dataset_from_files(tmp_path, char_tokenizer):
    path = write_jsonl(rows(5), tmp_path / "train.jsonl")
    cfg = DataConfig(train=str(path), template="raw", max_prompt_tokens=64)
    ds = build_prompt_dataset(cfg, char_tokenizer, seed=3)
    assert len(ds) == 5 and ds[2].prompt == "2+2"
    assert sorted(it.index for it in ds.next_prompts(5)) == list(range(5))


def test_build_synthetic_and_eval_sets(tmp_path, char_tokenizer):
    b1 = write_jsonl(rows(4), tmp_path / "math500.jsonl")
    b2 = write_jsonl(rows(2), tmp_path / "aime24.jsonl")
    cfg = DataConfig(train="synthetic", template="synthetic", synthetic_num_problems=300,
                     synthetic_eval_size=30, eval=[str(b1), str(b2)])
    ds = build_prompt_dataset(cfg, char_tokenizer, seed=0)
    sets = build_eval_sets(cfg, char_tokenizer, seed=0)
    assert list(sets) == ["synthetic", "math500", "aime24"]
    assert [len(v) for v in sets.values()] == [30, 4, 2]
    assert [it.index for it in sets["math500"]] == [0, 1, 2, 3]  # file order, no shuffle
    assert not {it.problem for it in ds.items} & {it.problem for it in sets["synthetic"]}
    assert sets["synthetic"][0].prompt == f"{sets['synthetic'][0].problem}="
    dup = DataConfig(eval=[str(b1), str(b1)], train=str(b2))
    with pytest.raises(ValueError, match="two evaluation sets are named 'math500'"):
        build_eval_sets(dup, char_tokenizer, seed=0)
