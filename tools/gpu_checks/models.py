"""Random Qwen2 / Qwen3-MoE HF models (weights stored in bf16: both paths load identical values), batches
(with replayed expert ids for the MoE row), and the actor's log-probs, entropies and one update's gradient
norm on them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

# row 1 (module docstring): the bf16 path's deviation from fp32, in units of the deviation that
# one bf16-sized relative error on every weight causes in the fp32 path
BF16_U = 2.0 ** -8
BEHAV_NOISE = 0.05


def make_random_qwen2(out_dir: Path, *, seed: int, init_std: float, **shape: Any) -> Path:
    """A Qwen2 HF directory (config.json + model.safetensors) with random bf16 weights (:func:`make_random_hf`)."""
    return make_random_hf(out_dir, family="qwen2", seed=seed, init_std=init_std, **shape)


def make_random_hf(out_dir: Path, *, family: str, seed: int, init_std: float, **shape: Any) -> Path:
    """A ``family`` (``qwen2`` or ``qwen3_moe``) HF directory (config.json + model.safetensors) with
    random bf16 weights.

    Shapes come from transformers' own module tree built on the meta device, so every tensor
    the HF checkpoint has is written (Qwen3-MoE: every expert and router), with norms near 1 and
    biases non-zero (every mapping used).
    """
    import transformers as tr
    from safetensors.torch import save_file

    if (out_dir / "config.json").is_file():
        return out_dir
    classes = {"qwen2": (tr.Qwen2Config, tr.Qwen2ForCausalLM), "qwen3_moe": (tr.Qwen3MoeConfig, tr.Qwen3MoeForCausalLM)}
    if family not in classes:
        raise ValueError(f"family={family!r}: random models are built for {sorted(classes)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = classes[family][0](**shape)
    with torch.device("meta"):
        meta = classes[family][1](cfg)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # 1.5B normal samples: seconds on a GPU
    g = torch.Generator(device=dev).manual_seed(seed)
    tensors = {}
    for name, p in meta.named_parameters():  # a tied lm_head is the embedding: listed once
        t = torch.randn(p.shape, generator=g, device=dev)
        if "norm" in name:
            t = 1.0 + 0.1 * t
        elif name.endswith(".bias"):
            t = 0.1 * t
        else:
            t = init_std * t
        tensors[name] = t.to(torch.bfloat16).cpu().contiguous()
    tensors = _per_expert_names(tensors)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out_dir)
    return out_dir


def _per_expert_names(tensors: dict) -> dict:
    """transformers 5 fuses each layer's experts into ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate
    rows first) and ``mlp.experts.down_proj`` ``[E, H, I]``; a checkpoint stores them per expert
    (``mlp.experts.{e}.gate_proj / up_proj / down_proj.weight``, the released Qwen3-MoE layout that
    mbridge reads and transformers fuses back on load)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def make_batch(n: int, *, vocab: int, prompt: tuple[int, int], response: tuple[int, int], seed: int,
               routed: Optional[str] = None):
    """Deterministic samples (prompt / response token ids, advantages, loss masks); ``routed``: an
    ``.npz`` of :func:`save_routed_experts` whose expert ids the samples carry (routing replay)."""
    from megatron_m2po.actor.batch import Sample

    rng = np.random.default_rng(seed)
    ids = dict(np.load(routed)) if routed else {}
    out = []
    for i in range(n):
        p = int(rng.integers(prompt[0], prompt[1] + 1))
        r = int(rng.integers(response[0], response[1] + 1))
        out.append(Sample(uid=f"g{i}", prompt_ids=rng.integers(0, vocab, p), response_ids=rng.integers(0, vocab, r),
                          behav_logprobs=np.zeros(r, np.float32), advantages=np.float32(rng.standard_normal()),
                          loss_mask=np.ones(r, np.uint8), versions=np.zeros(r, np.int64),
                          routed_experts=ids.get(f"g{i}")))
    return out


def save_routed_experts(hf_dir: Path, spec: dict, out: Path) -> Path:
    """The top-k expert ids HF transformers' fp32 forward (CPU) picks in every MoE layer for every
    position but the last of ``spec``'s samples (``Sample.routed_experts``: ``[P + R - 1, layers,
    top_k]``), written to ``out`` once; both paths of the MoE row replay them (``numerics.py``)."""
    import transformers as tr

    if out.is_file():
        return out
    model = tr.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    k = model.config.num_experts_per_tok
    logits: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(  # the router's logits, whatever else it returns
        lambda m, i, o: logits.append((o[0] if isinstance(o, tuple) else o).detach()))
        for layer in model.model.layers]
    ids = {}
    try:
        for s in make_batch(**spec):
            logits.clear()
            with torch.no_grad():
                model(torch.as_tensor(np.concatenate([s.prompt_ids, s.response_ids]))[None])
            top = torch.stack([lg.reshape(-1, lg.shape[-1]).topk(k, dim=-1).indices for lg in logits], dim=1)
            ids[s.uid] = top[:-1].numpy().astype(np.int64)
    finally:
        for h in hooks:
            h.remove()
    np.savez(out, **ids)
    return out


