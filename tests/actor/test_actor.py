"""MegatronActor on CPU / gloo: log-probs vs HF, layout invariance of a train step (TP / PP / DP,
sequence parallel, packed and padded micro-batches, token budgets, balanced shards), SP with bf16
and recompute, training from a plan and a shard, exact gradient scale vs an HF reference,
on-policy sanity, every loss, checkpoint resume.

Several layouts share one spawned job (each actor is built, used and closed in turn) to keep the
suite small on a 2-core CI machine.
"""

import os

import numpy as np
import pytest
import torch

import actor_testlib as lib
from megatron_m2po.standins.dist_testing import run_distributed


def _hf_dir(root, kind, tie=False, seed=2):
    d = os.path.join(root, f"{kind}_{tie}_{seed}")
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        lib.make_tiny_hf(kind, d, tie=tie, seed=seed)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return d


def _logprob_errors(rank, world_size, root, layouts):
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch

    out = []
    samples = lib.make_samples(5, seed=11)
    for kind, tie, tp, pp in layouts:
        d = _hf_dir(root, kind, tie)
        cfg = lib.actor_config(d, tp=tp, pp=pp, mbs=2)
        actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))
        lps, ents = actor.compute_logprobs(RolloutBatch(samples), with_entropy=True)
        too_long = lib.make_samples(1, seed=1, prompt=(250, 251), response=(10, 11))  # 260 > 256 positions
        try:
            actor.compute_logprobs(RolloutBatch(samples + too_long))
            refused = ""
        except ValueError as e:
            refused = str(e)
        actor.close()
        err = max(float(np.abs(lp - lib.hf_logprobs(d, s.prompt_ids, s.response_ids)).max())
                  for lp, s in zip(lps, samples))
        out.append((kind, tie, tp, pp, err, all(np.isfinite(e).all() and (e > 0).all() for e in ents), refused))
    return out


@pytest.mark.parametrize("world_size,layouts", [
    (1, [("qwen2", False, 1, 1), ("qwen3", False, 1, 1), ("llama", True, 1, 1)]),
    (2, [("qwen2", True, 2, 1), ("qwen3", False, 2, 1), ("llama", False, 1, 2), ("qwen3", False, 1, 2)]),
])
@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_logprobs_match_hf(tmp_path, world_size, layouts):
    """fp32 log-probs equal HF transformers' within 1e-5 at TP=1, TP=2, PP=2 (and DP=2 for TP=1 at
    world 2); a sequence longer than the model's positions is refused by name."""
    res = run_distributed(_logprob_errors, world_size, args=(str(tmp_path), layouts), timeout_s=180)
    for rank_res in res:
        for kind, tie, tp, pp, err, ent_ok, refused in rank_res:
            assert err < 1e-5, (kind, tie, tp, pp, err)
            assert ent_ok
            assert "'s0' has 260 tokens" in refused and "max_position_embeddings=256" in refused, refused


def _stale_batch(actor, samples, noise, seed=0):
    """Behaviour log-probs = current ones + noise (a stale policy), set in place."""
    from megatron_m2po.actor.batch import RolloutBatch

    lps = actor.compute_logprobs(RolloutBatch(samples))
    rng = np.random.default_rng(seed)
    for s, lp in zip(samples, lps):
        s.behav_logprobs = (lp + noise * rng.standard_normal(lp.shape)).astype(np.float32)
    return RolloutBatch(samples)


def _gathered_mask(rec, update):
    """{token_index: keep} of ``update`` (recorded by ``rec``, an ``actor_testlib.Recorder``), over
    every data-parallel rank of the last stage."""
    objs = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(objs, rec.mask(update) if rec.updates else {})
    out = {}
    for part in objs:
        for a, b in part.items():
            assert out.get(a, b) == b  # TP ranks agree
            out[a] = b
    return out


def _norm_grads(actor):
    """{name: gradient} of the norm weights (replicated over TP), one dict per TP rank of this
    model replica (pipeline-parallel layouts: {}, their local layer names differ per stage)."""
    if torch.distributed.get_world_size(actor.pg.pp) > 1:
        return [{}]
    grads = {}
    for chunk in actor.model:
        for name, p in chunk.named_parameters():
            if "layernorm" in name and getattr(p, "main_grad", None) is not None:
                grads[name] = p.main_grad.detach().clone().numpy()
    objs = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(objs, (actor.dp_rank, grads))
    return [g for dp, g in objs if dp == actor.dp_rank]


