"""fused_logprobs_entropy against a naive reference (full logits, log_softmax, autograd).

TP = 1 runs in-process; TP = 2 and 3 run over gloo in one 3-process spawn executing many cases;
the parent gathers the weight-gradient shards and compares with the reference on the full weight.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_m2po.parallel import logprobs as lp_mod
from megatron_m2po.parallel.logprobs import _downcast_in_place, fused_logprobs_entropy
from megatron_m2po.standins.dist_testing import run_distributed

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def naive_reference(hidden, weight_full, targets, g_logp, g_ent, *, temperature=1.0,
                    vocab_size=None, dtype=torch.float64):
    """Full logits over the true vocabulary, log_softmax, gather, entropy, autograd."""
    v = weight_full.shape[0] if vocab_size is None else vocab_size
    h = hidden.detach().to(dtype).requires_grad_()
    w = weight_full.detach().to(dtype).requires_grad_()
    z = (h @ w[:v].T) / temperature
    logsm = torch.log_softmax(z, dim=-1)
    logp = logsm.gather(1, targets[:, None]).squeeze(1)
    ent = -(logsm.exp() * logsm).sum(-1)
    loss = torch.zeros((), dtype=dtype)
    if g_logp is not None:
        loss = loss + (logp * g_logp.to(dtype)).sum()
    if g_ent is not None:
        loss = loss + (ent * g_ent.to(dtype)).sum()
    gh, gw = torch.autograd.grad(loss, (h, w)) if loss.requires_grad else (
        torch.zeros_like(h), torch.zeros_like(w))
    return logp.detach(), ent.detach(), gh, gw


def run_fused(hidden, weight, targets, g_logp, g_ent, **kw):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logp, ent = fused_logprobs_entropy(h, w, targets, **kw)
    loss = torch.zeros((), dtype=logp.dtype)
    if g_logp is not None:
        loss = loss + (logp * g_logp.to(logp.dtype)).sum()
    if g_ent is not None:
        loss = loss + (ent * g_ent.to(logp.dtype)).sum()
    if loss.requires_grad:
        gh, gw = torch.autograd.grad(loss, (h, w))
    else:
        gh, gw = torch.zeros_like(h), torch.zeros_like(w)
    return logp.detach(), (None if ent is None else ent.detach()), gh, gw


def make_case(seed, T, H, V, dtype, vocab_size=None, tp=1):
    """Random inputs with targets spread over every shard of the true vocabulary."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 1.5).to(dtype)
    v = V if vocab_size is None else vocab_size
    targets = torch.randint(0, v, (T,), generator=g)
    shard = V // tp
    for r in range(min(tp, T)):  # make sure each shard (with a valid token) owns some targets
        if r * shard < v:
            targets[r] = min(r * shard + 1, v - 1)
    g_logp = torch.randn(T, generator=g, dtype=torch.float64)
    g_ent = torch.randn(T, generator=g, dtype=torch.float64)
    return hidden, weight, targets, g_logp, g_ent


# (name, dtype, T, H, V, chunk_rows, temperature, compute_entropy, vocab_size, terms)
# terms: which outputs feed the loss ("both", "logp", "ent")
def _cases(T=11):
    out = []
    for dtype, chunk, temp in itertools.product((torch.float64, torch.float32),
                                                (1, 3, T, T + 5), (1.0, 0.7)):
        out.append((dtype, T, 6, 12, chunk, temp, True, None, "both"))
    out += [
        (torch.float64, T, 6, 12, 4, 1.3, False, None, "logp"),
        (torch.float64, T, 6, 12, 4, 0.8, True, None, "ent"),
        (torch.float64, T, 6, 12, 4, 0.8, True, None, "logp"),
        (torch.float64, T, 6, 12, 5, 0.9, True, 10, "both"),   # padded vocab, 2 padded rows
        (torch.float32, T, 6, 12, 5, 1.0, True, 9, "both"),
        (torch.float32, T, 6, 12, 3, 1.0, False, 11, "logp"),
    ]
    return out


