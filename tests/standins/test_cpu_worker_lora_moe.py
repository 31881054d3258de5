"""LoRA on MoE experts in the CPU worker (``standins/cpu_worker_lora.py``), held to HF peft.

The reference: peft's ``target_parameters`` LoRA on transformers' fused Qwen3-MoE experts (plus
the attention), random A and B, merged into the base with ``merge_and_unload``. The worker gets the
same adapter in the per-expert keys SGLang 0.5.23 reads (``lora/mem_pool.py`` ``experts\\.(\\d+)\\.``,
``lora/lora.py`` ``normalize_gate_up_proj``), converted here from peft's layout by peft's own
formula (``ParamWrapper.get_delta_weight``: expert ``e`` = rows ``e r ..`` of A, columns ``j E + e``
of B), once as a fused ``gate_up_proj`` and once as separate ``gate_proj`` / ``up_proj``; both must
generate the merged model's tokens and log-probs, beside a base row in the same batch. peft's own
keys, which SGLang does not read, are refused by name.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch

from megatron_m2po.rollout.client import SGLangClient
from rollout_testlib import cpu_worker_process, hf_logprobs

pytestmark = pytest.mark.slow  # engine processes, routers or multi-rank sweeps in module fixtures: the full suite's lane

PROMPT = [5, 9, 14, 3, 22, 7]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
E, R, ALPHA = 4, 4, 8


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(base dir, peft dir, fused-keys dir, split-keys dir, merged HF model, base HF model)."""
    import copy

    import transformers as tr
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("moe_lora")
    cfg = tr.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=E, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    base = tr.Qwen3MoeForCausalLM(cfg).float().eval()
    base.save_pretrained(root / "base")
    model = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=R, lora_alpha=ALPHA, lora_dropout=0.0, init_lora_weights=False, target_modules=["q_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    model.save_pretrained(root / "peft")
    merged = model.merge_and_unload().eval()
    sd = load_file(root / "peft" / "adapter_model.safetensors")
    dense = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
    fused, split = dict(dense), dict(dense)
    for layer in range(2):
        pre = f"base_model.model.model.layers.{layer}.mlp.experts"
        for wrapper, module in ((f"{pre}.base_layer", "gate_up_proj"), (pre, "down_proj")):
            a, b = sd[f"{wrapper}.lora_A.weight"], sd[f"{wrapper}.lora_B.weight"]
            for e in range(E):
                ae, be = a[e * R:(e + 1) * R].contiguous(), b[:, e::E].contiguous()
                fused[f"{pre}.{e}.{module}.lora_A.weight"], fused[f"{pre}.{e}.{module}.lora_B.weight"] = ae, be
                if module == "down_proj":
                    split[f"{pre}.{e}.down_proj.lora_A.weight"], split[f"{pre}.{e}.down_proj.lora_B.weight"] = ae, be
                    continue
                for h, part in enumerate(("gate_proj", "up_proj")):
                    split[f"{pre}.{e}.{part}.lora_A.weight"] = ae.clone()
                    split[f"{pre}.{e}.{part}.lora_B.weight"] = be.chunk(2, 0)[h].contiguous()
    config = {"peft_type": "LORA", "r": R, "lora_alpha": ALPHA,
              "target_modules": ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    for name, tensors in (("fused", fused), ("split", split)):
        (root / name).mkdir()
        save_file(tensors, str(root / name / "adapter_model.safetensors"))
        (root / name / "adapter_config.json").write_text(json.dumps(config))
    return str(root / "base"), str(root / "peft"), str(root / "fused"), str(root / "split"), merged, base


@pytest.fixture(scope="module")
def worker(moe, tmp_path_factory):
    args = ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "o_proj", "gate_up_proj",
            "down_proj"]
    with cpu_worker_process(moe[0], args, tmp_path_factory.mktemp("logs") / "worker.log") as url:
        yield url


async def _post(url: str, route: str, body) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + route, json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
            return r.status, await r.json(content_type=None)
def test_expert_adapters_equal_peft_merged(worker, moe):
    """Fused and split per-expert keys both serve peft's merged model; a base row in the same batch
    stays the base."""
    _, _, fused, split, merged, base = moe

    async def go():
        async with SGLangClient(worker, max_retries=0) as c:
            await c.load_lora_adapter("fused", fused)
            await c.load_lora_adapter("split", split)
            status, batch = await _post(worker, "/generate", {"input_ids": [PROMPT] * 3, "sampling_params": GREEDY,
                                                              "return_logprob": True,
                                                              "lora_path": ["fused", "split", None]})
            assert status == 200, batch
            return batch
    batch = asyncio.run(go())
    for row, ref in zip(batch, (merged, merged, base)):
        got = torch.tensor([x[0] for x in row["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, hf_logprobs(ref, PROMPT, row["output_ids"], 0.0), atol=1e-4, rtol=1e-4)
    lora_lp = hf_logprobs(merged, PROMPT, batch[0]["output_ids"], 0.0)
    base_lp = hf_logprobs(base, PROMPT, batch[0]["output_ids"], 0.0)
    assert (lora_lp - base_lp).abs().max() > 1e-2  # the adapters change what the experts compute


def test_peft_target_parameters_keys_are_refused_by_name(worker, moe):
    async def go():
        return await _post(worker, "/load_lora_adapter", {"lora_name": "peft", "lora_path": moe[1]})
    status, out = asyncio.run(go())
    assert not out["success"], out
    assert "mlp.experts.base_layer.lora_A" in out["error_message"] and "per-expert keys" in out["error_message"]
