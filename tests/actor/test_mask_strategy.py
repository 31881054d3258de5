"""``algo.m2po.mask_strategy=correct`` (actor/mask_correction.py) gives the update of the pre-pass
strategy: metrics, the global mask (decided by the literal Algorithm 1 reference), the per-token
dump, gradients and the weights after the optimizer step, when the provisional mask is wrong in
every micro-batch, right everywhere, and when nothing is masked; at TP=1, TP=2 + SP, PP=2 and DP=2
packed. Plus the strategy choice of ``auto`` and the refusals."""

import os
import sys

import numpy as np
import pytest
import torch

import actor_testlib as lib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "algo"))
import m2_reference as ref  # noqa: E402  (tests/algo: the literal Algorithm 1)
from megatron_m2po.standins.dist_testing import run_distributed

TAU = 0.02
LR = 1e-3  # actor_testlib's default


def _hf_dir(root, layers=2):
    d = os.path.join(root, f"qwen3_mask_{layers}")
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        lib.make_tiny_hf("qwen3", d, seed=21, layers=layers)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return d


def _grad(actor, p):
    """The update's gradient of ``p``: its grad buffer; with the distributed optimizer that holds
    the data-parallel sum only on the part this rank owns (the rest is the local partial sum), so
    the owners' parts are summed over the data-parallel group."""
    g = p.main_grad.detach().clone()
    if not actor.cfg.parallel.use_distributed_optimizer:
        return g.numpy()
    full = torch.zeros_like(g).view(-1)
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        if p in opt.model_param_gbuf_map:  # this rank owns part of p
            r = opt._get_model_param_range_map(p)["param"]
            full[r.start:r.end] = g.view(-1)[r.start:r.end]
    torch.distributed.all_reduce(full, group=actor.pg.dp)
    return full.view_as(g).numpy()


def _state(actor):
    """{local parameter name: (weights after the step, the update's gradient)} of this rank (both
    strategies run the same layout, so each rank compares its own shard)."""
    return {f"{c}.{name}": (p.detach().float().clone().numpy(), _grad(actor, p))
            for c, chunk in enumerate(actor.model) for name, p in chunk.named_parameters()}


def _gather(obj):
    objs = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(objs, obj)
    return objs


# The provisional mask of each update of the "correct" run: "keep_all" (wrong wherever the exact
# mask masks: every micro-batch here), "exact" (the pre-pass's mask: right everywhere), "inverted"
# (every token's keep flipped: wrong on every token, both ways), "running" (the
# loss spec's own guess, Algorithm 1 over the tokens seen so far); the last update's M2 is under
# the threshold (nothing masked, nothing to correct).
GUESSES = ("keep_all", "exact", "inverted", "running", "running")


def _forced_guess(kind, exact):
    def guess(spec, settings, mb, delta, earlier):
        valid = mb.loss_mask.bool()
        if kind == "keep_all":
            return valid.clone()
        right = torch.tensor([exact[i] for i in mb.token_index.tolist()], dtype=torch.bool)
        return valid & ~right if kind == "inverted" else right

    return guess


def _moe_dir(root):
    d = os.path.join(root, "qwen3_moe_mask")
    if torch.distributed.get_rank() == 0:
        lib.make_tiny_hf("qwen3_moe", d, seed=21)
    torch.distributed.barrier()
    return d


# Under expert parallelism (DP=2): per update one kind per data-parallel rank, so that one rank
# corrects while the other has nothing to (it fills with zero-weight micro-batches: every MoE
# forward is an all-to-all over both), then different correction counts.
EP_GUESSES = (("keep_all", "exact"), ("exact", "inverted"), ("inverted", "keep_all"), "running", "running")


