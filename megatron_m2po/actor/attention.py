"""Packed (THD) sequences on Megatron's local layer spec: per-sequence causal attention.

On GPU, packed micro-batches go through Megatron's packed-sequence path: ``PackedSeqParams``
with ``qkv_format="thd"`` and ``cu_seqlens``, Transformer Engine's ``TEDotProductAttention``
(which restricts attention to each sequence) and RoPE applied per sequence
(``apply_rotary_pos_emb(..., cu_seqlens=...)`` in ``megatron/core/transformer/attention.py``,
positions restarting at 0 in every sequence, ``rope_utils._apply_rotary_pos_emb_thd``).

Megatron-Core 0.16.1's local ``DotProductAttention`` asserts ``packed_seq_params is None``
(``megatron/core/transformer/dot_product_attention.py``); everything around it (the THD
reshapes in ``Attention.forward``, the output reshape to ``[t, 1, h]``) is Megatron's own code
and runs on CPU. :class:`PackedDotProductAttention` fills that gap the way varlen kernels are
emulated: the pack's sequences are split into groups of similar length (:func:`length_groups`),
each group's tokens are scattered into a ``[max_len, n, heads, head_dim]`` batch, causal
attention runs on it, and the outputs of the real tokens are gathered back. Token ``i``
therefore attends to ``j`` iff both lie in the same sequence and ``j <= i`` -- what TE's
``padding_causal`` THD kernels compute -- and attention costs about what the sequences alone
cost, not ``t^2`` as one dense block-diagonal mask over the pack would
(:func:`block_causal_mask`, kept as a reference). The projections, the MLP and the vocabulary
run on the ``t`` packed tokens only.

The causal attention itself, padded or packed, is
``torch.nn.functional.scaled_dot_product_attention`` when that computes exactly what the parent
would (fp32, plain softmax scale, no dropout, window or sink: :meth:`fused_causal_ok`), a fused
kernel that skips the blocks above the diagonal as the GPU's do; otherwise the parent's
arithmetic. :func:`install_thd_rope` replaces Megatron's per-sequence RoPE loop for packs by one
gather (TE's fused THD RoPE does the same in one kernel on GPU). So the actor runs one packed
code path on both platforms; only the kernels differ.
"""

from __future__ import annotations

import numpy as np
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

__all__ = ["PackedDotProductAttention", "block_causal_mask", "cp_causal_attention", "install_thd_rope", "length_groups",
           "thd_to_padded_index"]


def block_causal_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Bool ``[1, 1, t, t]``, True where attention is *not* allowed (Megatron's mask convention,
    ``attention_mask_func`` fills those scores): other sequences and future tokens."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths.long())
    t = seg.numel()
    pos = torch.arange(t, device=cu_seqlens.device)
    blocked = (seg[:, None] != seg[None, :]) | (pos[None, :] > pos[:, None])
    return blocked[None, None]


# Attention elements (batch x heads x query x key) counted as the cost of one more attention call
# (~10 small torch ops). tools/benchmarks/packing.py --actor with 20k / 200k / 2M gave packed
# speed-ups within the benchmark's noise of each other; 200k was the best of the three.
GROUP_OVERHEAD_ELEMENTS = 200_000


