"""Build Megatron-Core GPT models from local Hugging Face directories (through mbridge).

Supported families: Qwen2 / Qwen2.5 (``qwen2``), Qwen3 (``qwen3``, qk-norm), Llama 3
(``llama``) and Qwen3-MoE (``qwen3_moe``: Megatron's MoE layer, expert and expert-tensor parallel,
router settings from ``model.moe``). mbridge supplies the HF -> Megatron name mapping, QKV / gate-up fusion and TP
splitting; this module adds what it lacks:

* the layer spec: Transformer Engine's, built by megatron-core's own spec functions, with TE's
  modules when TE is importable (GPU) and their CPU twins otherwise
  (:mod:`~megatron_m2po.actor.te_twin`: the norms fused into ``linear_qkv`` / ``linear_fc1``,
  experts as ``TEGroupedMLP``), so both builds have one module tree and mbridge's own name
  mapping serves both;
* ``rope_theta`` copied from ``rope_parameters`` (transformers >= 5 moved it there);
* tied embeddings handled for every family (mbridge's Llama bridge ignores them, and its Qwen2
  bridge mutates a class-level dict, so each bridge here gets its own mapping tables);
* a ``GPTModel`` whose last stage returns the final-normed hidden states instead of logits: the
  actor applies the vocab-parallel output weight only to response rows
  (``parallel/logprobs.py``), so ``[tokens, vocab]`` logits are never materialised.

:func:`build_transformer_config` is the one place that turns our config into Megatron's
``TransformerConfig``; nothing else in the package sets Megatron model flags.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

import torch

from megatron_m2po.config import Config
from megatron_m2po.utils.settings import ConfigError

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "MOE_MODEL_TYPES",
    "is_moe",
    "HIDDEN_STATES_OUTPUT",
    "have_transformer_engine",
    "load_hf_config",
    "make_bridge",
    "build_transformer_config",
    "build_model",
    "output_weight",
    "iter_hf_weights",
    "TOKENIZER_FILES",
]

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe")
MOE_MODEL_TYPES = ("qwen3_moe",)
_ROUTER_DTYPES = {"float32": "fp32", "float64": "fp64", "model": None}
HIDDEN_STATES_OUTPUT = "hidden_states"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja",
                   "added_tokens.json")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def load_hf_config(hf_path: str):
    """Read ``config.json`` of a local HF model and normalise it for mbridge."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(hf_path, "config.json")):
        raise ValueError(f"model.hf_path={hf_path!r} has no config.json: pass a local HF model directory")
    hf_config = AutoConfig.from_pretrained(hf_path)
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {hf_config.model_type!r} of {hf_path} is not supported; "
                         f"supported: {list(SUPPORTED_MODEL_TYPES)}")
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if getattr(hf_config, "rope_theta", None) is None and "rope_theta" in rope:
        hf_config.rope_theta = rope["rope_theta"]
    if hf_config.model_type in MOE_MODEL_TYPES:
        _check_moe_hf_config(hf_config, hf_path)
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope_type={rope_type!r} of {hf_path} is not supported (default, llama3)")
    return hf_config


def _check_moe_hf_config(hf_config, hf_path: str) -> None:
    """What mbridge's Qwen3-MoE bridge builds: every layer MoE (``decoder_sparse_step=1``, no
    ``mlp_only_layers``), no shared experts."""
    dense = list(getattr(hf_config, "mlp_only_layers", None) or [])
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    if dense or step != 1:
        raise ValueError(f"{hf_path}: mlp_only_layers={dense}, decoder_sparse_step={step}: only models whose "
                         "every layer is MoE are supported (mbridge's qwen3_moe bridge builds no dense layers)")


def is_moe(hf_config) -> bool:
    return hf_config.model_type in MOE_MODEL_TYPES


