"""FP8 rollout weights: modelopt quantisation at export (SGLang's per-tensor FP8 checkpoint layout),
a CPU worker serving it through modelopt fake quantisation, FP8 weight updates (disk and
distributed), the measurable train/engine log-prob mismatch, and the config pairing with TIS."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_m2po.config import ConfigError, RolloutConfig, load_config
from megatron_m2po.rollout.client import SGLangClient
from megatron_m2po.rollout.engines import EngineFleet
from megatron_m2po.rollout.fp8 import FP8_MAX, is_fp8_config, quantize_tensor
from megatron_m2po.rollout.weight_sync import DiskWeightSync, DistributedWeightSync, export_fp8_dir
from megatron_m2po.utils.hf_dir import iter_safetensors
from rollout_testlib import hf_logprobs

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PROMPTS = [[2, 3, 4, 5, 6, 7], [9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27], [40]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


def _tensors(d: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _dequantized_model(fp8_dir: str, base_dir: str):
    """Independent reference: HF model whose linears hold weight.float() * weight_scale (no modelopt)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    t = _tensors(fp8_dir)
    sd = {k: v for k, v in t.items() if not k.endswith(".weight_scale")}
    for k in list(sd):
        if sd[k].dtype == torch.float8_e4m3fn:
            sd[k] = sd[k].float() * t[k[:-len(".weight")] + ".weight_scale"].float()
    model.load_state_dict(sd, strict=True)
    return model


def _perturbed(base_dir: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, t + 0.05 * torch.randn(t.shape, generator=g)) for n, t in iter_safetensors(base_dir)]


def test_quantize_tensor_is_per_tensor_e4m3():
    g = torch.Generator().manual_seed(0)
    for mag in (1e-3, 0.05, 3.0, 300.0):
        w = torch.randn(48, 40, generator=g) * mag
        q, s = quantize_tensor(w)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.dim() == 0
        assert s.item() == pytest.approx(w.abs().max().item() / FP8_MAX, rel=1e-6)
        # Bit-identical to torch's own round-to-nearest e4m3 cast of w / scale.
        assert torch.equal(q.view(torch.uint8), (w / s).to(torch.float8_e4m3fn).view(torch.uint8))
        deq = q.float() * s
        assert deq.abs().max().item() == pytest.approx(w.abs().max().item(), rel=1e-6)  # amax is on the grid
        # 3 mantissa bits: relative error <= 2^-4 on normals, absolute <= scale * 2^-10 on subnormals.
        err = (deq - w).abs()
        assert bool((err <= torch.maximum(w.abs() * 2 ** -4, s * 2 ** -10) * (1 + 1e-6)).all())
        assert err.max() > 0


def test_export_layout_is_what_sglang_fp8_loader_expects(tiny_model_dir, tmp_path):
    sync = DiskWeightSync([], str(tmp_path / "w"), base_model_dir=tiny_model_dir, fp8=True)
    d, _, n = sync.export(iter_safetensors(tiny_model_dir), 3)
    sync.close()
    cfg = json.loads((Path(d) / "config.json").read_text())
    qc = cfg["quantization_config"]
    # Fp8Config.from_config: quant_method (required, contains "fp8" -> fp8-serialized checkpoint),
    # activation_scheme (required, static|dynamic), weight_block_size absent -> per-tensor scales,
    # ignored_layers (optional).
    assert qc["quant_method"] == "fp8" and qc["activation_scheme"] == "dynamic"
    assert "weight_block_size" not in qc and "lm_head" in qc["ignored_layers"]
    assert is_fp8_config(cfg) and json.loads((Path(d) / "m2po_version.json").read_text()) == {"version": 3}
    t = _tensors(d)
    orig = dict(iter_safetensors(tiny_model_dir))
    layers = {k.split(".")[2] for k in orig if k.startswith("model.layers.")}
    assert n == len(orig) + 7 * len(layers)  # one weight_scale per quantised linear
    for i in layers:
        for lin in LINEARS:
            w, s = t[f"model.layers.{i}.{lin}.weight"], t[f"model.layers.{i}.{lin}.weight_scale"]
            assert w.dtype == torch.float8_e4m3fn and w.shape == orig[f"model.layers.{i}.{lin}.weight"].shape
            assert s.dtype == torch.float32 and s.numel() == 1  # PerTensorScaleParameter, fp32
            assert f"model.layers.{i}.{lin}.input_scale" not in t  # dynamic activation scheme
            torch.testing.assert_close(w.float() * s, orig[f"model.layers.{i}.{lin}.weight"],
                                       atol=float(s) * 2 ** -9 * 4, rtol=2 ** -4)
    for k, v in t.items():  # everything else unchanged, in full precision
        if v.dtype != torch.float8_e4m3fn and not k.endswith(".weight_scale"):
            assert v.dtype == torch.float32 and torch.equal(v, orig[k]), k
    assert t["lm_head.weight"].dtype == torch.float32 and t["model.embed_tokens.weight"].dtype == torch.float32
    with pytest.raises(ValueError, match="needs base_model_dir"):
        DiskWeightSync([], str(tmp_path / "w2"), fp8=True)


@pytest.fixture
def fp8_engine(tiny_model_dir, tmp_path):
    """A fresh FP8 engine per test: the weight-update test changes its weights."""
    root = tmp_path
    fp8_dir = export_fp8_dir(tiny_model_dir, root / "base_fp8")
    cfg = RolloutConfig(engine="cpu_worker", launcher="local", num_engines=1, base_port=0, use_router=False,
                        concurrency=8, weight_sync_timeout_s=30.0)
    fleet = EngineFleet(cfg, fp8_dir, run_dir=str(root / "run"), startup_timeout_s=120)
    fleet.start()
    try:
        yield fleet, fp8_dir, root
    finally:
        fleet.stop()


