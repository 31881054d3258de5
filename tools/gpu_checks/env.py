"""The environment: packages the actor rows need, the GPU-only modules blocked for the CPU paths, peak FLOP/s."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.py"  # the CLI: the subprocesses of rows 1 and 4 run it
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "GH200": 989.0, "A100": 312.0}


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
    return "transformer-engine" if _find("transformer_engine") is not None else "te-twin"


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