def _check_against_reference(case, res, hidden, weight, targets, g_logp, g_ent):
    dtype, T, H, V, chunk, temp, with_ent, vocab_size, terms = case
    gl = g_logp if terms in ("both", "logp") else None
    ge = g_ent if (terms in ("both", "ent") and with_ent) else None
    ref_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    r_logp, r_ent, r_gh, r_gw = naive_reference(hidden, weight, targets, gl, ge, temperature=temp,
                                                vocab_size=vocab_size, dtype=ref_dtype)
    logp, ent, gh, gw = res
    tol = TOL[dtype]
    msg = f"case {case}"
    assert logp.dtype == ref_dtype and gh.dtype == dtype and gw.dtype == dtype, msg
    torch.testing.assert_close(logp, r_logp, rtol=tol, atol=tol, msg=msg)
    if with_ent:
        torch.testing.assert_close(ent, r_ent, rtol=tol, atol=tol, msg=msg)
    else:
        assert ent is None, msg
    torch.testing.assert_close(gh, r_gh, rtol=tol, atol=tol, msg=msg)
    torch.testing.assert_close(gw, r_gw, rtol=tol, atol=tol, msg=msg)
    if vocab_size is not None:
        assert torch.all(gw[vocab_size:] == 0), msg


def _loss_grads(case, g_logp, g_ent):
    terms, with_ent = case[8], case[6]
    gl = g_logp if terms in ("both", "logp") else None
    ge = g_ent if (terms in ("both", "ent") and with_ent) else None
    return gl, ge


