"""Model building through mbridge: HF weights in, logits equal to HF, HF weights out bit-exactly (through
the one HF exporter, ``weights/hf_export.py``: every pipeline stage writes its own shards)."""

import os

import pytest
import torch

import actor_testlib as lib
from megatron_m2po.standins.dist_testing import run_distributed

CASES = [("qwen2", False), ("qwen2", True), ("qwen3", False), ("llama", True)]


def _logits_and_roundtrip(rank, world_size, root):
    lib.init_megatron(1, 1)
    import transformers as tr

    from megatron_m2po.actor import model as M
    from megatron_m2po.config import Config
    from megatron_m2po.weights.hf_export import export_hf_stages

    out = {}
    for kind, tie in CASES:
        d = lib.make_tiny_hf(kind, os.path.join(root, f"{kind}_{tie}"), tie=tie, seed=3)
        cfg = Config()
        cfg.model.hf_path = d
        chunks, bridge = M.build_model(cfg)
        m = chunks[0].eval()
        torch.manual_seed(1)
        ids = torch.randint(0, 128, (2, 12))
        with torch.no_grad():
            hidden = m(ids, torch.arange(12).expand(2, 12), None)  # [S, B, H]
            logits = hidden.transpose(0, 1) @ M.output_weight(m).T
            ref = tr.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()(ids).logits
        exp = os.path.join(root, f"export_{kind}_{tie}")
        export_hf_stages(chunks, bridge, exp)
        a, b = lib.read_safetensors_dir(d), lib.read_safetensors_dir(exp)
        out[(kind, tie)] = (float((logits - ref).abs().max()), sorted(set(a) ^ set(b)),
                            all(torch.equal(a[k], b[k]) for k in a if k in b),
                            os.path.isfile(os.path.join(exp, "config.json")))
    return out


def test_logits_match_hf_and_export_roundtrip_is_bit_exact(tmp_path):
    (out,) = run_distributed(_logits_and_roundtrip, 1, args=(str(tmp_path),), timeout_s=120)
    for case, (err, diff, equal, has_cfg) in out.items():
        assert err < 1e-5, (case, err)
        assert diff == [] and equal and has_cfg, case


def _roundtrip_parallel(rank, world_size, root):
    from megatron_m2po.actor import model as M
    from megatron_m2po.config import Config
    from megatron_m2po.weights.hf_export import export_hf_stages

    res = []
    for kind, tie, tp, pp in [("qwen2", True, 2, 1), ("qwen3", False, 1, 2), ("llama", False, 2, 1)]:
        lib.init_megatron(tp, pp)
        d = os.path.join(root, f"{kind}_{tie}")
        if rank == 0:
            lib.make_tiny_hf(kind, d, tie=tie, seed=5)
        torch.distributed.barrier()
        cfg = Config()
        cfg.model.hf_path = d
        cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel = tp, pp
        chunks, bridge = M.build_model(cfg)
        names = [n for n, _ in M.iter_hf_weights(chunks, bridge)]
        exp = os.path.join(root, f"export_{kind}_{tp}_{pp}")
        export_hf_stages(chunks, bridge, exp)
        torch.distributed.barrier()
        a, b = lib.read_safetensors_dir(d), lib.read_safetensors_dir(exp)
        res.append((kind, tp, pp, sorted(set(a) ^ set(b)), all(torch.equal(a[k], b[k]) for k in a if k in b),
                    len(names) == len(set(names)) == len(a)))
    return res


@pytest.mark.slow  # over 10 s on the CI machine under load: the full suite's lane
def test_export_roundtrip_tp2_and_pp2(tmp_path):
    out = run_distributed(_roundtrip_parallel, 2, args=(str(tmp_path),), timeout_s=150)
    for rank_res in out:
        for kind, tp, pp, diff, equal, names_ok in rank_res:
            assert diff == [] and equal and names_ok, (kind, tp, pp, diff)
