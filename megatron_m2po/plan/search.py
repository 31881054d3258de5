"""``m2po plan --search``: enumerate the layouts that fit and rank them by estimated step time.

The memory of each candidate comes from :func:`megatron_m2po.plan.memory.plan` (the same estimate and
the same refusals as ``m2po plan``); the time comes from the cost model below. Every assumption
is a field of :class:`CostModel` with its value and reason, and ``m2po plan --search`` prints
them (docs/planner.md explains the model).

Candidates (for the config's cluster, ``nnodes x gpus_per_node`` trainer GPUs):

* ``tp`` dividing the attention heads, the KV heads, the FFN width and the vocabulary, at most
  the GPUs of a node (``plan`` refuses more); sequence parallel whenever ``tp > 1`` (it divides
  the replicated activations by ``tp`` at the same communication volume, so it is never worse);
* ``cp`` in 1, 2, 4, 8 (context parallel; its K/V ring may span nodes, :func:`cp_comm_time`), not with
  expert parallelism;
* ``pp`` dividing the layers, ``tp * pp * cp`` dividing the world; ``vpp`` in 2..4 where the layers
  split into ``pp * vpp`` chunks and there are at least ``pp`` micro-batches (Megatron's
  interleaved schedule needs ``microbatch_group_size_per_vp_stage >= pp``);
* for an MoE model, expert parallel ``ep`` dividing the expert count with expert tensor parallel
  ``etp`` in ``{1, tp}`` and ``ep * etp`` dividing ``tp * cp * dp`` (Megatron's rule), no EP with
  CP (:func:`megatron_m2po.plan.moe.ep_choices`; the MoE terms are in :mod:`megatron_m2po.plan.moe`);
* recompute ``none`` / ``selective`` / ``full``; distributed optimizer off / on;
* a micro-batch token budget of ``k x seq_len``, ``k`` in 1, 2, 4, 8. Without packing
  (``parallel.packing=false``) that is ``parallel.micro_batch_size = k`` sequences right-padded
  to the longest; with packing it is ``parallel.max_tokens_per_microbatch = k * seq_len`` tokens.

Workload: ``prompts_per_update * n_samples_per_prompt`` sequences per optimizer update,
``num_updates_per_step`` updates per step, lengths ``seq_len = max_prompt + max_new`` at most.
The cost model assumes lengths uniform on ``[a, seq_len]`` with mean ``mean_len_frac *
seq_len`` (0.5 by default, so ``a = 0``): a padded micro-batch of ``k`` sequences then costs
``k * E[max of k]`` tokens, ``E[max] = a + (seq_len - a) k / (k + 1)``; for ``k`` = 2 / 4 / 8
that wastes 25 / 38 / 44 % of the tokens on padding at the default mean, close to what a
log-normal length distribution grouped by prompt gives (23 / 38 / 49 %).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from typing import Any, Optional

from megatron_m2po.config import Config
from megatron_m2po.plan import colocated as colocated_plan
from megatron_m2po.plan import lora as plan_lora
from megatron_m2po.plan import memory, moe, routing
from megatron_m2po.plan.memory import (GiB, Layout, LayoutPlan, ModelShape, PlanError, padded_vocab, plan_from_config,
                                       stage_params)

__all__ = ["CostModel", "Workload", "Candidate", "SearchResult", "step_time", "model_flops_per_update",
           "search_config", "parallel_section", "packing_of", "print_search", "result_to_dict", "register",
           "Placement", "ColocatedComparison", "compare_colocated", "print_comparison"]


# tools/benchmarks/global_mask.py on mini-batches of the staleness experiment (staleness_tiny, M2PO
# arm) at s = 32, replayed with 256-token micro-batches (6 per update; with the experiment's own
# 2048 the running guess sees every token and nothing is corrected)
MEASURED_CORRECTION_FRAC = 0.0139


@dataclass(frozen=True)
class CostModel:
    """Assumptions of the step-time estimate (H100 SXM defaults). Each field says why."""

    peak_tflops: float = 989.0
    """Dense bf16 peak of one H100 SXM (TFLOP/s)."""
    gemm_eff: float = 0.55
    """Fraction of peak that large bf16 GEMMs reach in a Megatron transformer layer."""
    gemm_half_tokens: int = 128
    """GEMM efficiency scales as T/(T + this) for T tokens per micro-batch: small micro-batches
    run skinny matrices."""
    attn_eff: float = 0.40
    """Fraction of peak that flash attention (forward + backward) reaches."""
    intra_node_gbs: float = 300.0
    """NCCL bus bandwidth inside a node (NVLink 4: ~450 GB/s per direction, ~300 achieved)."""
    inter_node_gbs: float = 40.0
    """NCCL bus bandwidth per GPU across nodes (one 400 Gb/s InfiniBand NIC per GPU, ~80 %)."""
    hbm_gbs: float = 2300.0
    """Achieved HBM bandwidth for the optimizer step (3.35 TB/s peak x ~0.7)."""
    layer_overhead_s: float = 1e-4
    """Fixed time per layer per micro-batch (forward + backward kernel launches, norms, rotary,
    small element-wise kernels that do not scale with FLOPs)."""
    pack_fill: float = 0.95
    """With packing, a micro-batch holds this fraction of its token budget on average."""
    mean_len_frac: float = 0.5
    """Mean sequence length / seq_len (lengths uniform on [a, seq_len] with this mean)."""
    overlap_comm: bool = False
    """Tensor-, pipeline- and data-parallel communication is not overlapped with compute (the
    actor does not turn on Megatron's overlap_grad_reduce / TP comm overlap): conservative."""
    mask_correction_frac: float = MEASURED_CORRECTION_FRAC
    """Share of an update's tokens that mask_strategy=correct re-runs forward-backward (the
    changed sequences up to their last changed token); measured by tools/benchmarks/global_mask.py
    on the staleness_tiny regime at staleness 32 (docs/planner.md). Long responses hold more
    tokens near the cut per sequence, so at 16k contexts it is likely larger: an assumption."""

    h2d_gbs: float = 25.0
    """Pinned host-to-device copies per GPU (PCIe Gen5 x16, ~25 GB/s achieved): how fast a frozen
    copy that waits in host memory (the distillation teacher) comes back to its GPU."""

    alltoall_eff: float = 0.6
    """MoE all-to-alls (token dispatch and combine) reach this fraction of the bus bandwidth above:
    many peer-to-peer messages of uneven size instead of one ring (an assumption)."""

    def describe(self) -> list[str]:
        doc = _field_docs()
        return [f"{f.name} = {getattr(self, f.name)!r}: {doc.get(f.name, '')}" for f in dataclasses.fields(self)]


def _field_docs() -> dict[str, str]:
    """Attribute docstrings of CostModel, read from its source (one place for value and reason)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(CostModel)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    out: dict[str, str] = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            out[a.target.id] = " ".join(str(b.value.value).split())  # type: ignore[union-attr]
    return out


@dataclass(frozen=True)
class Workload:
    """What one optimizer update trains on."""

    sequences: int              # per optimizer update, all data-parallel ranks together
    seq_len: int                # longest sequence (prompt + response)
    updates_per_step: int = 1
    packing: bool = False       # sequences concatenated up to the token budget (no padding)
    response_frac: float = 1.0  # fraction of tokens that are response rows (the output layer runs on these)
    prepass: bool = False       # the loss takes a global mask per update (M2PO, scope=global)
    mask_strategy: str = "prepass"  # how (algo.m2po.mask_strategy): prepass, correct or auto
    cp_comm_type: str = "p2p"   # how TE's attention exchanges K/V under CP (parallel.cp_comm_type)


@dataclass
class Candidate:
    """One layout, its memory plan and its estimated time."""

    layout: Layout
    budget_k: int               # micro-batch token budget = budget_k * seq_len
    plan: LayoutPlan
    micro_batches: int = 0      # per update per data-parallel rank
    time: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.plan.ok

    @property
    def memory_gib(self) -> float:
        return self.plan.worst.total / GiB if self.plan.stages else math.inf

    @property
    def step_s(self) -> float:
        return self.time.get("step", math.inf)

    def label(self) -> str:
        lay = self.layout
        ep = f" ep={lay.ep} etp={lay.etp or lay.tp}" if self.plan.model.is_moe else ""
        return (f"tp={lay.tp} pp={lay.pp}{f' vpp={lay.vpp}' if lay.vpp else ''}{f' cp={lay.cp}' if lay.cp > 1 else ''} "
                f"dp={lay.dp}{ep} "
                f"recompute={lay.recompute} dist-opt={'on' if lay.distributed_optimizer else 'off'} "
                f"mb={self.budget_k}x{lay.seq_len}")


# ------------------------------------------------------------------------------------------------
# Cost model
# ------------------------------------------------------------------------------------------------


def _len_stats(seq_len: int, frac: float, k: int) -> tuple[float, float, float]:
    """(mean length, E[length^2], E[max of k lengths]) for lengths uniform on [a, seq_len]."""
    if not 0.5 <= frac <= 1.0:
        raise PlanError(f"mean_len_frac={frac} must be in [0.5, 1] (lengths uniform on [a, seq_len], a >= 0)")
    L = float(seq_len)
    a = (2 * frac - 1) * L
    mean = (a + L) / 2
    sq = (L * L + a * L + a * a) / 3
    emax = a + (L - a) * k / (k + 1)
    return mean, sq, emax


def _bw(span_gpus: int, gpus_per_node: int, cm: CostModel) -> float:
    """Bytes/s of a group whose ranks span ``span_gpus`` consecutive ranks."""
    return (cm.intra_node_gbs if span_gpus <= gpus_per_node else cm.inter_node_gbs) * 1e9


ATTN_BWD_FORWARDS = 2.5
"""Flash attention's backward in forwards of FLOPs: 5 matmuls (recomputed QK^T, dV, dP, dQ, dK) against
the forward's 2 (Dao 2023, FlashAttention-2 §3.1; its benchmarks count fwd + bwd as 3.5 forwards, the
convention ``attn_eff`` is a fraction of)."""


def attention_train_s(attn_fwd_flops: float, cm: CostModel) -> float:
    """Seconds of core attention forward + backward for ``attn_fwd_flops`` forward FLOPs."""
    return (1 + ATTN_BWD_FORWARDS) * attn_fwd_flops / (cm.peak_tflops * 1e12 * cm.attn_eff)


def recompute_time(recompute: str, dense_fwd_s: float, attn_fwd_s: float) -> float:
    """Seconds activation recomputation adds to one micro-batch's backward (the layers of one GPU).

    ``full`` (Megatron's ``recompute_granularity=full``, uniform, one layer per group) re-runs every
    layer's forward inside the backward: its dense GEMMs and its core attention, ~1/3 of forward +
    backward (Megatron-LM's context-parallel guide: "~30% with full recompute"). ``selective``
    (``recompute_modules=["core_attn"]``) re-runs the core attention's forward only. Their extra
    communication is in ``tp_comm`` (2 more collectives per layer with full) and :func:`cp_comm_time`."""
    if recompute == "full":
        return dense_fwd_s + attn_fwd_s
    if recompute == "selective":
        return attn_fwd_s
    return 0.0


def cp_comm_time(m: ModelShape, lay: Layout, tokens_mb: float, attn_fwd_s: float, comm_type: str,
                 cm: CostModel) -> tuple[float, float]:
    """Exposed seconds of the context-parallel K/V exchange of one micro-batch on one GPU, over its
    ``m.layers / pp`` layers: ``(one forward pass, forward + recompute + backward)``.

    ``tokens_mb`` are the micro-batch's tokens over all CP ranks; ``attn_fwd_s`` this GPU's core-attention
    forward seconds for it (all its layers, already ``/ cp``). Each GPU holds ``tokens_mb / cp`` tokens,
    and its K and V are ``2 * kv_size / tp`` bf16 values per token (a chunk, ``c`` seconds to send). What
    Transformer Engine 2.9 does (``attention/dot_product_attention/context_parallel.py``):

    * ``p2p`` (``AttnFuncWithCPAndKVP2P``): ``cp`` steps per layer; step ``i`` computes attention with the
      K/V chunk it holds while sending it on and receiving the next (``batch_isend_irecv`` on a second
      stream), so only ``max(0, c - a)`` is exposed per step, ``a`` the step's attention (``1 / cp`` of
      the rank's work: the load-balanced chunk pairing gives every step equal work). Forward: ``cp - 1``
      sends (step 0 uses the local chunk, the last sends nothing). Backward: K/V again at step 0, K/V
      together with the dK/dV accumulated so far at steps ``1..cp-2`` (``2c``), dK/dV at the last step,
      against ``ATTN_BWD_FORWARDS * a`` of compute.
    * ``all_gather`` (``AttnFuncWithCPAndKVAllGather``): all-gathers K/V before the attention and again
      in backward, then reduce-scatters dK/dV; not overlapped: ``(cp - 1) c`` each.
    * ``a2a`` (Ulysses, ``flash_attn_a2a_communicate``): all-to-alls of Q, K, V before and of the output
      after, the same in backward with the gradients; ``(cp - 1) / cp`` of each local tensor, exposed.

    Recompute (full, or selective: the core attention's checkpoint re-runs TE's CP attention) repeats the
    forward's exchange. The CP group spans ``tp * cp`` consecutive ranks: ``inter_node_gbs`` beyond a node.
    """
    cp = lay.cp
    if cp == 1:
        return 0.0, 0.0
    layers = m.layers / lay.pp
    bw = _bw(lay.tp * cp, lay.gpus_per_node, cm)
    chunk = tokens_mb / cp * 2 * m.kv_size / lay.tp * 2
    c = chunk / bw
    forwards = 2 if lay.recompute in ("full", "selective") else 1
    if comm_type == "p2p":
        a_f = attn_fwd_s / layers / cp
        a_b = ATTN_BWD_FORWARDS * a_f
        fwd = (cp - 1) * max(0.0, c - a_f)
        bwd = 2 * max(0.0, c - a_b) + (cp - 2) * max(0.0, 2 * c - a_b)
    elif comm_type == "all_gather":
        fwd = (cp - 1) * c
        bwd = 2 * (cp - 1) * c
    elif comm_type == "a2a":
        local = tokens_mb / cp * 2 * (2 * m.q_size + 2 * m.kv_size) / lay.tp
        fwd = (cp - 1) / cp * local / bw
        bwd = fwd
    else:
        raise PlanError(f"cp_comm_type={comm_type!r}: expected p2p, all_gather or a2a")
    return layers * fwd, layers * (forwards * fwd + bwd)


@dataclass(frozen=True)
class _MicroBatchWork:
    """How one DP rank's share of an update splits into micro-batches, and one micro-batch's work on one GPU."""

    n: int                  # micro-batches per update per data-parallel rank
    tokens_all: float       # one micro-batch's tokens over all CP ranks
    tokens: float           # this GPU's share (2 of 2 cp chunks per sequence)
    attn_sq: float          # sum of L_i^2 over the micro-batch, / cp (causal work is balanced by the chunk pairing)


def _micro_batch_work(lay: Layout, work: Workload, budget_k: int, cm: CostModel) -> _MicroBatchWork:
    """Packed: the rank's mean tokens over budgets filled to ``pack_fill``; padded: ``budget_k``
    sequences padded to the longest of them (``E[max of k]``)."""
    seqs_rank = work.sequences / lay.dp
    mean, sq, emax = _len_stats(work.seq_len, cm.mean_len_frac, budget_k)
    n_mb = _micro_batches(work, lay.dp, budget_k, cm)
    if work.packing:
        tokens_mb = seqs_rank * mean / n_mb
        attn_sq_mb = seqs_rank / n_mb * sq          # sum of L_i^2 over the micro-batch
    else:
        tokens_mb = budget_k * emax                 # k sequences padded to the longest
        attn_sq_mb = budget_k * emax * emax
    return _MicroBatchWork(n=n_mb, tokens_all=tokens_mb, tokens=tokens_mb / lay.cp, attn_sq=attn_sq_mb / lay.cp)


def _micro_batch_times(m: ModelShape, lay: Layout, work: Workload, mb: _MicroBatchWork, cm: CostModel
                       ) -> dict[str, float]:
    """Seconds of one micro-batch's forward + backward on one GPU of the slowest (last) stage, by
    component (``compute``, ``recompute``, ``tp_comm``, ``cp_comm``, ``ep_comm``, ``pp_comm``,
    ``overhead``), and ``forward``: the same micro-batch forward only (the global mask's pre-pass)."""
    tp, pp, cp, vpp = lay.tp, lay.pp, lay.cp, lay.vpp or 1
    layers = m.layers / pp
    h = m.hidden
    tokens_mb = mb.tokens
    # forward FLOPs on one GPU for one micro-batch (the last stage also runs the output layer)
    # (norms are not matmuls; an MoE's expert GEMMs are in moe.comm_times, at their own efficiency)
    dense_fwd = (moe.forward_flops(m, tokens_mb, tp, layers)[0] if m.is_moe
                 else 2 * tokens_mb * m.matmul_params() * layers / tp)
    # the slowest stage is the last: it runs the output layer, on response rows only
    head_fwd = 2 * tokens_mb * work.response_frac * h * m.vocab / tp
    attn_fwd = 2 * m.q_size * mb.attn_sq * layers / tp   # QK^T and AV, causal half
    peak = cm.peak_tflops * 1e12
    g_eff = cm.gemm_eff * tokens_mb / (tokens_mb + cm.gemm_half_tokens)
    # forward + backward = 3 forwards for the GEMMs; the fused log-prob recomputes the logits in its
    # backward (+1); flash attention's backward is 2.5 forwards (attention_train_s). Under LoRA the
    # frozen base has no weight-gradient GEMM (2 forwards, the head 3); the adapters' own GEMMs
    # (forward, input and weight gradients) are 6 FLOPs per adapter parameter and token.
    lora = lay.lora_rank > 0
    adapter_flops = 6 * tokens_mb * plan_lora.adapter_compute_params(m, lay) if lora else 0.0
    compute = (((2 if lora else 3) * dense_fwd + (3 if lora else 4) * head_fwd + adapter_flops) / (peak * g_eff)
               + attention_train_s(attn_fwd, cm))
    recompute = recompute_time(lay.recompute, dense_fwd / (peak * g_eff), attn_fwd / (peak * cm.attn_eff))
    ep_comm = expert_fwd = 0.0
    if m.is_moe:
        mt = moe.comm_times(m, lay, tokens_mb, layers, cm, lambda span: _bw(span, lay.gpus_per_node, cm))
        compute += mt["expert_compute"]
        recompute += mt["expert_recompute"]
        ep_comm = mt["ep_comm"]
        # the experts' forward and the forward all-to-alls
        expert_fwd = mt["expert_compute"] / 3 + ep_comm / (3 if lay.recompute == "full" else 2)
    # TP: 2 all-reduces (or all-gather + reduce-scatter with SP, same volume) per layer forward,
    # 2 backward, 2 more in a full recompute; each moves T*h bf16 values.
    tp_comm = 0.0
    if tp > 1:
        n_coll = layers * moe.tp_collectives_per_layer(m, lay.recompute == "full")
        tp_comm = n_coll * 2 * (tp - 1) / tp * tokens_mb * h * 2 / _bw(tp, lay.gpus_per_node, cm)
    cp_fwd, cp_comm = cp_comm_time(m, lay, mb.tokens_all, attn_fwd / (peak * cm.attn_eff), work.cp_comm_type, cm)
    # PP: activations of the micro-batch forward and their gradient backward, per chunk boundary
    pp_comm = 0.0
    if pp > 1:
        pp_comm = 2 * vpp * tokens_mb * h * 2 / _bw(tp * cp * lay.dp + 1, lay.gpus_per_node, cm)
    overhead = cm.layer_overhead_s * layers
    forward = ((dense_fwd + head_fwd) / (peak * g_eff) + attn_fwd / (peak * cm.attn_eff)
               + (tp_comm / 2 if lay.recompute != "full" else tp_comm / 3) + cp_fwd
               + pp_comm / 2
               + overhead / 3)
    if m.is_moe:
        forward += expert_fwd
    return {"compute": compute, "recompute": recompute, "tp_comm": tp_comm, "cp_comm": cp_comm, "ep_comm": ep_comm,
            "pp_comm": pp_comm, "overhead": overhead, "forward": forward}


def _mask_time(lay: Layout, work: Workload, n_mb: int, forward_mb: float, t_mb: float, cm: CostModel) -> float:
    """M2PO's global mask: a forward-only pass over the mini-batch first (its own fill and drain),
    or a forward-backward of the changed sequences after it (mask_correction_frac of the tokens,
    packed into micro-batches of the same budget, one more fill and drain); auto takes the less."""
    if not work.prepass:
        return 0.0
    pp, vpp = lay.pp, lay.vpp or 1
    prepass = forward_mb * (n_mb + (pp - 1) / vpp)
    redo = cm.mask_correction_frac * n_mb  # micro-batches' worth of tokens re-run
    correct = t_mb * (redo + min(redo, 1.0) * (pp - 1) / vpp)
    options = {"prepass": prepass, "correct": correct, "auto": min(prepass, correct)}
    # (under expert parallelism every rank runs as many correction micro-batches as the one
    # with the most, zero-weight fillers on the others: charged at the mean share, as above)
    return options[work.mask_strategy]


def _teacher_time(lay: Layout, work: Workload, mb: _MicroBatchWork, cm: CostModel) -> float:
    """Seconds per update of ``algo.distill.mode=megatron``'s teacher (0 without one): once a step
    (placement=advantage, trainer/distill.py) its weights come back from pinned host memory (the
    stage with the most of them, at ``h2d_gbs``) and it runs forward only, in the actor's layout,
    over every micro-batch of the step with one pipeline fill and drain; a forward of the teacher's
    own shape on the same tokens (its FLOPs, not the student's). Charged per update: the step's
    cost over its updates."""
    if lay.teacher is None:
        return 0.0
    forward = _micro_batch_times(lay.teacher, lay, work, mb, cm)["forward"]
    passes = work.updates_per_step * mb.n + (lay.pp - 1) / (lay.vpp or 1)
    copy = max(memory.teacher_stage_bytes(lay, i) for i in range(lay.pp)) / (cm.h2d_gbs * 1e9)
    return (forward * passes + copy) / work.updates_per_step


def _gradient_sync_and_optimizer(m: ModelShape, lay: Layout, cm: CostModel) -> tuple[float, float]:
    """``(dp_comm, optimizer)`` seconds of one update on the stage with the most parameters.

    DP: gradients (fp32) reduced over dp; the distributed optimizer reduce-scatters them and
    all-gathers the bf16 parameters instead of one all-reduce."""
    vocab_p = padded_vocab(m.vocab, lay.tp, lay.vocab_divisible_by)
    lora = lay.lora_rank > 0  # a frozen base: only the adapters are reduced and stepped
    params = plan_lora.adapter_params(m, lay) if lora else max(stage_params(m, lay, i, vocab_p) for i in range(lay.pp))
    dp_comm = 0.0
    dpcp = lay.dp * lay.cp  # Megatron's DDP reduces gradients over data x context parallel ranks
    if dpcp > 1:
        bw = _bw(lay.tp * dpcp, lay.gpus_per_node, cm)
        if lay.distributed_optimizer:
            dp_comm = (dpcp - 1) / dpcp * params * (4 + lay.param_bytes) / bw
        else:
            dp_comm = 2 * (dpcp - 1) / dpcp * params * 4 / bw
    # Adam: read grad, master, m, v (16 B), write master, m, v (12 B) and the bf16 weight
    shard = dpcp if lay.distributed_optimizer else 1
    optimizer = params / shard * (28 + lay.param_bytes) / (cm.hbm_gbs * 1e9)
    if m.is_moe and not lora:  # expert parameters: over the expert data-parallel group
        e_comm, e_opt = moe.expert_dp_times(m, lay, cm, lambda span: _bw(span, lay.gpus_per_node, cm))
        dp_comm += e_comm
        optimizer += e_opt
    return dp_comm, optimizer


def step_time(m: ModelShape, lay: Layout, work: Workload, budget_k: int, cm: CostModel = CostModel()
              ) -> tuple[int, dict[str, float]]:
    """Estimated seconds of one training step of ``work`` under ``lay`` (per-component breakdown).

    Returns ``(micro-batches per update per DP rank, times)``; ``times`` holds seconds per update
    for ``compute``, ``recompute``, ``tp_comm``, ``cp_comm``, ``ep_comm`` (MoE all-to-alls and expert-TP
    gathers, :func:`megatron_m2po.plan.moe.comm_times`), ``pp_comm``, ``overhead``, ``bubble``,
    ``dp_comm`` and ``optimizer`` (and ``teacher`` with a Megatron distillation teacher:
    :func:`_teacher_time`), and ``update`` (their sum) and ``step`` (x updates per step).

    Context parallelism (``lay.cp``) splits every micro-batch's tokens over ``cp`` GPUs with
    Megatron's load-balanced chunks, so each GPU runs ``1 / cp`` of its dense and attention
    FLOPs; the price is the exposed part of the K/V exchange (``cp_comm``, :func:`cp_comm_time`)
    and gradients / optimizer states reduced and sharded over ``dp * cp``.
    """
    mb = _micro_batch_work(lay, work, budget_k, cm)
    n_mb, one = mb.n, _micro_batch_times(m, lay, work, mb, cm)
    t_mb = (one["compute"] + one["recompute"] + one["tp_comm"] + one["cp_comm"] + one["ep_comm"] + one["pp_comm"]
            + one["overhead"])
    bubble = t_mb * (lay.pp - 1) / (lay.vpp or 1)  # 1F1B: (pp - 1) micro-batch times, / vpp interleaved
    mask = _mask_time(lay, work, n_mb, one["forward"], t_mb, cm)
    teacher = _teacher_time(lay, work, mb, cm)
    dp_comm, optimizer = _gradient_sync_and_optimizer(m, lay, cm)
    if cm.overlap_comm:
        one["tp_comm"] = one["cp_comm"] = one["pp_comm"] = dp_comm = 0.0
    t = {k: n_mb * one[k] for k in ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "overhead")}
    t.update(bubble=bubble, mask=mask, dp_comm=dp_comm, optimizer=optimizer)
    if lay.teacher is not None:
        t["teacher"] = teacher
    t["update"] = sum(t.values())
    t["step"] = t["update"] * work.updates_per_step
    return n_mb, t


def model_flops_per_update(m: ModelShape, work: Workload, cm: CostModel = CostModel()) -> float:
    """Useful training FLOPs of one update: 3 x forward of the real tokens (no padding, no
    recompute, no pre-pass), the MFU numerator."""
    mean, sq, _ = _len_stats(work.seq_len, cm.mean_len_frac, 1)
    tokens = work.sequences * mean
    fwd = 2 * tokens * (m.matmul_params() * m.layers + work.response_frac * m.hidden * m.vocab)
    fwd += 2 * m.q_size * work.sequences * sq * m.layers
    return 3 * fwd


# ------------------------------------------------------------------------------------------------
# Search
# ------------------------------------------------------------------------------------------------

BUDGETS = (1, 2, 4, 8)
RECOMPUTE = ("none", "selective", "full")
CONTEXT_PARALLEL = (1, 2, 4, 8)


@dataclass
class SearchResult:
    model: ModelShape
    work: Workload
    cost: CostModel
    world: int
    headroom: float
    ranked: list[Candidate]          # fitting candidates, fastest first
    rejected: list[Candidate]        # enumerated but not fitting (plan errors or over the headroom)
    current: Optional[Candidate]     # the config's own layout, evaluated the same way
    tie: float = 0.02                # layouts within this fraction of the fastest count as equally fast

    @property
    def best(self) -> Candidate:
        """The chosen layout: the least memory among those within ``tie`` of the fastest (the
        estimate is not finer than that; spare memory is not), then the faster."""
        if not self.ranked:
            raise PlanError(self._nothing_fits())
        limit = self.ranked[0].step_s * (1 + self.tie)
        near = [c for c in self.ranked if c.step_s <= limit]
        return min(near, key=lambda c: (round(c.memory_gib, 1), c.step_s))

    def rank_of(self, c: Candidate) -> Optional[int]:
        for i, r in enumerate(self.ranked):
            if same_layout(r, c):
                return i + 1
        return None

    def _nothing_fits(self) -> str:
        sized = [c for c in self.rejected if c.plan.stages]
        head = f"no layout of {self.model.name} fits {self.world} GPUs"
        if not sized:
            errs = sorted({c.plan.errors[0] for c in self.rejected if c.plan.errors})[:3]
            return f"{head}: " + "; ".join(errs or ["no tp/pp divides the model and the GPU count"])
        small = min(sized, key=lambda c: c.memory_gib)
        why = small.plan.errors[0] if small.plan.errors else (
            f"{small.memory_gib:.1f} GiB is over {1 - self.headroom:.0%} of the budget (--headroom)")
        return (f"{head}: the smallest ({small.label()}) needs {small.memory_gib:.1f} GiB per GPU: {why}. "
                "Add nodes, shorten sequences (data.max_prompt_tokens + rollout.max_new_tokens) or use GPUs with "
                "more memory (--gpu-mem-gib)")


def same_layout(a: Candidate, b: Candidate) -> bool:
    la, lb = a.layout, b.layout
    return ((la.tp, la.pp, la.cp, la.vpp or None, la.ep, la.etp or la.tp, la.recompute, la.distributed_optimizer,
             a.budget_k)
            == (lb.tp, lb.pp, lb.cp, lb.vpp or None, lb.ep, lb.etp or lb.tp, lb.recompute, lb.distributed_optimizer,
                b.budget_k))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def packing_of(cfg: Config) -> tuple[bool, Optional[int]]:
    """Whether the actor packs micro-batches, and its token budget.

    READ HERE the packing fields once the config has them (``parallel.packing``,
    ``parallel.max_tokens_per_microbatch``); until then the actor right-pads ``micro_batch_size``
    sequences and the planner models exactly that.
    """
    par = cfg.parallel
    return bool(getattr(par, "packing", False)), getattr(par, "max_tokens_per_microbatch", None)


def _config_with(cfg: Config, **parallel: Any) -> Config:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel))


