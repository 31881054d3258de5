"""LoRA adapters (``model.lora``, actor/lora.py) as an HF peft adapter: names, config, directory.

:func:`peft_adapter_tensors` gathers every adapter of the model -- tensor-parallel shards joined
along the axis they were split on, pipeline stages collected on global rank 0 -- under peft's
names (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``, ``...mlp.down_proj.lora_B.weight``),
which is what ``peft.PeftModel.from_pretrained`` loads and what an engine's adapter push sends;
:func:`merge_adapters` folds them into HF weights (``W + s B A``, peft's ``merge_and_unload``) for a
merged model or a full-weight push.
:func:`write_peft_dir` writes them as ``adapter_model.safetensors`` with ``adapter_config.json``
(peft's ``LoraConfig`` fields), atomically. The peft equality tests (tests/actor/test_lora.py) load
what these write into peft on the HF model and compare log-probs and gradients with the actor.

MoE experts' adapters (``actor/lora.py`` ``ExpertLoRA``: per expert ``e`` a gate_up pair
``A_e [r, hidden]``, ``B_e [2 ffn, r]`` and a down pair) are gathered over the expert-parallel
group and named in one of two layouts:

* ``"sglang"`` (the engines' pushes and the merge): per expert, as SGLang 0.5.23 reads an
  adapter (``lora/mem_pool.py``: ``experts.{e}.`` then the module; ``lora/lora.py``
  ``normalize_gate_up_proj`` stacks a fused ``gate_up_proj`` A twice for gate and up):
  ``...layers.{i}.mlp.experts.{e}.gate_up_proj.lora_A.weight`` ``[r, hidden]``, ``...lora_B.weight``
  ``[2 ffn, r]``, ``...experts.{e}.down_proj.lora_{A,B}.weight``;
* ``"peft"`` (the adapter directory users load): peft 0.21's ``target_parameters`` LoRA on
  transformers' fused ``experts.gate_up_proj [E, 2 ffn, hidden]`` / ``experts.down_proj`` (one
  ``lora.ParamWrapper`` each, gate_up the inner one: ``...mlp.experts.base_layer.lora_A.weight``,
  down the outer: ``...mlp.experts.lora_A.weight``), A ``[E r, in]`` with expert ``e``'s rows at
  ``e r .. e r + r`` and B ``[out, E r]`` with its column ``j`` at ``j E + e``
  (``peft/tuners/lora/layer.py`` ``ParamWrapper.get_delta_weight``: ``A.reshape(E, r, in)``,
  ``B.reshape(out, r, E)``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["HF_PARENT", "peft_name", "peft_config", "stage_adapter_tensors", "peft_adapter_tensors", "write_peft_dir", "merge_adapters"]

# Megatron's parent module of a linear -> the HF module that holds the projection
HF_PARENT = {"self_attention": "self_attn", "mlp": "mlp"}
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def peft_name(layer: int, parent: str, part: str, which: str) -> str:
    """peft's saved name of adapter matrix ``which`` (``A`` / ``B``) of HF projection ``part``."""
    return f"base_model.model.model.layers.{layer}.{HF_PARENT[parent]}.{part}.lora_{which}.weight"


EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # peft target_parameters


def peft_config(lora_cfg, base_model_name_or_path: str, *, experts: bool = False) -> dict[str, Any]:
    """``adapter_config.json`` of ``model.lora``: the fields of peft's ``LoraConfig`` the adapter
    needs (the rest take peft's defaults when it loads the file). ``experts``: a peft directory of
    an MoE model with expert adapters: gate / up / down leave ``target_modules`` (peft would rewrite
    those names on transformers' fused experts, at rank 2r) for ``target_parameters``; the engines'
    config (``experts`` False) keeps the module names, which SGLang normalises to
    ``gate_up_proj`` / ``down_proj``."""
    from megatron_m2po.actor.lora import EXPERT_PARTS

    rank = int(lora_cfg.rank)
    alpha = float(lora_cfg.alpha) if lora_cfg.alpha is not None else 2.0 * rank  # model.lora.alpha's default
    modules = sorted(t for t in lora_cfg.targets if not (experts and t in EXPERT_PARTS))
    out = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
           "lora_alpha": int(alpha) if alpha.is_integer() else alpha, "lora_dropout": float(lora_cfg.dropout),
           "target_modules": modules, "base_model_name_or_path": base_model_name_or_path,
           "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
           "modules_to_save": None, "layers_to_transform": None, "use_rslora": False, "use_dora": False}
    if experts:
        out["target_parameters"] = list(EXPERT_PARAMETERS)
    return out


