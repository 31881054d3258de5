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


def peft_config(lora_cfg, base_model_name_or_path: str) -> dict[str, Any]:
    """``adapter_config.json`` of ``model.lora``: the fields of peft's ``LoraConfig`` the adapter
    needs (the rest take peft's defaults when it loads the file)."""
    rank = int(lora_cfg.rank)
    alpha = float(lora_cfg.alpha) if lora_cfg.alpha is not None else 2.0 * rank  # model.lora.alpha's default
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
            "lora_alpha": int(alpha) if alpha.is_integer() else alpha, "lora_dropout": float(lora_cfg.dropout),
            "target_modules": sorted(lora_cfg.targets), "base_model_name_or_path": base_model_name_or_path,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "modules_to_save": None, "layers_to_transform": None, "use_rslora": False, "use_dora": False}


def _whole(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` with its tensor-parallel shards joined (itself when it is not split)."""
    if not getattr(t, "tensor_model_parallel", False) or group.size() == 1:
        return t.detach()
    parts = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=t.partition_dim)


def _stage_tensors(chunks: list) -> list[tuple[int, int, str, torch.Tensor]]:
    """``(layer, order, peft name, whole tensor on CPU)`` of this stage's adapters (collective over TP)."""
    from megatron_m2po.actor.lora import LINEARS, adapter_modules

    out = []
    order = {name: i for i, name in enumerate(LINEARS)}
    for m in adapter_modules(chunks):
        parent = LINEARS[m.name][0]
        for j, part in enumerate(m.targets):
            for which, t in zip("AB", m.pair(part)):
                key = (order[m.name], j, which)
                out.append((m.layer, key, peft_name(m.layer, parent, part, which), _whole(t, m.tp_group).cpu()))
    return out


def stage_adapter_tensors(chunks: list) -> list[tuple[str, torch.Tensor]]:
    """This pipeline stage's adapters, whole, as ``(peft name, CPU tensor)`` (collective over its
    tensor-parallel group): what :func:`merge_adapters` folds into the stage's HF weights."""
    return [(name, t) for _, _, name, t in _stage_tensors(chunks)]


def peft_adapter_tensors(chunks: list) -> Optional[list[tuple[str, torch.Tensor]]]:
    """Every adapter matrix of the model, whole, as ``(peft name, CPU tensor)`` in layer order, on
    global rank 0; ``None`` on the other ranks. Collective: every rank calls it (tensor-parallel
    all-gathers everywhere, then a gather over the pipeline group of global rank 0)."""
    from megatron.core import parallel_state as ps

    mine = _stage_tensors(chunks)
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

    tensors = peft_adapter_tensors(chunks)
    if tensors is None:
        return None
    if not tensors:
        raise ValueError("the model has no LoRA adapters to export: set model.lora.rank > 0")
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in tensors}, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config(lora_cfg, base_model_name_or_path), indent=2) + "\n")
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
    for name, w in weights:
        ab = pairs.get(name)
        if ab is not None:
            delta = ab["B"].float().to(w.device) @ ab["A"].float().to(w.device)
            w = (w.float() + scaling * delta).to(w.dtype)
        yield name, w
