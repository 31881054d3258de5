"""`m2po plan` with experts: the MoE memory and time terms by hand, the refusals, and the search's
EP x ETP x TP x PP x DP space (plan/moe.py, docs/planner.md "MoE")."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_m2po.cli import main
from megatron_m2po.config import load_config
from megatron_m2po.plan import memory as P
from megatron_m2po.plan import moe as M
from megatron_m2po.plan import search as S

EX = Path(__file__).resolve().parents[1] / "examples"

# a small MoE whose numbers are easy to follow: q = 4 x 16 = 64 wide, kv = 2 x 16 = 32 wide
TOY = P.ModelShape("toy-moe", hidden=64, layers=4, heads=4, kv_heads=2, ffn=0, vocab=1024, tied=False,
                   head_dim=16, num_experts=8, top_k=2, moe_ffn=32)


def test_qwen3_30b_a3b_parameters_match_the_published_totals(tmp_path):
    """Qwen3-30B-A3B: "30.5B total, 3.3B activated" (its model card). Attention 2048 x (4096 + 2 x 512 +
    ...), 128 experts of 3 x 2048 x 768, a 128 x 2048 router, 48 layers, untied 151936 x 2048
    embeddings; the same shape parsed from its config.json fields."""
    m = P.MODELS["qwen3-30b-a3b"]
    attn = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128
    layer = attn + 128 * 2048 + 128 * 3 * 2048 * 768 + 2 * 2048
    assert m.num_params() == 48 * layer + 2048 + 2 * 151936 * 2048 == 30_532_122_624
    active = 48 * (attn + 128 * 2048 + 8 * 3 * 2048 * 768 + 2 * 2048) + 2048 + 2 * 151936 * 2048
    assert m.active_params() == active == 3_353_032_704
    hf = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
          "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
          "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False,
          "max_position_embeddings": 40960, "decoder_sparse_step": 1, "mlp_only_layers": [],
          "hidden_act": "silu", "attention_bias": False}
    assert P.ModelShape.from_hf_config(hf, name="qwen3-30b-a3b") == m
    assert P.model_shape("/models/Qwen3-30B-A3B") == m
    with pytest.raises(P.PlanError, match="MoE with dense layers"):
        P.ModelShape.from_hf_config({**hf, "mlp_only_layers": [0]})
    with pytest.raises(P.PlanError, match="shared experts"):
        P.ModelShape.from_hf_config({**hf, "shared_expert_intermediate_size": 5632})


def _toy_layout(**kw) -> P.Layout:
    base = dict(tp=2, pp=2, dp=4, ep=4, etp=1, sequence_parallel=True, distributed_optimizer=True,
                recompute="none", micro_batch_tokens=256, seq_len=256, num_microbatches=4, gpus_per_node=8)
    return P.Layout(**{**base, **kw})


def test_moe_memory_by_hand():
    """tp=2 x pp=2 x dp=4 (16 GPUs), ep=4, etp=1: expert data parallel = tp*dp/(ep*etp) = 2, the dense
    data parallel 4. Stage 0 holds 2 layers and the embedding."""
    lay = _toy_layout()
    assert M.expert_data_parallel(lay) == 2
    s0 = P.estimate(TOY, lay)[0]
    # dense: (attention 64*64 + 2*64*32 + 64*64 = 12288, norms 128) x 2 layers + embedding 1024 x 64, over
    # tp; the router (8 x 64) x 2 layers, replicated over tp
    dense = (2 * (12288 + 128) + 1024 * 64) / 2 + 2 * 512
    experts = 2 * (8 * 3 * 64 * 32) / (4 * 1)           # 2 of the 8 experts per layer, whole
    assert (dense, experts) == (46208, 24576)
    assert s0.params == dense + experts
    assert s0.weights == 2 * (dense + experts) and s0.gradients == 4 * (dense + experts)
    assert s0.optimizer == 12 * dense / 4 + 12 * experts / 2   # dense over dp*cp = 4, experts over edp = 2
    # activations per layer for T = 256 tokens: the dense formula without an MLP (replicated 8Th / tp,
    # Q/K/V/proj input 4Tq + 4Tkv over tp), the router 8 (T/tp) E, the experts' C = (T/tp) k etp = 256
    # copies: input 2Ch, fc1 out + gated act + scaled act 8Cf/etp, probs 4C
    dense_act = 8 * 256 * 64 / 2 + (4 * 256 * 64 + 4 * 256 * 32) / 2
    router = 8 * 128 * 8
    expert_act = 2 * 256 * 64 + 8 * 256 * 32 + 4 * 256
    per_layer = dense_act + router + expert_act
    assert per_layer == 222208
    in_flight = 2                                        # 1F1B stage 0 of 2: min(pp, n_mb)
    emb = 8 * 256 / 2                                    # int64 token ids, SP-split
    dispatch = 2 * (128 * 2 + 256) * 64                  # one layer's permuted input and received copies
    assert s0.activations == in_flight * 2 * per_layer + in_flight * emb + dispatch
    # without the distributed optimizer both are whole; ETP = TP splits every expert too
    assert P.estimate(TOY, _toy_layout(distributed_optimizer=False))[0].optimizer == 12 * (dense + experts)
    s = P.estimate(TOY, _toy_layout(ep=2, etp=2))[0]
    assert s.params == dense + 2 * (8 * 3 * 64 * 32) / (2 * 2)


def test_routing_imbalance_grows_the_hottest_ranks_expert_activations_by_hand():
    """``model.moe.routing_imbalance`` f: the hottest EP rank receives f x the mean copies C, so its
    expert activations (2Ch + 8Cf/etp + 4C per layer) and the received part of the dispatch buffer
    (2Ch) grow by f; the router logits, the attention and the permuted own tokens do not. At EP=1 one
    rank holds every expert: nothing to be imbalanced. From a config the factor is the config's."""
    base, hot = P.estimate(TOY, _toy_layout())[0], P.estimate(TOY, _toy_layout(routing_imbalance=1.5))[0]
    expert_act = 2 * 256 * 64 + 8 * 256 * 32 + 4 * 256   # C = 256 copies per layer (test above)
    received = 2 * 256 * 64
    assert hot.activations - base.activations == pytest.approx(0.5 * (2 * 2 * expert_act + received))
    assert (hot.weights, hot.gradients, hot.optimizer) == (base.weights, base.gradients, base.optimizer)
    one = dict(ep=1, dp=4)
    assert P.estimate(TOY, _toy_layout(routing_imbalance=1.5, **one))[0].activations == \
        P.estimate(TOY, _toy_layout(**one))[0].activations
    cfg = load_config(EX / "qwen3-30b-a3b.yaml", ["model.moe.routing_imbalance=2.0"])
    assert P.layout_from_config(cfg, nnodes=2).routing_imbalance == 2.0
    assert load_config(None).model.moe.routing_imbalance >= 1.5  # the default (docs/planner.md says why)
    m = P.MODELS["qwen3-30b-a3b"]
    plans = [P.plan_from_config(load_config(EX / "qwen3-30b-a3b.yaml", [f"model.moe.routing_imbalance={f}"]), m,
                                nnodes=2).worst.total for f in (1.0, 1.6, 2.0)]
    assert plans[0] < plans[1] < plans[2]


