"""The lease's transient in ``m2po plan``: what a rank stages on its GPU to receive a step's samples.

Rank 0 leases a training step and sends every rank the samples of its data-parallel shard, with
the plans of the step's optimizer mini-batches (``trainer/batching.py`` ``shard_step``,
``parallel/rank0.py`` ``scatter_from_rank0``). The part travels pickled through a uint8 tensor on
the default group's device, the GPU under NCCL: rank 0 stages one part at a time, every other
rank a buffer of its own part (every stage, TP and CP rank of a replica receives the whole shard).
So every stage holds one part transiently before the step's first forward, and the planner adds
it to each stage (:func:`lease_transient_bytes`, ``StageMemory.lease``).

A part's bytes, per sample of ``L`` tokens (``actor/batch.py`` ``Sample``): int64 token ids (8 B a
token); per response token the float32 behaviour log-prob and advantage, the uint8 loss mask and
the int64 version (17 B; 4 B more with the engine's log-probs, ``algo.recompute_behav_logprobs``);
with ``rollout.return_routed_experts`` the routed experts, ``layers x top_k`` ids a position in
uint8 (at most 256 experts) or uint16 (``actor/batch.py`` ``compact_expert_ids``); and pickle's
headers (:data:`SAMPLE_OVERHEAD_BYTES`). Bounds, so that the term is never below what runs: every
token is counted as a response token, every sequence at the longest length (``max_prompt_tokens +
max_new_tokens``), and a shard holds ``ceil(n / dp) + 1`` of a mini-batch's ``n`` sequences (the
balanced assignment, longest-processing-time first, leaves no rank more than one sequence's work
above the mean).

Before this path the step went out with ``dist.scatter_object_list``, which on NCCL stages
``world x largest part`` on rank 0 (``standins/collective_audit.py`` ``object_staging_bytes``), and the
routed experts travelled as int64: ~205 GiB on rank 0 at the Qwen3-30B-A3B recipe with routing replay
at full length (``tests/trainer/test_lease_staging.py``), ~13 GiB (33 parts of 0.39 GiB) at the dense
32B recipes, none of it planned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["LeaseShape", "SAMPLE_OVERHEAD_BYTES", "routed_id_bytes", "lease_bytes_per_token", "lease_transient_bytes",
           "describe"]

SAMPLE_OVERHEAD_BYTES = 1024
"""Pickle's share of one sample beyond its arrays' data: field names, the uid, array headers (measured
0.6-0.75 KB with a 14-character uid, with and without routed experts)."""

PLAN_BYTES_PER_SAMPLE = 24
"""A mini-batch's ``BatchPlan`` travels whole to every rank: three int64 entries per sample."""


@dataclass(frozen=True)
class LeaseShape:
    """What a step's lease holds, from the run config (``plan.memory.layout_from_config``); the default
    (no samples) plans no lease."""

    step_samples: int = 0          # prompts_per_step x n_samples_per_prompt
    updates: int = 1               # optimizer mini-batches per step (trainer.num_updates_per_step)
    routed_experts: bool = False   # rollout.return_routed_experts (an MoE model)
    engine_logprobs: bool = False  # algo.recompute_behav_logprobs: the engine's log-probs travel too


def routed_id_bytes(num_experts: int) -> int:
    """Bytes of one routed expert id on its way to the actor (``actor/batch.py`` ``compact_expert_ids``)."""
    return 1 if num_experts <= 256 else 2


def lease_bytes_per_token(m: Any, lease: LeaseShape) -> int:
    """A token's bytes in a part (module docstring), counted as a response token."""
    per = 8 + 17 + (4 if lease.engine_logprobs else 0)
    if lease.routed_experts and m.num_experts:
        per += m.layers * m.top_k * routed_id_bytes(m.num_experts)
    return per


def shard_samples(lease: LeaseShape, dp: int) -> int:
    """Sequences of a step on the most loaded data-parallel rank, at most (module docstring)."""
    n = lease.step_samples // max(lease.updates, 1)
    per_update = n if dp <= 1 else min(n, math.ceil(n / dp) + 1)
    return lease.updates * per_update


def lease_transient_bytes(m: Any, lay: Any) -> float:
    """Bytes a rank of layout ``lay`` stages on its GPU to receive its part of one step of model ``m``
    (``lay.lease``, ``lay.dp``, ``lay.seq_len``); 0 without a lease shape."""
    lease = lay.lease
    if not lease.step_samples:
        return 0.0
    seqs = shard_samples(lease, lay.dp)
    return float(seqs * (lay.seq_len * lease_bytes_per_token(m, lease) + SAMPLE_OVERHEAD_BYTES)
                 + PLAN_BYTES_PER_SAMPLE * lease.step_samples)


def describe(m: Any, lay: Any) -> str:
    """The ``how`` of the lease row in ``m2po plan``."""
    lease = lay.lease
    if not lease.step_samples:
        return "no step shape given"
    routed = (f" (routing {m.layers}x{m.top_k} uint{8 * routed_id_bytes(m.num_experts)})"
              if lease.routed_experts and m.num_experts else "")
    return f"{shard_samples(lease, lay.dp)} seqs x {lay.seq_len} tok x {lease_bytes_per_token(m, lease)} B{routed}"
