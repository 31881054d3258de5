"""LoRA on an MoE model's experts (actor/lora.py ``ExpertLoRA``), held to HF peft on CPU / gloo.

With the same non-zero adapters (attention and every expert's gate_up / down pair, B random, fp32;
at EP=1 loaded from the EP=2 run's checkpoint, so the adapters' checkpoint layout reshards over
expert layouts), the actor at EP=2 (DP=2), EP=1, TP=2 + SP with EP=2 (expert TP 1) and PP=2 gives
the per-token
log-probs and the adapter gradients (PP=2 through the per-expert loop, the others through grouped GEMMs) (of the sum of the response tokens' log-probs) of
``peft.PeftModel`` on transformers' Qwen3-MoE, loaded from the directory the exporter wrote
(peft's ``target_parameters`` LoRA on the fused experts); the merged weights equal peft's
``merge_and_unload``; the engines' layout (per expert, SGLang's names) holds the same matrices.
"""

import json
import os

import numpy as np
import pytest
import torch

import actor_testlib as lib
from megatron_m2po.standins.dist_testing import run_distributed

pytestmark = pytest.mark.slow  # engine processes, routers or multi-rank sweeps in module fixtures: the full suite's lane

RANK, ALPHA, EXPERTS = 4, 8.0, 4


def _actor(d: str, ep: int, tp: int, etp=1, pp: int = 1):
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor

    cfg = lib.actor_config(d, tp=tp, pp=pp, mbs=2)
    cfg.parallel.expert_parallel, cfg.parallel.expert_tensor_parallel = ep, etp
    cfg.parallel.sequence_parallel = tp > 1
    cfg.model.lora.rank, cfg.model.lora.alpha = RANK, ALPHA
    return MegatronActor.from_config(ActorConfig.from_config(cfg.validate(), total_updates=10)), cfg


def _layouts(rank, world_size, root):
    from megatron_m2po.actor.batch import RolloutBatch
    from megatron_m2po.weights.hf_export import iter_stage_hf_weights
    from megatron_m2po.weights.lora_export import peft_adapter_tensors, write_peft_dir

    d = os.path.join(root, "qwen3_moe")
    if rank == 0:
        lib.make_tiny_hf("qwen3_moe", d, seed=3)
    torch.distributed.barrier()
    samples = lib.make_samples(4, seed=5)
    import multiprocessing

    multiprocessing.current_process()._config["daemon"] = False  # Megatron's checkpoint writer has children
    ckpt = os.path.join(root, "ckpt_ep2")
    out = []
    for ep, tp, pp in ((2, 1, 1), (1, 1, 1), (2, 2, 1), (1, 1, 2)):
        actor, cfg = _actor(d, ep, tp, pp=pp)
        if (ep, tp, pp) == (1, 1, 1):  # the EP=2 run's checkpoint, resharded onto whole-model experts
            actor.load_checkpoint(ckpt, model_only=True)
        else:
            lib.random_lora_b(actor, seed=7)
        if pp == 2:  # the per-expert loop (devices and dtypes torch._grouped_mm does not serve) held to peft too
            from megatron_m2po.actor.lora import expert_adapter_modules
            for m in expert_adapter_modules(actor.chunks):
                m.grouped = False
        if (ep, tp, pp) == (2, 1, 1):
            actor.save_checkpoint(ckpt)
        logps = actor.compute_logprobs(RolloutBatch(samples))
        exp = os.path.join(root, f"peft_{ep}_{tp}_{pp}")
        write_peft_dir(actor.chunks, cfg.model.lora, exp, base_model_name_or_path=d)
        engine = lib.numpy_pairs(peft_adapter_tensors(actor.chunks, "sglang"))
        merged = {n: t.float().numpy() for n, t in iter_stage_hf_weights(actor.chunks, actor.bridge)}
        grads = lib.lora_adapter_grads(actor, samples)
        actor.close()
        if pp > 1:  # each stage merges its own layers: rank 0 holds the first
            merged = None
        out.append(((ep, tp, pp), logps, grads, exp, engine, merged if rank == 0 else None))
    from megatron_m2po.utils.settings import ConfigError

    refused = []
    for etp in (None, 1):  # expert TP = TP = 2 (its default): split experts; expert TP 1 without EP
        try:
            _actor(d, 1, 2, etp=etp)[0].close()
            refused.append(None)
        except ConfigError as e:
            refused.append(str(e))
    return [refused] + out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora_moe"))
    return run_distributed(_layouts, 2, args=(root,), timeout_s=420)[0], root


