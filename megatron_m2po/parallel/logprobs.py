"""Vocab-parallel fused token log-probs and entropy that never materialise ``[T, V]`` logits.

Megatron-based RL stacks usually compute ``output_layer(hidden)`` -> fp32 logits ``[T, V/TP]``
-> vocab-parallel log-softmax; with a 152k vocabulary and long responses that single tensor is
tens of GiB (slime #2253, #1951). Here the log-probs of the target tokens and the entropy of the
(temperature-scaled) sampling distribution come straight from the final hidden states and the
vocab-parallel output weight, ``chunk_rows`` rows at a time, so the working memory is
``O(chunk_rows * min(V/TP, _V_BLOCK))`` plus the gradients themselves.

Math (per row, ``z = h @ W.T / temperature`` over the true vocabulary, split over TP ranks):

- forward: ``m = allreduce_max(max_j z_j)``; then one stacked SUM all-reduce of
  ``s = sum_j exp(z_j - m)``, ``e = sum_j exp(z_j - m) * (z_j - m)``, ``z_t - m`` (only the rank
  owning the target contributes) and an ownership count (checked to be exactly 1 per row).
  ``logp = (z_t - m) - log s``, ``lse = m + log s``, ``entropy = log s - e / s`` (= lse - E_p[z],
  computed on shifted logits to avoid cancellation).
- backward recomputes each chunk's logits. With ``p = exp(z - lse)``:
  ``d logp / dz = onehot(t) - p`` and ``d entropy / dz_j = -p_j (z_j - E_p[z])``
  (from ``H = lse - sum_k p_k z_k`` and ``dp_k/dz_j = p_k (delta_kj - p_j)``), where
  ``z - E_p[z] = (z - lse) + entropy``. So ``dz = g_logp * onehot - p * (g_logp + g_ent * (z -
  E_p[z]))``, divided by ``temperature``; ``grad_hidden += dz @ W`` (all-reduced SUM over the TP
  group: ``hidden`` is replicated over TP, and its returned gradient is the full gradient, as in
  Megatron's ``ColumnParallelLinear``), ``grad_weight_shard += dz.T @ hidden`` (exactly this
  rank's rows of the full gradient). The entropy term is skipped when its gradient is None.
- Saved for backward: hidden, weight, targets and two fp32 values per row (lse, entropy); never
  the logits. Cost: the backward recomputes the logits (4 matmuls instead of 3).

Tiling: rows in chunks of ``chunk_rows``, the shard's vocabulary in blocks of ``_V_BLOCK``
rows; the forward keeps online-softmax statistics per row (running max, sum of exponentials,
sum of exp * shifted logit, rescaled when the max grows), so no tile is larger than
``[chunk_rows, _V_BLOCK]``; in the backward every tile is independent given the saved lse.

Precision: arithmetic in float32 (float64 when an input is float64); bf16 / fp16 weights are
cast to fp32 one vocab block at a time, so no full fp32 copy of the weight exists. With
``tf32=True`` (the actor's default, ``parallel.logprob_tf32``), CUDA inputs in bf16 / fp16 run the
matmuls on TF32 tensor cores: a bf16 or fp16 value is exact in TF32's 10-bit mantissa, so the
forward's products are those of fp32 with fp32 accumulation; the backward's ``dz`` (a genuine
fp32 value) is rounded to TF32. Measured on one H100 (``tools/gpu_check.py`` row 2's shapes,
forward + backward, best of 4), TF32 against fp32 matmuls:

    rows / chunk             1024          2048          4096          8192
    Qwen2.5-1.5B, T=8192     459 / 623 ms  248 / 487 ms  178 / 414 ms  142 / 390 ms   (peak 0.93-1.12 GiB)
    Qwen2.5-32B TP=8 rank    169 / 390 ms   93 / 308 ms   76 / 281 ms   61 / 273 ms   (peak 0.64-1.00 GiB)

(naive bf16 logits: 68 / 25 ms at 23 / 5.8 GiB). Log-probs within 9e-5 of fp32, gradients within
4.5e-4 relative (a bf16 forward's logits are 2^-8 relative). CPU tensors and fp32 / fp64 inputs
are unaffected. ``logp`` and
``entropy`` come out in the compute dtype; gradients accumulate in the compute dtype and are
returned in the inputs' dtypes (the weight gradient is cast inside its fp32 accumulator).

Padded vocabulary: Megatron pads the vocabulary to a multiple of
``make_vocab_size_divisible_by * TP``; the padded rows of the output weight are not tokens. Pass
``vocab_size`` (the true vocabulary) and the columns ``>= vocab_size`` (global index) are left
out of the softmax (equivalent to masking them to -inf; their weight gradient is 0). Targets must
be in ``[0, vocab_size)``; anything else raises ``ValueError``.

How the actor calls it (Megatron-Core ``GPTModel`` on the last pipeline stage)::

    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
    from megatron.core.tensor_parallel.utils import VocabUtility

    # 1. Final hidden states (after the final layer norm) instead of logits: actor/model.py
    #    builds a GPTModel subclass whose _postprocess returns them ([s, b, H], last stage).
    #    With sequence_parallel they are sequence-sharded: gather them with
    #    gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False) (its backward
    #    then *splits*, since our hidden gradient is already the full one; for the same reason
    #    no copy_to_tensor_model_parallel_region: the all-reduce is done here).
    # 2. Keep response rows only: position i predicts token i + 1.
    weight = (model.shared_embedding_or_output_weight()     # = actor.model.output_weight(model)
              if model.share_embeddings_and_output_weights else model.output_layer.weight)
    tp_rank, tp_size = pg.tp.rank(), pg.tp.size()   # pg: the actor's ProcessGroupCollection
    vocab_start, _ = VocabUtility.vocab_range_from_per_partition_vocab_size(
        weight.shape[0], tp_rank, tp_size)     # = tp_rank * V_padded / TP
    logp, entropy = fused_logprobs_entropy(
        hidden_rows,                # [T, H], response positions only, flattened over the batch
        weight,                     # [V_padded / TP, H], bf16 on GPU
        target_ids,                 # [T] int64, the next tokens
        tp_group=pg.tp,
        vocab_start=vocab_start,
        vocab_size=hf_config.vocab_size,   # true vocab; excludes Megatron's padding
        chunk_rows=1024,
        temperature=rollout_temperature,   # as the engine sampled
        compute_entropy=with_entropy)

Autograd then sends the weight gradient to the parameter (Megatron's DDP hooks add it to
``main_grad``) and the hidden gradient back through the final layer norm.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

__all__ = ["fused_logprobs_entropy"]

# Vocab rows per tile: working memory is a few [chunk_rows, _V_BLOCK] fp32 tiles plus, for
# bf16/fp16 weights, one [_V_BLOCK, H] fp32 cast of the weight block (2048 x 5120 -> 40 MiB).
_V_BLOCK = 2048


def _weight_blocks(weight: torch.Tensor, n_valid: int, cd: torch.dtype
                   ) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(start, end, weight[start:end] in the compute dtype)`` over the valid vocab rows."""
    for s in range(0, n_valid, _V_BLOCK):
        e = min(s + _V_BLOCK, n_valid)
        yield s, e, weight[s:e].to(cd)


