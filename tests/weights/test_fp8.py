"""FP8 rollout weights in SGLang 0.5.23's block-FP8 layout: the block quantisation against a naive
e4m3 reference, the exported checkpoint, a CPU worker serving it (close to, not equal to, full
precision), block-FP8 weight updates again and again (disk and distributed), per-tensor FP8
refusing every update after the first load as SGLang does, and the config pairing with TIS."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_m2po.config import ConfigError, RolloutConfig, load_config
from megatron_m2po.rollout.client import SGLangClient
from megatron_m2po.rollout.engines import EngineFleet
from megatron_m2po.weights.fp8 import (FP8_MAX, dequantize_block, fp8_block_of, is_fp8_config, quantize_block,
                                       quantize_tensor)
from megatron_m2po.weights.disk import DiskWeightSync
from megatron_m2po.weights.distributed import DistributedWeightSync
from megatron_m2po.weights.errors import WeightSyncError
from megatron_m2po.weights.fp8 import export_fp8_dir
from megatron_m2po.utils.hf_dir import iter_safetensors
from rollout_testlib import hf_logprobs

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PROMPTS = [[2, 3, 4, 5, 6, 7], [9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27], [40]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
BLOCK = (16, 16)  # the tiny model's k/v projections have 16 outputs: [128, 128] cannot serve it


def _naive_e4m3(x: float) -> float:
    """Round to the nearest e4m3fn value (ties to even), written out: 3 mantissa bits, exponents
    -6..8, subnormals in steps of 2^-9, saturating at 448."""
    if x == 0:
        return 0.0
    a = min(abs(x), FP8_MAX)
    e = max(math.floor(math.log2(a)), -6)
    step = 2.0 ** (e - 3)
    k = a / step
    r = math.floor(k)
    if k - r > 0.5 or (k - r == 0.5 and r % 2 == 1):
        r += 1
    return math.copysign(min(r * step, FP8_MAX), x)


def _naive_block(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: scale = amax / 448 (float32), each element W / scale (float32) rounded to e4m3."""
    out, inp = w.shape
    nb, kb = -(-out // bn), -(-inp // bk)
    scale = torch.zeros(nb, kb, dtype=torch.float64)
    grid = torch.zeros(out, inp, dtype=torch.float64)
    for i in range(nb):
        for j in range(kb):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].double()
            s = float(torch.tensor(blk.abs().max().item() / FP8_MAX, dtype=torch.float32))
            scale[i, j] = s
            for a in range(blk.shape[0]):
                for b in range(blk.shape[1]):
                    v = float(torch.tensor(blk[a, b].item(), dtype=torch.float32) / torch.tensor(s))
                    grid[i * bn + a, j * bk + b] = _naive_e4m3(v)
    return scale, grid


