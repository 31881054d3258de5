"""Per-sequence sums of per-token values, the sequences possibly split over context-parallel ranks
(GSPO's sequence ratio, the drift diagnostics' sequence weights)."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["SumOverGroup", "sequence_sums"]


class SumOverGroup(torch.autograd.Function):
    """Sum of a tensor over a process group. Every rank's loss depends on the sum, so the gradient of
    a rank's part is the sum over the group of every rank's gradient of the sum (backward: the same
    all-reduce)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        out = t.detach().clone().contiguous()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.detach().clone().contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sequence_sums(values: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor, seq_group=None,
                  num_seqs: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sums, counts, inv)``: each sequence's sum of ``values`` over its ``mask`` tokens, its number of
    such tokens, and each token's sequence (an index into both). With ``seq_group`` (context
    parallelism) the ids ``0 .. num_seqs - 1`` are shared by the group's ranks and each sequence's parts
    are summed over it (one all-reduce, differentiable); otherwise the ids present are renumbered."""
    if seq_group is not None:
        inv, n_seq = seq_index.to(torch.int64), int(num_seqs)
    else:
        _, inv = torch.unique(seq_index, return_inverse=True)
        n_seq = int(inv.max()) + 1 if inv.numel() else 0
    m = mask.to(values.dtype)
    sums = torch.zeros(n_seq, dtype=values.dtype, device=values.device).index_add(0, inv, values * m)
    counts = torch.zeros(n_seq, dtype=values.dtype, device=values.device).index_add(0, inv, m)
    if seq_group is not None:
        sums, counts = SumOverGroup.apply(torch.stack([sums, counts]), seq_group).unbind(0)
    return sums, counts, inv
