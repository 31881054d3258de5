"""The planner knows LoRA (plan/lora.py): a frozen base at param_bytes, gradients and optimizer
states of the adapters only, no reference copy, and a backward without the base's weight
gradients."""

import pytest

from megatron_m2po.config import Config
from megatron_m2po.plan import lora as L
from megatron_m2po.plan import memory as P
from megatron_m2po.plan import search as S


def _hand_adapters(m, r: int, tp: int) -> float:
    """Adapter parameters of one layer on one TP rank, from the shapes (q/k/v/gate/up: A replicated,
    B split over TP; o/down: A split, B replicated)."""
    h, q, kv, f = m.hidden, m.heads * (m.head_dim or m.hidden // m.heads), m.kv_heads * (m.head_dim or m.hidden // m.heads), m.ffn
    col = (r * h + q * r / tp) + 2 * (r * h + kv * r / tp) + 2 * (r * h + f * r / tp)
    row = (r * q / tp + h * r) + (r * f / tp + h * r)
    return col + row


def test_adapter_parameters_by_hand():
    m = P.model_shape("Qwen/Qwen2.5-32B")
    lay = P.Layout(tp=4, pp=2, lora_rank=16)
    assert L.adapter_params(m, lay) == pytest.approx(_hand_adapters(m, 16, 4) * m.layers / 2)
    only_attn = P.Layout(tp=4, pp=2, lora_rank=16, lora_targets=("q_proj", "v_proj"))
    h, q, kv = m.hidden, m.q_size, m.kv_size
    assert L.adapter_params(m, only_attn) == pytest.approx((16 * h + q * 16 / 4 + 16 * h + kv * 16 / 4) * m.layers / 2)
    assert L.adapter_params(m, P.Layout(tp=4, pp=2)) == 0.0


def test_expert_adapters_by_hand():
    """Qwen3-30B-A3B at EP=8: the attention adapters (as a dense model's) plus, per layer, 128 / 8
    local experts each holding gate_up (A 16 x 2048 shared by gate and up, B 2 x 768 x 16) and down
    (A 16 x 768, B 2048 x 16); each routed token adds 2 x top-8 r-wide intermediates."""
    m = P.MODELS["qwen3-30b-a3b"]
    r = 16
    lay = P.Layout(tp=1, pp=1, ep=8, etp=1, lora_rank=r)
    q, kv, h = m.q_size, m.kv_size, m.hidden
    attn = (r * h + q * r) + 2 * (r * h + kv * r) + (r * q + h * r)
    experts = 128 / 8 * (r * 2048 + 2 * 768 * r + r * 768 + 2048 * r)
    assert L.adapter_params(m, lay) == pytest.approx((attn + experts) * 48)
    attn_only = P.Layout(tp=1, pp=1, ep=8, etp=1, lora_rank=r, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    assert L.adapter_params(m, attn_only) == pytest.approx(attn * 48)
    assert L.adapter_activation_bytes(m, lay, 1000) == pytest.approx(2.0 * 1000 * r * (4 + 2 * 8))
    # compute: a token passes through its top-8 experts' adapters, not the 16 local experts'
    assert L.adapter_compute_params(m, lay) == pytest.approx(
        (attn + 8 * (r * 2048 + 2 * 768 * r + r * 768 + 2048 * r)) * 48)


def test_search_keeps_experts_whole_under_expert_lora():
    """LoRA on the experts needs expert TP 1 (actor/model.py refuses more): the search enumerates no
    other, where without LoRA it tries expert TP = TP too."""
    from pathlib import Path

    from megatron_m2po.config import load_config

    recipe = Path(__file__).resolve().parents[1] / "examples" / "qwen3-30b-a3b.yaml"
    m = P.MODELS["qwen3-30b-a3b"]

    def etps(overrides):
        res = S.search_config(load_config(recipe, overrides), m, nnodes=1, gpus_per_node=8)
        return {(c.layout.tp, c.layout.etp or c.layout.tp) for c in res.ranked + res.rejected}
    assert any(tp > 1 and etp == tp for tp, etp in etps([])), etps([])
    with_lora = etps(["model.lora.rank=16"])
    assert with_lora and all(etp == 1 for _, etp in with_lora), with_lora



def test_frozen_base_keeps_weights_and_drops_gradients_optimizer_and_reference():
    m = P.model_shape("Qwen/Qwen2.5-32B")
    full = P.Layout(tp=4, pp=2, dp=1, micro_batch_tokens=4096, seq_len=4096, reference=True)
    lora = P.Layout(**{**full.__dict__, "lora_rank": 32})
    adapters = L.adapter_params(m, lora)
    for f, lo in zip(P.estimate(m, full), P.estimate(m, lora)):
        assert lo.weights == pytest.approx(f.weights + adapters * lora.param_bytes)
        assert lo.gradients == pytest.approx(adapters * 4) and lo.optimizer == pytest.approx(adapters * 12)
        assert lo.reference == 0.0 < f.reference  # the base with adapters disabled: no copy
        assert lo.activations > f.activations  # + the r-wide intermediates, under 1 %
        assert lo.activations < 1.01 * f.activations


def test_lora_makes_32b_fit_four_gpus_where_full_training_does_not():
    m = P.model_shape("Qwen/Qwen2.5-32B")
    lay = dict(tp=4, pp=1, dp=1, micro_batch_tokens=8192, seq_len=8192, recompute="full", gpus_per_node=4)
    assert not P.plan(m, P.Layout(**lay)).ok
    assert P.plan(m, P.Layout(**lay, lora_rank=32)).ok


def test_layout_from_config_reads_model_lora():
    cfg = Config()
    assert P.layout_from_config(cfg).lora_rank == 0
    cfg.model.lora.rank, cfg.model.lora.targets = 8, ["q_proj", "o_proj"]
    lay = P.layout_from_config(cfg)
    assert lay.lora_rank == 8 and lay.lora_targets == ("q_proj", "o_proj")


def test_step_time_drops_the_base_weight_gradients():
    """Dense GEMM time goes from 3 forwards to 2 (plus the adapters' own), the optimizer and the
    gradient reduction shrink to the adapters' (~1.5 % of the base per GPU at r = 32: A is replicated over TP)."""
    m = P.model_shape("Qwen/Qwen2.5-32B")
    work = S.Workload(sequences=512, seq_len=8192, updates_per_step=4, response_frac=0.9)
    base = P.Layout(tp=4, pp=1, dp=2, micro_batch_tokens=8192, seq_len=8192, distributed_optimizer=True)
    lora = P.Layout(**{**base.__dict__, "lora_rank": 32})
    _, t_full = S.step_time(m, base, work, 1)
    _, t_lora = S.step_time(m, lora, work, 1)
    assert 0.6 < t_lora["compute"] / t_full["compute"] < 0.75
    assert t_lora["optimizer"] < 0.03 * t_full["optimizer"] and t_lora["dp_comm"] < 0.03 * t_full["dp_comm"]
