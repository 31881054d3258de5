"""The actor's config sections: ``model`` (with ``model.moe``), ``parallel`` and ``optim``.

They sit next to the code that reads them (``actor/model.py`` builds the Megatron model from
``model`` and ``parallel``, ``actor/actor.py`` the optimizer from ``optim``) and import only the
settings machinery (``utils/settings.py``), so the planner, the rollout side and the tools can
read them without importing Megatron. ``megatron_m2po/config.py`` composes them into the run's
tree; the rules that span sections (``trainer`` x ``store``, ``algo`` x ``rollout``) live there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron_m2po.utils.settings import ConfigError, check_ranges
from megatron_m2po.utils.settings import setting as _f

__all__ = ["MoEConfig", "LoRAConfig", "LORA_TARGETS", "ModelConfig", "ParallelConfig", "OptimConfig"]

@dataclass
class MoEConfig:
    """Router and expert settings of a Mixture-of-Experts policy (``model.moe.*``; read only for MoE
    models such as Qwen3-MoE, ``actor/model.py``). The defaults suit RL fine-tuning of a pretrained
    MoE: the policy gradient alone moves the router, and every token reaches the experts it chose,
    so that the trainer computes the same function the rollout engine sampled from."""

    aux_loss_coeff: float = _f(
        0.0, ge=0.0, help="Load-balancing auxiliary loss coefficient (Megatron moe_aux_loss_coeff; 0 = off, "
        "moe_router_load_balancing_type=none). Off for RL: the pretrained router is already balanced, and the aux "
        "loss adds a gradient that is not the policy's, moving routing away from what generated the rollouts "
        "(mbridge's Qwen3-MoE bridge also turns it off for RL). > 0 uses Megatron's aux_loss balancing.")
    z_loss_coeff: float = _f(
        0.0, ge=0.0, help="Router z-loss coefficient (Megatron moe_z_loss_coeff; 0 = off). Off for RL for the "
        "same reason as the aux loss; a small value (1e-3) can tame growing router logits in long runs.")
    capacity_factor: Optional[float] = _f(
        None, gt=0.0, help="Expert capacity factor (Megatron moe_expert_capacity_factor). null (default) = no "
        "capacity limit and no token dropping: a dropped token gets a different function in the trainer than "
        "in the engine (SGLang never drops), which biases log-probs and the importance ratios. A value turns "
        "dropping on (tokens over capacity skip the expert).")
    router_dtype: Literal["float32", "float64", "model"] = _f(
        "float32", help="Dtype of the router's logits and softmax (Megatron moe_router_dtype). float32 (default): "
        "with bf16 weights, near-ties between experts otherwise flip with rounding, so the trainer would route "
        "tokens to other experts than the engine; 'model' = the parameter dtype.")
    routing_imbalance: float = _f(
        1.6, ge=1.0, help="Planner only (m2po plan; plan/routing.py): token copies the hottest expert-parallel rank "
        "receives per dispatch, as a multiple of the mean. With the aux loss off and no capacity limit nothing "
        "balances the experts, so that rank's expert activations and dispatch buffer are this much larger. 1.6 "
        "(default): the tiny Qwen3-MoE's measured worst layer (1.60 at one expert per rank; its router is untrained) "
        "and at least the 1.5x reported for dropless MoE; docs/planner.md says why. Measure your checkpoint with "
        "tools/gpu_check.py --only imbalance --moe-model PATH and set what it reports.")

# HF module names LoRA can target, and the Megatron linear each maps onto (actor/lora.py).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAConfig:
    """Low-rank adapters on the policy's attention and MLP projections (``model.lora.*``;
    actor/lora.py). The base weights are frozen; only the adapters train, checkpoint and export
    (as an HF peft adapter directory, weights/lora_export.py)."""

    rank: int = _f(0, ge=0, help="LoRA rank r (0 = off: full fine-tuning). Each targeted projection W gets "
                   "W x + (alpha / r) B A x with A [r, in] and B [out, r], as HF peft's LoraConfig(r=...).")
    alpha: Optional[float] = _f(None, gt=0.0, help="LoRA alpha (peft's lora_alpha); the adapter output is scaled "
                                "by alpha / rank. null (default) = 2 x rank.")
    dropout: float = _f(0.0, ge=0.0, lt=1.0, help="Dropout on the adapters' input (peft's lora_dropout), applied "
                        "in training forwards only (forwards with gradients), never to log-probs computed without "
                        "them. 0 (default) keeps the training forward's log-probs equal to the others'.")
    targets: list[str] = _f(factory=lambda: list(LORA_TARGETS), help="HF module names that get adapters (peft's "
                            "target_modules): any of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj "
                            "(default all). On an MoE model the MLP names put adapters on every expert and go together: "
                            "gate_proj, up_proj and down_proj, or none of them.")

    push: Literal["auto", "adapter", "merged"] = _f(
        "auto", help="How new weights reach the engines (weights/lora_push.py). adapter: the engines keep the base "
        "and load each version's adapter (SGLang --enable-lora, /load_lora_adapter): MBs a push instead of the "
        "model's GBs. merged: the adapters folded into the base (W + alpha/r B A) and pushed as full weights through "
        "rollout.weight_sync. auto (default): adapter, except merged with rollout.colocate=true (the in-node "
        "transfer carries full weights) and external producers (they load v<version> model directories).")

    adapter_transport: Literal["disk", "memory"] = _f(
        "disk", help="With push=adapter, how an adapter reaches the engines. disk: a peft directory per version "
        "(rollout.weight_sync_dir; engines on other nodes need it shared), /load_lora_adapter. memory: "
        "/load_lora_adapter_from_tensors with shared-memory handles, no file (engines on rank 0's node: "
        "rollout.launcher=local).")

    @property
    def scaling(self) -> float:
        """peft's ``lora_alpha / r`` (0 when off)."""
        return (self.alpha if self.alpha is not None else 2.0 * self.rank) / self.rank if self.rank else 0.0

    def validate(self) -> None:
        """Ranges, and targets among :data:`LORA_TARGETS` (ConfigError naming the unknown ones)."""
        check_ranges(self, "model.lora")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown:
            raise ConfigError(f"model.lora.targets has unknown module names {unknown}; allowed: "
                              f"{', '.join(LORA_TARGETS)}")
        if self.rank and not self.targets:
            raise ConfigError(f"model.lora.rank={self.rank} with model.lora.targets=[]: name at least one of "
                              f"{', '.join(LORA_TARGETS)}, or set model.lora.rank=0")
        if len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"model.lora.targets={self.targets} names a module twice")


