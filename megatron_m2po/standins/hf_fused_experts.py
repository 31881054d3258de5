"""Per-expert HF names onto transformers 5's fused expert tensors (the CPU worker's MoE loader).

SGLang 0.5.23 loads a Qwen3-MoE's experts from the checkpoint's per-expert names
``model.layers.{l}.mlp.experts.{e}.gate_proj / up_proj / down_proj.weight``
(``srt/models/qwen3_moe.py`` ``Qwen3MoeForCausalLM.load_weights`` with
``FusedMoE.make_expert_params_mapping`` in ``srt/layers/moe/fused_moe_triton/layer.py``:
``gate_proj`` -> shard ``w1`` and ``up_proj`` -> ``w3`` of ``experts.w13_weight[e]``, gate in the
first half and up in the second (``_load_w13``), ``down_proj`` -> ``experts.w2_weight[e]``). This
holds for checkpoints on disk and for distributed weight updates alike: both go through
``load_weights``.

transformers 5 holds the experts fused as well (``models/qwen3_moe/modeling_qwen3_moe.py``
``Qwen3MoeExperts``: ``gate_up_proj [E, 2 * I, H]``, gate rows first, and ``down_proj [E, H, I]``),
and converts per-expert checkpoint names itself only in ``from_pretrained``
(``conversion_mapping.py``, ``"qwen2_moe"``: ``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``
of ``[gate_proj, up_proj]``). :func:`expert_target` does that conversion for one tensor of a
weight update: the slice of the fused parameter it fills.

The fused names themselves (``mlp.experts.gate_up_proj``) are not names SGLang loads: its
``load_weights`` skips them silently (no entry of ``params_dict``) and the engine keeps its old
experts. The CPU worker refuses them instead (:func:`is_fused_expert_name`), a louder failure of the
same mistake.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

__all__ = ["expert_target", "is_fused_expert_name"]

_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def is_fused_expert_name(name: str) -> bool:
    """True for transformers' fused expert parameter names, which SGLang's loader does not read."""
    return _FUSED.search(name) is not None


def expert_target(params: dict[str, torch.Tensor], name: str) -> Optional[torch.Tensor]:
    """The view of a fused expert parameter in ``params`` that the per-expert tensor ``name`` fills,
    or None when ``name`` is no per-expert name or the model has no fused parameter for it, or the
    expert index is out of range (the caller reports it as unknown)."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    e, proj = int(m["e"]), m["proj"]
    fused = params.get(f"{m['prefix']}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
    if fused is None or fused.dim() != 3 or e >= fused.shape[0]:
        return None
    if proj == "down_proj":
        return fused[e]
    half = fused.shape[1] // 2
    return fused[e, :half] if proj == "gate_proj" else fused[e, half:]
