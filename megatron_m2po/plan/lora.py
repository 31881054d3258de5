"""What LoRA changes in a GPU's memory (``model.lora.rank > 0``; the adapters are actor/lora.py's).

The base weights stay at ``param_bytes`` each, frozen: no fp32 gradient in Megatron's DDP buffer
(it holds ``requires_grad`` parameters only) and no fp32 main copy or Adam state in the
optimizer (it is built over the same parameters). Only the adapters have a gradient (4 B) and
optimizer states (12 B: fp32 main copy, m, v; sharded by the distributed optimizer as any
parameter). The frozen reference of the KL term is the base with the adapters disabled: no copy.

Adapter parameters per layer on one GPU, for rank ``r`` and the targets named as in HF (each
target has its own A and B, also where Megatron fuses q/k/v or gate/up into one linear):

=============  ==========================  ===========================
target         A (r x in)                  B (out x r)
=============  ==========================  ===========================
q_proj         r*h, replicated over TP     q*r / tp
k_proj, v_proj r*h, replicated             kv*r / tp
o_proj         r*q / tp                    h*r, replicated
gate/up_proj   r*h, replicated             f*r / tp
down_proj      r*f / tp                    h*r, replicated
=============  ==========================  ===========================

On an MoE model the MLP targets are the experts' (gate, up and down together): each of the
``E / ep`` local experts (whole: expert TP 1) holds a gate_up pair (A ``r*h`` shared by gate and up,
B ``2 f_e * r``) and a down pair (``r*f_e``, ``h*r``); each routed token adds two r-wide
intermediates per expert it visits (``top_k``).

Activations: the base's are unchanged (its inputs are kept for the input gradient either way); each
adapter adds its r-wide intermediate ``A x`` (T x r, 16-bit), counted here, which is < 1 % of a
layer's activations at r <= 64.
"""

from __future__ import annotations

from typing import Any, Sequence

# plan/memory.py's ModelShape and Layout (imported by it: no import back)
ModelShape = Layout = Any

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


def _target_params(m: ModelShape, target: str, r: int, tp: int) -> float:
    h, q, kv, f = m.hidden, m.q_size, m.kv_size, m.ffn
    return {"q_proj": r * h + q * r / tp, "k_proj": r * h + kv * r / tp, "v_proj": r * h + kv * r / tp,
            "o_proj": r * q / tp + h * r, "gate_proj": r * h + f * r / tp, "up_proj": r * h + f * r / tp,
            "down_proj": r * f / tp + h * r}[target]


def layer_targets(m: ModelShape, targets: Sequence[str]) -> list[str]:
    """The dense targets a layer of ``m`` carries (an MoE's MLP targets are its experts': :func:`expert_targets`)."""
    return [t for t in targets if not (m.is_moe and t in MLP_TARGETS)]


def expert_targets(m: ModelShape, targets: Sequence[str]) -> bool:
    """Whether the experts of an MoE model carry adapters (actor/lora.py ``ExpertLoRA``)."""
    return m.is_moe and bool(set(targets) & set(MLP_TARGETS))


def adapter_params(m: ModelShape, lay: Layout) -> float:
    """Adapter parameters on one GPU of a stage (the layers of one stage; uniform over stages)."""
    if lay.lora_rank <= 0:
        return 0.0
    r = lay.lora_rank
    per_layer = sum(_target_params(m, t, r, lay.tp) for t in layer_targets(m, lay.lora_targets))
    if expert_targets(m, lay.lora_targets):
        per_layer += m.num_experts / lay.ep * (r * m.hidden + 2 * m.moe_ffn * r + r * m.moe_ffn + m.hidden * r)
    return per_layer * m.layers / lay.pp


def adapter_compute_params(m: ModelShape, lay: Layout) -> float:
    """The adapter parameters one token passes through on one GPU of a stage: every dense adapter,
    and the ``top_k`` experts' it is routed to (not every local expert's: :func:`adapter_params`)."""
    if lay.lora_rank <= 0:
        return 0.0
    r = lay.lora_rank
    per_layer = sum(_target_params(m, t, r, lay.tp) for t in layer_targets(m, lay.lora_targets))
    if expert_targets(m, lay.lora_targets):
        per_layer += m.top_k * (r * m.hidden + 2 * m.moe_ffn * r + r * m.moe_ffn + m.hidden * r)
    return per_layer * m.layers / lay.pp


def adapter_activation_bytes(m: ModelShape, lay: Layout, tokens: float) -> float:
    """One layer's r-wide adapter intermediates for ``tokens`` tokens (16-bit)."""
    if lay.lora_rank <= 0:
        return 0.0
    n = len(layer_targets(m, lay.lora_targets)) + (2 * m.top_k if expert_targets(m, lay.lora_targets) else 0)
    return 2.0 * tokens * lay.lora_rank * n
