"""The actor's data layout without Megatron: packed / padded micro-batches, token-budget plans,
balanced data-parallel shards, the per-sequence causal mask of packed attention."""

import numpy as np
import pytest
import torch

import actor_testlib as lib
from megatron_m2po.actor.batch import (balanced_shards, dp_shard, group_microbatches, make_microbatches,
                                       sequence_work)


def _check_rows(mb, samples):
    """Every response token's predicting row holds the token before it, and the next row the token itself."""
    for k, (pos, row) in enumerate(zip(mb.row_pos.tolist(), mb.row_seq.tolist())):
        assert int(mb.tokens[row, pos + 1]) == int(mb.targets[k])
    first = 0
    for i in mb.sample_index:
        s = samples[i]
        r = s.response_ids.shape[0]
        pos, row = mb.row_pos[first].item(), mb.row_seq[first].item()
        assert int(mb.tokens[row, pos]) == int(s.prompt_ids[-1])  # the last prompt token predicts
        first += r


def test_packed_microbatch_layout():
    samples = lib.make_samples(5, seed=1)
    lengths = [s.length for s in samples]
    (mb,) = make_microbatches(samples, [[0, 2, 3]], packing=True, pad_multiple=4)
    total = lengths[0] + lengths[2] + lengths[3]
    padded_total = -(-total // 4) * 4
    assert mb.tokens.shape == (1, padded_total)
    bounds = [0, lengths[0], lengths[0] + lengths[2], total] + ([padded_total] if padded_total > total else [])
    assert mb.cu_seqlens.tolist() == bounds and mb.cu_seqlens.dtype == torch.int32
    assert mb.max_seqlen == max(np.diff(bounds))
    for a, b in zip(bounds[:-1], bounds[1:]):  # positions restart in every (pseudo-)sequence
        assert mb.position_ids[0, a:b].tolist() == list(range(b - a))
    _check_rows(mb, samples)
    # token_index: the canonical mini-batch order (response offsets of samples 0, 2, 3)
    off = np.concatenate([[0], np.cumsum([s.response_ids.shape[0] for s in samples])])
    assert mb.token_index.tolist() == [j for i in (0, 2, 3) for j in range(off[i], off[i + 1])]


def test_padded_microbatch_layout():
    samples = lib.make_samples(4, seed=2)
    (mb,) = make_microbatches(samples, [[1, 3]], pad_multiple=4)
    assert mb.cu_seqlens is None and mb.tokens.shape[0] == 2 and mb.tokens.shape[1] % 4 == 0
    assert mb.tokens.shape[1] - max(samples[1].length, samples[3].length) < 4
    _check_rows(mb, samples)


def test_token_budget_plans():
    lengths = [10, 3, 7, 12, 5, 30, 2]
    # count mode: consecutive groups
    assert group_microbatches(lengths, range(7), micro_batch_size=3, max_tokens=None, packing=True) == \
        [[0, 1, 2], [3, 4, 5], [6]]
    # packed budget 15: first fit by decreasing length (30 alone, over budget; 12+3; 10+5; 7+2)
    plan = group_microbatches(lengths, range(7), micro_batch_size=1, max_tokens=15, packing=True)
    assert plan == [[5], [1, 3], [0, 4], [2, 6]]
    for g in plan:
        assert len(g) == 1 or sum(lengths[i] for i in g) <= 15
    assert sorted(i for g in plan for i in g) == list(range(7))
    # padded budget counts B x longest: 12 and 3 no longer share 15 rows (2 x 12 = 24)
    plan = group_microbatches(lengths, range(7), micro_batch_size=1, max_tokens=15, packing=False)
    for g in plan:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 15, g
    # SP rounding is part of the budget: 7 + 2 = 9 rows -> 12 with pad_multiple 4, over a budget of 10
    assert group_microbatches([7, 2], [0, 1], micro_batch_size=1, max_tokens=10, packing=True,
                              pad_multiple=4) == [[0], [1]]
    assert group_microbatches([7, 2], [0, 1], micro_batch_size=1, max_tokens=12, packing=True,
                              pad_multiple=4) == [[0, 1]]


def test_balanced_shards_hand_example_and_determinism():
    h = 10 ** 9  # quadratic term tiny: work ~ length
    # LPT: 8 -> r0, 7 -> r1, 6 -> r1 (13), 5 -> r0 (13); the linear loads tie and the quadratic
    # term decides (7^2 + 6^2 < 8^2 + 5^2): 4 joins rank 1
    assert balanced_shards([8, 7, 6, 5, 4], 2, h) == [[0, 3], [1, 2, 4]]
    assert balanced_shards([8, 7, 6, 5], 2, h) == [[0, 3], [1, 2]]
    assert balanced_shards([1, 1, 1], 3, h) == [[0], [1], [2]]
    # the quadratic term: one 1000-token sequence outweighs two 600-token ones at h = 100
    assert sequence_work(1000, 100) > 2 * sequence_work(600, 100)
    assert balanced_shards([1000, 600, 600], 2, 100) == [[0], [1, 2]]


def test_balanced_shards_even_out_a_long_tail():
    """Log-normal lengths grouped by prompt (8 samples of similar length per prompt), 8 ranks:
    balanced shards are within 5 % of the mean work, contiguous ones are not."""
    rng = np.random.default_rng(0)
    lengths = []
    for _ in range(32):
        base = rng.lognormal(np.log(3000), 0.6)
        lengths += [int(max(64, base * rng.lognormal(0, 0.3))) for _ in range(8)]
    h, dp = 5120, 8

    def imbalance(shards):
        work = [sum(sequence_work(lengths[i], h) for i in s) for s in shards]
        return max(work) / (sum(work) / dp)

    balanced = balanced_shards(lengths, dp, h)
    assert sorted(i for s in balanced for i in s) == list(range(len(lengths)))
    contiguous = [list(dp_shard(len(lengths), dp, r)) for r in range(dp)]
    assert imbalance(balanced) <= 1.05 < imbalance(contiguous), (imbalance(balanced), imbalance(contiguous))
    assert balanced == balanced_shards(lengths, dp, h)


def test_block_causal_mask():
    from megatron_m2po.actor.attention import block_causal_mask

    m = block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32))[0, 0]
    allowed = ~m
    expect = torch.zeros(5, 5, dtype=torch.bool)
    expect[0, 0] = expect[1, 0] = expect[1, 1] = True
    for i in range(2, 5):
        expect[i, 2:i + 1] = True
    assert torch.equal(allowed, expect)


def test_empty_sequences_are_refused():
    samples = lib.make_samples(2, seed=3)
    samples[1].prompt_ids = np.zeros(0, np.int64)
    with pytest.raises(ValueError, match="s1"):
        make_microbatches(samples, [[0, 1]], packing=True)
