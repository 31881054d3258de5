"""Row 11: LoRA on the actor's GPU tree against HF peft -- the adapters see what the base weight sees.

Under Transformer Engine's spec the input layer norm runs inside ``linear_qkv`` and the MLP's
inside ``linear_fc1`` (``TELayerNormColumnParallelLinear``), so an adapter hooked on those modules
must normalise the input itself (``actor/lora.py``); on CPU the twin (``actor/te_twin.py``) has the
same tree, and the CPU tests hold it to peft. This row holds the real GPU tree to peft: the actor
(row 1's random Qwen2 model, bf16, TE spec when ``transformer_engine`` imports, the twin on CUDA
otherwise) with rank-8 adapters on every default target, their ``B`` random (a fresh adapter's
``B`` is 0, which hides everything), computes the response tokens' log-probs; it exports the
adapters as a peft directory (``weights/lora_export.py`` ``write_peft_dir``, what engines load);
a CPU fp32 subprocess (GPU-only packages blocked) loads the base with ``peft.PeftModel`` on that
directory and computes the same log-probs, and again after one bf16-sized relative error (2^-8,
random sign) on every weight -- row 1's unit. PASS when the RMS and the largest deviation are
each at most 4 units. Negative control: peft with the adapters disabled (the base alone) must
land above 4 units, so the adapters' effect is large enough for the check to see an adapter that
reads the wrong input. ``--cpu-smoke``: the CPU bf16 twin against the same reference.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from .env import ROOT, SCRIPT, block_gpu_only_modules, spec_name
from .models import BF16_U, make_batch
from .numerics import MAX_TOL, RMS_TOL, _numerics_inputs
from .report import Row

LORA_CHECK = "LoRA actor vs HF peft"
RANK, ALPHA = 8, 16.0


def _actor_logprobs(hf: Path, spec: dict, adapter_dir: Path) -> np.ndarray:
    """This process's device, bf16: the actor with random non-zero adapters; their peft export."""
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch
    from megatron_m2po.actor.lora import adapter_modules
    from megatron_m2po.weights.lora_export import write_peft_dir

    from .models import _actor_config

    cfg = _actor_config(hf, "bfloat16")
    cfg.model.lora.rank, cfg.model.lora.alpha = RANK, ALPHA
    actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=10))
    try:
        with torch.no_grad():
            for m in adapter_modules(actor.chunks):
                for j, part in enumerate(m.targets):
                    b = m.pair(part)[1]
                    g = torch.Generator().manual_seed(1000 * m.layer + j)
                    b.copy_(0.05 * torch.randn(b.shape, generator=g))
        lps = actor.compute_logprobs(RolloutBatch(make_batch(**spec)))
        write_peft_dir(actor.chunks, cfg.model.lora, str(adapter_dir), base_model_name_or_path=str(hf))
    finally:
        actor.close()
    return np.concatenate(lps)


def peft_reference_worker(hf_dir: str, adapter_dir: str, batch_json: str, out: str) -> int:
    """Subprocess: HF transformers + peft in fp32 on CPU (GPU-only packages blocked): the log-probs,
    the same after a 2^-8 relative error on every weight (the unit), and with the adapters disabled."""
    block_gpu_only_modules()
    import peft
    import transformers as tr

    samples = make_batch(**json.loads(Path(batch_json).read_text()))
    base = tr.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()

    def logps() -> np.ndarray:
        out = []
        with torch.no_grad():
            for s in samples:
                ids = torch.tensor(np.concatenate([s.prompt_ids, s.response_ids]))[None]
                lp = torch.log_softmax(model(ids).logits[0].double(), -1)
                p = len(s.prompt_ids)
                out.append(lp[torch.arange(p - 1, p - 1 + len(s.response_ids)), torch.tensor(s.response_ids)].numpy())
        return np.concatenate(out)

    res = {"logp": logps()}
    with model.disable_adapter():
        res["logp_defect"] = logps()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + BF16_U * (torch.randint(0, 2, p.shape, generator=g).to(p.dtype) * 2 - 1))
    res["logp_perturbed"] = logps()
    np.savez(out, **res)
    return 0


def _reference(hf: Path, adapter_dir: Path, spec: dict, work: Path) -> dict[str, np.ndarray]:
    batch_json, out = work / "lora-batch.json", work / "lora-reference.npz"
    batch_json.write_text(json.dumps(spec))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, str(SCRIPT), "--_peft_reference", str(hf), str(adapter_dir), str(batch_json),
                        str(out)], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"the peft reference failed (exit {r.returncode}):\n{tail}")
    return dict(np.load(out))


def _units(ref: dict, dev: np.ndarray) -> dict[str, float]:
    r = ref["logp"].astype(np.float64)
    unit = np.abs(ref["logp_perturbed"].astype(np.float64) - r)
    diff = np.abs(dev.astype(np.float64) - r)
    if not np.isfinite(diff).all():
        return {"rel_rms": math.inf, "rel_max": math.inf, "rms": math.inf, "unit_rms": float(np.sqrt(np.mean(unit ** 2)))}
    rms, unit_rms = float(np.sqrt(np.mean(diff ** 2))), float(np.sqrt(np.mean(unit ** 2)))
    return {"rms": rms, "unit_rms": unit_rms, "rel_rms": rms / max(unit_rms, 1e-12),
            "rel_max": float(diff.max()) / max(float(unit.max()), 1e-12)}


def row_lora_peft(smoke: bool, work: Path) -> list[Row]:
    shape, hf, spec = _numerics_inputs(smoke, work)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    adapter_dir = work / "lora-adapter"
    dev = _actor_logprobs(hf, spec, adapter_dir)
    ref = _reference(hf, adapter_dir, spec, work)
    if dev.shape != ref["logp"].shape:
        raise ValueError(f"log-probs: the reference has {ref['logp'].shape} values, the actor {dev.shape}")
    what = (f"L={shape['num_hidden_layers']} H={shape['hidden_size']}, rank {RANK} on every default target, "
            f"{spec['n']} seqs, {len(dev)} resp tokens")
    path = f"{LORA_CHECK}: actor {device} bf16 ({spec_name() if device == 'cuda' else 'te-twin'} spec) vs CPU fp32 peft"
    v, c = _units(ref, dev), _units(ref, ref["logp_defect"])
    crit = f"rms, max <= {RMS_TOL:g}x unit"
    return [Row(f"{path}: log-probs", what,
                f"rms {v['rms']:.1e} = {v['rel_rms']:.2f}x unit {v['unit_rms']:.1e}, max {v['rel_max']:.2f}x unit", crit,
                "PASS" if v["rel_rms"] <= RMS_TOL and v["rel_max"] <= MAX_TOL else "FAIL", v),
            Row("negative control: peft with the adapters disabled", what,
                f"{c['rel_rms']:.1f}x unit rms, {c['rel_max']:.1f}x unit max",
                f"> {RMS_TOL:g}x unit (the check can fail)", "PASS" if c["rel_rms"] > RMS_TOL else "FAIL", c)]
