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

Distributed checkpoints (``sharded_state_dict``) use ``TEGroupedMLP``'s layout, so a checkpoint
reshards over expert layouts as Megatron's does (megatron-core 0.16.1
``transformer/moe/experts.py`` ``TEGroupedMLP.sharded_state_dict`` and
``extensions/transformer_engine.py`` ``TEGroupedLinear._sharded_state_dict_grouped``): local
expert ``i`` of EP rank ``r`` is global expert ``r * num_local_experts + i``, saved as the slice
of one global tensor per linear (``{prefix}experts.linear_fc1.weight`` of shape
``[num_experts, fc1_out, hidden]``, the expert axis prepended after the layer offsets); fc1 is split
over expert TP on its rows and fc2 on its columns; the gated fc1 is saved as its gate and up halves
(``mlp.apply_swiglu_sharded_factory``), so a different expert-TP size re-splits each half; the
replica id's data-parallel entry is the rank in the *expert* data-parallel group (one writer
per expert shard). ``TEGroupedLinear``'s ``_extra_state`` entries (FP8 metadata) have no
counterpart here: a checkpoint written on GPUs has them and this layout loads without them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["LocalGroupedMLP"]


class _GroupedWeights(torch.nn.Module):
    """``weight0 .. weight{n-1}``: the per-expert weights of one grouped linear."""

    def __init__(self, n: int, out_features: int, in_features: int, *, partition_dim: int, config,
                 init_method, expert_parallel: bool, groups) -> None:
        super().__init__()
        # not a submodule / parameter: the process groups the checkpoint layout needs
        object.__setattr__(self, "_groups", groups)
        self._partition_dim = partition_dim
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

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> tuple[torch.Tensor, None]:
        """``TEGroupedLinear.forward(x, m_splits)`` (no bias): rows ``m_splits[i]`` of ``x`` (in
        order) through ``weight{i}``; ``(out, None)``, as Megatron's wrapper returns it. A module
        call, as on GPU, so forward hooks on the experts' linears (LoRA on experts) see the same
        ``(x, m_splits)`` and ``(out, bias)`` there and here."""
        outs = [F.linear(xi, w) for xi, w in zip(torch.split(x, m_splits), self.weights())]
        return (torch.cat(outs, dim=0) if outs else x.new_zeros(0, self.weight0.shape[0])), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """``TEGroupedLinear._sharded_state_dict_grouped`` (megatron-core 0.16.1,
        ``extensions/transformer_engine.py``) without ``_extra_state``: ``weight{i}`` becomes the
        global-expert slice ``(ep_axis, ep_rank * n + i, ep_size * n)`` of key ``{prefix}weight``,
        split over the expert-TP group on ``partition_dim``, replica id ``(pp, tp, expert-DP rank)``."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        if metadata.get("singleton_local_shards", False):
            raise NotImplementedError("singleton_local_shards checkpoints of the local-spec experts")
        n = len(self._parameters)
        groups = self._groups
        ep_size, ep_rank = dist.get_world_size(groups.ep), dist.get_rank(groups.ep)
        expt_dp_rank = dist.get_rank(groups.expt_dp)
        out = {}
        for i in range(n):
            offsets = (*sharded_offsets, (len(sharded_offsets), ep_rank * n + i, ep_size * n))
            sub = make_sharded_tensors_for_checkpoint(
                {"weight": getattr(self, f"weight{i}")}, prefix, {"weight": self._partition_dim}, offsets,
                tp_group=groups.expt_tp, dp_cp_group=metadata["dp_cp_group"])
            sh = sub[f"{prefix}weight"]
            sh.replica_id = (*sh.replica_id[:2], expt_dp_rank)  # replication along DP modulo EP
            out[f"{prefix}weight{i}"] = sh
        return out


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
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        self._pg = pg_collection
        ffn = divide(config.moe_ffn_hidden_size, etp)
        fc1_out = 2 * ffn if config.gated_linear_unit else ffn
        self.linear_fc1 = _GroupedWeights(num_local_experts, fc1_out, config.hidden_size, partition_dim=0,
                                          config=config, init_method=config.init_method, expert_parallel=ep, groups=pg_collection)
        self.linear_fc2 = _GroupedWeights(num_local_experts, config.hidden_size, ffn, partition_dim=1,
                                          config=config, init_method=config.output_layer_init_method,
                                          expert_parallel=ep, groups=pg_collection)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """``TEGroupedMLP.sharded_state_dict`` (megatron-core 0.16.1 ``transformer/moe/experts.py``):
        the grouped linears' global-expert tensors under ``{prefix}experts.linear_fc{1,2}.weight``
        (the keys ``SequentialMLP`` also writes), fc1 split into its gate / up halves."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        out = {}
        n = self.num_local_experts
        ep_size, ep_rank = dist.get_world_size(self._pg.ep), dist.get_rank(self._pg.ep)
        for name, module in (("linear_fc1", self.linear_fc1), ("linear_fc2", self.linear_fc2)):
            sub = module.sharded_state_dict(f"{name}.", sharded_offsets, metadata)
            if name == "linear_fc1" and self.config.gated_linear_unit:
                for i in range(n):
                    offsets = (*sharded_offsets, (len(sharded_offsets), ep_rank * n + i, ep_size * n))
                    sub[f"{name}.weight{i}"] = apply_swiglu_sharded_factory(sub[f"{name}.weight{i}"], offsets)
            replace_prefix_for_sharding(sub, f"{name}.", f"{prefix}experts.{name}.")
            out.update({f"{prefix}{k}": v for k, v in sub.items()})
        return out

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        # TEGroupedMLP.forward's unfused branch (bias_act_func's ``glu``)
        if self.config.gated_linear_unit:
            gate, up = torch.chunk(h, 2, dim=-1)
            return self.config.activation_func(gate) * (up + self.config.glu_linear_offset)
        return self.config.activation_func(h)

    def forward(self, permuted_hidden: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        counts = tokens_per_expert.tolist()
        fc1, _ = self.linear_fc1(permuted_hidden, counts)  # TEGroupedMLP.forward: linear_fc1(x, tokens_per_expert)
        h = self._activation(fc1)
        h = (h * permuted_probs.unsqueeze(-1)).to(h.dtype)  # the routing weight after the activation, as TEGroupedMLP
        out, _ = self.linear_fc2(h, counts)
        return out, None

    def backward_dw(self) -> None:  # MoELayer calls it with delayed weight-gradient computation only
        return None
