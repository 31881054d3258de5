"""One typed configuration tree for the whole product.

A run is described by a YAML file whose top-level keys are the sections below (``model``,
``parallel``, ``algo``, ``optim``, ``rollout``, ``store``, ``data``, ``reward``, ``trainer``,
``checkpoint``, ``logging``), plus dotted command-line overrides::

    m2po train examples/tiny_cpu.yaml algo.m2po.threshold=0.02 trainer.mode=stale_k

Every field carries its documentation (``help``) and, where it has one, its allowed range or
choices in the dataclass field metadata. Loading validates every field and the cross-field
rules; a violation raises :class:`ConfigError` (a ``ValueError``) naming the dotted key, the
value and what is allowed. Nothing in the library reads global arguments: components receive
the section they need.

Example:
    >>> cfg = load_config(None, ["algo.m2po.threshold=0.02", "trainer.mode=sync"])
    >>> cfg.algo.m2po.threshold
    0.02
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from megatron_m2po.algo.loss_settings import (AReaLM2POConfig, CISPOConfig, GRPOConfig, GSPOConfig, IcePopConfig,
                                             KLConfig, M2POConfig, MISConfig, VCPOConfig)

__all__ = [
    "ConfigError",
    "ModelConfig",
    "MoEConfig",
    "ParallelConfig",
    "AlgoConfig",
    "OptimConfig",
    "AgenticConfig",
    "RolloutConfig",
    "StoreConfig",
    "DataConfig",
    "RewardConfig",
    "TrainerConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "M2POConfig",
    "GRPOConfig",
    "GSPOConfig",
    "CISPOConfig",
    "IcePopConfig",
    "MISConfig",
    "AReaLM2POConfig",
    "VCPOConfig",
    "Config",
    "load_config",
    "config_from_dict",
    "config_to_dict",
    "apply_overrides",
    "dump_config",
    "settings_from_dict",
]


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type, or out of its allowed range."""