def _bridge_class(base: type) -> type:
    """A per-instance subclass of an mbridge bridge with its own mapping tables (see module doc)."""
    attention = dict(base._ATTENTION_MAPPING)
    mlp = dict(base._MLP_MAPPING)
    other = dict(getattr(base, "_OTHER_MAPPING", {}))
    direct = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
              "decoder.final_layernorm.weight": "model.norm.weight",
              "output_layer.weight": "lm_head.weight"}

    def adjust(self):
        if getattr(self.hf_config, "tie_word_embeddings", False):
            self._DIRECT_MAPPING["output_layer.weight"] = "model.embed_tokens.weight"

    def shared(self):
        return ["model.embed_tokens.weight"] if getattr(self.hf_config, "tie_word_embeddings", False) else []

    return type(f"M2po{base.__name__}", (base,), {
        "_ATTENTION_MAPPING": attention, "_MLP_MAPPING": mlp, "_OTHER_MAPPING": other,
        "_DIRECT_MAPPING": direct, "_adjust_mapping_for_shared_weights": adjust,
        "_get_hf_shared_weight_keys": shared})


def make_bridge(hf_path: str, dtype: str = "float32"):
    """An mbridge bridge for the model at ``hf_path`` (Megatron parallel state must be initialised)."""
    from mbridge.core.bridge import _MODEL_REGISTRY
    import mbridge.models  # noqa: F401  (registers the families)

    hf_config = load_hf_config(hf_path)
    cls = _bridge_class(_MODEL_REGISTRY[hf_config.model_type])
    bridge = cls(hf_config, dtype=_DTYPES[dtype])
    bridge.hf_path = hf_path
    return bridge


def build_transformer_config(cfg: Config, bridge=None):
    """Our config -> Megatron ``TransformerConfig`` (the only place Megatron model flags are set).

    mbridge derives the architecture (layers, heads, GQA, norms, qk-norm, biases) from the HF
    config and the parallel sizes from Megatron's parallel state; the run-level choices below
    override its defaults. Fused kernels are on only with Transformer Engine (GPU).
    ``calculate_per_token_loss=True`` tells Megatron not to divide losses by micro-batch counts
    nor average gradients over data parallel ranks: the actor's loss is already normalised by the
    global response-token count (see ``actor.py``).
    """
    if cfg.algo.routing_replay != "none" and not is_moe(hf0 := load_hf_config(cfg.model.hf_path)):
        raise ValueError(f"algo.routing_replay={cfg.algo.routing_replay} needs an MoE model; {cfg.model.hf_path} "
                         f"({hf0.model_type}) has no experts: use algo.routing_replay=none")
    if bridge is None:
        bridge = make_bridge(cfg.model.hf_path, cfg.model.dtype)
    p, m = cfg.parallel, cfg.model
    fused = have_transformer_engine()
    extra = dict(
        sequence_parallel=p.sequence_parallel,
        cp_comm_type=p.cp_comm_type if p.context_parallel > 1 else None,  # TE's K/V exchange (GPU)
        attention_dropout=m.attention_dropout,
        hidden_dropout=m.hidden_dropout,
        masked_softmax_fusion=fused,
        bias_activation_fusion=fused,
        bias_dropout_fusion=fused,
        apply_rope_fusion=fused,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        calculate_per_token_loss=True,
        variable_seq_lengths=True,
        fp16=m.dtype == "float16",
        bf16=m.dtype == "bfloat16",
    )
    if p.recompute == "selective":
        extra.update(recompute_granularity="selective")
    elif p.recompute == "full":
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    hf = bridge.hf_config
    etp = p.expert_tensor_parallel or p.tensor_parallel
    if is_moe(hf):
        extra.update(_moe_args(cfg, hf, fused))
    elif p.expert_parallel > 1 or etp != p.tensor_parallel:
        raise ValueError(f"parallel.expert_parallel={p.expert_parallel}, expert_tensor_parallel={etp}: the model "
                         f"{cfg.model.hf_path} ({hf.model_type}) has no experts; use 1 and leave "
                         "expert_tensor_parallel unset")
    bridge.set_extra_args(**extra)
    return bridge.config


