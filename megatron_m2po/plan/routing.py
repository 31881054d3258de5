"""Routing terms of ``m2po plan`` that balanced-routing arithmetic leaves out (docs/planner.md, "MoE").

**Routing imbalance.** RL runs dropless with the load-balancing loss off (``model.moe``), so
nothing keeps the experts of one expert-parallel rank from being hot: that rank receives more
than the mean ``T_in k`` token copies of a dispatch, and its expert activations and the dispatch
buffer grow with it. The planner multiplies the hottest EP rank's received copies by
``model.moe.routing_imbalance`` (:func:`hottest_rank_factor`; at ``ep == 1`` one rank holds
every expert and receives exactly the mean). :func:`ep_imbalance` is the statistic behind the
default: dispatch counts per expert, grouped into EP ranks as Megatron places experts
(``num_experts / ep`` consecutive experts per rank), max over ranks / mean per rank.

**Routing replay volume.** With ``rollout.return_routed_experts`` every stored token carries
``layers x top_k`` expert ids as uint16 (``store/codec.py``), and the trainer never prunes consumed
groups (``RolloutStore.prune_consumed`` is not called by it): :func:`replay_volume` gives the bytes
per token, per step, over the staleness window and over the run, and the JSON an engine returns
per response (SGLang 0.5.23 ``meta_info["routed_experts"]``: base64 of int32 ``[P + R - 1,
layers, top_k]``). :func:`replay_report` turns them into the plan's notes and warnings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["MEASURED_TINY_IMBALANCE", "hottest_rank_factor", "ep_imbalance", "ReplayVolume", "replay_volume",
           "replay_report", "replay_lines", "STORE_WARN_GIB"]

# tools/gpu_check.py --cpu-smoke --only imbalance --moe-model tiny (tools/gpu_checks/imbalance.py): the
# tiny Qwen3-MoE base (4 experts, top-2, 2 layers; upcycled with a random router, standins/tiny_moe.py)
# on 4,096 synthetic-task prompts with the responses it sampled at T=1 (48,751 tokens), in 12 dispatch
# groups of 4,096 tokens: the largest max-over-EP-ranks / mean over layers and groups, per EP size (EP=8
# does not divide 4 experts). Means over layers and groups: 1.16 (EP=2), 1.38 (EP=4).
MEASURED_TINY_IMBALANCE = {2: 1.21, 4: 1.60}

STORE_WARN_GIB = 500.0
"""``m2po plan`` warns when routing replay's store bytes exceed this (GiB): a quarter of a 2 TB local
NVMe, the smallest common on GPU nodes, leaving the rest for checkpoints and weight versions
(``m2po plan --store-warn-gib`` for another disk)."""


def hottest_rank_factor(lay: Any) -> float:
    """Received token copies of the hottest EP rank / the mean: ``lay.routing_imbalance`` when the
    experts are split over ``ep > 1`` ranks, 1 when one rank holds them all."""
    return float(lay.routing_imbalance) if lay.ep > 1 else 1.0


def ep_imbalance(counts: Any, ep: int) -> dict[str, float]:
    """Imbalance of dispatch ``counts`` (``[groups, layers, num_experts]`` token copies per expert, a
    group being the tokens of one dispatch) when ``ep`` ranks hold ``num_experts / ep`` consecutive
    experts each (Megatron's placement: local experts ``rank * E/ep ...``).

    Returns ``layer_max`` (max over groups and layers of max-over-ranks / mean: what one layer's
    dispatch buffer and expert activations on the hottest rank see), ``layer_mean`` (its mean over
    groups and layers) and ``stage_max`` (per group, the layers' copies summed per rank, max / mean:
    what a rank stores over all its layers when different layers have different hot ranks)."""
    import numpy as np

    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 3 or c.shape[2] % ep:
        raise ValueError(f"counts of shape {c.shape}: need [groups, layers, num_experts] with num_experts divisible "
                         f"by ep={ep}")
    ranks = c.reshape(c.shape[0], c.shape[1], ep, c.shape[2] // ep).sum(-1)   # [groups, layers, ep]
    mean = ranks.mean(-1)
    if (mean <= 0).any():
        raise ValueError("a dispatch group with no tokens in some layer: the counts are empty")
    per_layer = ranks.max(-1) / mean
    stage = ranks.sum(1)
    return {"layer_max": float(per_layer.max()), "layer_mean": float(per_layer.mean()),
            "stage_max": float((stage.max(-1) / stage.mean(-1)).max())}


@dataclass(frozen=True)
class ReplayVolume:
    """What routing replay stores and moves for one run config (bytes)."""

    per_token: int              # stored: layers x top_k uint16
    tokens_per_step: float      # prompts_per_step x samples x (prompt + response) at full length
    mean_tokens_per_step: float  # the same at the cost model's mean length (docs/planner.md)
    window_steps: int           # steps of rollouts the staleness keeps unconsumed
    run_steps: int              # trainer.num_steps (consumed groups are not pruned)
    json_per_response: float    # the engine's answer for one full-length response (base64 int32)
    enabled: bool               # rollout.return_routed_experts

    @property
    def window_bytes(self) -> float:
        return self.per_token * self.tokens_per_step * self.window_steps

    @property
    def run_bytes(self) -> float:
        return self.per_token * self.tokens_per_step * self.run_steps

    @property
    def mean_run_bytes(self) -> float:
        return self.per_token * self.mean_tokens_per_step * self.run_steps


def replay_volume(cfg: Any, m: Any, mean_len_frac: float = 0.5) -> ReplayVolume:
    """:class:`ReplayVolume` of run config ``cfg`` on MoE shape ``m``. The window: the steps a
    schedule generates ahead of training, ``ceil((stale_k or store.max_staleness) / U) + 1`` with
    ``U`` updates per step, at most ``trainer.num_steps``."""
    t, r = cfg.trainer, cfg.rollout
    seq = cfg.data.max_prompt_tokens + r.max_new_tokens
    samples = t.prompts_per_step * r.n_samples_per_prompt
    lag = t.stale_k if t.mode == "stale_k" else (cfg.store.max_staleness if t.mode == "async" else 0)
    window = min(t.num_steps, math.ceil(lag / t.num_updates_per_step) + 1)
    entries = m.layers * m.top_k
    return ReplayVolume(per_token=2 * entries, tokens_per_step=samples * seq,
                        mean_tokens_per_step=samples * seq * mean_len_frac, window_steps=window,
                        run_steps=t.num_steps, json_per_response=4 * math.ceil(4 * entries * (seq - 1) / 3),
                        enabled=bool(r.return_routed_experts))


def _b(x: float) -> str:
    for unit, div in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if x >= div:
            return f"{x / div:.1f} {unit}"
    return f"{x:.0f} B"


def replay_report(v: ReplayVolume, warn_gib: float = STORE_WARN_GIB) -> tuple[list[str], list[str]]:
    """(notes, warnings) of ``m2po plan`` about routing replay's volume."""
    how = ("on (rollout.return_routed_experts=true)" if v.enabled
           else "off here; algo.routing_replay=rollout with rollout.return_routed_experts=true would add")
    notes = [f"routing replay {how}: {v.per_token} B per stored token (uint16 layers x top_k), "
             f"{_b(v.per_token * v.tokens_per_step)} per step at full length; {_b(v.window_bytes)} over the "
             f"{v.window_steps} steps the staleness keeps unconsumed, {_b(v.run_bytes)} over the run's {v.run_steps} "
             f"steps ({_b(v.mean_run_bytes)} at half length; the trainer keeps consumed groups); the engines answer "
             f"{_b(v.json_per_response)} of JSON per full-length response (base64 int32)"]
    warns: list[str] = []
    limit = warn_gib * 2 ** 30
    if v.enabled and max(v.window_bytes, v.run_bytes) > limit:
        warns.append(f"routing replay stores {_b(v.run_bytes)} over the run ({_b(v.window_bytes)} within the "
                     f"staleness window) in store.path, above {warn_gib:g} GiB (m2po plan --store-warn-gib): put the "
                     f"store on a disk that holds it, shorten trainer.num_steps or rollout.max_new_tokens, or lower "
                     f"the staleness")
    return notes, warns


def replay_lines(cfg: Any, m: Any, warn_gib: float = STORE_WARN_GIB) -> tuple[list[str], list[str]]:
    """:func:`replay_report` for an MoE shape ``m`` (nothing for a dense one)."""
    if not getattr(m, "is_moe", False):
        return [], []
    return replay_report(replay_volume(cfg, m), warn_gib)
