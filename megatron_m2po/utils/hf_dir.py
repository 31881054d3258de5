"""HF model directories: which one a config names, and the tensors of one.

``resolve_model_path`` is the one place that turns ``model.hf_path`` (or a command-line
override) into a directory, building the embedded tiny base model on first use of ``"tiny"``.
It never changes the config it reads; callers that need the resolved path in a config make a
copy (``dataclasses.replace``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Optional

from megatron_m2po.utils.errors import UserError

if TYPE_CHECKING:
    import torch

    from megatron_m2po.actor.settings import ModelConfig

__all__ = ["resolve_model_path", "iter_safetensors", "write_stage_shards", "assemble_shards"]


def resolve_model_path(model: "ModelConfig", override: Optional[str] = None, *, progress: bool = False) -> str:
    """The HF model directory of ``override`` or ``model.hf_path``.

    ``"tiny"`` builds the tiny base model of ``model.tiny_family`` into ``model.tiny_cache_dir`` on first use (safe to
    call from several processes at once); ``"tiny-teacher"`` the same base trained further (its warm-up run on to a
    higher accuracy: a better model with the same tokenizer, the tiny task's distillation teacher). Anything else must be a local directory holding a
    ``config.json``; otherwise :class:`~megatron_m2po.utils.errors.UserError` (a ``ValueError``) names the path.
    """
    path = override or model.hf_path
    if path in ("tiny", "tiny-teacher"):
        from megatron_m2po.utils.standin import load_standin

        tiny_base = load_standin("tiny_base")
        spec = tiny_base.TinyBaseSpec(model=tiny_base.TinyModelSpec(family=model.tiny_family))
        if path == "tiny-teacher":  # the same base trained further (a distillation teacher, algo.distill)
            spec = tiny_base.teacher_spec(spec)
        return str(tiny_base.ensure_tiny_base(os.path.expanduser(model.tiny_cache_dir), spec=spec, progress=progress))
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        what = "does not exist" if not p.exists() else "is not an HF model directory (no config.json)"
        raise UserError(f"model path {path!r} {what}; set model.hf_path (or --model) to a local HF model "
                        "directory, or 'tiny' ('tiny-teacher' for a distillation teacher)")
    return str(p)


def _tokenizer_view(path: str) -> tuple[dict, dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return tok.get_vocab(), {k: str(v) for k, v in tok.special_tokens_map.items()}


def check_same_tokenizer(student: str, teacher: str) -> None:
    """UserError (one line) unless the two model directories' tokenizers map the same tokens to the
    same ids with the same special tokens."""
    (sv, ss), (tv, ts) = _tokenizer_view(student), _tokenizer_view(teacher)
    if sv == tv and ss == ts:
        return
    if sv != tv:
        diff = sorted(set(sv.items()) ^ set(tv.items()), key=str)[:3]
        why = f"vocabularies differ ({len(sv)} vs {len(tv)} tokens; e.g. {diff})"
    else:
        why = f"special tokens differ ({ss} vs {ts})"
    raise UserError(f"algo.distill.teacher={teacher}: its tokenizer is not the student's ({student}): {why}; the "
                    "teacher must score the student's own tokens, so use a teacher of the same tokenizer")


def iter_safetensors(path: str | os.PathLike) -> Iterator[tuple[str, "torch.Tensor"]]:
    """``(name, tensor)`` of every ``*.safetensors`` file in ``path``, files in name order."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {str(path)!r}")
    for f in files:
        yield from load_file(str(f)).items()


def write_stage_shards(tensors: Iterable[tuple[str, "torch.Tensor"]], out_dir: str | os.PathLike, stage: int,
                       shard_bytes: int) -> list[tuple[str, list[str], int]]:
    """Write one pipeline stage's tensors as ``stage<stage>-<j>.safetensors`` files of at most
    ``shard_bytes`` (one tensor larger than that gets a file of its own), holding one shard in host
    memory at a time; returns ``[(file name, tensor names, bytes)]`` for :func:`assemble_shards`."""
    from safetensors.torch import save_file

    files: list[tuple[str, list[str], int]] = []
    shard: dict = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        fname = f"stage{stage:05d}-{len(files):05d}.safetensors"
        save_file(shard, str(Path(out_dir) / fname), metadata={"format": "pt"})
        files.append((fname, list(shard), size))
        shard, size = {}, 0

    for name, t in tensors:
        t = t.detach().to("cpu").contiguous()
        nb = t.numel() * t.element_size()
        if shard and size + nb > shard_bytes:
            flush()
        shard[name] = t
        size += nb
    if shard:
        flush()
    return files


def assemble_shards(out_dir: str | os.PathLike, files: list[tuple[str, list[str], int]], *,
                    always_index: bool = False) -> int:
    """Rename the stages' files (in stage order) to HF's ``model-0000k-of-0000n.safetensors`` and
    write ``model.safetensors.index.json``; a single file becomes ``model.safetensors`` (with an
    index only when ``always_index``). Returns the total bytes. A tensor written twice is an error."""
    import json

    if not files:
        raise ValueError(f"{out_dir}: no tensors were written")
    out = Path(out_dir)
    index: dict[str, str] = {}
    total = 0
    for i, (fname, names, size) in enumerate(files):
        new = "model.safetensors" if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.rename(out / fname, out / new)
        for n in names:
            if n in index:
                raise ValueError(f"{out_dir}: tensor {n} was written by two stages")
            index[n] = new
        total += size
    if len(files) > 1 or always_index:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(index.items()))}, indent=1))
    return total
