"""The planner's colocated layouts (plan/colocated.py): two phases per shared GPU, each checked,
both printed, figures read from the plan object and the structured refusal; and ``--search``'s
comparison against the disaggregated splits of the same node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_m2po.config import load_config
from megatron_m2po.plan import colocated as C
from megatron_m2po.plan import memory as P
from megatron_m2po.plan import search as S

EX = Path(__file__).resolve().parents[1] / "examples"
GiB, MiB = 1024 ** 3, 1024 ** 2
ALL8 = ["rollout.colocate=true", "rollout.engine_gpu_ids=[0,1,2,3,4,5,6,7]", "rollout.num_engines=8"]


def _math7b(*overrides: str):
    cfg = load_config(EX / "qwen2.5-math-7b.yaml", [*ALL8, *overrides])
    return cfg, P.plan_from_config(cfg, P.MODELS["qwen2.5-math-7b"], nnodes=1, gpus_per_node=8)


def test_sglang_working_set_and_residue_follow_its_memory_hook():
    """Hand-computed from SGLang 0.5.23 arg_groups/memory_hook.py: 512 MiB + 1.5 MiB x chunked prefill
    + tp/8 GiB + 2 MiB x decode max_bs, at least 10 GiB above 60 GiB."""
    assert C.sglang_capacity_defaults(80, 1) == (8192, 256)
    assert C.sglang_capacity_defaults(80, 4) == (8192, 512)
    assert C.sglang_capacity_defaults(40, 1) == (4096, 32)
    assert C.EngineShare(0.8, 1, 80).working_set_bytes() == (512 + 1.5 * 8192 + 128 + 512) * MiB
    assert C.EngineShare(0.8, 4, 80).working_set_bytes() == (512 + 1.5 * 8192 + 512 + 1024) * MiB
    assert C.EngineShare(0.8, 1, 40).working_set_bytes() == (512 + 1.5 * 4096 + 128 + 64) * MiB  # no floor
    assert C.EngineShare(0.8, 1, 24).working_set_bytes() < 10 * GiB
    released = C.EngineShare(0.8, 1, 80)
    assert released.residue_bytes() == C.CUDA_CONTEXT_GIB * GiB + 512 * MiB + GiB / 8
    kept_graphs = C.EngineShare(0.8, 1, 80, release_cuda_graph=False)
    assert kept_graphs.residue_bytes() - released.residue_bytes() == 512 * MiB


def test_colocated_plan_has_both_phases_and_fits_at_a_fraction_that_leaves_sglang_room():
    _, p = _math7b("rollout.engine_mem_fraction=0.8")
    assert p.ok, p.errors
    ph = p.colocated
    gen, train = ph.generating, ph.training
    gpu = 80 * GiB
    # training: the trainer's own peak beside what released engines leave; plan()'s budget is the rest
    assert train.parts["trainer peak"] == p.worst.total
    assert p.layout.reserved_gib * GiB == pytest.approx(train.parts["released engine residue"])
    assert train.total <= gpu and p.worst.total <= p.layout.budget_gib * GiB
    # generating: SGLang's static memory is the fraction of what is free when it starts
    free = gpu - p.worst.overhead - C.CUDA_CONTEXT_GIB * GiB
    assert gen.parts["trainer residue (offloaded)"] == p.worst.overhead
    assert gen.parts["engine weights"] + gen.parts["engine KV pool"] == pytest.approx(0.8 * free)
    assert gen.parts["engine weights"] == P.MODELS["qwen2.5-math-7b"].num_params() * 2
    assert gen.total == pytest.approx(gpu - 0.2 * free + gen.parts["engine working set"])
    assert gen.ok and gen.total <= gpu
    assert 0.8 < ph.max_mem_fraction < 0.85


def test_generating_phase_that_does_not_fit_is_refused_with_its_figures():
    _, p = _math7b("rollout.engine_mem_fraction=0.85")  # the disaggregated recipe's fraction
    assert not p.ok
    r = p.refusal
    assert r is not None and r.cause == "generating"
    assert r.need == pytest.approx(p.colocated.generating.total) and r.need > r.budget == 80 * GiB
    assert r.figure == C.EngineShare(0.85, 1, 80).working_set_bytes()
    assert p.colocated.max_mem_fraction < 0.85
    assert f"{p.colocated.max_mem_fraction:.2f}" in r.message and r.message in p.errors
    # too small a fraction: no KV cache beside the weights
    _, p = _math7b("rollout.engine_mem_fraction=0.15")
    assert p.refusal is not None and p.refusal.cause == "generating" and p.colocated.kv_bytes == 0


def test_pushing_phase_holds_the_trainers_weights_beside_the_engines_weights():
    """During the push the trainer has offloaded its gradients and optimizer states but not its
    weights, and the engines have resumed theirs (trainer/colocated.py to_engines); the push adds
    two buckets and one gathered tensor."""
    _, p = _math7b("rollout.engine_mem_fraction=0.8")
    push, w = p.colocated.pushing, p.worst
    m = P.MODELS["qwen2.5-math-7b"]
    assert push.parts["trainer weights (states offloaded)"] == w.weights
    assert push.parts["trainer residue (overhead)"] == w.overhead
    assert push.parts["engine weights (resumed)"] == m.num_params() * 2
    assert push.parts["push buckets"] == 2 * 512 * MiB + m.vocab * m.hidden * 2
    assert push.parts["released engine residue"] == C.EngineShare(0.8, 1, 80).residue_bytes()
    assert push.ok and p.ok, p.errors
    assert C.push_buffer_bytes(2048 * MiB, 0, 3 * GiB) == 3 * GiB  # no more than the weights in all


def test_a_push_that_does_not_fit_is_refused_though_both_phases_fit():
    """A 32B trainer (TP=4 x PP=2, 7.6 GiB of weights a GPU) with TP=2 engines (30.5 GiB of weights
    each): training and generating fit, but with 32 GiB buckets the push holds the engine's weights
    twice over (the resumed weights, and buckets as large as all the weights plus the gathered
    embedding) beside the trainer's:
    refused with cause ``pushing`` and what to change; at 16 GiB buckets the same layout fits."""
    base = ("rollout.colocate=true", "rollout.engine_gpu_ids=[0,1,2,3,4,5,6,7]", "rollout.num_engines=4",
            "rollout.engine_tp=2", "rollout.engine_mem_fraction=0.8", "parallel.tensor_parallel=4",
            "parallel.pipeline_parallel=2", "parallel.sequence_parallel=true", "parallel.recompute=full",
            "parallel.use_distributed_optimizer=true")
    m = P.MODELS["qwen2.5-32b"]

    def plan(bucket_mb: int):
        cfg = load_config(EX / "qwen2.5-math-7b.yaml", [*base, f"rollout.weight_sync_bucket_mb={bucket_mb}"])
        return P.plan_from_config(cfg, m, nnodes=1, gpus_per_node=8)

    p = plan(32768)
    ph = p.colocated
    assert ph.training.ok and ph.generating.ok, (ph.training.total / GiB, ph.generating.total / GiB)
    assert not ph.pushing.ok and not p.ok
    assert ph.pushing.parts["push buckets"] == m.num_params() * 2 + m.vocab * m.hidden * 2  # buckets capped
    r = p.refusal
    assert r is not None and r.cause == "pushing" and r.need == pytest.approx(ph.pushing.total)
    assert "lower rollout.weight_sync_bucket_mb" in r.message and r.message in p.errors
    ok = plan(16384)
    assert ok.ok and ok.colocated.pushing.ok and ok.colocated.pushing.total < ph.pushing.total


def test_training_phase_budget_is_the_gpu_less_the_released_engines_residue():
    # the 7B trainer on TP=1 without the distributed optimizer: too big for one GPU even beside
    # released engines; the refusal's budget is 80 GiB less their residue, not less their fraction
    _, p = _math7b("rollout.engine_mem_fraction=0.8", "parallel.tensor_parallel=1", "parallel.sequence_parallel=false",
                   "parallel.use_distributed_optimizer=false")
    r = p.refusal
    assert r is not None and r.cause != "generating"
    assert r.budget == pytest.approx(80 * GiB - C.EngineShare(0.8, 1, 80).residue_bytes())
    assert not p.colocated.training.ok


def test_disaggregated_plan_has_no_phases():
    cfg = load_config(EX / "qwen2.5-math-7b.yaml")
    p = P.plan_from_config(cfg, P.MODELS["qwen2.5-math-7b"], nnodes=1, gpus_per_node=4)
    assert p.colocated is None and p.layout.reserved_gib == 0.0


def test_cli_prints_both_phases_and_refuses(capsys):
    import argparse

    def run(*argv: str) -> tuple[int, str]:
        ap = argparse.ArgumentParser()
        S.register(ap.add_subparsers())
        flags = [a for a in argv if a.startswith("--")]
        overrides = [a for a in argv if not a.startswith("--")]
        args = ap.parse_args(["plan", str(EX / "qwen2.5-math-7b.yaml"), *ALL8, *overrides, "--gpus-per-node", "8", *flags])
        rc = args.func(args)
        return rc, capsys.readouterr().out

    rc, out = run("rollout.engine_mem_fraction=0.8", "--json")
    d = json.loads(out)
    assert rc == 0 and d["colocated"]["generating"]["total"] <= d["colocated"]["generating"]["budget"]
    assert d["colocated"]["training"]["total"] <= d["colocated"]["training"]["budget"]
    assert d["colocated"]["pushing"]["total"] <= d["colocated"]["pushing"]["budget"]
    rc, out = run("rollout.engine_mem_fraction=0.85")
    assert rc == 1 and "generating" in out and "training" in out and "REJECTED" in out
    # the OK line names the shared GPU's tightest phase, not the training phase alone
    rc, out = run("rollout.engine_mem_fraction=0.8")
    peak = max(("generating", "training", "pushing"), key=lambda k: d["colocated"][k]["total"])
    assert rc == 0 and f"tightest phase of the shared GPU: {peak}, " in " ".join(out.split()), out[-600:]


def test_search_compares_colocated_with_the_disaggregated_splits_of_the_node():
    cfg = load_config(EX / "qwen2.5-math-7b.yaml", [*ALL8, "rollout.engine_mem_fraction=0.8"])
    m = P.MODELS["qwen2.5-math-7b"]
    res = S.search_config(cfg, m, nnodes=1, gpus_per_node=8)
    assert all(c.plan.colocated is not None for c in res.ranked)
    cmp = S.compare_colocated(cfg, res, nnodes=1, gpus_per_node=8, trainer_gpus=[2, 4, 6])
    col = cmp.colocated
    assert col.trainer_gpus == col.engine_gpus == 8 and not col.overlap and col.switch_s > 0
    assert col.step_s == pytest.approx(col.train_s + col.generation.seconds + col.switch_s)
    assert col.generation.engines == 8
    assert [s.trainer_gpus for s in cmp.splits] == [2, 4, 6]
    for s in cmp.splits:  # stale_k: engines generate while the trainer trains
        assert s.overlap and s.switch_s == 0
        assert s.step_s == max(s.train_s, s.generation.seconds)
        assert s.generation.engines == 8 - s.trainer_gpus
        assert s.candidate.plan.colocated is None
    assert cmp.best_split is min(cmp.splits, key=lambda s: s.step_s)
    # in sync mode nothing overlaps: every split pays training plus generation
    sync = load_config(EX / "qwen2.5-math-7b.yaml", [*ALL8, "rollout.engine_mem_fraction=0.8", "trainer.mode=sync"])
    cmp = S.compare_colocated(sync, res, nnodes=1, gpus_per_node=8, trainer_gpus=[4])
    (s,) = cmp.splits
    assert s.step_s == pytest.approx(s.train_s + s.generation.seconds)


def test_generation_roofline_by_hand():
    g = C.generation_time(layers=2, kv_size=4, weight_bytes=1e9, sequences=8, prompt_len=10, max_new=100,
                          mean_frac=0.5, gpus=2, engine_tp=1, kv_bytes=1e9, hbm_gbs=1.0)
    per_tok = 2 * 2 * 4 * 2
    assert g.engines == 2 and g.batch == 4  # the KV pool holds more than the 4 sequences per engine
    assert g.iter_s == pytest.approx((1e9 + 4 * (10 + 25) * per_tok) / 1e9)
    assert g.seconds == pytest.approx(100 * g.iter_s)  # 4 x 50 tokens / 4 per iteration < max_new
    assert C.generation_time(layers=2, kv_size=4, weight_bytes=1e9, sequences=8, prompt_len=10, max_new=100,
                             mean_frac=0.5, gpus=2, engine_tp=1, kv_bytes=0, hbm_gbs=1.0).seconds == float("inf")
