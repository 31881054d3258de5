"""The Mixture-of-Experts terms of ``m2po plan`` / ``m2po plan --search`` (docs/planner.md, "MoE").

A model is MoE when its shape has ``num_experts > 0`` (Qwen3-MoE: every layer's MLP is
``num_experts`` routed experts of width ``moe_ffn``, ``top_k`` per token, no shared expert, a
``[num_experts, hidden]`` router). Its parameters split into

* **dense** -- attention, the two norms, the router and the embeddings: laid out as in a dense
  model (attention over TP; the router is replicated over TP, Megatron's ``TopKRouter``), their
  gradients reduced and their optimizer states sharded over the data-parallel group ``dp * cp``;
* **experts** -- ``num_experts * 3 * hidden * moe_ffn`` per layer, split over expert parallel
  (``num_experts / ep`` experts per rank) and expert tensor parallel (``moe_ffn / etp`` of each),
  their gradients reduced and optimizer states sharded over the *expert* data-parallel group of
  ``edp = tp * cp * dp / (ep * etp)`` ranks (megatron-core 0.16.1 ``parallel_state.
  initialize_model_parallel``: the expert rank generator splits each pipeline stage's
  ``world / pp`` ranks as ``etp x ep x edp``, so ``etp * ep * pp`` must divide the world).

Activations of an MoE layer on one GPU, for ``T`` tokens of the micro-batch (``/ cp``) and
balanced routing: the attention part as in a dense layer; the router's fp32 logits and
probabilities ``8 T_in E`` (``T_in = T / tp``: tokens enter the MoE layer split by sequence
parallel); the alltoall dispatcher brings ``C = T_in * k * etp`` token copies to this GPU's
experts (each of the ``ep`` ranks sends ``T_in * k`` copies spread evenly over the group, then
the expert-TP all-gather), which store their input ``2 C h``, the fc1 output (gate + up,
``4 C f / etp``), the gated activation and its probability-scaled copy (``2 C f / etp`` each,
``TEGroupedMLP`` applies the routing probabilities before fc2) and the probabilities ``4 C``.
One layer's dispatch is in flight at a time: its permuted input and received copies,
``2 (T_in k + C) h``, are counted once per stage.

Compute uses the *active* parameters: per token the attention, the router and ``k`` experts.
The expert GEMMs run on ``C / (E / ep)`` tokens per local expert, which sets their efficiency
(``CostModel.gemm_half_tokens``). Communication per MoE layer and micro-batch: the dispatch and
combine all-to-alls (forward, again in backward, and in a full recompute), each moving
``T_in * k * h`` bf16 values per GPU of which ``(ep - 1) / ep`` leave it, over NVLink when the
``ep * etp`` consecutive ranks of the EP group lie in a node and InfiniBand otherwise; with
``etp > 1`` the expert-TP all-gather / reduce-scatter of the ``C`` copies; the dense TP
collectives cover the attention only (the MoE layer's input stays sequence-parallel).
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["router_params", "expert_layer_params", "tp_split_layer_params", "stage_expert_params",
           "expert_data_parallel", "layout_errors", "layer_activation_bytes", "dispatch_buffer_bytes",
           "forward_flops", "tp_collectives_per_layer", "comm_times", "expert_dp_times", "ep_choices"]


def router_params(m: Any) -> int:
    """The router's ``[num_experts, hidden]`` weight of one layer (replicated over TP)."""
    return m.num_experts * m.hidden


def expert_layer_params(m: Any) -> int:
    """All experts of one layer: gate, up and down projections of width ``moe_ffn``."""
    return m.num_experts * 3 * m.hidden * m.moe_ffn


def tp_split_layer_params(m: Any) -> int:
    """The parameters of one MoE layer that Megatron splits over TP: attention and the norms (the
    norms are replicated, but Megatron's memory formula divides them too; they are ``2 h``)."""
    return m.attention_params() + 2 * m.hidden


def expert_data_parallel(lay: Any) -> int:
    """Size of the expert data-parallel group: ``tp * cp * dp / (ep * etp)`` (0 if not whole)."""
    etp = lay.etp or lay.tp
    inner = lay.tp * lay.cp * lay.dp
    return inner // (lay.ep * etp) if inner % (lay.ep * etp) == 0 else 0


