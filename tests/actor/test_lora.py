"""LoRA on the Megatron actor (actor/lora.py, weights/lora_export.py), held to HF peft on CPU / gloo.

* peft equality: with the same non-zero adapters (B random, fp32), the actor at TP=2 + SP, PP=2, CP=2
  and DP=2 gives the per-token log-probs and the adapter gradients (of the sum of the response
  tokens' log-probs) of ``peft.PeftModel`` on the HF model, loaded from the directory the
  exporter wrote -- so the export is what peft loads, too;
* training (at DP=2, in the same launch): the base is frozen (the optimizer holds fp32 states of the adapters only, and a step
  leaves every base tensor bit-identical); ``adapters_disabled`` is exactly the base model; the
  reference KL (the adapter-disabled actor) is 0 at the first update (B = 0, peft's init) and
  > 0 after it; a checkpoint resumes the next update exactly;
* ``model.lora`` config errors name the wrong values.
"""

import os

import numpy as np
import pytest
import torch

import actor_testlib as lib
from megatron_m2po.standins.dist_testing import run_distributed

RANK, ALPHA = 4, 8.0


def _lora_actor(d: str, tp: int = 1, pp: int = 1, sp: bool = False, kl: float = 0.0, cp: int = 1):
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor

    cfg = lib.actor_config(d, tp=tp, pp=pp, mbs=2)
    cfg.parallel.sequence_parallel = sp
    cfg.parallel.context_parallel = cp
    cfg.model.lora.rank, cfg.model.lora.alpha = RANK, ALPHA
    cfg.algo.kl.coef, cfg.algo.kl.estimator = kl, "k3"
    return MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=10)), cfg


def _layouts(rank, world_size, root, layouts):
    from megatron_m2po.actor.batch import RolloutBatch
    from megatron_m2po.weights.lora_export import write_peft_dir

    d = os.path.join(root, "qwen2")
    if rank == 0:
        lib.make_tiny_hf("qwen2", d, seed=4, tie=True)
    torch.distributed.barrier()
    out = []
    for tp, pp, sp, *rest in layouts:
        cp = rest[0] if rest else 1
        actor, cfg = _lora_actor(d, tp, pp, sp, cp=cp)
        lib.random_lora_b(actor, seed=7)
        samples = lib.make_samples(4, seed=5)
        logps = actor.compute_logprobs(RolloutBatch(samples))
        exp = os.path.join(root, f"peft_{tp}_{pp}_{sp}_{cp}")
        write_peft_dir(actor.chunks, cfg.model.lora, exp, base_model_name_or_path=d)
        grads = lib.lora_adapter_grads(actor, samples)
        actor.close()
        out.append(((tp, pp, sp, cp), logps, grads, exp))
    return out


