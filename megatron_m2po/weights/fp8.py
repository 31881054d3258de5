"""FP8 rollout weights: block-FP8 export for engines that serve FP8, and the CPU worker's FP8 linears.

Why block FP8 (SGLang 0.5.23 ``srt/layers/quantization/fp8.py``). ``Fp8LinearMethod.
process_weights_after_loading`` runs after every load: at start-up, after a disk update
(``DefaultModelLoader.load_weights_and_postprocess``) and when a distributed session ends
(``WeightUpdater.end_weight_update``). For per-tensor FP8 (no ``weight_block_size``), per-channel
and online ``--quantization fp8`` it replaces ``layer.weight`` and ``layer.weight_scale`` by new
``Parameter`` objects (transposed weight, requantised scales) that carry no ``weight_loader``, and
``restore_weights_before_loading`` does not undo it. The next update therefore fails: Qwen2's loader
reads ``param.weight_loader`` of the fused qkv / gate_up parameters (AttributeError), the other
linears hit a shape assertion (or, when square, load untransposed). A failed disk update "rolls
back" by reloading from the path it already switched to, fails again, and the scheduler dies. The
block path (``process_weights_after_loading_block_quant``) assigns ``.data`` and keeps its
parameters and their loaders ("Keep parameter object to preserve weight_loader attrs for hot
reload"), so updates load into it again and again. The export is therefore block FP8:

- ``<module>.weight``            ``float8_e4m3fn [out, in]``: ``round_e4m3(W / s)``, ``s`` the scale
  of the element's block (torch's round-to-nearest-even cast; saturating at 448)
- ``<module>.weight_scale_inv``  ``float32 [ceil(out / bn), ceil(in / bk)]``: ``amax(|W| over the
  block) / 448``; despite SGLang's name it multiplies: ``W ~= weight * weight_scale_inv`` expanded
  over each block (``fp8_utils.block_quant_dequant``)

and config.json carries ``"quantization_config": {"quant_method": "fp8", "activation_scheme":
"dynamic", "weight_block_size": [bn, bk], "ignored_layers": [...]}`` (``Fp8Config``: block
quantisation needs an FP8-serialised checkpoint and dynamic activations; ``[128, 128]`` is the
DeepSeek-V3 / Qwen3-FP8 layout, ``rollout.fp8_block_size``). SGLang refuses at start-up a fused
(qkv, gate_up) or tensor-parallel linear whose partition sizes are not multiples of the block
(``Fp8LinearMethod.validate_block_quant_shapes``), so the export requires both sizes of every
quantised linear to be multiples. Embeddings, ``lm_head``, norms, biases and router gates stay in
the trainer's dtype; skipped linears are listed in ``ignored_layers``.

Engines start from a block-FP8 export of the base model (:func:`export_fp8_dir`), not from
the float model with ``--quantization fp8``: SGLang quantises a float checkpoint online per channel
or per tensor, which replaces the parameters as above.

CPU worker (:class:`FP8Linears`): the quantised linears compute with the dequantised weights in
float32 (W8A16, SGLang's weight-only Marlin FP8 path; on FP8 GPUs SGLang also quantises activations
dynamically, which adds to the mismatch below), and follow 0.5.23's rules per format: block FP8 is
reloadable; per-tensor FP8 (a per-tensor checkpoint, or a float one served with ``--quantization
fp8``, quantised per tensor on load through nvidia-modelopt) loads once and refuses every later
update of a quantised linear as SGLang does.

Training with FP8 rollouts (docs/design.md §3). The engine's log-probs then come from the quantised
model, the trainer's from full precision: set ``rollout.fp8_weights=true`` together with
``algo.recompute_behav_logprobs=true`` (the trainer recomputes behaviour log-probs in full
precision at generation time and logs ``mismatch/train_vs_engine_kl``) and ``algo.tis=true``
(the loss is weighted by ``min(p_train_behav / p_engine_behav, algo.tis_cap)``, paper eq. 6).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import torch

from megatron_m2po.utils.hf_dir import iter_safetensors, write_stage_shards
from megatron_m2po.weights.errors import WeightSyncError
from megatron_m2po.weights.version_dir import fill_version_dir, seal_version_dir

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = ".weight_scale"          # per-tensor checkpoints (read by the CPU worker)
BLOCK_SCALE_SUFFIX = ".weight_scale_inv"  # block checkpoints (what the export writes)
# Linears of the decoder blocks that stay unquantised (MoE routers, as modelopt and SGLang do).
DEFAULT_SKIP = (r"\.mlp\.gate\.weight$", r"shared_expert_gate\.weight$", r"\.router\.")
_IN_LAYERS = re.compile(r"(^|\.)layers\.\d+\.")
# Fused in SGLang's Qwen2 / Llama (stacked_params_mapping): their partitions must be block multiples.
_FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def check_block(block: Sequence[int]) -> tuple[int, int]:
    """``weight_block_size`` as ``(bn, bk)``; a ValueError naming the field otherwise."""
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"rollout.fp8_block_size={block!r}: give two positive ints [block_n, block_k] "
                         "(SGLang's weight_block_size; [128, 128] is the usual layout)")
    return int(block[0]), int(block[1])


def quantization_config(block: Sequence[int] = DEFAULT_BLOCK, ignored_layers: Iterable[str] = ()) -> dict:
    """The ``quantization_config`` entry of config.json for block FP8 with dynamic activations."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(check_block(block)),
            "ignored_layers": sorted({"lm_head", *ignored_layers})}


