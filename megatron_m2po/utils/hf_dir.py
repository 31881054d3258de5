"""HF model directories: which one a config names, and the tensors of one.

``resolve_model_path`` is the one place that turns ``model.hf_path`` (or a command-line
override) into a directory, building the embedded tiny base model on first use of ``"tiny"``.
It never changes the config it reads; callers that need the resolved path in a config make a
copy (``dataclasses.replace``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

if TYPE_CHECKING:
    import torch

    from megatron_m2po.config import ModelConfig

__all__ = ["resolve_model_path", "iter_safetensors"]


def resolve_model_path(model: "ModelConfig", override: Optional[str] = None, *, progress: bool = False) -> str:
    """The HF model directory of ``override`` or ``model.hf_path``.

    ``"tiny"`` builds the tiny base model into ``model.tiny_cache_dir`` on first use (safe to
    call from several processes at once). Anything else must be a local directory holding a
    ``config.json``; otherwise ``ValueError`` names the path.
    """
    path = override or model.hf_path
    if path == "tiny":
        from megatron_m2po.utils.tiny_base import ensure_tiny_base

        return str(ensure_tiny_base(os.path.expanduser(model.tiny_cache_dir), progress=progress))
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise ValueError(f"model path {path!r} is not an HF model directory (no config.json); set "
                         "model.hf_path (or --model) to a local HF model directory, or 'tiny'")
    return str(p)


def iter_safetensors(path: str | os.PathLike) -> Iterator[tuple[str, "torch.Tensor"]]:
    """``(name, tensor)`` of every ``*.safetensors`` file in ``path``, files in name order."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {str(path)!r}")
    for f in files:
        yield from load_file(str(f)).items()
