"""Micro-batch plans under expert parallelism: the same number of micro-batches on every rank.

Each MoE layer's token dispatcher is a collective over the expert-parallel group, whose ranks
hold different data-parallel shards (Megatron: EP subdivides the data-parallel dimension). The
actor plans micro-batches per shard (balanced shards, token budgets), so two shards may plan
different counts; the rank with more would then wait forever in an all-to-all that the other
never joins. :func:`same_microbatch_count` agrees on one count over the data-parallel group and
re-cuts each plan to it with :func:`equalize_microbatches`. Micro-batching is not a loss quantity
(the loss is normalised by the global token count), so results do not change.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["equalize_microbatches", "same_microbatch_count"]


def equalize_microbatches(groups: list[list[int]], lengths: list[int], target: int) -> list[list[int]]:
    """``groups`` (a micro-batch plan: lists of indices into ``lengths``) re-cut into exactly
    ``target`` micro-batches.

    Too few: the group with the most sequences (ties: the first) is split in two halves, until
    ``target`` (needs ``target`` <= the number of sequences). Too many: the two groups with the
    fewest tokens (ties: the first ones) are merged, which may exceed
    ``parallel.max_tokens_per_microbatch``. Each group keeps its indices in increasing order.
    Deterministic.
    """
    out = [list(g) for g in groups if g]
    n = sum(len(g) for g in out)
    if not 1 <= target <= n:
        raise ValueError(f"cannot make {target} micro-batches of {n} sequences")
    while len(out) < target:
        k = max(range(len(out)), key=lambda j: (len(out[j]), -j))
        g = out[k]
        out[k:k + 1] = [g[:len(g) // 2], g[len(g) // 2:]]
    while len(out) > target:
        a, b = sorted(sorted(range(len(out)), key=lambda j: (sum(lengths[i] for i in out[j]), j))[:2])
        out[a] = sorted(out[a] + out[b])
        del out[b]
    return out


def same_microbatch_count(groups: list[list[int]], lengths: list[int], n_sequences: int, group,
                          device: torch.device) -> list[list[int]]:
    """This rank's plan re-cut to the count every rank of ``group`` (the data-parallel group) agrees
    on: the largest planned count, capped by the fewest sequences any rank holds. Collective.

    Raises ValueError when some rank holds no sequence (it could run no MoE forward at all)."""
    t = torch.tensor([len(groups), -n_sequences], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    most, fewest = int(t[0]), -int(t[1])
    if fewest < 1:
        raise ValueError(f"expert parallelism: a data-parallel rank holds no sequence of this mini-batch (its "
                         f"{dist.get_world_size(group)} ranks each need one for the MoE all-to-alls); use at least "
                         "data-parallel-size sequences per mini-batch (trainer.prompts_per_update x "
                         "rollout.n_samples_per_prompt)")
    return equalize_microbatches(groups, lengths, min(most, fewest))