def test_expert_lora_refuses_split_experts_and_whole_experts_without_ep(runs):
    """Split experts (expert TP 2) have no adapters; whole experts under TP=2 need EP > 1, for the
    base weights as for the adapters (without an all-to-all the TP copies of an expert would drift)."""
    split, no_ep = runs[0][0]
    assert split is not None and "parallel.expert_tensor_parallel is 2" in split
    assert "set parallel.expert_tensor_parallel=1" in split
    assert no_ep is not None and "expert_tensor_parallel=1 below parallel.tensor_parallel=2 needs" in no_ep


def test_expert_lora_equals_peft_at_ep2_ep1_tp2_sp_ep2_and_pp2(runs):
    out, root = runs
    out = out[1:]
    d = os.path.join(root, "qwen3_moe")
    samples = lib.make_samples(4, seed=5)
    ref_logps, ref_grads = lib.peft_reference(d, out[0][3], samples)
    assert any("mlp.experts.base_layer.lora_A" in n for n in ref_grads), sorted(ref_grads)[:8]
    config = json.load(open(os.path.join(out[0][3], "adapter_config.json")))
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    for layout, logps, grads, _, _, _ in out:
        for got, want in zip(logps, ref_logps):
            np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"log-probs at (EP, TP, PP) = {layout}")
        assert {n for n, _ in grads} == set(ref_grads), layout
        for name, g in grads:
            np.testing.assert_allclose(g, ref_grads[name].numpy(), atol=2e-4, rtol=1e-3,
                                       err_msg=f"{name} at (EP, TP, PP) = {layout}")
    # every layout exported the same adapters (the one peft model above stands for all of them)
    first = dict(out[0][2])
    for layout, _, grads, *_ in out[1:]:
        for name, g in grads:
            np.testing.assert_allclose(g, first[name], atol=2e-4, rtol=1e-3, err_msg=f"{name} at {layout}")


