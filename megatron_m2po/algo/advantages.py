"""GRPO advantages: group-normalised outcome rewards (docs/design.md §3, "Advantages").

``A_i = (R_i - mean_g) / (std_g + eps)`` over the samples of one prompt (group ``g``), with the
sample standard deviation (``ddof=1``, as ``torch.std`` in the released M2PO/verl code).
``normalize_std=False`` gives the mean-only variant (Dr. GRPO, arXiv 2503.20783):
``A_i = R_i - mean_g``.

Deliberate differences from the released code: a group of size 1 gives advantage 0 (the
released code returns the raw reward, which is not a baseline-corrected signal), and a group
whose rewards are all equal gives exactly 0 (not a rounding residue divided by eps).
Computed in float64; groups may have any sizes and appear in any order.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import torch

ArrayLike = Union[torch.Tensor, np.ndarray, Sequence[float]]


def grpo_advantages(rewards: ArrayLike, group_ids: Union[ArrayLike, Sequence], *, eps: float = 1e-6,
                    normalize_std: bool = True) -> Union[torch.Tensor, np.ndarray]:
    """Per-sample advantages. ``group_ids``: any hashable id per sample (ints, prompt uids ...).

    Returns a tensor of ``rewards``' float dtype if ``rewards`` is a tensor, else a float32
    numpy array. Non-finite rewards raise ValueError.
    """
    is_tensor = isinstance(rewards, torch.Tensor)
    r = rewards.detach().cpu().double().numpy() if is_tensor else np.asarray(rewards, dtype=np.float64)
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.cpu().numpy()
    gid = np.asarray(group_ids)
    if r.ndim != 1 or gid.shape != r.shape:
        raise ValueError(f"grpo_advantages: rewards and group_ids must be 1-D of equal length, got "
                         f"{r.shape} and {gid.shape}")
    if not np.isfinite(r).all():
        bad = np.flatnonzero(~np.isfinite(r))
        raise ValueError(f"grpo_advantages: {bad.size} non-finite rewards at indices {bad[:10].tolist()}")
    if eps <= 0:
        raise ValueError(f"grpo_advantages: eps={eps} must be > 0")
    if r.size == 0:
        out = np.zeros(0)
    else:
        _, inv = np.unique(gid, return_inverse=True)
        inv = inv.reshape(-1)
        size = np.bincount(inv).astype(np.float64)
        mean = np.bincount(inv, weights=r) / size
        centred = r - mean[inv]
        out = centred
        if normalize_std:
            var = np.bincount(inv, weights=centred**2) / np.maximum(size - 1, 1)
            out = centred / (np.sqrt(var)[inv] + eps)
        # Exact zeros for groups without signal: size 1, or all rewards equal.
        gmax = np.full(size.shape, -np.inf)
        gmin = np.full(size.shape, np.inf)
        np.maximum.at(gmax, inv, r)
        np.minimum.at(gmin, inv, r)
        flat = (size[inv] < 2) | (gmax[inv] == gmin[inv])
        out = np.where(flat, 0.0, out)
    if is_tensor:
        dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
        return torch.as_tensor(out, dtype=dtype, device=rewards.device)
    return out.astype(np.float32)
