"""How long the engines may take to load a disk weight push: it follows the model's bytes.

A disk push writes the weights once (every pipeline stage its own shards) and then every engine
loads the whole checkpoint: SGLang 0.5.23's ``update_weights_from_disk``
(``model_executor/model_runner_components/weight_updater.py``) iterates
``DefaultModelLoader._get_weights_iterator`` over every shard on every TP rank (the ranks of one
node share the page cache, so a node reads the checkpoint once; PP stages load one after another).
A 32B bf16 model is 64 GB: at a shared filesystem's few hundred MB/s that is minutes, so a fixed
``rollout.weight_sync_timeout_s`` (300 s) fails a healthy push of a large model. The engines' load
therefore gets::

    timeout = rollout.weight_sync_timeout_s + bytes / (rollout.weight_sync_min_gbps * 1e9)

the configured timeout covering what does not scale with the bytes (the pause, the post-load
processing, the cache flush, as before), the read at the floor added: 300 + 320 = 620 s for 64 GB.
``weight_sync_min_gbps`` is the slowest read a node is allowed (0.2 GB/s by default: a 10 GbE NFS
share split among a few nodes, or one spinning disk). A small model's push keeps the configured
timeout (a tiny model adds milliseconds). A dead engine still fails fast: its HTTP call breaks at
once, only a hung one waits the whole timeout. ``tools/gpu_check.py --only
disk_push`` measures a node's write and read bandwidth against this floor (docs/design.md, "GPU last").
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["disk_push_timeout_s", "checkpoint_bytes"]


def disk_push_timeout_s(nbytes: float, configured_s: float, min_gbps: float) -> float:
    """Seconds the engines get to load ``nbytes`` of weights from disk: ``configured_s`` plus the
    read at ``min_gbps`` GB/s (module docstring)."""
    if min_gbps <= 0:
        raise ValueError(f"rollout.weight_sync_min_gbps={min_gbps}: must be > 0 (GB/s)")
    return float(configured_s) + nbytes / (min_gbps * 1e9)


def checkpoint_bytes(path: str | os.PathLike) -> int:
    """Bytes of the ``*.safetensors`` files of an HF model directory (0 when it has none)."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
