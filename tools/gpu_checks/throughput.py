"""Row 3: tokens/s and MFU of one M2PO update of a Qwen2.5-1.5B-shaped model."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .env import spec_name
from .models import _actor_config, make_batch, make_random_qwen2
from .report import Row

QWEN25_15B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6)


def train_flops(shape: dict, samples: list) -> float:
    """Useful FLOPs of one update: 3 x forward (matmuls, causal attention, the head on response rows)."""
    h, L = shape["hidden_size"], shape["num_hidden_layers"]
    heads, kv, f, V = (shape["num_attention_heads"], shape["num_key_value_heads"], shape["intermediate_size"],
                       shape["vocab_size"])
    d = h // heads
    matmul = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * f
    fwd = 0.0
    for s in samples:
        n, r = s.length, len(s.response_ids)
        fwd += 2 * n * matmul * L + 2 * r * h * V + 2 * heads * d * n * n * L
    return 3 * fwd


def row_throughput(smoke: bool, work: Path, peak: Optional[float], lora_rank: int = 0) -> list[Row]:
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch

    shape = (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=True)
             if smoke else QWEN25_15B)
    label = "tiny Qwen2 (smoke)" if smoke else "Qwen2.5-1.5B shape, random weights"
    hf = make_random_qwen2(work / ("tput-tiny" if smoke else "tput-1.5b"), seed=1, init_std=0.02, **shape)
    n, (p, r) = (4, (32, 96)) if smoke else (16, (512, 1536))
    samples = make_batch(n, vocab=shape["vocab_size"], prompt=(p, p), response=(r, r), seed=5)
    for s in samples:
        s.behav_logprobs = np.full(len(s.response_ids), -math.log(shape["vocab_size"]), np.float32)
    dtype = "bfloat16"
    cfg = _actor_config(hf, dtype)
    cfg.model.lora.rank = lora_rank  # --lora-rank: the adapters train, the base is frozen (actor/lora.py)
    actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))
    cuda = torch.cuda.is_available()
    try:
        actor.train_step(RolloutBatch(samples))  # warm-up: kernels, allocator, optimizer state
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(1 if smoke else 3):
            t0 = time.perf_counter()
            actor.train_step(RolloutBatch(samples))
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        mem = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None
    finally:
        actor.close()
    t = min(times)
    tokens = sum(s.length for s in samples)
    flops = train_flops(shape, samples)
    if lora_rank:
        label += f", LoRA rank {lora_rank} on {', '.join(cfg.model.lora.targets)}"
    what = (f"{label}: {n} x ({p}+{r}) tokens, TP=PP=DP=1, {dtype}, "
            f"{'CPU' if not cuda else spec_name() + ' spec'}")
    vals = dict(tokens_per_s=tokens / t, step_s=t, tflops=flops / t / 1e12, peak_mem_gib=mem)
    res = f"{tokens / t:,.0f} tokens/s, {t:.2f} s/update, {flops / t / 1e12:.1f} TFLOP/s useful"
    if mem is not None:
        res += f", peak {mem:.1f} GiB"
    if peak:
        mfu = flops / t / (peak * 1e12)
        vals["mfu"] = mfu
        rows = [Row("train step (M2PO update)", what, res + f", MFU {mfu:.1%} of {peak:g} TFLOP/s",
                    "reported (planner assumes gemm_eff 0.55)", "INFO", vals)]
    else:
        why = "no peak FLOP/s for a CPU" if not cuda else "unknown GPU: pass --peak-tflops"
        rows = [Row("train step (M2PO update)", what, res + f"; MFU skipped: {why}", "reported", "INFO", vals)]
    return rows