def _train_layouts(rank, world_size, root, layouts):
    """One update pair per layout ``(tp, pp, options)``; options: mbs, dist_opt, sp, packing,
    max_tokens, balance (parallel.* settings), cp, loss (``algo.loss``, m2po by default), correct
    (``algo.m2po.mask_strategy=correct`` with a keep-all provisional mask: a correction pass in every
    micro-batch that holds a masked token)."""
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor

    d = _hf_dir(root, "qwen3", seed=4)
    res = []
    for tp, pp, o in layouts:
        cfg = lib.actor_config(d, tp=tp, pp=pp, mbs=o.get("mbs", 2), dist_opt=o.get("dist_opt", False),
                               loss=o.get("loss", "m2po"))
        cfg.parallel.sequence_parallel = o.get("sp", False)
        cfg.parallel.packing = o.get("packing", False)
        cfg.parallel.max_tokens_per_microbatch = o.get("max_tokens")
        cfg.parallel.balance_data_parallel = o.get("balance", True)
        cfg.parallel.context_parallel = o.get("cp", 1)
        cfg.algo.m2po.threshold = 0.02
        if o.get("correct"):
            cfg.algo.m2po.mask_strategy = "correct"
        actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))
        if o.get("correct"):
            actor.global_mask.guess = lambda spec, settings, mb, delta, earlier: mb.loss_mask.bool().clone()
        batch = _stale_batch(actor, lib.make_samples(8, seed=5), noise=0.5)
        logps, ents = actor.compute_logprobs(batch, with_entropy=True)
        mbs = actor._microbatches(batch.samples[:4], actor._shards(batch.samples[:4])[actor.dp_rank])
        plan = [(mb.sample_index, tuple(mb.tokens.shape), mb.cu_seqlens is not None) for mb in mbs]
        rec = lib.Recorder(actor)
        metrics = actor.train_step(batch, num_minibatches=2)
        mask = _gathered_mask(rec, 1) if o.get("loss", "m2po") == "m2po" else {}  # the second update's
        grads = _norm_grads(actor) if not o.get("dist_opt") else [{}]
        weights = {k: v.numpy().copy() for k, v in actor.iter_hf_weights()}
        actor.close()
        res.append(((tp, pp, tuple(sorted(o.items()))), (logps, ents), metrics, mask, grads, weights, plan))
    return res


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_train_step_layout_invariance(tmp_path):
    """Same data and initial weights: identical log-probs, entropies, M2 mask, metrics, gradients
    of the replicated norm weights and updated weights for (TP, PP, DP) = (1,1,1) x micro-batch 1
    and 3, (2,1,1) with and without sequence parallelism, (1,2,1), (1,1,2) (+ distributed
    optimizer), and packed micro-batches (THD; the local spec's per-sequence causal mask) at
    TP=2 + SP, PP=2 and DP=2, with token budgets, balanced or contiguous data-parallel shards.

    The reference is the padded path at TP=1, one sequence per micro-batch. The model is
    Qwen3-shaped (q / k norms as well as the pre-norms and the final norm). With sequence
    parallelism each TP rank sees half of every sequence, so the norm weights' gradients are
    partial sums that ``finalize_model_grads`` must add over TP: the test compares them on every
    TP rank with the TP=1 gradients (a missing reduction gives each rank its own partial value).
    Sequence lengths are odd and even, so SP pads micro-batches to a multiple of TP."""
    single = run_distributed(_train_layouts, 1, args=(str(tmp_path), [
        (1, 1, {"mbs": 1}), (1, 1, {"mbs": 3}), (1, 1, {"packing": True, "max_tokens": 30}),
        (1, 1, {"mbs": 1, "correct": True})]), timeout_s=240)[0]
    double = run_distributed(_train_layouts, 2, args=(str(tmp_path), [
        (2, 1, {}), (2, 1, {"mbs": 3, "sp": True}), (2, 1, {"sp": True, "packing": True}),
        (1, 2, {}), (1, 2, {"packing": True, "max_tokens": 25}),
        (1, 1, {}), (1, 1, {"mbs": 3, "dist_opt": True}),
        (1, 1, {"packing": True, "max_tokens": 40}), (1, 1, {"packing": True, "balance": False}),
        (2, 1, {"sp": True, "correct": True}), (1, 2, {"correct": True}),
        (1, 1, {"packing": True, "max_tokens": 40, "correct": True})]),
        timeout_s=420)[0]
    (_, (lp0, ent0), m0, mask0, g0, w0, _), *others = single + double
    # mask_strategy=auto (the default): a pre-pass first (it measures a correction's cost), then the
    # correction (the running guess is right here); "correct" layouts re-run every micro-batch that
    # holds a masked token, and still give the reference's update to the same tolerance
    for layout, _, m, *_ in single + double:
        corrected = [m[u]["mask/corrected_microbatch_frac"] for u in range(2)]
        if dict(layout[2]).get("correct"):
            assert [m[u]["mask/correct"] for u in range(2)] == [1.0, 1.0] and min(corrected) > 0, (layout, m)
        else:
            assert [m[u]["mask/correct"] for u in range(2)] == [0.0, 1.0] and corrected[1] == 0.0, (layout, m)
    assert len(m0) == 2 and m0[0]["m2po/mask_frac"] > 0, m0  # the test data does mask tokens
    assert sum(not k for k in mask0.values()) > 0
    assert any(s.length % 2 for s in lib.make_samples(8, seed=5)), "some sequence must need SP padding"
    (g0,) = g0
    assert any("q_layernorm" in k for k in g0) and any("final_layernorm" in k for k in g0), sorted(g0)
    for layout, (lp, ent), m, mask, grads, w, plan in others:
        opts = dict(layout[2])
        # the packed layouts do pack: some micro-batch is one row of several sequences
        assert all(packed == opts.get("packing", False) for _, _, packed in plan), (layout, plan)
        if opts.get("packing"):
            assert any(len(ix) > 1 and shape[0] == 1 for ix, shape, _ in plan), (layout, plan)
        for a, b in zip(lp, lp0):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=str(layout))
        for a, b in zip(ent, ent0):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=str(layout))
        assert mask == mask0, layout
        for u in range(2):
            for key in ("m2po/mask_frac", "m2po/m2_before", "m2po/m2_after", "loss/policy", "policy/kl_k3",
                        "policy/entropy", "optim/grad_norm"):
                assert m[u][key] == pytest.approx(m0[u][key], rel=1e-5, abs=1e-7), (layout, u, key)
        for g in grads:  # every TP rank of the replica
            assert not g or set(g) == set(g0), layout
            for name in g:
                np.testing.assert_allclose(g[name], g0[name], rtol=1e-4, atol=1e-6, err_msg=f"{layout} {name}")
        # lr 1e-3 for two Adam steps: fp32 reduction-order differences in near-zero gradients move
        # a weight by a few 1e-6 .. 1e-5 (measured up to 2.2e-5 at TP=2 + SP)
        for name in w0:
            np.testing.assert_allclose(w[name], w0[name], rtol=0, atol=5e-5, err_msg=f"{layout} {name}")