def _downcast_in_place(buf: torch.Tensor, dtype: torch.dtype, block: int = 1 << 22) -> torch.Tensor:
    """``buf.to(dtype)`` for a narrower dtype, written into ``buf``'s own storage.

    Saves the extra copy (e.g. 195 MiB for a bf16 [19008, 5120] gradient next to its 389 MiB fp32
    accumulator). Element ``i`` of the result lives at byte ``i * size(dtype)``, never after
    byte ``i * size(buf.dtype)``, so a block written in order only overwrites source bytes that
    were already read. The result is a view on ``buf``'s (larger) storage.
    """
    if buf.dtype == dtype:
        return buf
    if dtype.itemsize > buf.dtype.itemsize or not buf.is_contiguous() or buf.numel() == 0:
        return buf.to(dtype)
    src = buf.view(-1)
    dst = src.view(torch.uint8)[: src.numel() * dtype.itemsize].view(dtype)
    for i in range(0, src.numel(), block):
        dst[i:i + block].copy_(src[i:i + block].to(dtype))
    return dst.view(buf.shape)


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)


def _tf32_applies(tf32: bool, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    half = (torch.bfloat16, torch.float16)
    return bool(tf32) and hidden.is_cuda and hidden.dtype in half and weight.dtype in half


@contextlib.contextmanager
def _matmul_tf32(enabled: bool) -> Iterator[None]:
    """TF32 matmuls inside the block when ``enabled`` (the global flag is restored after)."""
    if not enabled:
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


class _FusedLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, tp_group, vocab_start, n_valid, chunk_rows,
                temperature, compute_entropy, tf32):
        ctx.tf32 = _tf32_applies(tf32, hidden, weight)
        with _matmul_tf32(ctx.tf32):
            return _FusedLogprobsEntropy._forward(ctx, hidden, weight, targets, tp_group, vocab_start, n_valid,
                                                  chunk_rows, temperature, compute_entropy)

    @staticmethod
    def _forward(ctx, hidden, weight, targets, tp_group, vocab_start, n_valid, chunk_rows,
                 temperature, compute_entropy):
        cd = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
        T = hidden.shape[0]
        inv_temp = 1.0 / temperature
        dev = hidden.device
        logp = torch.empty(T, dtype=cd, device=dev)
        lse = torch.empty(T, dtype=cd, device=dev)
        ent = torch.zeros(T, dtype=cd, device=dev)
        bad_rows = torch.zeros((), dtype=torch.int64, device=dev)
        with torch.no_grad():
            for r0 in range(0, T, chunk_rows):
                r1 = min(r0 + chunk_rows, T)
                c = r1 - r0
                # 1/temperature goes into the [c, H] rows, not into every [c, V] tile
                h = hidden[r0:r1].to(cd)
                h = h * inv_temp if inv_temp != 1.0 else h
                local = targets[r0:r1] - vocab_start
                owned = (local >= 0) & (local < n_valid)
                # Online softmax statistics over this shard's vocab blocks, relative to the
                # running row max m: s = sum exp(z - m), e = sum exp(z - m) * (z - m).
                m = torch.full((c,), float("-inf"), dtype=cd, device=dev)
                s = torch.zeros(c, dtype=cd, device=dev)
                e = torch.zeros(c, dtype=cd, device=dev)
                z_t = torch.zeros(c, dtype=cd, device=dev)
                for v0, v1, wb in _weight_blocks(weight, n_valid, cd):
                    z = h @ wb.T
                    in_blk = owned & (local >= v0) & (local < v1)
                    zt_b = z.gather(1, (local - v0).clamp(0, v1 - v0 - 1)[:, None]).squeeze(1)
                    z_t += torch.where(in_blk, zt_b, torch.zeros_like(zt_b))
                    m_new = torch.maximum(m, z.amax(dim=1))
                    z.sub_(m_new[:, None])
                    ex = torch.exp(z)
                    if v0 == 0:
                        s = ex.sum(dim=1)
                        if compute_entropy:
                            e = ex.mul_(z).sum(dim=1)
                    else:
                        shift = m - m_new  # <= 0, finite after the first block
                        alpha = torch.exp(shift)
                        if compute_entropy:
                            e = alpha * (e + shift * s) + ex.mul(z).sum(dim=1)
                        s = alpha * s + ex.sum(dim=1)
                    m = m_new
                    del z, ex
                # Re-base to the max over the TP group; a shard that is all padding has s = 0.
                m_g = m.clone()
                _all_reduce(m_g, dist.ReduceOp.MAX, tp_group)
                stats = torch.zeros(4, c, dtype=cd, device=dev)  # sum exp, sum exp*z, z_t, owned
                if n_valid > 0:
                    shift = m - m_g
                    beta = torch.exp(shift)
                    stats[0] = beta * s
                    if compute_entropy:
                        stats[1] = beta * (e + shift * s)
                    stats[2] = torch.where(owned, z_t - m_g, torch.zeros_like(z_t))
                stats[3] = owned.to(cd)
                _all_reduce(stats, dist.ReduceOp.SUM, tp_group)
                log_s = torch.log(stats[0])
                logp[r0:r1] = stats[2] - log_s
                lse[r0:r1] = m_g + log_s
                if compute_entropy:
                    ent[r0:r1] = log_s - stats[1] / stats[0]
                bad_rows += (stats[3] != 1).sum()
        if T > 0 and int(bad_rows) > 0:
            raise ValueError(
                f"fused_logprobs_entropy: {int(bad_rows)} of {T} targets are not owned by exactly "
                f"one tensor-parallel rank (targets range [{int(targets.min())}, "
                f"{int(targets.max())}]); targets must lie in [0, vocab_size) of the true "
                f"vocabulary and each rank's vocab_start must be tp_rank * V/TP "
                f"(this rank: vocab_start={vocab_start}, valid rows={n_valid}).")
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.cfg = (tp_group, vocab_start, n_valid, chunk_rows, temperature, cd)
        ctx.set_materialize_grads(False)
        if compute_entropy:
            return logp, ent.clone()
        return logp, None

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        with _matmul_tf32(ctx.tf32):
            return _FusedLogprobsEntropy._backward(ctx, g_logp, g_ent) + (None,)

    @staticmethod
    def _backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        tp_group, vocab_start, n_valid, chunk_rows, temperature, cd = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        T, H = hidden.shape
        inv_temp = 1.0 / temperature
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=cd, device=weight.device) if need_w else None
        # Fold 1/temperature (d z / d raw logits) into the per-row upstream gradients.
        gl = g_logp.to(cd) * inv_temp if g_logp is not None else None
        ge = g_ent.to(cd) * inv_temp if g_ent is not None else None
        if gl is None and ge is None:
            T = 0  # nothing flows back: zero gradients
        for r0 in range(0, T, chunk_rows):
            r1 = min(r0 + chunk_rows, T)
            h = hidden[r0:r1].to(cd)
            h_s = h * inv_temp if inv_temp != 1.0 else h
            neg_lse = -lse[r0:r1, None]
            gl_c = gl[r0:r1] if gl is not None else None
            # dz = -p * (g_logp + g_ent * (z - E_p[z])) with z - E_p[z] = log p + entropy
            #    = p * (a * log p + b),  a = -g_ent,  b = -(g_logp + g_ent * entropy)
            if ge is not None:
                a = -ge[r0:r1, None]
                b = a * ent[r0:r1, None]
                if gl_c is not None:
                    b = b - gl_c[:, None]
            else:
                a, b = None, -gl_c[:, None]
            local = targets[r0:r1] - vocab_start
            gh = torch.zeros(r1 - r0, H, dtype=cd, device=hidden.device) if need_h else None
            # Each (rows, vocab block) tile is independent given the saved lse and entropy.
            for v0, v1, wb in _weight_blocks(weight, n_valid, cd):
                dz = torch.addmm(neg_lse, h_s, wb.T)  # log p
                if a is not None:
                    p = torch.exp(dz)
                    dz.mul_(a).add_(b).mul_(p)
                    del p
                else:
                    dz.exp_().mul_(b)
                if gl_c is not None:  # + g_logp * onehot(target)
                    rows = ((local >= v0) & (local < v1)).nonzero().squeeze(1)
                    dz.index_put_((rows, local[rows] - v0), gl_c[rows], accumulate=True)
                if need_h:
                    gh.addmm_(dz, wb)
                if need_w:
                    grad_w[v0:v1].addmm_(dz.T, h)
                del dz
            if need_h:
                _all_reduce(gh, dist.ReduceOp.SUM, tp_group)
                grad_h[r0:r1] = gh
        if need_w:
            grad_w = _downcast_in_place(grad_w, weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None


def fused_logprobs_entropy(hidden: torch.Tensor, weight_shard: torch.Tensor,
                           targets: torch.Tensor, *, tp_group=None, vocab_start: int = 0,
                           chunk_rows: int = 1024, temperature: float = 1.0,
                           compute_entropy: bool = True, vocab_size: int | None = None,
                           tf32: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` and entropy of ``softmax(hidden @ W.T / temperature)``, vocab-parallel.

    Args:
        hidden: ``[T, H]`` final hidden states (same on every TP rank), any float dtype.
        weight_shard: ``[V/TP, H]`` this rank's rows of the output weight (global rows
            ``[vocab_start, vocab_start + V/TP)``).
        targets: ``[T]`` integer global token ids in ``[0, vocab_size)``, same on every TP rank.
        tp_group: tensor-parallel process group; ``None`` means the weight holds the whole
            vocabulary and nothing is communicated.
        vocab_start: first global vocab row of ``weight_shard`` (``tp_rank * V/TP``).
        chunk_rows: rows processed at once; working memory is ~3 fp32 tiles of
            ``[chunk_rows, 2048]`` plus two of ``[chunk_rows, H]``; one all-reduce per chunk.
        temperature: logits are divided by it before the softmax (as the rollout engine does).
        compute_entropy: also return the entropy (else ``None``; saves one pass per chunk).
        vocab_size: the true global vocabulary; columns ``>= vocab_size`` (Megatron's padding)
            are excluded from the softmax. ``None``: every row of every shard is a token.
        tf32: TF32 tensor-core matmuls for CUDA bf16 / fp16 inputs (see Precision above).

    Returns:
        ``(logp [T], entropy [T] or None)`` in float32 (float64 for float64 inputs); both carry
        gradients to ``hidden`` (the full gradient, all-reduced over ``tp_group``) and
        ``weight_shard`` (its rows of the full gradient), returned in the inputs' dtypes.
        Collective calls: per chunk one MAX and one SUM all-reduce in forward and one SUM
        all-reduce of ``[chunk_rows, H]`` in backward; every TP rank must call it with the same
        ``T`` and ``chunk_rows``.
    """
    if hidden.dim() != 2 or weight_shard.dim() != 2 or hidden.shape[1] != weight_shard.shape[1]:
        raise ValueError(f"fused_logprobs_entropy expects hidden [T, H] and weight_shard [V/TP, H]; "
                         f"got {tuple(hidden.shape)} and {tuple(weight_shard.shape)}")
    if targets.dim() != 1 or targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"targets must be [T] = [{hidden.shape[0]}]; got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids; got dtype {targets.dtype}")
    if not (hidden.dtype.is_floating_point and weight_shard.dtype.is_floating_point):
        raise ValueError(f"hidden and weight_shard must be floating point; got {hidden.dtype}, "
                         f"{weight_shard.dtype}")
    if int(chunk_rows) < 1:
        raise ValueError(f"chunk_rows must be >= 1; got {chunk_rows}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if vocab_start < 0:
        raise ValueError(f"vocab_start must be >= 0; got {vocab_start}")
    v_shard = weight_shard.shape[0]
    if vocab_size is None:
        n_valid = v_shard
    else:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1; got {vocab_size}")
        n_valid = max(0, min(v_shard, int(vocab_size) - int(vocab_start)))
    targets = targets.to(device=hidden.device, dtype=torch.int64)
    return _FusedLogprobsEntropy.apply(hidden, weight_shard, targets, tp_group, int(vocab_start),
                                       n_valid, int(chunk_rows), float(temperature),
                                       bool(compute_entropy), bool(tf32))