def _f(default: Any = dataclasses.MISSING, *, help: str, ge: float | None = None,
       gt: float | None = None, le: float | None = None, lt: float | None = None,
       factory: Any = None) -> Any:
    """A dataclass field with documentation and an optional numeric range."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


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


@dataclass
class AlgoConfig:
    """Policy loss and advantage estimation (docs/design.md §3).

    ``loss`` names an entry of the loss registry (``algo/losses.py``); a loss's own settings live
    in its section (``algo.m2po.*``, ``algo.grpo.*``, ``algo.gspo.*``, ``algo.cispo.*``, ``algo.icepop.*``,
    ``algo.mis.*``, ``algo.areal_m2po.*``, ``algo.vcpo.*``), or, for a
    plugin loss that declares a settings dataclass, in ``algo.loss_options``.
    """

    loss: str = _f("m2po", help="Policy loss: a name registered with megatron_m2po.algo.losses.register_loss "
                   "(built in: m2po, grpo, no_tr, gspo, cispo, icepop, mis, areal_m2po, vcpo; algo.plugins may "
                   "register more).")
    plugins: list[str] = _f(factory=list, help="Modules imported when the config is validated (dotted paths, e.g. "
                            "my_pkg.losses), so that their register_loss calls run.")
    m2po: M2POConfig = field(default_factory=M2POConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    gspo: GSPOConfig = field(default_factory=GSPOConfig)
    cispo: CISPOConfig = field(default_factory=CISPOConfig)
    icepop: IcePopConfig = field(default_factory=IcePopConfig)
    mis: MISConfig = field(default_factory=MISConfig)
    areal_m2po: AReaLM2POConfig = field(default_factory=AReaLM2POConfig)
    vcpo: VCPOConfig = field(default_factory=VCPOConfig)
    kl: KLConfig = field(default_factory=KLConfig)  # reference-model KL, any loss (algo/kl.py)
    loss_options: dict[str, Any] = _f(factory=dict, help="Settings of a plugin loss, checked against the settings "
                                      "dataclass it registered (built-in losses read algo.<loss>.*).")
    logratio_clamp: float = _f(20.0, gt=0.0, help="log(pi_theta / pi_behav) is clamped to [-c, c] before exp.")
    tis: bool = _f(False, help="Truncated importance sampling weight min(p_train_behav / p_engine_behav, C) (paper eq. 6).")
    tis_cap: float = _f(2.0, gt=0.0, help="C of the TIS weight.")
    recompute_behav_logprobs: bool = _f(False, help="Recompute behaviour log-probs with the trainer at generation time "
                                        "(enables TIS and the mismatch KL).")
    advantage: Literal["grpo", "grpo_no_std"] = _f("grpo", help="Advantage estimator: GRPO group normalisation.")
    adv_eps: float = _f(1e-6, gt=0.0, help="Added to the group std in the GRPO advantage.")
    entropy_coef: float = _f(0.0, ge=0.0, help="Entropy bonus coefficient.")
    routing_replay: Literal["none", "rollout"] = _f(
        "none", help="MoE routing replay (R3): 'rollout' replays the experts the engine's routers picked for every "
        "token (rollout.return_routed_experts) in the trainer's forwards that compute log-probs and gradients, "
        "instead of routing with the trainer's router (docs/moe.md).")


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


@dataclass
class AgenticConfig:
    """Multi-turn episodes (``rollout.producer=agentic``; megatron_m2po/rollout/episodes.py, docs/agentic.md).

    Each sample is one episode: the model's turns are generated through the engines (the whole
    conversation so far sent as input_ids, so the engine's prefix cache reuses it), the
    environment's observations are appended with loss_mask 0, and the whole episode is stored
    as one trajectory.
    """

    env: str = _f("", help="Environment class or factory, 'package.module:Name', called as Name(**env_args) once per "
                  "episode; it implements megatron_m2po.rollout.episodes.Environment (async reset / step / close).")
    env_args: dict[str, Any] = _f(factory=dict, help="Keyword arguments of the environment factory.")
    format: Literal["auto", "chat", "raw"] = _f(
        "auto", help="How turns become tokens: 'chat' renders the first prompt and every observation with the "
        "tokenizer's own chat template (apply_chat_template with the environment's tools); 'raw' uses the dataset's "
        "prompt and the observation text as is; 'auto' = chat when the tokenizer has a chat template, else raw.")
    max_turns: int = _f(4, ge=1, help="Model turns per episode; an episode still running after them ends "
                        "(finish_reason 'length', metrics rollout/episode_end/max_turns).")
    max_episode_tokens: int = _f(4096, ge=1, help="Response tokens per episode (model turns + observations); a turn "
                                 "gets at most what is left (and at most rollout.max_new_tokens).")
    max_context_tokens: int = _f(32768, ge=2, help="Prompt + response tokens an episode may reach (the engine's "
                                 "context length); the episode ends when the next turn would not fit.")
    step_timeout_s: float = _f(60.0, gt=0, help="Timeout of one environment step (a tool call); on expiry the step "
                               "is cancelled, the environment closed (its processes killed) and the episode ends "
                               "with timeout_reward.")
    episode_timeout_s: float = _f(3600.0, gt=0, help="Wall-clock limit of a whole episode (generation and steps); "
                                  "on expiry the episode ends with timeout_reward, keeping the tokens so far.")
    reset_timeout_s: float = _f(60.0, gt=0, help="Timeout of the environment's reset (an expired reset is an error).")
    timeout_reward: float = _f(0.0, help="Reward of an episode that hit step_timeout_s or episode_timeout_s "
                               "(counted: rollout/episode_end/step_timeout, .../episode_timeout).")
    error_reward: float = _f(0.0, help="Reward of an episode whose environment raised in reset or step (a fault of the "
                             "environment's code in one episode: the episode ends keeping its tokens, counted as "
                             "rollout/episode_end/env_error, the error's last line logged once per distinct error, and "
                             "the run goes on).")
    max_consecutive_env_errors: int = _f(64, ge=1, help="Episodes in a row ending in an environment error (none "
                                         "finishing in between) that stop the run with the environment's name and "
                                         "error: the environment fails everywhere, not in one episode.")


@dataclass
class RolloutConfig:
    """Rollout engines and sampling."""

    source: Literal["engines", "external"] = _f(
        "engines", help="Where trajectories come from: our engines + producer, or external producers that push to "
                        "the store's HTTP ingestion (served by the trainer; needs trainer.mode=async).")
    engine: Literal["cpu_worker", "sglang"] = _f("cpu_worker", help="Engine kind: SGLang on GPU, the CPU worker otherwise.")
    launcher: Literal["local", "ray", "external"] = _f("local", help="Engines as local subprocesses, Ray actors, or given by address.")
    num_engines: int = _f(1, ge=0, help="Number of engines to launch (ignored for external).")
    engine_tp: int = _f(1, ge=1, help="Tensor parallel size of each SGLang engine.")
    engine_mem_fraction: float = _f(0.7, gt=0.0, le=1.0, help="SGLang --mem-fraction-static.")
    engine_gpu_ids: list[int] = _f(factory=list, help="launcher=local: the node's GPUs for the engines, engine_tp per "
                                   "engine in order; empty = the GPUs after the trainer's (LOCAL_WORLD_SIZE ..).")
    colocate: bool = _f(False, help="launcher=local: engine_gpu_ids may include the trainer's GPUs (engines share them, "
                        "holding engine_mem_fraction); without it such a list is refused.")
    ray_cpus_per_engine: float = _f(1.0, ge=0.0, help="launcher=ray: CPUs each engine actor reserves (GPUs = engine_tp for sglang).")
    external_addrs: list[str] = _f(factory=list, help="http://host:port of engines started elsewhere (launcher=external).")
    use_router: bool = _f(True, help="Put sglang-router (cache_aware policy) in front of the engines. false: the "
                          "trainer's client dispatches /generate over the engines itself (rollout/dispatch.py: a "
                          "prompt group on one engine, else least in-flight requests; failed engines skipped), "
                          "needed for return_routed_experts, which sglang-router 0.3.2 drops.")
    router_addr: Optional[str] = _f(None, help="Attach to an existing router at this address instead of starting one.")
    host: str = _f("127.0.0.1", help="Bind address of locally launched engines and router.")
    base_port: int = _f(30000, ge=0, le=65000, help="First port for engines; the router takes base_port - 1. 0 = pick free ports.")
    n_samples_per_prompt: int = _f(8, ge=1, help="Samples per prompt (GRPO group size).")
    max_new_tokens: int = _f(1024, ge=1, help="Maximum response length.")
    temperature: float = _f(1.0, gt=0.0, help="Sampling temperature (the trainer divides logits by it too).")
    top_p: float = _f(1.0, gt=0.0, le=1.0, help="Nucleus sampling.")
    concurrency: Optional[int] = _f(
        None, ge=1, help="In-flight generate requests of the trainer's client over the whole fleet. null (default): "
        "derived from the fleet, the sum over engines of what each reports it can run (/server_info, SGLang 0.5.23: "
        "internal_states[*].effective_max_running_requests_per_dp), re-derived when engines join or leave; an engine "
        "that reports nothing counts as 64 (with a warning). An integer is used as given.")
    engine_max_running_requests: Optional[int] = _f(
        None, ge=1, help="--max-running-requests of each engine the trainer launches (null: SGLang sizes it from "
        "KV-cache memory, the CPU worker runs 64). rollout.concurrency=null then derives from what they report.")
    request_timeout_s: float = _f(600.0, gt=0, help="Timeout of one generate request.")
    max_retries: int = _f(3, ge=0, help="Retries with backoff for failed requests.")
    weight_sync: Literal["disk", "distributed"] = _f("disk", help="How weights reach the engines.")
    weight_sync_dir: str = _f("", help="Shared directory for disk weight sync (default: <run_dir>/weights).")
    weight_sync_bucket_mb: float = _f(512.0, gt=0, help="Bucket size of the distributed weight broadcast.")
    weight_sync_timeout_s: float = _f(300.0, gt=0, help="Timeout of a weight update (a dead engine cannot hang training); "
                                      "a disk push's load gets more for a large model (weight_sync_min_gbps).")
    weight_sync_min_gbps: float = _f(
        0.2, gt=0, help="Slowest disk read (GB/s) a disk weight push is allowed: the engines' load of a push of B bytes "
        "times out after weight_sync_timeout_s + B / (this x 1e9) (rollout/push_timeout.py; 64 GB of a 32B model: "
        "300 + 320 s). 0.2 = a 10 GbE NFS share split among a few nodes; measure yours with tools/gpu_check.py "
        "--only disk_push.")
    producer: str = _f("megatron_m2po.rollout.producer:default_producer",
                       help="Rollout producer, 'module:function' (slime-style custom rollout functions allowed), or "
                            "'agentic': multi-turn episodes with the environment of rollout.agentic.")
    agentic: AgenticConfig = field(default_factory=AgenticConfig)
    fp8_weights: bool = _f(False, help="Serve FP8: engines start from a block-FP8 export of the base model and every push "
                           "exports block FP8 (SGLang 0.5.23 hot-reloads only block FP8; rollout/fp8.py). Pair with "
                           "algo.recompute_behav_logprobs=true and algo.tis=true.")
    filter: Literal["none", "zero_variance"] = _f(
        "none", help="Dynamic sampling (DAPO): 'zero_variance' drops groups whose rewards are all equal (zero GRPO "
        "advantage: no gradient) before they reach the store's training queue, counted in rollout/filtered_groups, "
        "and generates more prompts so every step still trains on trainer.prompts_per_step groups "
        "(docs/design.md §3a). External producers: dropped at ingestion (acknowledged, not stored).")
    filter_max_rounds: int = _f(
        8, ge=0, help="rollout.filter: a step generates its own prompts and at most this many over-sampling rounds "
        "(each at most trainer.prompts_per_step prompts) before the run stops with an error naming the step; "
        "async: at most (1 + this) x prompts_per_step groups generated per step leased.")
    return_routed_experts: bool = _f(False, help="Ask the engines for the top-k expert ids of every MoE layer per "
                                     "token (SGLang's return_routed_experts; engines are started with "
                                     "--enable-return-routed-experts) and keep them with each trajectory. Needs "
                                     "rollout.use_router=false (the client dispatches over any number of "
                                     "engines): sglang-router 0.3.2 drops the request field.")
    fp8_block_size: list[int] = _f(factory=lambda: [128, 128],
                                   help="FP8 weight_block_size [block_n, block_k]; both sizes of every decoder linear must "
                                        "be multiples (SGLang refuses fused / tensor-parallel partitions that are not).")


@dataclass
class StoreConfig:
    """The staleness-tagged rollout store.

    The consumption policy follows ``trainer.mode``: sync and stale_k lease exactly the groups
    generated for the step (exact stale-k); async leases under the bounded policy configured by
    ``max_staleness``, ``order`` and ``retire_overage``.
    """

    path: str = _f("", help="SQLite file (default: <run_dir>/rollouts.sqlite).")
    max_staleness: int = _f(256, ge=0, help="Data older than this many updates is never trained on.")
    retire_overage: bool = _f(False, help="async: retire (and count) over-age data instead of raising.")
    order: Literal["oldest", "freshest"] = _f("oldest", help="async: which available groups the bounded policy serves first.")
    synchronous: Literal["FULL", "NORMAL"] = _f("FULL", help="SQLite synchronous setting (FULL: an acknowledged group survives power loss).")
    serve_host: str = _f("127.0.0.1", help="Bind address of `m2po store serve`.")
    serve_port: int = _f(8765, ge=0, le=65535, help="Port of `m2po store serve` (0 = any free port).")
    token_env: str = _f("M2PO_STORE_TOKEN", help="Environment variable holding the ingestion bearer token.")
    token_file: str = _f("", help="File holding the ingestion bearer token (used when the env var is unset).")
    max_request_mb: float = _f(256.0, gt=0, help="Largest accepted ingestion request.")


@dataclass
class DataConfig:
    """Prompt datasets."""

    train: str = _f("synthetic", help="'synthetic' (arithmetic task) or a local .jsonl / .parquet file in the DeepScaleR schema.")
    eval: list[str] = _f(factory=list, help="Benchmark files (same schema) for `m2po eval` and held-out accuracy.")
    template: Literal["paper", "chat", "raw", "synthetic"] = _f(
        "paper", help="Prompt template: the paper's, the paper's text inside the tokenizer's chat template, the problem "
        "as is, or '{problem}=' (the tiny base model's warm-up format; megatron_m2po/data/templates.py).")
    max_prompt_tokens: int = _f(1024, ge=1, help="Longer prompts are rejected at load with their index.")
    drop_long_prompts: bool = _f(False, help="Drop (and count) prompts longer than max_prompt_tokens instead of raising.")
    synthetic_num_problems: int = _f(20000, ge=1, help="Size of the synthetic training set.")
    synthetic_min_operand: int = _f(0, ge=0, help="Synthetic task: smallest operand.")
    synthetic_max_operand: int = _f(20, ge=1, help="Synthetic task: largest operand.")
    synthetic_num_operands: int = _f(2, ge=2, help="Synthetic task: operands per problem.")
    synthetic_ops: str = _f("+-", help="Synthetic task: operators drawn from these characters (+-*).")
    synthetic_eval_size: int = _f(256, ge=0, help="Held-out synthetic problems for evaluation.")
    shuffle: bool = _f(True, help="Shuffle deterministically per epoch.")


@dataclass
class RewardConfig:
    """Reward function (docs/design.md §3, paper appendix B)."""

    fn: str = _f("math", help="'math' (math-verify), 'http' (a reward model server at reward.url) or a custom "
                 "'module:function' (per item or @batch_reward; may be 'async def').")
    correct: float = _f(1.0, help="Reward of a verified-correct final answer.")
    wrong: float = _f(0.1, help="Reward of an extracted but wrong answer.")
    no_answer: float = _f(0.0, help="Reward when no \\boxed{} answer is found.")
    timeout_s: float = _f(5.0, gt=0, help="Per-response scoring timeout (a timeout scores no_answer and is counted).")
    num_workers: int = _f(2, ge=1, help="Scoring processes.")
    url: str = _f("", help="reward.fn=http: the reward server's endpoint (http://host:port/path), POSTed "
                  '{"responses": [...], "answers": [...]} and answering {"scores": [...]} (rewards/http.py).')
    batch_size: int = _f(64, ge=1, help="reward.fn=http: responses per request.")
    max_concurrency: int = _f(4, ge=1, help="reward.fn=http: requests in flight at once.")
    request_timeout_s: float = _f(60.0, gt=0, help="reward.fn=http: deadline of one request; after the retries a "
                                  "timed-out batch scores no_answer and is counted (reward/n_timeouts).")
    max_retries: int = _f(2, ge=0, help="reward.fn=http: extra attempts of a request that cannot connect, times out "
                          "or gets 429 / 5xx (backoff 0.5 s, 1 s, ...); a server still unreachable stops the run.")


@dataclass
class TrainerConfig:
    """The training loop (docs/design.md §3)."""

    mode: Literal["sync", "stale_k", "async"] = _f("stale_k", help="sync (on-policy), stale_k (controlled staleness), async (bounded lag).")
    stale_k: int = _f(0, ge=0, help="Staleness k of stale_k mode (updates between generation and first use).")
    num_steps: int = _f(100, ge=1, help="Training steps (each does num_updates_per_step optimizer updates).")
    prompts_per_step: int = _f(256, ge=1, help="Prompts per training step (x n_samples_per_prompt trajectories).")
    prompts_per_update: int = _f(64, ge=1, help="Prompts per optimizer mini-batch.")
    sync_every_updates: int = _f(1, ge=1, help="async: push weights to the engines every N optimizer updates.")
    seed: int = _f(1234, help="Global seed (data order, sampling, init).")
    run_dir: str = _f("runs/default", help="Output directory: metrics, checkpoints, store, weights.")
    eval_every_steps: int = _f(0, ge=0, help="Held-out evaluation every N steps (0 = off).")
    eval_samples: int = _f(1, ge=1, help="Samples per held-out problem (avg@k).")
    wait_timeout_s: float = _f(3600.0, ge=1, help="Longest the trainer waits for data (a step's rollouts, a "
                               "generation, an evaluation) before it fails with a message naming what it waited for; "
                               "SIGINT / SIGTERM end such a wait at once.")

    @property
    def num_updates_per_step(self) -> int:
        return self.prompts_per_step // self.prompts_per_update


@dataclass
class CheckpointConfig:
    """Checkpointing (Megatron distributed checkpoint + extra state)."""

    dir: str = _f("", help="Checkpoint directory (default: <run_dir>/checkpoints).")
    save_every_steps: int = _f(10, ge=0, help="Save every N steps (0 = only at the end and on a signal).")
    keep_last: int = _f(2, ge=1, help="Checkpoints kept on disk.")
    resume: bool = _f(True, help="Resume from the newest complete checkpoint when one exists.")
    export_hf_at_end: bool = _f(True, help="Export HF safetensors of the final weights.")


@dataclass
class LoggingConfig:
    """Metrics sinks. JSONL and TensorBoard are always written."""

    wandb_project: str = _f("", help="Weights & Biases project (empty = off).")
    wandb_run_name: str = _f("", help="W&B run name.")
    progress: bool = _f(True, help="Rich progress display on rank 0.")
    dump_tokens_every: int = _f(0, ge=0, help="Write token-level data (entropy, log-ratio, advantage sign, staleness, "
                                "GRPO clip / M2PO mask decisions) of every N-th training step to "
                                "<run_dir>/tokens/step_NNNNNN.npz (0 = never); read by `m2po experiment entropy`.")
    access_log: bool = _f(False, help="Print aiohttp's access line of every request to the trainer's ingestion server "
                          "(rollout.source=external) on the console; off, requests are only counted "
                          "(server/requests in its GET /v1/stats).")
    dump_tokens_max: int = _f(200_000, ge=1, help="At most this many response tokens per dumped step (a seeded uniform "
                              "subset beyond it): bounds a dump to ~10 MB.")
    trace: bool = _f(False, help="Write <run_dir>/trace.json, a Chrome / Perfetto trace (open it in "
                     "https://ui.perfetto.dev) of every trainer rank's phases (pushes, waits for data, mask "
                     "pass, forward-backward, optimizer, checkpoints, evaluation), the driver's generation and "
                     "rewards, and the engines' load; each rank also leaves <run_dir>/trace/rank<R>.json. "
                     "Draw it with tools/plot_trace.py.")


@dataclass
class Config:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> "Config":
        """Cross-field rules; raises ConfigError naming the values."""
        for sect in dataclasses.fields(self):
            _validate_ranges(getattr(self, sect.name), sect.name)
        t, a, p = self.trainer, self.algo, self.parallel
        if t.prompts_per_step % t.prompts_per_update:
            raise ConfigError(
                f"trainer.prompts_per_step={t.prompts_per_step} must be a multiple of "
                f"trainer.prompts_per_update={t.prompts_per_update} (each step does a whole number of updates)")
        _check_loss(a)
        if a.tis and not a.recompute_behav_logprobs:
            raise ConfigError("algo.tis=true needs algo.recompute_behav_logprobs=true (TIS compares trainer and engine "
                              "behaviour log-probs)")
        if self.store.max_staleness < t.stale_k + t.num_updates_per_step - 1 and t.mode == "stale_k":
            raise ConfigError(
                f"store.max_staleness={self.store.max_staleness} is below the largest staleness stale_k produces "
                f"(trainer.stale_k + updates per step - 1 = {t.stale_k + t.num_updates_per_step - 1}); raise it")
        if p.sequence_parallel and p.tensor_parallel == 1:
            raise ConfigError("parallel.sequence_parallel=true needs parallel.tensor_parallel > 1")
        if p.context_parallel > 1 and p.packing and p.cp_comm_type != "p2p":
            # TE 2.x runs THD (packed) attention with CP on the KV-P2P path only (its
            # tests/pytorch/attention/test_attention_with_cp.py skips THD for all_gather and a2a).
            raise ConfigError(f"parallel.packing=true with parallel.context_parallel={p.context_parallel} needs "
                              f"parallel.cp_comm_type='p2p' (Transformer Engine's packed attention with CP), "
                              f"got {p.cp_comm_type!r}")
        if p.expert_parallel > 1 and p.context_parallel > 1:
            # Neither is tested with the other: the equal micro-batch count MoE needs
            # (actor/moe_plan.py) is planned over data-parallel replicas, not over DP x CP.
            raise ConfigError(f"parallel.expert_parallel={p.expert_parallel} with parallel.context_parallel="
                              f"{p.context_parallel} is not supported yet; use one of the two")
        if p.expert_parallel > 1 and p.tensor_parallel > 1 and not p.sequence_parallel:
            # Megatron's MoELayer.forward refuses to train MoE with TP > 1 without SP, and its
            # ModelParallelConfig warns that EP x TP needs SP.
            raise ConfigError(f"parallel.expert_parallel={p.expert_parallel} with parallel.tensor_parallel="
                              f"{p.tensor_parallel} needs parallel.sequence_parallel=true (Megatron-Core trains MoE "
                              "layers with tensor parallelism only under sequence parallelism)")
        if p.virtual_pipeline_parallel is not None and p.pipeline_parallel == 1:
            raise ConfigError("parallel.virtual_pipeline_parallel needs parallel.pipeline_parallel > 1")
        block = self.rollout.fp8_block_size
        if len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
            raise ConfigError(f"rollout.fp8_block_size={block!r}: give two positive ints [block_n, block_k] "
                              "(SGLang's weight_block_size; [128, 128] is the usual layout)")
        if self.rollout.launcher == "external" and not self.rollout.external_addrs and not self.rollout.router_addr:
            raise ConfigError("rollout.launcher=external needs rollout.external_addrs (or rollout.router_addr)")
        if self.rollout.source == "external" and t.mode != "async":
            raise ConfigError(f"rollout.source=external needs trainer.mode=async (got {t.mode!r}): external "
                              "producers push whenever they like, so the store serves under store.max_staleness")
        if t.mode == "async" and a.recompute_behav_logprobs:
            raise ConfigError("algo.recompute_behav_logprobs=true needs trainer.mode=sync or stale_k: in async mode the "
                              "trainer's weights are not the ones that generated the data")
        ag = self.rollout.agentic
        if self.rollout.producer == "agentic" and ":" not in ag.env:
            raise ConfigError(f"rollout.producer=agentic needs rollout.agentic.env='package.module:Name' (got "
                              f"rollout.agentic.env={ag.env!r}); see docs/agentic.md")
        if ag.env and self.rollout.producer != "agentic":
            raise ConfigError(f"rollout.agentic.env={ag.env!r} is only used with rollout.producer=agentic (got "
                              f"rollout.producer={self.rollout.producer!r})")
        rw = self.reward
        if rw.fn.strip() == "http" and not rw.url.startswith(("http://", "https://")):
            raise ConfigError(f"reward.fn=http needs reward.url=http://host:port/path of the reward server (got "
                              f"reward.url={rw.url!r})")
        if rw.url and rw.fn.strip() != "http":
            raise ConfigError(f"reward.url={rw.url!r} is only read with reward.fn=http (got reward.fn={rw.fn!r})")
        if self.rollout.filter != "none" and self.rollout.n_samples_per_prompt < 2:
            raise ConfigError(f"rollout.filter={self.rollout.filter} with rollout.n_samples_per_prompt="
                              f"{self.rollout.n_samples_per_prompt}: a group of one sample always has equal rewards, "
                              "so every group would be dropped; use n_samples_per_prompt >= 2 or rollout.filter=none")
        if self.rollout.n_samples_per_prompt == 1 and a.advantage.startswith("grpo"):
            raise ConfigError("rollout.n_samples_per_prompt=1 gives GRPO groups of one sample (all advantages 0); use >= 2")
        _check_routing_replay(self)
        return self

    # Convenience paths derived from run_dir.
    def resolved_path(self, value: str, default_name: str) -> Path:
        return Path(os.path.expanduser(value)) if value else Path(self.trainer.run_dir) / default_name


# --------------------------------------------------------------------------------------------
# Loading, overrides, validation
# --------------------------------------------------------------------------------------------


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML value to the annotated type, or raise naming the key."""
    optional, inner = _is_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: null is not allowed (expected {_type_name(tp)})")
    tp = inner
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of {list(choices)}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping (key: value)")
        return dict(value)
    if origin in (list, tuple):
        (elem,) = typing.get_args(tp)[:1] or (Any,)
        if isinstance(value, str):  # "a,b" from the command line
            value = [v for v in value.split(",") if v] if value else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} must be a list")
        return [_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}={value!r} must be a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be a string")
        return str(value)
    if tp is Any:
        return value
    raise TypeError(f"unsupported config type {tp} at {key}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _validate_ranges(section: Any, prefix: str) -> None:
    for f in dataclasses.fields(section):
        v = getattr(section, f.name)
        key = f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(v):
            _validate_ranges(v, key)
            continue
        if v is None or isinstance(v, (bool, str, list, dict)):
            continue
        m = f.metadata
        bounds = [("ge", lambda a, b: a >= b, ">="), ("gt", lambda a, b: a > b, ">"),
                  ("le", lambda a, b: a <= b, "<="), ("lt", lambda a, b: a < b, "<")]
        for name, ok, sym in bounds:
            b = m.get(name)
            if b is not None and not ok(v, b):
                raise ConfigError(f"{key}={v!r} is out of range: must be {sym} {b} ({m.get('help', '')})")


# Keys that moved or went away: an old YAML file or override gets told what to write instead.
_MOVED = {
    "algo.m2_threshold": "algo.m2po.threshold", "algo.m2_rule": "algo.m2po.rule", "algo.m2_scope": "algo.m2po.scope",
    "algo.eps_low": "algo.grpo.eps_low", "algo.eps_high": "algo.grpo.eps_high", "algo.dual_clip_c": "algo.grpo.dual_clip",
    "algo.gspo_eps_low": "algo.gspo.eps_low", "algo.gspo_eps_high": "algo.gspo.eps_high",
    "algo.cispo_eps_high": "algo.cispo.eps_high",
}
_REMOVED = {
    "store.policy": "the trainer mode picks the consumption policy (sync / stale_k: exact stale-k; async: bounded "
                    "by store.max_staleness, store.order, store.retire_overage); delete the key",
    "logging.log_every_updates": "every optimizer update writes one metrics record; delete the key",
}


def _unknown_key(key: str, names, full: str | None = None) -> str:
    """The error text for an unknown dotted ``key`` (``full``: the whole override key)."""
    full = full or key
    if key in _MOVED:
        return f"config key {full} was renamed to {_MOVED[key]}{full[len(key):]}"
    if key in _REMOVED:
        return f"config key {full} was removed: {_REMOVED[key]}"
    prefix, _, leaf = key.rpartition(".")
    moved = {k.rpartition(".")[2]: v for k, v in _MOVED.items() if k.rpartition(".")[0] == prefix}
    near = difflib.get_close_matches(leaf, list(names) + list(moved), n=1)
    if near:
        hint = f"; did you mean {moved.get(near[0]) or '.'.join(filter(None, [prefix, near[0]]))}?"
    else:
        hint = f"; keys under {prefix or '<top>'}: {sorted(names)}"
    return f"unknown config key {full}{hint}"


def _section_from_dict(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        if k not in names:
            raise ConfigError(_unknown_key(f"{prefix}.{k}" if prefix else str(k), names))
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            kwargs[k] = _section_from_dict(tp, v or {}, f"{prefix}.{k}" if prefix else k)
        else:
            kwargs[k] = _coerce(v, tp, f"{prefix}.{k}" if prefix else k)
    return cls(**kwargs)


def settings_from_dict(cls: type, data: dict, prefix: str) -> Any:
    """A settings dataclass (e.g. a plugin loss's) from a mapping, with the checks of the config tree:
    unknown keys (did-you-mean), types, ``ge``/``gt``/``le``/``lt`` metadata and ``check()``."""
    obj = _section_from_dict(cls, data or {}, prefix)
    _validate_ranges(obj, prefix)
    try:
        if hasattr(obj, "check"):
            obj.check()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return obj


def _check_routing_replay(c: "Config") -> None:
    """``algo.routing_replay=rollout`` needs the engines' routed experts, an MoE model (checked when the model
    is built: ``actor/model.py``). Full recompute replays the backward FIFO (``actor/routing_replay.py``)."""
    a, m, r = c.algo, c.model, c.rollout
    if r.return_routed_experts and r.source == "engines" and (r.use_router or r.router_addr):
        # Measured: the pinned sglang-router 0.3.2 re-serialises /generate from a typed request that has no
        # return_routed_experts, so the engines never see it and answer without meta_info.routed_experts.
        raise ConfigError("rollout.return_routed_experts=true through sglang-router (rollout.use_router="
                          f"{r.use_router}, rollout.router_addr={r.router_addr!r}): the pinned sglang-router 0.3.2 "
                          "drops return_routed_experts from /generate requests. Set rollout.use_router=false and "
                          "rollout.router_addr=null: the trainer then dispatches /generate over the engines itself "
                          "(any rollout.num_engines; external engines listed in rollout.external_addrs)")
    if a.routing_replay == "none":
        return
    if not c.rollout.return_routed_experts:
        raise ConfigError("algo.routing_replay=rollout replays the experts the engines picked: it needs "
                          "rollout.return_routed_experts=true")
    if m.hf_path == "tiny" and m.tiny_family != "qwen3_moe":
        raise ConfigError(f"algo.routing_replay=rollout needs an MoE model; model.hf_path=tiny with "
                          f"model.tiny_family={m.tiny_family!r} is dense (use model.tiny_family=qwen3_moe)")


def _check_loss(a: AlgoConfig) -> None:
    """``algo.loss`` names a registered loss (after importing ``algo.plugins``); its settings are valid."""
    from megatron_m2po.algo import losses  # the registry; imports torch, so only when validating

    try:
        losses.load_plugins(a.plugins)
    except ValueError as e:
        raise ConfigError(str(e)) from e.__cause__
    try:
        spec = losses.get_loss(a.loss)
    except ValueError as e:
        raise ConfigError(f"algo.loss={a.loss!r}: {e}") from None
    if a.loss_options and (spec.settings is None or isinstance(getattr(a, spec.name, None), spec.settings)):
        where = f"it reads algo.{spec.name}.*" if spec.settings is not None else "it has no settings"
        raise ConfigError(f"algo.loss_options={a.loss_options!r} is only read by a plugin loss that registers a "
                          f"settings dataclass; loss {a.loss!r} ignores it ({where})")
    if spec.settings is not None and not isinstance(getattr(a, spec.name, None), spec.settings):
        # a plugin's settings: checked like the rest of the tree, then stored complete and coerced
        a.loss_options = dataclasses.asdict(settings_from_dict(spec.settings, a.loss_options, "algo.loss_options"))
    settings = losses.loss_settings(spec, a)
    try:
        if hasattr(settings, "check"):
            settings.check()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def config_from_dict(data: dict | None) -> Config:
    """Build and validate a Config from a nested dict (YAML content)."""
    return _section_from_dict(Config, data or {}, "").validate()


def config_to_dict(cfg: Any) -> dict:
    """Nested plain dict of a config (for YAML dumps and checkpoints)."""
    return dataclasses.asdict(cfg)


def _set_dotted(data: dict, dotted: str, raw: str) -> None:
    parts = dotted.split(".")
    node: Any = data
    cls: Any = Config
    for i, p in enumerate(parts):
        names = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if p not in names:
            raise ConfigError(_unknown_key(".".join(parts[:i + 1]), names, dotted))
        tp = typing.get_type_hints(cls)[p]
        if typing.get_origin(tp) is dict and i < len(parts) - 1:  # a free mapping: a.b.<key>[.<key>]=value
            for q in parts[i:-1]:
                if not isinstance(node.get(q), dict):
                    node[q] = {}
                node = node[q]
            node[parts[-1]] = yaml.safe_load(raw) if raw != "" else None
            return
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(tp):
                raise ConfigError(f"{dotted} is a section; override one of its fields, e.g. {dotted}.<field>=...")
            optional, inner = _is_optional(tp)
            if inner is str:  # keep strings verbatim ("007" stays "007")
                node[p] = None if optional and raw.lower() in ("null", "none", "~") else raw
            else:
                node[p] = yaml.safe_load(raw) if raw != "" else None
        else:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
            cls = tp


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b=value`` overrides to a nested dict; values parse as YAML scalars."""
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} must look like section.key=value (e.g. algo.m2po.threshold=0.02)")
        key, raw = ov.split("=", 1)
        _set_dotted(data, key.strip(), raw.strip())
    return data


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config file (or the defaults when path is None) and apply dotted overrides."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections, got {type(data).__name__}")
    apply_overrides(data, list(overrides or []))
    return config_from_dict(data)


def dump_config(cfg: Config) -> str:
    """YAML text of a resolved config."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every field, for `m2po config --help`-style listings."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows += describe(hints[f.name], key + ".")
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            rows.append((key, repr(default), f.metadata.get("help", "")))
    return rows
