"""GPU check: what the CPU test suite cannot prove, on one or two CUDA GPUs in a few minutes.

    python tools/gpu_check.py                   # CUDA GPUs: every row (row 4 needs two)
    python tools/gpu_check.py --cpu-smoke       # CPU, tiny shapes: the machinery only (CI runs this)
    python tools/gpu_check.py --json out.json   # the rows as JSON too

It prints one table, a row per claim:

1. **actor numerics** -- the actor's CUDA path (Transformer Engine layer spec when
   ``transformer_engine`` is importable, Megatron's local spec otherwise) in bf16 computes the
   same token log-probs, entropies and gradient norm as the CPU fp32 path (local spec, the path
   every CPU test checks against HF transformers to 1e-5) on the same weights and batch: a random
   Qwen2-shaped model (GQA, qkv bias) whose weights are stored in bf16, so both paths start from
   identical values. The CPU fp32 reference runs in a subprocess with CUDA hidden and every
   GPU-only package blocked (``GPU_ONLY_MODULES``: Transformer Engine, and NVIDIA apex, amp_C and
   the other fused-kernel extensions an NGC image also has, which Megatron-Core would otherwise
   pick for the optimizer and gradient clipping and run on CPU tensors), exactly the code path of
   the CPU tests; it checks that Megatron chose torch AdamW and its local multi-tensor ops. Behaviour log-probs are
   each path's own log-probs plus the same fixed noise (std 0.05: M2 = 0.0025 < 0.04), so the
   M2PO mask keeps every token on both paths and no discrete decision can differ.

   Tolerance, and why: a bf16 path rounds every stored activation to 8 significant bits (a
   relative error of up to 2^-8) while the weights are identical and matmuls accumulate in fp32.
   How far that moves log-probs depends on the model and the batch (depth, scale of the logits),
   so the scale is measured, not assumed: the reference also computes its fp32 log-probs and
   entropies after a relative error of 2^-8 with random sign on every weight -- one bf16-sized
   rounding of every stored tensor of every layer, the same kind of perturbation as the bf16
   path's activation roundings. That deviation is the "unit". A correct bf16 path lands near one
   unit (round-to-nearest errors average less than 2^-8: CPU bf16 measured 0.5-0.8 units); the check asks for the RMS and the largest deviation each <= 4 units (room for the
   extra roundings in softmax, norms and residual adds, and for GPU kernels that differ from the
   CPU ones), and the M2PO gradient norm within 5 % (relative). A real defect (wrong RoPE, mask,
   GQA grouping, norm, bias mapping, vocab-parallel reduction) moves log-probs by a sizeable
   fraction of their spread: many units. A negative-control row shows the check has teeth on
   this very model: the fp32 path with its q/k/v biases dropped must land above 4 units (on CPU:
   15 at the smoke shapes, 31 at this row's GPU shapes, where CPU bf16 measured 0.6-0.8 units).

2. **fused log-prob vs naive, memory and time** -- ``megatron_m2po.parallel.logprobs`` (chunked,
   recomputing, never ``[T, V]`` logits) against materialised logits + ``log_softmax`` + entropy,
   forward + backward to the hidden states and the output weight, at one Qwen2.5-1.5B rank
   (T = 8192, H = 1536, V = 151936) and one Qwen2.5-32B TP=8 rank (T = 16384, H = 5120,
   V/TP = 19008). Peak CUDA memory above the inputs (``max_memory_allocated``), best-of-3 time,
   and the log-probs of both methods (they must agree to 1e-3). Two naive variants: fp32 matmul
   (what tools/benchmarks/logprob_memory.py measures, same arithmetic as the fused kernel) and
   bf16 logits cast to fp32 (what Megatron RL stacks do).

3. **train-step throughput** -- tokens/s and MFU of one M2PO optimizer update of a
   Qwen2.5-1.5B-shaped model (28 layers, hidden 1536, GQA 12/2, SwiGLU 8960, vocab 151936,
   tied) with random weights on one GPU, TP = PP = DP = 1, bf16, 16 sequences of 512 prompt +
   1536 response tokens, one sequence per micro-batch, after one warm-up update. MFU counts the
   useful FLOPs only (3 x forward: matmuls, causal attention, the output layer on response
   rows); the M2PO mask pre-pass (one more forward) and the fused log-prob's recomputed logits
   are real work it does not credit. Peak FLOP/s: 989 TFLOP/s dense bf16 for H100 / H200 SXM
   (--peak-tflops for another GPU); compare with the planner's ``gemm_eff`` (docs/planner.md).

4. **packed sequences at TP=2 + sequence parallel** -- the layout every recipe trains with:
   two ranks (processes started with torchrun's environment, NCCL), tensor parallel 2 with
   sequence parallelism, micro-batches packed under a token budget (THD: Transformer Engine's
   ``padding_causal`` attention with ``cu_seqlens``, its fused THD RoPE, the SP padding
   pseudo-sequence when a pack's length is odd), bf16, on row 1's model and batch, against row
   1's CPU fp32 reference (one process, unpacked) with row 1's tolerance: log-probs, entropies
   and the M2PO gradient norm. Needs 2 GPUs: with fewer the row is refused by name
   ("row 4 needs 2 GPUs, found K") and the exit status is 2.

``--cpu-smoke`` runs the same code at tiny shapes on CPU (CUDA hidden and the GPU-only packages
blocked in every process, so it runs the same in the NGC image): row 1 compares CPU bf16 with the
CPU fp32 reference (same tolerance), row 2 checks agreement and time (the memory column needs the
CUDA allocator: skipped, with the reason), row 3 measures tokens/s (no MFU: no CPU peak), row 4
runs its two ranks on gloo with Megatron's local layer spec and the actor's packed attention
(``actor/attention.py``). It proves that the table, the comparisons and the two-rank launch run,
not any GPU claim.

Needs megatron-core and mbridge (the versions in constraints-cpu.txt); without them the actor
rows are skipped and the message says how to install them. Exit status: 0 all rows passed or
informational, 1 a check failed, 2 rows were skipped (a missing package, or too few GPUs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

# row 1 (module docstring): the bf16 path's deviation from fp32, in units of the deviation that
# one bf16-sized relative error on every weight causes in the fp32 path
BF16_U = 2.0 ** -8
RMS_TOL = 4.0
MAX_TOL = 4.0
GRAD_NORM_TOL = 0.05
BEHAV_NOISE = 0.05
LOGPROB_AGREE = 1e-3       # row 2: fused vs naive log-probs / entropies, absolute (fp32 arithmetic)
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "GH200": 989.0, "A100": 312.0}

QWEN25_15B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6)


@dataclass
class Row:
    check: str
    shape: str
    result: str
    criterion: str
    verdict: str            # PASS | FAIL | INFO | SKIP
    values: Optional[dict] = None


# ------------------------------------------------------------------------------------------------
# Environment
# ------------------------------------------------------------------------------------------------


def missing_packages() -> list[str]:
    return [name for mod, name in (("megatron.core", "megatron-core"), ("mbridge", "mbridge"),
                                   ("transformers", "transformers")) if _find(mod) is None]


def _find(mod: str):
    try:
        return importlib.util.find_spec(mod)
    except ModuleNotFoundError:
        return None


def _pins() -> dict[str, str]:
    pins = {"megatron-core": "0.16.1", "mbridge": "0.15.1", "transformers": "5.23.0"}
    f = ROOT / "constraints-cpu.txt"
    if f.is_file():
        for line in f.read_text().splitlines():
            name, _, ver = line.strip().partition("==")
            if name in pins and ver:
                pins[name] = ver
    return pins


def install_message(missing: list[str]) -> str:
    pins = _pins()
    reqs = " ".join(f"'{m}=={pins[m]}'" for m in missing)
    return (f"{', '.join(missing)} not importable by {sys.executable}: the actor rows need them.\n"
            f"  online:   {sys.executable} -m pip install {reqs}\n"
            f"  offline:  on a machine with internet `pip download {reqs} -d wheels/` (add "
            f"--platform/--python-version for the target), copy wheels/ here, then "
            f"`{sys.executable} -m pip install --no-index --find-links wheels/ {reqs}`\n"
            "  transformer-engine is optional: without it the actor runs Megatron's local layer spec.")


def spec_name() -> str:
    return "transformer-engine" if _find("transformer_engine") is not None else "local"


# Packages whose kernels take CUDA tensors only. An NGC image has several of them; Megatron-Core
# picks each when it imports (0.16.1 and 0.19.2 alike): optimizer/__init__.py and
# distrib_optimizer.py take TE's, else apex's FusedAdam (torch AdamW only if both imports fail);
# optimizer/optimizer.py and clip_grads.py take TE's, else apex's multi_tensor_applier with amp_C's
# kernels (megatron.core.utils' local_multi_tensor_* only if both fail); gpt_layer_specs.py and
# transformer_block.py take apex's FusedLayerNorm; tensor_parallel/layers.py imports
# fused_weight_gradient_mlp_cuda, fusions/fused_softmax.py the scaled_*softmax_cuda kernels,
# transformer/attention.py flash-attention 3, megatron_fsdp/mixed_precision.py amp_C. Each import
# sits in try/except ImportError, so a None entry in sys.modules (ModuleNotFoundError on import,
# find_spec -> None) selects the CPU fallback.
GPU_ONLY_MODULES = (
    "transformer_engine", "transformer_engine_torch", "apex", "amp_C", "fused_layer_norm_cuda",
    "fast_layer_norm", "fused_weight_gradient_mlp_cuda", "scaled_masked_softmax_cuda",
    "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda", "flash_attn", "flash_attn_interface",
    "flash_attn_3", "flashattn_hopper",
)


def block_gpu_only_modules() -> None:
    """Make every module of :data:`GPU_ONLY_MODULES` unimportable in this process, so Megatron-Core
    takes its CPU code paths (the ones every CPU test checks). Must run before ``megatron.core`` is
    imported: Megatron chooses its kernels at import time."""
    chosen = sorted(m for m in sys.modules if m.startswith("megatron.core.optimizer") or m == "megatron.core")
    loaded = sorted(m for m in GPU_ONLY_MODULES if sys.modules.get(m) is not None)
    if chosen or loaded:
        raise RuntimeError(f"block_gpu_only_modules() called too late: already imported {chosen + loaded}")
    for m in GPU_ONLY_MODULES:
        sys.modules[m] = None  # type: ignore[assignment]


def check_cpu_fallbacks() -> None:
    """Raise unless Megatron-Core chose its CPU fallbacks (after :func:`block_gpu_only_modules`)."""
    from megatron.core import optimizer, utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mc_optimizer

    wrong = []
    if not optimizer.USING_PYTORCH_OPTIMIZER:
        wrong.append(f"optimizer {optimizer.Adam.__module__}.{optimizer.Adam.__name__}")
    for mod in (clip_grads, mc_optimizer):
        if mod.multi_tensor_applier is not utils.local_multi_tensor_applier:
            wrong.append(f"{mod.__name__}.multi_tensor_applier from {mod.multi_tensor_applier.__module__}")
    if wrong:
        raise RuntimeError("the CPU reference must use Megatron's torch fallbacks, but got: " + ", ".join(wrong))


def peak_tflops(override: Optional[float]) -> Optional[float]:
    if override:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, v in PEAK_TFLOPS.items():  # "H100 PCIe" before "H100"
        if key in name:
            return v
    return None


# ------------------------------------------------------------------------------------------------
# Random HF models (weights stored in bf16: both paths load identical values)
# ------------------------------------------------------------------------------------------------


def make_random_qwen2(out_dir: Path, *, seed: int, init_std: float, **shape: Any) -> Path:
    """A Qwen2 HF directory (config.json + model.safetensors) with random bf16 weights.

    Shapes come from transformers' own module tree built on the meta device, so every tensor
    the HF checkpoint has is written, with norms near 1 and biases non-zero (every mapping used).
    """
    import transformers as tr
    from safetensors.torch import save_file

    if (out_dir / "config.json").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = tr.Qwen2Config(**shape)
    with torch.device("meta"):
        meta = tr.Qwen2ForCausalLM(cfg)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # 1.5B normal samples: seconds on a GPU
    g = torch.Generator(device=dev).manual_seed(seed)
    tensors = {}
    for name, p in meta.named_parameters():  # a tied lm_head is the embedding: listed once
        t = torch.randn(p.shape, generator=g, device=dev)
        if "norm" in name:
            t = 1.0 + 0.1 * t
        elif name.endswith(".bias"):
            t = 0.1 * t
        else:
            t = init_std * t
        tensors[name] = t.to(torch.bfloat16).cpu().contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out_dir)
    return out_dir


def make_batch(n: int, *, vocab: int, prompt: tuple[int, int], response: tuple[int, int], seed: int):
    """Deterministic samples (prompt / response token ids, advantages, loss masks)."""
    from megatron_m2po.actor.batch import Sample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = int(rng.integers(prompt[0], prompt[1] + 1))
        r = int(rng.integers(response[0], response[1] + 1))
        out.append(Sample(uid=f"g{i}", prompt_ids=rng.integers(0, vocab, p), response_ids=rng.integers(0, vocab, r),
                          behav_logprobs=np.zeros(r, np.float32), advantages=np.float32(rng.standard_normal()),
                          loss_mask=np.ones(r, np.uint8), versions=np.zeros(r, np.int64)))
    return out


def _actor_config(hf_dir: Path, dtype: str, *, lr: float = 1e-5, mbs: int = 1, parallel: Optional[dict] = None):
    from megatron_m2po.config import Config

    cfg = Config()
    cfg.model.hf_path = str(hf_dir)
    cfg.model.dtype = dtype
    cfg.parallel.micro_batch_size = mbs
    for k, v in (parallel or {}).items():
        setattr(cfg.parallel, k, v)
    cfg.algo.loss = "m2po"
    cfg.optim.lr = lr
    cfg.rollout.temperature = 1.0
    return cfg


def actor_outputs(hf_dir: Path, dtype: str, samples: list, *, noise_seed: int = 7, calibrate: bool = False,
                  parallel: Optional[dict] = None) -> dict[str, np.ndarray]:
    """Log-probs and entropies of ``samples``, then one M2PO update's gradient norm, on this process's device.

    With ``calibrate`` (the fp32 reference) also the log-probs and entropies after one
    bf16-sized relative error (2^-8, random sign) on every weight: the error scale of the
    tolerance (module docstring). The weights are restored before the update. ``parallel``:
    ``ParallelConfig`` fields to set (the packed row's TP=2 + SP layout); with several ranks every
    rank returns the same values (the actor gathers log-probs to all ranks).
    """
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch

    cfg = _actor_config(hf_dir, dtype, parallel=parallel)
    actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=10))
    extra: dict[str, np.ndarray] = {}
    try:
        lps, ents = actor.compute_logprobs(RolloutBatch(samples), with_entropy=True)
        if calibrate:
            params = [p for c in actor.chunks for p in c.parameters()]
            saved = [p.detach().clone() for p in params]
            g = torch.Generator().manual_seed(noise_seed)
            with torch.no_grad():
                for p in params:
                    sign = torch.randint(0, 2, p.shape, generator=g).to(p.device, p.dtype) * 2 - 1
                    p.mul_(1 + BF16_U * sign)
            plps, pents = actor.compute_logprobs(RolloutBatch(samples), with_entropy=True)
            with torch.no_grad():
                for p, v in zip(params, saved):
                    p.copy_(v)
            # negative control: a subtle defect (the q/k/v biases dropped) must be many units away
            biases = [p for c in actor.chunks for n, p in c.named_parameters() if n.endswith("linear_qkv.bias")]
            bsaved = [b.detach().clone() for b in biases]
            with torch.no_grad():
                for b in biases:
                    b.zero_()
            dlps = actor.compute_logprobs(RolloutBatch(samples))
            with torch.no_grad():
                for b, v in zip(biases, bsaved):
                    b.copy_(v)
            extra = {"logp_perturbed": np.concatenate(plps), "entropy_perturbed": np.concatenate(pents),
                     "logp_defect": np.concatenate(dlps), "n_biases": np.array([len(biases)])}
        rng = np.random.default_rng(noise_seed)
        for s, lp in zip(samples, lps):  # behaviour = own log-probs + fixed noise (module docstring)
            s.behav_logprobs = (lp + BEHAV_NOISE * rng.standard_normal(lp.shape)).astype(np.float32)
        metrics = actor.train_step(RolloutBatch(samples), num_minibatches=1)[0]
    finally:
        actor.close()
    return {"logp": np.concatenate(lps), "entropy": np.concatenate(ents),
            "grad_norm": np.array([metrics["optim/grad_norm"]]),
            "mask_frac": np.array([metrics.get("m2po/mask_frac", 0.0)]), **extra}


def _reference_worker(hf_dir: str, batch_json: str, out: str) -> int:
    """Subprocess: the CPU fp32 path, with CUDA hidden and the GPU-only packages blocked (local
    layer spec, torch AdamW, local multi-tensor ops: the code path of the CPU tests)."""
    block_gpu_only_modules()
    spec = json.loads(Path(batch_json).read_text())
    samples = make_batch(**spec)
    res = actor_outputs(Path(hf_dir), "float32", samples, calibrate=True)
    check_cpu_fallbacks()
    np.savez(out, **res)
    return 0


def start_reference(hf_dir: Path, spec: dict, work: Path) -> tuple[subprocess.Popen, Path]:
    batch_json, out = work / "batch.json", work / "reference.npz"
    batch_json.write_text(json.dumps(spec))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get(
        "PYTHONPATH", ""), "PYTHONWARNINGS": "ignore"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_reference", str(hf_dir), str(batch_json), str(out)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out


def compare(ref: dict[str, np.ndarray], dev: dict[str, np.ndarray]) -> dict[str, Any]:
    """Row 1's criterion (module docstring). Returns the measured values and ``ok``."""
    out: dict[str, Any] = {}
    ok = True
    for key in ("logp", "entropy"):
        r, d = ref[key].astype(np.float64), dev[key].astype(np.float64)
        if r.shape != d.shape:
            raise ValueError(f"{key}: reference has {r.shape} values, device path {d.shape}")
        unit = np.abs(ref[key + "_perturbed"].astype(np.float64) - r)
        unit_rms, unit_max = float(np.sqrt(np.mean(unit ** 2))), float(unit.max())
        diff = np.abs(d - r)
        finite = bool(np.isfinite(d).all())
        rms = float(np.sqrt(np.mean(diff ** 2))) if finite else math.inf
        mx = float(diff.max()) if finite else math.inf
        rel_rms, rel_max = rms / max(unit_rms, 1e-12), mx / max(unit_max, 1e-12)
        out[key] = dict(rms=rms, max=mx, unit_rms=unit_rms, unit_max=unit_max, rel_rms=rel_rms, rel_max=rel_max)
        ok &= finite and rel_rms <= RMS_TOL and rel_max <= MAX_TOL
    if "logp_defect" in ref:  # the negative control, in the same units (not part of ``ok``)
        unit = np.abs(ref["logp_perturbed"] - ref["logp"]).astype(np.float64)
        dd = np.abs(ref["logp_defect"] - ref["logp"]).astype(np.float64)
        out["defect"] = dict(rel_rms=float(np.sqrt(np.mean(dd ** 2)) / max(np.sqrt(np.mean(unit ** 2)), 1e-12)),
                             rel_max=float(dd.max() / max(unit.max(), 1e-12)))
    g_ref, g_dev = float(ref["grad_norm"][0]), float(dev["grad_norm"][0])
    rel = abs(g_dev - g_ref) / max(abs(g_ref), 1e-12)
    out["grad_norm"] = dict(reference=g_ref, device=g_dev, rel=rel)
    ok &= math.isfinite(g_dev) and rel <= GRAD_NORM_TOL
    out["ok"] = bool(ok)
    return out


def _numerics_inputs(smoke: bool, work: Path) -> tuple[dict, Path, dict]:
    """The random model and batch of rows 1 and 4 (they share the CPU fp32 reference)."""
    shape = (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=256, max_position_embeddings=512) if smoke else
             dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=1408, vocab_size=8192, max_position_embeddings=2048))
    # weights ~ N(0, 1/H): unit gain per matmul, so errors neither vanish nor explode with depth
    hf = make_random_qwen2(work / "numerics-model", seed=0, init_std=shape["hidden_size"] ** -0.5,
                           tie_word_embeddings=False, **shape)
    spec = dict(n=4 if smoke else 8, vocab=shape["vocab_size"], prompt=(4, 12) if smoke else (16, 64),
                response=(6, 16) if smoke else (32, 160), seed=3)
    return shape, hf, spec


