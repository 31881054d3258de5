"""LoRA adapters on Megatron-Core's column- and row-parallel linears (``model.lora``, issue 41).

Each targeted HF projection ``W`` gets peft's ``W x + s B A x`` with ``s = alpha / r``, A ``[r, in]``
and B ``[out, r]``. Megatron fuses some HF projections into one linear, so one
:class:`LoRALinear` holds the adapters of a fused linear, each HF projection keeping its own A and
B (what peft has, hence exact equality with peft and a direct export to peft names):

=================  ==============================  ==========================================
HF names           Megatron linear                 fused output of one TP rank
=================  ==============================  ==========================================
q/k/v_proj         ``self_attention.linear_qkv``   per local query group: its q heads, k, v
o_proj             ``self_attention.linear_proj``  (row-parallel)
gate/up_proj       ``mlp.linear_fc1``              ``[gate shard; up shard]``
down_proj          ``mlp.linear_fc2``              (row-parallel)
=================  ==============================  ==========================================

Tensor / sequence parallelism (the layouts that make every TP / SP size give the same function
and gradients):

* column-parallel: A replicated, B split along ``out`` like the base weight. ``h = A x`` goes
  through ``copy_to_tensor_model_parallel_region`` (its backward all-reduces ``dh``, so grad A is
  whole on every rank) or, with SP, ``gather_from_sequence_parallel_region`` (x is a sequence
  shard; grad A is then partial per shard and A is marked ``sequence_parallel``, which Megatron's
  ``finalize_model_grads`` all-reduces over TP, ``_allreduce_non_tensor_model_parallel_grads``).
* row-parallel: A split along ``in``, B replicated. ``h = A_local x_local`` is summed by
  ``reduce_from_tensor_model_parallel_region`` or, with SP, reduce-scattered over the sequence
  (``reduce_scatter_to_sequence_parallel_region``; B is then marked ``sequence_parallel``).

Under Transformer Engine's layer spec (and its CPU twin, ``actor/te_twin.py``) ``linear_qkv`` and
the dense ``linear_fc1`` normalise their input *inside* the module (``layer_norm_weight``), so the
forward hook receives the residual stream; the hook applies the module's own norm
(:func:`~megatron_m2po.actor.te_twin.fused_norm`) before the adapters, which then read exactly the
input of the base GEMM, ``LN(x)``, as peft and SGLang do (on the sequence shard under SP, gathered
after ``A`` as above).

The adapter of a linear is a sibling module (``linear_qkv_lora`` next to ``linear_qkv``), added by
a forward hook: the base linear's own ``sharded_state_dict`` would treat children as replicated,
and the sibling gives checkpoints its own TP axes (:meth:`LoRALinear.sharded_state_dict`). The
base parameters are frozen (``requires_grad=False``) before DDP and the optimizer are built, so
Megatron's gradient buffers, fp32 main copies and Adam states hold the adapters only. A is
initialised as peft does (``kaiming_uniform_(a=sqrt(5))``, from a generator seeded by the run seed,
the layer and the projection, whole then sliced, so every layout starts from the same adapters),
B with zeros. Dropout (``model.lora.dropout``) acts on the adapter input in forwards with
gradients only.

MoE experts (:class:`ExpertLoRA`, when the targets name the MLP of an MoE model): every expert
``e`` of a layer gets its own pair on its fused gate / up projection, ``A_e [r, hidden]`` shared by
gate and up and ``B_e [2 ffn, r]`` (gate rows first), and one on its down projection -- exactly
what peft puts on transformers' fused expert parameters (``target_parameters``, ``lora.ParamWrapper``:
per expert one rank-r update of ``gate_up_proj[e]`` and of ``down_proj[e]``) and what SGLang
0.5.23 serves from an adapter's per-expert ``experts.{e}.gate_up_proj`` keys (``lora/lora.py``
``normalize_gate_up_proj`` duplicates the shared A for the stacked gate / up buffer). So gate,
up and down are targeted together or not at all (SGLang wraps its ``FusedMoE`` only when both
``gate_up_proj`` and ``down_proj`` are targets: ``lora/lora_manager.py``). The adapters hook the
experts' grouped linears (``TEGroupedLinear(x, m_splits)`` on GPU, ``LocalGroupedMLP``'s
counterpart here), each rank holding its local experts' pairs (``allreduce`` False: Megatron's DDP
reduces them over the expert data-parallel group, which with whole experts holds the
tensor-parallel ranks, each of which routes its own sequence shard);
experts are whole on each rank (``parallel.expert_tensor_parallel=1``, checked).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import zlib
from typing import Iterator, Optional

import torch
from torch import nn

from megatron_m2po.actor.te_twin import fused_norm, is_fused_norm_linear
from megatron_m2po.utils.settings import ConfigError

__all__ = ["EXPERT_PARTS", "ExpertLoRA", "grouped_gemm_ok", "grouped_gemm_serves", "LINEARS", "LoRALinear", "add_adapters", "adapter_modules", "adapters_disabled",
           "base_view", "base_views", "expert_adapter_modules", "has_adapters", "is_adapter_key"]

# Megatron linear -> (parent attribute, the HF projections it fuses, in the fused output's order, parallel kind)
LINEARS = {
    "linear_qkv": ("self_attention", ("q_proj", "k_proj", "v_proj"), "column"),
    "linear_proj": ("self_attention", ("o_proj",), "row"),
    "linear_fc1": ("mlp", ("gate_proj", "up_proj"), "column"),
    "linear_fc2": ("mlp", ("down_proj",), "row"),
}
SUFFIX = "_lora"  # the adapter module of linear X is the sibling X_lora


class LoRALinear(nn.Module):
    """The adapters of one (possibly fused) Megatron linear of one layer; its output is added to
    the base linear's by a forward hook (module docstring). ``{hf}_A`` / ``{hf}_B`` parameters
    hold this rank's part: column-parallel ``A [r, in]`` whole, ``B [out_hf / tp, r]``;
    row-parallel ``A [r, in / tp]``, ``B [out, r]`` whole."""

    def __init__(self, linear: nn.Module, name: str, targets: list[str], *, rank: int, scaling: float,
                 dropout: float, layer: int, seed: int, hf) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import (set_defaults_if_not_set_tensor_model_parallel_attributes,
                                                   set_tensor_model_parallel_attributes)

        _, parts, kind = LINEARS[name]
        self.name, self.kind, self.layer = name, kind, layer
        self.parts, self.targets = parts, [p for p in parts if p in targets]
        self.rank, self.scaling = rank, scaling
        self.enabled = True
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        self.tp_group = linear.tp_group
        self.tp, tp_rank = self.tp_group.size(), self.tp_group.rank()
        self.sequence_parallel = bool(linear.sequence_parallel)
        heads, groups = int(hf.num_attention_heads), int(hf.num_key_value_heads)
        self.head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // heads)
        self.groups_local = groups // self.tp
        self.q_per_group = heads // groups
        full_in, full_out = _hf_shape(name, hf, self.head_dim)
        for part in self.targets:
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{layer}/{part}".encode()))  # same on every rank
            a = torch.empty(rank, full_in)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)  # peft: nn.Linear's own init
            b = torch.zeros(full_out[part], rank)
            if kind == "column":  # B split along out like the base, A whole
                b = b.chunk(self.tp, 0)[tp_rank]
            else:  # A split along in like the base, B whole
                a = a.chunk(self.tp, 1)[tp_rank]
            dtype, device = linear.weight.dtype, linear.weight.device
            pa = nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            pb = nn.Parameter(b.to(device=device, dtype=dtype).contiguous())
            split, whole = (pb, pa) if kind == "column" else (pa, pb)
            set_tensor_model_parallel_attributes(split, True, 0 if kind == "column" else 1, 1)
            set_defaults_if_not_set_tensor_model_parallel_attributes(whole)
            if self.sequence_parallel:  # its gradient is partial per sequence shard: summed over TP
                whole.sequence_parallel = True
            self.register_parameter(f"{part}_A", pa)
            self.register_parameter(f"{part}_B", pb)
        self.fused_norm = is_fused_norm_linear(linear)  # linear_qkv / dense linear_fc1 of TE's spec
        linear.register_forward_hook(self._hook, with_kwargs=True)

    def pair(self, part: str) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(A, B)`` of HF projection ``part``."""
        return getattr(self, f"{part}_A"), getattr(self, f"{part}_B")

    def _hook(self, module, args, kwargs, output):
        if not self.enabled or not self.targets:
            return None
        x = args[0] if args else kwargs["input_"]
        if self.fused_norm:
            # Transformer Engine's LayerNormLinear (and its CPU twin) normalise inside the module: the
            # hook's input is the residual stream; the base GEMM, peft and SGLang see the normalised one
            x = fused_norm(module, x)
        out, bias = output
        return self.add_delta(x, out), bias

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` plus the adapters' contribution to this rank's output of the linear for input ``x``.

        Few kernels, since a step runs this on every targeted linear of every micro-batch: one GEMM
        for every A of the linear (``h = x [A_1; A_2; ...]^T``), then one ``addmm`` that adds
        ``h B^T`` to the base output, where ``B`` is every projection's ``scaling x B`` placed at its
        rows of the fused output (Megatron's per-query-group ``[q..., k, v]`` of ``linear_qkv``,
        ``[gate; up]`` of ``linear_fc1``) and its ``rank`` columns of ``h`` (zero elsewhere)."""
        from megatron.core import tensor_parallel as tpm

        if self.dropout is not None and self.training and torch.is_grad_enabled():
            x = self.dropout(x)
        a = torch.cat([self.pair(p)[0] for p in self.targets], 0)
        h = x.to(a.dtype) @ a.t()  # [s, b, k r]
        if self.tp > 1:
            if self.kind == "column":
                h = tpm.gather_from_sequence_parallel_region(h, group=self.tp_group) if self.sequence_parallel \
                    else tpm.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
            else:
                h = tpm.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group) if self.sequence_parallel \
                    else tpm.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        b = self._placed_b().to(out.dtype)  # [out_local, k r]
        flat = torch.addmm(out.reshape(-1, out.shape[-1]), h.reshape(-1, h.shape[-1]).to(out.dtype), b.t())
        return flat.view(out.shape)

    def _placed_b(self) -> torch.Tensor:
        """Every projection's ``scaling x B`` at its rows of the fused output and its columns of ``h``."""
        r, k = self.rank, len(self.targets)
        col = {p: i for i, p in enumerate(self.targets)}

        def placed(p: str, rows: int, like: torch.Tensor) -> torch.Tensor:
            if p not in col:
                return like.new_zeros(rows, k * r)
            i = col[p]
            return torch.nn.functional.pad(self.pair(p)[1] * self.scaling, (i * r, (k - 1 - i) * r))

        like = self.pair(self.targets[0])[1]
        if len(self.parts) == 1:
            return placed(self.parts[0], like.shape[0], like)
        if self.name == "linear_fc1":
            return torch.cat([placed(p, like.shape[0], like) for p in self.parts], 0)
        g, hd = self.groups_local, self.head_dim
        widths = {"q_proj": self.q_per_group * hd, "k_proj": hd, "v_proj": hd}
        blocks = [placed(p, g * widths[p], like).reshape(g, widths[p], k * r) for p in self.parts]
        return torch.cat(blocks, 1).reshape(-1, k * r)  # Megatron's per-query-group [q..., k, v]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Checkpoint tensors with their TP axes (B of column-, A of row-parallel linears)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axis = {f"{p}_{'B' if self.kind == 'column' else 'A'}": 0 if self.kind == "column" else 1
                for p in self.targets}
        sd = self.state_dict(prefix="", keep_vars=True)
        dp_cp = (metadata or {}).get("dp_cp_group")
        if dp_cp is None:
            from megatron.core import parallel_state as ps

            dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(sd, prefix, axis, sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=dp_cp)


def _hf_shape(name: str, hf, head_dim: int) -> tuple[int, dict[str, int]]:
    """(in features, {HF projection: out features}) of the whole (unsplit) linear ``name``."""
    hidden, ffn = int(hf.hidden_size), int(hf.intermediate_size)
    heads, groups = int(hf.num_attention_heads), int(hf.num_key_value_heads)
    if name == "linear_qkv":
        return hidden, {"q_proj": heads * head_dim, "k_proj": groups * head_dim, "v_proj": groups * head_dim}
    if name == "linear_proj":
        return heads * head_dim, {"o_proj": hidden}
    if name == "linear_fc1":
        return hidden, {"gate_proj": ffn, "up_proj": ffn}
    return ffn, {"down_proj": hidden}


EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")  # an MoE model's MLP targets: its experts'


class ExpertLoRA(nn.Module):
    """The adapters of one MoE layer's local experts (module docstring), one stacked parameter per
    matrix: ``gate_up_A`` ``[n, r, hidden]``, ``gate_up_B`` ``[n, 2 ffn, r]``, ``down_A`` ``[n, r, ffn]``,
    ``down_B`` ``[n, hidden, r]``, row ``i`` for local expert ``i`` (global expert ``ep_rank * n + i``).
    Forward hooks on the experts' ``linear_fc1`` / ``linear_fc2`` (called ``(x, m_splits)``,
    answering ``(out, bias)``) add ``s B_e A_e x`` to the rows of each expert: two grouped GEMMs
    over all local experts (``torch._grouped_mm`` with the experts' row offsets) where torch has
    them for the tensors' device, dtype and GPU generation, else one pair of matmuls per expert. Per expert, the
    loop launched ~4 kernels forward and ~8 backward per hook: on one H100 at 128 experts a
    Qwen3-30B-A3B-shaped layer's step took 3-4x the step with attention adapters only, CPU-bound
    on launches (``tools/benchmarks/expert_lora.py`` measures both paths side by side)."""

    PAIRS = ("gate_up", "down")

    def __init__(self, experts: nn.Module, *, rank: int, scaling: float, dropout: float, layer: int, seed: int,
                 hf, ep_rank: int) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        self.layer, self.rank, self.scaling = layer, rank, scaling
        self.enabled = True
        self.grouped: Optional[bool] = None  # None: torch._grouped_mm where it serves (grouped_gemm_serves)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        n = self.num_local_experts = int(experts.num_local_experts)
        self.first_expert, self.ep_rank = ep_rank * n, ep_rank
        hidden, ffn = int(hf.hidden_size), int(hf.moe_intermediate_size)
        shapes = {"gate_up": (hidden, 2 * ffn), "down": (ffn, hidden)}  # (in, out)
        w = experts.linear_fc1.weight0
        for pair, (fin, fout) in shapes.items():
            a = torch.empty(n, rank, fin)
            for i in range(n):  # each global expert's A from its own generator: every EP layout starts alike
                gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{layer}/experts.{self.first_expert + i}.{pair}"
                                                               .encode()))
                nn.init.kaiming_uniform_(a[i], a=math.sqrt(5), generator=gen)
            for which, t in (("A", a), ("B", torch.zeros(n, fout, rank))):
                prm = nn.Parameter(t.to(device=w.device, dtype=w.dtype))
                # whole on this rank (expert TP = 1): "parallel" so that norms and checkpoints take each
                # rank's experts as its own, as Megatron's expert linears are marked
                set_tensor_model_parallel_attributes(prm, True, 0, 1)
                # DDP: reduced over the expert data-parallel group, which holds the tensor-parallel
                # ranks too when experts are whole (expert TP 1): at TP > 1 each of them routes its
                # own sequence shard, so its gradient is partial even without expert parallelism
                prm.allreduce = False
                self.register_parameter(f"{pair}_{which}", prm)
        experts.linear_fc1.register_forward_hook(self._hook_fc1, with_kwargs=True)
        experts.linear_fc2.register_forward_hook(self._hook_fc2, with_kwargs=True)

    def pair(self, pair: str, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert ``i``'s ``(A, B)`` of ``pair`` (``gate_up`` / ``down``): views of the stacked
        parameters."""
        return getattr(self, f"{pair}_A")[i], getattr(self, f"{pair}_B")[i]

    def _hook_fc1(self, module, args, kwargs, output):
        return self._hook("gate_up", args, kwargs, output)

    def _hook_fc2(self, module, args, kwargs, output):
        return self._hook("down", args, kwargs, output)

    def _hook(self, pair: str, args, kwargs, output):
        if not self.enabled:
            return None
        x = args[0] if args else kwargs["x"]
        splits = [int(m) for m in (args[1] if len(args) > 1 else kwargs["m_splits"])]
        out, bias = output
        if not splits:
            return None
        if self.dropout is not None and self.training and torch.is_grad_enabled():
            x = self.dropout(x)
        a, b = getattr(self, f"{pair}_A"), getattr(self, f"{pair}_B")
        x = x.to(a.dtype)
        grouped = self.grouped if self.grouped is not None else grouped_gemm_serves(x, a, b)
        if grouped and x.shape[0] > 0:
            offs = torch.tensor(list(itertools.accumulate(splits)), dtype=torch.int32).to(x.device, non_blocking=True)
            xa = torch._grouped_mm(x.contiguous(), a.transpose(1, 2), offs=offs)
            delta = torch._grouped_mm(xa * self.scaling, b.transpose(1, 2), offs=offs)
        else:  # unbind: one gradient stack for all experts, not a whole-stack zero tensor per expert
            delta = torch.cat([(xi @ ai.t()) @ (bi * self.scaling).t()
                               for xi, ai, bi in zip(torch.split(x, splits), a.unbind(0), b.unbind(0))], 0)
        return out + delta.to(out.dtype), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Each matrix as one global tensor (``{prefix}gate_up_A`` ``[num_experts, r, hidden]``, ...),
        local expert ``i`` at global index ``first_expert + i``, as the expert weights are saved
        (``experts.py`` ``_GroupedWeights.sharded_state_dict``), so a checkpoint reshards over expert
        layouts (the same keys and global shapes as when each expert's matrix was its own tensor)."""
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        ep = ps.get_expert_model_parallel_world_size()
        dp_rank = ps.get_expert_data_parallel_rank()
        out = {}
        for pair in self.PAIRS:
            for which in "AB":
                key = f"{prefix}{pair}_{which}"
                offsets = (*sharded_offsets, (len(sharded_offsets), self.ep_rank, ep))
                out[key] = ShardedTensor.from_rank_offsets(key, getattr(self, f"{pair}_{which}"), *offsets,
                                                           replica_id=(0, 0, dp_rank),
                                                           prepend_axis_num=len(sharded_offsets))
        return out


def grouped_gemm_serves(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes the expert adapters' products ``x A^T`` then ``(x A^T) B^T``
    here (:func:`grouped_gemm_ok`; and ``x`` starts 16-byte aligned, as its CUDA kernel needs)."""
    cap = torch.cuda.get_device_capability(x.device) if x.device.type == "cuda" else None
    return x.data_ptr() % 16 == 0 and grouped_gemm_ok(x.device.type, (x.dtype, a.dtype, b.dtype),
                                                      (x.shape[-1], a.shape[1], b.shape[1]), cap)


def grouped_gemm_ok(device_type: str, dtypes, dims, capability: Optional[tuple] = None) -> bool:
    """``torch._grouped_mm`` for tensors of ``dtypes`` whose rows have ``dims`` elements: torch has it,
    and every row is 16-byte aligned (both its CUDA and its CPU implementation refuse other strides:
    "strides should be multiple of 16 bytes"). On CUDA only bf16 on Hopper (compute capability 9.x:
    its CUTLASS kernel, ``ATen/native/cuda/Blas.cpp`` ``_grouped_mm_cuda``, which equalled the loop
    exactly on an H100, empty experts included; other generations and dtypes take the loop until
    measured there). On CPU torch's own implementation, any float dtype (equal to the loop:
    tests/actor/test_lora_moe.py)."""
    if not hasattr(torch, "_grouped_mm") or device_type not in ("cuda", "cpu"):
        return False
    if device_type == "cuda" and (any(d != torch.bfloat16 for d in dtypes) or capability is None
                                  or capability[0] != 9):
        return False
    return all(n * d.itemsize % 16 == 0 for n in dims for d in dtypes)


def add_adapters(chunks: list, lora_cfg, hf, seed: int) -> None:
    """Freeze every parameter of ``chunks`` and add the adapters ``lora_cfg`` (``model.lora``)
    targets to each decoder layer of this pipeline stage. Call before DDP and the optimizer are
    built. On an MoE model the MLP targets are its experts' (:class:`ExpertLoRA`): ConfigError
    unless gate, up and down are targeted together (whole experts on each rank, expert TP 1, is
    checked with the layout: ``actor/model.py``)."""
    from megatron.core import parallel_state as ps

    targets = list(lora_cfg.targets)
    mlp_targets = [t for t in targets if t in EXPERT_PARTS]
    moe = bool(getattr(hf, "num_experts", None))
    if moe and mlp_targets and set(mlp_targets) != set(EXPERT_PARTS):
        raise ConfigError(f"model.lora.targets={targets}: on this mixture-of-experts model the MLP targets are its "
                          f"experts', and {sorted(mlp_targets)} is only part of them: gate_proj and up_proj share one "
                          "A per expert (peft's fused gate_up_proj) and SGLang serves expert adapters only when "
                          "gate_up_proj and down_proj are both targets; name all of gate_proj, up_proj, down_proj "
                          "or none of them")
    if moe and mlp_targets and lora_cfg.dropout > 0:
        raise ConfigError(f"model.lora.dropout={lora_cfg.dropout} with adapters on the experts: peft's LoRA on "
                          "fused expert parameters (target_parameters, the exported final_adapter) has no dropout, "
                          "so the adapter would not load in peft; set model.lora.dropout=0 or target the attention "
                          "only: model.lora.targets=[q_proj,k_proj,v_proj,o_proj]")
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        for layer in chunk.decoder.layers:
            for name, (parent_name, parts, _) in LINEARS.items():
                if not set(parts) & set(targets):
                    continue
                parent = getattr(layer, parent_name)
                if parent_name == "mlp" and moe:
                    continue  # the experts' adapters, below
                adapter = LoRALinear(getattr(parent, name), name, targets, rank=lora_cfg.rank,
                                     scaling=lora_cfg.scaling, dropout=lora_cfg.dropout,
                                     layer=layer.layer_number - 1, seed=seed, hf=hf)
                parent.add_module(name + SUFFIX, adapter)
            if moe and mlp_targets:
                experts = layer.mlp.experts
                adapter = ExpertLoRA(experts, rank=lora_cfg.rank, scaling=lora_cfg.scaling, dropout=lora_cfg.dropout,
                                     layer=layer.layer_number - 1, seed=seed, hf=hf,
                                     ep_rank=ps.get_expert_model_parallel_rank())
                layer.mlp.add_module("experts" + SUFFIX, adapter)


def adapter_modules(chunks: list) -> Iterator[LoRALinear]:
    """Every :class:`LoRALinear` of ``chunks`` (unwrapped or DDP-wrapped), in module order."""
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, LoRALinear):
                yield m


def expert_adapter_modules(chunks: list) -> Iterator["ExpertLoRA"]:
    """Every :class:`ExpertLoRA` of ``chunks``, in module order."""
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, ExpertLoRA):
                yield m


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key is an adapter's (``...linear_qkv_lora.q_proj_A``; its optimizer too)."""
    return f"{SUFFIX}." in key


def has_adapters(chunks: list) -> bool:
    return next(adapter_modules(chunks), None) is not None or next(expert_adapter_modules(chunks), None) is not None


@contextlib.contextmanager
def adapters_disabled(chunks: list):
    """Inside, every adapter of ``chunks`` is skipped: the chunks compute exactly the base model."""
    mods = list(adapter_modules(chunks)) + list(expert_adapter_modules(chunks))
    before = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m, e in zip(mods, before):
            m.enabled = e


class _BaseView:
    """A chunk as mbridge's export sees it: the same modules, without the adapter parameters
    (mbridge maps every parameter name to an HF name and has none for them)."""

    def __init__(self, chunk) -> None:
        self._chunk = chunk

    def __getattr__(self, name):
        return getattr(self._chunk, name)

    def named_parameters(self, *args, **kwargs):
        return ((n, p) for n, p in self._chunk.named_parameters(*args, **kwargs) if SUFFIX + "." not in n)

    def state_dict(self, *args, **kwargs):
        sd = self._chunk.state_dict(*args, **kwargs)
        for k in [k for k in sd if SUFFIX + "." in k]:
            del sd[k]
        return sd


def base_view(chunk):
    """An unwrapped ``chunk`` for mbridge's weight export: itself without adapters, else a :class:`_BaseView`."""
    return _BaseView(chunk) if has_adapters([chunk]) else chunk


def base_views(chunks: list) -> list:
    """:func:`base_view` of each unwrapped chunk."""
    return [base_view(c) for c in chunks]