def _parallel_fields(tp: int, pp: int, vpp: Optional[int], recompute: str, distopt: bool, k: int,
                     seq_len: int, packing: bool, cp: int = 1, ep: int = 1, etp: Optional[int] = None
                     ) -> dict[str, Any]:
    f: dict[str, Any] = dict(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp,
                             virtual_pipeline_parallel=vpp, expert_parallel=ep, expert_tensor_parallel=etp,
                             sequence_parallel=tp > 1, recompute=recompute, use_distributed_optimizer=distopt)
    if packing:
        f["max_tokens_per_microbatch"] = k * seq_len
        f["micro_batch_size"] = 1
    else:
        f["micro_batch_size"] = k
    return f


def _evaluate(cfg: Config, m: ModelShape, work: Workload, cost: CostModel, k: int, **kw: Any) -> Candidate:
    p = plan_from_config(cfg, m, **kw)
    lay = p.layout
    cand = Candidate(layout=lay, budget_k=k, plan=p)
    if p.ok:
        cand.micro_batches, cand.time = step_time(m, lay, work, k, cost)
    return cand


def search_config(cfg: Config, m: ModelShape, *, nnodes: int = 1, gpus_per_node: int = 8,
                  node_gpus: Optional[int] = None, gpu_mem_gib: float = 80.0, cost: CostModel = CostModel(),
                  headroom: float = 0.1, max_vpp: int = 4, tie: float = 0.02, host_mem_gib: Optional[float] = None,
                  host_process_gib: Optional[float] = None) -> SearchResult:
    """Every layout of ``cfg``'s model on ``nnodes x gpus_per_node`` GPUs, ranked by step time.

    A layout fits when :func:`~megatron_m2po.plan.memory.plan` accepts it and its worst stage needs at
    most ``(1 - headroom)`` of the memory budget (a margin for the estimate's error). The chosen
    one (:attr:`SearchResult.best`) needs the least memory among those within ``tie`` of the
    fastest estimated step time.
    """
    if not 0 <= headroom < 1:
        raise PlanError(f"headroom={headroom} must be in [0, 1)")
    world = nnodes * gpus_per_node
    seq_len = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    packing, _budget = packing_of(cfg)
    from megatron_m2po.algo.losses import loss_settings, resolve_loss

    spec = resolve_loss(cfg.algo)
    work = Workload(sequences=cfg.trainer.prompts_per_update * cfg.rollout.n_samples_per_prompt, seq_len=seq_len,
                    updates_per_step=cfg.trainer.num_updates_per_step, packing=packing,
                    response_frac=cfg.rollout.max_new_tokens / seq_len,
                    prepass=spec.needs_global_mask_prepass(loss_settings(spec, cfg.algo)),
                    mask_strategy=getattr(loss_settings(spec, cfg.algo), "mask_strategy", "prepass"),
                    cp_comm_type=cfg.parallel.cp_comm_type)
    common = dict(nnodes=nnodes, gpus_per_node=gpus_per_node, node_gpus=node_gpus, gpu_mem_gib=gpu_mem_gib,
                  host_mem_gib=host_mem_gib, host_process_gib=host_process_gib)
    ranked: list[Candidate] = []
    rejected: list[Candidate] = []

    def consider(tp: int, pp: int, vpp: Optional[int], rc: str, distopt: bool, k: int, cp: int = 1, ep: int = 1,
                 etp: Optional[int] = None) -> Candidate:
        c = _config_with(cfg, **_parallel_fields(tp, pp, vpp, rc, distopt, k, seq_len, packing, cp, ep, etp))
        if world % (tp * pp * cp):
            raise PlanError(f"tp*pp*cp = {tp * pp * cp} does not divide {world} GPUs")
        dp = world // (tp * pp * cp)
        n_mb = _micro_batches(work, dp, k, cost)
        cand = _evaluate(c, m, work, cost, k, num_microbatches=n_mb,
                         micro_batch_tokens=k * seq_len, **common)
        return cand

    for tp in _divisors(gpus_per_node):
        if m.heads % tp or m.kv_heads % tp or (m.ffn % tp and not m.is_moe) or m.vocab % tp:
            continue
        for pp, cp in [(pp, cp) for pp in _divisors(m.layers) for cp in CONTEXT_PARALLEL]:
            # CP may span nodes: its ring runs at the inter-node bandwidth there (cp_comm_time).
            # (EP with CP, which the config refuses, is left out by moe.ep_choices, whatever EP the
            # config has: the search does not depend on the layout it starts from)
            if world % (tp * pp * cp):
                continue
            dp = world // (tp * pp * cp)
            if work.sequences < dp:
                continue
            for k in BUDGETS:
                n_mb = _micro_batches(work, dp, k, cost)
                vpps: list[Optional[int]] = [None]
                if pp > 1 and n_mb >= pp:
                    vpps += [v for v in range(2, max_vpp + 1) if m.layers % (pp * v) == 0]
                ep_etp = moe.ep_choices(m, tp, cp, dp)
                if cfg.model.lora.rank > 0 and plan_lora.expert_targets(m, cfg.model.lora.targets):
                    ep_etp = [(ep, etp) for ep, etp in ep_etp if etp == 1]  # adapters need whole experts
                for vpp, (ep, etp) in [(v, e) for v in vpps for e in ep_etp]:
                    for rc in RECOMPUTE:
                        for distopt in (False, True):
                            cand = consider(tp, pp, vpp, rc, distopt, k, cp, ep, etp)
                            limit = (1 - headroom) * cand.layout.budget_gib
                            (ranked if cand.fits and cand.memory_gib <= limit else rejected).append(cand)
    ranked.sort(key=lambda c: (c.step_s, c.memory_gib))
    par = cfg.parallel
    try:
        k_now = max(1, (_budget // seq_len) if packing and _budget else par.micro_batch_size)
        current = consider(par.tensor_parallel, par.pipeline_parallel, par.virtual_pipeline_parallel,
                           par.recompute, par.use_distributed_optimizer, k_now, par.context_parallel,
                           par.expert_parallel, par.expert_tensor_parallel)
    except PlanError:
        current = None
    return SearchResult(model=m, work=work, cost=cost, world=world, headroom=headroom, ranked=ranked,
                        rejected=rejected, current=current, tie=tie)


# ------------------------------------------------------------------------------------------------
# Colocated against disaggregated (rollout.colocate=true)
# ------------------------------------------------------------------------------------------------


@dataclass
class Placement:
    """One use of the nodes: every GPU time-shared (colocated), or ``trainer_gpus`` of each node
    training while the other ``engine_gpus`` generate (disaggregated). A step takes training plus
    generation plus the colocated switch, or, where the mode lets them overlap (stale_k, async:
    the engines generate for later updates while the trainer trains), the longer of the two."""

    name: str
    trainer_gpus: int           # per node
    engine_gpus: int            # per node
    train_s: float
    generation: colocated_plan.GenerationEstimate
    switch_s: float
    overlap: bool
    candidate: Candidate

    @property
    def step_s(self) -> float:
        gen = self.generation.seconds
        return (max(self.train_s, gen) if self.overlap else self.train_s + gen) + self.switch_s


@dataclass
class ColocatedComparison:
    colocated: Placement
    splits: list[Placement]     # the disaggregated splits that fit, by trainer GPUs per node

    @property
    def best_split(self) -> Optional[Placement]:
        return min(self.splits, key=lambda p: p.step_s) if self.splits else None


def _generation(cfg: Config, m: ModelShape, gpus: int, kv_bytes: float, cost: CostModel
                ) -> colocated_plan.GenerationEstimate:
    r = cfg.rollout
    return colocated_plan.generation_time(
        layers=m.layers, kv_size=m.kv_size, weight_bytes=m.num_params() * (1 if r.fp8_weights else 2) / r.engine_tp,
        sequences=cfg.trainer.prompts_per_step * r.n_samples_per_prompt, prompt_len=cfg.data.max_prompt_tokens,
        max_new=r.max_new_tokens, mean_frac=cost.mean_len_frac, gpus=gpus, engine_tp=r.engine_tp, kv_bytes=kv_bytes,
        hbm_gbs=cost.hbm_gbs)


def _disaggregated_kv(cfg: Config, m: ModelShape, gpu_mem_gib: float) -> float:
    """A dedicated engine rank's KV pool: ``engine_mem_fraction`` (at most what leaves SGLang's working
    set room) of the GPU less its CUDA context, less its weights."""
    r = cfg.rollout
    share = colocated_plan.EngineShare(r.engine_mem_fraction, r.engine_tp, gpu_mem_gib)
    free = (gpu_mem_gib - colocated_plan.CUDA_CONTEXT_GIB) * GiB
    frac = min(r.engine_mem_fraction, 1 - share.working_set_bytes() / free)
    return frac * free - m.num_params() * (1 if r.fp8_weights else 2) / r.engine_tp


def compare_colocated(cfg: Config, res: SearchResult, *, nnodes: int, gpus_per_node: int, gpu_mem_gib: float = 80.0,
                      headroom: float = 0.1, tie: float = 0.02, trainer_gpus: Optional[list[int]] = None
                      ) -> ColocatedComparison:
    """``res`` (the colocated search of ``cfg``) against the best disaggregated split of the same
    nodes: for each ``t`` in ``trainer_gpus`` (default 1 .. gpus_per_node - 1) the fastest trainer
    layout on ``t`` GPUs per node (the same search) and engines on the other GPUs of every node.
    Generation: :func:`megatron_m2po.plan.colocated.generation_time`; the colocated switch:
    the trainer's copied state (weights, main parameters, Adam moments) out and back over the host link."""
    cost, m, best = res.cost, res.model, res.best
    overlap = cfg.trainer.mode != "sync"
    ph = best.plan.colocated
    assert ph is not None, "compare_colocated needs a colocated search"
    worst = best.plan.worst
    col = Placement("colocated", gpus_per_node, gpus_per_node, best.step_s,
                    _generation(cfg, m, nnodes * gpus_per_node, ph.kv_bytes, cost),
                    colocated_plan.switch_seconds(worst.weights + worst.optimizer), False, best)
    r = cfg.rollout
    splits = []
    for t in trainer_gpus or range(1, gpus_per_node):
        engines = (gpus_per_node - t) // r.engine_tp
        if engines < 1:
            continue
        rollout = dataclasses.replace(r, colocate=False, engine_gpu_ids=[], num_engines=engines)
        try:
            sub = search_config(dataclasses.replace(cfg, rollout=rollout), m, nnodes=nnodes, gpus_per_node=t,
                                node_gpus=gpus_per_node, gpu_mem_gib=gpu_mem_gib, cost=cost, headroom=headroom, tie=tie)
            cand = sub.best
        except PlanError:
            continue
        gen = _generation(cfg, m, nnodes * engines * r.engine_tp, _disaggregated_kv(cfg, m, gpu_mem_gib), cost)
        splits.append(Placement(f"disaggregated {t}+{gpus_per_node - t}", t, gpus_per_node - t, cand.step_s, gen,
                                0.0, overlap, cand))
    return ColocatedComparison(col, splits)


def print_comparison(cmp: ColocatedComparison) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=160)
    t = Table(title="colocated against the disaggregated splits of the same nodes (seconds per step; "
                    "generation a decode roofline, docs/planner.md)")
    for col in ("placement", "trainer layout", "train s", "generate s", "switch s", "step s", "engine batch"):
        t.add_column(col, justify="left" if col in ("placement", "trainer layout") else "right")
    best = cmp.best_split
    for p in [cmp.colocated, *cmp.splits]:
        mark = " (best split)" if best is not None and p is best else ""
        t.add_row(p.name + mark, p.candidate.label(), f"{p.train_s:.1f}", f"{p.generation.seconds:.1f}",
                  f"{p.switch_s:.1f}", f"{p.step_s:.1f}", f"{p.generation.batch:.0f}")
    con.print(t)
    if best is None:
        con.print("no disaggregated split of these nodes fits: colocated is the only placement", highlight=False)
        return
    c = cmp.colocated
    winner = "colocated" if c.step_s <= best.step_s else best.name
    con.print(f"{winner} is faster: colocated {c.step_s:.1f} s/step vs {best.name} {best.step_s:.1f} s/step"
              f" ({'training and generation overlap there' if best.overlap else 'sync: no overlap in either'})",
              highlight=False)


def _micro_batches(work: Workload, dp: int, k: int, cost: CostModel) -> int:
    seqs_rank = work.sequences / dp
    if work.packing:
        mean, _, _ = _len_stats(work.seq_len, cost.mean_len_frac, k)
        return max(1, math.ceil(seqs_rank * mean / (k * work.seq_len * cost.pack_fill)))
    return max(1, math.ceil(seqs_rank / k))


def parallel_section(c: Candidate, packing: bool) -> dict[str, Any]:
    """The ``parallel:`` entries of a recipe that runs ``c``."""
    lay = c.layout
    out: dict[str, Any] = dict(tensor_parallel=lay.tp, pipeline_parallel=lay.pp, context_parallel=lay.cp)
    if lay.vpp:
        out["virtual_pipeline_parallel"] = lay.vpp
    if c.plan.model.is_moe:
        out.update(expert_parallel=lay.ep, expert_tensor_parallel=lay.etp or lay.tp)
    out.update(sequence_parallel=lay.sequence_parallel, use_distributed_optimizer=lay.distributed_optimizer,
               recompute=lay.recompute)
    if packing:
        out.update(packing=True, max_tokens_per_microbatch=lay.micro_batch_tokens)
    else:
        out["micro_batch_size"] = c.budget_k
    return out


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------


def _row(res: SearchResult, c: Candidate) -> dict[str, Any]:
    t = c.time
    flops = model_flops_per_update(res.model, res.work, res.cost)
    mfu = flops / (t["update"] * res.world * res.cost.peak_tflops * 1e12)
    return dict(layout=c.label(), memory_gib=round(c.memory_gib, 1), micro_batches=c.micro_batches,
                step_s=round(t["step"], 2), mfu=round(mfu, 3),
                **{k: round(v * res.work.updates_per_step, 2) for k, v in t.items() if k not in ("update", "step")})


def result_to_dict(res: SearchResult, top: int) -> dict[str, Any]:
    return {"model": res.model.name, "world": res.world, "workload": dataclasses.asdict(res.work),
            "cost_model": dataclasses.asdict(res.cost), "headroom": res.headroom,
            "enumerated": len(res.ranked) + len(res.rejected), "fitting": len(res.ranked),
            "top": [_row(res, c) for c in res.ranked[:top]],
            "chosen": dict(_row(res, res.best), rank=res.rank_of(res.best),
                           parallel=parallel_section(res.best, res.work.packing)),
            "current": (dict(_row(res, res.current), rank=res.rank_of(res.current))
                        if res.current is not None and res.current.fits else None)}


def _mask_words(w: Workload, cm: CostModel) -> str:
    if not w.prepass:
        return ""
    if w.mask_strategy == "prepass":
        return ", the global mask by a forward-only pre-pass per update (column mask)"
    return (f", the global mask by mask_strategy={w.mask_strategy} (column mask: expected cost, correcting "
            f"{cm.mask_correction_frac:.2%} of the tokens, measured)")


def print_search(res: SearchResult, top: int = 5) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=200)
    w = res.work
    con.print(f"[bold]{res.model.name}[/] on {res.world} GPUs: {w.sequences} sequences of <= {w.seq_len} tokens "
              f"per update ({w.response_frac:.0%} response), {w.updates_per_step} updates per step, "
              f"{'packed' if w.packing else 'right-padded'} micro-batches"
              f"{_mask_words(w, res.cost)}", highlight=False)
    con.print("cost model (docs/planner.md):")
    for line in res.cost.describe():
        con.print(f"  {line}", highlight=False, markup=False)
    con.print(f"  headroom = {res.headroom}: a layout fits when its worst stage needs <= {1 - res.headroom:.0%} "
              f"of the GPU budget", highlight=False)
    best = res.best
    t = Table(title=f"{len(res.ranked)} of {len(res.ranked) + len(res.rejected)} layouts fit; fastest first "
                    f"(seconds per step)")
    teacher = best.layout.teacher is not None  # algo.distill.mode=megatron: its forward passes (_teacher_time)
    cols = ["#", "layout", "GiB", "mb/upd", "step s", "compute", "recomp", "mask", *(["teacher"] if teacher else []),
            "tp", "cp", "ep", "pp", "bubble", "dp", "optim", "MFU"]
    for ccol in cols:
        t.add_column(ccol, justify="left" if ccol == "layout" else "right", no_wrap=ccol == "layout")
    shown = list(res.ranked[:top])
    if not any(same_layout(best, c) for c in shown):
        shown.append(best)
    if res.current is not None and res.current.fits and not any(same_layout(res.current, c) for c in shown):
        shown.append(res.current)
    for c in shown:
        r = _row(res, c)
        rank = res.rank_of(c)
        name = r["layout"] + (" (config)" if res.current is not None and same_layout(c, res.current) else "") \
            + ((" (chosen)" if same_layout(c, res.ranked[0]) else " (chosen*)") if same_layout(c, best) else "")
        t.add_row(str(rank) if rank is not None else "-", name, f"{r['memory_gib']:.1f}", str(r["micro_batches"]), f"{r['step_s']:.1f}",
                  f"{r['compute']:.1f}", f"{r['recompute']:.1f}", f"{r['mask']:.1f}",
                  *([f"{r.get('teacher', 0.0):.1f}"] if teacher else []), f"{r['tp_comm']:.1f}", f"{r['cp_comm']:.1f}",
                  f"{r['ep_comm']:.1f}", f"{r['pp_comm']:.1f}",
                  f"{r['bubble']:.1f}", f"{r['dp_comm']:.1f}", f"{r['optimizer']:.2f}", f"{r['mfu']:.2f}")
    con.print(t)
    if not same_layout(best, res.ranked[0]):
        con.print(f"* chosen over row 1: the least memory among the layouts within {res.tie:.0%} of the fastest "
                  "(the time estimate is not finer than that; spare memory is not)", highlight=False)
    cur = res.current
    if cur is not None and cur.fits and res.rank_of(cur) is None:
        con.print(f"config's layout fits the GPU but not the {res.headroom:.0%} headroom: {cur.memory_gib:.1f} GiB, "
                  f"{cur.step_s:.1f} s/step ({cur.step_s / best.step_s - 1:+.0%} vs chosen)", highlight=False)
    elif cur is not None and cur.fits:
        rank = res.rank_of(cur)
        con.print(f"config's layout: rank {rank}, {cur.step_s:.1f} s/step "
                  f"({cur.step_s / best.step_s - 1:+.0%} vs chosen), {cur.memory_gib:.1f} GiB", highlight=False)
    elif cur is not None:
        why = cur.plan.errors[0] if cur.plan.errors else f"over the {res.headroom:.0%} headroom"
        con.print(f"config's layout does not fit: {why}", highlight=False)
    sec = parallel_section(best, w.packing)
    con.print(f"[bold green]chosen[/]: {best.label()}: {best.step_s:.1f} s/step, {best.memory_gib:.1f} GiB of "
              f"{best.layout.budget_gib:.0f} GiB (the least memory within {res.tie:.0%} of the fastest, "
              f"{res.ranked[0].step_s:.1f} s/step)", highlight=False)
    con.print("parallel:\n" + "\n".join(f"  {k}: {str(v).lower() if isinstance(v, bool) else v}"
                                        for k, v in sec.items()), highlight=False)


