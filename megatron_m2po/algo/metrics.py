"""Metric records that declare how they reduce across micro-batches and ranks.

A loss or a mask returns ``{name: Metric(value, reduce, weight)}``. ``merge_metrics`` combines
records of several micro-batches on one rank; ``reduce_metrics`` combines them over a process
group with one all-reduce per reduction kind present (SUM for "mean" and "sum" together; MAX
for "max" and "min", as max(-x) = -min(x)) plus one 2-element name check -- never one collective
per metric.

Reductions:

* ``"mean"``: weighted mean ``sum(value * weight) / sum(weight)`` (weight = number of tokens the
  value averages over, so micro-batches and ranks of different sizes combine exactly). A total
  weight of 0 gives 0.0.
* ``"sum"``: sum. ``"max"`` / ``"min"``: extremes (weight ignored).
* ``"hist"``: a 1-D tensor of counts (a histogram), summed element-wise; reduced to a list of
  floats (it travels in the SUM all-reduce). Every rank's histogram has the same length.

Every rank of the group must report the same metric names (checked: a mismatch raises
ValueError on every rank instead of deadlocking or mixing numbers up).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Iterable, Mapping, Union

import torch
import torch.distributed as dist

from megatron_m2po.parallel.devices import collective_device

REDUCTIONS = ("mean", "sum", "max", "min", "hist")


@dataclass(frozen=True)
class Metric:
    """One metric value with its cross-rank reduction. ``value`` may be a float or a 0-d tensor
    (kept as a tensor so that losses don't force a device sync per metric)."""

    value: Union[float, torch.Tensor]
    reduce: str = "mean"
    weight: Union[float, torch.Tensor] = 1.0

    def __post_init__(self):
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"Metric: reduce={self.reduce!r}; use one of {REDUCTIONS}")


def _f(x) -> float:
    return float(x.detach().item()) if isinstance(x, torch.Tensor) else float(x)


MetricDict = Mapping[str, Metric]


def merge_metrics(dicts: Iterable[MetricDict]) -> dict[str, Metric]:
    """Combine per-micro-batch records on one rank (names may differ between dicts)."""
    out: dict[str, Metric] = {}
    for d in dicts:
        for name, m in d.items():
            prev = out.get(name)
            if prev is None:
                if m.reduce == "hist":
                    out[name] = Metric(m.value.detach().to(torch.float64).clone(), "hist")
                else:
                    out[name] = Metric(_f(m.value), m.reduce, _f(m.weight))
                continue
            if prev.reduce != m.reduce:
                raise ValueError(f"merge_metrics: {name!r} declared as {prev.reduce!r} and {m.reduce!r}")
            if m.reduce == "hist":  # element-wise, on the values' device (no sync per micro-batch)
                out[name] = Metric(prev.value + m.value.detach().to(prev.value), "hist")
                continue
            v, w = _f(m.value), _f(m.weight)
            if m.reduce == "mean":
                tw = prev.weight + w
                val = (prev.value * prev.weight + v * w) / tw if tw else 0.0
                out[name] = Metric(val, "mean", tw)
            elif m.reduce == "sum":
                out[name] = Metric(prev.value + v, "sum")
            elif m.reduce == "max":
                out[name] = Metric(max(prev.value, v), "max")
            else:
                out[name] = Metric(min(prev.value, v), "min")
    return out


def reduce_metrics(metrics: Union[MetricDict, Iterable[MetricDict]], group=None) -> dict[str, float]:
    """Reduce metric records over ``group`` (None = this process only); returns plain floats.

    ``metrics`` is one dict or an iterable of dicts (merged first, see ``merge_metrics``).
    Collectives: a 2-element MAX all-reduce checking that every rank has the same names, one SUM
    all-reduce (means and sums) and one MAX all-reduce (maxima and negated minima), each only
    when such metrics exist.
    """
    if not isinstance(metrics, Mapping):
        metrics = merge_metrics(metrics)
    names = sorted(metrics)
    sum_names = [n for n in names if metrics[n].reduce in ("mean", "sum")]
    hist_names = [n for n in names if metrics[n].reduce == "hist"]
    hist_len = [int(metrics[n].value.numel()) for n in hist_names]
    max_names = [n for n in names if metrics[n].reduce == "max"]
    min_names = [n for n in names if metrics[n].reduce == "min"]
    checksum = float(zlib.crc32("\n".join(f"{n}:{metrics[n].reduce}" + (f":{metrics[n].value.numel()}" if
                                                                         metrics[n].reduce == "hist" else "")
                                          for n in names).encode()))

    sums = []
    for n in sum_names:
        m = metrics[n]
        if m.reduce == "mean":
            w = _f(m.weight)
            sums += [_f(m.value) * w, w]
        else:
            sums += [_f(m.value), 0.0]
    for n in hist_names:
        sums += metrics[n].value.detach().to(torch.float64).cpu().tolist()
    sum_t = torch.tensor(sums, dtype=torch.float64)
    # MIN is folded into the MAX all-reduce as max(-x) = -min(x).
    ext_t = torch.tensor([_f(metrics[n].value) for n in max_names] + [-_f(metrics[n].value) for n in min_names],
                         dtype=torch.float64)
    if group is not None:
        device = collective_device(group)
        check = torch.tensor([checksum, -checksum], dtype=torch.float64, device=device)
        dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
        if float(check[0]) != checksum or float(check[1]) != -checksum:
            raise ValueError(f"reduce_metrics: ranks report different metric names; this rank has {names}. "
                             "Every rank must produce the same metrics (use weight 0 for absent means).")
        if sum_names or hist_names:
            sum_t = sum_t.to(device)
            dist.all_reduce(sum_t, op=dist.ReduceOp.SUM, group=group)
        if max_names or min_names:
            ext_t = ext_t.to(device)
            dist.all_reduce(ext_t, op=dist.ReduceOp.MAX, group=group)
    out: dict[str, float] = {}
    s = sum_t.cpu().tolist()
    for i, n in enumerate(sum_names):
        a, b = s[2 * i], s[2 * i + 1]
        if metrics[n].reduce == "mean":
            out[n] = a / b if b else 0.0
        else:
            out[n] = a
    pos = 2 * len(sum_names)
    for n, k in zip(hist_names, hist_len):
        out[n] = s[pos:pos + k]
        pos += k
    e = ext_t.cpu().tolist()
    for i, n in enumerate(max_names):
        out[n] = e[i]
    for i, n in enumerate(min_names):
        out[n] = -e[len(max_names) + i]
    return out
