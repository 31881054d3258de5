"""Context parallelism in the actor on CPU / gloo: Megatron's load-balanced split of padded and
packed micro-batches, the CP attention of the local layer spec against one-rank attention
(forward and backward), log-probs at CP=2 (and CP=2 x TP=2 + SP) equal to CP=1 and HF, and a
train step at CP=2 equal to the one-rank reference (log-probs, mask, metrics, gradients,
weights), also with the mask taken by correction (``mask_strategy=correct``) and with GSPO."""

import numpy as np
import pytest
import torch

import actor_testlib as lib
from megatron_m2po.actor.batch import cp_local_rows, cp_pad_multiple, cp_split, make_microbatches
from megatron_m2po.standins.dist_testing import run_distributed
from test_actor import _hf_dir, _train_layouts


@pytest.mark.parametrize("packing", [False, True])
def test_cp_split_holds_every_token_once_with_its_original_position(packing):
    """Over the CP ranks, each response token is predicted once, by the row at its original
    position, with its canonical token index; rank r holds chunks r and 2CP-1-r of each sequence."""
    samples = lib.make_samples(3, seed=3)
    cp = 2
    m = cp_pad_multiple(cp, 2, True)
    assert m == 8 and cp_pad_multiple(1, 2, True) == 1
    (whole,) = make_microbatches(samples, [[0, 1, 2]], packing=packing, pad_multiple=1 if packing else m,
                                 seq_multiple=m if packing else 1)
    if packing:
        assert all(int(n) % m == 0 for n in torch.diff(whole.cu_seqlens))
    seen = {}
    for r in range(cp):
        part = cp_split(whole, cp, r)
        assert part.tokens.shape[1] * cp == whole.tokens.shape[1]
        # the row of each held token is the whole micro-batch's row at the same original position
        lengths = np.diff(whole.cu_seqlens.numpy()) if packing else np.array([whole.tokens.shape[1]])
        glob, pos = cp_local_rows(lengths, cp, r)
        np.testing.assert_array_equal(part.tokens.numpy(), whole.tokens.numpy()[:, glob])
        np.testing.assert_array_equal(part.position_ids.numpy(), whole.position_ids.numpy()[:, glob])
        np.testing.assert_array_equal(part.position_ids[0].numpy(), pos)
        for k, t in enumerate(part.token_index.tolist()):
            assert t not in seen
            seen[t] = (int(glob[int(part.row_pos[k])]), int(part.row_seq[k]), int(part.targets[k]))
    assert len(seen) == whole.num_tokens
    for k, t in enumerate(whole.token_index.tolist()):
        assert seen[t] == (int(whole.row_pos[k]), int(whole.row_seq[k]), int(whole.targets[k]))
    c = lengths[0] // (2 * cp)
    np.testing.assert_array_equal(cp_local_rows(lengths[:1], cp, 0)[1], np.r_[0:c, 3 * c:4 * c])