def _run(rank, world_size, root, layouts):
    """Per layout and update: the pre-pass update, then the same update from the same state
    (``actor_testlib.snapshot``) with the correction strategy and the provisional mask of
    ``GUESSES`` (``EP_GUESSES`` under expert parallelism); the trajectory goes on from the
    corrected update."""
    from megatron_m2po.actor import mask_correction
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch

    pad = mask_correction.pad_for_schedule
    fills = []  # filler micro-batches the interleaved schedule needed per correction run

    def counted(groups, weights, target, *args, **kw):
        fills.append(target - len(groups))
        return pad(groups, weights, target, *args, **kw)

    mask_correction.pad_for_schedule = counted
    out = []
    for tp, pp, o in layouts:
        d = _moe_dir(root) if o.get("ep") else _hf_dir(root, layers=pp * o["vp"] if o.get("vp") else 2)
        guesses = EP_GUESSES if o.get("ep") else GUESSES
        fills.clear()
        cfg = lib.actor_config(d, tp=tp, pp=pp, mbs=o.get("mbs", 2))
        cfg.parallel.expert_parallel = o.get("ep", 1)
        cfg.parallel.virtual_pipeline_parallel = o.get("vp")
        cfg.parallel.use_distributed_optimizer = o.get("dist_opt", False)
        cfg.parallel.sequence_parallel = o.get("sp", False)
        cfg.parallel.packing = o.get("packing", False)
        cfg.parallel.max_tokens_per_microbatch = o.get("max_tokens")
        cfg.model.dtype = o.get("dtype", "float32")
        cfg.parallel.recompute = o.get("recompute", "none")
        cfg.algo.m2po.threshold = TAU
        actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))
        samples = lib.make_samples(4 * len(GUESSES), seed=22)
        lps = actor.compute_logprobs(RolloutBatch(samples))
        rng = np.random.default_rng(3)
        for s, lp in zip(samples, lps):
            s.behav_logprobs = (lp + 0.5 * rng.standard_normal(lp.shape)).astype(np.float32)
        updates = []
        m2 = actor.cfg.algo.m2po
        for u, mini in enumerate(RolloutBatch(samples).split(len(GUESSES))):
            m2.threshold = 100.0 if u == len(GUESSES) - 1 else TAU  # last: M2 under the threshold, nothing masked
            snap = lib.snapshot(actor)
            pair, exact = {}, {}
            for strategy in ("prepass", "correct"):
                if strategy == "correct":
                    lib.restore(actor, snap)
                    kind = guesses[u] if isinstance(guesses[u], str) else guesses[u][actor.dp_rank]
                    if kind != "running":  # the actor's guess, replaced for this update
                        actor.global_mask.guess = _forced_guess(kind, exact)
                m2.mask_strategy = strategy
                rec = lib.Recorder(actor)
                m = actor.train_update(mini)
                if strategy == "prepass":
                    exact = rec.mask(u)  # of this rank's tokens: the mask the forced guesses are built from
                tokens = [(r.mb.token_index.tolist(), r.logp.float().tolist(), r.entropy.float().tolist(),
                           r.mb.behav_logprobs.tolist(), r.mb.advantages.tolist(), r.mb.loss_mask.tolist(),
                           r.keep.tolist()) for r in rec.updates.get(u, []) if actor.tp_rank == 0]
                strategies = set().union(*_gather({r.strategy for r in rec.updates.get(u, [])}))  # last stage's
                # micro-batches holding a token the exact mask removes (what keep-all gets wrong)
                hits = sum(_gather([bool((r.mb.loss_mask.bool() & ~r.keep).any()) for r in rec.updates.get(u, [])
                                    if actor.tp_rank == 0]), [])
                pair[strategy] = (m, strategies, _state(actor), sum(_gather(tokens), []), hits)
                actor.global_mask.__dict__.pop("guess", None)
            updates.append((pair["prepass"], pair["correct"]))
        actor.close()
        out.append(((tp, pp, tuple(sorted(o.items())) + (("fills", sum(_gather(sum(fills)))),)), updates))
    mask_correction.pad_for_schedule = pad
    return out


