"""Row 6: a Qwen3-MoE-shaped model's bf16 path against the CPU fp32 reference, with routing replayed.

Why replay: the router picks each token's top-k experts by comparing scores; two near-tied scores
(certain among thousands of tokens x layers) can swap order under the bf16 path's activation
rounding, and a token sent to another expert moves its log-prob by far more than any rounding --
a flipped decision, not a numerical error, which would make row 1's tolerance meaningless (or make
the check pass or fail by the luck of the draw). Router weights with wide margins cannot rule this
out: the margins depend on the hidden states, which the model makes. So both paths replay the
same expert ids (``algo.routing_replay=rollout``, the production replay machinery of
``actor/routing_replay.py`` through Megatron-Core's ``RouterReplay``): the ids HF transformers'
fp32 forward picks on CPU (``models.save_routed_experts``; Megatron's fp32 path matches HF to
1e-5 on Qwen3-MoE, ``tests/actor/test_moe.py``), computed once and given to the CPU fp32
reference and to the device path alike. The routing weights are still each path's own router
softmax at those ids, so the router's arithmetic stays under the check; only the discrete choice is
pinned. The negative control breaks exactly what replay feeds: every replayed id shifted by one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .env import spec_name
from .models import make_random_hf, save_routed_experts
from .numerics import bf16_and_reference, comparison_rows
from .report import Row

MOE_CHECK = "MoE actor bf16 vs CPU fp32"


def _moe_inputs(smoke: bool, work: Path) -> tuple[dict, Path, dict]:
    """The random Qwen3-MoE model (every layer MoE, GQA, QK norm, top-2 of 8 renormalised) and the batch."""
    shape = dict(hidden_size=64 if smoke else 512, num_hidden_layers=2 if smoke else 4,
                 num_attention_heads=4 if smoke else 8, num_key_value_heads=2, head_dim=16 if smoke else 64,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32 if smoke else 512,
                 intermediate_size=128 if smoke else 1408, norm_topk_prob=True, decoder_sparse_step=1,
                 mlp_only_layers=[], vocab_size=256 if smoke else 8192, max_position_embeddings=512 if smoke else 2048,
                 tie_word_embeddings=False)
    # weights ~ N(0, 1/H) as row 1 (router included: its logits then spread by ~1, experts well mixed)
    hf = make_random_hf(work / "moe-model", family="qwen3_moe", seed=0, init_std=shape["hidden_size"] ** -0.5,
                        **shape)
    spec = dict(n=4 if smoke else 8, vocab=shape["vocab_size"], prompt=(4, 12) if smoke else (16, 64),
                response=(6, 16) if smoke else (32, 160), seed=3)
    spec["routed"] = str(save_routed_experts(hf, spec, work / "moe-routed.npz"))
    return shape, hf, spec


def row_moe_numerics(smoke: bool, work: Path) -> list[Row]:
    shape, hf, spec = _moe_inputs(smoke, work)
    ref_work = work / "moe-reference"  # its own batch and reference files (row 1's are in ``work``)
    ref_work.mkdir(exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dev, ref = bf16_and_reference(hf, spec, ref_work)
    what = (f"L={shape['num_hidden_layers']} H={shape['hidden_size']} V={shape['vocab_size']}, "
            f"{shape['num_experts']} experts top-{shape['num_experts_per_tok']}, EP=1, "
            f"{spec['n']} seqs, {len(ref['logp'])} resp tokens")
    spec_used = spec_name() if device == "cuda" else "te-twin"
    experts = "TEGroupedMLP" if spec_used == "transformer-engine" else "LocalGroupedMLP"
    return comparison_rows(f"MoE actor {device} bf16 ({spec_used} spec, {experts}, replayed routing) vs CPU fp32",
                           what, ref, dev, control=True)