_REFERENCES: dict[tuple[str, str], dict[str, np.ndarray]] = {}  # (model dir, batch spec) -> reference outputs


def reference_outputs(hf: Path, spec: dict, work: Path, proc_out=None) -> dict[str, np.ndarray]:
    """The CPU fp32 reference of ``hf`` on ``spec``'s batch: computed once per run (``proc_out``: a
    :func:`start_reference` already under way)."""
    key = (str(hf), json.dumps(spec, sort_keys=True))
    if key not in _REFERENCES:
        proc, out = proc_out or start_reference(hf, spec, work)
        log, _ = proc.communicate()
        if proc.returncode != 0:
            tail = "\n".join(log.strip().splitlines()[-15:])
            raise RuntimeError(f"the CPU fp32 reference failed (exit {proc.returncode}):\n{tail}")
        _REFERENCES[key] = dict(np.load(out))
    return _REFERENCES[key]


def row_actor_numerics(smoke: bool, work: Path) -> list[Row]:
    shape, hf, spec = _numerics_inputs(smoke, work)
    key = (str(hf), json.dumps(spec, sort_keys=True))
    started = None if key in _REFERENCES else start_reference(hf, spec, work)  # runs while this process does
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = actor_outputs(hf, "bfloat16", make_batch(**spec))
    except BaseException:
        if started:
            started[0].kill()
            started[0].communicate()
        raise
    ref = reference_outputs(hf, spec, work, started)
    what = (f"L={shape['num_hidden_layers']} H={shape['hidden_size']} V={shape['vocab_size']}, "
            f"{spec['n']} seqs, {len(ref['logp'])} resp tokens")
    path = f"actor {device} bf16 ({spec_name() if device == 'cuda' else 'local'} spec) vs CPU fp32"
    return comparison_rows(path, what, ref, dev, control=True)