def _grad_scale_and_onpolicy(rank, world_size, root):
    """Gradient norm of one update vs an HF autograd reference of -(1/N) sum M r A; on-policy sanity."""
    import transformers as tr

    from megatron_m2po.actor.actor import ActorConfig, MegatronActor

    d = _hf_dir(root, "qwen3", seed=6)
    out = {}
    # on-policy: behaviour = current log-probs -> ratio 1, KL 0, nothing masked
    cfg = lib.actor_config(d, mbs=2)
    actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))
    batch = _stale_batch(actor, lib.make_samples(6, seed=7), noise=0.0)
    out["onpolicy"] = actor.train_step(batch, 1)[0]
    actor.close()

    # gradient scale: grad_clip off so optimizer/grad_norm is the raw global norm
    cfg = lib.actor_config(d, mbs=2)
    cfg.optim.grad_clip = 0.0
    cfg.algo.m2po.threshold = 0.02
    actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))
    samples = lib.make_samples(6, seed=8)
    batch = _stale_batch(actor, samples, noise=0.5, seed=3)
    rec = lib.Recorder(actor)
    metrics = actor.train_step(batch, 1)[0]
    keep = rec.mask(0)
    assert rec.strategy(0) == "prepass" and len(keep) == sum(len(s.response_ids) for s in samples)
    # HF reference
    hf = tr.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    n = float(sum(int(s.loss_mask.sum()) for s in samples))
    loss, offset = 0.0, 0
    for s in samples:
        ids = torch.tensor(np.concatenate([s.prompt_ids, s.response_ids]))[None]
        lp = torch.log_softmax(hf(ids).logits[0].float(), -1)
        p, r = len(s.prompt_ids), len(s.response_ids)
        lp = lp[torch.arange(p - 1, p - 1 + r), torch.tensor(s.response_ids)]
        ratio = torch.exp(lp - torch.tensor(s.behav_logprobs))
        m = torch.tensor([float(s.loss_mask[j] and keep[offset + j]) for j in range(r)])
        loss = loss - (m * ratio * torch.tensor(s.advantages)).sum() / n
        offset += r
    loss.backward()
    ref_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters() if p.grad is not None)))
    out["grad"] = (metrics.get("optim/grad_norm"), ref_norm, metrics["loss/policy"], float(loss))
    actor.close()
    return out


