"""The device a collective's tensors must live on.

NCCL groups take only CUDA tensors ("No backend type associated with device type cpu" otherwise);
gloo groups take CPU tensors. Code that builds a small tensor just to reduce a flag or a few
statistics asks here instead of assuming the CPU (which gloo accepts and NCCL refuses on the
first step; the CPU platform's collective audit, ``standins/collective_audit.py``, refuses it too).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["collective_device"]


def collective_device(group: Optional[Any] = None) -> torch.device:
    """The current CUDA device when ``group`` (None: the default group) is NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