# ------------------------------------------------------------------------------------------------
# CLI: `m2po plan` with --search
# ------------------------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    p = memory.register(sub)
    p.add_argument("--search", action="store_true",
                   help="Enumerate the layouts that fit the cluster (tp, pp, vpp, cp, ep, recompute, micro-batch token "
                        "budget, distributed optimizer), rank them by estimated step time (cost model in "
                        "docs/planner.md) and print the fastest and the chosen one.")
    p.add_argument("--top", type=int, default=5, help="With --search: how many layouts to print.")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="With --search: fraction of the GPU budget kept free for the estimate's error.")
    p.add_argument("--tie", type=float, default=0.02,
                   help="With --search: layouts within this fraction of the fastest count as equally fast; the "
                        "chosen one is the least memory among them.")
    p.set_defaults(func=run)


def _script_gpus_per_node(args: argparse.Namespace) -> Optional[int]:
    """GPUS_PER_NODE of the recipe's launch script when it is not 8 (said on stderr), else None."""
    if not args.config or "=" in args.config:
        return None
    from megatron_m2po.plan.recipes import launch_cluster

    rc = launch_cluster(args.config)
    if rc is None or rc.gpus_per_node == 8:
        return None
    print(f"# {rc.gpus_per_node} trainer GPUs per node: what {rc.script.name} launches (GPUS_PER_NODE); "
          "--gpus-per-node searches another", file=sys.stderr)
    return rc.gpus_per_node


