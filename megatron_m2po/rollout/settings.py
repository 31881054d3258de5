"""The ``rollout`` config section (engines, launching, router, sampling, weight sync, FP8,
filters, producers) and its ``rollout.agentic`` sub-section.

Read by the engine launchers and the client (``rollout/``), the weight push (``weights/``) and
the rank-0 rollout service (``rollout_service/``); it imports only the settings machinery, so
any of them may import it. The rules that also involve ``trainer`` or ``algo`` live in
``megatron_m2po/config.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from megatron_m2po.utils.settings import ConfigError, check_ranges
from megatron_m2po.utils.settings import setting as _f

__all__ = ["AgenticConfig", "RolloutConfig"]

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
    colocate: bool = _f(False, help="Time-share the trainer's GPUs (docs/design.md §5, \"Colocated mode\"): the "
                        "engines sit on the trainer's GPUs (launcher=local: engine_gpu_ids defaults to them) and are "
                        "started with --enable-memory-saver; per step they generate while the trainer's parameters, "
                        "gradients and optimizer states are offloaded, then release weights and KV cache while it "
                        "trains, and take the new weights in place through /update_weights_from_tensor. Sets "
                        "rollout.weight_sync=colocated (from disk, the default; distributed is refused). Needs "
                        "trainer.mode=sync or stale_k (async: use disaggregated engines).")
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
    weight_sync: Literal["disk", "distributed", "colocated"] = _f(
        "disk", help="How weights reach the engines: 'disk' (safetensors in weight_sync_dir, each engine loads them), "
        "'distributed' (NCCL broadcast from every pipeline stage's sender), 'colocated' (memory handles to engines "
        "on the trainer's own GPUs, /update_weights_from_tensor; what rollout.colocate=true uses).")
    weight_sync_dir: str = _f("", help="Shared directory for disk weight sync (default: <run_dir>/weights).")
    weight_sync_bucket_mb: float = _f(512.0, gt=0, help="Bucket size of the distributed weight broadcast and of the colocated "
                                      "hand-over (one extra copy of this size on each sender).")
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
                           "exports block FP8 (SGLang 0.5.23 hot-reloads only block FP8; weights/fp8.py). Pair with "
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

    @property
    def has_engines(self) -> bool:
        """Whether the trainer has engines to sample with: external producers without
        ``external_addrs`` push their rollouts and leave it none."""
        return not (self.source == "external" and not self.external_addrs)

    def validate(self) -> None:
        """Field ranges (``rollout.*``, ``rollout.agentic.*``), then the pairings within the section."""
        check_ranges(self, "rollout")
        block = self.fp8_block_size
        if len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
            raise ConfigError(f"rollout.fp8_block_size={block!r}: give two positive ints [block_n, block_k] "
                              "(SGLang's weight_block_size; [128, 128] is the usual layout)")
        if self.launcher == "external" and not self.external_addrs and not self.router_addr:
            raise ConfigError("rollout.launcher=external needs rollout.external_addrs (or rollout.router_addr)")
        self._check_colocate()
        ag = self.agentic
        if self.producer == "agentic" and ":" not in ag.env:
            raise ConfigError(f"rollout.producer=agentic needs rollout.agentic.env='package.module:Name' (got "
                              f"rollout.agentic.env={ag.env!r}); see docs/agentic.md")
        if ag.env and self.producer != "agentic":
            raise ConfigError(f"rollout.agentic.env={ag.env!r} is only used with rollout.producer=agentic (got "
                              f"rollout.producer={self.producer!r})")
        if self.filter != "none" and self.n_samples_per_prompt < 2:
            raise ConfigError(f"rollout.filter={self.filter} with rollout.n_samples_per_prompt="
                              f"{self.n_samples_per_prompt}: a group of one sample always has equal rewards, "
                              "so every group would be dropped; use n_samples_per_prompt >= 2 or rollout.filter=none")
        if self.return_routed_experts and self.source == "engines" and (self.use_router or self.router_addr):
            # Measured: the pinned sglang-router 0.3.2 re-serialises /generate from a typed request that has no
            # return_routed_experts, so the engines never see it and answer without meta_info.routed_experts.
            raise ConfigError("rollout.return_routed_experts=true through sglang-router (rollout.use_router="
                              f"{self.use_router}, rollout.router_addr={self.router_addr!r}): the pinned sglang-router "
                              "0.3.2 drops return_routed_experts from /generate requests. Set rollout.use_router=false "
                              "and rollout.router_addr=null: the trainer then dispatches /generate over the engines "
                              "itself (any rollout.num_engines; external engines listed in rollout.external_addrs)")

    def _check_colocate(self) -> None:
        """``rollout.colocate=true`` time-shares the trainer's GPUs: the transport is ``colocated``
        (derived from ``disk``, the default; ``distributed`` refused: NCCL refuses an engine rank and a
        stage sender on one GPU, and the engines' weights are released while the trainer trains)."""
        if self.colocate:
            if self.source == "external" or self.launcher == "external":
                raise ConfigError(f"rollout.colocate=true with rollout.source={self.source}, rollout.launcher="
                                  f"{self.launcher}: colocated engines are the ones the trainer starts on its own "
                                  "GPUs; use rollout.launcher=local (or ray) and rollout.source=engines, or "
                                  "rollout.colocate=false")
            if self.weight_sync == "distributed":
                raise ConfigError("rollout.colocate=true with rollout.weight_sync=distributed: colocated engines "
                                  "take their weights in place from the trainer ranks on their own GPUs "
                                  "(rollout.weight_sync=colocated, which colocate sets from the default disk); "
                                  "NCCL refuses a group with two members on one GPU. Remove rollout.weight_sync or "
                                  "set it to colocated")
            self.weight_sync = "colocated"
        elif self.weight_sync == "colocated":
            raise ConfigError("rollout.weight_sync=colocated needs rollout.colocate=true (engines time-sharing the "
                              "trainer's GPUs); disaggregated engines use rollout.weight_sync=disk or distributed")