def _attention_vs_one_rank(rank, world_size):
    from megatron_m2po.actor.attention import cp_causal_attention

    g = torch.Generator().manual_seed(0)
    heads, groups, d, cp = 4, 2, 8, world_size
    lengths = [8, 16, 4]  # multiples of 2 x CP
    cu = [0] + list(np.cumsum(lengths))
    q = torch.randn(sum(lengths), heads, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lengths), groups, d, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lengths), groups, d, generator=g, dtype=torch.float64)
    w = torch.randn(sum(lengths), heads * d, generator=g, dtype=torch.float64)
    # one rank: per-sequence causal attention
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    outs = []
    for a, b in zip(cu[:-1], cu[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in ref_in)
        ks, vs = ks.repeat_interleave(heads // groups, 0), vs.repeat_interleave(heads // groups, 0)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.3)
                    .transpose(0, 1).reshape(b - a, -1))
    ref = torch.cat(outs)
    (ref * w).sum().backward()
    # CP: this rank's rows
    glob, _ = cp_local_rows(np.array(lengths), cp, rank)
    glob = torch.from_numpy(glob)
    mine = [t[glob].clone().requires_grad_() for t in (q, k, v)]
    out = cp_causal_attention(*mine, cu, torch.distributed.group.WORLD, 0.3)
    (out * w[glob]).sum().backward()
    return (float((out - ref[glob]).abs().max()),
            max(float((m.grad - r.grad[glob]).abs().max()) for m, r in zip(mine, ref_in)))


def test_cp_attention_equals_one_rank_forward_and_backward():
    """TE's all-gather CP algorithm over gloo gives one-rank causal attention and its gradients
    (float64: to rounding) for packed sequences of different lengths with GQA."""
    for fwd, bwd in run_distributed(_attention_vs_one_rank, 2, timeout_s=60):
        assert fwd < 1e-12 and bwd < 1e-12, (fwd, bwd)


def _cp_logprobs(rank, world_size, root, layouts):
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch

    samples = lib.make_samples(5, seed=11)
    d = _hf_dir(root, "qwen3", False)
    out = []
    for tp, cp, sp, packing in layouts:
        cfg = lib.actor_config(d, tp=tp, mbs=2)
        cfg.parallel.context_parallel, cfg.parallel.sequence_parallel, cfg.parallel.packing = cp, sp, packing
        actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))
        assert torch.distributed.get_world_size(actor.pg.cp) == cp
        lps, ents = actor.compute_logprobs(RolloutBatch(samples), with_entropy=True)
        actor.close()
        hf = max(float(np.abs(lp - lib.hf_logprobs(d, s.prompt_ids, s.response_ids)).max())
                 for lp, s in zip(lps, samples))
        out.append(((tp, cp, sp, packing), lps, ents, hf))
    return out


