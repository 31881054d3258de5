"""Routing replay (``algo.routing_replay=rollout``, ``actor/routing_replay.py``) on the tiny Qwen3-MoE.

The routed experts to replay come from *another* router: an HF model whose gate weights are
re-drawn (a stand-in for an engine at an older weight version) picks the top-k of each token
and layer. The trainer, holding the original weights, must then compute exactly the log-probs
of a naive reference: HF transformers with the original weights whose every MoE layer is forced
to those experts (weights = softmax of the original router's logits at the forced ids, as
Qwen3-MoE renormalises). Checked at several layouts (layout invariance with replay), with
packing, and against the unforced log-probs (which must differ, so the test can fail).
"""

import os

import numpy as np
import pytest
import torch

import actor_testlib as lib
from megatron_m2po.standins.dist_testing import run_distributed


def _dirs(root, layers=2):
    """(original, perturbed-router) tiny MoE dirs of ``layers`` layers, built on rank 0."""
    d = os.path.join(root, f"moe{layers}")
    other = os.path.join(root, f"moe{layers}_other_router")
    if torch.distributed.get_rank() == 0 and not os.path.isfile(os.path.join(other, "config.json")):
        import transformers as tr

        lib.make_tiny_hf("qwen3_moe", d, seed=5, layers=layers)
        m = tr.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        g = torch.Generator().manual_seed(123)
        with torch.no_grad():
            for layer in m.model.layers:
                layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=g))
        m.save_pretrained(other, safe_serialization=True)
    torch.distributed.barrier()
    return d, other


_MODELS: dict = {}


def _hf_route_and_logprobs(hf_dir, ids, force=None):
    """HF forward of one sequence: (top-k ids [T, layers, k] its routers picked, log-probs [T, V]).
    ``force`` [T, layers, k]: every MoE layer uses these experts instead (the naive reference)."""
    if hf_dir not in _MODELS:
        import transformers as tr

        model = tr.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        state: dict = {}
        for li, layer in enumerate(model.model.layers):
            def fwd(h, gate=layer.mlp.gate, li=li):
                logits = torch.nn.functional.linear(h.reshape(-1, gate.hidden_dim), gate.weight)
                if state["force"] is None:
                    probs = torch.softmax(logits, -1, dtype=torch.float)
                    w, idx = torch.topk(probs, gate.top_k, dim=-1)
                    w = w / w.sum(-1, keepdim=True)
                else:
                    idx = torch.as_tensor(state["force"][:, li]).long()
                    w = torch.softmax(logits.gather(1, idx), -1, dtype=torch.float)
                state["picked"][li] = idx
                return logits, w.to(logits.dtype), idx

            layer.mlp.gate.forward = fwd
        _MODELS[hf_dir] = (model, state)
    model, state = _MODELS[hf_dir]
    state.update(force=force, picked={})
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor(ids)[None]).logits[0].double(), -1)
    picked = state["picked"]
    return torch.stack([picked[i] for i in range(len(picked))], 1).numpy(), lp


def _replayed_samples(d, other, n=5, **lengths):
    samples = lib.make_samples(n, seed=21, **lengths)
    for s in samples:
        ids = list(s.prompt_ids) + list(s.response_ids)
        routed, _ = _hf_route_and_logprobs(other, ids)
        s.routed_experts = routed[:-1]  # SGLang's rows: every position but the last
    return samples


def _reference(d, samples, force: bool):
    out = []
    for s in samples:
        ids = list(s.prompt_ids) + list(s.response_ids)
        full = None
        if force:  # the last position's experts are never recorded; any choice leaves the log-probs unchanged
            full = np.concatenate([s.routed_experts, np.broadcast_to(np.arange(2), (1, *s.routed_experts.shape[1:]))])
        _, lp = _hf_route_and_logprobs(d, ids, full)
        p = len(s.prompt_ids)
        out.append(lp[torch.arange(p - 1, len(ids) - 1), torch.tensor(s.response_ids)].float().numpy())
    return out


def _replay_errors(rank, world_size, root, layouts):
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch

    d, other = _dirs(root)
    samples = _replayed_samples(d, other)
    forced, natural = _reference(d, samples, True), _reference(d, samples, False)
    gap = max(float(np.abs(a - b).max()) for a, b in zip(forced, natural))
    res = []
    for ep, tp, pp, packing in layouts:
        cfg = lib.actor_config(d, tp=tp, pp=pp, mbs=2)
        cfg.parallel.expert_parallel = ep
        cfg.parallel.sequence_parallel = tp > 1
        cfg.parallel.packing = packing
        cfg.rollout.return_routed_experts, cfg.rollout.use_router = True, False
        cfg.algo.routing_replay = "rollout"
        actor = MegatronActor.from_config(ActorConfig.from_config(cfg.validate(), total_updates=10))
        lps = actor.compute_logprobs(RolloutBatch(samples))
        metrics = actor.train_step(RolloutBatch([_with_behav(s, lp) for s, lp in zip(samples, lps)]))[0]
        actor.close()
        err = max(float(np.abs(a - b).max()) for a, b in zip(lps, forced))
        res.append(((ep, tp, pp, packing), err, gap, metrics))
    return res


def _with_behav(s, lp):
    import dataclasses

    return dataclasses.replace(s, behav_logprobs=lp)


