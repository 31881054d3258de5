"""The teacher of on-policy distillation in ``algo.distill.mode=megatron`` (algo/distill.py).

A frozen copy of the teacher checkpoint (``algo.distill.teacher``) built by the actor's own
``actor.model.build_model`` in the actor's layout -- the same TP / PP / CP / EP groups, layer spec
and precision -- host-resident between uses, exactly as the reference of ``algo.kl``
(:class:`~megatron_m2po.actor.reference.FrozenReference`, whose machinery it is): its log-probs
come from the actor's schedule and fused vocab-parallel log-prob path over the same micro-batches as
the policy's, so every layout gives the same teacher log-probs. The planner counts it as it counts
the reference (its bytes: the teacher's parameters). A teacher whose tokenizer differs from the
student's would score other tokens than the ones sampled: refused by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from megatron_m2po.actor.reference import FrozenReference

__all__ = ["make_teacher"]


def make_teacher(cfg: Any, device: torch.device) -> Optional[FrozenReference]:
    """The teacher the config asks for (None with ``algo.distill.coef == 0``): a frozen copy of
    ``algo.distill.teacher`` in the actor's layout, in the current Megatron parallel state."""
    d = cfg.algo.distill
    if d.coef == 0:
        return None
    if d.mode != "megatron":  # mode=sglang: teacher engines on rank 0's rollout side (rollout_service/teacher.py)
        return None
    from megatron_m2po.utils.hf_dir import check_same_tokenizer, resolve_model_path

    teacher = resolve_model_path(cfg.model, override=d.teacher)
    check_same_tokenizer(cfg.model.hf_path, teacher)
    model = dataclasses.replace(cfg.model, hf_path=teacher, lora=dataclasses.replace(cfg.model.lora, rank=0))
    return FrozenReference.build(dataclasses.replace(cfg, model=model), device)
