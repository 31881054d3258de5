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


def test_routed_experts_stay_compact_until_the_router():
    """Samples keep routed experts in uint8 (ids below 256) or uint16, and so does a micro-batch
    (uint16 when one of its samples needs it); out-of-range ids are refused naming the sample."""
    from megatron_m2po.actor.batch import Sample, cp_split

    samples = lib.make_samples(3, seed=4)
    rng = np.random.default_rng(0)
    for i, s in enumerate(samples):
        ids = rng.integers(0, 128 if i < 2 else 300, (s.length - 1, 3, 2))
        samples[i] = Sample(uid=s.uid, prompt_ids=s.prompt_ids, response_ids=s.response_ids,
                            behav_logprobs=s.behav_logprobs, advantages=s.advantages, loss_mask=s.loss_mask,
                            versions=s.versions, routed_experts=ids)
    assert [s.routed_experts.dtype for s in samples] == [np.uint8, np.uint8, np.uint16]
    (small,) = make_microbatches(samples, [[0, 1]], packing=True)
    (mixed,) = make_microbatches(samples, [[0, 2]], pad_multiple=4)
    assert small.routed_experts.dtype == torch.uint8 and mixed.routed_experts.dtype == torch.uint16
    assert mixed.routed_experts.shape == (3, 2, mixed.tokens.shape[1], 2)
    assert torch.equal(mixed.routed_experts[:, 1, :samples[2].length - 1].permute(1, 0, 2).long(),
                       torch.from_numpy(samples[2].routed_experts.astype(np.int64)))
    (padded,) = make_microbatches(samples, [[0, 2]], pad_multiple=4)
    assert cp_split(padded, 2, 1).routed_experts.dtype == torch.uint16  # the CP split keeps it compact
    s = samples[0]
    for bad in (-1, 70000):
        with pytest.raises(ValueError, match=f"sample {s.uid!r}.*{bad}"):
            Sample(uid=s.uid, prompt_ids=s.prompt_ids, response_ids=s.response_ids, behav_logprobs=s.behav_logprobs,
                   advantages=s.advantages, loss_mask=s.loss_mask, versions=s.versions,
                   routed_experts=np.full((s.length - 1, 3, 2), bad))


def test_empty_sequences_are_refused():
    samples = lib.make_samples(2, seed=3)
    samples[1].prompt_ids = np.zeros(0, np.int64)
    with pytest.raises(ValueError, match="s1"):
        make_microbatches(samples, [[0, 1]], packing=True)