@pytest.mark.parametrize("world_size,layouts", [
    (2, [(1, 1, False, False), (1, 2, False, False), (1, 2, False, True)]),
    (4, [(2, 2, True, False), (2, 2, True, True)]),
])
@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_cp_logprobs_equal_cp1_and_hf(tmp_path, world_size, layouts):
    """fp32 log-probs and entropies at CP=2 (and CP=2 x TP=2 + SP), padded and packed, equal
    CP=1's (DP=2 at world 2) and HF transformers' within 1e-5 on every rank."""
    res = run_distributed(_cp_logprobs, world_size, args=(str(tmp_path), layouts), timeout_s=300)
    for rank_res in res:
        (_, lp0, ent0, _) = res[0][0]
        for layout, lps, ents, hf in rank_res:
            print("layout (tp, cp, sp, packing)", layout, "max |logp - HF|", hf)
            assert hf < 1e-5, (layout, hf)
            if world_size == 2:
                for a, b in zip(lps, lp0):
                    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=str(layout))
                for a, b in zip(ents, ent0):
                    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=str(layout))


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_train_step_at_cp2_equals_one_rank(tmp_path):
    """Two M2PO updates at CP=2 (padded; packed), CP=2 x PP=2, CP=2 x DP=2 (packed) and CP=2 x
    TP=2 + SP (packed) give the one-rank reference's log-probs, global
    mask, metrics, norm-weight gradients and weights (the comparison of
    ``test_actor.test_train_step_layout_invariance``)."""
    (ref,) = run_distributed(_train_layouts, 1, args=(str(tmp_path), [(1, 1, {"mbs": 1})]), timeout_s=240)[0]
    others = run_distributed(_train_layouts, 2, args=(str(tmp_path), [
        (1, 1, {"cp": 2}), (1, 1, {"cp": 2, "packing": True, "max_tokens": 40})]), timeout_s=300)[0]
    others += run_distributed(_train_layouts, 4, args=(str(tmp_path), [
        (1, 2, {"cp": 2}), (1, 1, {"cp": 2, "packing": True}), (2, 1, {"cp": 2, "sp": True, "packing": True})]),
        timeout_s=400)[0]
    _, (lp0, ent0), m0, mask0, (g0,), w0, _ = ref
    assert m0[0]["m2po/mask_frac"] > 0 and sum(not k for k in mask0.values()) > 0
    for layout, (lp, ent), m, mask, grads, w, plan in others:
        assert all(packed == dict(layout[2]).get("packing", False) for _, _, packed in plan), (layout, plan)
        print("layout", layout, "max |logp - reference|", max(float(np.abs(a - b).max()) for a, b in zip(lp, lp0)))
        for a, b in zip(lp, lp0):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=str(layout))
        for a, b in zip(ent, ent0):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=str(layout))
        assert mask == mask0, layout
        for u in range(2):
            for key in ("m2po/mask_frac", "m2po/m2_before", "m2po/m2_after", "loss/policy", "policy/kl_k3",
                        "policy/entropy", "optim/grad_norm"):
                assert m[u][key] == pytest.approx(m0[u][key], rel=1e-5, abs=1e-7), (layout, u, key)
        for g in grads:
            assert not g or set(g) == set(g0), layout  # (PP layouts: no comparable names)
            for name in g:
                np.testing.assert_allclose(g[name], g0[name], rtol=1e-4, atol=1e-6, err_msg=f"{layout} {name}")
        for name in w0:
            np.testing.assert_allclose(w[name], w0[name], rtol=0, atol=5e-5, err_msg=f"{layout} {name}")


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_mask_correction_and_gspo_at_cp2_equal_one_rank(tmp_path):
    """At CP=2 (padded and packed) ``algo.m2po.mask_strategy=correct`` -- every CP rank holding part
    of each sequence, the changed sequences' differences summed over the CP group and cut alike --
    gives the one-rank pre-pass reference's mask, metrics, gradients and weights; GSPO, whose
    sequence ratio sums each sequence's log-ratios over the CP ranks (and their gradient back),
    gives its one-rank run's. The keep-all provisional mask forces a correction in every update."""
    refs = run_distributed(_train_layouts, 1, args=(str(tmp_path), [
        (1, 1, {"mbs": 1}), (1, 1, {"mbs": 1, "loss": "gspo"})]), timeout_s=240)[0]
    others = run_distributed(_train_layouts, 2, args=(str(tmp_path), [
        (1, 1, {"cp": 2, "correct": True}), (1, 1, {"cp": 2, "packing": True, "max_tokens": 40, "correct": True}),
        (1, 1, {"cp": 2, "loss": "gspo"}), (1, 1, {"cp": 2, "packing": True, "loss": "gspo"})]), timeout_s=400)[0]
    by_loss = {dict(r[0][2]).get("loss", "m2po"): r for r in refs}
    keys = {"m2po": ("m2po/mask_frac", "m2po/m2_before", "m2po/m2_after", "loss/policy", "policy/kl_k3",
                     "policy/entropy", "optim/grad_norm"),
            "gspo": ("gspo/seq_ratio_mean", "loss/clip_frac", "loss/policy", "policy/kl_k3", "policy/entropy",
                     "optim/grad_norm")}
    assert by_loss["gspo"][2][0]["loss/clip_frac"] > 0  # the clip is active: the ratio matters
    for layout, (lp, ent), m, mask, grads, w, _ in others:
        loss = dict(layout[2]).get("loss", "m2po")
        _, (lp0, ent0), m0, mask0, (g0,), w0, _ = by_loss[loss]
        if loss == "m2po":
            assert [m[u]["mask/correct"] for u in range(2)] == [1.0, 1.0], (layout, m)
            assert m[0]["mask/corrected_sequence_frac"] > 0, layout
            assert mask == mask0 and sum(not k for k in mask0.values()) > 0, layout
        for a, b in list(zip(lp, lp0)) + list(zip(ent, ent0)):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=str(layout))
        for u in range(2):
            for key in keys[loss]:
                assert m[u][key] == pytest.approx(m0[u][key], rel=1e-5, abs=1e-7), (layout, u, key)
        for g in grads:
            for name in g:
                np.testing.assert_allclose(g[name], g0[name], rtol=1e-4, atol=1e-6, err_msg=f"{layout} {name}")
        for name in w0:
            np.testing.assert_allclose(w[name], w0[name], rtol=0, atol=5e-5, err_msg=f"{layout} {name}")