def _whole(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` with its tensor-parallel shards joined (itself when it is not split)."""
    if not getattr(t, "tensor_model_parallel", False) or group.size() == 1:
        return t.detach()
    parts = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=t.partition_dim)


def _all_experts(mine: torch.Tensor) -> torch.Tensor:
    """``[num_experts, ...]``: this rank's local experts' stacked tensor ``[n, ...]`` and every other
    expert-parallel rank's, by global expert index (collective over the expert-parallel group)."""
    from megatron.core import parallel_state as ps

    group = ps.get_expert_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return mine.clone()  # a copy, never the live parameter
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine.contiguous(), group=group)
    return torch.cat(parts, 0)


def _expert_tensors(m, layout: str) -> list[tuple[tuple, str, torch.Tensor]]:
    """``(order key, name, CPU tensor)`` of one layer's expert adapters in ``layout`` (module docstring)."""
    out = []
    prefix = f"base_model.model.model.layers.{m.layer}.mlp.experts"
    for k, pair in enumerate(m.PAIRS):  # gate_up, down
        a, b = (_all_experts(getattr(m, f"{pair}_{which}").detach()).cpu() for which in "AB")
        module = "gate_up_proj" if pair == "gate_up" else "down_proj"
        if layout == "sglang":
            for e in range(a.shape[0]):
                for which, t in (("A", a[e]), ("B", b[e])):
                    out.append(((2, e, k, which), f"{prefix}.{e}.{module}.lora_{which}.weight", t))
        else:  # peft's ParamWrapper: A [E r, in] expert-major, B [out, E r] column j E + e
            n, r = a.shape[0], a.shape[1]
            wrapper = f"{prefix}.base_layer" if pair == "gate_up" else prefix
            out.append(((2, 0, k, "A"), f"{wrapper}.lora_A.weight", a.reshape(n * r, a.shape[2])))
            out.append(((2, 0, k, "B"), f"{wrapper}.lora_B.weight", b.permute(1, 2, 0).reshape(b.shape[1], r * n)))
    return out


def _stage_tensors(chunks: list, layout: str = "peft") -> list[tuple[int, tuple, str, torch.Tensor]]:
    """``(layer, order, name, whole tensor on CPU)`` of this stage's adapters (collective over TP
    and over the expert-parallel group); expert adapters in ``layout`` (module docstring)."""
    from megatron_m2po.actor.lora import LINEARS, adapter_modules, expert_adapter_modules

    out = []
    order = {name: i for i, name in enumerate(LINEARS)}
    for m in adapter_modules(chunks):
        parent = LINEARS[m.name][0]
        for j, part in enumerate(m.targets):
            for which, t in zip("AB", m.pair(part)):
                key = (0, order[m.name], j, which)
                out.append((m.layer, key, peft_name(m.layer, parent, part, which), _whole(t, m.tp_group).cpu()))
    for m in expert_adapter_modules(chunks):
        out.extend((m.layer, key, name, t) for key, name, t in _expert_tensors(m, layout))
    return out


def stage_adapter_tensors(chunks: list) -> list[tuple[str, torch.Tensor]]:
    """This pipeline stage's adapters, whole, as ``(name, CPU tensor)`` (collective over its
    tensor-parallel and expert-parallel groups; experts per expert, the ``"sglang"`` layout):
    what :func:`merge_adapters` folds into the stage's HF weights."""
    return [(name, t) for _, _, name, t in _stage_tensors(chunks, "sglang")]


def peft_adapter_tensors(chunks: list, layout: str = "peft") -> Optional[list[tuple[str, torch.Tensor]]]:
    """Every adapter matrix of the model, whole, as ``(name, CPU tensor)`` in layer order, on
    global rank 0; ``None`` on the other ranks. Collective: every rank calls it (tensor- and
    expert-parallel all-gathers everywhere, then a gather over the pipeline group of global rank 0).
    ``layout``: how expert adapters are named, ``"peft"`` (a peft directory) or ``"sglang"`` (an
    engine push); the same for every other adapter."""
    from megatron.core import parallel_state as ps

    mine = _stage_tensors(chunks, layout)
    pp = ps.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp) > 1:
        if dist.get_global_rank(pp, 0) != 0:
            return None  # another replica's or TP rank's stages: global rank 0 collects its own group's
        parts: Optional[list] = [None] * dist.get_world_size(pp) if dist.get_rank() == 0 else None
        dist.gather_object(mine, parts, dst=0, group=pp)
        if dist.get_rank() != 0:
            return None
        mine = [x for part in parts for x in part]
    elif dist.get_rank() != 0:
        return None
    mine.sort(key=lambda x: (x[0], x[1]))
    return [(name, t) for _, _, name, t in mine]


def write_peft_dir(chunks: list, lora_cfg, out_dir: str, *, base_model_name_or_path: str) -> Optional[Path]:
    """Write the adapters as a peft adapter directory ``out_dir`` (global rank 0; replaces an
    existing one through a temporary directory). Collective; returns the path on rank 0, else None."""
    from safetensors.torch import save_file

    from megatron_m2po.actor.lora import expert_adapter_modules

    tensors = peft_adapter_tensors(chunks)
    experts = next(expert_adapter_modules(chunks), None) is not None  # the same on every rank
    if tensors is None:
        return None
    if not tensors:
        raise ValueError("the model has no LoRA adapters to export: set model.lora.rank > 0")
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in tensors}, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = peft_config(lora_cfg, base_model_name_or_path, experts=experts)
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def merge_adapters(weights, adapters: list[tuple[str, torch.Tensor]], scaling: float):
    """``(hf_name, tensor)`` of ``weights`` with the adapters folded in: ``W + scaling * B @ A`` for
    each projection ``adapters`` (peft names, :func:`peft_adapter_tensors`) has, computed in fp32
    and cast back to ``W``'s dtype (what peft's ``merge_and_unload`` computes); other tensors as
    they are. ``weights`` may be any iterable of pairs, e.g. one stage's HF weights."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    prefix = "base_model.model."
    for name, t in adapters:
        base, which = name[len(prefix):].rsplit(".lora_", 1)
        pairs.setdefault(base + ".weight", {})[which.split(".")[0]] = t
    # an expert's fused gate_up pair (the "sglang" layout) acts on its HF gate_proj and up_proj:
    # rows [:ffn] of B A are gate's, [ffn:] up's
    halves: dict[str, tuple[dict[str, torch.Tensor], int]] = {}
    for base in [b for b in pairs if b.endswith(".gate_up_proj.weight")]:
        ab = pairs.pop(base)
        for h, part in enumerate(("gate_proj", "up_proj")):
            halves[base.replace(".gate_up_proj.", f".{part}.")] = (ab, h)
    for name, w in weights:
        ab, half = pairs.get(name), None
        if ab is None and name in halves:
            ab, half = halves[name]
        if ab is not None:
            delta = ab["B"].float().to(w.device) @ ab["A"].float().to(w.device)
            if half is not None:
                delta = delta.chunk(2, 0)[half]
            w = (w.float() + scaling * delta).to(w.dtype)
        yield name, w
