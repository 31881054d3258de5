"""The actor's process groups: Megatron-Core's ``ProcessGroupCollection``, and what is read from it.

The actor takes one :class:`~megatron.core.process_groups_config.ProcessGroupCollection` (the
object Megatron-Core's own modules, DDP and ``finalize_model_grads`` take as ``pg_collection``)
instead of copying ranks, sizes and groups out of ``parallel_state``: ranks and sizes are read
from the groups when needed (``dist.get_rank(group)``, ``dist.get_world_size(group)``), so a
layout is described by the groups alone and a caller that builds its own (colocated engines,
a second model) passes them in. :func:`process_groups` builds the collection from
``parallel_state`` the way Megatron-Core does (``ProcessGroupCollection.use_mpu_process_groups``,
megatron-core 0.16.1 ``process_groups_config.py``; the same fields on Megatron-LM main), limited
to the groups the actor, its grad finaliser and its checkpoint layout read.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

__all__ = ["ACTOR_GROUPS", "process_groups", "last_rank", "is_last", "nontrivial"]

# tp / pp / cp / dp / dp_cp: the actor's passes and reductions (dp_cp: token-level metrics and
# the global mask over data x context parallel); embd / pos_embd: finalize_model_grads's
# embedding all-reduces across pipeline stages; ep / expt_tp / expt_dp: expert parallelism.
ACTOR_GROUPS = ("tp", "pp", "cp", "dp", "dp_cp", "embd", "pos_embd", "ep", "expt_tp", "expt_dp")


def process_groups(names: tuple[str, ...] = ACTOR_GROUPS):
    """A ``ProcessGroupCollection`` of ``names`` from Megatron's initialised ``parallel_state``."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=list(names))


def last_rank(group: Any) -> int:
    """The global rank of ``group``'s last member (for a pipeline group: the last stage's rank,
    what ``parallel_state.get_pipeline_model_parallel_last_rank`` returns for the default groups)."""
    return dist.get_process_group_ranks(group)[-1]


def is_last(group: Any) -> bool:
    """Whether this rank is the last member of ``group`` (of a pipeline group: the last stage)."""
    return dist.get_rank(group) == dist.get_world_size(group) - 1


def nontrivial(group: Any) -> Optional[Any]:
    """``group``, or None when it has one rank: the functions that take an optional group skip
    their collective for None (a reduction over one rank is the identity)."""
    return group if dist.get_world_size(group) > 1 else None