def comparison_rows(path: str, what: str, ref: dict, dev: dict, *, control: bool) -> list[Row]:
    """The rows of :func:`compare`: log-probs, entropies, (the negative control), grad norm."""
    c = compare(ref, dev)
    lp, en, gn = c["logp"], c["entropy"], c["grad_norm"]
    crit = f"rms, max <= {RMS_TOL:g}x unit"

    def res(v: dict) -> str:
        return (f"rms {v['rms']:.1e} = {v['rel_rms']:.2f}x unit {v['unit_rms']:.1e}, "
                f"max {v['max']:.1e} = {v['rel_max']:.2f}x unit {v['unit_max']:.1e}")

    rows = [
        Row(f"{path}: log-probs", what, res(lp), crit,
            "PASS" if lp["rel_rms"] <= RMS_TOL and lp["rel_max"] <= MAX_TOL else "FAIL", lp),
        Row(f"{path}: entropies", what, res(en), crit,
            "PASS" if en["rel_rms"] <= RMS_TOL and en["rel_max"] <= MAX_TOL else "FAIL", en),
    ]
    if control:
        rows.append(Row("negative control: fp32 with q/k/v biases dropped", what,
                        f"{c['defect']['rel_rms']:.1f}x unit rms, {c['defect']['rel_max']:.1f}x unit max "
                        f"({int(ref['n_biases'][0])} bias tensors)", f"> {RMS_TOL:g}x unit (the check can fail)",
                        "PASS" if c["defect"]["rel_rms"] > RMS_TOL else "FAIL", c["defect"]))
    rows.append(Row(f"{path}: M2PO grad norm", what,
                    f"{gn['device']:.4g} vs {gn['reference']:.4g} ({gn['rel']:.2%})", f"within {GRAD_NORM_TOL:.0%}",
                    "PASS" if gn["rel"] <= GRAD_NORM_TOL else "FAIL", gn))
    return rows