def _tensors(d: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _dequantized_model(fp8_dir: str, base_dir: str):
    """Independent reference: HF model whose linears hold the checkpoint's weights dequantised by
    hand (per block or per tensor, as its config says)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    block = fp8_block_of(json.loads((Path(fp8_dir) / "config.json").read_text()))
    t = _tensors(fp8_dir)
    sd = {k: v for k, v in t.items() if not k.endswith((".weight_scale", ".weight_scale_inv"))}
    for k in list(sd):
        if sd[k].dtype == torch.float8_e4m3fn:
            mod = k[:-len(".weight")]
            if block is None:
                sd[k] = sd[k].float() * t[mod + ".weight_scale"].float()
            else:
                s = t[mod + ".weight_scale_inv"].float()
                sd[k] = sd[k].float() * s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[
                    :sd[k].shape[0], :sd[k].shape[1]]
    model.load_state_dict(sd, strict=True)
    return model


def _perturbed(base_dir: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, t + 0.05 * torch.randn(t.shape, generator=g)) for n, t in iter_safetensors(base_dir)]


@pytest.mark.parametrize("shape,block,mag", [((48, 40), (16, 16), 0.05), ((48, 40), (16, 16), 300.0),
                                             ((40, 56), (8, 32), 1e-3), ((256, 128), (128, 128), 3.0)])
def test_block_quantisation_matches_a_naive_e4m3_reference(shape, block, mag):
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(*shape, generator=g) * mag
    w[:block[0], :block[1]] *= 1e-3  # blocks of very different ranges: each gets its own scale
    q, s = quantize_block(w, block)
    nb, kb = -(-shape[0] // block[0]), -(-shape[1] // block[1])
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (nb, kb)  # BlockQuantScaleParameter's shape
    ref_scale, ref_grid = _naive_block(w, *block)
    assert torch.equal(s.double(), ref_scale)
    assert torch.equal(q.double(), ref_grid)  # the same e4m3 value, element by element
    deq = dequantize_block(q, s, block)
    # Within e4m3's rounding: relative 2^-4 on normals, scale * 2^-10 on subnormals; each block's
    # largest element is exact (it maps to 448).
    se = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:shape[0], :shape[1]]
    err = (deq - w).abs()
    assert bool((err <= torch.maximum(w.abs() * 2 ** -4, se * 2 ** -10) * (1 + 1e-6)).all())
    assert err.max() > 0
    for i in range(nb):
        for j in range(kb):
            blk = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            assert deq[blk].abs().max().item() == pytest.approx(w[blk].abs().max().item(), rel=1e-6)


def test_export_layout_is_sglangs_block_fp8(tiny_model_dir, tmp_path):
    sync = DiskWeightSync([], str(tmp_path / "w"), base_model_dir=tiny_model_dir, fp8=True, fp8_block=BLOCK)
    d, _, n = sync.export(iter_safetensors(tiny_model_dir), 3)
    sync.close()
    cfg = json.loads((Path(d) / "config.json").read_text())
    qc = cfg["quantization_config"]
    # Fp8Config.from_config: quant_method contains "fp8" (serialized), weight_block_size -> block
    # quantisation (which needs activation_scheme "dynamic"), ignored_layers optional.
    assert qc["quant_method"] == "fp8" and qc["activation_scheme"] == "dynamic"
    assert qc["weight_block_size"] == list(BLOCK) and "lm_head" in qc["ignored_layers"]
    assert is_fp8_config(cfg) and fp8_block_of(cfg) == BLOCK
    assert json.loads((Path(d) / "m2po_version.json").read_text()) == {"version": 3}
    t = _tensors(d)
    orig = dict(iter_safetensors(tiny_model_dir))
    layers = {k.split(".")[2] for k in orig if k.startswith("model.layers.")}
    assert n == len(orig) + 7 * len(layers)  # one weight_scale_inv per quantised linear
    for i in layers:
        for lin in LINEARS:
            name = f"model.layers.{i}.{lin}"
            w, s = t[f"{name}.weight"], t[f"{name}.weight_scale_inv"]
            out, inp = orig[f"{name}.weight"].shape
            assert w.dtype == torch.float8_e4m3fn and w.shape == (out, inp)
            assert s.dtype == torch.float32 and s.shape == (out // BLOCK[0], inp // BLOCK[1])
            assert f"{name}.weight_scale" not in t and f"{name}.input_scale" not in t
            want_q, want_s = quantize_block(orig[f"{name}.weight"], BLOCK)
            assert torch.equal(s, want_s) and torch.equal(w.view(torch.uint8), want_q.view(torch.uint8))
    for k, v in t.items():  # everything else unchanged, in full precision
        if v.dtype != torch.float8_e4m3fn and not k.endswith(".weight_scale_inv"):
            assert v.dtype == torch.float32 and torch.equal(v, orig[k]), k
    with pytest.raises(ValueError, match="needs base_model_dir"):
        DiskWeightSync([], str(tmp_path / "w2"), fp8=True)


def test_a_block_the_model_does_not_divide_is_refused_naming_the_setting(tiny_model_dir, tmp_path):
    with pytest.raises(WeightSyncError, match=r"weight has shape \[\d+, \d+\], not a multiple of the FP8 block \[128, 128\].*rollout.fp8_block_size"):
        export_fp8_dir(tiny_model_dir, tmp_path / "fp8_128")  # the default [128, 128]
    assert not (tmp_path / "fp8_128").exists()
    with pytest.raises(ConfigError, match="fp8_block_size"):
        load_config(None, ["rollout.fp8_weights=true", "rollout.fp8_block_size=[128]"])


def _fleet(model_dir, root, extra=()) -> EngineFleet:
    cfg = RolloutConfig(engine="cpu_worker", launcher="local", num_engines=1, base_port=0, use_router=False,
                        concurrency=8, weight_sync_timeout_s=30.0)
    return EngineFleet(cfg, model_dir, run_dir=str(root / "run"), startup_timeout_s=120,
                       extra_engine_args=list(extra)).start()


@pytest.fixture
def fp8_engine(tiny_model_dir, tmp_path):
    """A fresh block-FP8 engine per test: the weight-update test changes its weights."""
    fp8_dir = export_fp8_dir(tiny_model_dir, tmp_path / "base_fp8", block=BLOCK)
    fleet = _fleet(fp8_dir, tmp_path)
    try:
        yield fleet, fp8_dir, tmp_path
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


def _check_serves(url, ref, prompts=PROMPTS):
    outs = asyncio.run(_generate(url, prompts, GREEDY))
    for prompt, out in zip(prompts, outs):
        torch.testing.assert_close(torch.tensor(out.output_logprobs), hf_logprobs(ref, prompt, out.output_ids, 0.0),
                                   atol=2e-5, rtol=0)


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
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
    # The worker computes with the FP8 weights exactly (the dequantised checkpoint) ...
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


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_block_fp8_takes_update_after_update_disk_and_distributed(fp8_engine, tiny_model_dir):
    """SGLang keeps block-FP8 parameters (and their weight_loader) through
    process_weights_after_loading: every push loads into them again."""
    fleet, _, root = fp8_engine
    url = fleet.url
    disk = DiskWeightSync([url], str(root / "weights"), base_model_dir=tiny_model_dir, fp8=True, fp8_block=BLOCK,
                          timeout_s=30)
    dist = DistributedWeightSync([url], backend="gloo", bucket_mb=0.002, timeout_s=30, fp8=True, fp8_block=BLOCK)
    try:
        for version, sync in ((1, disk), (2, dist), (3, disk), (4, dist)):
            named = _perturbed(tiny_model_dir, seed=version)
            sync.push(named, version)  # distributed: 2 KB buckets split weights from their scales
            # Reference: the FP8 export of the same weights, dequantised by hand.
            ref_sync = DiskWeightSync([], str(root / f"ref{version}"), base_model_dir=tiny_model_dir, fp8=True,
                                      fp8_block=BLOCK)
            ref_dir, _, _ = ref_sync.export(named, version)
            ref_sync.close()
            assert _server_info(url)["weight_version"] == str(version)
            _check_serves(url, _dequantized_model(ref_dir, tiny_model_dir))
        # Full-precision weights into a block-FP8 engine: SGLang's loader would cast them into the
        # fp8 parameters under the old scales; the worker refuses, naming what to set.
        plain = DistributedWeightSync([url], backend="gloo", timeout_s=30, group_name="plain_sync")
        try:
            with pytest.raises(WeightSyncError, match="rollout.fp8_weights=true"):
                plain.push(_perturbed(tiny_model_dir, seed=9), 5)
        finally:
            plain.close()
    finally:
        dist.close()
        disk.close()


def _per_tensor_dir(src: str, dst: Path) -> str:
    """A per-tensor FP8 checkpoint (``weight_scale``, no ``weight_block_size``) of ``src``."""
    import shutil
    dst.mkdir(parents=True)
    shutil.copy(Path(src) / "config.json", dst / "config.json")
    out = {}
    for name, t in iter_safetensors(src):
        mod = name[:-len(".weight")]
        if any(mod.endswith(lin) for lin in LINEARS) and name.startswith("model.layers."):
            out[name], out[mod + ".weight_scale"] = quantize_tensor(t)
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_per_tensor_fp8_loads_once_and_refuses_every_update(tiny_model_dir, tmp_path):
    """SGLang 0.5.23 per-tensor FP8: process_weights_after_loading replaces weight / weight_scale by
    Parameters without weight_loader. The start-up load serves; a distributed update fails (the
    tensors before the failing one stay loaded); a disk update fails, its rollback from the same
    directory fails again and the scheduler dies."""
    per_tensor = _per_tensor_dir(tiny_model_dir, tmp_path / "pt")
    fleet = _fleet(per_tensor, tmp_path)
    try:
        url = fleet.url
        _check_serves(url, _dequantized_model(per_tensor, tiny_model_dir), PROMPTS[:2])
        dist = DistributedWeightSync([url], backend="gloo", timeout_s=30)
        try:
            with pytest.raises(WeightSyncError, match="'Parameter' object has no attribute 'weight_loader'"):
                dist.push(iter(_tensors(_per_tensor_dir(tiny_model_dir, tmp_path / "pt1")).items()), 1)
        finally:
            dist.close()
        assert _server_info(url)["weight_version"] == "0"
        disk = DiskWeightSync([url], str(tmp_path / "weights"), base_model_dir=tiny_model_dir, timeout_s=30)
        try:
            with pytest.raises(WeightSyncError, match=r"engines not answering /health: " + url.replace(".", r"\.")):
                disk.push(_per_tensor_dir(tiny_model_dir, tmp_path / "pt2"), 2)
        finally:
            disk.close()
        assert fleet.engines[0].handle.proc.wait(30) == 1
    finally:
        fleet.stop()


@pytest.mark.slow  # over 8 s on the CI machine: full suite only; the file keeps a fast test
def test_online_fp8_of_a_float_model_refuses_updates(tiny_model_dir, tmp_path):
    """``--quantization fp8`` on a float checkpoint quantises online (per channel / per tensor):
    the parameters are replaced, so even FP8 pushes in the block layout fail."""
    fleet = _fleet(tiny_model_dir, tmp_path, ["--quantization", "fp8"])
    try:
        assert _server_info(fleet.url)["quantization"] == "fp8"
        dist = DistributedWeightSync([fleet.url], backend="gloo", timeout_s=30, fp8=True, fp8_block=BLOCK)
        try:
            with pytest.raises(WeightSyncError, match="no attribute 'weight_loader'"):
                dist.push(_perturbed(tiny_model_dir, seed=1), 1)
        finally:
            dist.close()
    finally:
        fleet.stop()


def test_fp8_rollouts_with_recomputed_behaviour_and_tis_validate():
    cfg = load_config(None, ["rollout.fp8_weights=true", "algo.recompute_behav_logprobs=true", "algo.tis=true"])
    assert cfg.rollout.fp8_weights and cfg.algo.tis and cfg.algo.recompute_behav_logprobs
    assert cfg.rollout.fp8_block_size == [128, 128]
    with pytest.raises(ConfigError, match="recompute_behav_logprobs"):
        load_config(None, ["rollout.fp8_weights=true", "algo.tis=true"])