def _quant_dict(config: dict | object) -> Optional[dict]:
    qc = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    return qc or None


def is_fp8_config(config: dict | object) -> bool:
    """True when an HF config (dict or PretrainedConfig) declares an FP8 checkpoint."""
    qc = _quant_dict(config)
    return bool(qc) and "fp8" in str(qc.get("quant_method", ""))


def fp8_block_of(config: dict | object) -> Optional[tuple[int, int]]:
    """The ``weight_block_size`` of an FP8 config; None for per-tensor FP8 (or no FP8)."""
    qc = _quant_dict(config)
    if not is_fp8_config(config) or qc.get("weight_block_size") is None:
        return None
    return check_block(qc["weight_block_size"])


def _target_name(name: str, skip: Iterable[str] = DEFAULT_SKIP) -> bool:
    return name.endswith(".weight") and bool(_IN_LAYERS.search(name)) and not any(re.search(p, name) for p in skip)


def is_quant_target(name: str, tensor: torch.Tensor, skip: Iterable[str] = DEFAULT_SKIP) -> bool:
    """A 2-D ``.weight`` of a linear inside the decoder blocks (not embeddings / lm_head / norms)."""
    return tensor.dim() == 2 and _target_name(name, skip)


def check_block_shape(name: str, shape: Sequence[int], block: Sequence[int]) -> None:
    """Both sizes of a quantised linear must be multiples of the block (SGLang refuses fused and
    tensor-parallel partitions that are not, ``Fp8LinearMethod.validate_block_quant_shapes``)."""
    bn, bk = check_block(block)
    out, inp = int(shape[0]), int(shape[1])
    if out % bn or inp % bk:
        raise ValueError(f"{name} has shape [{out}, {inp}], not a multiple of the FP8 block [{bn}, {bk}]: SGLang "
                         "0.5.23 refuses such block-FP8 linears (fp8.py validate_block_quant_shapes); set "
                         "rollout.fp8_block_size to a block that divides every linear of the model (e.g. "
                         f"[{_gcd_pow2(out)}, {_gcd_pow2(inp)}] for this one)")


def _gcd_pow2(n: int) -> int:
    return n & -n  # the largest power of two dividing n