def stage_expert_params(m: Any, lay: Any) -> float:
    """Expert parameters on one GPU of a stage: ``L/pp`` layers of ``E/ep`` experts, ``1/etp`` of each."""
    if not m.is_moe:
        return 0.0
    return expert_layer_params(m) * (m.layers / lay.pp) / (lay.ep * (lay.etp or lay.tp))


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def layout_errors(m: Any, lay: Any) -> list[str]:
    """What Megatron (``initialize_model_parallel``) and the actor (``actor/model.py``
    ``_moe_args`` and ``build_transformer_config``, ``actor/actor.py`` ``init_parallel``) refuse
    about the expert layout; the config-level rules (EP with CP, EP x TP without SP,
    ``mask_strategy=correct`` with EP) come from ``Config.validate`` in ``plan_from_config``."""
    etp = lay.etp or lay.tp
    errs: list[str] = []
    if not m.is_moe:
        if lay.ep > 1 or etp != lay.tp:
            errs.append(f"expert_parallel={lay.ep}, expert_tensor_parallel={etp}: {m.name} has no experts; use 1 and "
                        "leave parallel.expert_tensor_parallel unset")
        return errs
    if lay.ep < 1 or etp < 1:
        errs.append(f"expert_parallel={lay.ep} and expert_tensor_parallel={etp} must be >= 1")
        return errs
    if m.num_experts % lay.ep:
        errs.append(f"num_experts {m.num_experts} not divisible by expert_parallel {lay.ep}: use ep in "
                    f"{_divisors(m.num_experts, lay.world_size)}")
    if m.moe_ffn % etp:
        errs.append(f"moe_intermediate_size {m.moe_ffn} not divisible by expert_tensor_parallel {etp}: use a divisor")
    if lay.world_size % (etp * lay.ep * lay.pp):
        errs.append(f"world size {lay.world_size} is not a multiple of expert_tensor_parallel x expert_parallel x "
                    f"pipeline_parallel = {etp} x {lay.ep} x {lay.pp} (Megatron splits each stage's ranks as "
                    f"etp x ep x expert-dp)")
    if lay.tp > 1 and not lay.sequence_parallel:
        errs.append(f"MoE model {m.name} with tp={lay.tp} needs sequence_parallel=true (Megatron-Core trains MoE "
                    "layers under TP only with SP)")
    return errs


def layer_activation_bytes(m: Any, tokens: float, tp: int, etp: int, *, dense_part: float,
                           imbalance: float = 1.0) -> float:
    """Bytes one MoE layer stores for backward on one GPU: ``dense_part`` (the attention and the
    replicated norm / router inputs, from the dense formula with no MLP) plus the router's fp32
    logits and probabilities and the experts' activations for ``C = (tokens/tp) * k * etp``
    dispatched copies (module docstring), times ``imbalance`` on the hottest EP rank
    (:func:`megatron_m2po.plan.routing.hottest_rank_factor`)."""
    t_in = tokens / tp
    c = t_in * m.top_k * etp * imbalance
    router = 8 * t_in * m.num_experts
    experts = 2 * c * m.hidden + 8 * c * m.moe_ffn / etp + 4 * c
    return dense_part + router + experts


def dispatch_buffer_bytes(m: Any, tokens: float, tp: int, etp: int, imbalance: float = 1.0) -> float:
    """One layer's dispatch in flight: permuted input ``T_in k`` and received ``C`` copies (times
    ``imbalance`` on the hottest EP rank), bf16."""
    t_in = tokens / tp
    return 2 * (t_in * m.top_k + t_in * m.top_k * etp * imbalance) * m.hidden


# ---------------------------------------------------------------------------------------- time


def forward_flops(m: Any, tokens: float, tp: int, layers: float) -> tuple[float, float]:
    """(non-expert matmul FLOPs, expert FLOPs) of one forward on one GPU for ``tokens`` tokens of
    ``layers`` MoE layers: attention + router over TP, ``k`` experts per token (their ``C`` copies
    at ``moe_ffn / etp`` make ``2 (tokens/tp) k 3 h f`` whatever ``etp``)."""
    dense = 2 * tokens * (m.attention_params() + router_params(m)) * layers / tp
    experts = 2 * tokens * m.top_k * 3 * m.hidden * m.moe_ffn * layers / tp
    return dense, experts