def _moe_args(cfg: Config, hf, fused: bool) -> dict:
    """Megatron MoE flags from ``model.moe`` and the parallel layout, after checking the layout fits
    the model (expert count over EP, MoE intermediate size over ETP, SP under TP)."""
    p, moe = cfg.parallel, cfg.model.moe
    etp = p.expert_tensor_parallel or p.tensor_parallel
    if hf.num_experts % p.expert_parallel:
        raise ValueError(f"num_experts={hf.num_experts} of {cfg.model.hf_path} is not divisible by "
                         f"parallel.expert_parallel={p.expert_parallel}; choose a divisor")
    if hf.moe_intermediate_size % etp:
        raise ValueError(f"moe_intermediate_size={hf.moe_intermediate_size} of {cfg.model.hf_path} is not divisible "
                         f"by the expert tensor parallel size {etp} (parallel.expert_tensor_parallel, default "
                         "tensor_parallel); choose a divisor")
    if p.expert_parallel == 1 and etp < p.tensor_parallel:
        # Whole experts (or fewer expert-TP ranks) without expert parallelism: no all-to-all, so each
        # TP rank sends only its own sequence shard through its copy of the experts, and Megatron
        # reduces expert weights at EP = 1 over dense data parallelism only (TEGroupedLinear:
        # allreduce = not (is_expert and EP > 1)): the TP copies drift apart (measured: they differ
        # by a step after one update), and mbridge's export asserts expert TP = TP there.
        raise ConfigError(f"parallel.expert_tensor_parallel={etp} below parallel.tensor_parallel={p.tensor_parallel} "
                          "needs parallel.expert_parallel > 1 (the experts' tokens then cross the TP ranks); set "
                          f"expert_parallel to a divisor of {hf.num_experts} above 1, or leave expert_tensor_parallel "
                          "unset (= tensor_parallel)")
    lora = cfg.model.lora
    if lora.rank and etp > 1 and {"gate_proj", "up_proj", "down_proj"} & set(lora.targets):
        raise ConfigError(f"LoRA on the experts of {cfg.model.hf_path} needs whole experts on each rank, but "
                          f"parallel.expert_tensor_parallel is {etp} (its default is the tensor-parallel size): set "
                          "parallel.expert_tensor_parallel=1 (experts split over expert_parallel instead), or target "
                          "the attention only: model.lora.targets=[q_proj,k_proj,v_proj,o_proj]")
    if p.tensor_parallel > 1 and not p.sequence_parallel:
        # MoELayer.forward raises in training otherwise (megatron/core/transformer/moe/moe_layer.py)
        raise ValueError(f"MoE model {cfg.model.hf_path} with parallel.tensor_parallel={p.tensor_parallel} needs "
                         "parallel.sequence_parallel=true (Megatron-Core trains MoE layers under TP only with SP)")
    return dict(
        moe_token_dispatcher_type=p.moe_token_dispatcher,
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_z_loss_coeff=moe.z_loss_coeff or None,
        moe_expert_capacity_factor=moe.capacity_factor,
        moe_router_dtype=_ROUTER_DTYPES[moe.router_dtype],
        # Qwen3-MoE: softmax over all experts, top-k, renormalised when norm_topk_prob (HF
        # Qwen3MoeSparseMoeBlock) = Megatron's top-k of the logits then softmax (pre_softmax=False);
        # without renormalisation it is softmax first (pre_softmax=True).
        moe_router_pre_softmax=not bool(getattr(hf, "norm_topk_prob", True)),
        moe_grouped_gemm=fused,  # TEGroupedMLP on GPU; the local spec's experts are set in _layer_spec
        moe_permute_fusion=False,
        # Routing replay (actor/routing_replay.py): one RouterReplay per router (moe/router.py). The
        # fused TE top-k (moe_router_fusion) bypasses it in moe_utils.topk_routing_with_score_function.
        moe_enable_routing_replay=cfg.algo.routing_replay == "rollout",
        moe_router_fusion=False,
    )


