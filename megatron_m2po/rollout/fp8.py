"""FP8 rollout weights: quantise at export for engines that serve FP8, fake-quantise in the CPU worker.

Format (what SGLang's ``Fp8Config`` / ``Fp8LinearMethod`` load for a *serialized* per-tensor FP8
checkpoint, ``python/sglang/srt/layers/quantization/fp8.py``): every linear layer of the decoder
blocks stores

- ``<module>.weight``        ``float8_e4m3fn [out, in]`` -- ``round_e4m3(W / weight_scale)``
- ``<module>.weight_scale``  ``float32`` scalar -- ``amax(|W|) / 448`` (per tensor; SGLang keeps one
  per fused shard of qkv / gate_up), so ``W ~= weight.float() * weight_scale``

and ``config.json`` carries ``"quantization_config": {"quant_method": "fp8", "activation_scheme":
"dynamic", "ignored_layers": [...]}`` (no ``weight_block_size`` = per-tensor scales; dynamic =
activation scales computed at run time, so no ``input_scale`` tensors). Embeddings, ``lm_head``,
norms, biases and router gates stay in the trainer's dtype; skipped linears are listed in
``ignored_layers``.

The FP8 rounding comes from nvidia-modelopt (``tensor_quant.scaled_e4m3``: e4m3 with a per-tensor
amax), the same quantiser the CPU worker uses to emulate the engine: :func:`fake_quant_model`
replaces the decoder's linears by modelopt ``QuantLinear`` modules whose FP8 weight quantizer
rounds the weights onto the grid of the exported scales (amax = 448 * weight_scale) and computes
in float32 (W8A16: SGLang's weight-only Marlin FP8 path; on FP8 GPUs SGLang also quantises
activations dynamically, which adds to the mismatch below).

Training with FP8 rollouts (docs/design.md §3). The engine's log-probs then come from the quantised
model, the trainer's from full precision: set ``rollout.fp8_weights=true`` together with
``algo.recompute_behav_logprobs=true`` (the trainer recomputes behaviour log-probs in full
precision at generation time and logs ``mismatch/train_vs_engine_kl``) and ``algo.tis=true``
(the loss is weighted by ``min(p_train_behav / p_engine_behav, algo.tis_cap)``, paper eq. 6).

Engines must start FP8 too: launch them from an FP8 export of the base model
(``DiskWeightSync(..., fp8=True).export(weights, 0)`` or ``weight_sync.export_fp8_dir``), or from the base
model with ``--quantization fp8`` (SGLang and the CPU worker quantise on load).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
SCALE_SUFFIX = ".weight_scale"
# Linears of the decoder blocks that stay unquantised (MoE routers, as modelopt and SGLang do).
DEFAULT_SKIP = (r"\.mlp\.gate\.weight$", r"shared_expert_gate\.weight$", r"\.router\.")
_IN_LAYERS = re.compile(r"(^|\.)layers\.\d+\.")


def quantization_config(ignored_layers: Iterable[str] = ()) -> dict:
    """The ``quantization_config`` entry of config.json for per-tensor dynamic FP8."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic",
            "ignored_layers": sorted({"lm_head", *ignored_layers})}


def is_fp8_config(config: dict | object) -> bool:
    """True when an HF config (dict or PretrainedConfig) declares an FP8 checkpoint."""
    qc = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    return bool(qc) and "fp8" in str(qc.get("quant_method", ""))


def _target_name(name: str, skip: Iterable[str] = DEFAULT_SKIP) -> bool:
    return name.endswith(".weight") and bool(_IN_LAYERS.search(name)) and not any(re.search(p, name) for p in skip)


def is_quant_target(name: str, tensor: torch.Tensor, skip: Iterable[str] = DEFAULT_SKIP) -> bool:
    """A 2-D ``.weight`` of a linear inside the decoder blocks (not embeddings / lm_head / norms)."""
    return tensor.dim() == 2 and _target_name(name, skip)


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor e4m3 quantisation through modelopt: returns (fp8 weight, float32 scalar scale)."""
    from modelopt.torch.quantization.tensor_quant import scaled_e4m3
    w = w.detach().float()
    amax = w.abs().amax().clamp(min=1e-12)
    scale = (amax / FP8_MAX).to(torch.float32)
    fq = scaled_e4m3(w, amax, None, 4, 3)  # values on the e4m3 grid of this amax
    return (fq / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.reshape(())


def dequantize_tensor(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype)


def quantize_named(weights: Iterable[tuple[str, torch.Tensor]], *, skip: Iterable[str] = DEFAULT_SKIP,
                   skipped: Optional[list[str]] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) stream -> the FP8 checkpoint's stream: each target ``.weight`` becomes its
    fp8 tensor followed by ``.weight_scale``; everything else passes unchanged. Names of skipped
    decoder linears (for ``ignored_layers``) are appended to ``skipped``."""
    skip = tuple(skip)
    for name, t in weights:
        if is_quant_target(name, t, skip):
            q, s = quantize_tensor(t)
            yield name, q
            yield name[:-len(".weight")] + SCALE_SUFFIX, s
        else:
            if skipped is not None and name.endswith(".weight") and t.dim() == 2 and _IN_LAYERS.search(name):
                skipped.append(name[:-len(".weight")])
            yield name, t