def length_groups(lengths: list[int], heads: int = 1, overhead: int = GROUP_OVERHEAD_ELEMENTS) -> list[list[int]]:
    """Split a pack's sequences (indices, longest first) into groups padded separately.

    Padding a group to its longest sequence costs ``n * max_len^2 * heads`` attention elements,
    and each group costs ``overhead`` more; the split minimising the sum over contiguous runs of
    the sequences sorted by length is found exactly (dynamic programme, O(n^2)). A pack of equal
    lengths stays one group; a first-fit-decreasing pack (a few long sequences, short fillers)
    splits into the long ones and the fillers."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j sorted sequences
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # group = sorted[i:j], padded to its longest, sorted[i]
            c = best[i] + (j - i) * lengths[order[i]] ** 2 * heads + overhead
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def thd_to_padded_index(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(pos, seq, max_len)``: packed token ``i`` is position ``pos[i]`` of sequence ``seq[i]``."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
    pos = torch.arange(seq.numel(), device=cu.device) - cu[:-1][seq]
    return pos, seq, int(lengths.max()) if lengths.numel() else 0


_PLANS: dict = {}  # the current micro-batch's _PackedAttentionPlan, keyed by (cu_seqlens, heads per partition)


class _PackedAttentionPlan:
    """Index tensors of one pack's padded groups, computed once per micro-batch (every layer
    of the micro-batch reuses them)."""

    def __init__(self, cu: list[int], heads: int, device: torch.device, overhead: int):
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
        self.groups = []  # (token indices, pos, seq, max_len, n) per group
        order = []
        for g in length_groups(lengths, heads, overhead):
            tok = torch.cat([torch.arange(cu[i], cu[i + 1], device=device) for i in g])
            pos, seq, max_len = thd_to_padded_index(
                torch.tensor([0] + [int(x) for x in np.cumsum([lengths[i] for i in g])], device=device))
            self.groups.append((tok, pos, seq, max_len, len(g)))
            order.append(tok)
        cat = torch.cat(order)
        self.inverse = None  # outputs of the groups, concatenated, are in token order already
        if not torch.equal(cat, torch.arange(cat.numel(), device=device)):
            self.inverse = torch.empty_like(cat)
            self.inverse[cat] = torch.arange(cat.numel(), device=device)


class _GatherCP(torch.autograd.Function):
    """All-gather along a new first dimension over the CP group; backward: the sum of every rank's
    gradient of the gathered tensor, this rank's slice (TE reduce-scatters dK / dV; gloo has no
    reduce-scatter, so all-reduce and slice: the same values)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(group.size())]
        torch.distributed.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad[ctx.group.rank()], None


def cp_causal_attention(query, key, value, cu_seqlens: list[int], group, scale: float) -> torch.Tensor:
    """Causal attention of packed, context-parallel sequences, the algorithm of TE's
    ``AttnFuncWithCPAndKVAllGather`` (``transformer_engine/pytorch/attention/dot_product_attention/
    context_parallel.py``): all-gather K and V over the CP group, put each sequence's ``2 CP``
    chunks back in order, and let each of this rank's two query chunks ``i`` (``r`` and
    ``2 CP - 1 - r``, :func:`~megatron_m2po.actor.batch.cp_local_rows`) attend to the keys of
    chunks ``0..i``, causally aligned at the bottom right (query position ``i c + a`` sees key
    positions ``<= i c + a``). Backward sums dK / dV over the group (TE: reduce-scatter).

    ``query`` ``[t, heads, d]`` and ``key`` / ``value`` ``[t, groups, d]`` hold this rank's rows
    (its part of every sequence, in order); ``cu_seqlens`` are the *global* padded bounds (each
    length a multiple of ``2 CP``). Returns ``[t, heads * d]``. The softmax runs over exactly the
    keys it runs over without CP, so the result equals CP=1 up to summation order. On GPU TE's
    kernels compute the same with the group's ``cp_comm_type`` (p2p ring, all-gather or a2a)."""
    cp, r = group.size(), group.rank()
    rep = query.shape[1] // key.shape[1]
    k_all, v_all = _GatherCP.apply(key, group), _GatherCP.apply(value, group)  # [cp, t, groups, d]
    outs = []
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        c = (b - a) // (2 * cp)
        off = a // cp  # this sequence's first local row on every rank

        def whole(x_all):  # [L, groups, d]: chunk j is rank j's first chunk or rank 2cp-1-j's second
            return torch.cat([x_all[j, off:off + c] if j < cp else x_all[2 * cp - 1 - j, off + c:off + 2 * c]
                              for j in range(2 * cp)])

        k_s, v_s = whole(k_all), whole(v_all)
        if rep > 1:
            k_s, v_s = k_s.repeat_interleave(rep, dim=1), v_s.repeat_interleave(rep, dim=1)
        for half, i in enumerate((r, 2 * cp - 1 - r)):
            q = query[off + half * c:off + (half + 1) * c]
            n_keys = (i + 1) * c
            allowed = torch.arange(n_keys, device=q.device)[None, :] <= (i * c + torch.arange(c, device=q.device))[:, None]
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k_s[:n_keys].transpose(0, 1), v_s[:n_keys].transpose(0, 1), attn_mask=allowed,
                scale=scale)
            outs.append(out.transpose(0, 1).reshape(c, -1))
    return torch.cat(outs)