@dataclass
class ModelConfig:
    """The policy model."""

    hf_path: str = _f("tiny", help="Local HF model directory (config.json, safetensors, tokenizer). "
                      "'tiny' builds/reuses the tiny CPU base model (tools/make_tiny_base.py).")
    dtype: Literal["float32", "bfloat16", "float16"] = _f(
        "float32", help="Parameter and compute dtype of the actor (bf16 on GPU).")
    tiny_cache_dir: str = _f("~/.cache/megatron_m2po/tiny_base",
                             help="Where the tiny base model is built and cached.")
    tiny_family: Literal["qwen2", "qwen3", "qwen3_moe", "qwen2_tools"] = _f(
        "qwen2", help="Family of the tiny base model (hf_path=tiny): qwen2, qwen3, qwen3_moe (the qwen3 "
        "base upcycled into 4 experts, top-2; standins/tiny_moe.py), or qwen2_tools (the qwen2 base fine-tuned to "
        "call a calculator on products, with a chat template with tools; standins/tiny_tools.py, docs/agentic.md).")
    attention_dropout: float = _f(0.0, ge=0.0, lt=1.0, help="Attention dropout (0 for RL).")
    hidden_dropout: float = _f(0.0, ge=0.0, lt=1.0, help="Hidden dropout (0 for RL).")
    moe: MoEConfig = field(default_factory=MoEConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def validate(self) -> None:
        """Field ranges (``model.*``, ``model.moe.*``), ``model.lora``; whether the model is MoE is checked
        when it is built."""
        check_ranges(self, "model")
        self.lora.validate()


@dataclass
class ParallelConfig:
    """Megatron-Core parallel layout. Data parallel size is world_size / (tp * pp * cp)."""

    tensor_parallel: int = _f(1, ge=1, help="Tensor (model) parallel size.")
    pipeline_parallel: int = _f(1, ge=1, help="Pipeline parallel size.")
    context_parallel: int = _f(1, ge=1, help="Context parallel size: every sequence is cut into 2 x CP chunks, "
                               "rank r holding chunks r and 2CP-1-r (Megatron's load-balanced split; sequences are "
                               "padded to a multiple of 2 x CP, x TP with sequence parallelism).")
    cp_comm_type: Literal["p2p", "all_gather", "a2a"] = _f(
        "p2p", help="How Transformer Engine's attention exchanges K/V over the context-parallel group on GPU "
        "(Megatron's TransformerConfig.cp_comm_type): p2p ring (overlaps compute), all_gather, or a2a "
        "(Ulysses-style head scatter, needs heads divisible by CP). Packed micro-batches need p2p. The CPU "
        "layer spec computes the same attention with an all-gather.")
    expert_parallel: int = _f(1, ge=1, help="Expert (model) parallel size, Megatron's expert_model_parallel_size: "
                              "each MoE layer's experts are split over this many ranks of the data-parallel "
                              "dimension (needs an MoE model; the expert count must be a multiple). world size must be "
                              "a multiple of expert_tensor_parallel x expert_parallel x pipeline_parallel.")
    expert_tensor_parallel: Optional[int] = _f(
        None, ge=1, help="Tensor parallel size inside each expert, Megatron's expert_tensor_parallel_size. null "
        "(default) = tensor_parallel, as Megatron defines it; the MoE intermediate size must be a multiple.")
    moe_token_dispatcher: Literal["alltoall", "allgather"] = _f(
        "alltoall", help="Megatron's MoE token dispatcher (moe_token_dispatcher_type): alltoall sends each token "
        "to the ranks of its experts only (the choice with expert parallelism); allgather gathers all tokens.")
    virtual_pipeline_parallel: Optional[int] = _f(None, ge=1, help="Interleaved pipeline chunks per rank.")
    sequence_parallel: bool = _f(False, help="Megatron sequence parallelism (needs TP > 1; micro-batch "
                                 "lengths are padded to a multiple of TP).")
    use_distributed_optimizer: bool = _f(False, help="Shard optimizer states over data-parallel ranks (ZeRO-1).")
    micro_batch_size: int = _f(1, ge=1, help="Sequences per micro-batch (when max_tokens_per_microbatch is not set).")
    packing: bool = _f(False, help="Concatenate the sequences of a micro-batch without padding (Megatron's THD "
                       "packed-sequence path: Transformer Engine attention on GPU, a per-sequence causal mask on CPU).")
    max_tokens_per_microbatch: Optional[int] = _f(None, ge=1, help="Token budget of a micro-batch: sequences are "
                                                  "grouped (longest first) while their rows (packed: the sum of lengths; "
                                                  "padded: sequences x longest) fit; a longer sequence gets its own "
                                                  "micro-batch. Unset = micro_batch_size sequences per micro-batch.")
    balance_data_parallel: bool = _f(True, help="Assign each update's sequences to data-parallel ranks so that their "
                                     "work (tokens and attention's quadratic term) is near-equal; false = contiguous "
                                     "shards. Results are identical either way.")
    recompute: Literal["none", "selective", "full"] = _f("none", help="Activation recomputation.")
    backend: Literal["auto", "nccl", "gloo"] = _f("auto", help="torch.distributed backend; auto = nccl with CUDA, gloo without.")
    logprob_chunk_rows: int = _f(2048, ge=1, help="Rows per chunk of the fused vocab-parallel log-prob.")
    logprob_tf32: bool = _f(True, help="On CUDA with bf16 / fp16 weights, the fused log-prob's matmuls run on TF32 "
                            "tensor cores (inputs exact, fp32 accumulation; 2.4-3.6x faster on H100, log-probs "
                            "within 1e-4 of fp32: parallel/logprobs.py). false = fp32 multiplies. No effect on CPU.")
    timeout_s: float = _f(1800.0, gt=0, help="Collective timeout for the training process groups.")

    def validate(self) -> None:
        """Field ranges, then the pairings of parallelisms Megatron-Core and Transformer Engine support."""
        check_ranges(self, "parallel")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ConfigError("parallel.sequence_parallel=true needs parallel.tensor_parallel > 1")
        if self.context_parallel > 1 and self.packing and self.cp_comm_type != "p2p":
            # TE 2.x runs THD (packed) attention with CP on the KV-P2P path only (its
            # tests/pytorch/attention/test_attention_with_cp.py skips THD for all_gather and a2a).
            raise ConfigError(f"parallel.packing=true with parallel.context_parallel={self.context_parallel} needs "
                              f"parallel.cp_comm_type='p2p' (Transformer Engine's packed attention with CP), "
                              f"got {self.cp_comm_type!r}")
        if self.expert_parallel > 1 and self.context_parallel > 1:
            # Neither is tested with the other: the equal micro-batch count MoE needs
            # (actor/moe_plan.py) is planned over data-parallel replicas, not over DP x CP.
            raise ConfigError(f"parallel.expert_parallel={self.expert_parallel} with parallel.context_parallel="
                              f"{self.context_parallel} is not supported yet; use one of the two")
        if self.expert_parallel > 1 and self.tensor_parallel > 1 and not self.sequence_parallel:
            # Megatron's MoELayer.forward refuses to train MoE with TP > 1 without SP, and its
            # ModelParallelConfig warns that EP x TP needs SP.
            raise ConfigError(f"parallel.expert_parallel={self.expert_parallel} with parallel.tensor_parallel="
                              f"{self.tensor_parallel} needs parallel.sequence_parallel=true (Megatron-Core trains MoE "
                              "layers with tensor parallelism only under sequence parallelism)")
        if self.virtual_pipeline_parallel is not None and self.pipeline_parallel == 1:
            raise ConfigError("parallel.virtual_pipeline_parallel needs parallel.pipeline_parallel > 1")

@dataclass
class OptimConfig:
    """Optimizer (Megatron's distributed-aware Adam) and schedule."""

    lr: float = _f(1e-6, gt=0.0, help="Learning rate.")
    min_lr: float = _f(0.0, ge=0.0, help="Floor of the schedule.")
    lr_schedule: Literal["constant", "cosine", "linear"] = _f("constant", help="Learning-rate schedule after warm-up.")
    warmup_updates: int = _f(0, ge=0, help="Linear warm-up, in optimizer updates.")
    adam_beta1: float = _f(0.9, ge=0.0, lt=1.0, help="AdamW beta1.")
    adam_beta2: float = _f(0.999, ge=0.0, lt=1.0, help="AdamW beta2.")
    adam_eps: float = _f(1e-8, gt=0.0, help="AdamW epsilon.")
    weight_decay: float = _f(0.01, ge=0.0, help="AdamW weight decay.")
    grad_clip: float = _f(1.0, ge=0.0, help="Global gradient-norm clip (0 = off).")

    def validate(self) -> None:
        check_ranges(self, "optim")