def write_fp8_config(model_dir: str | Path, ignored_layers: Iterable[str] = ()) -> dict:
    """Add ``quantization_config`` to ``model_dir/config.json`` (must exist); returns the entry."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise ValueError(f"{model_dir}: no config.json to mark as FP8; pass base_model_dir to the weight sync "
                         "so every exported version is a complete HF model directory")
    cfg = json.loads(path.read_text())
    cfg["quantization_config"] = quantization_config(ignored_layers)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return cfg["quantization_config"]


# --------------------------------------------------------------------------- CPU worker side

_QUANT_CFG = {
    "quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": (4, 3), "axis": None}},
        {"quantizer_name": "*", "parent_class": "nn.Embedding", "enable": False},
        {"quantizer_name": "*lm_head*", "enable": False},
        {"quantizer_name": "*mlp.gate.*", "enable": False},
        {"quantizer_name": "*shared_expert_gate*", "enable": False},
        {"quantizer_name": "*router*", "enable": False},
    ],
    "algorithm": "max",
}


class FakeQuantFP8:
    """modelopt FP8 fake quantisation of a float model, and an FP8-checkpoint weight loader.

    ``convert(named)`` turns an incoming (name, tensor) stream into float tensors for the
    model's parameters: an fp8 ``.weight`` and its ``.weight_scale`` (either order, possibly
    in different calls -- distributed buckets) become ``weight.float() * scale`` and set the
    layer's quantizer ``amax = 448 * scale``; a float ``.weight`` of a quantised layer is
    quantised on load (its own amax), like SGLang's ``--quantization fp8``.
    """

    def __init__(self, model: torch.nn.Module, skip: Iterable[str] = DEFAULT_SKIP) -> None:
        import modelopt.torch.quantization as mtq
        self.skip = tuple(skip)
        # Calibrating weight quantizers needs no data: amax = max |W| (forward_loop=None).
        self.model = mtq.quantize(model, _QUANT_CFG, forward_loop=None)
        self.targets = {n for n, m in self.model.named_modules()
                        if getattr(getattr(m, "weight_quantizer", None), "is_enabled", False)
                        and _target_name(n + ".weight", self.skip)}
        if not self.targets:
            raise ValueError(f"{type(model).__name__}: no decoder-layer linear to quantise to FP8 was found")
        self._weights: dict[str, torch.Tensor] = {}
        self._scales: dict[str, torch.Tensor] = {}

    def _set_amax(self, module_name: str, amax: torch.Tensor) -> None:
        q = self.model.get_submodule(module_name).weight_quantizer
        q.amax = amax.detach().to(torch.float32).reshape(())

    def convert(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named:
            if name.endswith(SCALE_SUFFIX):
                mod = name[:-len(SCALE_SUFFIX)]
                if mod not in self.targets:
                    raise ValueError(f"{name}: FP8 scale for {mod!r}, which is not a quantised linear of this model")
                if mod in self._weights:
                    yield self._emit(mod, self._weights.pop(mod), t)
                else:
                    self._scales[mod] = t
            elif name.endswith(".weight") and t.dtype == FP8_DTYPE:
                mod = name[:-len(".weight")]
                if mod not in self.targets:
                    raise ValueError(f"{name}: FP8 weight for {mod!r}, which this model does not quantise")
                if mod in self._scales:
                    yield self._emit(mod, t, self._scales.pop(mod))
                else:
                    self._weights[mod] = t
            else:
                mod = name[:-len(".weight")] if name.endswith(".weight") else None
                if mod in self.targets:  # full-precision weight into an FP8 engine: quantise on load
                    self._set_amax(mod, t.detach().float().abs().amax().clamp(min=1e-12))
                yield name, t

    def _emit(self, mod: str, q: torch.Tensor, scale: torch.Tensor) -> tuple[str, torch.Tensor]:
        if scale.numel() != 1:
            raise ValueError(f"{mod}{SCALE_SUFFIX} has shape {tuple(scale.shape)}: only per-tensor FP8 scales "
                             "(one float32 per weight) are supported")
        scale = scale.reshape(()).float()
        self._set_amax(mod, scale * FP8_MAX)
        return mod + ".weight", dequantize_tensor(q, scale)

    def check_complete(self) -> None:
        """Raise when an FP8 weight arrived without its scale (or the reverse)."""
        if self._weights or self._scales:
            missing = [f"{m}{SCALE_SUFFIX}" for m in self._weights] + [f"{m}.weight" for m in self._scales]
            self._weights.clear()
            self._scales.clear()
            raise ValueError(f"incomplete FP8 checkpoint: missing {missing[:8]}")
