"""Packed (THD) sequences on Megatron's local layer spec: per-sequence causal attention.

On GPU, packed micro-batches go through Megatron's packed-sequence path: ``PackedSeqParams``
with ``qkv_format="thd"`` and ``cu_seqlens``, Transformer Engine's ``TEDotProductAttention``
(which restricts attention to each sequence) and RoPE applied per sequence
(``apply_rotary_pos_emb(..., cu_seqlens=...)`` in ``megatron/core/transformer/attention.py``,
positions restarting at 0 in every sequence, ``rope_utils._apply_rotary_pos_emb_thd``).

Megatron-Core 0.16.1's local ``DotProductAttention`` asserts ``packed_seq_params is None``
(``megatron/core/transformer/dot_product_attention.py``); everything around it (the THD
reshapes in ``Attention.forward``, RoPE per sequence, the output reshape to ``[t, 1, h]``) is
Megatron's own code and runs on CPU. :class:`PackedDotProductAttention` fills that one gap: with
THD input it runs the parent's arithmetic on the packed tokens as one batch row of length
``t`` with a block-diagonal causal mask (token ``i`` attends to ``j`` iff both lie in the same
sequence and ``j <= i``), which is what TE's ``padding_causal`` THD kernels compute. Without
packed parameters it is the parent unchanged. So the actor runs one packed code path on both
platforms; only the attention kernel differs.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

__all__ = ["PackedDotProductAttention", "block_causal_mask"]


def block_causal_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Bool ``[1, 1, t, t]``, True where attention is *not* allowed (Megatron's mask convention,
    ``attention_mask_func`` fills those scores): other sequences and future tokens."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths.long())
    t = seg.numel()
    pos = torch.arange(t, device=cu_seqlens.device)
    blocked = (seg[:, None] != seg[None, :]) | (pos[None, :] > pos[:, None])
    return blocked[None, None]


class PackedDotProductAttention(DotProductAttention):
    """``DotProductAttention`` that also accepts ``packed_seq_params`` with ``qkv_format="thd"``
    (module docstring). Query / key / value come as ``[t, heads, head_dim]``; returns
    ``[t, heads * head_dim]`` like TE's THD attention."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed sequences in format {packed_seq_params.qkv_format!r}: only 'thd' is supported")
        if not torch.equal(packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv):
            raise ValueError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
        mask = block_causal_mask(packed_seq_params.cu_seqlens_q)
        out = super().forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask,
                              attn_mask_type=attn_mask_type, attention_bias=attention_bias)
        return out.squeeze(1)  # [t, 1, h] -> [t, h]
