"""A tiny Qwen3-MoE base for CPU runs, upcycled from a tiny dense Qwen3 (no training).

:func:`upcycle_to_qwen3_moe` turns a local HF Qwen3 directory (e.g. the warmed-up tiny base of
``utils/tiny_base.py`` with ``TinyModelSpec(family="qwen3")``) into a ``Qwen3MoeForCausalLM``
directory: every layer's dense MLP is copied into each of ``num_experts`` experts
(``moe_intermediate_size = intermediate_size``), and a seeded random router
(``mlp.gate.weight``, std ``router_std``) picks ``top_k`` of them with renormalised weights
(``norm_topk_prob=True``). With ``expert_noise=0`` the experts are identical and their
renormalised mixture is the dense MLP, so the MoE computes the dense model's function (up to
fp32 rounding) and starts RL with its accuracy; a small ``expert_noise`` makes the experts, and
therefore the routing, matter. This is sparse upcycling (Komatsuzaki et al., 2022) without the
continued pre-training.

The weights are written under the HF checkpoint's per-expert names
(``model.layers.{l}.mlp.experts.{e}.gate_proj / up_proj / down_proj.weight``), the layout of the
released Qwen3-MoE checkpoints, which mbridge's ``qwen3_moe`` bridge and SGLang 0.5.23's
``Qwen3MoeForCausalLM.load_weights`` read. Tokenizer files and ``m2po_tiny.json`` are copied.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

__all__ = ["upcycle_to_qwen3_moe"]

_COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
           "chat_template.jinja", "m2po_tiny.json")


def upcycle_to_qwen3_moe(dense_dir: str, out_dir: str, *, num_experts: int = 4, top_k: int = 2,
                         router_std: float = 0.02, expert_noise: float = 0.0, seed: int = 0) -> str:
    """Write the Qwen3-MoE upcycling of the Qwen3 model in ``dense_dir`` to ``out_dir`` (returned).

    Idempotent: an existing ``out_dir/config.json`` is kept. The directory is complete once
    ``config.json`` exists (written into a temporary sibling, renamed at the end)."""
    import glob

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, Qwen3MoeConfig

    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    dense = AutoConfig.from_pretrained(dense_dir)
    if dense.model_type != "qwen3":
        raise ValueError(f"{dense_dir} is a {dense.model_type!r} model: upcycling to Qwen3-MoE needs a qwen3 one")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in 1..num_experts={num_experts}")
    weights: dict = {}
    for f in sorted(glob.glob(os.path.join(dense_dir, "*.safetensors"))):
        weights.update(load_file(f))
    g = torch.Generator().manual_seed(seed)
    out: dict = {}
    for name, t in weights.items():
        if ".mlp." not in name:
            out[name] = t.contiguous()
            continue
        prefix, proj = name.split(".mlp.")  # proj: gate_proj.weight / up_proj.weight / down_proj.weight
        for e in range(num_experts):
            noise = expert_noise * torch.randn(t.shape, generator=g, dtype=t.dtype) if expert_noise else 0.0
            out[f"{prefix}.mlp.experts.{e}.{proj}"] = (t + noise).contiguous()
    for layer in range(dense.num_hidden_layers):
        out[f"model.layers.{layer}.mlp.gate.weight"] = router_std * torch.randn(
            num_experts, dense.hidden_size, generator=g, dtype=torch.float32)
    fields = {k: v for k, v in dense.to_dict().items()
              if k not in ("model_type", "architectures", "transformers_version", "auto_map")}
    cfg = Qwen3MoeConfig(**{**fields, "num_experts": num_experts, "num_experts_per_tok": top_k,
                            "moe_intermediate_size": dense.intermediate_size, "norm_topk_prob": True,
                            "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False,
                            "router_aux_loss_coef": 0.0})
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    dst = Path(out_dir)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for fname in _COPIED:
        if os.path.isfile(os.path.join(dense_dir, fname)):
            shutil.copy2(os.path.join(dense_dir, fname), tmp / fname)
    cfg.save_pretrained(str(tmp))  # config.json last: the directory is complete
    with open(tmp / "m2po_upcycled.json", "w") as f:
        json.dump({"from": os.path.abspath(dense_dir), "num_experts": num_experts, "top_k": top_k,
                   "router_std": router_std, "expert_noise": expert_noise, "seed": seed}, f, indent=1)
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)
    return out_dir