class PackedDotProductAttention(DotProductAttention):
    """``DotProductAttention`` that also accepts ``packed_seq_params`` with ``qkv_format="thd"``
    (module docstring). Query / key / value come as ``[t, heads, head_dim]``; returns
    ``[t, heads * head_dim]`` like TE's THD attention.

    With context parallelism (Megatron's local class asserts CP = 1: "only supported by
    TEDotProductAttention") attention runs :func:`cp_causal_attention` over the CP group of
    ``pg_collection`` for padded and packed micro-batches alike (a padded row is one sequence)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        import copy

        cp = config.context_parallel_size
        parent_config = config
        if cp > 1:  # the parent's CP assert is about its own kernel; CP attention is this class's job
            parent_config = copy.copy(config)
            parent_config.context_parallel_size = 1
        super().__init__(parent_config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.config = config
        self.cp_group = None
        if cp > 1:
            from megatron.core import parallel_state as ps

            self.cp_group = getattr(pg_collection, "cp", None) or ps.get_context_parallel_group()
            if self.config.window_size is not None or self.softmax_offset is not None or \
                    config.apply_query_key_layer_scaling or (attention_dropout or config.attention_dropout) > 0:
                raise ValueError("context parallelism on the CPU layer spec supports plain causal attention only "
                                 "(no attention dropout, sliding window, softmax offset or query-key layer scaling)")

    def _cp_forward(self, query, key, value, packed_seq_params):
        if self.attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"context parallelism needs causal attention, got {self.attn_mask_type}")
        if packed_seq_params is not None:
            return cp_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q.tolist(), self.cp_group,
                                       self.softmax_scale)
        s, b = query.shape[0], query.shape[1]  # padded [s, b, heads, d]: every row one sequence of s x CP
        flat = lambda x: x.transpose(0, 1).reshape(b * s, x.shape[2], x.shape[3])  # noqa: E731
        cu = [k * s * self.cp_group.size() for k in range(b + 1)]
        out = cp_causal_attention(flat(query), flat(key), flat(value), cu, self.cp_group, self.softmax_scale)
        return out.reshape(b, s, -1).transpose(0, 1)

    def fused_causal_ok(self, query) -> bool:
        """Whether :meth:`causal_attention` computes exactly what the parent would: causal
        self-attention in fp32 with the plain softmax scale, no dropout, window or sink."""
        cfg = self.config
        return (query.dtype == torch.float32 and self.attn_mask_type == AttnMaskType.causal
                and self.softmax_offset is None and not cfg.apply_query_key_layer_scaling
                and getattr(cfg, "window_size", None) is None
                and (not self.training or self.attention_dropout.p == 0.0))

    def causal_attention(self, query, key, value):
        """Causal attention of ``[s, b, heads, d]`` inputs (key / value with the query groups of
        GQA), returning ``[s, b, heads * d]`` as the parent does, through
        ``torch.nn.functional.scaled_dot_product_attention``: on CPU a fused flash-style kernel
        that skips the blocks above the diagonal, as the GPU's fused kernels do, where the
        parent materialises the full ``[b, heads, s, s]`` scores, masks and softmaxes them."""
        rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if rep > 1:
            key, value = key.repeat_interleave(rep, dim=2), value.repeat_interleave(rep, dim=2)
        s, b = query.shape[0], query.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
            is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if self.cp_group is not None and self.cp_group.size() > 1:
            if attention_mask is not None or attention_bias is not None:
                raise ValueError("context parallelism on the CPU layer spec takes no attention mask or bias")
            return self._cp_forward(query, key, value, packed_seq_params)
        fused = attention_mask is None and attention_bias is None and self.fused_causal_ok(query)
        if packed_seq_params is None:
            if fused:
                return self.causal_attention(query, key, value)
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed sequences in format {packed_seq_params.qkv_format!r}: only 'thd' is supported")
        if not torch.equal(packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv):
            raise ValueError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
        if self.attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"packed sequences need causal attention, got {self.attn_mask_type}")
        cu = packed_seq_params.cu_seqlens_q
        if int(cu[-1]) != query.shape[0]:
            raise ValueError(f"cu_seqlens ends at {int(cu[-1])} but the pack has {query.shape[0]} tokens")
        key_ = (tuple(cu.tolist()), self.num_attention_heads_per_partition)
        plan = _PLANS.get(key_)
        if plan is None:
            plan = _PackedAttentionPlan(list(key_[0]), key_[1], query.device, GROUP_OVERHEAD_ELEMENTS)
            _PLANS.clear()  # one micro-batch at a time: keep only its plan
            _PLANS[key_] = plan
        outs = []
        whole = plan.inverse is None and len(plan.groups) == 1
        for tok, pos, seq, max_len, n in plan.groups:
            def to_padded(x):  # [t, heads, d] -> [max_len, n, heads, d] of this group, zeros elsewhere
                x = x if whole else x[tok]
                return x.new_zeros((max_len, n) + tuple(x.shape[1:])).index_put((pos, seq), x)

            q, k, v = to_padded(query), to_padded(key), to_padded(value)
            if fused:
                out = self.causal_attention(q, k, v)
            else:  # mask None + causal: the parent's default causal mask, as on the padded path
                out = super().forward(q, k, v, None, attn_mask_type=attn_mask_type, attention_bias=attention_bias)
            outs.append(out[pos, seq])  # [max_len, n, h] -> [t_g, h]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out if plan.inverse is None else out[plan.inverse]


def _thd_rope(original):
    """Megatron's ``rope_utils._apply_rotary_pos_emb_thd`` without its loop over sequences.

    Megatron's baseline (0.16.1) slices ``freqs`` once per sequence of the pack and
    concatenates the slices before one ``_apply_rotary_pos_emb_bshd`` call; TE's fused THD
    kernel (the GPU path) does it in one pass. Without context parallelism the concatenation is
    an index: ``freqs[position within the sequence]`` (``freqs`` of the longest sequence), or
    ``freqs[:t]`` itself when ``freqs`` covers every packed position (Megatron's "exact mapping"
    case). Same values, one gather instead of a Python loop per layer and sequence. With context
    parallelism, the original runs."""
    from megatron.core.models.common.embeddings import rope_utils

    def apply_thd(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0,
                  cp_group=None):
        if cp_group is None or cp_group.size() != 1:
            return original(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                            multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
        if freqs.dim() >= 1 and freqs.size(0) == cu_seqlens[-1]:
            packed = freqs
        else:
            pos, _, _ = thd_to_padded_index(cu_seqlens)
            packed = freqs[pos]
        return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), packed, rotary_interleaved=rotary_interleaved,
                                                     multi_latent_attention=multi_latent_attention,
                                                     mscale=mscale).squeeze(1)

    apply_thd.original = original
    return apply_thd


def install_thd_rope() -> None:
    """Use :func:`_thd_rope` for packed RoPE on the local spec (idempotent). Installed only where
    Megatron's function has the 0.16 signature; other versions keep their own."""
    import inspect

    from megatron.core.models.common.embeddings import rope_utils

    fn = getattr(rope_utils, "_apply_rotary_pos_emb_thd", None)
    if fn is None or hasattr(fn, "original"):
        return
    params = list(inspect.signature(fn).parameters)
    if params != ["t", "cu_seqlens", "freqs", "rotary_interleaved", "multi_latent_attention", "mscale", "cp_group"]:
        return
    rope_utils._apply_rotary_pos_emb_thd = _thd_rope(fn)