REPLAY_ON = ["rollout.return_routed_experts=true", "algo.routing_replay=rollout", "rollout.use_router=false",
             "rollout.router_addr=null", "rollout.external_addrs=[http://rollout-node-0:30000]"]


def test_plan_prints_routing_replays_store_bytes_and_warns_above_the_limit(capsys):
    """Routing replay stores 48 layers x top-8 uint16 = 768 B per token of the 30B-A3B recipe: 2,048
    samples x 8,192 tokens a step = 12 GiB; stale_k 256 over U = 4 updates a step keeps 65 steps
    unconsumed (780 GiB) and the trainer keeps consumed groups over 400 steps (4.7 TiB); an engine's
    answer carries base64 int32 ids, 16 x 48 x 8 / 3 B per token: ~16 MiB per 8k response. Printed
    for an MoE config (replay off: what it would add), a warning above --store-warn-gib when on."""
    from megatron_m2po.plan import routing as R

    cfg = load_config(EX / "qwen3-30b-a3b.yaml", REPLAY_ON)
    v = R.replay_volume(cfg, P.MODELS["qwen3-30b-a3b"])
    assert (v.per_token, v.tokens_per_step, v.window_steps, v.run_steps) == (768, 2048 * 8192, 65, 400)
    assert v.window_bytes == 768 * 2048 * 8192 * 65 and v.run_bytes == 768 * 2048 * 8192 * 400
    assert v.json_per_response == 4 * -(-4 * 48 * 8 * 8191 // 3) and v.enabled
    assert main(["plan", str(EX / "qwen3-30b-a3b.yaml"), "--nnodes", "2", *REPLAY_ON]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "routing replay on (rollout.return_routed_experts=true): 768 B per stored token" in out, out
    assert "12.0 GiB per step" in out and "780.0 GiB over the 65 steps" in out and "4.7 TiB over the run's 400" in out
    assert "16.0 MiB of JSON per full-length response" in out
    assert "warning: routing replay stores 4.7 TiB over the run (780.0 GiB within the staleness window)" in out
    assert "above 500 GiB" in out
    assert main(["plan", str(EX / "qwen3-30b-a3b.yaml"), "--nnodes", "2", "--store-warn-gib", "8000", *REPLAY_ON]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "768 B per stored token" in out and "warning: routing replay" not in out
    assert main(["plan", str(EX / "qwen3-30b-a3b.yaml"), "--nnodes", "2"]) == 0  # the recipe: replay off
    out = " ".join(capsys.readouterr().out.split())
    assert "routing replay off here" in out and "would add: 768 B per stored token" in out
    assert "warning: routing replay" not in out
    assert main(["plan", str(EX / "qwen3-8b.yaml")]) in (0, 1)  # a dense model: no routing
    assert "routing replay" not in capsys.readouterr().out


def test_moe_layouts_megatron_or_the_actor_refuse_are_named():
    def errs(**kw):
        return " ".join(P.plan(TOY, _toy_layout(**kw)).errors)
    assert P.plan(TOY, _toy_layout()).ok
    assert "num_experts 8 not divisible by expert_parallel 3" in errs(ep=3, dp=6, tp=1, sequence_parallel=False)
    assert "moe_intermediate_size 32 not divisible by expert_tensor_parallel 3" in errs(etp=3, ep=1)
    # etp x ep x pp = 2 x 8 x 2 = 32 does not divide 16 GPUs
    assert "not a multiple of expert_tensor_parallel x expert_parallel x pipeline_parallel = 2 x 8 x 2" in errs(
        ep=8, etp=2)
    assert "needs sequence_parallel=true" in errs(sequence_parallel=False)
    dense = dataclasses.replace(TOY, num_experts=0, ffn=128)
    assert "has no experts" in " ".join(P.plan(dense, _toy_layout()).errors)


def test_plan_refuses_what_the_trainer_refuses_for_moe():
    """plan_from_config runs the trainer's Config.validate at the planned layout: EP with CP is
    refused (config.py); the global mask's correction pass with EP is not (it runs under EP)."""
    cfg = load_config(EX / "qwen3-30b-a3b.yaml")
    m = P.MODELS["qwen3-30b-a3b"]
    p = P.plan_from_config(cfg, m, nnodes=2, gpus_per_node=8, ep=2, cp=2, pp=2)
    assert any("expert_parallel=2 with parallel.context_parallel=2 is not supported" in e for e in p.errors), p.errors
    cfg = load_config(EX / "qwen3-30b-a3b.yaml", ["algo.m2po.mask_strategy=correct"])
    p = P.plan_from_config(cfg, m, nnodes=2, gpus_per_node=8, ep=4)
    assert p.ok and not p.errors, p.errors


def test_moe_time_terms_by_hand():
    """Expert GEMMs on the active parameters at an efficiency set by the tokens per local expert; the
    dispatch + combine all-to-alls forward and backward over NVLink inside a node, InfiniBand across;
    the expert-TP gather / scatter of the dispatched copies."""
    cm = S.CostModel(peak_tflops=1000.0, gemm_eff=0.5, gemm_half_tokens=100, intra_node_gbs=100.0,
                     inter_node_gbs=10.0, alltoall_eff=0.5)

    def bw(span):
        return S._bw(span, 8, cm)
    lay = P.Layout(tp=1, pp=1, dp=4, ep=4, etp=1)
    t = M.comm_times(TOY, lay, 1000, 4, cm, bw)
    per_expert = 1000 * 2 / (8 / 4)                      # C = 2000 copies over 2 local experts
    eff = 0.5 * per_expert / (per_expert + 100)
    flops = 2 * 1000 * 2 * 3 * 64 * 32 * 4              # k experts of 3 h f, 4 layers
    assert t["expert_compute"] == pytest.approx(3 * flops / (1e15 * eff))
    assert t["expert_recompute"] == 0
    vol = 1000 * 2 * 64 * 2 * 3 / 4                      # bf16 copies leaving the GPU, per all-to-all
    assert t["ep_comm"] == pytest.approx(4 * 2 * 2 * vol / (100e9 * 0.5))
    wide = M.comm_times(TOY, dataclasses.replace(lay, ep=8, dp=16, gpus_per_node=8), 1000, 4, cm,
                        lambda span: S._bw(span, 4, cm))  # EP group over 8 ranks, 4 GPUs per node
    assert wide["ep_comm"] == pytest.approx(4 * 2 * 2 * 1000 * 2 * 64 * 2 * 7 / 8 / (10e9 * 0.5))
    full = M.comm_times(TOY, dataclasses.replace(lay, recompute="full"), 1000, 4, cm, bw)
    assert full["ep_comm"] == pytest.approx(1.5 * t["ep_comm"])
    assert full["expert_recompute"] == pytest.approx(t["expert_compute"] / 3)
    etp = M.comm_times(TOY, P.Layout(tp=2, pp=1, dp=2, ep=1, etp=2, sequence_parallel=True), 1000, 4, cm, bw)
    c = 500 * 2 * 2                                     # (T / tp) k etp copies after the expert-TP gather
    assert etp["ep_comm"] == pytest.approx(4 * 2 * 2 * 0.5 * c * 64 * 2 / 100e9)
    # dense TP collectives: attention and MLP in a dense layer, the attention only in an MoE one
    assert (M.tp_collectives_per_layer(TOY, False), M.tp_collectives_per_layer(P.MODELS["qwen3-8b"], False)) == (2, 4)


@pytest.fixture(scope="module")
def search_a3b():
    cfg = load_config(EX / "qwen3-30b-a3b.yaml")
    return cfg, S.search_config(cfg, P.model_shape(cfg.model.hf_path), nnodes=2, gpus_per_node=8)


def test_search_spans_expert_layouts_within_megatrons_rules(search_a3b):
    _, res = search_a3b
    allc = res.ranked + res.rejected
    seen = {(c.layout.ep, c.layout.etp) for c in allc}
    assert {1, 2, 4, 8, 16} <= {ep for ep, _ in seen} and {etp for _, etp in seen} == {1, 2, 4}
    for c in allc:
        lay = c.layout
        assert 128 % lay.ep == 0 and lay.etp in (1, lay.tp)
        assert (lay.tp * lay.cp * lay.dp) % (lay.ep * lay.etp) == 0 and lay.world_size == 16
        assert not (lay.ep > 1 and lay.cp > 1)              # the trainer refuses EP with CP
        assert lay.sequence_parallel == (lay.tp > 1)
    for c in res.ranked:
        assert c.plan.ok and c.memory_gib <= 0.9 * 80
        # the global mask as configured (auto: the cheaper of pre-pass and correction), with EP too
        by = {k: S.step_time(res.model, c.layout, dataclasses.replace(res.work, mask_strategy=k), c.budget_k,
                             res.cost)[1]["mask"] for k in ("prepass", "correct")}
        assert res.work.mask_strategy == "auto" and c.time["mask"] == min(by.values()), (c.layout, by)
    assert any(c.layout.ep > 1 for c in res.ranked)
    # the EP group across the two nodes pays InfiniBand for every all-to-all
    by = {(c.layout.tp, c.layout.pp, c.layout.ep, c.layout.etp, c.layout.recompute, c.budget_k, c.layout.vpp,
           c.layout.distributed_optimizer): c for c in res.ranked}
    pairs = [(c, by.get((1, 1, 8, 1) + k[4:])) for k, c in by.items() if k[:4] == (1, 1, 16, 1)]
    pairs = [(a, b) for a, b in pairs if b is not None]
    assert pairs and all(a.time["ep_comm"] > 4 * b.time["ep_comm"] for a, b in pairs)


def test_recipe_uses_the_layout_the_search_chooses(search_a3b):
    cfg, res = search_a3b
    chosen = S.parallel_section(res.best, S.packing_of(cfg)[0])
    have = {k: getattr(cfg.parallel, k) for k in chosen}
    assert have == chosen, f"recipe {have} but m2po plan --search chooses {chosen}"
    assert cfg.parallel.virtual_pipeline_parallel == chosen.get("virtual_pipeline_parallel")
    header = (EX / "qwen3-30b-a3b.yaml").read_text().split("\nmodel:")[0]
    assert "m2po plan --search examples/qwen3-30b-a3b.yaml --nnodes 2 --gpus-per-node 8" in header
    assert f"{res.best.step_s:.0f} s/step" in header and f"{res.best.memory_gib:.1f} GiB" in header
    assert f"fastest of {len(res.ranked)} fitting" in header


def test_cli_plan_prints_experts(capsys):
    assert main(["plan", str(EX / "qwen3-30b-a3b.yaml"), "--nnodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "128 experts, top-8, 3.35B active" in out and "ep=8 etp=1" in out and "expert-dp=1" in out
    assert "micro-batch 8192 tokens" in out  # the packed budget of the recipe
    assert main(["plan", str(EX / "qwen3-30b-a3b.yaml"), "--nnodes", "2", "--ep", "3"]) == 1
    assert "num_experts 128 not divisible by expert_parallel 3" in capsys.readouterr().out