# ------------------------------------------------------------------------------------------------
# Row 4: packed sequences at TP=2 + sequence parallel (the recipes' layout), 2 ranks
# ------------------------------------------------------------------------------------------------

PACKED_TP = 2
PACKED_CHECK = "actor packed TP=2+SP vs CPU fp32"


def packed_layout(smoke: bool) -> dict:
    """Row 4's ``parallel`` settings: what every recipe sets (TP with sequence parallelism, packed
    THD micro-batches under a token budget), at a budget that packs 3-5 of the row's sequences
    and leaves packs of odd length (the SP padding pseudo-sequence)."""
    return dict(tensor_parallel=PACKED_TP, sequence_parallel=True, packing=True,
                max_tokens_per_microbatch=64 if smoke else 512)


def gpus_refusal(row: int, check: str, need: int, found: int) -> Optional[Row]:
    """A SKIP row naming why ``row`` cannot run (``found`` < ``need`` GPUs), else None."""
    if found >= need:
        return None
    return Row(check, "-", f"refused: row {row} needs {need} GPUs, found {found} (run it on a machine with "
               f">= {need}, or leave it out: --only numerics logprobs throughput)", "-", "SKIP")


def _packed_rank_worker(hf_dir: str, batch_json: str, out: str, smoke: str) -> int:
    """One rank of row 4 (RANK / WORLD_SIZE / MASTER_* in the environment, as torchrun sets them):
    the actor's own process-group setup (NCCL on CUDA, gloo on CPU), TP=2 + SP, packed; rank 0
    writes the outputs."""
    if smoke == "1":
        block_gpu_only_modules()  # the CPU path of the image too (module docstring)
    spec = json.loads(Path(batch_json).read_text())
    res = actor_outputs(Path(hf_dir), "bfloat16", make_batch(**spec), parallel=packed_layout(smoke == "1"))
    if os.environ["RANK"] == "0":
        np.savez(out, **res)
    return 0


