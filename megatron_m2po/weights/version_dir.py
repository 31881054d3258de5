"""A pushed weight version on disk: the complete HF model directory ``<sync_dir>/v<version>``.

Engines load it with ``/update_weights_from_disk``, a relaunched engine is refit from the latest
one, and external producers find it by its name and its ``m2po_version.json``
(:mod:`megatron_m2po.ingestion.producer`). It is written as a temporary directory (the stages' shards,
then :func:`fill_version_dir`), marked and renamed by :func:`seal_version_dir` once complete: a
rename is atomic on one filesystem, so no reader sees half a checkpoint. The FP8 base model
(:func:`megatron_m2po.weights.fp8.export_fp8_dir`) is written the same way.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

from megatron_m2po.utils.hf_dir import assemble_shards

__all__ = ["HF_FILES", "MARKER", "complete_version_dir", "fill_version_dir", "seal_version_dir"]

# What an engine needs besides the weights to load (or launch from) the directory.
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")
MARKER = "m2po_version.json"


def complete_version_dir(sync_dir: str | os.PathLike, version: int) -> Optional[str]:
    """``<sync_dir>/v<version>`` when it is complete (its marker names ``version``), else None."""
    final = Path(sync_dir) / f"v{version}"
    try:
        if json.loads((final / MARKER).read_text())["version"] == int(version):
            return str(final)
    except (OSError, ValueError, KeyError):
        pass
    return None


def fill_version_dir(tmp: Path, files: list, base_model_dir: Optional[str]) -> None:
    """Name the stages' shard ``files`` (in stage order) as HF does, write the index, and copy the
    base model's :data:`HF_FILES`. A ValueError when no tensor or one tensor twice was written."""
    assemble_shards(tmp, files)
    if base_model_dir:
        for f in HF_FILES:
            src = Path(base_model_dir) / f
            if src.exists():
                shutil.copy2(src, tmp / f)


def seal_version_dir(tmp: Path, final: Path, version: int) -> str:
    """Mark ``tmp`` as ``version`` (fsynced), then rename it to ``final`` (replacing an older one)."""
    with open(tmp / MARKER, "w") as fh:
        json.dump({"version": int(version)}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    return str(final)