def _check(results):
    for layout, updates in results:
        opts = dict(layout[2])
        fp32 = opts.get("dtype", "float32") == "float32"
        guesses = EP_GUESSES if opts.get("ep") else GUESSES
        if opts.get("vp") or opts.get("ep"):  # some correction ran fewer micro-batches than the schedule
            assert opts["fills"] > 0, layout  # or another expert-parallel rank takes
        tol = dict(rel=1e-5, abs=1e-7) if fp32 else dict(rel=2e-2, abs=1e-4)
        for u, ((ma, sa, ga, ta, hits), (mb, sb, gb, tb, _)) in enumerate(updates):
            assert (sa, sb) == ({"prepass"}, {"correct"}), (layout, u)  # the records' strategies
            # mask/*: what the guess cost (the pre-pass measures it only for auto)
            assert set(ma) == {k for k in mb if not k.startswith("mask/")}, (layout, u, set(ma) ^ set(mb))
            for k in ma:
                assert mb[k] == pytest.approx(ma[k], **tol), (layout, u, k, ma[k], mb[k])
            assert mb["mask/correct"] == 1.0
            frac = mb["mask/corrected_microbatch_frac"]
            if not isinstance(guesses[u], str):  # one rank's guess wrong, or the two differently
                assert ma["m2po/mask_frac"] > 0 and frac > 0, (layout, u, ma["m2po/mask_frac"], frac)
            elif guesses[u] == "keep_all":  # wrong in every micro-batch where the exact mask removes a token
                assert ma["m2po/mask_frac"] > 0 and frac == pytest.approx(np.mean(hits)) and frac > 0.5, \
                    (layout, u, ma["m2po/mask_frac"], frac, hits)
            elif guesses[u] == "inverted":  # wrong on every token
                assert ma["m2po/mask_frac"] > 0 and frac == 1.0, (layout, u, ma["m2po/mask_frac"], frac)
            elif guesses[u] == "exact" or u == len(GUESSES) - 1:  # a right guess, or nothing masked
                assert mb["mask/correction_token_frac"] == 0.0, (layout, u, mb)
            if u == len(GUESSES) - 1:
                assert ma["m2po/mask_frac"] == 0.0
            # Gradients: the same up to rounding of the masked tokens' contributions, which the
            # correction subtracts (or adds) in another forward (the layout tests' tolerance).
            # Weights after the step: where the gradient is ~0, Adam turns that rounding (up to
            # ~3e-8 here) into a step of up to lr (lr |g| / (|g| + eps)); every other coordinate
            # stays within 1e-6.
            # bf16: the cancelled contributions carry bf16 rounding (8 bits): per tensor the
            # gradients agree to 5 % in norm (bf16 pre-pass updates at micro-batch 1 vs 2 differ by
            # up to 3.1 % here, the correction by 3.9 % when it re-adds 20 % of the tokens) and the
            # weights to two bf16 ulps at 1.0 (the layout difference is one).
            assert set(ga) == set(gb), layout
            for name, (wa, g_a) in ga.items():
                wb, g_b = gb[name]
                if fp32:
                    np.testing.assert_allclose(g_b, g_a, rtol=1e-4, atol=1e-6, err_msg=f"{layout} {u} grad {name}")
                    bound = np.where(np.abs(g_a) < 1e-6, LR, 1e-6)
                else:
                    err = np.linalg.norm(g_b - g_a) / max(float(np.linalg.norm(g_a)), 1e-12)
                    assert err <= 5e-2, (layout, u, name, err)
                    bound = 2 ** -7
                assert (np.abs(wb - wa) <= bound).all(), (layout, u, name, float(np.abs(wb - wa).max()))
            # the per-token dump: same tokens, same values, the exact mask
            da = {r[0]: r[1:] for t in ta for r in zip(*t)}
            db = {r[0]: r[1:] for t in tb for r in zip(*t)}
            assert set(da) == set(db) and len(da) > 10, layout
            for i in da:
                assert da[i][5] == db[i][5], (layout, u, i)  # keep
                np.testing.assert_allclose(db[i][:2], da[i][:2], rtol=0, atol=1e-5 if fp32 else 5e-2)
            # the literal Algorithm 1 reference decides every token (on the correct run's log-ratios)
            if u < len(GUESSES) - 1:
                idx = sorted(db)
                delta = (torch.tensor([db[i][0] for i in idx]) - torch.tensor([db[i][2] for i in idx])).clamp(-20, 20)
                adv = [db[i][3] for i in idx]
                valid = [bool(db[i][4]) for i in idx]
                keep = ref.remove_rule(delta, adv, valid, TAU, order_key=idx)["keep"].tolist()
                assert [bool(db[i][5]) for i in idx] == [bool(k) for k in keep], (layout, u)


def _auto(rank, world_size, root):
    """Four updates with mask_strategy=auto, the second with a guess that masks every token: the
    strategy each took and its metrics."""
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch

    cfg = lib.actor_config(_hf_dir(root), mbs=1)
    cfg.algo.m2po.threshold, cfg.algo.m2po.mask_strategy = TAU, "auto"
    actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))
    samples = lib.make_samples(32, seed=23, response=(20, 40))
    for s, lp in zip(samples, actor.compute_logprobs(RolloutBatch(samples))):
        s.behav_logprobs = (lp + 0.5 * np.random.default_rng(4).standard_normal(lp.shape)).astype(np.float32)
    out = []
    for u, mini in enumerate(RolloutBatch(samples).split(4)):
        if u == 1:
            actor.global_mask.guess = lambda spec, settings, mb, delta, earlier: torch.zeros_like(
                mb.loss_mask, dtype=torch.bool)
        rec = lib.Recorder(actor)
        m = actor.train_update(mini)
        actor.global_mask.__dict__.pop("guess", None)
        out.append((rec.strategy(u), m))
    actor.close()
    return out


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_correct_equals_prepass_one_process(tmp_path):
    """TP=1, padded micro-batches of 2, and packed with a token budget under full recompute; and
    ``auto``: a pre-pass first, which measures what a correction would have re-run, then the
    cheaper way by the last measurement: the running guess re-runs a few % of the tokens (correct),
    a guess that masks everything most of them (pre-pass next)."""
    res = run_distributed(_run, 1, args=(str(tmp_path), [
        (1, 1, {}), (1, 1, {"packing": True, "max_tokens": 40, "recompute": "full"})]), timeout_s=240)[0]
    _check(res)
    from megatron_m2po.actor.mask_correction import FORWARD_SHARE

    (updates,) = run_distributed(_auto, 1, args=(str(tmp_path),), timeout_s=240)
    took = [t for t, _ in updates]
    fracs = [m["mask/correction_token_frac"] for _, m in updates]
    assert took == ["prepass", "correct", "prepass", "correct"], (took, fracs)
    assert fracs[0] < FORWARD_SHARE["none"] < fracs[1] and fracs[2] < FORWARD_SHARE["none"], fracs
    assert [m["mask/correct"] for _, m in updates] == [0.0, 1.0, 0.0, 1.0]


