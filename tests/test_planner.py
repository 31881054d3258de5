"""`m2po plan`: memory estimates against Megatron-LM's own formulas and published layouts.

The references below are transcribed independently (not imported) from
megatron/training/theoretical_memory_usage.py in NVIDIA/Megatron-LM and from Korthikanti et al.
(2022), Table 2; `megatron.training` is not part of megatron-core.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from megatron_m2po.plan import memory as P
from megatron_m2po.plan.lease import LeaseShape
from megatron_m2po.cli import main
from megatron_m2po.config import load_config

GiB = 1024 ** 3
EX = Path(__file__).resolve().parents[1] / "examples"


# ---------------------------------------------------------------------------------------------
# Independent references
# ---------------------------------------------------------------------------------------------


def megatron_weight_and_optimizer_bytes(*, hidden, layers, heads, kv_heads, ffn, padded_vocab, untied, tp, pp,
                                        dp, distributed_optimizer, swiglu=True, kv_channels=None):
    """compute_weight_and_optimizer_memory (dense, RMSNorm, no MTP)."""
    kv_channels = kv_channels or hidden // heads
    q_ratio = kv_channels * heads / hidden
    self_attn = 2 * hidden * hidden * ((1 + kv_heads / heads) * q_ratio)
    gated = 1.5 if swiglu else 1.0
    per_layer = 2 * hidden * (ffn * gated + 1) + self_attn
    emb = hidden * padded_vocab
    block = per_layer * layers + hidden
    shard = (block / pp + emb) / tp
    if untied and pp == 1:
        shard += emb / tp
    per_param = 18 if not distributed_optimizer else 6 + 12 / dp
    return shard * per_param


def megatron_activation_sp_selective(*, s, b, h, ffn, layers, pp, tp, num_microbatches=None, vpp=None,
                                     padded_vocab=None):
    """compute_activation_memory (SP + selective recompute), first stage."""
    act = s * b * h * (18 + 4 * ffn / h) * layers
    act += 8 * s * b * pp
    act += s * b * h * pp
    if vpp is not None:
        act *= 1 + (pp - 1) / (pp * vpp)
    if vpp is None and pp > 1 and num_microbatches is not None:
        act *= min(1, num_microbatches / pp)
    if pp == 1:
        act += s * b * h * 4 * (1 + padded_vocab / h)
    return act / tp


def megatron_layer_without_sp(*, s, b, h, tp):
    """compute_activation_memory_without_sp, per layer (before the 1.05 slack)."""
    return s * b * h * (10 + 24 / tp)


# a GPT layer as Megatron's and the paper's formulas assume: MHA, ffn = 4h, GeLU, dropout
GPT = P.ModelShape("gpt", hidden=4096, layers=32, heads=32, kv_heads=32, ffn=16384, vocab=51200, tied=False,
                   gated=False)
LLAMA = P.MODELS["llama-3-8b"]


# ---------------------------------------------------------------------------------------------
# Shapes and parameter counts
# ---------------------------------------------------------------------------------------------


def test_param_counts_match_published_totals():
    # Qwen2.5-32B: 32,763,876,352 parameters (qkv biases included); Llama-3-8B: 8,030,261,248.
    assert P.MODELS["qwen2.5-32b"].num_params() == 32_763_876_352
    assert LLAMA.num_params() == 8_030_261_248
    assert abs(P.MODELS["qwen3-8b"].num_params() / 1e9 - 8.19) < 0.01
    assert abs(P.MODELS["qwen2.5-1.5b"].num_params() / 1e9 - 1.54) < 0.01  # tied embedding counted once


def test_hf_config_parsing_matches_builtin(tmp_path):
    cfg = {"model_type": "qwen2", "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 40,
           "num_key_value_heads": 8, "intermediate_size": 27648, "vocab_size": 152064, "hidden_act": "silu",
           "tie_word_embeddings": False, "max_position_embeddings": 131072}
    d = tmp_path / "Qwen2.5-32B"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    m = P.model_shape(str(d))
    assert m.num_params() == P.MODELS["qwen2.5-32b"].num_params()
    q3 = dict(cfg, model_type="qwen3", num_attention_heads=64, intermediate_size=25600, vocab_size=151936,
              head_dim=128, attention_bias=False)
    (d / "config.json").write_text(json.dumps(q3))
    assert P.model_shape(str(d / "config.json")).num_params() == P.MODELS["qwen3-32b"].num_params()


def test_model_names_resolve_and_unknown_names_list_choices():
    assert P.model_shape("/models/Qwen2.5-32B").name == "qwen2.5-32b"
    assert P.model_shape("Qwen/Qwen3-8B").name == "qwen3-8b"
    assert P.model_shape("Qwen2.5-Math-7B").max_positions == 4096
    with pytest.raises(P.PlanError, match="qwen2.5-32b"):
        P.model_shape("/models/mystery-70b")


# ---------------------------------------------------------------------------------------------
# Against Megatron-LM's theoretical memory formulas
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp,pp,dp,distopt", [(8, 2, 2, True), (4, 4, 2, True), (2, 1, 4, False),
                                              (1, 1, 1, False), (8, 1, 8, True)])
def test_weights_and_optimizer_match_megatron(tp, pp, dp, distopt):
    lay = P.Layout(tp=tp, pp=pp, dp=dp, distributed_optimizer=distopt, param_bytes=2)
    stage0 = P.estimate(LLAMA, lay)[0]
    vp = P.padded_vocab(LLAMA.vocab, tp)
    ref = megatron_weight_and_optimizer_bytes(
        hidden=LLAMA.hidden, layers=LLAMA.layers, heads=LLAMA.heads, kv_heads=LLAMA.kv_heads, ffn=LLAMA.ffn,
        padded_vocab=vp, untied=True, tp=tp, pp=pp, dp=dp, distributed_optimizer=distopt)
    ours = stage0.weights + stage0.gradients + stage0.optimizer
    # Megatron puts the final norm (h params) on the first stage; we put it where it lives (last)
    assert ours == pytest.approx(ref, rel=1e-6)


def test_padded_vocab_is_megatrons():
    assert P.padded_vocab(152064, 1) == 152064
    assert P.padded_vocab(152064, 8) == 152576  # next multiple of 128*8
    assert P.padded_vocab(151936, 8) == 152576


@pytest.mark.parametrize("tp,pp,nmb,vpp", [(8, 1, None, None), (4, 4, 64, None), (4, 4, 2, None),
                                           (2, 4, 64, 2), (8, 2, 16, None)])
def test_activations_sp_selective_match_megatron(tp, pp, nmb, vpp):
    s, b = 4096, 1
    lay = P.Layout(tp=tp, pp=pp, sequence_parallel=True, recompute="selective", micro_batch_tokens=s * b, seq_len=s,
                   num_microbatches=nmb, vpp=vpp, flash_attention=False, dropout=True)
    stage0 = P.estimate(GPT, lay)[0]
    ref = megatron_activation_sp_selective(s=s, b=b, h=GPT.hidden, ffn=GPT.ffn, layers=GPT.layers, pp=pp, tp=tp,
                                           num_microbatches=nmb, vpp=vpp,
                                           padded_vocab=P.padded_vocab(GPT.vocab, tp))
    ours = stage0.activations
    if pp == 1:
        # Megatron's output-layer term: 4sbh (input) + 4sbV (fp32 logits); ours splits it into the
        # final-norm output (2sbh/t with SP) and the logits of the log-prob path; compare the rest.
        ref -= s * b * GPT.hidden * 4 * (1 + P.padded_vocab(GPT.vocab, tp) / GPT.hidden) / tp
        ours -= 2 * s * b * GPT.hidden / tp
    assert ours == pytest.approx(ref, rel=1e-9)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_layer_without_sp_matches_megatron(tp):
    s = 2048
    ours = P.layer_activation_bytes(GPT, s, s, tp, sequence_parallel=False, score_term=False, dropout=True)
    assert ours == pytest.approx(megatron_layer_without_sp(s=s, b=1, h=GPT.hidden, tp=tp), rel=1e-12)


def test_korthikanti_table2_variants():
    """Per-layer bytes: sbh(34 + 5as/h) without parallelism, sbh/t(34 + 5as/h) with TP+SP, 2sbh with full."""
    s, b, h, a, t = 2048, 2, GPT.hidden, GPT.heads, 4
    T = s * b
    none = P.layer_activation_bytes(GPT, T, s, 1, sequence_parallel=False, score_term=True, dropout=True)
    assert none == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    tp_only = P.layer_activation_bytes(GPT, T, s, t, sequence_parallel=False, score_term=True, dropout=True)
    assert tp_only == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    tp_sp = P.layer_activation_bytes(GPT, T, s, t, sequence_parallel=True, score_term=True, dropout=True)
    assert tp_sp == pytest.approx(s * b * h / t * (34 + 5 * a * s / h))
    full = P.estimate(GPT, P.Layout(tp=1, recompute="full", micro_batch_tokens=T, seq_len=s, dropout=True,
                                    flash_attention=False))[0]
    layers_part = GPT.layers * 2 * T * h
    one_layer = none
    emb = 8 * T + T * h
    final_norm = 2 * T * h
    assert full.activations == pytest.approx(layers_part + one_layer + emb + final_norm)


def test_gqa_swiglu_and_no_dropout_change_only_their_terms():
    T, h = 4096, 5120
    m = P.MODELS["qwen2.5-32b"]  # q = h, kv = h/5, SwiGLU ffn 27648
    got = P.layer_activation_bytes(m, T, T, 8, sequence_parallel=True, score_term=False, dropout=False)
    replicated = 8 * T * h
    split = 4 * T * h + 4 * T * (h // 5) + 6 * T * 27648
    assert got == pytest.approx(replicated / 8 + split / 8)


# ---------------------------------------------------------------------------------------------
# Published layouts: accepted / rejected, and the messages
# ---------------------------------------------------------------------------------------------


def _plan(model, **kw):
    base = dict(param_bytes=2, micro_batch_tokens=4096, seq_len=4096, num_microbatches=64, gpus_per_node=8)
    base.update(kw)
    return P.plan(P.MODELS[model], P.Layout(**base))


@pytest.mark.parametrize("tp,pp,dp", [(8, 2, 2), (4, 4, 2), (8, 4, 1)])
def test_qwen25_32b_published_layouts_fit_80gb(tp, pp, dp):
    p = _plan("qwen2.5-32b", tp=tp, pp=pp, dp=dp, sequence_parallel=True, recompute="selective",
              distributed_optimizer=True)
    assert p.ok, p.errors
    assert p.worst.total < 80 * GiB


def test_qwen25_32b_tp1_rejected_naming_weights_and_tp():
    p = _plan("qwen2.5-32b", tp=1, pp=1, dp=8, distributed_optimizer=True)
    assert not p.ok
    msg = p.errors[0]
    assert "> budget 80.0 GiB" in msg and "weights" in msg and "parallel.tensor_parallel" in msg
    assert (p.refusal.cause, p.refusal.message, p.refusal.need) == ("weights", msg, p.worst.total)
    assert p.refusal.budget == p.layout.budget_gib * GiB == 80 * GiB


def test_7b_tp2_fits_and_tp1_without_distributed_optimizer_is_rejected():
    ok = _plan("qwen2.5-7b", tp=2, dp=4, sequence_parallel=True, recompute="selective", distributed_optimizer=True)
    assert ok.ok, ok.errors
    bad = _plan("qwen2.5-7b", tp=1, dp=1)
    assert not bad.ok
    assert "optimizer states" in bad.errors[0] and "use_distributed_optimizer" in bad.errors[0]
    # the number quoted is the real optimizer footprint: 12 B/param of the whole model
    assert bad.refusal.cause == "optimizer" and bad.refusal.message == bad.errors[0]
    assert bad.refusal.figure == bad.worst.optimizer
    assert f"optimizer states {bad.refusal.figure / GiB:.1f} GiB" in bad.errors[0]
    with pytest.raises(P.MemoryPlanError) as refused:
        bad.raise_if_infeasible()
    assert refused.value.refusal == bad.refusal and str(refused.value) == bad.errors[0]


def test_divisibility_and_node_limits_are_named():
    p = _plan("qwen2.5-32b", tp=16, pp=1, dp=2)
    text = " | ".join(p.errors)
    assert "tp=16 exceeds GPUs per node 8" in text
    assert "num_attention_heads 40 not divisible by tp 16" in text
    assert "kv heads 8 not divisible by tp 16" in text
    q3 = _plan("qwen3-32b", tp=16, pp=1, dp=2, gpus_per_node=16)
    assert [e for e in q3.errors if "kv heads 8 not divisible by tp 16" in e]
    assert not [e for e in q3.errors if "num_attention_heads" in e]  # 64 heads split fine
    lay = _plan("qwen2.5-7b", tp=2, pp=3, dp=1)
    assert any("num_hidden_layers 28 not divisible by pp 3" in e for e in lay.errors)


def test_naive_logits_rejected_where_fused_fits():
    kw = dict(tp=1, dp=1, micro_batch_tokens=32768, seq_len=32768, recompute="full", num_microbatches=4)
    fused = _plan("qwen2.5-1.5b", **kw)
    naive = _plan("qwen2.5-1.5b", fused_logprobs=False, **kw)
    assert fused.ok, fused.errors
    assert not naive.ok and "logits" in naive.errors[0] and "fused" in naive.errors[0]
    s = fused.stages[-1]
    vocab = P.padded_vocab(151936, 1)
    assert s.logits_naive == 32768 * vocab * 14
    assert s.logits_fused == 1024 * vocab * 12


def test_pipeline_in_flight_1f1b():
    st = P.estimate(P.MODELS["qwen2.5-32b"], P.Layout(tp=8, pp=4, num_microbatches=64))
    assert [s.in_flight for s in st] == [4, 3, 2, 1]
    st = P.estimate(P.MODELS["qwen2.5-32b"], P.Layout(tp=8, pp=4, num_microbatches=2))
    assert [s.in_flight for s in st] == [2, 2, 2, 1]


# ---------------------------------------------------------------------------------------------
# Recipes and the CLI
# ---------------------------------------------------------------------------------------------

RECIPES = {"qwen2.5-32b": (4, 8), "qwen3-32b": (4, 8), "qwen2.5-math-7b": (1, 4), "qwen3-8b": (1, 4),
           "qwen3-30b-a3b": (2, 8), "qwen2.5-math-7b-colocated": (1, 8), "qwen2.5-32b-lora": (1, 2)}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipes_are_feasible_with_paper_hyperparameters(name):
    cfg = load_config(EX / f"{name}.yaml")
    assert (cfg.trainer.prompts_per_step, cfg.rollout.n_samples_per_prompt, cfg.trainer.prompts_per_update) == (256, 8, 64)
    assert cfg.trainer.num_updates_per_step == 4
    assert (cfg.optim.lr, cfg.optim.lr_schedule, cfg.optim.adam_beta1, cfg.optim.adam_beta2,
            cfg.optim.weight_decay) == (1e-6, "constant", 0.9, 0.999, 0.01)
    assert (cfg.rollout.temperature, cfg.algo.m2po.threshold, cfg.algo.loss) == (1.0, 0.04, "m2po")
    assert (cfg.trainer.mode, cfg.trainer.stale_k) == ("stale_k", 256)
    assert cfg.model.dtype == "bfloat16"
    nnodes, gpn = RECIPES[name]
    p = P.plan_from_config(cfg, P.model_shape(cfg.model.hf_path), nnodes=nnodes, gpus_per_node=gpn)
    assert p.ok, p.errors
    assert p.layout.world_size == nnodes * gpn
    assert not [w for w in p.warnings if "max_position_embeddings" in w]
    if nnodes > 1:
        assert p.layout.pp > 1 and p.layout.sequence_parallel and p.layout.distributed_optimizer


def test_colocated_engines_leave_only_their_residue_while_training():
    """Colocated engines time-share the GPU (docs/planner.md "Colocated layouts"): while the trainer
    trains they have released weights and KV and hold only the released engine's residue (before
    colocated mode they held engine_mem_fraction, 40 GiB here, and this layout was refused)."""
    from megatron_m2po.plan.colocated import EngineShare

    cfg = load_config(EX / "qwen2.5-math-7b.yaml", ["rollout.engine_gpu_ids=[0,1,2,3]", "rollout.colocate=true",
                                                        "rollout.engine_mem_fraction=0.5"])
    p = P.plan_from_config(cfg, P.MODELS["qwen2.5-math-7b"], nnodes=1, gpus_per_node=4)
    residue = EngineShare(mem_fraction=0.5, engine_tp=cfg.rollout.engine_tp, gpu_mem_gib=80.0).residue_bytes()
    assert p.layout.reserved_gib == pytest.approx(residue / 2**30) and p.layout.reserved_gib < 2
    assert p.ok and p.colocated.generating.ok and p.colocated.training.ok
    cfg = load_config(EX / "qwen2.5-math-7b.yaml", ["rollout.engine_gpu_ids=[6,7,8,9]"])
    p = P.plan_from_config(cfg, P.MODELS["qwen2.5-math-7b"], nnodes=1, gpus_per_node=4)
    assert any("but this node has 8 GPU(s)" in e for e in p.errors)


def test_plan_refuses_what_the_trainer_refuses_at_start_up():
    """The plan applies the trainer's placement rules (rollout/placement.py): engines on the trainer's
    GPUs need rollout.colocate=true; with distributed sync, not on a stage sender's GPU."""
    cfg = load_config(EX / "qwen2.5-math-7b.yaml", ["rollout.engine_gpu_ids=[0,1,2,3]"])
    p = P.plan_from_config(cfg, P.MODELS["qwen2.5-math-7b"], nnodes=1, gpus_per_node=4)
    assert any("rollout.colocate=true" in e for e in p.errors), p.errors
    # Colocated engines with NCCL's weight sync (an engine on a sender's GPU) are refused when the config
    # loads now (issue 40: colocate time-shares every trainer GPU and uses the colocated transport).
    from megatron_m2po.utils.settings import ConfigError

    with pytest.raises(ConfigError, match="rollout.weight_sync=distributed"):
        load_config(EX / "qwen2.5-math-7b.yaml", ["rollout.engine_gpu_ids=[0,1,2,3]", "rollout.colocate=true",
                                                  "rollout.weight_sync=distributed"])