def run(args: argparse.Namespace) -> int:
    if not args.search or args.list_models:
        return memory.run(args)
    fixed = [k for k in ("tp", "pp", "dp", "cp", "vpp", "ep", "etp", "micro_batch_tokens", "num_microbatches", "recompute",
                         "sequence_parallel", "distributed_optimizer") if getattr(args, k, None) is not None]
    if fixed:
        print(f"m2po plan --search: --{', --'.join(k.replace('_', '-') for k in fixed)} fix what the search "
              f"enumerates; drop them (or drop --search to check one layout)", file=sys.stderr)
        return 2
    cfg = memory.config_of(args)
    # The search's cluster is what it is told (or the smallest that fits); a recipe whose launch
    # script runs fewer trainer processes than a node's GPUs (engines on the others) is searched there.
    gpn = args.gpus_per_node or _script_gpus_per_node(args) or 8
    try:
        m = memory.resolve_model(args, cfg)
        def search(nnodes: int) -> SearchResult:
            r = search_config(cfg, m, nnodes=nnodes, gpus_per_node=gpn, node_gpus=args.node_gpus,
                              gpu_mem_gib=args.gpu_mem_gib, headroom=args.headroom, tie=args.tie,
                              host_mem_gib=args.host_mem_gib, host_process_gib=args.host_process_gib)
            r.best  # noqa: B018 -- raises PlanError naming why nothing fits
            return r

        try:
            res = search(args.nnodes or 1)
        except PlanError:
            if args.nnodes is not None:
                raise
            # No cluster size given and one node is too small: the smallest power-of-two node count
            # that fits, said so up front (the recipes name theirs in their headers).
            for n in (2, 4, 8, 16, 32, 64):
                try:
                    res = search(n)
                except PlanError:
                    continue
                print(f"# nothing fits 1 node x {gpn} GPUs; the smallest power-of-two cluster that "
                      f"fits is {n} nodes: layouts for --nnodes {n} (pass --nnodes for another size)",
                      file=sys.stderr)
                break
            else:
                raise
    except PlanError as e:
        print(f"m2po plan --search: {e}", file=sys.stderr)
        return 1
    notes, warns = routing.replay_lines(cfg, m, args.store_warn_gib)
    cmp = None
    if res.best.plan.colocated is not None:
        cmp = compare_colocated(cfg, res, nnodes=res.world // gpn, gpus_per_node=gpn, gpu_mem_gib=args.gpu_mem_gib,
                                headroom=args.headroom, tie=args.tie)
    if args.json:
        out = dict(result_to_dict(res, args.top), notes=notes, warnings=warns)
        if cmp is not None:
            out["colocated_comparison"] = [dict(placement=p.name, layout=p.candidate.label(), train_s=p.train_s,
                                                generate_s=p.generation.seconds, switch_s=p.switch_s, step_s=p.step_s)
                                           for p in [cmp.colocated, *cmp.splits]]
        print(json.dumps(out, indent=2))
    else:
        print_search(res, args.top)
        if cmp is not None:
            print_comparison(cmp)
        for line in notes:
            print(line)
        for line in warns:
            print(f"warning: {line}")
    return 0