@pytest.mark.slow  # over 10 s on the CI machine under load: the full suite's lane
def test_gradient_scale_and_on_policy_sanity(tmp_path):
    (out,) = run_distributed(_grad_scale_and_onpolicy, 1, args=(str(tmp_path),), timeout_s=180)
    m = out["onpolicy"]
    assert m["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert m["policy/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert abs(m["policy/kl_k1"]) < 1e-6 and abs(m["policy/kl_k3"]) < 1e-9
    assert m["m2po/mask_frac"] == 0.0 and m["m2po/m2_before"] < 1e-10
    assert m["staleness/mean"] == 0.0 and m["staleness/max"] == 0.0
    got, ref, loss, ref_loss = out["grad"]
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert got is not None and got == pytest.approx(ref, rel=1e-4), (got, ref)


def _all_losses(rank, world_size, root):
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor

    d = _hf_dir(root, "llama", seed=9)
    res = {}
    for loss in ("m2po", "grpo", "no_tr", "gspo", "cispo", "icepop", "mis", "areal_m2po", "vcpo"):
        cfg = lib.actor_config(d, mbs=2, loss=loss)
        if loss == "m2po":
            cfg.algo.m2po.rule, cfg.algo.m2po.scope = "cap", "microbatch"  # the released code's variant
        actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))
        samples = lib.make_samples(4, seed=10, version=0)
        batch = _stale_batch(actor, samples, noise=0.3)
        before = {k: v.clone() for k, v in actor.iter_hf_weights()}
        actor.version = 3  # staleness = update index - token version
        m = actor.train_step(batch, 2)
        after = dict(actor.iter_hf_weights())
        moved = max(float((after[k] - before[k]).abs().max()) for k in before)
        res[loss] = (m, moved, actor.version)
        actor.close()
    return res


@pytest.mark.slow  # over 10 s on the CI machine under load: the full suite's lane
def test_every_registered_loss_trains(tmp_path):
    (res,) = run_distributed(_all_losses, 1, args=(str(tmp_path),), timeout_s=180)
    for loss, (metrics, moved, version) in res.items():
        assert version == 5 and len(metrics) == 2 and moved > 0, loss
        for m in metrics:
            assert all(np.isfinite(v) for v in m.values()), (loss, m)
        assert metrics[0]["staleness/mean"] == 3.0 and metrics[1]["staleness/max"] == 4.0
    assert "loss/clip_frac" in res["grpo"][0][0] and "m2po/mask_frac" in res["m2po"][0][0]
    # the off-policy corrections: areal_m2po's global mask came from the pre-pass, vcpo scaled its LR
    assert "areal_m2po/mask_frac" in res["areal_m2po"][0][0] and "mis/mask_frac" in res["mis"][0][0]
    assert all(m["optim/lr"] == pytest.approx(1e-3 * m["vcpo/lr_scale"]) for m in res["vcpo"][0])


def _checkpoint_resume(rank, world_size, root, dist_opt):
    import multiprocessing

    from megatron_m2po.actor.actor import ActorConfig, MegatronActor

    # Megatron's torch_dist writer starts a multiprocessing Manager; the test harness runs ranks as
    # daemonic processes, which may not have children (torchrun ranks are not daemonic).
    multiprocessing.current_process()._config["daemon"] = False

    d = _hf_dir(root, "qwen2", tie=True, seed=12)
    cfg = lib.actor_config(d, tp=1, pp=1, mbs=2, dist_opt=dist_opt)
    ckdir = os.path.join(root, f"ckpt_{dist_opt}")
    actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))
    b1 = _stale_batch(actor, lib.make_samples(4, seed=13), noise=0.4, seed=1)
    actor.train_step(b1, 2)
    actor.save_checkpoint(os.path.join(ckdir, "step_1"), {"cursor": 17, "note": "x"})
    b2 = _stale_batch(actor, lib.make_samples(4, seed=14), noise=0.4, seed=2)
    m_a = actor.train_step(b2, 2)
    w_a = {k: v.numpy().copy() for k, v in actor.iter_hf_weights()}
    actor.close()

    actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))
    extra = actor.load_checkpoint(ckdir)  # follows 'latest'
    version = actor.version
    m_b = actor.train_step(b2, 2)
    w_b = {k: v.numpy().copy() for k, v in actor.iter_hf_weights()}
    export = os.path.join(root, f"export_{dist_opt}")
    from megatron_m2po.weights.hf_export import export_hf

    export_hf(actor, export)
    actor.close()
    same = all(np.array_equal(w_a[k], w_b[k]) for k in w_a)
    exported = lib.read_safetensors_dir(export) if rank == 0 else None
    exp_same = rank != 0 or all(np.array_equal(exported[k].numpy(), w_b[k]) for k in w_b)
    return extra, version, same, m_a == m_b, exp_same, sorted(os.listdir(ckdir))