def test_math7b_context_warning():
    cfg = load_config(EX / "qwen2.5-math-7b.yaml", ["rollout.max_new_tokens=4096"])
    p = P.plan_from_config(cfg, P.MODELS["qwen2.5-math-7b"], gpus_per_node=4)
    assert any("max_position_embeddings 4096" in w for w in p.warnings)


def test_cli_ok_and_rejected(capsys):
    assert main(["plan", "--nnodes", "4", "--gpus-per-node", "8", str(EX / "qwen2.5-32b.yaml")]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-32b" in out and "OK" in out and "optimizer states" in out
    rc = main(["plan", "--model", "qwen2.5-32b", "--nnodes", "2", "--tp", "16",
               str(EX / "qwen2.5-32b.yaml"), "parallel.pipeline_parallel=1", "parallel.context_parallel=1"])
    out = capsys.readouterr().out
    assert rc == 1 and "tp=16 exceeds GPUs per node 8" in out
    assert main(["plan", "--json", "--gpus-per-node", "4", str(EX / "qwen3-8b.yaml")]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] and math.isclose(d["worst_total_gib"], max(s["total"] for s in d["stages"]) / GiB)
    assert main(["plan", "--list-models"]) == 0
    assert "llama-3-8b" in capsys.readouterr().out


def test_lease_transient_by_hand_on_every_stage(capsys):
    """Every rank stages its part of a step's samples on its GPU (plan/lease.py): per data-parallel
    rank 4 updates x (2048 / 4 / dp + 1) sequences of 8192 tokens at 25 B a token, plus the routed
    experts (48 x 8 uint8) with routing replay, 1 KB a sample and the plans (24 B a sample)."""
    replay = ["algo.routing_replay=rollout", "rollout.return_routed_experts=true", "rollout.use_router=false",
              "rollout.router_addr=null", "rollout.external_addrs=[http://r:30000]"]
    for over, per_token in (([], 25), (replay, 25 + 48 * 8)):
        cfg = load_config(EX / "qwen3-30b-a3b.yaml", over)
        p = P.plan_from_config(cfg, P.MODELS["qwen3-30b-a3b"], nnodes=2, gpus_per_node=8)
        seqs = 4 * (2048 // 4 // p.layout.dp + 1)
        want = seqs * (8192 * per_token + 1024) + 24 * 2048
        assert [s.lease for s in p.stages] == [want] * p.layout.pp, (p.stages, want)
        assert all(s.total - s.lease == pytest.approx(t.total) for s, t in
                   zip(p.stages, P.estimate(P.MODELS["qwen3-30b-a3b"], dataclasses.replace(p.layout, lease=LeaseShape()))))
    assert main(["plan", "--nnodes", "2", str(EX / "qwen3-30b-a3b.yaml"), *replay]) == 0
    out = capsys.readouterr().out
    assert "lease (step's samples)" in out and f"{want / GiB:.2f}" in out and "(routing 48x8 uint8)" in out


def test_planner_takes_context_parallel_and_refuses_what_te_refuses(capsys):
    """Context parallelism runs in the actor: the config and `m2po plan` take it (optimizer states
    sharded over dp x cp); packed micro-batches with CP need cp_comm_type=p2p, as TE does."""
    from megatron_m2po.config import ConfigError

    cfg = load_config(str(EX / "qwen2.5-32b.yaml"), ["parallel.context_parallel=2"])
    assert cfg.parallel.context_parallel == 2 and cfg.parallel.cp_comm_type == "p2p"
    with pytest.raises(ConfigError, match="packing=true with parallel.context_parallel=2 needs parallel.cp_comm_type='p2p'"):
        load_config(str(EX / "qwen2.5-32b.yaml"), ["parallel.context_parallel=2", "parallel.cp_comm_type=all_gather"])
    rc = main(["plan", "--nnodes", "4", "--gpus-per-node", "8", str(EX / "qwen2.5-32b.yaml"),
               "parallel.context_parallel=2"])
    captured = capsys.readouterr()
    assert rc == 0 and "dp*cp=4" in captured.out, captured.out + captured.err


# ---------------------------------------------------------------------------------------------
# `m2po plan --search`: the cost model by hand, the ranking rules, the recipes
# ---------------------------------------------------------------------------------------------

from megatron_m2po.plan import search as S  # noqa: E402

# A GPT-style toy (MHA, GeLU MLP 4h): matmul parameters per layer 4h^2 + 8h^2 = 12h^2.
TOY = P.ModelShape("toy", hidden=1024, layers=8, heads=8, kv_heads=8, ffn=4096, vocab=32000, tied=False,
                   gated=False)
# Every sequence exactly seq_len long, GEMMs at a flat 50 % of a 1 PFLOP/s peak, no fixed costs.
FLAT = S.CostModel(peak_tflops=1000.0, gemm_eff=0.5, gemm_half_tokens=0, attn_eff=0.5, layer_overhead_s=0.0,
                   mean_len_frac=1.0, intra_node_gbs=100.0, inter_node_gbs=10.0, hbm_gbs=1000.0)


def test_step_time_by_hand_single_gpu():
    work = S.Workload(sequences=4, seq_len=2048, updates_per_step=2)
    n_mb, t = S.step_time(TOY, P.Layout(tp=1, pp=1, dp=1), work, 1, FLAT)
    assert n_mb == 4
    # per micro-batch (2048 tokens), forward:
    dense = 2 * 2048 * (12 * 1024 ** 2) * 8          # 412,316,860,416: 2 FLOPs per parameter per token
    head = 2 * 2048 * 1024 * 32000                   # 134,217,728,000: output layer
    attn = 2 * 1024 * 2048 ** 2 * 8                  # 68,719,476,736: QK^T + AV over the causal half
    assert (dense, head, attn) == (412_316_860_416, 134_217_728_000, 68_719_476_736)
    # training = 3 forwards of the GEMMs; the fused log-prob recomputes the head's logits once more;
    # flash attention's backward is 2.5 forwards (5 matmuls against 2)
    per_mb = (3 * dense + 4 * head + 3.5 * attn) / 5e14
    assert t["compute"] == pytest.approx(4 * per_mb, rel=1e-12)
    assert t["recompute"] == t["tp_comm"] == t["pp_comm"] == t["bubble"] == t["dp_comm"] == 0
    # Adam over every parameter: 30 bytes per parameter through HBM
    assert t["optimizer"] == pytest.approx(TOY.num_params() * 30 / 1e12, rel=1e-3)
    assert t["step"] == pytest.approx(2 * t["update"]) and t["update"] == pytest.approx(
        sum(v for k, v in t.items() if k not in ("update", "step")))
    # recompute: full repeats the whole layer forward, selective only the core attention
    _, full = S.step_time(TOY, P.Layout(recompute="full"), work, 1, FLAT)
    _, sel = S.step_time(TOY, P.Layout(recompute="selective"), work, 1, FLAT)
    assert full["recompute"] == pytest.approx(4 * (dense + attn) / 5e14)
    assert sel["recompute"] == pytest.approx(4 * attn / 5e14)
    # M2PO's global mask: one more forward over the mini-batch; the head runs on response rows only
    _, pre = S.step_time(TOY, P.Layout(), dataclasses_replace(work, prepass=True, response_frac=0.25), 1, FLAT)
    assert pre["mask"] == pytest.approx(4 * (dense + head / 4 + attn) / 5e14)
    assert pre["compute"] == pytest.approx(4 * (3 * dense + 4 * head / 4 + 3.5 * attn) / 5e14)
    # or a forward-backward of the corrected share of the tokens (no bubble at PP=1); auto: the less
    t_mb = (3 * dense + 4 * head / 4 + 3.5 * attn) / 5e14
    for frac, strategy, want in ((0.1, "correct", 0.1 * 4 * t_mb), (0.1, "auto", 0.1 * 4 * t_mb),
                                 (0.5, "auto", pre["mask"]), (0.0, "correct", 0.0)):
        cm = dataclasses_replace(FLAT, mask_correction_frac=frac)
        w = dataclasses_replace(work, prepass=True, response_frac=0.25, mask_strategy=strategy)
        assert S.step_time(TOY, P.Layout(), w, 1, cm)[1]["mask"] == pytest.approx(want), (frac, strategy)


def test_context_parallel_by_hand():
    """CP=2 splits each micro-batch's tokens over two GPUs: per-GPU compute equals DP=2's on the
    same GPUs (same sequences per GPU-pair, half the tokens each); gradients are reduced and
    optimizer states sharded over dp x cp. The K/V exchange costs only what attention does not hide
    (test_cp_comm_by_hand)."""
    work = S.Workload(sequences=4, seq_len=2048)
    n_cp, cp = S.step_time(TOY, P.Layout(cp=2, dp=1, distributed_optimizer=True), work, 1, FLAT)
    n_dp, dp = S.step_time(TOY, P.Layout(cp=1, dp=2, distributed_optimizer=True), work, 1, FLAT)
    assert (n_cp, n_dp) == (4, 2)
    assert cp["compute"] == pytest.approx(dp["compute"], rel=1e-12)
    # one p2p ring step: 1024 tokens' K and V (2 x 1024 bf16 each) = 4 MiB at 100 GB/s = 84 us, against a
    # step's attention forward 2 * 1024 * (2048^2 / 2) * 1 layer / 2 steps = 2.1 GFLOP at 500 TFLOP/s = 4.3 us
    c = 1024 * 2 * 1024 * 2 / 100e9
    a = 2 * 1024 * 2048 ** 2 / 2 / 2 / 5e14
    assert c > 2.5 * a  # exposed: forward (cp-1) steps, backward K/V then dK/dV
    assert cp["cp_comm"] == pytest.approx(4 * 8 * ((c - a) + 2 * (c - 2.5 * a)))
    assert dp["cp_comm"] == 0 and cp["dp_comm"] == pytest.approx(dp["dp_comm"])
    assert cp["optimizer"] == pytest.approx(dp["optimizer"])
    # the global mask's strategies cost the same under CP (mask_strategy=correct runs with CP)
    w = dataclasses_replace(work, prepass=True, mask_strategy="correct")
    cm = dataclasses_replace(FLAT, mask_correction_frac=0.0)
    assert S.step_time(TOY, P.Layout(cp=2), w, 1, cm)[1]["mask"] == 0.0


def test_cp_comm_by_hand():
    """The K/V exchange of TE 2.9 per cp_comm_type on a 16-layer GQA model (8 query heads, 2 KV
    heads of 128), one 32768-token micro-batch, TP=2, PP=2 (8 layers here), by hand:
    p2p hides each ring step behind that step's attention, all_gather and a2a hide nothing, and
    recompute repeats the forward exchange."""
    m = P.ModelShape("gqa", hidden=1024, layers=16, heads=8, kv_heads=2, ffn=4096, vocab=32000, tied=False)
    cm = FLAT
    T, tp, cp, layers = 32768, 2, 4, 8
    chunk = T / cp * 2 * 256 / tp * 2            # this GPU's K and V: 8192 tokens x 2 x 128 values x 2 bytes = 4 MiB
    c = chunk / 100e9                             # 41.9 us inside a node at 100 GB/s
    attn_fwd_s = 1e-3 * layers                    # 1 ms of attention forward per layer on this GPU
    a = 1e-3 / cp                                 # one ring step: 250 us > c: fully hidden
    lay = P.Layout(tp=tp, pp=2, cp=cp, gpus_per_node=8)
    assert S.cp_comm_time(m, lay, T, attn_fwd_s, "p2p", cm) == (0.0, 0.0)
    # short attention (a packed micro-batch of many short sequences): 20 us per layer -> 5 us per step
    a = 20e-6 / cp
    fwd = layers * (cp - 1) * (c - a)
    bwd = layers * (2 * (c - 2.5 * a) + (cp - 2) * (2 * c - 2.5 * a))
    got = S.cp_comm_time(m, lay, T, 20e-6 * layers, "p2p", cm)
    assert got == (pytest.approx(fwd), pytest.approx(fwd + bwd))
    full = S.cp_comm_time(m, dataclasses_replace(lay, recompute="full"), T, 20e-6 * layers, "p2p", cm)
    sel = S.cp_comm_time(m, dataclasses_replace(lay, recompute="selective"), T, 20e-6 * layers, "p2p", cm)
    assert full == sel == (pytest.approx(fwd), pytest.approx(2 * fwd + bwd))
    # all_gather: (cp - 1) chunks gathered forward, again backward, dK/dV reduce-scattered; nothing hidden
    ag = S.cp_comm_time(m, lay, T, attn_fwd_s, "all_gather", cm)
    assert ag == (pytest.approx(layers * 3 * c), pytest.approx(layers * 9 * c))
    # a2a: Q, K, V in and the output back, (cp-1)/cp of each local tensor, forward and backward
    local = T / cp * 2 * (2 * 1024 + 2 * 256) / tp
    one = 3 / 4 * local / 100e9
    assert S.cp_comm_time(m, lay, T, attn_fwd_s, "a2a", cm) == (pytest.approx(layers * one),
                                                                 pytest.approx(2 * layers * one))
    # a CP group of tp * cp = 16 ranks spans two 8-GPU nodes: the ring runs at the inter-node bandwidth
    across = dataclasses_replace(lay, cp=8)
    c8 = T / 8 * 2 * 256 / tp * 2 / 10e9
    assert S.cp_comm_time(m, across, T, attn_fwd_s, "all_gather", cm)[0] == pytest.approx(layers * 7 * c8)
    with pytest.raises(P.PlanError, match="cp_comm_type='ring'"):
        S.cp_comm_time(m, lay, T, attn_fwd_s, "ring", cm)


def test_recompute_time_by_hand():
    """Full recompute re-runs each layer's forward (dense + attention: ~1/3 of forward + backward),
    selective the core attention only."""
    assert S.recompute_time("full", 3.0, 1.0) == 4.0
    assert S.recompute_time("selective", 3.0, 1.0) == 1.0
    assert S.recompute_time("none", 3.0, 1.0) == 0.0
    # with the attention's 3.5 forwards, full recompute adds a third of the dense and 1/3.5 of the
    # attention's forward + backward
    assert S.attention_train_s(5e14, FLAT) == pytest.approx(3.5)


def test_comm_by_hand_and_tp_beyond_a_node_is_penalised():
    work = S.Workload(sequences=8, seq_len=2048)
    inside = P.Layout(tp=8, dp=2, gpus_per_node=8, sequence_parallel=True, distributed_optimizer=True)
    n_mb, t = S.step_time(TOY, inside, work, 1, FLAT)
    assert n_mb == 4
    # 4 all-reduce-sized collectives per layer per micro-batch of 2048 x 1024 bf16 values, ring factor 2(t-1)/t
    one = 2 * 7 / 8 * 2048 * 1024 * 2 / 100e9
    assert t["tp_comm"] == pytest.approx(4 * 8 * 4 * one)
    # tp*dp = 16 ranks span two 8-GPU nodes: the distributed optimizer's reduce-scatter (fp32 grads) and
    # all-gather (bf16 params) of one GPU's parameters go over the inter-node bandwidth
    local = TOY.num_params(P.padded_vocab(TOY.vocab, 8)) / 8
    assert t["dp_comm"] == pytest.approx(1 / 2 * local * 6 / 10e9, rel=1e-3)
    # the same TP group across two 4-GPU nodes runs at the inter-node bandwidth
    across = dataclasses_replace(inside, gpus_per_node=4)
    _, t2 = S.step_time(TOY, across, work, 1, FLAT)
    assert t2["tp_comm"] == pytest.approx(10 * t["tp_comm"])
    assert t2["step"] > t["step"]
    # and the search never offers it: plan() refuses TP beyond the node
    assert not P.plan(TOY, across).ok


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def test_bubble_grows_with_pp_and_shrinks_with_vpp():
    work = S.Workload(sequences=16, seq_len=2048)
    bubbles = {}
    for pp, vpp in [(1, None), (2, None), (4, None), (4, 2)]:
        lay = P.Layout(pp=pp, vpp=vpp, dp=1)
        n_mb, t = S.step_time(TOY, lay, work, 1, FLAT)
        per_mb = (t["compute"] + t["recompute"] + t["tp_comm"] + t["pp_comm"] + t["overhead"]) / n_mb
        assert t["bubble"] == pytest.approx(per_mb * (pp - 1) / (vpp or 1))
        bubbles[pp, vpp] = t["bubble"]
    assert bubbles[1, None] == 0 < bubbles[2, None] < bubbles[4, None]
    assert bubbles[4, 2] < bubbles[4, None]


def test_padding_and_packing_micro_batches_by_hand():
    cm = dataclasses_replace(FLAT, mean_len_frac=0.5, pack_fill=1.0)
    work = S.Workload(sequences=64, seq_len=1000)
    # padded: k sequences uniform on [0, 1000] cost k * E[max] = k * 1000 k / (k + 1) tokens
    n_mb, t1 = S.step_time(TOY, P.Layout(), work, 1, cm)
    n_mb4, t4 = S.step_time(TOY, P.Layout(), work, 4, cm)
    assert (n_mb, n_mb4) == (64, 16)
    head1 = 64 * 4 * 2 * 500 * 1024 * 32000 / 5e14     # E[max of 1] = mean = 500 tokens per micro-batch
    head4 = 16 * 4 * 2 * (4 * 800) * 1024 * 32000 / 5e14  # E[max of 4] = 800
    dense1 = 64 * 3 * 2 * 500 * 12 * 1024 ** 2 * 8 / 5e14
    attn1 = 64 * 3.5 * 2 * 1024 * 500 ** 2 * 8 / 5e14
    assert t1["compute"] == pytest.approx(head1 + dense1 + attn1)
    assert t4["compute"] > t1["compute"]                # 1 - 500/800 = 37.5 % of the tokens are padding
    assert head4 == pytest.approx(head1 * 1.6)
    # packed: 64 x 500 tokens per rank in budgets of 2 x 1000 -> 16 micro-batches, no padding
    packed = dataclasses_replace(work, packing=True)
    n_p, tp_ = S.step_time(TOY, P.Layout(), packed, 2, cm)
    assert n_p == 16
    assert tp_["compute"] == pytest.approx(head1 + dense1 + 3.5 * 2 * 1024 * 8 * 64 * (1000 ** 2 / 3) / 5e14)


@pytest.fixture(scope="module")
def search32():
    cfg = load_config(EX / "qwen2.5-32b.yaml")
    return S.search_config(cfg, P.model_shape(cfg.model.hf_path), nnodes=4, gpus_per_node=8)


def test_search_excludes_what_does_not_fit(search32):
    res = search32
    assert res.ranked and res.rejected
    assert all(c.fits and c.memory_gib <= 0.9 * 80 for c in res.ranked)
    assert all(c.layout.world_size == 32 for c in res.ranked + res.rejected)
    tp1 = [c for c in res.rejected if c.layout.tp == 1 and c.layout.pp == 1]
    assert tp1 and not [c for c in res.ranked if c.layout.tp == 1 and c.layout.pp == 1]
    assert all("weights" in c.plan.errors[0] for c in tp1)    # 32B in bf16 with fp32 grads: 196 GiB per GPU
    assert all(c.plan.refusal.cause == "weights" for c in tp1)
    # a layout plan() accepts but that leaves less than the headroom is out too
    tight = [c for c in res.rejected if c.plan.ok]
    assert tight and all(0.9 * 80 < c.memory_gib for c in tight)
    assert sorted(c.step_s for c in res.ranked) == [c.step_s for c in res.ranked]


def test_search_full_recompute_ranks_behind_selective(search32):
    res = search32
    by_key = {}
    for i, c in enumerate(res.ranked):
        lay = c.layout
        by_key[(lay.tp, lay.pp, lay.vpp, lay.distributed_optimizer, c.budget_k, lay.recompute)] = i
    pairs = [(i, by_key[k[:-1] + ("full",)]) for k, i in by_key.items()
             if k[-1] == "selective" and k[:-1] + ("full",) in by_key]
    assert len(pairs) > 20
    assert all(sel < full for sel, full in pairs)


def test_chosen_is_the_least_memory_within_the_tie(search32):
    res = search32
    fastest = res.ranked[0]
    near = [c for c in res.ranked if c.step_s <= fastest.step_s * 1.02]
    assert any(c is res.best for c in near)
    assert round(res.best.memory_gib, 1) == min(round(c.memory_gib, 1) for c in near)
    strict = dataclasses_replace(res, tie=0.0)
    assert strict.best is fastest or strict.best.step_s == fastest.step_s
    loose = dataclasses_replace(res, tie=10.0)       # everything ties: the smallest layout that fits
    assert round(loose.best.memory_gib, 1) == min(round(c.memory_gib, 1) for c in res.ranked)


def test_search_with_nothing_fitting_says_why(capsys):
    rc = main(["plan", "--search", "--nnodes", "1", "--gpus-per-node", "1", str(EX / "qwen2.5-32b.yaml")])
    err = capsys.readouterr().err
    assert rc == 1 and "no layout of qwen2.5-32b fits 1 GPUs" in err and "weights" in err


# qwen3-30b-a3b: tests/test_planner_moe.py (one search shared with the MoE constraint checks)
SEARCH_RECIPES = {"qwen2.5-32b": (4, 8), "qwen2.5-32b-32k": (4, 8), "qwen3-32b": (4, 8), "qwen2.5-math-7b": (1, 4),
                  "qwen3-8b": (1, 4), "qwen2.5-32b-lora": (1, 2)}


@pytest.mark.parametrize("name", sorted(SEARCH_RECIPES))
def test_recipes_use_the_layout_the_search_chooses(name):
    path = EX / f"{name}.yaml"
    cfg = load_config(path)
    nnodes, gpn = SEARCH_RECIPES[name]
    res = S.search_config(cfg, P.model_shape(cfg.model.hf_path), nnodes=nnodes, gpus_per_node=gpn)
    packing, _ = S.packing_of(cfg)
    chosen = S.parallel_section(res.best, packing)
    have = {k: getattr(cfg.parallel, k) for k in chosen}
    assert have == chosen, f"{name}: recipe {have} but m2po plan --search chooses {chosen}"
    assert cfg.parallel.virtual_pipeline_parallel == chosen.get("virtual_pipeline_parallel")
    header = path.read_text().split("\nmodel:")[0]
    assert f"m2po plan --search examples/{name}.yaml" in header
    assert f"{res.best.step_s:.0f} s/step" in header


@pytest.mark.parametrize("name,cluster", sorted({**SEARCH_RECIPES, "qwen3-30b-a3b": (2, 8),
                                                "qwen2.5-math-7b-colocated": (1, 8)}.items()))
def test_a_recipe_is_planned_on_the_cluster_its_launch_script_launches(name, cluster, capsys):
    """`m2po plan examples/<recipe>.yaml` as the README writes it (no --nnodes): the nodes and GPUs
    of the recipe's scripts/run_*.sh, said on stderr (it used to plan one 8-GPU node: "world size 8
    ... not divisible by 16" for the 32B recipes)."""
    assert main(["plan", "--json", str(EX / f"{name}.yaml")]) == 0
    out = capsys.readouterr()
    lay = json.loads(out.out)["layout"]
    nodes, gpus = cluster
    assert lay["gpus_per_node"] == gpus and lay["tp"] * lay["pp"] * lay["cp"] * lay["dp"] == nodes * gpus
    said = f"{gpus} GPUs" if gpus >= 8 else f"{gpus} trainer GPUs (of an 8-GPU node; engines on the others)"
    assert f"# {nodes} node(s) x {said}: the cluster run_" in out.err  # the 32B LoRA recipe: 2 of 8 GPUs train


def test_a_world_size_that_holds_no_whole_replica_names_the_node_count_that_does(tmp_path, capsys):
    assert main(["plan", "--nnodes", "1", str(EX / "qwen2.5-32b.yaml")]) == 1
    err = capsys.readouterr().err
    assert "world size 8 (1 node(s) x 8 GPUs) is not divisible by tp*pp*cp = 4*2*2 = 16" in err
    assert "plan it on --nnodes 2 (or a multiple)" in err
    # a config no launch script runs: one node of 8 GPUs, nothing said
    own = tmp_path / "mine.yaml"
    own.write_text((EX / "qwen3-8b.yaml").read_text())
    assert main(["plan", "--json", str(own)]) in (0, 1)
    out = capsys.readouterr()
    assert json.loads(out.out)["layout"]["gpus_per_node"] == 8 and "the cluster run_" not in out.err


def test_cli_search_prints_ranked_layouts_and_assumptions(capsys):
    assert main(["plan", "--search", "--nnodes", "4", "--gpus-per-node", "8", str(EX / "qwen2.5-32b.yaml")]) == 0
    out = capsys.readouterr().out
    assert "layouts fit; fastest first" in out and "chosen" in out and "(config)" in out
    # the 32B recipe's layout is row 2, chosen over row 1 for its memory: the table says why
    assert "(chosen*)" in out and "* chosen over row 1: the least memory among the layouts within 2% of the " \
        "fastest" in " ".join(out.split())
    for f in ("peak_tflops", "gemm_eff", "intra_node_gbs", "inter_node_gbs", "layer_overhead_s", "headroom"):
        assert f in out
    assert main(["plan", "--search", "--json", "--top", "3", "--nnodes", "4", str(EX / "qwen3-32b.yaml")]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["top"]) == 3 and d["top"][0]["step_s"] <= d["top"][1]["step_s"] <= d["top"][2]["step_s"]
    assert d["chosen"]["parallel"]["tensor_parallel"] >= 1 and d["current"]["rank"] >= 1
    assert 0 < d["chosen"]["mfu"] < d["cost_model"]["gemm_eff"]
    assert main(["plan", "--search", "--tp", "8", str(EX / "qwen3-8b.yaml")]) == 2
    assert "fix what the search enumerates" in capsys.readouterr().err


def test_search_without_a_cluster_size_finds_the_smallest_that_fits(capsys):
    """`m2po plan --search RECIPE` with no --nnodes: the 32B recipe does not fit one 8-GPU node, so
    the search says so and ranks the layouts of the smallest power-of-two node count that fits;
    with --nnodes given, nothing is guessed."""
    assert main(["plan", "--search", "--json", str(EX / "qwen2.5-32b.yaml")]) == 0
    out = capsys.readouterr()
    d = json.loads(out.out)
    assert "nothing fits 1 node x 8 GPUs" in out.err and "is 2 nodes" in out.err
    assert d["top"] and d["chosen"]["parallel"]["tensor_parallel"] * d["chosen"]["parallel"]["pipeline_parallel"] <= 16
    assert main(["plan", "--search", "--nnodes", "1", str(EX / "qwen2.5-32b.yaml")]) == 1
    assert "no layout of qwen2.5-32b fits 8 GPUs" in capsys.readouterr().err