def run_packed_ranks(hf: Path, spec: dict, work: Path, smoke: bool, timeout_s: float) -> dict[str, np.ndarray]:
    """Start row 4's ranks as separate processes (CPU: CUDA hidden, gloo), wait for all with a
    deadline, and return rank 0's outputs; a failed rank's log tail becomes the error."""
    from megatron_m2po.utils.net import free_port

    batch_json, out = work / "packed-batch.json", work / "packed.npz"
    batch_json.write_text(json.dumps(spec))
    out.unlink(missing_ok=True)
    base = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(PACKED_TP), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # as scripts/train.sh
    if smoke:
        base["CUDA_VISIBLE_DEVICES"] = ""
    logs = [work / f"packed-rank{r}.log" for r in range(PACKED_TP)]
    procs = []
    for r in range(PACKED_TP):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_packed_rank", str(hf), str(batch_json), str(out),
               "1" if smoke else "0"]
        with open(logs[r], "w") as log:
            procs.append(subprocess.Popen(cmd, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=log,
                                          stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    failed = None
    try:  # the first rank to fail is the one to report: its peer then waits in a collective
        while True:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = (bad[0][0], f"exit {bad[0][1]}")
                break
            if None not in codes:
                break
            running = codes.index(None)
            if time.monotonic() > deadline:
                failed = (running, f"still running after {timeout_s:g} s")
                break
            try:
                procs[running].wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if failed:
        r, why = failed
        tail = "\n".join(logs[r].read_text().strip().splitlines()[-15:])
        raise RuntimeError(f"packed TP={PACKED_TP} rank {r} failed ({why}):\n{tail}")
    return dict(np.load(out))


def row_packed_tp_sp(smoke: bool, work: Path) -> list[Row]:
    from megatron_m2po.actor.batch import group_microbatches

    found = PACKED_TP if smoke else torch.cuda.device_count()
    refused = gpus_refusal(4, PACKED_CHECK, PACKED_TP, found)
    if refused:
        return [refused]
    shape, hf, spec = _numerics_inputs(smoke, work)
    layout = packed_layout(smoke)
    samples = make_batch(**spec)
    lengths = [s.length for s in samples]
    packs = group_microbatches(lengths, list(range(len(samples))), micro_batch_size=1,
                               max_tokens=layout["max_tokens_per_microbatch"], packing=True, pad_multiple=PACKED_TP)
    if max(len(p) for p in packs) < 2:
        raise ValueError(f"row 4 packs no two sequences together (packs {packs}, lengths {lengths}): it would not "
                         "test packed attention; lower the row's sequence lengths or raise its token budget")
    key = (str(hf), json.dumps(spec, sort_keys=True))
    started = None if key in _REFERENCES else start_reference(hf, spec, work)
    try:
        dev = run_packed_ranks(hf, spec, work, smoke, timeout_s=300 if smoke else 600)
    except BaseException:
        if started:
            started[0].kill()
            started[0].communicate()
        raise
    ref = reference_outputs(hf, spec, work, started)
    odd = sum(sum(lengths[i] for i in p) % PACKED_TP for p in packs)
    what = (f"L={shape['num_hidden_layers']} H={shape['hidden_size']}, {spec['n']} seqs in {len(packs)} packs of "
            f"{'/'.join(str(len(p)) for p in packs)} seqs ({odd} padded to a multiple of TP), "
            f"{len(ref['logp'])} resp tokens")
    device = "cpu gloo" if smoke else f"cuda nccl, {spec_name()} spec"
    return comparison_rows(f"actor {device} bf16 TP=2+SP packed (THD) vs CPU fp32", what, ref, dev, control=False)


# ------------------------------------------------------------------------------------------------
# Row 2: fused log-prob vs naive
# ------------------------------------------------------------------------------------------------


def _logprob_methods():
    from megatron_m2po.parallel.logprobs import fused_logprobs_entropy

    def fused(h, w, t, chunk):
        return fused_logprobs_entropy(h, w, t, chunk_rows=chunk)

    def naive_fp32(h, w, t, chunk):
        logsm = torch.log_softmax(h.float() @ w.float().T, dim=-1)
        return logsm.gather(1, t[:, None]).squeeze(1), -(logsm.exp() * logsm).sum(-1)

    def naive_bf16(h, w, t, chunk):
        logsm = torch.log_softmax((h @ w.T).float(), dim=-1)
        return logsm.gather(1, t[:, None]).squeeze(1), -(logsm.exp() * logsm).sum(-1)

    return {"fused": fused, "naive fp32 logits": naive_fp32, "naive bf16 logits": naive_bf16}


def measure_logprob(method, T: int, H: int, V: int, chunk: int, device: torch.device, repeats: int) -> dict:
    """Peak memory above the inputs (CUDA), best-of time, and the outputs of forward + backward."""
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(T, H, generator=g) * 0.5).to(device, torch.bfloat16).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * H ** -0.5).to(device, torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g).to(device)
    g1, g2 = torch.randn(T, generator=g).to(device), torch.randn(T, generator=g).to(device)
    cuda = device.type == "cuda"
    times, peak, outs = [], None, None
    for rep in range(repeats + 1):  # the first run warms up kernels and the allocator
        hidden.grad = weight.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        logp, ent = method(hidden, weight, targets, chunk)
        ((logp * g1).sum() + (ent * g2).sum()).backward()
        if cuda:
            torch.cuda.synchronize()
        if rep:
            times.append(time.perf_counter() - t0)
        if cuda and rep == 1:
            peak = torch.cuda.max_memory_allocated() - base
        outs = (logp.detach().float().cpu(), ent.detach().float().cpu())
        del logp, ent
    del hidden, weight
    if cuda:
        torch.cuda.empty_cache()
    return {"time_s": min(times), "peak_bytes": peak, "logp": outs[0], "entropy": outs[1]}