@pytest.mark.multiproc
@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_correct_equals_prepass_at_every_layout(tmp_path):
    """TP=2 + SP (fp32 and bf16), PP=2 (1F1B; the cuts broadcast to the first stage) and DP=2
    packed with a token budget (each replica corrects its own shard, one grad sync)."""
    res = run_distributed(_run, 2, args=(str(tmp_path), [
        (2, 1, {"sp": True}), (1, 2, {}), (1, 1, {"packing": True, "max_tokens": 40}),
        (2, 1, {"sp": True, "dtype": "bfloat16"})]), timeout_s=480)
    for rank_res in res:
        _check(rank_res)


@pytest.mark.multiproc
@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_correct_equals_prepass_interleaved_distributed_optimizer_and_recompute(tmp_path):
    """PP=2 x VP=2 (Megatron's interleaved schedule; corrections of one micro-batch are filled up
    with zero-weight ones, ``mask_correction.pad_for_schedule``), the distributed optimizer at
    DP=2, and selective recompute at TP=2 + SP."""
    res = run_distributed(_run, 2, args=(str(tmp_path), [
        (1, 2, {"vp": 2, "mbs": 1}), (1, 1, {"dist_opt": True}), (2, 1, {"sp": True, "recompute": "selective"})]),
        timeout_s=480)
    for rank_res in res:
        _check(rank_res)


@pytest.mark.multiproc
@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_correct_equals_prepass_under_expert_parallelism(tmp_path):
    """The tiny Qwen3-MoE at EP=2 (DP=2, each rank holds 2 of the 4 experts), one sequence per
    micro-batch: a correction on one data-parallel rank only (the other joins every MoE all-to-all
    with zero-weight micro-batches, ``GlobalMask.expert_count``), then corrections of different
    counts on the two; the update equals the pre-pass's."""
    res = run_distributed(_run, 2, args=(str(tmp_path), [(1, 1, {"ep": 2, "mbs": 1})]), timeout_s=300,
                          pg_timeout_s=90)
    for rank_res in res:
        _check(rank_res)


@pytest.mark.multiproc
@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_correct_equals_prepass_under_expert_and_pipeline_parallelism(tmp_path):
    """As above at EP=2 x PP=2 (world 4): each stage's expert all-to-alls step together, the stages
    of a replica take the same count (their cuts are broadcast first). (EP=2 x TP=2 + SP, whose
    expert-TP gathers span the TP pair, passed the same checks once by hand: 46 s.)"""
    res = run_distributed(_run, 4, args=(str(tmp_path), [(1, 2, {"ep": 2, "mbs": 1})]), timeout_s=400,
                          pg_timeout_s=90)
    for rank_res in res:
        _check(rank_res)


