"""The experts of an MoE layer on the local (non Transformer Engine) spec, laid out as on GPU.

On GPU the MoE layer's experts are Megatron-Core's ``TEGroupedMLP``
(``megatron/core/transformer/moe/experts.py``; chosen by
``TESpecProvider.grouped_mlp_modules`` for ``moe_grouped_gemm=True``, as mbridge's Qwen3-MoE
bridge sets). Its parameters are ``linear_fc1.weight{i}`` / ``linear_fc2.weight{i}``, one per
local expert (Transformer Engine's ``GroupedLinear``), and mbridge keys everything expert-specific
on those names: the HF mapping (``mlp.experts.linear_fc1`` -> ``experts.{i}.gate_proj / up_proj``),
the local -> global expert numbering under expert parallelism, the split over the *expert*
tensor-parallel group on load and the expert-parallel gather on export (``mbridge/core/bridge.py``).

Megatron's local spec offers ``SequentialMLP`` (``local_experts.{i}.linear_fc1.weight``: names
mbridge does not map, and whose loads it would split over the dense TP group) or the legacy
``GroupedMLP`` (needs the CUDA ``grouped_gemm`` package). :class:`LocalGroupedMLP` is therefore
the CPU counterpart of ``TEGroupedMLP``: the same parameter names, shapes and parallel attributes,
so mbridge's production expert paths run unchanged on CPU, and ``TEGroupedMLP.forward``'s
arithmetic without fusions (fc1 per expert, gated SiLU, scaling by the routing probability, fc2).

Parallel layout (as ``TEGroupedLinear`` with ``explicit_expert_comm``): each rank holds its
``num_local_experts`` experts, and with expert tensor parallelism (ETP) the fc1 rows
(``[gate_r; up_r]`` of rank r) / fc2 columns of each; the token dispatcher does all
communication, the GEMMs here are local. Weights carry ``allreduce=False`` when expert
parallelism is on (Megatron's DDP and optimizer then reduce them over the expert data-parallel
group) and the tensor-parallel attributes of column / row parallel weights (as ``SequentialMLP``'s
``ColumnParallelLinear`` / ``RowParallelLinear`` with ``is_expert=True`` set them).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["LocalGroupedMLP"]


class _GroupedWeights(torch.nn.Module):
    """``weight0 .. weight{n-1}``: the per-expert weights of one grouped linear."""

    def __init__(self, n: int, out_features: int, in_features: int, *, partition_dim: int, config,
                 init_method, expert_parallel: bool) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        for i in range(n):
            w = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=config.params_dtype,
                                               device=torch.cuda.current_device()))
            if config.perform_initialization:
                with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                    init_method(w)
            set_tensor_model_parallel_attributes(w, is_parallel=True, dim=partition_dim, stride=1)
            w.allreduce = not expert_parallel
            self.register_parameter(f"weight{i}", w)

    def weights(self) -> list[torch.Tensor]:
        return [getattr(self, f"weight{i}") for i in range(len(self._parameters))]


class LocalGroupedMLP(torch.nn.Module):
    """``TEGroupedMLP`` on the local spec (see module doc); built by ``MoELayer`` through the spec.

    ``forward(permuted_hidden [T, H], tokens_per_expert [E_local], permuted_probs [T])`` ->
    ``(output [T, H], None)``: rows are grouped by local expert in order, as the dispatcher sends them.
    """

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None) -> None:
        super().__init__()
        from megatron.core.utils import divide

        if config.add_bias_linear:
            raise NotImplementedError("expert biases on the local spec (Qwen3-MoE has none)")
        if config.moe_apply_probs_on_input or config.moe_latent_size:
            raise NotImplementedError("moe_apply_probs_on_input / moe_latent_size on the local spec")
        self.config = config
        self.num_local_experts = num_local_experts
        etp = pg_collection.expt_tp.size() if pg_collection is not None else config.expert_tensor_parallel_size
        ep = config.expert_model_parallel_size > 1
        ffn = divide(config.moe_ffn_hidden_size, etp)
        fc1_out = 2 * ffn if config.gated_linear_unit else ffn
        self.linear_fc1 = _GroupedWeights(num_local_experts, fc1_out, config.hidden_size, partition_dim=0,
                                          config=config, init_method=config.init_method, expert_parallel=ep)
        self.linear_fc2 = _GroupedWeights(num_local_experts, config.hidden_size, ffn, partition_dim=1,
                                          config=config, init_method=config.output_layer_init_method,
                                          expert_parallel=ep)

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        # TEGroupedMLP.forward's unfused branch (bias_act_func's ``glu``)
        if self.config.gated_linear_unit:
            gate, up = torch.chunk(h, 2, dim=-1)
            return self.config.activation_func(gate) * (up + self.config.glu_linear_offset)
        return self.config.activation_func(h)

    def forward(self, permuted_hidden: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        counts = tokens_per_expert.tolist()
        xs = torch.split(permuted_hidden, counts)
        ps = torch.split(permuted_probs.unsqueeze(-1), counts)
        outs = []
        for x, p, w1, w2 in zip(xs, ps, self.linear_fc1.weights(), self.linear_fc2.weights()):
            h = self._activation(F.linear(x, w1))
            h = (h * p).to(h.dtype)  # the routing weight after the activation, as TEGroupedMLP
            outs.append(F.linear(h, w2))
        return torch.cat(outs, dim=0), None

    def backward_dw(self) -> None:  # MoELayer calls it with delayed weight-gradient computation only
        return None