def row_logprobs(smoke: bool) -> list[Row]:
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    shapes = ([("tiny", 256, 64, 1000, 64)] if smoke else
              [("Qwen2.5-1.5B, TP=1", 8192, 1536, 151936, 1024), ("Qwen2.5-32B, one TP=8 rank", 16384, 5120, 19008, 1024)])
    rows = []
    for label, T, H, V, chunk in shapes:
        res = {name: measure_logprob(fn, T, H, V, chunk, device, 1 if smoke else 3)
               for name, fn in _logprob_methods().items()}
        f = res["fused"]
        agree = max(float((res[n]["logp"] - f["logp"]).abs().max()) for n in res if n.startswith("naive fp32"))
        agree_e = max(float((res[n]["entropy"] - f["entropy"]).abs().max()) for n in res if n.startswith("naive fp32"))
        shape = f"{label}: T={T} H={H} V/TP={V}, chunk {chunk}"
        ok = agree <= LOGPROB_AGREE and agree_e <= LOGPROB_AGREE
        rows.append(Row("fused log-prob = naive (fp32 arithmetic)", shape,
                        f"max |dlogp| {agree:.1e}, max |dentropy| {agree_e:.1e}", f"<= {LOGPROB_AGREE:g}",
                        "PASS" if ok else "FAIL", dict(logp=agree, entropy=agree_e)))
        if device.type == "cuda":
            mem = ", ".join(f"{n} {r['peak_bytes'] / 2**30:.2f} GiB" for n, r in res.items())
            less = min(r["peak_bytes"] for n, r in res.items() if n != "fused") / max(f["peak_bytes"], 1)
            rows.append(Row("fused log-prob memory (fwd+bwd, peak above inputs)", shape,
                            f"{mem} ({less:.1f}x less)", "fused < every naive",
                            "PASS" if less > 1 else "FAIL",
                            {n: r["peak_bytes"] for n, r in res.items()}))
        else:
            rows.append(Row("fused log-prob memory (fwd+bwd, peak above inputs)", shape,
                            "skipped: needs the CUDA allocator's peak statistics "
                            "(CPU peak RSS: tools/benchmarks/logprob_memory.py)", "-", "SKIP"))
        tm = ", ".join(f"{n} {r['time_s'] * 1e3:.1f} ms" for n, r in res.items())
        rows.append(Row(f"fused log-prob time ({device.type}, best of {1 if smoke else 3})", shape,
                        f"{tm} (fused/naive-bf16 {f['time_s'] / res['naive bf16 logits']['time_s']:.2f}x)",
                        "reported", "INFO", {n: r["time_s"] for n, r in res.items()}))
    return rows