def _both(rank, world_size, root):
    return {"layouts": _layouts(rank, world_size, root, [(2, 1, True), (1, 2, False), (1, 1, False), (1, 1, False, 2)]),
            "training": _training(rank, world_size, root)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both halves on two gloo ranks in one launch (the suite's time budget): the three layouts,
    then the training checks at DP=2. Rank 0's results, and the directory they used."""
    root = str(tmp_path_factory.mktemp("lora"))
    return run_distributed(_both, 2, args=(root,), timeout_s=420)[0], root


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_lora_equals_peft_at_tp2_sp_pp2_cp2_dp2(runs):
    out, root = runs
    res = out["layouts"]
    d = os.path.join(root, "qwen2")
    samples = lib.make_samples(4, seed=5)
    ref_logps, ref_grads = lib.peft_reference(d, res[0][3], samples)
    assert len(ref_grads) == 2 * 2 * 7  # two layers, A and B of the seven projections
    for layout, logps, grads, _ in res:
        for a, b in zip(logps, ref_logps):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=str(layout))
        assert sorted(n for n, _ in grads) == sorted(ref_grads), layout
        for name, g in grads:
            np.testing.assert_allclose(g, ref_grads[name].float().numpy(), rtol=1e-4, atol=1e-5,
                                       err_msg=f"{layout} {name}")
    # the adapters folded into the HF weights: peft's merge_and_unload
    import peft
    import transformers as tr

    from megatron_m2po.weights.lora_export import merge_adapters

    merged = dict(merge_adapters(lib.read_safetensors_dir(d).items(), sorted(lib.read_safetensors_dir(res[0][3]).items()), ALPHA / RANK))
    base = tr.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    want = peft.PeftModel.from_pretrained(base, res[0][3]).merge_and_unload().state_dict()
    for name, w in merged.items():
        torch.testing.assert_close(w, want[name], rtol=0, atol=1e-6, msg=name)
    # every layout exported the same adapters (so the one peft model above stands for all of them)
    a0 = lib.read_safetensors_dir(res[0][3])
    for _, _, _, exp in res[1:]:
        a = lib.read_safetensors_dir(exp)
        assert a.keys() == a0.keys() and all(torch.equal(a[k], a0[k]) for k in a0), exp


def _training(rank, world_size, root):
    import multiprocessing

    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch
    from megatron_m2po.actor.lora import adapter_modules, adapters_disabled
    from megatron_m2po.weights.lora_export import peft_adapter_tensors

    # Megatron's torch_dist writer starts a multiprocessing Manager: ranks of the harness are
    # daemonic and may not have children (as in test_actor.py's resume test)
    multiprocessing.current_process()._config["daemon"] = False
    d = os.path.join(root, "qwen3")
    if rank == 0:
        lib.make_tiny_hf("qwen3", d, seed=2)
    torch.distributed.barrier()
    samples = lib.make_samples(8, seed=3)
    plain_cfg = lib.actor_config(d)
    plain = MegatronActor.from_config(ActorConfig.from_config(plain_cfg, total_updates=10))
    base_logps = plain.compute_logprobs(RolloutBatch(samples))
    plain.close()
    actor, _ = _lora_actor(d, kl=0.05)
    lora_params = [p for m in adapter_modules(actor.chunks) for p in m.parameters()]
    ids = {id(p) for p in lora_params}
    base = {n: p.detach().clone() for n, p in actor.chunks[0].named_parameters() if id(p) not in ids}
    rng = np.random.default_rng(0)
    for s, lp in zip(samples, actor.compute_logprobs(RolloutBatch(samples))):
        s.behav_logprobs = (lp + 0.3 * rng.standard_normal(lp.shape)).astype(np.float32)
    first, second = RolloutBatch(samples[:4]), RolloutBatch(samples[4:])
    m0 = actor.train_update(first)
    ckpt = os.path.join(root, "ckpt", "step_1")
    actor.save_checkpoint(ckpt)
    from megatron.core import dist_checkpointing
    saved = sorted(dist_checkpointing.load_tensors_metadata(os.path.join(ckpt, "dist")))
    m1 = actor.train_update(second)
    after = lib.numpy_pairs(peft_adapter_tensors(actor.chunks))
    inner = [o.optimizer for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])]
    opt_params = [p for o in inner for g in o.param_groups for p in g["params"]]
    state_numel = sum(v.numel() for o in inner for st in o.state.values() for k, v in st.items()
                      if k in ("exp_avg", "exp_avg_sq"))
    with adapters_disabled(actor.model):
        disabled = actor.compute_logprobs(RolloutBatch(samples))
    enabled = actor.compute_logprobs(RolloutBatch(samples))
    actor.load_checkpoint(ckpt)
    m1_again = actor.train_update(second)
    again = lib.numpy_pairs(peft_adapter_tensors(actor.chunks))
    base_same = all(torch.equal(p, base[n]) for n, p in actor.chunks[0].named_parameters() if n in base)
    frozen = all(not p.requires_grad for n, p in actor.chunks[0].named_parameters() if n in base)
    actor.close()
    return dict(m0=m0, m1=m1, m1_again=m1_again, after=after, again=again, base_same=base_same, frozen=frozen,
                n_lora=sum(p.numel() for p in lora_params), n_opt=sum(p.numel() for p in opt_params),
                state_numel=state_numel, disabled=disabled, enabled=enabled, base_logps=base_logps, saved=saved)