def _actor_config(hf_dir: Path, dtype: str, *, lr: float = 1e-5, mbs: int = 1, parallel: Optional[dict] = None,
                  replay: bool = False):
    from megatron_m2po.config import Config

    cfg = Config()
    cfg.model.hf_path = str(hf_dir)
    cfg.model.dtype = dtype
    cfg.parallel.micro_batch_size = mbs
    for k, v in (parallel or {}).items():
        setattr(cfg.parallel, k, v)
    cfg.algo.loss = "m2po"
    cfg.optim.lr = lr
    cfg.rollout.temperature = 1.0
    if replay:  # the samples carry expert ids: every forward replays them (actor/routing_replay.py)
        cfg.algo.routing_replay = "rollout"
        cfg.rollout.return_routed_experts = True
    return cfg


def actor_outputs(hf_dir: Path, dtype: str, samples: list, *, noise_seed: int = 7, calibrate: bool = False,
                  parallel: Optional[dict] = None) -> dict[str, np.ndarray]:
    """Log-probs and entropies of ``samples``, then one M2PO update's gradient norm, on this process's device.

    With ``calibrate`` (the fp32 reference) also the log-probs and entropies after one
    bf16-sized relative error (2^-8, random sign) on every weight: the error scale of the
    tolerance (module docstring), and the negative control's log-probs (:func:`_negative_control`).
    The weights are restored before the update. ``parallel``:
    ``ParallelConfig`` fields to set (the packed row's TP=2 + SP layout); with several ranks every
    rank returns the same values (the actor gathers log-probs to all ranks). Samples that carry
    ``routed_experts`` (the MoE row) are run with routing replay (``algo.routing_replay=rollout``).
    """
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch

    replay = samples[0].routed_experts is not None
    cfg = _actor_config(hf_dir, dtype, parallel=parallel, replay=replay)
    actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=10))
    extra: dict[str, np.ndarray] = {}
    try:
        lps, ents = actor.compute_logprobs(RolloutBatch(samples), with_entropy=True)
        if calibrate:
            params = [p for c in actor.chunks for p in c.parameters()]
            saved = [p.detach().clone() for p in params]
            g = torch.Generator().manual_seed(noise_seed)
            with torch.no_grad():
                for p in params:
                    sign = torch.randint(0, 2, p.shape, generator=g).to(p.device, p.dtype) * 2 - 1
                    p.mul_(1 + BF16_U * sign)
            plps, pents = actor.compute_logprobs(RolloutBatch(samples), with_entropy=True)
            with torch.no_grad():
                for p, v in zip(params, saved):
                    p.copy_(v)
            extra = {"logp_perturbed": np.concatenate(plps), "entropy_perturbed": np.concatenate(pents),
                     **_negative_control(actor, samples, replay)}
        rng = np.random.default_rng(noise_seed)
        for s, lp in zip(samples, lps):  # behaviour = own log-probs + fixed noise (module docstring)
            s.behav_logprobs = (lp + BEHAV_NOISE * rng.standard_normal(lp.shape)).astype(np.float32)
        metrics = actor.train_step(RolloutBatch(samples), num_minibatches=1)[0]
    finally:
        actor.close()
    return {"logp": np.concatenate(lps), "entropy": np.concatenate(ents),
            "grad_norm": np.array([metrics["optim/grad_norm"]]),
            "mask_frac": np.array([metrics.get("m2po/mask_frac", 0.0)]), **extra}


def _negative_control(actor, samples: list, replay: bool) -> dict[str, np.ndarray]:
    """The fp32 log-probs with a subtle defect, which must land many units away; everything is restored.

    Dense (row 1): the q/k/v biases dropped. MoE with routing replay (row 6): every replayed expert id
    ``e`` shifted to ``(e + 1) mod E`` -- a mis-numbered expert layout, the defect an expert-weight
    mapping or replay index bug would cause (Qwen3 has no q/k/v bias to drop)."""
    from megatron_m2po.actor.batch import RolloutBatch

    if replay:
        n_exp = int(actor.chunks[0].config.num_moe_experts)
        saved = [s.routed_experts for s in samples]
        for s in samples:
            s.routed_experts = (s.routed_experts + 1) % n_exp
        try:
            dlps = actor.compute_logprobs(RolloutBatch(samples))
        finally:
            for s, v in zip(samples, saved):
                s.routed_experts = v
        return {"logp_defect": np.concatenate(dlps), "control": np.array(
            f"fp32 with replayed experts shifted e -> e+1 mod {n_exp}|{saved[0].shape[1]} MoE layers")}
    biases = [p for c in actor.chunks for n, p in c.named_parameters() if n.endswith("linear_qkv.bias")]
    bsaved = [b.detach().clone() for b in biases]
    with torch.no_grad():
        for b in biases:
            b.zero_()
    dlps = actor.compute_logprobs(RolloutBatch(samples))
    with torch.no_grad():
        for b, v in zip(biases, bsaved):
            b.copy_(v)
    return {"logp_defect": np.concatenate(dlps),
            "control": np.array(f"fp32 with q/k/v biases dropped|{len(biases)} bias tensors")}