# ------------------------------------------------------------------------------------------------
# Row 3: train-step throughput
# ------------------------------------------------------------------------------------------------


def train_flops(shape: dict, samples: list) -> float:
    """Useful FLOPs of one update: 3 x forward (matmuls, causal attention, the head on response rows)."""
    h, L = shape["hidden_size"], shape["num_hidden_layers"]
    heads, kv, f, V = (shape["num_attention_heads"], shape["num_key_value_heads"], shape["intermediate_size"],
                       shape["vocab_size"])
    d = h // heads
    matmul = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * f
    fwd = 0.0
    for s in samples:
        n, r = s.length, len(s.response_ids)
        fwd += 2 * n * matmul * L + 2 * r * h * V + 2 * heads * d * n * n * L
    return 3 * fwd


def row_throughput(smoke: bool, work: Path, peak: Optional[float]) -> list[Row]:
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch

    shape = (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=True)
             if smoke else QWEN25_15B)
    label = "tiny Qwen2 (smoke)" if smoke else "Qwen2.5-1.5B shape, random weights"
    hf = make_random_qwen2(work / ("tput-tiny" if smoke else "tput-1.5b"), seed=1, init_std=0.02, **shape)
    n, (p, r) = (4, (32, 96)) if smoke else (16, (512, 1536))
    samples = make_batch(n, vocab=shape["vocab_size"], prompt=(p, p), response=(r, r), seed=5)
    for s in samples:
        s.behav_logprobs = np.full(len(s.response_ids), -math.log(shape["vocab_size"]), np.float32)
    dtype = "bfloat16"
    actor = MegatronActor.from_config(ActorConfig.from_config(_actor_config(hf, dtype), total_updates=100))
    cuda = torch.cuda.is_available()
    try:
        actor.train_step(RolloutBatch(samples))  # warm-up: kernels, allocator, optimizer state
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(1 if smoke else 3):
            t0 = time.perf_counter()
            actor.train_step(RolloutBatch(samples))
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        mem = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None
    finally:
        actor.close()
    t = min(times)
    tokens = sum(s.length for s in samples)
    flops = train_flops(shape, samples)
    what = (f"{label}: {n} x ({p}+{r}) tokens, TP=PP=DP=1, {dtype}, "
            f"{'CPU' if not cuda else spec_name() + ' spec'}")
    vals = dict(tokens_per_s=tokens / t, step_s=t, tflops=flops / t / 1e12, peak_mem_gib=mem)
    res = f"{tokens / t:,.0f} tokens/s, {t:.2f} s/update, {flops / t / 1e12:.1f} TFLOP/s useful"
    if mem is not None:
        res += f", peak {mem:.1f} GiB"
    if peak:
        mfu = flops / t / (peak * 1e12)
        vals["mfu"] = mfu
        rows = [Row("train step (M2PO update)", what, res + f", MFU {mfu:.1%} of {peak:g} TFLOP/s",
                    "reported (planner assumes gemm_eff 0.55)", "INFO", vals)]
    else:
        why = "no peak FLOP/s for a CPU" if not cuda else "unknown GPU: pass --peak-tflops"
        rows = [Row("train step (M2PO update)", what, res + f"; MFU skipped: {why}", "reported", "INFO", vals)]
    return rows