@pytest.mark.slow  # over 10 s on the CI machine under load: the full suite's lane
def test_lora_training_frozen_base_reference_kl_and_resume(runs):
    r = runs[0]["training"]
    # the optimizer holds the adapters only: fp32 main params and two Adam moments of them
    assert r["frozen"] and r["n_lora"] > 0
    assert r["n_opt"] == r["n_lora"] and r["state_numel"] == 2 * r["n_lora"]
    assert r["base_same"], "a step changed a base weight"
    # adapters disabled = the base model, bit for bit; enabled (trained B) differs
    for a, b in zip(r["disabled"], r["base_logps"]):
        np.testing.assert_array_equal(a, b)
    assert any(np.abs(c - b).max() > 1e-4 for b, c in zip(r["base_logps"], r["enabled"]))
    # reference KL: 0 while B = 0 (the policy is the base), positive one step later
    assert r["m0"]["ref/kl"] == 0.0 and r["m1"]["ref/kl"] > 0
    # the checkpoint holds the adapters (and their optimizer state) only: the base is model.hf_path's
    model_keys = [k for k in r["saved"] if not k.startswith("optimizer.")]
    assert model_keys and all("_lora." in k for k in model_keys), model_keys[:8]
    # resume: the update after the checkpoint is made again exactly
    for key in ("loss/total", "ref/kl", "optim/grad_norm"):
        assert r["m1_again"][key] == pytest.approx(r["m1"][key], rel=1e-6, abs=1e-12), key
    assert [n for n, _ in r["again"]] == [n for n, _ in r["after"]]
    for (n, a), (_, b) in zip(r["after"], r["again"]):
        np.testing.assert_array_equal(a, b, err_msg=n)


@pytest.mark.parametrize("override, words", [
    (["model.lora.rank=4", "model.lora.targets=[q_proj,qkv_proj]"], ["'qkv_proj'", "q_proj, k_proj"]),
    (["model.lora.rank=-1"], ["model.lora.rank=-1", ">= 0"]),
    (["model.lora.rank=4", "model.lora.dropout=1.5"], ["model.lora.dropout=1.5"]),
    (["model.lora.rank=4", "model.lora.targets=[]"], ["model.lora.rank=4", "targets=[]"]),
    (["model.lora.rank=4", "model.lora.dropout=0.1", "parallel.recompute=full"],
     ["model.lora.dropout=0.1 with parallel.recompute=full", "model.lora.dropout=0"]),
])
def test_lora_config_errors_name_the_values(override, words):
    from megatron_m2po.config import load_config
    from megatron_m2po.utils.settings import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, override)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_lora_scaling_defaults_to_two():
    from megatron_m2po.actor.settings import LoRAConfig

    assert LoRAConfig(rank=8).scaling == 2.0 and LoRAConfig(rank=8, alpha=32).scaling == 4.0
    assert LoRAConfig().scaling == 0.0


def test_lora_on_moe_targets_gate_up_down_together():
    """On an MoE model the MLP targets are the experts': gate / up share A (peft's fused gate_up_proj)
    and SGLang serves expert adapters only with gate_up_proj and down_proj both targeted, so a part
    of them is refused, naming what to set (expert TP > 1: tests/actor/test_lora_moe.py)."""
    from types import SimpleNamespace

    from megatron_m2po.actor.lora import add_adapters
    from megatron_m2po.actor.settings import LoRAConfig
    from megatron_m2po.utils.settings import ConfigError

    with pytest.raises(ConfigError, match=r"\['down_proj', 'gate_proj'\] is only part.*gate_proj, up_proj, down_proj"):
        add_adapters([], LoRAConfig(rank=4, targets=["q_proj", "gate_proj", "down_proj"]),
                     SimpleNamespace(num_experts=4), seed=0)
    add_adapters([], LoRAConfig(rank=4, targets=["q_proj", "o_proj"]), SimpleNamespace(num_experts=4), seed=0)
    # peft's fused-expert LoRA (the exported adapter's layout) has no dropout
    with pytest.raises(ConfigError, match=r"model.lora.dropout=0.1 with adapters on the experts.*dropout=0"):
        add_adapters([], LoRAConfig(rank=4, dropout=0.1), SimpleNamespace(num_experts=4), seed=0)
    add_adapters([], LoRAConfig(rank=4, dropout=0.1, targets=["q_proj"]), SimpleNamespace(num_experts=4), seed=0)
