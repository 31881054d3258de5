"""The CPU twin of Transformer Engine's layer spec: the GPU build's module tree without TE kernels.

On GPUs the actor builds its layers with megatron-core's
``get_gpt_layer_with_transformer_engine_spec`` (dense) or ``get_gpt_decoder_block_spec(...,
use_transformer_engine=True)`` (MoE). There the two pre-norms of a layer are *inside* the first
linear that reads them: ``self_attention.linear_qkv`` and the dense ``mlp.linear_fc1`` are
``TELayerNormColumnParallelLinear`` (megatron-core 0.16.1 ``models/gpt/gpt_layer_specs.py``,
``backend.column_parallel_layer_norm_linear()``), with parameters ``layer_norm_weight`` (and
``layer_norm_bias`` for LayerNorm); ``input_layernorm`` is ``IdentityOp``, and so is
``pre_mlp_layernorm`` of a dense layer. Whatever hooks a fused linear (LoRA) receives the
*un-normalised* residual stream, a sequence shard under sequence parallelism.

Megatron's local spec keeps those norms as separate modules, so a CPU build on it has another
tree, other parameter names and other hook inputs than the GPU build: a defect of the GPU build
that lives in that difference (LoRA's hook reading the un-normalised input) cannot show on CPU.
This module removes the difference. :func:`te_layer_spec` runs megatron-core's *own* TE spec
functions with :class:`CpuTESpecProvider` in place of ``TESpecProvider`` (and a CPU norm in place
of ``TENorm``), so the tree, the parameter names, the ``sharded_state_dict`` keys and mbridge's name
mapping are those of the GPU build; only the leaf modules are CPU implementations:

=========================================  =============================================
Transformer Engine (GPU)                   CPU twin
=========================================  =============================================
``TELayerNormColumnParallelLinear``        :class:`LayerNormColumnParallelLinear`
``TEColumnParallelLinear``                 ``ColumnParallelLinear`` (megatron-core)
``TERowParallelLinear``                    ``RowParallelLinear`` (megatron-core)
``TENorm``                                 ``SequenceParallelTorchNorm`` (``actor/norm.py``)
``TENorm`` for q / k                       ``HeadTorchNorm``
``TEDotProductAttention``                  ``PackedDotProductAttention`` (``actor/attention.py``)
``TEGroupedMLP``                           ``LocalGroupedMLP`` (``actor/experts.py``)
=========================================  =============================================

:class:`LayerNormColumnParallelLinear` follows Transformer Engine 2.9's ``LayerNormLinear`` in
column-parallel mode (``transformer_engine/pytorch/module/layernorm_linear.py``): the norm runs on
the local sequence shard, then the *normalised* activations are all-gathered over the
tensor-parallel group (sequence parallelism) and multiplied by the weight shard; the norm's
parameters carry ``sequence_parallel`` so that Megatron sums their partial gradients over TP
(``finalize_model_grads``). Its attributes ``normalization``, ``eps``, ``zero_centered_gamma``,
``layer_norm_weight``, ``layer_norm_bias`` are TE's, so :func:`fused_norm` computes the input the
GEMM sees from either module (the LoRA hook uses it on GPU and CPU alike).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch

__all__ = ["CpuTESpecProvider", "fused_norm", "is_fused_norm_linear",  # and LayerNormColumnParallelLinear (lazy)
           "te_layer_spec"]


def is_fused_norm_linear(module: torch.nn.Module) -> bool:
    """Whether ``module`` normalises its input itself (TE's ``LayerNormLinear`` or the CPU twin)."""
    return isinstance(getattr(module, "layer_norm_weight", None), torch.Tensor)


def fused_norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The normalised input that the GEMM of the fused norm + linear ``module`` multiplies.

    Transformer Engine's norms compute in float32 and return the input's dtype; with
    ``zero_centered_gamma`` the scale is ``1 + weight``. RMSNorm: ``x / sqrt(mean(x^2) + eps)``;
    LayerNorm: ``(x - mean) / sqrt(var + eps)`` then the bias.
    """
    w = module.layer_norm_weight
    gamma = w.float() + 1 if getattr(module, "zero_centered_gamma", False) else w.float()
    xf = x.float()
    kind = getattr(module, "normalization", "RMSNorm")
    if kind == "RMSNorm":
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps) * gamma
    elif kind == "LayerNorm":
        b = getattr(module, "layer_norm_bias", None)
        y = torch.nn.functional.layer_norm(xf, (xf.shape[-1],), gamma, None if b is None else b.float(),
                                           module.eps)
    else:
        raise ValueError(f"normalization={kind!r} is not supported (RMSNorm, LayerNorm)")
    return y.to(x.dtype)


def _make_layer_norm_linear_class():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear as base

    class LayerNormColumnParallelLinear(base):
        """CPU twin of megatron-core's ``TELayerNormColumnParallelLinear`` (module docstring).

        The constructor takes what megatron-core's builders pass to the TE module
        (``SelfAttention.linear_qkv``, ``MLP.linear_fc1``); the forward takes the un-normalised
        input (a sequence shard under SP), normalises it, and hands it to
        ``ColumnParallelLinear.forward``, which gathers the sequence and applies the weight shard.
        """

        def __init__(self, input_size: int, output_size: int, *, config, init_method, gather_output: bool,
                     bias: bool, skip_bias_add: bool, is_expert: bool, skip_weight_param_allocation: bool = False,
                     tp_comm_buffer_name: Optional[str] = None, tp_group=None, stride: int = 1, **kwargs) -> None:
            if config.normalization not in ("RMSNorm", "LayerNorm"):
                raise ValueError(f"normalization={config.normalization!r} is not supported (RMSNorm, LayerNorm)")
            if gather_output:
                raise ValueError("TELayerNormColumnParallelLinear does not gather its output; neither does its "
                                 "CPU twin")
            super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                             gather_output=False, stride=stride, skip_bias_add=skip_bias_add,
                             skip_weight_param_allocation=skip_weight_param_allocation, is_expert=is_expert,
                             tp_comm_buffer_name=tp_comm_buffer_name, tp_group=tp_group, **kwargs)
            self.normalization = config.normalization
            self.eps = float(config.layernorm_epsilon)
            self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
            dtype = config.params_dtype
            device = self.weight.device if getattr(self, "weight", None) is not None else None
            init = torch.zeros if self.zero_centered_gamma else torch.ones
            self.layer_norm_weight = torch.nn.Parameter(init(input_size, dtype=dtype, device=device))
            if self.normalization == "LayerNorm":
                self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=dtype, device=device))
            else:
                self.layer_norm_bias = None
            for p in (self.layer_norm_weight, self.layer_norm_bias):
                if p is not None:  # partial gradients per sequence shard: summed over TP (finalize_model_grads)
                    p.sequence_parallel = bool(config.sequence_parallel)

        def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                    runtime_gather_output: Optional[bool] = None):
            return super().forward(fused_norm(self, input_), weight=weight,
                                   runtime_gather_output=runtime_gather_output)

    LayerNormColumnParallelLinear.__module__ = __name__
    LayerNormColumnParallelLinear.__qualname__ = "LayerNormColumnParallelLinear"
    return LayerNormColumnParallelLinear


_layer_norm_linear_class = functools.cache(_make_layer_norm_linear_class)  # megatron-core imported on first use


def __getattr__(name: str):
    if name == "LayerNormColumnParallelLinear":
        return _layer_norm_linear_class()
    raise AttributeError(name)


class CpuTESpecProvider:
    """megatron-core's ``BackendSpecProvider`` protocol answered with the CPU twins of TE's modules
    (module docstring): what ``TESpecProvider`` answers on GPU, leaf for leaf."""

    def column_parallel_linear(self) -> type:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        return ColumnParallelLinear

    def row_parallel_linear(self) -> type:
        from megatron.core.tensor_parallel.layers import RowParallelLinear

        return RowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        return _layer_norm_linear_class()

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        from megatron_m2po.actor.norm import HeadTorchNorm, SequenceParallelTorchNorm

        return HeadTorchNorm if for_qk else SequenceParallelTorchNorm

    def core_attention(self) -> type:
        from megatron_m2po.actor.attention import PackedDotProductAttention

        return PackedDotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool):
        # TEGroupedMLP's twin whatever moe_grouped_gemm says: its names are the ones mbridge maps
        from megatron_m2po.actor.experts import LocalGroupedMLP

        return LocalGroupedMLP, None

    def activation_func(self) -> Optional[type]:
        return None

    def linear(self) -> type:
        raise NotImplementedError("multi-latent attention (TELinear) has no CPU twin")


def _bind_missing_te_gemm() -> None:
    """Megatron-Core 0.16.1 ``moe_utils`` binds ``te_general_gemm`` only when Transformer Engine
    imports, yet ``RouterGatingLinearFunction.forward`` (every router's gating GEMM,
    ``router_gating_linear``) reads the name unconditionally: without TE the first routed token
    raises ``NameError: name 'te_general_gemm' is not defined`` -- on a GPU too (seen on an H100
    without TE, ``tools/gpu_check.py`` row 6). ``None`` selects that function's own ``torch.mm``
    branch (the router logits in ``moe_router_dtype``), which is what a TE-less install means."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@contextlib.contextmanager
def _te_names_on_cpu():
    """megatron-core's spec module with the CPU twins under the names its TE branches read
    (``TESpecProvider``, ``TENorm``), for the duration of one spec build."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from megatron_m2po.actor.norm import SequenceParallelTorchNorm

    saved = {k: specs.__dict__[k] for k in ("TESpecProvider", "TENorm") if k in specs.__dict__}
    specs.TESpecProvider = CpuTESpecProvider
    specs.TENorm = SequenceParallelTorchNorm
    try:
        yield specs
    finally:
        for k in ("TESpecProvider", "TENorm"):
            if k in saved:
                setattr(specs, k, saved[k])
            else:
                delattr(specs, k)


def te_layer_spec(config, vp_stage: Optional[int] = None):
    """The decoder spec of one model chunk that the GPU build gets from Transformer Engine, built by
    megatron-core's own spec functions with the CPU twins (module docstring)."""
    from megatron_m2po.actor.attention import install_thd_rope

    install_thd_rope()  # packed RoPE in one gather, as TE's fused THD kernel (actor/attention.py)
    with _te_names_on_cpu() as specs:
        if config.num_moe_experts:
            _bind_missing_te_gemm()
            # what mbridge's LLMBridge._get_transformer_layer_spec builds on GPU
            return specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
        layer = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from megatron_m2po.actor.norm import SequenceParallelTorchNorm

    # the final norm: TENorm on GPU (transformer_block.LayerNormImpl), its twin here
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=SequenceParallelTorchNorm)