def test_expert_lora_engine_layout_and_merge_equal_peft(runs):
    """The engines' per-expert names hold peft's per-expert matrices (A rows e r.., B columns j E + e),
    and the merged HF weights (a full-weight push, final_hf) equal peft's ``merge_and_unload``."""
    import peft
    import transformers as tr

    out, root = runs
    out = out[1:]
    d = os.path.join(root, "qwen3_moe")
    for layout, _, _, exp, engine, merged in out:
        from safetensors.torch import load_file

        fused = load_file(os.path.join(exp, "adapter_model.safetensors"))
        engine = dict(engine)
        for layer in range(2):
            pre = f"base_model.model.model.layers.{layer}.mlp.experts"
            for wrapper, module, f_in in ((f"{pre}.base_layer", "gate_up_proj", 64), (pre, "down_proj", 32)):
                a, b = fused[f"{wrapper}.lora_A.weight"], fused[f"{wrapper}.lora_B.weight"]
                assert a.shape == (EXPERTS * RANK, f_in), (layout, a.shape)
                for e in range(EXPERTS):
                    np.testing.assert_array_equal(engine[f"{pre}.{e}.{module}.lora_A.weight"], a[e * RANK:(e + 1) * RANK])
                    np.testing.assert_array_equal(engine[f"{pre}.{e}.{module}.lora_B.weight"], b[:, e::EXPERTS])
        if merged is None:  # PP=2: rank 0 merged its own stage only
            continue
        base = tr.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        want = peft.PeftModel.from_pretrained(base, exp).merge_and_unload().state_dict()
        for layer in range(2):
            for e in range(EXPERTS):
                gate_up = want[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e]
                for h, part in enumerate(("gate_proj", "up_proj")):
                    np.testing.assert_allclose(merged[f"model.layers.{layer}.mlp.experts.{e}.{part}.weight"],
                                               gate_up.chunk(2, 0)[h].numpy(), atol=1e-6, err_msg=f"{part} {layout}")
                np.testing.assert_allclose(merged[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"],
                                           want[f"model.layers.{layer}.mlp.experts.down_proj"][e].numpy(), atol=1e-6)
            np.testing.assert_allclose(merged[f"model.layers.{layer}.self_attn.q_proj.weight"],
                                       want[f"model.layers.{layer}.self_attn.q_proj.weight"].numpy(), atol=1e-6)


def _experts_with_lora(dtype, splits, hidden=32, ffn=16, rank=RANK):
    from types import SimpleNamespace

    from megatron_m2po.actor.lora import ExpertLoRA

    class Grouped(torch.nn.Module):  # called as the experts' grouped linears are: (x, m_splits) -> (out, bias)
        def __init__(self, n, fout, fin):
            super().__init__()
            self.weight0 = torch.nn.Parameter(torch.randn(n, fout, fin, dtype=dtype), requires_grad=False)

        def forward(self, x, m_splits):
            return torch.cat([xi @ w.t() for xi, w in zip(torch.split(x, m_splits), self.weight0)]), None

    experts = torch.nn.Module()
    experts.num_local_experts = len(splits)
    experts.linear_fc1 = Grouped(len(splits), 2 * ffn, hidden)
    experts.linear_fc2 = Grouped(len(splits), hidden, ffn)
    lora = ExpertLoRA(experts, rank=rank, scaling=2.0, dropout=0.0, layer=0, seed=0,
                      hf=SimpleNamespace(hidden_size=hidden, moe_intermediate_size=ffn), ep_rank=1)
    with torch.no_grad():
        for pair in lora.PAIRS:
            getattr(lora, f"{pair}_B").normal_(0, 0.1)
    return experts, lora


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [[3, 0, 7, 1, 0, 9], [0, 0, 0, 5, 0, 0], [0] * 6])
def test_grouped_expert_gemms_equal_the_per_expert_loop(dtype, splits):
    """The adapters' two grouped GEMMs (torch._grouped_mm over the experts' row offsets) give the
    per-expert loop's output and gradients (input, A, B) exactly, empty experts included; by hand,
    each expert's rows get s B_e A_e x and nothing of another expert's pair."""
    from megatron_m2po.actor.lora import grouped_gemm_serves

    torch.manual_seed(0)
    experts, lora = _experts_with_lora(dtype, splits, rank=8)
    assert grouped_gemm_serves(torch.empty(0, 32, dtype=dtype), lora.gate_up_A, lora.gate_up_B)
    x = torch.randn(sum(splits), 32, dtype=dtype, requires_grad=True)
    g = torch.randn(sum(splits), 2 * 16, dtype=dtype)
    got = {}
    for grouped in (True, False):
        lora.grouped = grouped
        x.grad = None
        for p in lora.parameters():
            p.grad = None
        out, _ = experts.linear_fc1(x, splits)
        (out.float() * g.float()).sum().backward()
        got[grouped] = [out.detach(), x.grad] + [p.grad for p in (lora.gate_up_A, lora.gate_up_B)]
    for a, b in zip(got[True], got[False]):
        assert torch.equal(a, b)
    start = 0
    base = experts.linear_fc1.weight0
    for e, n in enumerate(splits):
        xe = x.detach()[start:start + n].double()
        want = xe @ base[e].double().t() + 2.0 * (xe @ lora.gate_up_A[e].double().t()) @ lora.gate_up_B[e].double().t()
        torch.testing.assert_close(got[True][0][start:start + n].double(), want,
                                   **(dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)))
        start += n
    assert lora.first_expert == len(splits)  # EP rank 1's experts: A from those global experts' seeds


