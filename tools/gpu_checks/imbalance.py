"""Row 7: MoE routing imbalance -- token copies per expert-parallel rank on a real MoE forward.

The planner assumes the hottest EP rank receives ``model.moe.routing_imbalance`` x the mean token
copies of a dispatch (``plan/routing.py``); RL runs dropless with the load-balancing loss off, so
only the checkpoint's router decides how hot a rank gets. This row measures it: prompts (the
DeepScaleR file of ``--moe-data``, else the synthetic arithmetic task) under the recipes' template,
responses the model samples itself at T=1 (RL trains on its own samples, whose routing differs from
the prompts'), then one forward per sequence with a hook on every layer's router (``mlp.gate``,
the module row 6 hooks) counting each token's top-k experts. Sequences fill dispatch groups of
``GROUP_TOKENS`` tokens (about one EP group's micro-batch tokens per layer); for each EP size in
``EP_SIZES`` dividing the experts, ``plan.routing.ep_imbalance`` groups the experts into ranks as
Megatron places them and takes max-over-ranks / mean.

Verdict: with a pretrained checkpoint (``--moe-model /models/Qwen3-30B-A3B``, bf16, about 61 GB on
one 80 GB GPU) PASS when the largest per-layer imbalance is at most the planner's default, FAIL
otherwise (raise ``model.moe.routing_imbalance`` and re-plan). The row's own random model, or the
tiny base (``--moe-model tiny``: upcycled with a random router), are INFO: their routers were never
trained, so their routing says nothing about a pretrained one's hot experts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .report import Row

IMBALANCE_CHECK = "MoE routing imbalance (token copies per EP rank)"
EP_SIZES = (2, 4, 8)
GROUP_TOKENS = 4096


def _model_dir(model: Optional[str], smoke: bool, work: Path) -> tuple[Path, str]:
    """(HF directory, what it is: "random" | "tiny" | "checkpoint")."""
    if model == "tiny":
        from megatron_m2po.config import ModelConfig
        from megatron_m2po.utils.hf_dir import resolve_model_path

        return Path(resolve_model_path(ModelConfig(hf_path="tiny", tiny_family="qwen3_moe"))), "tiny"
    if model:
        return Path(model).expanduser(), "checkpoint"
    from .moe import _moe_inputs  # row 6's random Qwen3-MoE (8 experts, top-2)

    return _moe_inputs(smoke, work)[1], "random"


def _prompts(tok, vocab: int, n: int, data: Optional[str], template: str, seed: int) -> list[list[int]]:
    if tok is None:  # a random model has no tokenizer: random prompt ids
        rng = np.random.default_rng(seed)
        return [list(map(int, rng.integers(0, vocab, int(rng.integers(16, 65))))) for _ in range(n)]
    from megatron_m2po.data.io import load_rows
    from megatron_m2po.data.synthetic import SyntheticTask
    from megatron_m2po.data.templates import render_prompt, tokenize_prompts

    rows = load_rows(data)[:n] if data else list(SyntheticTask().generate(n, f"imbalance:{seed}"))
    return tokenize_prompts([render_prompt(r["problem"], template, tok) for r in rows], template, tok)


def _sample(model, prompts: list[list[int]], *, max_new: int, pad: int, eos: Optional[int], batch: int,
            seed: int) -> list[list[int]]:
    """Each prompt followed by the model's own T=1 sample (up to and with its EOS)."""
    dev = next(model.parameters()).device
    torch.manual_seed(seed)
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        L = max(map(len, chunk))
        ids = torch.full((len(chunk), L), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for j, p in enumerate(chunk):  # left padding: generation continues every row at the end
            ids[j, L - len(p):] = torch.tensor(p)
            attn[j, L - len(p):] = 1
        with torch.no_grad():
            gen = model.generate(input_ids=ids.to(dev), attention_mask=attn.to(dev), do_sample=True, temperature=1.0,
                                 top_p=1.0, top_k=0, max_new_tokens=max_new, pad_token_id=pad, eos_token_id=eos)
        for j, p in enumerate(chunk):
            resp = gen[j, L:].tolist()
            if eos is not None and eos in resp:
                resp = resp[:resp.index(eos) + 1]
            out.append(list(p) + resp)
    return out


def dispatch_counts(model, seqs: list[list[int]], group_tokens: int = GROUP_TOKENS) -> np.ndarray:
    """``[groups, layers, num_experts]`` top-k token copies per expert: the model's routers on every
    token of ``seqs`` (one forward each), sequences filling groups of at least ``group_tokens``
    tokens in order (a last group under half of that is dropped unless it is the only one)."""
    layers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no MoE router (layer.mlp.gate): not an MoE model")
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    dev = next(model.parameters()).device
    logits: list[torch.Tensor] = []
    hooks = [g.register_forward_hook(lambda m, i, o: logits.append((o[0] if isinstance(o, tuple) else o).detach()))
             for g in layers]
    groups, cur, n_cur = [], np.zeros((len(layers), E), np.int64), 0
    try:
        for s in seqs:
            logits.clear()
            with torch.no_grad():
                model(torch.tensor(s, device=dev)[None])
            for li, lg in enumerate(logits):
                top = lg.reshape(-1, E).float().topk(k, dim=-1).indices
                cur[li] += torch.bincount(top.reshape(-1), minlength=E).cpu().numpy()
            n_cur += len(s)
            if n_cur >= group_tokens:
                groups.append(cur)
                cur, n_cur = np.zeros_like(cur), 0
    finally:
        for h in hooks:
            h.remove()
    if n_cur and (not groups or n_cur >= group_tokens / 2):
        groups.append(cur)
    return np.stack(groups)


def row_routing_imbalance(smoke: bool, work: Path, model: Optional[str] = None,
                          data: Optional[str] = None) -> list[Row]:
    import transformers as tr

    from megatron_m2po.config import MoEConfig
    from megatron_m2po.plan.routing import ep_imbalance

    path, kind = _model_dir(model, smoke, work)
    cuda = torch.cuda.is_available() and not smoke
    dtype = torch.bfloat16 if cuda else torch.float32
    hf = tr.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to("cuda" if cuda else "cpu").eval()
    tok = tr.AutoTokenizer.from_pretrained(str(path)) if (path / "tokenizer_config.json").is_file() else None
    n, max_new, batch = {"random": (32 if smoke else 64, 32, 32), "tiny": (4096, 16, 512),
                         "checkpoint": (8 if smoke else 64, 32 if smoke else 256, 16)}[kind]
    template = "synthetic" if kind == "tiny" else "paper"
    prompts = _prompts(tok, hf.config.vocab_size, n, data, template, seed=0)
    pad = (tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0)
    eos = tok.eos_token_id if tok is not None else None
    seqs = _sample(hf, prompts, max_new=max_new, pad=pad, eos=eos, batch=batch, seed=0)
    group = 512 if smoke and kind == "random" else GROUP_TOKENS
    counts = dispatch_counts(hf, seqs, group)
    E = hf.config.num_experts
    per_ep = [(ep, ep_imbalance(counts, ep)) for ep in EP_SIZES if E % ep == 0]
    if not per_ep:
        raise ValueError(f"{path}: {E} experts split over none of EP {EP_SIZES}")
    default = MoEConfig().routing_imbalance
    worst = max(d["layer_max"] for _, d in per_ep)
    result = "max/mean per layer " + ", ".join(
        f"EP={ep}: {d['layer_max']:.2f} (mean {d['layer_mean']:.2f}, all layers {d['stage_max']:.2f})" for ep, d in per_ep)
    shape = (f"{kind} {path.name}: {hf.config.num_hidden_layers} layers, {E} experts top-"
             f"{hf.config.num_experts_per_tok}; {len(seqs)} seqs, {sum(map(len, seqs))} tokens in {counts.shape[0]} "
             f"groups of >= {group}")
    if kind == "checkpoint":
        verdict = "PASS" if worst <= default else "FAIL"
        criterion = f"<= model.moe.routing_imbalance default {default:g}"
    else:
        verdict = "INFO"
        criterion = f"none: an untrained router (planner default {default:g}; --moe-model a checkpoint to measure)"
    values = {"kind": kind, "per_ep": {str(ep): d for ep, d in per_ep}, "worst": worst, "default": default,
              "counts_shape": list(counts.shape)}
    return [Row(IMBALANCE_CHECK, shape, result, criterion, verdict, values)]