@pytest.mark.parametrize("v_block", [2048, 5, 1])  # one vocab tile, several, one column each
@pytest.mark.parametrize("case", _cases(), ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_logprobs_tp1_matches_naive(case, v_block, monkeypatch):
    monkeypatch.setattr(lp_mod, "_V_BLOCK", v_block)
    dtype, T, H, V, chunk, temp, with_ent, vocab_size, terms = case
    hidden, weight, targets, g_logp, g_ent = make_case(7, T, H, V, dtype, vocab_size)
    gl, ge = _loss_grads(case, g_logp, g_ent)
    res = run_fused(hidden, weight, targets, gl, ge, chunk_rows=chunk, temperature=temp,
                    compute_entropy=with_ent, vocab_size=vocab_size)
    _check_against_reference(case, res, hidden, weight, targets, g_logp, g_ent)


def test_logprobs_gradcheck_float64():
    """Finite differences, independent of the naive reference (padding + temperature)."""
    hidden, weight, targets, _, _ = make_case(3, 5, 4, 9, torch.float64, vocab_size=8)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()

    def f(h, w):
        return fused_logprobs_entropy(h, w, targets, chunk_rows=2, temperature=0.6, vocab_size=8)

    assert torch.autograd.gradcheck(f, (h, w), eps=1e-6, atol=1e-8)


def test_logprobs_downcast_in_place_matches_to():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        buf = torch.randn(7, 5, dtype=torch.float64)
        want = buf.to(dtype)
        for block in (1, 3, 35, 100):
            got = _downcast_in_place(buf.clone(), dtype, block=block)
            assert got.dtype == dtype and got.shape == (7, 5)
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("v_block", [2048, 6])
def test_logprobs_bf16_and_fp16_inputs_against_fp32_reference(v_block, monkeypatch):
    monkeypatch.setattr(lp_mod, "_V_BLOCK", v_block)
    for dtype in (torch.bfloat16, torch.float16):
        hidden, weight, targets, g_logp, g_ent = make_case(11, 13, 16, 40, dtype, vocab_size=37)
        logp, ent, gh, gw = run_fused(hidden, weight, targets, g_logp, g_ent, chunk_rows=4,
                                      temperature=0.9, vocab_size=37)
        # The reference sees exactly the low-precision values, computed in float64.
        r_logp, r_ent, r_gh, r_gw = naive_reference(hidden, weight, targets, g_logp, g_ent,
                                                    temperature=0.9, vocab_size=37)
        assert logp.dtype == torch.float32 and gh.dtype == dtype and gw.dtype == dtype
        torch.testing.assert_close(logp.double(), r_logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent.double(), r_ent, rtol=1e-5, atol=1e-5)
        # gradients are fp32-accurate then rounded once to the input dtype
        for got, ref in ((gh, r_gh), (gw, r_gw)):
            torch.testing.assert_close(got.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_logprobs_saves_no_logits_and_works_without_grad():
    T, H, V = 64, 8, 50
    hidden, weight, targets, _, _ = make_case(5, T, H, V, torch.float32)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        logp, ent = fused_logprobs_entropy(h, w, targets, chunk_rows=16)
    assert sorted(saved, key=str) == sorted([(T, H), (V, H), (T,), (T,), (T,)], key=str), saved
    with torch.no_grad():
        logp2, ent2 = fused_logprobs_entropy(hidden, weight, targets, chunk_rows=7)
    torch.testing.assert_close(logp2, logp.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent2, ent.detach(), rtol=1e-6, atol=1e-6)


def test_logprobs_empty_input():
    hidden = torch.zeros(0, 4, requires_grad=True)
    weight = torch.randn(6, 4, requires_grad=True)
    logp, ent = fused_logprobs_entropy(hidden, weight, torch.zeros(0, dtype=torch.long))
    assert logp.shape == (0,) and ent.shape == (0,)
    gh, gw = torch.autograd.grad((logp.sum() + ent.sum()), (hidden, weight), allow_unused=True)
    assert gh.shape == (0, 4) and torch.all(gw == 0)


def test_logprobs_rejects_bad_inputs():
    hidden, weight, targets, _, _ = make_case(1, 4, 3, 10, torch.float32)
    with pytest.raises(ValueError, match="not owned"):
        fused_logprobs_entropy(hidden, weight, torch.tensor([0, 1, 9, 2]), vocab_size=9)
    with pytest.raises(ValueError, match="not owned"):
        fused_logprobs_entropy(hidden, weight, torch.tensor([0, 1, -1, 2]))
    with pytest.raises(ValueError, match="weight_shard"):
        fused_logprobs_entropy(hidden, weight[:, :2], targets)
    with pytest.raises(ValueError, match="targets must be"):
        fused_logprobs_entropy(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="chunk_rows"):
        fused_logprobs_entropy(hidden, weight, targets, chunk_rows=0)
    with pytest.raises(ValueError, match="temperature"):
        fused_logprobs_entropy(hidden, weight, targets, temperature=0.0)


# ---------------------------------------------------------------------------- tensor parallel

def _tp_worker(rank, world_size, plan, seed):
    """Run ``plan`` = [(tp, case)]: tp = world_size on all ranks, tp = 2 on ranks 0 and 1."""
    groups = {world_size: dist.new_group(list(range(world_size))), 2: dist.new_group([0, 1])}
    results = []
    for i, (tp, case) in enumerate(plan):
        if rank >= tp:
            results.append(None)
            continue
        lp_mod._V_BLOCK = (2048, 4, 1)[i % 3]  # one vocab tile per shard, several, per column
        dtype, T, H, V, chunk, temp, with_ent, vocab_size, terms = case
        hidden, weight, targets, g_logp, g_ent = make_case(seed, T, H, V, dtype, vocab_size, tp=tp)
        gl, ge = _loss_grads(case, g_logp, g_ent)
        shard = V // tp
        res = run_fused(hidden, weight[rank * shard:(rank + 1) * shard], targets, gl, ge,
                        tp_group=groups[tp], vocab_start=rank * shard, chunk_rows=chunk,
                        temperature=temp, compute_entropy=with_ent, vocab_size=vocab_size)
        # numpy, not tensors: torch would pass tensors by shared-memory fds that die with us
        results.append(tuple(None if t is None else t.numpy() for t in res))
    # a target that falls in the padding must raise on every rank (no hang)
    hidden, weight, targets, _, _ = make_case(seed, 4, 3, 3 * world_size, torch.float32)
    try:
        fused_logprobs_entropy(hidden, weight[rank * 3:(rank + 1) * 3],
                               torch.tensor([0, 3 * world_size - 1, 1, 2]),
                               tp_group=groups[world_size], vocab_start=rank * 3,
                               vocab_size=3 * world_size - 1)
        raised = False
    except ValueError:
        raised = True
    return results, raised


@pytest.mark.multiproc
def test_logprobs_tp2_and_tp3_match_naive():
    """One 3-process spawn: TP = 2 cases on ranks {0, 1}, TP = 3 cases on all three."""
    T, seed = 10, 13
    # Few collectives: under load each one waits for every rank to be scheduled.
    tp2 = [(torch.float64, T, 5, 12, chunk, temp, True, None, "both")
           for chunk, temp in ((1, 1.0), (3, 0.7), (T, 0.7), (T + 5, 1.0))]
    tp2 += [
        (torch.float32, T, 5, 12, 4, 0.7, True, None, "both"),
        (torch.float64, T, 5, 12, 4, 1.2, False, None, "logp"),
        (torch.float64, T, 5, 12, 3, 0.8, True, None, "ent"),
        (torch.float64, T, 5, 12, 4, 0.9, True, 10, "both"),   # padding inside rank 1's shard
        (torch.float64, T, 5, 12, 4, 0.9, True, 5, "both"),    # rank 1's shard is all padding
        (torch.float32, T, 5, 12, 3, 1.0, True, 11, "both"),
        (torch.float64, 0, 5, 12, 4, 1.0, True, None, "both"),  # no rows
    ]
    tp3 = [(torch.float64, 8, 4, 12, 3, 0.7, True, None, "both"),
           (torch.float64, 8, 4, 12, 5, 1.0, True, 10, "both"),
           (torch.float32, 8, 4, 12, 8, 1.1, False, None, "logp")]
    plan = [(2, c) for c in tp2] + [(3, c) for c in tp3]
    outs = run_distributed(_tp_worker, 3, args=(plan, seed), timeout_s=150)
    assert all(raised for _, raised in outs)
    for i, (tp, case) in enumerate(plan):
        dtype, T, H, V, *_rest = case
        hidden, weight, targets, g_logp, g_ent = make_case(seed, T, H, V, dtype, case[7], tp=tp)
        per_rank = [tuple(None if a is None else torch.from_numpy(a) for a in res[i])
                    for res, _ in outs[:tp]]
        logp, ent, gh, _ = per_rank[0]
        for other in per_rank[1:]:  # replicated outputs and hidden gradient
            torch.testing.assert_close(other[0], logp, rtol=0, atol=0)
            torch.testing.assert_close(other[2], gh, rtol=0, atol=0)
        gw = torch.cat([r[3] for r in per_rank])
        _check_against_reference(case, (logp, ent, gh, gw), hidden, weight, targets, g_logp, g_ent)


def test_tf32_flag_is_exact_on_cpu_and_leaves_the_global_setting_alone():
    """``tf32=True`` only changes CUDA bf16 / fp16 matmuls (their TF32 numbers are gpu_check row 2's):
    on CPU the results are bit-identical, and the process-wide TF32 flag is restored after the
    forward and the backward, also when the forward raises."""
    from megatron_m2po.parallel.logprobs import _matmul_tf32, _tf32_applies

    g = torch.Generator().manual_seed(3)
    h = torch.randn(37, 16, generator=g).to(torch.bfloat16)
    w = (torch.randn(50, 16, generator=g) * 0.3).to(torch.bfloat16)
    t = torch.randint(0, 50, (37,), generator=g)
    outs = []
    for tf32 in (False, True):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = fused_logprobs_entropy(hh, ww, t, chunk_rows=8, tf32=tf32)
        (lp.sum() + ent.sum()).backward()
        outs.append((lp, ent, hh.grad, ww.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert not _tf32_applies(True, h, w)  # CPU tensors: never
    assert not _tf32_applies(True, h.float(), w.float())  # fp32 inputs would be rounded: never
    before = torch.backends.cuda.matmul.allow_tf32
    with pytest.raises(RuntimeError, match="inside"):
        with _matmul_tf32(True):
            assert torch.backends.cuda.matmul.allow_tf32
            raise RuntimeError("inside")
    assert torch.backends.cuda.matmul.allow_tf32 == before