@pytest.mark.parametrize("world_size,dist_opt", [(1, False), (2, True)])
@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_checkpoint_resume_gives_identical_next_step(tmp_path, world_size, dist_opt):
    res = run_distributed(_checkpoint_resume, world_size, args=(str(tmp_path), dist_opt), timeout_s=200)
    for extra, version, same, same_metrics, exp_same, listing in res:
        assert extra == {"cursor": 17, "note": "x"} and version == 2
        assert same and same_metrics and exp_same
        assert listing == ["latest", "step_1"]


def _sp_precision_recompute(rank, world_size, root, variants):
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor

    d = _hf_dir(root, "qwen3", seed=15)
    out = []
    for dtype, recompute in variants:
        cfg = lib.actor_config(d, tp=2, mbs=2)
        cfg.parallel.sequence_parallel = True
        cfg.parallel.recompute = recompute
        cfg.model.dtype = dtype
        actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))
        samples = lib.make_samples(4, seed=16)
        batch = _stale_batch(actor, samples, noise=0.3)
        before = {k: v.float().clone() for k, v in actor.iter_hf_weights()}
        m = actor.train_step(batch, 1)[0]
        after = {k: v.float() for k, v in actor.iter_hf_weights()}
        out.append((dtype, recompute, m, max(float((after[k] - before[k]).abs().max()) for k in before),
                    [s.behav_logprobs for s in samples]))
        actor.close()
    return out


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_sequence_parallel_with_bf16_and_recompute(tmp_path):
    """TP=2 with sequence parallelism runs one update in bf16 with selective recompute and in fp32
    with full recompute: finite metrics, weights move; full recompute gives the metrics and
    gradient norm of the same update without recompute (it re-runs the same fp32 arithmetic),
    and bf16 log-probs stay near the fp32 ones."""
    res = run_distributed(_sp_precision_recompute, 2, args=(str(tmp_path), [
        ("bfloat16", "selective"), ("float32", "full"), ("float32", "none")]), timeout_s=240)
    for rank_res in res:
        for dtype, recompute, m, moved, _ in rank_res:
            assert all(np.isfinite(v) for v in m.values()), (dtype, recompute, m)
            assert moved > 0, (dtype, recompute)
        (_, _, _, _, lp_bf16), (_, _, m_full, _, lp_fp32), (_, _, m_none, _, _) = rank_res
        for key in ("loss/policy", "optim/grad_norm", "policy/entropy", "m2po/m2_before"):
            assert m_full[key] == pytest.approx(m_none[key], rel=1e-6, abs=1e-9), key
        # bf16 keeps 8 mantissa bits: log-probs of a tiny model within 0.1 nat of fp32
        err = max(float(np.abs(a - b).max()) for a, b in zip(lp_bf16, lp_fp32))
        assert 0 < err < 0.1, err


