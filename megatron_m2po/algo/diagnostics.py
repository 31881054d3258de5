"""Drift diagnostics every update logs, whatever the loss (docs/measurements/drift_ladder).

* ``policy/abs_logratio_p999``: the 99.9th percentile of ``|log r|`` (behaviour vs current, the
  clamped log-ratio the loss sees) over the update's loss tokens on every rank. Exact percentiles
  would need every token on one rank; the update keeps a histogram instead, summed over
  micro-batches and ranks like any other metric: 240 bins with log-spaced upper edges from 1e-6 to
  50 (each 7.7 % wider than the last), and the percentile is the upper edge of the bin where the
  cumulative count first reaches 99.9 % (so it is within 7.7 % above the exact value; 0 when it
  lies below 1e-6, and the last edge when above).
* ``policy/seq_ess_ratio``: the sequence-level effective sample size ratio
  ``ESS / n = (sum w)^2 / (n sum w^2)`` with ``w = exp(sum of log r over the sequence's loss
  tokens)`` -- 1 when every sequence weighs the same, 1/n when one sequence carries all the
  weight. Under context parallelism a sequence's tokens are split over the CP ranks; their parts
  are summed over the CP group first (as GSPO does). Log-weights are capped at 700 (float64's
  range).

:func:`drift_metrics` returns the per-micro-batch records (private ``_drift/*`` names that
a ``"hist"`` and two means); :func:`finish_drift_metrics` turns the reduced values into the two
public metrics and removes the private ones.
"""

from __future__ import annotations

import math

import torch

from megatron_m2po.algo.metrics import Metric
from megatron_m2po.algo.sequences import sequence_sums

__all__ = ["EDGES", "drift_metrics", "finish_drift_metrics"]

_PREFIX = "_drift/"
N_BINS = 240
EDGES = torch.logspace(-6.0, math.log10(50.0), N_BINS, dtype=torch.float64)  # upper edges of bins 0 .. 239
_W_MEAN, _W2_MEAN = _PREFIX + "seq_w", _PREFIX + "seq_w2"
_LOG_W_CAP = 700.0


_HIST = _PREFIX + "abs_logratio_hist"


def drift_metrics(delta: torch.Tensor, mask: torch.Tensor, seq_index=None, seq_group=None,
                  num_seqs=None) -> dict[str, Metric]:
    """The records of one micro-batch: the ``|log r|`` histogram and the sequence weights' moments."""
    d = delta.detach().to(torch.float64)
    m = mask.to(torch.bool)
    # bin i holds EDGES[i-1] < |d| <= EDGES[i]; values above the last edge go to the last bin
    idx = torch.bucketize(d[m].abs(), EDGES.to(d.device)).clamp(max=N_BINS - 1)
    out = {_HIST: Metric(torch.bincount(idx, minlength=N_BINS).to(torch.float64), "hist")}
    if seq_index is None:
        out[_W_MEAN] = Metric(0.0, "mean", 0.0)
        out[_W2_MEAN] = Metric(0.0, "mean", 0.0)
        return out
    sums, tokens, _ = sequence_sums(d, m, seq_index, seq_group, num_seqs)  # CP parts summed over seq_group
    w = torch.exp(sums[tokens > 0].clamp(max=_LOG_W_CAP))
    n = float(w.numel())
    out[_W_MEAN] = Metric(w.mean() if n else 0.0, "mean", n)
    out[_W2_MEAN] = Metric((w * w).mean() if n else 0.0, "mean", n)
    return out


def finish_drift_metrics(out: dict[str, float]) -> dict[str, float]:
    """Replace the reduced ``_drift/*`` values in ``out`` by the two public metrics (in place)."""
    counts = out.pop(_HIST, None) or []
    w, w2 = out.pop(_W_MEAN, None), out.pop(_W2_MEAN, None)
    total = sum(counts)
    if total > 0:
        target, acc = 0.999 * total, 0.0
        for i, c in enumerate(counts):
            acc += c
            if acc >= target:
                out["policy/abs_logratio_p999"] = 0.0 if i == 0 else float(EDGES[i])
                break
    if w is not None and w2:
        out["policy/seq_ess_ratio"] = w * w / w2
    return out