def tp_collectives_per_layer(m: Any, full_recompute: bool) -> int:
    """Dense TP collectives (all-reduce equivalents of ``T h``) per layer, forward + backward (+
    recompute): attention and MLP in a dense layer, the attention only in an MoE layer."""
    per_pass = 1 if m.is_moe else 2
    return per_pass * (3 if full_recompute else 2)


def comm_times(m: Any, lay: Any, tokens: float, layers: float, cm: Any, bw) -> dict[str, float]:
    """Seconds per micro-batch on one GPU for the MoE layers of a stage: ``expert_compute`` (the
    expert GEMMs, forward + backward), ``expert_recompute`` (their forward again under full
    recompute), ``ep_comm`` (dispatch + combine all-to-alls, and the expert-TP gather / scatter).

    ``bw(span)`` is the search's bandwidth of a group over ``span`` consecutive ranks."""
    tp, etp, ep = lay.tp, lay.etp or lay.tp, lay.ep
    full = lay.recompute == "full"
    t_in = tokens / tp
    c = t_in * m.top_k * etp
    per_expert = c / (m.num_experts / ep)
    peak = cm.peak_tflops * 1e12
    eff = cm.gemm_eff * per_expert / (per_expert + cm.gemm_half_tokens)
    _, experts = forward_flops(m, tokens, tp, layers)
    out = {"expert_compute": 3 * experts / (peak * eff),
           "expert_recompute": experts / (peak * eff) if full else 0.0, "ep_comm": 0.0}
    passes = 3 if full else 2          # forward, backward (, recompute): dispatch + combine each
    if ep > 1:
        vol = t_in * m.top_k * m.hidden * 2 * (ep - 1) / ep
        out["ep_comm"] += layers * passes * 2 * vol / (bw(ep * etp) * cm.alltoall_eff)
    if etp > 1:  # all-gather after dispatch, reduce-scatter before combine (the C copies, bf16)
        out["ep_comm"] += layers * passes * 2 * (etp - 1) / etp * c * m.hidden * 2 / bw(etp)
    return out


def expert_dp_times(m: Any, lay: Any, cm: Any, bw) -> tuple[float, float]:
    """(gradient reduction, Adam step) seconds per update for the expert parameters of a stage:
    reduced and sharded over the expert data-parallel group (as the dense ones over ``dp * cp``)."""
    params = stage_expert_params(m, lay)
    edp = expert_data_parallel(lay)
    if not params or not edp:
        return 0.0, 0.0
    comm = 0.0
    if edp > 1:
        span = lay.tp * lay.cp * lay.dp  # a stage's ranks
        if lay.distributed_optimizer:
            comm = (edp - 1) / edp * params * (4 + lay.param_bytes) / bw(span)
        else:
            comm = 2 * (edp - 1) / edp * params * 4 / bw(span)
    shard = edp if lay.distributed_optimizer else 1
    return comm, params / shard * (28 + lay.param_bytes) / (cm.hbm_gbs * 1e9)


def ep_choices(m: Any, tp: int, cp: int, dp: int) -> list[tuple[int, Optional[int]]]:
    """The (ep, etp) pairs the search tries for a (tp, cp, dp) layout: one pair ``(1, None)`` for a
    dense model; for an MoE one every ``ep`` dividing the expert count with ``etp`` in ``{1, tp}``
    (experts whole on a rank, or split as the attention is) and ``ep * etp`` dividing
    ``tp * cp * dp`` (Megatron's rule), no EP with CP and no expert TP below TP without EP (the
    trainer refuses both: actor/model.py)."""
    if not m.is_moe:
        return [(1, None)]
    out = []
    for etp in sorted({1, tp}):
        if m.moe_ffn % etp:
            continue
        for ep in range(1, m.num_experts + 1):
            if m.num_experts % ep or (tp * cp * dp) % (ep * etp) or (ep > 1 and cp > 1):
                continue
            if ep == 1 and etp < tp:  # refused by the trainer: the TP copies of an expert would drift
                continue
            out.append((ep, etp))
    return out


def describe(m: Any) -> str:
    """One line: total and active parameters."""
    if not m.is_moe:
        return ""
    return (f" ({m.num_experts} experts, top-{m.top_k}, {m.active_params() / 1e9:.2f}B active; experts "
            f"{m.layers * expert_layer_params(m) / 1e9:.2f}B)")

