"""A PyTorch norm for Megatron's local layer spec that supports sequence parallelism.

Megatron-Core 0.16.1's local spec builds its norms with ``WrappedTorchNorm``
(``megatron/core/transformer/torch_norm.py``) when Apex is absent, and that wrapper asserts
``not config.sequence_parallel``. The reason is not the arithmetic (a norm is per token, so it
runs unchanged on a sequence shard) but the gradient: with sequence parallelism each tensor
parallel rank sees only its ``S / TP`` slice of the sequence, so the gradient of the norm's
weight (and bias) on one rank is a partial sum. Megatron's own SP-capable norms mark such
parameters with ``param.sequence_parallel = True`` (``FusedLayerNorm.__init__`` in
``megatron/core/fusions/fused_layer_norm.py``; ``TENorm`` via Transformer Engine's
``sequence_parallel`` flag, ``megatron/core/extensions/transformer_engine.py``), and
``finalize_model_grads`` -> ``_allreduce_non_tensor_model_parallel_grads``
(``megatron/core/distributed/finalize_model_grads.py``) sums the gradients of every parameter
with that attribute over the tensor-parallel group when ``config.sequence_parallel`` is on.

:class:`SequenceParallelTorchNorm` does the same for ``torch.nn.RMSNorm`` / ``LayerNorm``:
same module and parameter names as ``WrappedTorchNorm`` (so checkpoints and the HF name
mapping are unchanged), with the ``sequence_parallel`` attribute set on its parameters. It is
used for the decoder layers' pre-norms and the final norm. The q / k norms (Qwen3) act on
attention heads after ``linear_qkv`` has gathered the sequence, so they see every token on every
rank: :class:`HeadTorchNorm` builds them without the attribute (their gradients are summed over
TP by name, ``q_layernorm`` / ``k_layernorm``, in the same ``finalize_model_grads`` function,
because each TP rank holds different heads).
"""

from __future__ import annotations

import torch

__all__ = ["SequenceParallelTorchNorm", "HeadTorchNorm"]


class SequenceParallelTorchNorm:
    """``torch.nn.RMSNorm`` / ``LayerNorm`` built from a Megatron ``TransformerConfig``, with the
    ``sequence_parallel`` attribute on its parameters (module docstring).

    Refuses what ``WrappedTorchNorm`` refuses apart from sequence parallelism
    (zero-centred gamma, persistent and memory-efficient layer norm need Apex / TE kernels).
    """

    sequence_sharded = True  # the input is a sequence shard when config.sequence_parallel

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, flag, False):
                raise ValueError(f"{flag}=True needs Transformer Engine or Apex norms; the PyTorch norm of the "
                                 "local layer spec does not implement it")
        # In the model's dtype, as Megatron's own layers (and TE / Apex norms) are: a float32 norm in a
        # bf16 model puts parameters of two dtypes in one optimizer group, and the distributed
        # optimizer's checkpoint then pairs their states with the wrong parameters.
        dtype = getattr(config, "params_dtype", None)
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=dtype)
        else:
            raise ValueError(f"normalization={config.normalization!r} is not supported by the local layer spec "
                             "(RMSNorm, LayerNorm)")
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel) and cls.sequence_sharded
        return norm


class HeadTorchNorm(SequenceParallelTorchNorm):
    """The q / k norm: same as :class:`SequenceParallelTorchNorm` on a gathered sequence (no
    ``sequence_parallel`` attribute; see the module docstring)."""

    sequence_sharded = False