def test_auto_takes_the_cheaper_way_and_bad_settings_are_refused():
    from megatron_m2po.actor.mask_correction import (FORWARD_SHARE, check_dropout, choose_strategy,
                                                     pad_for_schedule, schedule_count)
    from megatron_m2po.config import load_config

    # auto: a pre-pass first (it measures what a correction would have cost), then whichever costs less
    assert choose_strategy("auto", None, recompute="none", dropout=False) == "prepass"
    assert choose_strategy("auto", {"mask/correction_token_frac": 0.02}, recompute="none", dropout=False) == "correct"
    assert choose_strategy("auto", {"mask/correction_token_frac": 0.3}, recompute="full", dropout=False) == "prepass"
    assert choose_strategy("auto", {"mask/correction_token_frac": 0.3}, recompute="none", dropout=False) == "correct"
    assert FORWARD_SHARE["full"] < 0.3 < FORWARD_SHARE["none"]
    assert choose_strategy("auto", {"mask/correction_token_frac": 0.0}, recompute="none", dropout=True) == "prepass"
    assert choose_strategy("correct", None, recompute="none", dropout=False) == "correct"
    with pytest.raises(ValueError, match="model.attention_dropout=0 and model.hidden_dropout=0"):
        check_dropout("correct", 0.0, 0.1)
    check_dropout("auto", 0.1, 0.1)  # auto falls back to the pre-pass instead
    # interleaved pipelining: a correction run filled up to whole groups of PP zero-weight micro-batches
    w = [torch.tensor([1, 0, -1], dtype=torch.int8), torch.tensor([1], dtype=torch.int8)]
    lengths = [9, 7, 4, 30]
    cut = {0: 2, 1: 1, 2: 1}
    assert [schedule_count(n, 4) for n in (0, 1, 4, 5)] == [0, 4, 4, 8]
    groups, weights, c = pad_for_schedule([[0, 1], [2]], w, 4, lengths, cut)
    assert groups == [[0, 1], [2], [2], [2]] and [x.tolist() for x in weights] == [[1, 0, -1], [1], [0], [0]]
    assert c == cut
    assert pad_for_schedule([[0], [2]], w, 2, lengths, {0: 2, 2: 1}) == ([[0], [2]], w, {0: 2, 2: 1})
    assert pad_for_schedule([[0]], [None], 2, lengths, {0: 2}, last=False) == ([[0], [0]], [None, None], {0: 2})
    # expert parallelism: a rank with nothing to correct runs the agreed count with its spare sample
    groups, weights, c = pad_for_schedule([], [], 2, lengths, {}, 3)
    assert groups == [[3], [3]] and [x.tolist() for x in weights] == [[0], [0]] and c == {3: 1}
    assert pad_for_schedule([], [], 0, lengths, {}) == ([], [], {})
    with pytest.raises(ValueError, match="cannot fill 2 correction micro-batches up to 1"):
        pad_for_schedule([[0], [2]], w, 1, lengths, cut)
    with pytest.raises(ValueError, match="mask_strategy='correct'.*scope='microbatch'"):
        load_config(None, ["algo.m2po.mask_strategy=correct", "algo.m2po.scope=microbatch", "algo.m2po.rule=cap"])
    with pytest.raises(ValueError, match="mask_strategy"):
        load_config(None, ["algo.m2po.mask_strategy=lazy"])
    assert load_config(None, ["algo.m2po.mask_strategy=auto"]).algo.m2po.mask_strategy == "auto"


@pytest.mark.parametrize("rule", ["remove", "cap"])
def test_running_guess_is_the_exact_mask_of_the_tokens_seen(rule):
    """M2PO's provisional mask of a micro-batch is the rule over the rank's tokens seen so far:
    on the last micro-batch, the exact mask of all of them (``m2po_mask``, ties at the cut broken
    by the order key alike); on the first, the mask of that micro-batch alone."""
    from megatron_m2po.algo.loss_settings import M2POConfig
    from megatron_m2po.algo.losses import get_loss
    from megatron_m2po.algo.m2_mask import m2po_mask

    guess = get_loss("m2po").provisional_keep
    g = torch.Generator().manual_seed(5)
    for tau in (0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 10.0) * 4:
        settings = M2POConfig(threshold=tau, rule=rule)
        # rounded log-ratios: runs of equal (log r)^2, which the order key must break as m2po_mask does
        parts = [((0.3 * torch.randn(n, generator=g) * 8).round() / 8, torch.randn(n, generator=g),
                  torch.rand(n, generator=g) > 0.2) for n in (7, 40, 23)]
        keys = torch.randperm(70, generator=g)
        parts = [p + (keys[o:o + len(p[0])],) for p, o in zip(parts, (0, 7, 47))]
        cat = [torch.cat(x) for x in zip(*parts)]
        want = m2po_mask(*cat[:3], threshold=tau, rule=rule, order_key=cat[3])[0][-23:]
        got = guess(*parts[-1][:3], order_key=parts[-1][3], seen=parts[:-1], settings=settings)
        assert torch.equal(got, want), (rule, tau)
        first = m2po_mask(*parts[0][:3], threshold=tau, rule=rule, order_key=parts[0][3])[0]
        assert torch.equal(guess(*parts[0][:3], order_key=parts[0][3], seen=[], settings=settings), first), (rule, tau)
