"""Random Qwen2 HF models (weights stored in bf16: both paths load identical values), batches, and the
actor's log-probs, entropies and one update's gradient norm on them."""

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
    """A Qwen2 HF directory (config.json + model.safetensors) with random bf16 weights.

    Shapes come from transformers' own module tree built on the meta device, so every tensor
    the HF checkpoint has is written, with norms near 1 and biases non-zero (every mapping used).
    """
    import transformers as tr
    from safetensors.torch import save_file

    if (out_dir / "config.json").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = tr.Qwen2Config(**shape)
    with torch.device("meta"):
        meta = tr.Qwen2ForCausalLM(cfg)
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
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out_dir)
    return out_dir


def make_batch(n: int, *, vocab: int, prompt: tuple[int, int], response: tuple[int, int], seed: int):
    """Deterministic samples (prompt / response token ids, advantages, loss masks)."""
    from megatron_m2po.actor.batch import Sample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = int(rng.integers(prompt[0], prompt[1] + 1))
        r = int(rng.integers(response[0], response[1] + 1))
        out.append(Sample(uid=f"g{i}", prompt_ids=rng.integers(0, vocab, p), response_ids=rng.integers(0, vocab, r),
                          behav_logprobs=np.zeros(r, np.float32), advantages=np.float32(rng.standard_normal()),
                          loss_mask=np.ones(r, np.uint8), versions=np.zeros(r, np.int64)))
    return out


def _actor_config(hf_dir: Path, dtype: str, *, lr: float = 1e-5, mbs: int = 1, parallel: Optional[dict] = None):
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
    return cfg


def actor_outputs(hf_dir: Path, dtype: str, samples: list, *, noise_seed: int = 7, calibrate: bool = False,
                  parallel: Optional[dict] = None) -> dict[str, np.ndarray]:
    """Log-probs and entropies of ``samples``, then one M2PO update's gradient norm, on this process's device.

    With ``calibrate`` (the fp32 reference) also the log-probs and entropies after one
    bf16-sized relative error (2^-8, random sign) on every weight: the error scale of the
    tolerance (module docstring). The weights are restored before the update. ``parallel``:
    ``ParallelConfig`` fields to set (the packed row's TP=2 + SP layout); with several ranks every
    rank returns the same values (the actor gathers log-probs to all ranks).
    """
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch

    cfg = _actor_config(hf_dir, dtype, parallel=parallel)
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
            # negative control: a subtle defect (the q/k/v biases dropped) must be many units away
            biases = [p for c in actor.chunks for n, p in c.named_parameters() if n.endswith("linear_qkv.bias")]
            bsaved = [b.detach().clone() for b in biases]
            with torch.no_grad():
                for b in biases:
                    b.zero_()
            dlps = actor.compute_logprobs(RolloutBatch(samples))
            with torch.no_grad():
                for b, v in zip(biases, bsaved):
                    b.copy_(v)
            extra = {"logp_perturbed": np.concatenate(plps), "entropy_perturbed": np.concatenate(pents),
                     "logp_defect": np.concatenate(dlps), "n_biases": np.array([len(biases)])}
        rng = np.random.default_rng(noise_seed)
        for s, lp in zip(samples, lps):  # behaviour = own log-probs + fixed noise (module docstring)
            s.behav_logprobs = (lp + BEHAV_NOISE * rng.standard_normal(lp.shape)).astype(np.float32)
        metrics = actor.train_step(RolloutBatch(samples), num_minibatches=1)[0]
    finally:
        actor.close()
    return {"logp": np.concatenate(lps), "entropy": np.concatenate(ents),
            "grad_norm": np.array([metrics["optim/grad_norm"]]),
            "mask_frac": np.array([metrics.get("m2po/mask_frac", 0.0)]), **extra}