# ------------------------------------------------------------------------------------------------
# Table and main
# ------------------------------------------------------------------------------------------------

COLUMNS = ("check", "shape", "result", "criterion", "verdict")
ROWS = {"numerics": 1, "logprobs": 2, "throughput": 3, "packed": 4}  # --only names -> row numbers (docstring)


def guarded(check: str, fn, *args: Any) -> list[Row]:
    """Run one group of rows; an exception becomes a FAIL row (traceback on stderr), so one
    broken path does not hide the others."""
    import gc
    import traceback

    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 -- reported as a failed row
        traceback.print_exc()
        msg = " ".join(str(e).split())
        return [Row(check, "-", f"error: {type(e).__name__}: {msg[:160]} (traceback on stderr)", "-", "FAIL")]
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def format_table(rows: list[Row], header: str) -> str:
    cells = [COLUMNS] + [tuple(getattr(r, c) for c in COLUMNS) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    line = lambda row: " | ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()  # noqa: E731
    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([header, line(cells[0]), sep] + [line(r) for r in cells[1:]])


def parse_table(text: str) -> list[dict[str, str]]:
    """The rows of a printed table (what tests read back)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("check ") and "| verdict" in ln)
    out = []
    for ln in lines[start + 2:]:
        if " | " not in ln:
            break
        parts = [p.strip() for p in ln.split(" | ")]
        out.append(dict(zip(COLUMNS, parts)))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/gpu_check.py", description=__doc__.split("\n\n", 1)[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes on CPU; CUDA-only measurements are skipped with the reason (CI)")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of this GPU for the MFU")
    ap.add_argument("--work-dir", help="where the random models go (default: a temporary directory)")
    ap.add_argument("--only", nargs="+", choices=list(ROWS), default=list(ROWS),
                    help="run only these rows (" + ", ".join(f"{k}: row {v}" for k, v in ROWS.items()) + ")")
    ap.add_argument("--_reference", nargs=3, metavar=("HF_DIR", "BATCH_JSON", "OUT_NPZ"), help=argparse.SUPPRESS)
    ap.add_argument("--_packed_rank", nargs=4, metavar=("HF_DIR", "BATCH_JSON", "OUT_NPZ", "SMOKE"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._reference:
        return _reference_worker(*a._reference)
    if a._packed_rank:
        return _packed_rank_worker(*a._packed_rank)
    if a.cpu_smoke:
        # CPU only, also on a GPU machine or in the NGC image: CUDA hidden before torch initialises
        # it, the GPU-only packages blocked before Megatron-Core picks its kernels.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        block_gpu_only_modules()
    cuda = torch.cuda.is_available()
    if not cuda and not a.cpu_smoke:
        print("tools/gpu_check.py: no CUDA device (torch.cuda.is_available() is False). Run it on a GPU "
              "machine, or pass --cpu-smoke to check the machinery at tiny shapes on CPU.", file=sys.stderr)
        return 2
    import warnings

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name() if cuda and not a.cpu_smoke else "cpu"
    missing = missing_packages()
    mc = _version("megatron-core")
    header = (f"gpu_check{' --cpu-smoke' if a.cpu_smoke else ''}: device={dev} torch={torch.__version__} "
              f"megatron-core={mc or 'missing'} layer-spec={spec_name()}")
    rows: list[Row] = []
    rc = 0
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        work = Path(a.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if "numerics" in a.only:
            if missing:
                rows.append(Row("actor bf16 vs CPU fp32", "-", f"skipped: {', '.join(missing)} missing", "-", "SKIP"))
            else:
                rows += guarded("actor bf16 vs CPU fp32", row_actor_numerics, a.cpu_smoke, work)
        if "logprobs" in a.only:
            rows += guarded("fused log-prob vs naive", row_logprobs, a.cpu_smoke)
        if "throughput" in a.only:
            if missing:
                rows.append(Row("train step (M2PO update)", "-", f"skipped: {', '.join(missing)} missing", "-", "SKIP"))
            else:
                rows += guarded("train step (M2PO update)", row_throughput, a.cpu_smoke, work,
                                peak_tflops(a.peak_tflops) if not a.cpu_smoke else None)
        if "packed" in a.only:
            if missing:
                rows.append(Row(PACKED_CHECK, "-", f"skipped: {', '.join(missing)} missing", "-", "SKIP"))
            else:
                rows += guarded(PACKED_CHECK, row_packed_tp_sp, a.cpu_smoke, work)
    print(format_table(rows, header), flush=True)
    if missing:
        print("\n" + install_message(missing), file=sys.stderr)
        rc = 2
    if any(r.verdict == "SKIP" and r.result.startswith("refused:") for r in rows):
        rc = 2
    if any(r.verdict == "FAIL" for r in rows):
        rc = 1
    if a.json:
        Path(a.json).write_text(json.dumps({"header": header, "rows": [asdict(r) for r in rows]}, indent=2,
                                           default=float))
    return rc


def _version(dist: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
