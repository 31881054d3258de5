"""``m2po plan``: per-GPU memory and feasibility of a Megatron-Core layout, before launching.

What is estimated (bytes per GPU, for every pipeline stage; the verdict uses the worst one):

* **weights** -- parameters of the stage (``L/pp`` layers, plus the embedding on the first stage
  and the output layer on the last; a tied embedding is kept on both end stages, as Megatron
  does), divided over tensor parallel; 2 bytes each in bf16/fp16, 4 in fp32.
* **gradients** -- Megatron's DDP keeps fp32 main gradients in a contiguous buffer: 4 bytes per
  local parameter, not sharded by the distributed optimizer (it reduce-scatters inside it).
* **optimizer states** -- Adam ``m`` and ``v`` (fp32) plus an fp32 master copy when the model is
  16-bit: 12 (or 8 in fp32) bytes per parameter, divided by ``dp * cp`` with
  ``parallel.use_distributed_optimizer`` (Megatron shards over the data-parallel group that
  includes context parallel).
* **activations** -- Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models" (2022), Table 2, generalised: per layer and micro-batch of ``T`` tokens the 16-bit
  activations are ``T*h*(10 + 24/t) + 5*a*T*s/t`` bytes for a GPT layer (MHA, ffn = 4h, GeLU,
  dropout), which we derive term by term so that GQA (K and V are ``kv_heads*head_dim`` wide),
  a query width different from ``h`` (Qwen3), SwiGLU (fc1 output is ``2*ffn`` wide) and absent
  dropout (RL uses none) change exactly the terms they touch. Sequence parallel divides the
  replicated part by ``t`` too; selective recompute (or flash attention, which never stores the
  ``s x s`` scores) removes the score term; full recompute keeps only each layer's input plus one
  layer's worth while it is recomputed. With 1F1B, stage ``i`` holds ``min(pp - i, n_mb)``
  micro-batches in flight (Megatron's interleaving penalty ``1 + (pp-1)/(pp*vpp)`` with virtual
  stages). Context parallel divides the tokens by ``cp``.
* **logits** (last stage, one micro-batch) -- the naive path materialises ``T x V/t`` logits in
  bf16, an fp32 copy, the fp32 softmax kept for backward and the fp32 gradient (14 bytes per
  element); the fused vocab-parallel log-prob of :mod:`megatron_m2po.parallel.logprobs` holds only
  ``chunk_rows x V/t`` fp32 logits, their exponentials and gradient (12 bytes per element). The
  product always uses the fused one; the naive number is shown for comparison.
* **experts** (an MoE model; :mod:`megatron_m2po.plan.moe` gives every term) -- expert weights
  and gradients over expert parallel x expert tensor parallel, their optimizer states over the
  expert data-parallel group; the MoE layers' router, dispatched-token and expert activations.
* **overhead** -- fixed: CUDA context, NCCL communicator buffers, cuBLAS/TE workspaces and
  allocator fragmentation (``--overhead-gib``, 3 GiB by default).
* **lease** (every stage) -- the transient of receiving a step's samples: this rank's part, pickled
  on its GPU before the step's first forward (:mod:`megatron_m2po.plan.lease`).
* **reference** (``algo.kl.coef > 0``; :mod:`megatron_m2po.actor.reference`) -- the frozen
  reference's weights, the stage's parameters at ``param_bytes`` each (no gradients, no optimizer
  state). They are on the GPU only during the update's reference forward (forward-only, before
  the forward-backward) and freed before it, so the total counts ``max(activations + logits,
  reference + logits)`` rather than their sum.

The weight/optimizer term equals Megatron-LM's ``compute_weight_and_optimizer_memory`` (18 bytes
per parameter, or ``6 + 12/dp`` with the distributed optimizer) and the per-layer activation term
equals its ``compute_activation_memory`` (``s*b*h*(18 + 4*ffn/h)/t``, SP + selective) and
``compute_activation_memory_without_sp`` (``s*b*h*(10 + 24/t)``) on the architectures those
formulas assume; tests/test_planner.py checks both against an independent transcription.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_m2po.config import Config, load_config
from megatron_m2po.utils.settings import ConfigError
from megatron_m2po.plan import colocated as colocated_plan
from megatron_m2po.plan import host as host_plan
from megatron_m2po.plan import lease, moe, routing
from megatron_m2po.plan import lora as plan_lora

GiB = 1024 ** 3

__all__ = ["ModelShape", "MODELS", "Layout", "StageMemory", "LayoutPlan", "PlanError", "MemoryRefusal",
           "MemoryPlanError", "model_shape",
           "estimate", "plan", "plan_from_config", "stage_params", "resolve_model", "config_of", "register", "run"]


class PlanError(ValueError):
    """The layout cannot run: the message names the limit and what to change."""


@dataclass(frozen=True)
class MemoryRefusal:
    """The memory check's refusal in figures, so that a caller (a test, a search ranking rejects)
    reads numbers instead of parsing :attr:`message`, the text ``m2po plan`` prints.

    ``cause`` is the term the suggested fix is about: ``weights`` (weights + fp32 gradients exceed
    the budget on their own), ``optimizer`` (unsharded optimizer states), ``states`` (weights +
    gradients + optimizer states), ``logits`` or ``activations``; ``figure`` is that term's bytes,
    the number the message quotes first after the cause. A colocated layout whose generating phase
    does not fit (plan/colocated.py) has cause ``generating``: ``need`` is that phase's total and
    ``figure`` the engine's working set that ``(1 - engine_mem_fraction)`` of the free memory must hold;
    one whose push does not fit (the trainer's state beside the engine's resumed weights) has cause
    ``pushing``, ``figure`` the push's buckets."""

    stage: int
    need: float     # bytes the stage needs
    budget: float   # bytes one GPU gives the trainer
    cause: str
    figure: float
    message: str


class MemoryPlanError(PlanError):
    """A layout refused for memory: :attr:`refusal` holds the figures of the message."""

    def __init__(self, message: str, refusal: "MemoryRefusal") -> None:
        super().__init__(message)
        self.refusal = refusal