def quantize_block(w: torch.Tensor, block: Sequence[int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block e4m3 quantisation: (fp8 weight [out, in], float32 ``weight_scale_inv`` [ceil(out/bn),
    ceil(in/bk)]) with ``scale = amax(|block|) / 448`` (an all-zero block gets a tiny scale)."""
    bn, bk = check_block(block)
    w = w.detach().float()
    out, inp = w.shape
    nb, kb = -(-out // bn), -(-inp // bk)
    padded = w.new_zeros(nb * bn, kb * bk)
    padded[:out, :inp] = w
    blocks = padded.view(nb, bn, kb, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12 / FP8_MAX).to(torch.float32)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * bn, kb * bk)[:out, :inp].contiguous(), scale.contiguous()


def dequantize_block(q: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int] = DEFAULT_BLOCK,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp8_utils.block_quant_dequant``: each element times its block's ``weight_scale_inv``."""
    bn, bk = check_block(block)
    out, inp = q.shape
    s = scale_inv.to(torch.float32).repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:out, :inp]
    return (q.to(torch.float32) * s).to(dtype)


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor e4m3 quantisation through modelopt: (fp8 weight, float32 scalar scale). Only the
    CPU worker's per-tensor emulation uses it (a per-tensor checkpoint or ``--quantization fp8``)."""
    from modelopt.torch.quantization.tensor_quant import scaled_e4m3
    w = w.detach().float()
    amax = w.abs().amax().clamp(min=1e-12)
    scale = (amax / FP8_MAX).to(torch.float32)
    fq = scaled_e4m3(w, amax, None, 4, 3)  # values on the e4m3 grid of this amax
    return (fq / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.reshape(())


def dequantize_tensor(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype)


def quantize_named(weights: Iterable[tuple[str, torch.Tensor]], *, block: Sequence[int] = DEFAULT_BLOCK,
                   skip: Iterable[str] = DEFAULT_SKIP,
                   skipped: Optional[list[str]] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) stream -> the block-FP8 checkpoint's stream: each target ``.weight``
    becomes its fp8 tensor followed by ``.weight_scale_inv``; everything else passes unchanged.
    Names of skipped decoder linears (for ``ignored_layers``) are appended to ``skipped``."""
    skip, block = tuple(skip), check_block(block)
    for name, t in weights:
        if is_quant_target(name, t, skip):
            check_block_shape(name, t.shape, block)
            q, s = quantize_block(t, block)
            yield name, q
            yield name[:-len(".weight")] + BLOCK_SCALE_SUFFIX, s
        else:
            if skipped is not None and name.endswith(".weight") and t.dim() == 2 and _IN_LAYERS.search(name):
                skipped.append(name[:-len(".weight")])
            yield name, t


def write_fp8_config(model_dir: str | Path, block: Sequence[int] = DEFAULT_BLOCK,
                     ignored_layers: Iterable[str] = ()) -> dict:
    """Add ``quantization_config`` to ``model_dir/config.json`` (must exist); returns the entry."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise ValueError(f"{model_dir}: no config.json to mark as FP8; pass base_model_dir to the weight sync "
                         "so every exported version is a complete HF model directory")
    cfg = json.loads(path.read_text())
    cfg["quantization_config"] = quantization_config(block, ignored_layers)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return cfg["quantization_config"]


def export_fp8_dir(src_dir: str | Path, dst_dir: str | Path, block: tuple[int, int] = DEFAULT_BLOCK,
                   shard_mb: float = 4096.0) -> str:
    """Write a block-FP8 copy of an HF model directory (the base model FP8 engines start from).

    The same stream and layout as a disk push with ``fp8=True`` (:func:`quantize_named`, shards of
    at most ``shard_mb``, :mod:`~megatron_m2po.weights.version_dir` at version 0), written next to
    ``dst_dir`` and renamed to it once complete. A linear the block does not divide fails it with a
    :class:`~megatron_m2po.weights.errors.WeightSyncError` naming ``rollout.fp8_block_size``, as
    such a push fails."""
    block = check_block(block)
    dst = Path(dst_dir)
    if dst.exists():
        raise ValueError(f"export_fp8_dir: {dst} already exists")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".fp8-export-", dir=dst.parent))
    try:
        skipped: list[str] = []
        stream = quantize_named(iter_safetensors(str(src_dir)), block=block, skipped=skipped)
        try:
            files = write_stage_shards(stream, tmp, 0, int(shard_mb * 2**20))
            fill_version_dir(tmp, files, str(src_dir))
        except ValueError as e:
            raise WeightSyncError(f"exporting {src_dir} as block FP8 failed: {e}") from None
        write_fp8_config(tmp, block, skipped)
        seal_version_dir(tmp, dst, 0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dst)


# --------------------------------------------------------------------------- CPU worker side