def _attention_vs_naive(rank, world_size):
    """PackedDotProductAttention, with the fused kernel and with the parent's arithmetic, on THD
    packs and on padded ``[s, b]`` input, against causal softmax attention written out here
    sequence by sequence (GQA: 4 query heads on 2 key/value groups): outputs and gradients."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_m2po.actor.attention import PackedDotProductAttention

    lib.init_megatron()
    heads, groups, d = 4, 2, 8
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads, num_query_groups=groups,
                            kv_channels=d, attention_dropout=0.0, hidden_dropout=0.0)
    attn = PackedDotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    assert attn.fused_causal_ok(torch.zeros(1))
    assert not attn.fused_causal_ok(torch.zeros(1, dtype=torch.bfloat16))
    out = []
    for kernel in ("fused", "parent"):
        if kernel == "parent":
            attn.fused_causal_ok = lambda query: False
        for lengths in ([5, 1, 9, 3, 40, 17, 17, 2, 30, 64, 8],  # several length groups; one of length 1
                        [6, 7, 5]):  # one group, its sequences reordered by length within it
            out.append((kernel, "packed", lengths, *_check_attention(attn, lengths, heads, groups, d, packed=True)))
        out.append((kernel, "padded", [9, 9, 9], *_check_attention(attn, [9, 9, 9], heads, groups, d, packed=False)))
    return out


def _check_attention(attn, lengths, heads, groups, d, packed):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    t = int(cu[-1])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(t, heads, d, generator=g, requires_grad=True)
    k = torch.randn(t, groups, d, generator=g, requires_grad=True)
    v = torch.randn(t, groups, d, generator=g, requires_grad=True)
    if packed:
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                                 max_seqlen_kv=max(lengths))
        out = attn(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    else:  # equal lengths as [s, b, heads, d]: sequence j is column j
        s, b = lengths[0], len(lengths)

        def sbhd(x):
            return x.view(b, s, *x.shape[1:]).transpose(0, 1)
        out = attn(sbhd(q), sbhd(k), sbhd(v), None, attn_mask_type=AttnMaskType.causal)
        out = out.transpose(0, 1).reshape(t, -1)
    w = torch.randn(out.shape, generator=g)
    (out * w).sum().backward()
    got = [x.detach().numpy().copy() for x in (out, q.grad, k.grad, v.grad)]

    q2, k2, v2 = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    rows = []
    for s in range(len(lengths)):
        a, b = int(cu[s]), int(cu[s + 1])
        qs = q2[a:b].transpose(0, 1)  # [heads, L, d]
        ks = k2[a:b].repeat_interleave(heads // groups, dim=1).transpose(0, 1)
        vs = v2[a:b].repeat_interleave(heads // groups, dim=1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) / d ** 0.5
        scores = scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        rows.append((scores.softmax(-1) @ vs).transpose(0, 1).reshape(b - a, heads * d))
    ref = torch.cat(rows)
    (ref * w).sum().backward()
    return got, [x.detach().numpy().copy() for x in (ref, q2.grad, k2.grad, v2.grad)]


@pytest.mark.slow  # over 10 s on the CI machine under load: the full suite's lane
def test_attention_matches_per_sequence_attention():
    """The CPU core attention equals attention computed sequence by sequence, forward and
    backward, with both kernels (the fused ``scaled_dot_product_attention`` one, and the parent's
    arithmetic that bf16, dropout or attention sinks fall back to), on packed input (sequences
    grouped by length, scattered into padded rows, real tokens gathered back: the pack's tokens
    never see another sequence) and on padded input."""
    from megatron_m2po.standins.dist_testing import run_distributed

    (cases,) = run_distributed(_attention_vs_naive, 1, timeout_s=120)
    assert {(c[0], c[1]) for c in cases} == {(k, f) for k in ("fused", "parent") for f in ("packed", "padded")}
    for kernel, layout, lengths, got, ref in cases:
        for name, a, b in zip(("output", "dq", "dk", "dv"), got, ref):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=f"{name}, {kernel} {layout} {lengths}")


def test_length_groups_are_the_cheapest_split():
    """The dynamic programme's split costs no more than any split into runs of the sorted
    lengths (all of them enumerated here), and covers every sequence once."""
    import itertools

    from megatron_m2po.actor.attention import length_groups

    rng = np.random.default_rng(0)
    for _ in range(30):
        lengths = [int(x) for x in rng.integers(1, 200, rng.integers(1, 9))]
        overhead = int(rng.choice([0, 5_000, 200_000]))
        groups = length_groups(lengths, heads=2, overhead=overhead)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))

        def cost(gs):
            return sum(len(g) * max(lengths[i] for i in g) ** 2 * 2 + overhead for g in gs)
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        n = len(order)
        best = min(cost([order[a:b] for a, b in zip((0,) + cuts, cuts + (n,))])
                   for r in range(n) for cuts in itertools.combinations(range(1, n), r))
        assert cost(groups) == best, (lengths, overhead, groups)
    assert length_groups([50, 50, 50], heads=4) == [[0, 1, 2]]


def _rope_thd(rank, world_size):
    """Megatron's own ``_apply_rotary_pos_emb_thd`` against the installed gather, both freqs cases."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_m2po.actor.attention import install_thd_rope

    lib.init_megatron()
    original = rope_utils._apply_rotary_pos_emb_thd
    install_thd_rope()
    install_thd_rope()  # idempotent
    fast = rope_utils._apply_rotary_pos_emb_thd
    assert fast is not original and fast.original is original
    cp = ps.get_context_parallel_group()
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    t = torch.randn(18, 3, 16, generator=g)
    out = []
    for freqs in (torch.randn(9, 1, 1, 16, generator=g), torch.randn(18, 1, 1, 16, generator=g)):
        a = original(t, cu, freqs, cp_group=cp)
        b = fast(t, cu, freqs, cp_group=cp)
        out.append(bool(torch.equal(a, b)))
    rope_utils._apply_rotary_pos_emb_thd = original
    return out


def test_packed_rope_gather_equals_megatrons_loop():
    """RoPE on a THD pack through one gather gives bit for bit what Megatron's per-sequence
    loop gives, for ``freqs`` of the longest sequence and for ``freqs`` of every packed position."""
    from megatron_m2po.standins.dist_testing import run_distributed

    (same,) = run_distributed(_rope_thd, 1, timeout_s=120)
    assert same == [True, True]


def test_stored_teacher_log_probs_ride_with_their_tokens_through_packing_and_the_cp_split():
    """algo.distill.mode=sglang with placement=loss: each sample's stored teacher log-probs become the
    micro-batch's ``teacher_logprobs``, one per response token in ``targets``' order, and every CP rank
    keeps exactly its own tokens' values (the loss pairs them with the policy's log-probs token by
    token); a micro-batch with a sample that has none carries none."""
    from megatron_m2po.actor.batch import cp_pad_multiple, cp_split

    samples = lib.make_samples(3, seed=6)
    for i, s in enumerate(samples):
        s.teacher_logprobs = -(np.arange(s.response_ids.size, dtype=np.float32) + 100 * i)
    value_of = {(i, j): float(-(j + 100 * i)) for i, s in enumerate(samples) for j in range(s.response_ids.size)}
    m = cp_pad_multiple(2, 1, False)
    (mb,) = make_microbatches(samples, [[0, 1, 2]], packing=True, pad_multiple=m, seq_multiple=m)
    assert torch.equal(mb.teacher_logprobs, torch.from_numpy(np.concatenate([s.teacher_logprobs for s in samples])))
    seen = []
    for rank in range(2):
        part = cp_split(mb, 2, rank)
        assert part.teacher_logprobs.shape == part.targets.shape
        for t, seq, tok in zip(part.teacher_logprobs.tolist(), part.seq_index.tolist(), part.token_index.tolist()):
            i = part.sample_index[seq]
            j = tok - sum(samples[k].response_ids.size for k in range(i))
            assert t == value_of[(i, j)]
            seen.append((i, j))
    assert sorted(seen) == sorted(value_of)
    samples[1].teacher_logprobs = None
    (none,) = make_microbatches(samples, [[0, 1]], packing=True)
    assert none.teacher_logprobs is None