def _sharded_vs_whole(rank, world_size, root):
    """Two updates from the whole mini-batches on every rank, then from their plans plus each
    rank's own shard (``ShardedBatch``), starting from the same weights."""
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import BatchPlan, ShardedBatch

    d = _hf_dir(root, "qwen2", seed=17)
    cfg = lib.actor_config(d, mbs=2)
    cfg.parallel.packing, cfg.parallel.max_tokens_per_microbatch = True, 40
    cfg.algo.m2po.threshold = 0.02
    out = []
    for sharded in (False, True):
        actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))
        batch = _stale_batch(actor, lib.make_samples(8, seed=18, version=0), noise=0.5)
        actor.version = 2
        minis = batch.split(2)
        if not sharded:
            metrics = [actor.train_update(m) for m in minis]
            wrong = None
        else:
            plans = [BatchPlan.of(m.samples) for m in minis]
            try:  # a rank sent someone else's shard is told so, before any collective
                other = actor.shards(plans[0])[1 - actor.dp_rank]
                actor.train_update(ShardedBatch(plans[0], {i: minis[0].samples[i] for i in other}))
                wrong = "no error"
            except ValueError as e:
                wrong = str(e)
            metrics = []
            for m, plan in zip(minis, plans):
                mine = actor.shards(plan)[actor.dp_rank]
                metrics.append(actor.train_update(ShardedBatch(plan, {i: m.samples[i] for i in mine})))
        weights = {k: v.numpy().copy() for k, v in actor.iter_hf_weights()}
        actor.close()
        out.append((metrics, weights, wrong))
    return out


def test_a_rank_needs_only_its_shard(tmp_path):
    """DP=2: updates from (global plan + own shard) equal updates from the whole mini-batch on
    every rank: metrics (staleness from the plan's version counts included) and weights."""
    res = run_distributed(_sharded_vs_whole, 2, args=(str(tmp_path),), timeout_s=240)
    for (m_whole, w_whole, _), (m_shard, w_shard, wrong) in res:
        assert "was sent a shard without mini-batch samples" in wrong, wrong
        assert m_whole == m_shard
        assert m_whole[0]["staleness/mean"] == 2.0 and m_whole[1]["staleness/max"] == 3.0
        for k in w_whole:
            assert np.array_equal(w_whole[k], w_shard[k]), k


def _dump_layouts(rank, world_size, root, layouts):
    """The trainer's token dump (``trainer/token_dump.py``) of one step of two updates, recorded
    through the actor's ``token_hook`` at each layout ``(tp, pp, packing)``; rank 0 returns the
    arrays of the written file."""
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.trainer.token_dump import TokenDump, read_token_dump

    d = _hf_dir(root, "qwen3", seed=4)
    out = []
    for tp, pp, packing in layouts:
        cfg = lib.actor_config(d, tp=tp, pp=pp, mbs=2)
        cfg.parallel.sequence_parallel = tp > 1
        cfg.parallel.packing, cfg.parallel.max_tokens_per_microbatch = packing, (40 if packing else None)
        cfg.algo.m2po.threshold = 0.02
        cfg.logging.dump_tokens_every = 1
        actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))
        batch = _stale_batch(actor, lib.make_samples(8, seed=5), noise=0.5)
        actor.version = 2
        run_dir = os.path.join(root, f"dump_{tp}_{pp}_{packing}_{world_size}")
        dump = TokenDump(cfg, actor, run_dir)
        dump.begin(0)
        first = 0
        for mini in batch.split(2):
            update = actor.version
            actor.train_update(mini)
            dump.end_update(mini, update, first)
            first += len(mini.samples)
        path = dump.write()
        actor.close()
        if rank == 0:
            data, meta = read_token_dump(path)
            out.append(((tp, pp, packing), data))
    return out


@pytest.mark.multiproc
@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_token_dump_is_the_same_at_every_layout(tmp_path):
    """The per-token dump of a step (log-prob and entropy at the training weights, the keep mask
    the loss used, the clip / mask flags) does not depend on the layout: TP=2 with SP, PP=2
    (recorded by the last stage, gathered to rank 0) and DP=2 with packing write what one
    process writes (log-probs, entropy and the behaviour log-probs each layout computed to 1e-5,
    the rest exactly)."""
    (ref,) = run_distributed(_dump_layouts, 1, args=(str(tmp_path), [(1, 1, False)]), timeout_s=240)[0]
    others = run_distributed(_dump_layouts, 2, args=(str(tmp_path), [(2, 1, False), (1, 2, False), (1, 1, True)]),
                             timeout_s=360)[0]
    _, base = ref
    assert len(base["token"]) > 20 and base["m2po_masked"].any() and (base["keep"] == 0).any()
    assert sorted(set(base["update"].tolist())) == [2, 3]
    for layout, data in others:
        assert set(data) == set(base), layout
        for k in base:
            if k in ("logp", "behav_logp", "entropy", "logratio"):  # behaviour = each layout's log-probs + noise
                np.testing.assert_allclose(data[k], base[k], rtol=0, atol=1e-5, err_msg=f"{k} {layout}")
            else:
                np.testing.assert_array_equal(data[k], base[k], err_msg=f"{k} {layout}")