async def _generate(url, prompts, params):
    async with SGLangClient(url, concurrency=8, timeout_s=60) as c:
        return await c.generate_many(prompts, params)


def _server_info(url):
    async def go():
        async with SGLangClient(url) as c:
            return await c.get_server_info()
    return asyncio.run(go())


def test_cpu_worker_serves_fp8_close_to_but_not_equal_full_precision(fp8_engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM
    fleet, fp8_dir, _ = fp8_engine
    assert _server_info(fleet.url)["quantization"] == "fp8"
    full = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    deq = _dequantized_model(fp8_dir, tiny_model_dir)
    outs = asyncio.run(_generate(fleet.url, PROMPTS, {**GREEDY, "temperature": 1.0, "sampling_seed": 5}))
    engine, train, ref = [], [], []
    for prompt, out in zip(PROMPTS, outs):
        engine.append(torch.tensor(out.output_logprobs))
        train.append(hf_logprobs(full, prompt, out.output_ids, 1.0))
        ref.append(hf_logprobs(deq, prompt, out.output_ids, 1.0))
    engine, train, ref = torch.cat(engine), torch.cat(train), torch.cat(ref)
    # The worker computes with the FP8 weights exactly (modelopt fake quant == dequantised checkpoint) ...
    torch.testing.assert_close(engine, ref, atol=2e-5, rtol=0)
    # ... which are close to, but not, the full-precision weights: a measurable mismatch.
    diff = (train - engine).abs()
    assert diff.max() < 0.1 and diff.max() > 1e-4
    log_ratio = train - engine                      # log p_train_behav / p_engine_behav
    kl_k3 = (torch.exp(-log_ratio) - 1 + log_ratio).mean()  # E_engine[k3] of KL(engine || train)
    tis = torch.clamp(torch.exp(log_ratio), max=2.0)       # TIS weights (paper eq. 6)
    assert kl_k3 > 1e-9 and (tis - 1).abs().max() > 1e-4
    # Greedy decoding follows the FP8 model's argmax.
    greedy = asyncio.run(_generate(fleet.url, PROMPTS[:2], GREEDY))
    for prompt, out in zip(PROMPTS[:2], greedy):
        with torch.no_grad():
            logits = deq(torch.tensor([prompt + out.output_ids])).logits[0, len(prompt) - 1:-1]
        assert out.output_ids == logits.argmax(-1).tolist()


def test_fp8_weight_updates_disk_and_distributed(fp8_engine, tiny_model_dir):
    fleet, _, root = fp8_engine
    url = fleet.url
    disk = DiskWeightSync([url], str(root / "weights"), base_model_dir=tiny_model_dir, fp8=True, timeout_s=30)
    dist = DistributedWeightSync([url], backend="gloo", bucket_mb=0.002, timeout_s=30, fp8=True)
    try:
        for version, sync in ((1, disk), (2, dist)):
            named = _perturbed(tiny_model_dir, seed=version)
            sync.push(named, version)  # distributed: 2 KB buckets split weights from their scales
            # Reference: the FP8 export of the same weights, dequantised by hand.
            ref_sync = DiskWeightSync([], str(root / f"ref{version}"), base_model_dir=tiny_model_dir, fp8=True)
            ref_dir, _, _ = ref_sync.export(named, version)
            ref_sync.close()
            ref = _dequantized_model(ref_dir, tiny_model_dir)
            outs = asyncio.run(_generate(url, PROMPTS, GREEDY))
            assert _server_info(url)["weight_version"] == str(version)
            for prompt, out in zip(PROMPTS, outs):
                torch.testing.assert_close(torch.tensor(out.output_logprobs),
                                           hf_logprobs(ref, prompt, out.output_ids, 0.0), atol=2e-5, rtol=0)
        # Full-precision weights into the FP8 engine are quantised on load (SGLang --quantization fp8).
        named = _perturbed(tiny_model_dir, seed=3)
        plain = DistributedWeightSync([url], backend="gloo", timeout_s=30, group_name="plain_sync")
        try:
            plain.push(named, 3)
        finally:
            plain.close()
        ref_sync = DiskWeightSync([], str(root / "ref3"), base_model_dir=tiny_model_dir, fp8=True)
        ref = _dequantized_model(ref_sync.export(named, 3)[0], tiny_model_dir)
        ref_sync.close()
        out = asyncio.run(_generate(url, PROMPTS[:1], GREEDY))[0]
        torch.testing.assert_close(torch.tensor(out.output_logprobs),
                                   hf_logprobs(ref, PROMPTS[0], out.output_ids, 0.0), atol=2e-5, rtol=0)
    finally:
        dist.close()
        disk.close()


def test_fp8_rollouts_with_recomputed_behaviour_and_tis_validate():
    cfg = load_config(None, ["rollout.fp8_weights=true", "algo.recompute_behav_logprobs=true", "algo.tis=true"])
    assert cfg.rollout.fp8_weights and cfg.algo.tis and cfg.algo.recompute_behav_logprobs
    with pytest.raises(ConfigError, match="recompute_behav_logprobs"):
        load_config(None, ["rollout.fp8_weights=true", "algo.tis=true"])