# ------------------------------------------------------------------------------------------------
# Model shapes
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer that memory depends on (HF config names)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    head_dim: Optional[int] = None     # None = hidden // heads
    qkv_bias: bool = False             # Qwen2 / Qwen2.5
    qk_norm: bool = False              # Qwen3
    gated: bool = True                 # SwiGLU MLP (gate + up)
    max_positions: Optional[int] = None
    num_experts: int = 0               # MoE: routed experts per layer (0 = dense); plan/moe.py
    top_k: int = 0                     # MoE: experts per token (num_experts_per_tok)
    moe_ffn: int = 0                   # MoE: one expert's MLP width (moe_intermediate_size)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_size(self) -> int:
        return self.heads * self.kv_channels

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.kv_channels

    def attention_params(self) -> int:
        h, q, kv = self.hidden, self.q_size, self.kv_size
        attn = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * self.kv_channels
        return attn

    def layer_params(self) -> int:
        if self.is_moe:  # attention, router, all experts (plan/moe.py)
            mlp = moe.router_params(self) + moe.expert_layer_params(self)
        else:
            mlp = (3 if self.gated else 2) * self.hidden * self.ffn
        return self.attention_params() + mlp + 2 * self.hidden  # two RMSNorm weights

    def matmul_params(self) -> int:
        """Matmul parameters one token meets in a layer (the active ones of an MoE: ``top_k`` experts)."""
        if self.is_moe:
            return self.attention_params() + moe.router_params(self) + self.top_k * 3 * self.hidden * self.moe_ffn
        return self.layer_params() - 2 * self.hidden

    def active_params(self) -> int:
        """Parameters one token meets (all of a dense model)."""
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * (self.matmul_params() + 2 * self.hidden) + self.hidden + emb

    def num_params(self, vocab: Optional[int] = None) -> int:
        v = self.vocab if vocab is None else vocab
        return self.layers * self.layer_params() + self.hidden + v * self.hidden * (1 if self.tied else 2)

    @classmethod
    def from_hf_config(cls, cfg: dict | str | Path, name: str = "") -> "ModelShape":
        """From an HF ``config.json`` (dict or path; a directory means its config.json)."""
        if not isinstance(cfg, dict):
            p = Path(cfg)
            p = p / "config.json" if p.is_dir() else p
            if not p.is_file():
                raise PlanError(f"HF config {str(p)!r} does not exist")
            name = name or p.parent.name
            cfg = json.loads(p.read_text())
        cfg = cfg.get("text_config", cfg)
        need = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"]
        missing = [k for k in need if k not in cfg]
        if missing:
            raise PlanError(f"HF config lacks {missing}; the planner needs {need}")
        mtype = str(cfg.get("model_type", ""))
        act = str(cfg.get("hidden_act", "silu"))
        experts = _moe_fields(cfg, name)
        return cls(
            name=name or mtype or "model", hidden=int(cfg["hidden_size"]), layers=int(cfg["num_hidden_layers"]),
            heads=int(cfg["num_attention_heads"]),
            kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            ffn=int(cfg["intermediate_size"]), vocab=int(cfg["vocab_size"]),
            tied=bool(cfg.get("tie_word_embeddings", False)), head_dim=cfg.get("head_dim"),
            qkv_bias=bool(cfg.get("attention_bias", mtype == "qwen2")), qk_norm=mtype.startswith("qwen3"),
            gated=act in ("silu", "swiglu", "gelu_pytorch_tanh_gated"),
            max_positions=cfg.get("max_position_embeddings"), **experts)


def _moe_fields(cfg: dict, name: str) -> dict:
    """num_experts / top_k / moe_ffn of an HF MoE config (Qwen3-MoE names); {} for a dense one.
    Refuses what the actor refuses (``actor/model.py`` ``_check_moe_hf_config``): dense layers
    among the MoE ones, shared experts."""
    n = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not n:
        return {}
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise PlanError(f"{name or cfg.get('model_type')}: MoE with dense layers (mlp_only_layers="
                        f"{cfg.get('mlp_only_layers')}, decoder_sparse_step={cfg.get('decoder_sparse_step')}) is not "
                        "supported by the actor; only models whose every layer is MoE")
    if cfg.get("shared_expert_intermediate_size"):
        raise PlanError(f"{name or cfg.get('model_type')}: shared experts are not supported by the actor")
    need = ["num_experts_per_tok", "moe_intermediate_size"]
    missing = [k for k in need if k not in cfg]
    if missing:
        raise PlanError(f"MoE HF config lacks {missing}; the planner needs {need}")
    return dict(num_experts=n, top_k=int(cfg["num_experts_per_tok"]), moe_ffn=int(cfg["moe_intermediate_size"]))


def _m(name: str, **kw: Any) -> ModelShape:
    return ModelShape(name=name, **kw)


# Numbers from the models' public HF config.json files.
MODELS: dict[str, ModelShape] = {m.name: m for m in [
    _m("qwen2.5-1.5b", hidden=1536, layers=28, heads=12, kv_heads=2, ffn=8960, vocab=151936, tied=True,
       qkv_bias=True, max_positions=131072),
    _m("qwen2.5-7b", hidden=3584, layers=28, heads=28, kv_heads=4, ffn=18944, vocab=152064, tied=False,
       qkv_bias=True, max_positions=131072),
    _m("qwen2.5-math-7b", hidden=3584, layers=28, heads=28, kv_heads=4, ffn=18944, vocab=152064, tied=False,
       qkv_bias=True, max_positions=4096),
    _m("qwen2.5-32b", hidden=5120, layers=64, heads=40, kv_heads=8, ffn=27648, vocab=152064, tied=False,
       qkv_bias=True, max_positions=131072),
    _m("qwen3-8b", hidden=4096, layers=36, heads=32, kv_heads=8, ffn=12288, vocab=151936, tied=False,
       head_dim=128, qk_norm=True, max_positions=40960),
    _m("qwen3-32b", hidden=5120, layers=64, heads=64, kv_heads=8, ffn=25600, vocab=151936, tied=False,
       head_dim=128, qk_norm=True, max_positions=40960),
    # Qwen/Qwen3-30B-A3B config.json (mbridge 0.15.1's qwen3_moe bridge reads the same fields):
    # 48 layers, hidden 2048, 32 q / 4 kv heads of 128, 128 experts, top-8, moe_intermediate_size
    # 768, intermediate_size 6144 (unused: no dense layers), no shared experts, untied embeddings.
    _m("qwen3-30b-a3b", hidden=2048, layers=48, heads=32, kv_heads=4, ffn=6144, vocab=151936, tied=False,
       head_dim=128, qk_norm=True, max_positions=40960, num_experts=128, top_k=8, moe_ffn=768),
    _m("llama-3-8b", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, tied=False,
       max_positions=8192),
]}


def _norm_name(s: str) -> str:
    return s.lower().replace("_", "-").replace("meta-", "")


def model_shape(name_or_path: str) -> ModelShape:
    """A built-in shape by name (``qwen2.5-32b``; ``Qwen/Qwen2.5-32B`` and model directories
    named like one work too) or an HF config.json / model directory."""
    p = Path(name_or_path).expanduser()
    if (p / "config.json").is_file() or (p.is_file() and p.suffix == ".json"):
        return ModelShape.from_hf_config(p)
    key = _norm_name(p.name)
    for suffix in ("", "-instruct", "-base"):
        if key.endswith(suffix) and key[: len(key) - len(suffix)] in MODELS:
            return MODELS[key[: len(key) - len(suffix)]]
    raise PlanError(f"unknown model {name_or_path!r}: give an HF config (--hf-config path/config.json, or a "
                    f"model.hf_path directory holding one) or one of --model {sorted(MODELS)}")


# ------------------------------------------------------------------------------------------------
# Layout and estimate
# ------------------------------------------------------------------------------------------------