def test_grouped_gemm_serves_only_where_torch_runs_it():
    """CUDA: bf16 on Hopper with 16-byte aligned rows (torch's CUTLASS grouped GEMM, measured equal to
    the loop on an H100), else the loop; CPU: torch's own, with 16-byte aligned rows too (it refuses
    others, as checked here); an input not starting 16-byte aligned takes the loop."""
    from megatron_m2po.actor.lora import grouped_gemm_ok, grouped_gemm_serves

    h100 = (9, 0)
    assert grouped_gemm_ok("cuda", [torch.bfloat16] * 3, (2048, 16, 1536), h100)
    assert not grouped_gemm_ok("cuda", [torch.bfloat16] * 3, (2048, 16, 1536), (10, 0))  # not measured there
    assert not grouped_gemm_ok("cuda", [torch.bfloat16] * 3, (2048, 16, 1536), (8, 0))
    assert not grouped_gemm_ok("cuda", [torch.bfloat16] * 3, (2048, 4, 1536), h100)  # rank 4: 8-byte rows of A x
    assert not grouped_gemm_ok("cuda", [torch.float32] * 3, (2048, 16, 1536), h100)
    assert not grouped_gemm_ok("cuda", [torch.bfloat16, torch.float32, torch.bfloat16], (2048, 16, 1536), h100)
    assert grouped_gemm_ok("cpu", [torch.float32] * 3, (32, 4, 16)) == hasattr(torch, "_grouped_mm")
    assert not grouped_gemm_ok("cpu", [torch.bfloat16] * 3, (32, 4, 16))
    if hasattr(torch, "_grouped_mm"):
        with pytest.raises(RuntimeError, match="16 bytes"):  # what the condition spares the hook
            torch._grouped_mm(torch.ones(3, 4, dtype=torch.bfloat16), torch.ones(2, 4, 4, dtype=torch.bfloat16),
                              offs=torch.tensor([1, 3], dtype=torch.int32))
    assert not grouped_gemm_ok("meta", [torch.float32] * 3, (32, 16, 32))
    a, b = torch.zeros(2, 4, 32), torch.zeros(2, 16, 4)
    x = torch.zeros(3 * 32 + 1)
    assert grouped_gemm_serves(x[:96].view(3, 32), a, b) == hasattr(torch, "_grouped_mm")
    assert not grouped_gemm_serves(x[1:].view(3, 32), a, b)  # 4 bytes past an aligned start


def test_expert_lora_benchmark_runs_both_paths():
    """tools/benchmarks/expert_lora.py at CPU size: the base, the grouped and the looped adapters timed."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, os.path.join(root, "tools", "benchmarks", "expert_lora.py"), "--tokens", "64",
                          "--experts", "4", "--hidden", "32", "--ffn", "16", "--rank", "4", "--repeats", "1",
                          "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "torch._grouped_mm serves: True" in res.stdout, res.stdout
    for line in ("base experts alone", "+ adapters, grouped GEMMs", "+ adapters, loop per expert", "loop / grouped"):
        assert line in res.stdout, res.stdout


def _resume_checks(rank, world_size, root):
    import multiprocessing

    from megatron_m2po.actor.batch import RolloutBatch

    multiprocessing.current_process()._config["daemon"] = False  # Megatron's checkpoint writer has children
    d = os.path.join(root, "qwen3_moe")
    lib.make_tiny_hf("qwen3_moe", d, seed=3)
    samples = lib.make_samples(2, seed=5)
    actor, _ = _actor(d, 1, 1)
    lib.random_lora_b(actor, seed=7)
    actor.train_step(RolloutBatch(samples))
    ckpt = os.path.join(root, "ckpt")
    actor.save_checkpoint(ckpt)
    saved = {n: p.detach().clone() for n, p in actor.chunks[0].named_parameters() if p.requires_grad}
    from megatron_m2po.actor.checkpoint import resolve_checkpoint

    meta_path = os.path.join(str(resolve_checkpoint(ckpt)), "actor.json")
    meta = json.load(open(meta_path))
    out = {"marker": meta.get("expert_adapters")}
    resumed, _ = _actor(d, 1, 1)
    resumed.load_checkpoint(ckpt)
    out["resumed_equal"] = all(torch.equal(p, saved[n]) for n, p in resumed.chunks[0].named_parameters()
                               if p.requires_grad)
    meta.pop("expert_adapters")  # as written before the adapters were stacked
    json.dump(meta, open(meta_path, "w"))
    try:
        _actor(d, 1, 1)[0].load_checkpoint(ckpt)
        out["old_refused"] = None
    except ValueError as e:
        out["old_refused"] = str(e)
    _actor(d, 1, 1)[0].load_checkpoint(ckpt, model_only=True)  # its weights still load
    return out


def test_expert_lora_checkpoint_resumes_and_refuses_the_per_expert_layouts_optimizer_state(tmp_path):
    """A full resume restores the stacked expert adapters exactly; a checkpoint without actor.json's
    "expert_adapters" marker (one tensor per expert, whose distributed-optimizer buffer is in another
    order) is refused by name for a full resume and loads weights only."""
    out = run_distributed(_resume_checks, 1, args=(str(tmp_path),), timeout_s=240)[0]
    assert out["marker"] == "stacked"
    assert out["resumed_equal"]
    assert out["old_refused"] and "one tensor per expert" in out["old_refused"], out