def _layer_spec(config, vp_stage=None):
    """The decoder spec of one model chunk: Transformer Engine's layer spec when TE is importable
    (GPU), else the same spec built with TE's CPU twins (:mod:`megatron_m2po.actor.te_twin`): one
    module tree, one set of parameter names and hook points on both."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if have_transformer_engine():
        if config.num_moe_experts:
            # what mbridge's LLMBridge._get_transformer_layer_spec builds: TE layers with TEGroupedMLP experts
            return specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    from megatron_m2po.actor.te_twin import te_layer_spec

    return te_layer_spec(config, vp_stage)


def _hidden_gpt_model_class():
    from megatron.core.models.gpt.gpt_model import GPTModel

    class HiddenStateGPTModel(GPTModel):
        """GPTModel whose last stage returns final-normed hidden states [S, B, H], not logits.

        The decoder (TransformerBlock) applies the final norm on the last stage; only the output
        projection is skipped. The actor applies ``output_weight(model)`` to response rows.
        """

        def _postprocess(self, hidden_states, *args, **kwargs):
            return hidden_states

    return HiddenStateGPTModel


def build_model(cfg: Config, *, load_weights: bool = True, bridge=None):
    """Build the model chunks of this pipeline rank (a list, one per virtual stage) and the bridge.

    Weights are loaded from ``cfg.model.hf_path`` when ``load_weights``. The chunks are plain
    ``GPTModel`` modules on the current device (callers wrap them with Megatron's DDP).
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    bridge = bridge or make_bridge(cfg.model.hf_path, cfg.model.dtype)
    config = build_transformer_config(cfg, bridge)
    hf = bridge.hf_config
    tp = ps.get_tensor_model_parallel_world_size()
    if hf.vocab_size % tp:
        raise ValueError(f"vocab_size={hf.vocab_size} is not divisible by parallel.tensor_parallel={tp}: "
                         "padded vocabulary rows would change the log-prob normaliser; choose another TP size")
    rope = getattr(hf, "rope_parameters", None) or {}
    rope_kwargs = {}
    if rope.get("rope_type") == "llama3":
        rope_kwargs = dict(rope_scaling=True, rope_scaling_factor=float(rope.get("factor", 8.0)))
    cls = _hidden_gpt_model_class()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    stages = list(range(vpp)) if vpp and ps.get_pipeline_model_parallel_world_size() > 1 else [None]
    chunks = []
    for vp in stages:
        kw = {} if vp is None else {"vp_stage": vp}
        pre = ps.is_pipeline_first_stage(ignore_virtual=vp is None, **kw)
        post = ps.is_pipeline_last_stage(ignore_virtual=vp is None, **kw)
        model = cls(config=config, transformer_layer_spec=_layer_spec(config, vp), vocab_size=hf.vocab_size,
                    max_sequence_length=hf.max_position_embeddings, pre_process=pre, post_process=post,
                    share_embeddings_and_output_weights=bool(getattr(hf, "tie_word_embeddings", False)),
                    position_embedding_type="rope", rotary_base=hf.rope_theta, **rope_kwargs, **kw)
        for param in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        model.vp_stage = vp
        chunks.append(model)
    bridge.vocab_size = bridge.padded_vocab_size = hf.vocab_size
    if load_weights:
        with torch.no_grad():
            bridge.load_weights(chunks, cfg.model.hf_path)
    return chunks, bridge


def output_weight(model) -> Optional[torch.Tensor]:
    """The vocab-parallel output weight [V/TP, H] on the last stage (tied embedding or lm_head)."""
    if not model.post_process:
        return None
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def iter_hf_weights(chunks, bridge) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` with TP / PP shards gathered; every rank must iterate.

    Collective over the tensor and pipeline groups: all ranks of a model replica iterate in step.
    A tied output weight is yielded once (as ``model.embed_tokens.weight``). LoRA adapters are not
    among them (the base weights; ``weights/lora_export.py`` exports the adapters).
    """
    from megatron_m2po.actor.lora import base_views

    seen: set[str] = set()
    it = bridge.export_weights(base_views(chunks))  # the base weights only under LoRA (actor/lora.py)
    while True:
        # mbridge broadcasts the live parameters over the pipeline group; outside no_grad that
        # records c10d::broadcast_ in their autograd history. Grad mode is thread-global, so it
        # is switched off around each step of the export only, never across a yield.
        with torch.no_grad():
            try:
                name, tensor = next(it)
            except StopIteration:
                return
        if name in seen:
            continue
        seen.add(name)
        yield name, tensor.detach()


def publish_hf_dir(tmp: Path, out: Path, bridge, tokenizer_src: Optional[str]) -> None:
    """Finish an HF directory whose weights are in ``tmp``: config (copied from the source model when
    it has one, else the bridge's) and tokenizer files, then rename ``tmp`` to ``out``."""
    src = tokenizer_src or getattr(bridge, "hf_path", None)
    if src:
        for fname in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(src, fname)):
                shutil.copy2(os.path.join(src, fname), tmp / fname)
    if src and os.path.isfile(os.path.join(src, "config.json")):
        shutil.copy2(os.path.join(src, "config.json"), tmp / "config.json")  # faithful to the source
    else:
        bridge.hf_config.save_pretrained(str(tmp))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