@dataclass
class Layout:
    """Everything besides the model that per-GPU memory depends on."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    vpp: Optional[int] = None
    ep: int = 1                             # expert parallel (MoE; folds into dp: plan/moe.py)
    etp: Optional[int] = None               # expert tensor parallel (None = tp, as Megatron)
    sequence_parallel: bool = False
    recompute: str = "none"                 # none | selective | full
    distributed_optimizer: bool = False
    micro_batch_tokens: int = 4096          # tokens of one micro-batch (all its sequences)
    seq_len: int = 4096                     # longest sequence (for the s x s attention scores)
    num_microbatches: Optional[int] = None  # per optimizer update per DP rank (None = many)
    gpus_per_node: int = 8                  # trainer processes per node
    node_gpus: int = 8                      # physical GPUs per node
    gpu_mem_gib: float = 80.0
    reserved_gib: float = 0.0               # taken by colocated engines while training (plan/colocated.py)
    param_bytes: int = 2                    # 2 = bf16/fp16, 4 = fp32
    flash_attention: bool = True            # TE/flash never stores the s x s scores
    dropout: bool = False                   # RL runs without dropout
    fused_logprobs: bool = True
    logprob_chunk_rows: int = 1024
    overhead_gib: float = 3.0
    vocab_divisible_by: int = 128           # Megatron pads the vocab to a multiple of this * tp
    routing_imbalance: float = 1.0          # MoE: hottest EP rank's token copies / mean (plan/routing.py)
    lease: lease.LeaseShape = lease.LeaseShape()  # a step's samples, for the lease's transient (plan/lease.py)
    reference: bool = False                 # algo.kl.coef > 0: a frozen reference copy (actor/reference.py)
    teacher: Optional["ModelShape"] = None  # algo.distill.coef > 0: the frozen teacher's shape (actor/teacher.py)
    lora_rank: int = 0                      # model.lora.rank: frozen base, adapters train (plan/lora.py)
    lora_targets: tuple[str, ...] = plan_lora.DEFAULT_TARGETS
    offload: bool = False                   # rollout.colocate: the trainer's state waits in host memory (plan/host.py)
    engine_procs: int = 0                   # engine ranks on a node beside the trainer's (host memory)
    host_mem_gib: float = host_plan.NODE_GIB  # RAM of one node
    host_process_gib: float = host_plan.PROCESS_GIB  # pageable host memory allowed per GPU process

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def budget_gib(self) -> float:
        return self.gpu_mem_gib - self.reserved_gib


@dataclass
class StageMemory:
    stage: int
    params: float
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    logits_naive: float
    logits_fused: float
    overhead: float
    in_flight: int
    lease: float = 0.0  # transient: this rank's part of a step's samples on its GPU (plan/lease.py)
    reference: float = 0.0  # transient: the frozen reference's weights during its forward (actor/reference.py)
    teacher: float = 0.0  # transient: the distillation teacher's weights during its forward (actor/teacher.py)

    @property
    def total(self) -> float:
        # the frozen copies' weights and the forward-backward's activations are never on the GPU
        # together (each frozen forward runs alone, before the update's forward-backward)
        return (self.weights + self.gradients + self.optimizer + max(self.activations, self.reference, self.teacher)
                + self.logits + self.overhead + self.lease)


@dataclass
class LayoutPlan:
    model: ModelShape
    layout: Layout
    stages: list[StageMemory]
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    refusal: Optional[MemoryRefusal] = None  # the memory check's error of ``errors``, in figures
    # rollout.colocate=true: the generating and training phases of a shared GPU (plan/colocated.py)
    colocated: Optional["colocated_plan.ColocatedPhases"] = None
    host: Optional[host_plan.HostMemory] = None  # one node's host memory (plan/host.py)

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def ok(self) -> bool:
        return not self.errors

    def raise_if_infeasible(self) -> "LayoutPlan":
        if self.errors and self.refusal is not None:
            raise MemoryPlanError("; ".join(self.errors), self.refusal)
        if self.errors:
            raise PlanError("; ".join(self.errors))
        return self


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    m = divisible_by * tp
    return -(-vocab // m) * m


def layer_activation_bytes(m: ModelShape, tokens: float, seq_len: int, tp: int, *, sequence_parallel: bool,
                           score_term: bool, dropout: bool, act_bytes: int = 2) -> float:
    """Bytes stored for backward by one transformer layer for ``tokens`` tokens on one GPU.

    Term by term (16-bit activations, 1-byte dropout masks), following Korthikanti et al. Table 2:
    replicated over TP: both norm inputs (2Th each), the inputs of QKV and fc1 (2Th each), the two
    dropout masks (Th each); split over TP: Q, K, V (2T*q, 2T*kv, 2T*kv), the output-projection
    input (2T*q), fc1 output (2T*f, or 4T*f with SwiGLU's gate+up) and the fc2 input (2T*f); the
    attention scores: softmax 2aTs, its dropout mask aTs and output 2aTs.
    """
    T, h, f, a = tokens, m.hidden, m.ffn, m.heads
    w = act_bytes / 2.0
    replicated = w * 8 * T * h + (2 * T * h if dropout else 0)
    mlp = (6 if m.gated else 4) * T * f * w
    split = w * (4 * T * m.q_size + 4 * T * m.kv_size) + mlp
    if score_term:
        split += a * T * seq_len * (5 if dropout else 2) * w
    return replicated / (tp if sequence_parallel else 1) + split / tp


def stage_params(m: ModelShape, lay: Layout, stage: int, vocab_p: int) -> float:
    """Parameters on one GPU of ``stage`` outside the experts (all of a dense model's); an MoE's
    expert parameters are :func:`megatron_m2po.plan.moe.stage_expert_params`."""
    per_layer = m.layer_params() if not m.is_moe else moe.tp_split_layer_params(m)
    p = per_layer * m.layers / lay.pp
    emb = vocab_p * m.hidden
    if stage == 0:
        p += emb
    if stage == lay.pp - 1:
        p += m.hidden  # final norm
        if lay.pp > 1 or not m.tied:
            p += emb      # output layer (a tied embedding is copied to the last stage when pp > 1)
    router = moe.router_params(m) * m.layers / lay.pp if m.is_moe else 0  # replicated over TP
    return p / lay.tp + router


def estimate(m: ModelShape, lay: Layout) -> list[StageMemory]:
    """Per-stage memory (bytes) of ``m`` under ``lay``; no feasibility checks."""
    vocab_p = padded_vocab(m.vocab, lay.tp, lay.vocab_divisible_by)
    toks = lay.micro_batch_tokens / lay.cp
    sp = lay.sequence_parallel and lay.tp > 1
    full_layer = _layer_bytes(m, lay, toks, sp, score_term=not lay.flash_attention)
    if lay.recompute == "selective":
        per_layer = _layer_bytes(m, lay, toks, sp, score_term=False)
    elif lay.recompute == "full":
        per_layer = 2 * toks * m.hidden / (lay.tp if sp else 1)
    else:
        per_layer = full_layer
    # first-stage embedding: int64 token ids (+ the embedding-dropout mask)
    emb_act = 8 * toks + (toks * m.hidden if lay.dropout else 0)
    emb_act /= lay.tp if sp else 1

    opt_bytes = 12 if lay.param_bytes < 4 else 8
    opt_shard = lay.dp * lay.cp if lay.distributed_optimizer else 1
    experts = moe.stage_expert_params(m, lay)          # 0 for a dense model
    expert_shard = moe.expert_data_parallel(lay) if lay.distributed_optimizer else 1
    n_mb = lay.num_microbatches if lay.num_microbatches is not None else 10 ** 9
    layers_per_stage = m.layers / lay.pp
    adapters = plan_lora.adapter_params(m, lay)
    if lay.recompute != "full":
        per_layer += plan_lora.adapter_activation_bytes(m, lay, toks)

    naive = toks * vocab_p / lay.tp * 14
    fused = min(lay.logprob_chunk_rows, toks) * vocab_p / lay.tp * 12
    leased = lease.lease_transient_bytes(m, lay)  # every rank receives its replica's shard: every stage
    out = []
    for i in range(lay.pp):
        params = stage_params(m, lay, i, vocab_p)
        if lay.vpp:  # interleaved 1F1B: Megatron's memory penalty on the first stage
            in_flight = math.ceil((1 + (lay.pp - 1) / (lay.pp * lay.vpp)) * lay.pp) if i == 0 else lay.pp - i
            factor = (1 + (lay.pp - 1) / (lay.pp * lay.vpp)) * lay.pp if i == 0 else lay.pp - i
        else:
            in_flight = min(lay.pp - i, n_mb)
            factor = in_flight
        act = factor * layers_per_stage * per_layer
        if i == 0:
            act += factor * emb_act
        if lay.recompute == "full":
            act += full_layer  # the layer being recomputed during backward
        if m.is_moe:  # one layer's token dispatch in flight
            act += moe.dispatch_buffer_bytes(m, toks, lay.tp, lay.etp or lay.tp, routing.hottest_rank_factor(lay))
        logits_naive = logits_fused = 0.0
        if i == lay.pp - 1:
            act += 2 * toks * m.hidden / (lay.tp if sp else 1)  # final-norm output, input of the output layer
            logits_naive, logits_fused = naive, fused
        if lay.lora_rank > 0:  # frozen base: gradients and optimizer states of the adapters only
            grads, opt = adapters * 4, adapters * opt_bytes / opt_shard
        else:
            grads, opt = (params + experts) * 4, params * opt_bytes / opt_shard + experts * opt_bytes / expert_shard
        out.append(StageMemory(
            stage=i, params=params + experts + adapters, weights=(params + experts + adapters) * lay.param_bytes,
            gradients=grads, optimizer=opt, activations=act,
            logits=logits_fused if lay.fused_logprobs else logits_naive,
            logits_naive=logits_naive, logits_fused=logits_fused, overhead=lay.overhead_gib * GiB,
            in_flight=in_flight, lease=leased,
            # under LoRA the reference is the base with the adapters disabled: no copy
            reference=(params + experts) * lay.param_bytes if lay.reference and lay.lora_rank <= 0 else 0.0,
            teacher=teacher_stage_bytes(lay, i)))
    return out


def teacher_stage_bytes(lay: Layout, stage: int) -> float:
    """The distillation teacher's weights on one GPU of ``stage`` (0 without a teacher): its own
    shape, split by the actor's layout as the actor's build_model splits it (actor/teacher.py)."""
    t = lay.teacher
    if t is None:
        return 0.0
    vocab_p = padded_vocab(t.vocab, lay.tp, lay.vocab_divisible_by)
    return (stage_params(t, lay, stage, vocab_p) + moe.stage_expert_params(t, lay)) * lay.param_bytes


def _layer_bytes(m: ModelShape, lay: Layout, toks: float, sp: bool, *, score_term: bool) -> float:
    """Activation bytes of one layer (an MoE layer: the dense formula without its MLP, plus plan/moe.py's terms)."""
    if not m.is_moe:
        return layer_activation_bytes(m, toks, lay.seq_len, lay.tp, sequence_parallel=sp, score_term=score_term,
                                      dropout=lay.dropout)
    dense = layer_activation_bytes(dataclasses.replace(m, num_experts=0, ffn=0), toks, lay.seq_len, lay.tp,
                                   sequence_parallel=sp, score_term=score_term, dropout=lay.dropout)
    return moe.layer_activation_bytes(m, toks, lay.tp, lay.etp or lay.tp, dense_part=dense,
                                      imbalance=routing.hottest_rank_factor(lay))


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def plan(m: ModelShape, lay: Layout) -> LayoutPlan:
    """Estimate and check ``lay`` for ``m``; ``LayoutPlan.errors`` says what is impossible and what to change."""
    errs: list[str] = []
    warns: list[str] = []
    for k in ("tp", "pp", "dp", "cp"):
        if getattr(lay, k) < 1:
            raise PlanError(f"{k}={getattr(lay, k)} must be >= 1")
    ok_tp = [d for d in _divisors(m.heads, lay.gpus_per_node) if m.kv_heads % d == 0]
    if lay.tp > lay.gpus_per_node:
        errs.append(f"tp={lay.tp} exceeds GPUs per node {lay.gpus_per_node}: tensor parallel must stay inside "
                    f"a node; use tp in {ok_tp} and raise pipeline_parallel instead")
    if m.heads % lay.tp:
        errs.append(f"num_attention_heads {m.heads} not divisible by tp {lay.tp}: use tp in {ok_tp}")
    if m.kv_heads % lay.tp:
        errs.append(f"kv heads {m.kv_heads} not divisible by tp {lay.tp}: Megatron splits key/value groups "
                    f"over TP; use tp in {ok_tp}")
    if m.ffn % lay.tp and not m.is_moe:
        errs.append(f"intermediate_size {m.ffn} not divisible by tp {lay.tp}: use tp in {ok_tp}")
    if m.vocab % lay.tp:  # the actor refuses it (actor/model.py): padded rows would change the normaliser
        errs.append(f"vocab_size {m.vocab} not divisible by tp {lay.tp}: the actor refuses padded vocabulary rows; "
                    f"use tp in {[d for d in ok_tp if m.vocab % d == 0]}")
    errs += moe.layout_errors(m, lay)
    stages = lay.pp * (lay.vpp or 1)
    if m.layers % stages:
        what = f"pp*vpp = {lay.pp}*{lay.vpp}" if lay.vpp else f"pp {lay.pp}"
        errs.append(f"num_hidden_layers {m.layers} not divisible by {what}: use pp in "
                    f"{_divisors(m.layers, 64)}")
    if lay.vpp and lay.pp == 1:
        errs.append("virtual pipeline stages need pipeline_parallel > 1")
    if lay.sequence_parallel and lay.tp == 1:
        errs.append("sequence_parallel needs tp > 1")
    if lay.recompute not in ("none", "selective", "full"):
        errs.append(f"recompute={lay.recompute!r} must be none, selective or full")
    if lay.cp > 1 and lay.micro_batch_tokens % (2 * lay.cp):
        errs.append(f"micro-batch tokens {lay.micro_batch_tokens} not divisible by 2*cp = {2 * lay.cp} "
                    f"(context parallel splits each sequence into 2*cp load-balanced chunks)")
    if m.max_positions and lay.seq_len > m.max_positions:
        warns.append(f"sequence length {lay.seq_len} exceeds the model's max_position_embeddings "
                     f"{m.max_positions}: shorten data.max_prompt_tokens + rollout.max_new_tokens or extend "
                     f"the RoPE range first")
    if lay.num_microbatches is not None and 1 < lay.pp and lay.num_microbatches < lay.pp:
        warns.append(f"{lay.num_microbatches} micro-batches per update < pp {lay.pp}: the pipeline is mostly "
                     f"bubbles; raise prompts_per_update or lower micro_batch_size")

    stages_mem = estimate(m, lay) if not errs else []
    p = LayoutPlan(model=m, layout=lay, stages=stages_mem, errors=errs, warnings=warns)
    if errs:
        return p
    worst = p.worst
    budget = lay.budget_gib * GiB
    if worst.total > budget:
        p.refusal = _memory_refusal(worst, lay, budget, experts=m.is_moe)
        p.errors.append(p.refusal.message)
    # the frozen copies wait in host memory between their forwards: the reference and the teacher
    p.host = host_plan.host_memory(reference_bytes=worst.reference, teacher_bytes=worst.teacher, weights=worst.weights,
                                   optimizer=worst.optimizer,
                                   offload=lay.offload, trainer_procs=lay.gpus_per_node, engine_procs=lay.engine_procs,
                                   node_gib=lay.host_mem_gib, process_gib=lay.host_process_gib)
    if not p.host.ok:
        p.errors.append(p.host.refusal())
    return p


def _g(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def _memory_refusal(s: StageMemory, lay: Layout, budget: float, experts: bool = False) -> MemoryRefusal:
    head = (f"stage {s.stage} needs {_g(s.total)} > budget {_g(budget)}"
            + (f" ({lay.gpu_mem_gib:g} GiB GPU - {lay.reserved_gib:.1f} GiB that colocated engines leave "
               "while training)" if lay.reserved_gib else ""))
    states = s.weights + s.gradients + s.optimizer
    shard = lay.dp * lay.cp
    if s.weights + s.gradients + s.overhead > budget:
        cause, figure = "weights", s.weights
        fix = (f"weights {_g(s.weights)} + fp32 gradients {_g(s.gradients)} exceed the budget on their own: raise "
               f"parallel.tensor_parallel or parallel.pipeline_parallel (they scale as 1/(tp*pp))"
               + ("; the experts' also as 1/(ep*etp): raise parallel.expert_parallel" if experts else ""))
    elif not lay.distributed_optimizer and (s.optimizer > 0.3 * budget or states + s.overhead > budget):
        cause, figure = "optimizer", s.optimizer
        fix = (f"optimizer states {_g(s.optimizer)} > budget share: enable parallel.use_distributed_optimizer "
               f"(shards them over dp*cp = {shard}: {_g(s.optimizer / shard)}) or raise data parallel")
        if shard == 1:
            fix += "; with dp*cp = 1 only more tensor/pipeline parallelism helps"
    elif states + s.overhead > budget:
        cause, figure = "states", states
        fix = (f"weights+gradients+optimizer states {_g(states)} exceed the budget: raise data parallel (the "
               f"distributed optimizer shards over dp*cp = {shard}) or tensor/pipeline parallelism")
    elif s.logits > 0.25 * budget:
        cause, figure = "logits", s.logits
        fix = (f"logits {_g(s.logits)}: use the fused log-prob (fused_logprobs) or fewer tokens per micro-batch")
    else:
        hints = []
        if lay.recompute != "full":
            hints.append("parallel.recompute=" + ("selective or full" if lay.recompute == "none" else "full"))
        if lay.tp > 1 and not lay.sequence_parallel:
            hints.append("parallel.sequence_parallel=true")
        hints += ["fewer tokens per micro-batch (parallel.micro_batch_size)", "more tensor/pipeline parallelism"]
        cause, figure = "activations", s.activations
        fix = f"activations {_g(s.activations)} ({s.in_flight} micro-batch(es) in flight): use " + ", ".join(hints)
    return MemoryRefusal(stage=s.stage, need=s.total, budget=budget, cause=cause, figure=figure,
                         message=f"{head}; {fix}")


# ------------------------------------------------------------------------------------------------
# From a run config
# ------------------------------------------------------------------------------------------------


def layout_from_config(cfg: Config, *, nnodes: int = 1, gpus_per_node: int = 8, node_gpus: Optional[int] = None,
                       gpu_mem_gib: float = 80.0, **overrides: Any) -> Layout:
    """The layout a run of ``cfg`` on ``nnodes x gpus_per_node`` trainer processes would use."""
    par = cfg.parallel
    seq = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    lay = Layout(tp=par.tensor_parallel, pp=par.pipeline_parallel, cp=par.context_parallel,
                 ep=par.expert_parallel, etp=par.expert_tensor_parallel,
                 vpp=par.virtual_pipeline_parallel, sequence_parallel=par.sequence_parallel,
                 recompute=par.recompute, distributed_optimizer=par.use_distributed_optimizer,
                 # a token budget groups sequences (packed or padded) up to it; a longer one runs alone
                 micro_batch_tokens=(max(par.max_tokens_per_microbatch, seq) if par.max_tokens_per_microbatch
                                     else par.micro_batch_size * seq), seq_len=seq, gpus_per_node=gpus_per_node,
                 node_gpus=node_gpus or max(gpus_per_node, 8), gpu_mem_gib=gpu_mem_gib,
                 param_bytes=4 if cfg.model.dtype == "float32" else 2,
                 dropout=cfg.model.attention_dropout > 0 or cfg.model.hidden_dropout > 0,
                 logprob_chunk_rows=par.logprob_chunk_rows, routing_imbalance=cfg.model.moe.routing_imbalance,
                 lease=lease.LeaseShape(step_samples=cfg.trainer.prompts_per_step * cfg.rollout.n_samples_per_prompt,
                                        updates=cfg.trainer.num_updates_per_step,
                                        routed_experts=cfg.rollout.return_routed_experts,
                                        engine_logprobs=cfg.algo.recompute_behav_logprobs),
                 reference=cfg.algo.kl.coef > 0, lora_rank=cfg.model.lora.rank,
                 # mode=sglang: the teacher runs on engines of its own, not in the trainer's memory
                 teacher=model_shape(cfg.algo.distill.teacher)
                 if cfg.algo.distill.coef > 0 and cfg.algo.distill.mode == "megatron" else None,
                 lora_targets=tuple(cfg.model.lora.targets), offload=cfg.rollout.colocate)
    for k, v in overrides.items():
        if v is not None:
            setattr(lay, k, v)
    if "dp" not in overrides or overrides["dp"] is None:
        world = nnodes * lay.gpus_per_node
        model_par = lay.tp * lay.pp * lay.cp
        if world % model_par:
            need = model_par // math.gcd(model_par, lay.gpus_per_node)  # the fewest nodes that hold whole replicas
            raise PlanError(f"world size {world} ({nnodes} node(s) x {lay.gpus_per_node} GPUs) is not divisible by "
                            f"tp*pp*cp = {lay.tp}*{lay.pp}*{lay.cp} = {model_par}: plan it on --nnodes {need} (or a "
                            f"multiple), or give a layout whose tp*pp*cp divides {world}")
        lay.dp = world // model_par
    if lay.num_microbatches is None:
        seqs = cfg.trainer.prompts_per_update * cfg.rollout.n_samples_per_prompt
        lay.num_microbatches = max(1, seqs // (lay.dp * par.micro_batch_size))
    return lay


def engine_gpus(cfg: Config, lay: Layout) -> list[int]:
    """GPUs of node 0 that locally launched SGLang engines use (empty when engines are elsewhere)."""
    r = cfg.rollout
    if r.engine != "sglang" or r.launcher != "local":
        return []
    if r.engine_gpu_ids:
        return list(r.engine_gpu_ids)
    return list(range(lay.gpus_per_node, lay.gpus_per_node + r.num_engines * r.engine_tp))


def _trainer_config_errors(cfg: Config, lay: Layout) -> list[str]:
    """What ``Config.validate`` (the trainer's start-up checks) says about ``cfg`` run at ``lay``'s
    layout (the search builds its candidates' configs without validating them; the CLI's --tp / --ep
    overrides reach the layout only)."""
    par = dataclasses.replace(cfg.parallel, tensor_parallel=lay.tp, pipeline_parallel=lay.pp,
                              context_parallel=lay.cp, sequence_parallel=lay.sequence_parallel,
                              expert_parallel=lay.ep, expert_tensor_parallel=lay.etp,
                              virtual_pipeline_parallel=lay.vpp)
    try:
        dataclasses.replace(cfg, parallel=par).validate()
    except ConfigError as e:
        return [str(e)]
    return []


def plan_from_config(cfg: Config, m: ModelShape, **kw: Any) -> LayoutPlan:
    """Plan a run config: layout, engine GPU accounting, memory."""
    lay = layout_from_config(cfg, **kw)
    extra: list[str] = []
    eng = engine_gpus(cfg, lay)
    r = cfg.rollout
    if eng:
        # The trainer's own placement rules (rollout/placement.py): what it would refuse at start-up
        # is an error of the plan.
        from megatron_m2po.rollout import placement

        node = placement.NodeGPUs(trainer=lay.gpus_per_node, world=lay.world_size, count=lay.node_gpus)
        try:
            placement.check_weight_sync_placement(cfg, node, placement.engine_gpus(r, node))
        except ValueError as e:
            extra.append(str(e))
        lay.engine_procs = len(eng)  # engine ranks on node 0, beside its trainer ranks (host memory)
        shared = sorted(set(eng) & set(range(lay.gpus_per_node)))
        if shared:  # colocated: engines release their memory while training runs (plan/colocated.py)
            lay.reserved_gib = _engine_share(cfg, lay).residue_bytes() / GiB
    p = plan(m, lay)
    if eng and lay.reserved_gib and p.stages:
        _colocated_phases(p, cfg)
    if m.is_moe and p.stages:  # the layout's shape passed plan()'s own checks (no message twice)
        extra += _trainer_config_errors(cfg, lay)
    p.errors = extra + p.errors
    if eng:
        how = "colocated with the trainer" if lay.reserved_gib else "disaggregated"
        p.notes.append(f"engines: {r.num_engines} x SGLang TP={r.engine_tp} on node-0 GPUs {eng} ({how}), started by "
                       f"the trainer (rollout.launcher=local) behind sglang-router at port {r.base_port - 1}")
    elif r.launcher == "external":
        p.notes.append(f"engines: external at {r.router_addr or r.external_addrs} (start them with "
                       f"scripts/launch_sglang_fleet.sh on the rollout nodes first)")
    else:
        p.notes.append(f"engines: {r.num_engines} x {r.engine} via rollout.launcher={r.launcher}")
    for what, path in (("model.hf_path", cfg.model.hf_path), ("data.train", cfg.data.train)):
        if path not in ("tiny", "synthetic") and not Path(path).expanduser().exists():
            p.warnings.append(f"{what}={path} does not exist on this machine (fine if this is not a training node)")
    seqs = cfg.trainer.prompts_per_update * r.n_samples_per_prompt
    if seqs % (lay.dp * cfg.parallel.micro_batch_size):
        p.warnings.append(f"{seqs} sequences per update do not split evenly into dp={lay.dp} x micro_batch_size="
                          f"{cfg.parallel.micro_batch_size}: some ranks run one more micro-batch")
    return p


def _engine_share(cfg: Config, lay: Layout) -> "colocated_plan.EngineShare":
    r = cfg.rollout
    return colocated_plan.EngineShare(mem_fraction=r.engine_mem_fraction, engine_tp=r.engine_tp,
                                      gpu_mem_gib=lay.gpu_mem_gib)


def _colocated_phases(p: LayoutPlan, cfg: Config) -> None:
    """Add the generating and training phases of a shared GPU to ``p`` (plan/colocated.py); a
    generating phase that does not fit is an error with a :class:`MemoryRefusal` of cause
    ``generating`` (the training phase is ``plan``'s own check, at a budget less the engines' residue)."""
    lay = p.layout
    engine_bytes = 1 if cfg.rollout.fp8_weights else 2  # SGLang serves bf16, or block FP8 with fp8_weights
    engine_weights = p.model.num_params() * engine_bytes / cfg.rollout.engine_tp
    w = p.worst
    m = p.model
    largest = m.vocab * m.hidden * 2  # the embedding (or head), gathered whole under its HF name
    push = colocated_plan.push_buffer_bytes(cfg.rollout.weight_sync_bucket_mb * 2**20, largest,
                                            m.num_params() * engine_bytes)
    ph = colocated_plan.phases(w.total, w.overhead, engine_weights, _engine_share(cfg, lay),
                               trainer_weights=w.weights, push_bytes=push)
    p.colocated = ph
    gen, share = ph.generating, ph.share
    free = gen.budget - gen.parts["trainer residue (offloaded)"] - gen.parts["engine CUDA context"]
    problem = ""
    if ph.kv_bytes <= 0:
        problem = (f"rollout.engine_mem_fraction={share.mem_fraction:g} of the {_g(free)} free leaves no KV cache "
                   f"beside the engine's weights {_g(engine_weights)}: raise rollout.engine_tp or the fraction "
                   f"(at most {ph.max_mem_fraction:.2f})")
    elif not gen.ok:
        work = gen.parts["engine working set"]
        problem = (f"the engine's working set {_g(work)} (SGLang's reserve for activations and CUDA graphs) does not "
                   f"fit the {_g((1 - share.mem_fraction) * free)} that rollout.engine_mem_fraction={share.mem_fraction:g} "
                   f"leaves of {_g(free)} free: lower it to at most {ph.max_mem_fraction:.2f}")
    push_phase = ph.pushing
    if not problem and not push_phase.ok:
        msg = (f"pushing phase needs {_g(push_phase.total)} > {_g(push_phase.budget)} GPU: during the push the "
               f"trainer's weights ({_g(push_phase.parts['trainer weights (states offloaded)'])}) "
               "and the engine's resumed "
               f"weights ({_g(engine_weights)}) are resident together, with "
               f"{_g(push_phase.parts['push buckets'])} of push buckets; lower rollout.weight_sync_bucket_mb, raise "
               "rollout.engine_tp (smaller engine shards), or shard the trainer's weights further (tensor / pipeline "
               "parallel)")
        if p.refusal is None:
            p.refusal = MemoryRefusal(stage=w.stage, need=push_phase.total, budget=push_phase.budget, cause="pushing",
                                      figure=push_phase.parts["push buckets"], message=msg)
        p.errors.append(msg)
    if problem:
        msg = f"generating phase needs {_g(gen.total)} > {_g(gen.budget)} GPU; {problem}"
        if p.refusal is None:
            p.refusal = MemoryRefusal(stage=p.worst.stage, need=gen.total, budget=gen.budget, cause="generating",
                                      figure=gen.parts["engine working set"], message=msg)
        p.errors.append(msg)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def _bool_flag(p: argparse.ArgumentParser, name: str, help: str) -> None:
    p.add_argument(f"--{name}", dest=name.replace("-", "_"), action=argparse.BooleanOptionalAction, default=None,
                   help=help)


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``m2po plan`` (``plan.search.register`` extends it with ``--search``)."""
    p = sub.add_parser("plan", help="Estimate per-GPU memory of a layout and reject impossible ones.",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="Run config YAML (omit for the defaults).")
    p.add_argument("overrides", nargs="*", help="Dotted config overrides, e.g. parallel.tensor_parallel=8")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--hf-config", help="HF config.json (or model directory) of the model.")
    src.add_argument("--model", help=f"Built-in model shape: {', '.join(MODELS)}.")
    p.add_argument("--list-models", action="store_true", help="Print the built-in shapes and exit.")
    p.add_argument("--gpu-mem-gib", type=float, default=80.0, help="Memory of one GPU (GiB).")
    p.add_argument("--nnodes", type=int, default=None,
                   help="Training nodes (default: a recipe's launch script's NNODES, else 1; with --search and "
                        "nothing fitting one node, the smallest power-of-two count that fits).")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="Trainer processes (GPUs) per node (default: a recipe's launch script's GPUS_PER_NODE, else 8).")
    p.add_argument("--node-gpus", type=int, default=None, help="Physical GPUs per node (default max(8, gpus-per-node)).")
    for k in ("tp", "pp", "dp", "cp", "vpp", "ep", "etp"):
        p.add_argument(f"--{k}", type=int, default=None, help=f"Override {k} (dp default: world / (tp*pp*cp)).")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="Tokens per micro-batch (default micro_batch_size * (max_prompt_tokens + max_new_tokens)).")
    p.add_argument("--seq-len", type=int, default=None, help="Longest sequence (default max_prompt + max_new).")
    p.add_argument("--num-microbatches", type=int, default=None, help="Micro-batches per update per DP rank.")
    p.add_argument("--recompute", choices=["none", "selective", "full"], default=None)
    _bool_flag(p, "sequence-parallel", "Megatron sequence parallelism.")
    _bool_flag(p, "distributed-optimizer", "Shard optimizer states over data parallel.")
    _bool_flag(p, "fused-logprobs", "Fused chunked log-prob (default on; --no-fused-logprobs = naive logits).")
    _bool_flag(p, "flash-attention", "Flash/TE attention (no s x s scores stored; default on).")
    p.add_argument("--overhead-gib", type=float, default=None, help="Fixed overhead per GPU (GiB, default 3).")
    p.add_argument("--host-mem-gib", type=float, default=None,
                   help=f"RAM of one node (GiB, default {host_plan.NODE_GIB:g}): the reference copy and colocated "
                        "mode's offloaded state are pinned there (plan/host.py).")
    p.add_argument("--host-process-gib", type=float, default=None,
                   help=f"Pageable host memory allowed per GPU process (GiB, default {host_plan.PROCESS_GIB:g}).")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="Override model.lora.rank (0 = full fine-tuning; > 0: frozen base, adapters train).")
    p.add_argument("--json", action="store_true", help="Print the plan as JSON.")
    p.add_argument("--store-warn-gib", type=float, default=routing.STORE_WARN_GIB,
                   help="MoE: warn when routing replay stores more than this in the rollout store (GiB; default a "
                        "quarter of a 2 TB local NVMe; plan/routing.py).")
    p.set_defaults(func=run)
    return p


def resolve_model(args: argparse.Namespace, cfg: Config) -> ModelShape:
    if args.hf_config:
        return ModelShape.from_hf_config(args.hf_config)
    if args.model:
        return model_shape(args.model)
    return model_shape(cfg.model.hf_path)


def config_of(args: argparse.Namespace):
    """The config of ``m2po plan CONFIG [overrides]``; a first argument with ``=`` is an override
    (no config file: the defaults)."""
    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path:
        path, overrides = None, [path] + overrides
    return load_config(path, overrides)


def cluster_of(args: argparse.Namespace) -> tuple[int, int]:
    """``(nnodes, gpus_per_node)`` of ``m2po plan``: the options, else the defaults of the launch
    script that runs the config (:func:`~megatron_m2po.plan.recipes.launch_cluster`, said on stderr),
    else one node of 8 GPUs."""
    nnodes, gpn = args.nnodes, args.gpus_per_node
    if (nnodes is None or gpn is None) and args.config and "=" not in args.config:
        from megatron_m2po.plan.recipes import launch_cluster

        rc = launch_cluster(args.config)
        if rc is not None:
            nnodes, gpn = nnodes or rc.nnodes, gpn or rc.gpus_per_node
            gpus = f"{gpn} GPUs" if gpn >= 8 else f"{gpn} trainer GPUs (of an 8-GPU node; engines on the others)"
            print(f"# {nnodes} node(s) x {gpus}: the cluster {rc.script.name} launches this recipe on "
                  "(NNODES, GPUS_PER_NODE); --nnodes / --gpus-per-node plan another", file=sys.stderr)
    return nnodes or 1, gpn or 8


def run(args: argparse.Namespace) -> int:
    if args.list_models:
        for m in MODELS.values():
            print(f"{m.name:16s} {m.num_params() / 1e9:6.2f}B  hidden={m.hidden} layers={m.layers} heads={m.heads} "
                  f"kv_heads={m.kv_heads} ffn={m.ffn} vocab={m.vocab} tied={m.tied}"
                  + (f" experts={m.num_experts} top_k={m.top_k} moe_ffn={m.moe_ffn}" if m.is_moe else ""))
        return 0
    cfg = config_of(args)
    try:
        m = resolve_model(args, cfg)
        names = {"tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "vpp": "vpp", "ep": "ep", "etp": "etp",
                 "micro_batch_tokens": "micro_batch_tokens",
                 "seq_len": "seq_len", "num_microbatches": "num_microbatches", "recompute": "recompute",
                 "sequence_parallel": "sequence_parallel", "distributed_optimizer": "distributed_optimizer",
                 "fused_logprobs": "fused_logprobs", "flash_attention": "flash_attention",
                 "overhead_gib": "overhead_gib", "lora_rank": "lora_rank", "host_mem_gib": "host_mem_gib",
                 "host_process_gib": "host_process_gib"}
        kw = {dst: getattr(args, src) for src, dst in names.items()}
        nnodes, gpus_per_node = cluster_of(args)
        p = plan_from_config(cfg, m, nnodes=nnodes, gpus_per_node=gpus_per_node,
                             node_gpus=args.node_gpus, gpu_mem_gib=args.gpu_mem_gib, **kw)
        notes, warns = routing.replay_lines(cfg, m, args.store_warn_gib)
        p.notes += notes
        p.warnings += warns
    except PlanError as e:
        print(f"m2po plan: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(plan_to_dict(p), indent=2))
    else:
        print_plan(p)
    return 0 if p.ok else 1


def plan_to_dict(p: LayoutPlan) -> dict:
    return {"model": dataclasses.asdict(p.model), "layout": dataclasses.asdict(p.layout),
            "params_b": p.model.num_params() / 1e9, "active_params_b": p.model.active_params() / 1e9,
            "stages": [dict(dataclasses.asdict(s), total=s.total) for s in p.stages],
            "worst_total_gib": p.worst.total / GiB if p.stages else None,
            "budget_gib": p.layout.budget_gib, "ok": p.ok, "errors": p.errors, "warnings": p.warnings,
            "notes": p.notes, "colocated": colocated_plan.to_dict(p.colocated) if p.colocated else None,
            "host": None if p.host is None else {"parts_gib": {k: v / GiB for k, v in p.host.parts.items()},
                                                 "total_gib": p.host.total / GiB, "budget_gib": p.host.budget / GiB,
                                                 "ok": p.host.ok}}


def print_plan(p: LayoutPlan) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=120)
    m, lay = p.model, p.layout
    ep = f" ep={lay.ep} etp={lay.etp or lay.tp} expert-dp={moe.expert_data_parallel(lay)}" if m.is_moe else ""
    con.print(f"[bold]{m.name}[/]  {m.num_params() / 1e9:.2f}B params{moe.describe(m)}  | tp={lay.tp} pp={lay.pp} "
              f"dp={lay.dp} cp={lay.cp}{f' vpp={lay.vpp}' if lay.vpp else ''}{ep}  world={lay.world_size}  sp={lay.sequence_parallel} "
              f"recompute={lay.recompute} dist-opt={lay.distributed_optimizer}  micro-batch {lay.micro_batch_tokens} "
              f"tokens, {lay.num_microbatches} per update per DP rank")
    if p.stages:
        shown = [p.stages[0]] + ([p.stages[-1]] if len(p.stages) > 1 else [])
        t = Table(title=f"per-GPU memory (GiB), budget {lay.budget_gib:.1f} GiB")
        t.add_column("component")
        for s in shown:
            t.add_column(f"stage {s.stage}", justify="right")
        t.add_column("how")
        rows = [
            ("weights", "weights", f"{lay.param_bytes} B/param over tp"
             + (f", base frozen + LoRA r={lay.lora_rank} adapters" if lay.lora_rank > 0 else "")),
            ("gradients", "gradients", "fp32 main grads, 4 B/param" + (" (adapters only)" if lay.lora_rank > 0 else "")),
            ("optimizer states", "optimizer",
             f"fp32 master+Adam m,v{f' / dp*cp={lay.dp * lay.cp}' if lay.distributed_optimizer else ''}"
             + (f", experts' / expert-dp={moe.expert_data_parallel(lay)}" if m.is_moe and lay.distributed_optimizer
                else "")),
            ("activations", "activations", f"{lay.recompute} recompute, 1F1B in flight: "
                                            + "/".join(str(s.in_flight) for s in shown)),
            ("logits (fused log-prob)", "logits_fused", f"{lay.logprob_chunk_rows} rows x V/tp fp32"),
            ("overhead", "overhead", "CUDA ctx, NCCL, workspaces"),
            ("lease (step's samples)", "lease", lease.describe(m, lay)),
        ]
        if lay.reference:  # appended: rows[4] is the logits row
            rows.append(("reference (algo.kl)", "reference", "frozen weights during its forward; total counts "
                         "max(activations, reference)"))
        if lay.teacher is not None:
            rows.append(("teacher (algo.distill)", "teacher", f"frozen {lay.teacher.name or 'teacher'} weights "
                         "during its forward; total counts max(activations, reference, teacher)"))
        if not lay.fused_logprobs:
            rows[4] = ("logits (naive)", "logits_naive", "T x V/tp: bf16 + fp32 copy + softmax + grad")
        for label, attr, how in rows:
            t.add_row(label, *[f"{getattr(s, attr) / GiB:.2f}" for s in shown], how)
        t.add_row("[bold]total[/]", *[f"[bold]{s.total / GiB:.2f}[/]" for s in shown], "")
        alt = "logits (naive, for comparison)" if lay.fused_logprobs else "logits (fused, for comparison)"
        t.add_row(f"[dim]{alt}[/]", *[f"[dim]{(s.logits_naive if lay.fused_logprobs else s.logits_fused) / GiB:.2f}[/]"
                                      for s in shown], "[dim]not in total[/]")
        con.print(t)
    if p.colocated is not None:
        colocated_plan.print_phases(con, p.colocated)
    if p.host is not None:
        con.print(p.host.describe(), highlight=False)
    for n in p.notes:
        con.print(n)
    for w in p.warnings:
        con.print(f"[yellow]warning:[/] {w}")
    if p.ok and p.colocated is not None:  # the shared GPU's tightest phase, not the training phase alone
        peak = p.colocated.peak
        con.print(f"[green]OK[/]: worst stage {p.worst.total / GiB:.1f} GiB of {lay.budget_gib:.1f} GiB while "
                  f"training; tightest phase of the shared GPU: {peak.name}, {peak.total / GiB:.1f} of "
                  f"{peak.budget / GiB:.1f} GiB")
    elif p.ok:
        con.print(f"[green]OK[/]: worst stage {p.worst.total / GiB:.1f} GiB of {lay.budget_gib:.1f} GiB")
    else:
        for e in p.errors:
            con.print(f"[red]REJECTED[/]: {e}")
