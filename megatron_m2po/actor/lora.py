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

The adapter of a linear is a sibling module (``linear_qkv_lora`` next to ``linear_qkv``), added by
a forward hook: the base linear's own ``sharded_state_dict`` would treat children as replicated,
and the sibling gives checkpoints its own TP axes (:meth:`LoRALinear.sharded_state_dict`). The
base parameters are frozen (``requires_grad=False``) before DDP and the optimizer are built, so
Megatron's gradient buffers, fp32 main copies and Adam states hold the adapters only. A is
initialised as peft does (``kaiming_uniform_(a=sqrt(5))``, from a generator seeded by the run seed,
the layer and the projection, whole then sliced, so every layout starts from the same adapters),
B with zeros. Dropout (``model.lora.dropout``) acts on the adapter input in forwards with
gradients only. MoE: attention adapters only (the experts' linears are refused in
:func:`add_adapters`).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from typing import Iterator, Optional

import torch
from torch import nn

from megatron_m2po.utils.settings import ConfigError

__all__ = ["LINEARS", "LoRALinear", "add_adapters", "adapter_modules", "adapters_disabled", "base_view", "base_views",
           "has_adapters", "is_adapter_key"]

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
        linear.register_forward_hook(self._hook, with_kwargs=True)

    def pair(self, part: str) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(A, B)`` of HF projection ``part``."""
        return getattr(self, f"{part}_A"), getattr(self, f"{part}_B")

    def _hook(self, module, args, kwargs, output):
        if not self.enabled or not self.targets:
            return None
        x = args[0] if args else kwargs["input_"]
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


def add_adapters(chunks: list, lora_cfg, hf, seed: int) -> None:
    """Freeze every parameter of ``chunks`` and add the adapters ``lora_cfg`` (``model.lora``)
    targets to each decoder layer of this pipeline stage. Call before DDP and the optimizer are
    built. ConfigError for MLP targets on an MoE model (its experts have no adapters)."""
    targets = list(lora_cfg.targets)
    mlp_targets = [t for t in targets if t in ("gate_proj", "up_proj", "down_proj")]
    if mlp_targets and getattr(hf, "num_experts", None):
        raise ConfigError(f"model.lora.targets={targets}: {mlp_targets} name the MLP, which is a mixture of experts "
                          f"in this model ({hf.num_experts} experts); LoRA on experts is not supported, target "
                          "the attention only: model.lora.targets=[q_proj,k_proj,v_proj,o_proj]")
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        for layer in chunk.decoder.layers:
            for name, (parent_name, parts, _) in LINEARS.items():
                if not set(parts) & set(targets):
                    continue
                parent = getattr(layer, parent_name)
                adapter = LoRALinear(getattr(parent, name), name, targets, rank=lora_cfg.rank,
                                     scaling=lora_cfg.scaling, dropout=lora_cfg.dropout,
                                     layer=layer.layer_number - 1, seed=seed, hf=hf)
                parent.add_module(name + SUFFIX, adapter)


def adapter_modules(chunks: list) -> Iterator[LoRALinear]:
    """Every :class:`LoRALinear` of ``chunks`` (unwrapped or DDP-wrapped), in module order."""
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, LoRALinear):
                yield m


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key is an adapter's (``...linear_qkv_lora.q_proj_A``; its optimizer too)."""
    return f"{SUFFIX}." in key


def has_adapters(chunks: list) -> bool:
    return next(adapter_modules(chunks), None) is not None


@contextlib.contextmanager
def adapters_disabled(chunks: list):
    """Inside, every adapter of ``chunks`` is skipped: the chunks compute exactly the base model."""
    mods = list(adapter_modules(chunks))
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