@pytest.mark.multiproc
@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_replayed_logprobs_equal_hf_forced_to_the_recorded_experts(tmp_path):
    """With replay the actor's fp32 log-probs equal HF's forced to the recorded experts within 1e-5,
    at (EP, TP, PP, packing) = (2,2,1) (TP = ETP = 2 with sequence parallelism, padded rows of 2
    sequences: the router's sequence-major token order and the SP slice) and (1,1,2) packed, on 4
    ranks; forced and natural routing differ by more
    than 1e-2 (the recorded routing matters). The train step on those log-probs is on-policy:
    its training forward replays the same experts (``policy/ratio_max`` = 1 within 1e-5)."""
    layouts = [(2, 2, 1, False), (1, 1, 2, True)]
    res = run_distributed(_replay_errors, 4, args=(str(tmp_path), layouts), timeout_s=400)
    for rank_res in res:
        for layout, err, gap, metrics in rank_res:
            print(f"EP, TP, PP, packing = {layout}: max |logp - HF forced| = {err:.2e} (forced vs natural {gap:.2e})")
            assert gap > 1e-2, gap
            assert err < 1e-5, (layout, err)
            assert abs(metrics["policy/ratio_max"] - 1.0) < 1e-5, (layout, metrics["policy/ratio_max"])


def _recompute_runs(rank, world_size, root, vpps):
    """Per VPP: replay with full recompute vs replay without recompute, PP=2, same samples and
    behaviour log-probs (HF forced to the recorded routing): max |logp - HF forced| of each, and
    the train step's gradients (``main_grad``) of both."""
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch

    d, other = _dirs(root, layers=4)
    # equal lengths: every micro-batch has the same [tokens, top_k] targets, so replaying another
    # micro-batch's routing runs and gives wrong values (not a shape error)
    data = [None, None]
    if rank == 0:  # the HF references once, for both ranks
        data[0] = _replayed_samples(d, other, n=4, prompt=(4, 5), response=(6, 7))
        data[1] = _reference(d, data[0], True)
    torch.distributed.broadcast_object_list(data, src=0)
    samples, forced = data
    train = RolloutBatch([_with_behav(s, lp) for s, lp in zip(samples, forced)])
    res = []
    for vpp in vpps:
        out = {}
        for recompute in ("none", "full"):
            cfg = lib.actor_config(d, pp=2, mbs=2)
            cfg.parallel.virtual_pipeline_parallel = vpp
            cfg.parallel.recompute = recompute
            cfg.rollout.return_routed_experts, cfg.rollout.use_router = True, False
            cfg.algo.routing_replay = "rollout"
            actor = MegatronActor.from_config(ActorConfig.from_config(cfg.validate(), total_updates=10))
            lps = actor.compute_logprobs(RolloutBatch(samples))
            actor.train_step(train)
            grads = {(i, n): p.main_grad.detach().clone() for i, m in enumerate(actor.model)
                     for n, p in m.named_parameters()}
            actor.close()
            out[recompute] = (max(float(np.abs(a - b).max()) for a, b in zip(lps, forced)), grads)
        g0, g1 = out["none"][1], out["full"][1]
        scale = max(float(g.abs().max()) for g in g0.values())
        diff = max(float((g1[k] - g0[k]).abs().max()) for k in g0)
        res.append((vpp, out["none"][0], out["full"][0], diff, scale))
    return res


@pytest.mark.multiproc
@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_full_recompute_with_pipelining_replays_each_micro_batchs_routing(tmp_path):
    """Replay + full recompute at PP=2 (1F1B) and PP=2 x VPP=2 (interleaved, one layer per chunk)
    on a 4-layer tiny MoE, 2 micro-batches (both in flight on the first stage): the log-probs equal HF's forced to the recorded experts
    within 1e-5 and the train step's gradients equal those of replay without recompute within
    1e-6 of their largest entry. The recomputes replay the backward FIFO (``REPLAY_BACKWARD``);
    with Megatron's ``REPLAY_FORWARD`` (the last targets set, another micro-batch's under 1F1B)
    the first stage's gradients differed by 3.4e-3 (1F1B) and 4.3e-3 (interleaved) of a largest
    entry of 8.2e-2 (measured), the log-probs (forward only, no recompute) were right."""
    res = run_distributed(_recompute_runs, 2, args=(str(tmp_path), [None, 2]), timeout_s=300)
    rows = [(rank, *r) for rank, rank_res in enumerate(res) for r in rank_res]
    for rank, vpp, lp_none, lp_full, diff, scale in rows:
        print(f"rank {rank} PP=2 VPP={vpp}: max |logp - HF forced| {lp_none:.1e} (no recompute), "
              f"{lp_full:.1e} (full); max |grad full - grad none| {diff:.2e} of max |grad| {scale:.2e}")
    for rank, vpp, lp_none, lp_full, diff, scale in rows:
        assert scale > 1e-4, (rank, vpp, scale)
        assert lp_none < 1e-5 and lp_full < 1e-5, (rank, vpp, lp_none, lp_full)
        assert diff < 1e-6 * scale, (rank, vpp, diff, scale)


def test_replay_needs_an_moe_model(tmp_path):
    """``algo.routing_replay=rollout`` on a dense model is refused when the Megatron config is built."""
    from megatron_m2po.actor.model import build_transformer_config

    d = lib.make_tiny_hf("qwen3", str(tmp_path / "dense"))
    cfg = lib.actor_config(d)
    cfg.rollout.return_routed_experts, cfg.rollout.use_router, cfg.algo.routing_replay = True, False, "rollout"
    with pytest.raises(ValueError, match=r"algo.routing_replay=rollout needs an MoE model; .* \(qwen3\) has no experts"):
        build_transformer_config(cfg.validate())