class FP8Linears:
    """The CPU worker's FP8 linears, by SGLang 0.5.23's rules for the format.

    ``block`` = ``(bn, bk)``: a block-FP8 engine. ``convert(named)`` turns an fp8 ``.weight`` and its
    ``.weight_scale_inv`` (either order, possibly in different calls: distributed buckets) into
    the dequantised float weight; any number of updates. At construction the fused partitions
    (q/k/v, gate/up) are checked against ``bn`` as ``validate_block_quant_shapes`` does (one
    tensor-parallel rank). A float ``.weight`` of a quantised linear is refused (SGLang's loader
    would cast it into the fp8 parameter with the old scales).

    ``block=None``: per-tensor FP8 (``.weight`` + scalar ``.weight_scale``, or float weights
    quantised per tensor on load, as ``--quantization fp8`` does). :meth:`after_loading` is
    ``process_weights_after_loading``: from then on every tensor of a quantised linear fails the
    update, like SGLang whose parameters were replaced without ``weight_loader``.
    """

    def __init__(self, model: torch.nn.Module, block: Optional[Sequence[int]] = None,
                 skip: Iterable[str] = DEFAULT_SKIP) -> None:
        self.skip = tuple(skip)
        self.block = check_block(block) if block is not None else None
        self.targets = {n for n, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear) and _target_name(n + ".weight", self.skip)}
        if not self.targets:
            raise ValueError(f"{type(model).__name__}: no decoder-layer linear to quantise to FP8 was found")
        if self.block is not None:
            sizes = {n: tuple(model.get_submodule(n).weight.shape) for n in self.targets}
            for n, shape in sorted(sizes.items()):
                fused = any(n.endswith("." + part) for group in _FUSED for part in group)
                if fused and shape[0] % self.block[0]:
                    raise ValueError(
                        f"block FP8 [{self.block[0]}, {self.block[1]}]: {n} has {shape[0]} outputs, not a multiple of "
                        f"block_n={self.block[0]}; SGLang 0.5.23 refuses to load it (fp8.py validate_block_quant_shapes: "
                        "fused qkv / gate_up partitions). Export with a smaller rollout.fp8_block_size")
        self.processed = False  # per-tensor: parameters replaced after the first load
        self._weights: dict[str, torch.Tensor] = {}
        self._scales: dict[str, torch.Tensor] = {}

    @property
    def scale_suffix(self) -> str:
        return SCALE_SUFFIX if self.block is None else BLOCK_SCALE_SUFFIX

    def _module_of(self, name: str) -> Optional[str]:
        for suffix in (".weight", SCALE_SUFFIX, BLOCK_SCALE_SUFFIX):
            if name.endswith(suffix) and name[:-len(suffix)] in self.targets:
                return name[:-len(suffix)]
        return None

    def convert(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named:
            mod = self._module_of(name)
            if mod is None:
                if name.endswith((SCALE_SUFFIX, BLOCK_SCALE_SUFFIX)):
                    raise ValueError(f"{name}: an FP8 scale for a module this model does not quantise")
                yield name, t
                continue
            if self.processed:
                # qwen2.py load_weights: ``weight_loader = param.weight_loader`` on a Parameter that
                # process_weights_after_loading created (per-tensor FP8) -> AttributeError.
                raise ValueError(
                    f"{name}: 'Parameter' object has no attribute 'weight_loader' (SGLang 0.5.23 per-tensor FP8: "
                    "Fp8LinearMethod.process_weights_after_loading replaced weight / weight_scale after the first "
                    "load, so weights cannot be updated; serve block FP8 (weight_block_size), which the weight "
                    "sync exports)")
            if name.endswith(self.scale_suffix):
                if mod in self._weights:
                    yield self._emit(mod, self._weights.pop(mod), t)
                else:
                    self._scales[mod] = t
            elif name.endswith((SCALE_SUFFIX, BLOCK_SCALE_SUFFIX)):
                kind = "block" if self.block is not None else "per-tensor"
                raise ValueError(f"{name}: this engine serves {kind} FP8 and takes {mod}{self.scale_suffix}")
            elif t.dtype == FP8_DTYPE:
                if mod in self._scales:
                    yield self._emit(mod, t, self._scales.pop(mod))
                else:
                    self._weights[mod] = t
            elif self.block is not None:
                raise ValueError(f"{name}: a {t.dtype} weight for a block-FP8 linear; SGLang's loader would cast it "
                                 "into the fp8 parameter with the old scales. Push FP8 weights "
                                 "(rollout.fp8_weights=true)")
            else:  # per-tensor engine, first load of a float checkpoint: quantise on load
                q, s = quantize_tensor(t)
                yield name, dequantize_tensor(q, s)

    def _emit(self, mod: str, q: torch.Tensor, scale: torch.Tensor) -> tuple[str, torch.Tensor]:
        if self.block is None:
            if scale.numel() != 1:
                raise ValueError(f"{mod}{SCALE_SUFFIX} has shape {tuple(scale.shape)}: a per-tensor FP8 checkpoint "
                                 "has one float32 scale per weight")
            return mod + ".weight", dequantize_tensor(q, scale.reshape(()))
        bn, bk = self.block
        want = (-(-q.shape[0] // bn), -(-q.shape[1] // bk))
        if tuple(scale.shape) != want:
            raise ValueError(f"{mod}{BLOCK_SCALE_SUFFIX} has shape {tuple(scale.shape)}, expected {want} for a "
                             f"{tuple(q.shape)} weight in [{bn}, {bk}] blocks")
        return mod + ".weight", dequantize_block(q, scale, self.block)

    def quantize_model(self, model: torch.nn.Module) -> None:
        """Online FP8 of a float model (``--quantization fp8``): per tensor, then processed."""
        with torch.no_grad():
            for n in self.targets:
                w = model.get_submodule(n).weight
                q, s = quantize_tensor(w)
                w.copy_(dequantize_tensor(q, s))
        self.after_loading()

    def after_loading(self) -> None:
        """``process_weights_after_loading`` after a complete load: raise when an FP8 weight came
        without its scale (or the reverse); per-tensor parameters are replaced from now on."""
        if self._weights or self._scales:
            missing = [f"{m}{self.scale_suffix}" for m in self._weights] + [f"{m}.weight" for m in self._scales]
            self._weights.clear()
            self._scales.clear()
            raise ValueError(f"incomplete FP8 checkpoint: missing {missing[:8]}")
        if self.block is None:
            self.processed = True
