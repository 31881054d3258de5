"""Exact distributed order statistics without gathering the values.

The M2PO mask needs, over every token of an optimizer mini-batch spread across data- and
context-parallel ranks, "the longest ascending prefix whose mean is <= tau" (paper Algorithm 1)
or "the largest cap whose capped mean is <= tau" (the released code). Both are monotone
predicates over the sorted values, so they can be found by a **radix search** over the bit
pattern of the values instead of sorting an all-gathered copy.

Protocol of :func:`radix_search` (keys are int64, e.g. the bit pattern of non-negative float64
values, which orders like the integers):

1. The search range starts as ``[lo, lo + 2**bits)`` with nothing known below ``lo``.
2. Each round splits the current range into ``2**r`` buckets by the next ``r`` key bits. Every
   rank builds a local histogram ``[2**r, 1 + W]`` of (count, W exact int64 weight sums) over
   its keys inside the range and the histograms are summed with **one** ``all_reduce`` (int64,
   so the sum is exact and independent of the rank layout and reduction order).
3. With the global (count, sums) of everything below each bucket start, the caller's monotone
   predicate picks the last bucket whose start still satisfies it (binary search over the
   buckets, no collective); the range shrinks to that bucket and local keys outside it are
   dropped.
4. After ``ceil(bits / r)`` rounds the range is a single key ``P``: the largest key for which
   the predicate holds, with the exact global stats of the keys ``< P`` and ``== P``.

Collective cost: ``ceil(bits / bits_per_round)`` all-reduces of ``2**r * (1 + W) * 8`` bytes
(63-bit keys, r = 9, W = 3: 7 rounds of 16 KiB), whatever the number of tokens. Every rank takes
the same decisions from the same reduced numbers, so the number of collectives never diverges.

Exact sums. Float sums depend on the summation order, which would make the mask depend on the
parallel layout. Values in ``[0, 512)`` are therefore converted to fixed point with
``FIXED_POINT_BITS = 84`` fractional bits, rounded **up** (``q = ceil(v * 2**84)``), and carried
as three 31-bit int64 limbs whose sums are exact for fewer than 2**31 values; thresholds are
rounded **down** (``floor(tau * 2**84)``). "mean <= tau" is decided on these integers, which is
conservative (a kept set's exact mean never exceeds tau) and differs from exact real arithmetic
only when a mean lies within 2**-84 below tau. ``tau = 0`` keeps exactly the zero values.

Functions here take process groups as arguments and never read globals; ``group=None`` means a
single process (no collective is issued and fast sort + cumsum paths are used where they exist).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

FIXED_POINT_BITS = 84
LIMB_BITS = 31
N_LIMBS = 3
VALUE_LIMIT = 512.0  # fixed-point values must lie in [0, VALUE_LIMIT)
MAX_COUNT = 2**31 - 1  # exactness bound of the int64 limb sums
_LIMB_MASK = (1 << LIMB_BITS) - 1
_INF_BITS = 0x7FF0000000000000


# --------------------------------------------------------------------------- fixed point
def to_fixed_limbs(values: torch.Tensor) -> torch.Tensor:
    """``ceil(v * 2**84)`` of float64 values in ``[0, 512)`` as int64 limbs ``[3, n]`` (limb-major,
    low limb first).

    Every step is exact in float64: scaling by a power of two, ``ceil`` and splitting off
    power-of-two multiples.
    """
    v = values.reshape(-1).to(torch.float64)
    out = torch.empty(N_LIMBS, v.numel(), dtype=torch.float64, device=v.device)
    x = torch.ceil(v * float(2**FIXED_POINT_BITS))
    hi = torch.floor(x * float(2.0 ** (-2 * LIMB_BITS)), out=out[2])
    x.sub_(hi * float(2 ** (2 * LIMB_BITS)))
    mid = torch.floor(x * float(2.0**-LIMB_BITS), out=out[1])
    torch.sub(x, mid * float(2**LIMB_BITS), out=out[0])
    return out.to(torch.int64)


def fixed_of_float(x: float) -> int:
    """``ceil(x * 2**84)`` as a Python int (the same rounding as :func:`to_fixed_limbs`)."""
    return math.ceil(float(x) * float(2**FIXED_POINT_BITS))


def threshold_to_fixed(tau: float) -> int:
    """``floor(tau * 2**84)``; thresholds at or above the value limit are capped (nothing exceeds them)."""
    return math.floor(min(float(tau), VALUE_LIMIT - 12.0) * float(2**FIXED_POINT_BITS))


def limbs_value(limbs: Sequence[int]) -> int:
    """Python int of summed limbs ``(low, mid, hi)``."""
    return sum(int(v) << (LIMB_BITS * i) for i, v in enumerate(limbs))


def fixed_to_float(q: int) -> float:
    return q / float(2**FIXED_POINT_BITS)


def _int_limbs(q: int) -> list[int]:
    return [(q >> (LIMB_BITS * i)) & _LIMB_MASK for i in range(N_LIMBS)]


def _limbs_le_zero(d: torch.Tensor) -> torch.Tensor:
    """Column-wise ``sum_i d[i] * 2**(31 i) <= 0`` for int64 limbs ``[3, n]`` with |d| < 2**62 (exact)."""
    c0 = d[0] >> LIMB_BITS
    r0 = d[0] & _LIMB_MASK
    d1 = d[1] + c0
    c1 = d1 >> LIMB_BITS
    r1 = d1 & _LIMB_MASK
    d2 = d[2] + c1
    return (d2 < 0) | ((d2 == 0) & (r1 == 0) & (r0 == 0))


def float64_bits(values: torch.Tensor) -> torch.Tensor:
    """Bit pattern of float64 values as int64 (non-negative floats order like these integers)."""
    return values.to(torch.float64).contiguous().view(torch.int64)


def bits_to_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _check_fixed_range(values: torch.Tensor, what: str) -> None:
    if values.numel() > MAX_COUNT:
        raise ValueError(f"{what}: {values.numel()} values exceed the exact-sum limit of {MAX_COUNT}; "
                         "split the selection.")
    if values.numel() and not bool(((values >= 0) & (values < VALUE_LIMIT)).all()):
        bad = values[~((values >= 0) & (values < VALUE_LIMIT))]
        raise ValueError(f"{what}: values must be finite and in [0, {VALUE_LIMIT}); got {bad.numel()} outside, "
                         f"e.g. {bad[:5].tolist()}")


# --------------------------------------------------------------------------- radix search
@dataclass(frozen=True)
class SearchResult:
    """Result of :func:`radix_search` (identical on every rank)."""

    key: int  # the largest key P in the range whose predicate holds
    below: tuple[int, ...]  # global (count, *weight sums) over keys < P
    equal: tuple[int, ...]  # global (count, *weight sums) over keys == P
    rounds: int  # all-reduce rounds issued


Predicate = Callable[[int, tuple[int, ...]], bool]


def round_widths(bits: int, bits_per_round: int) -> list[int]:
    n = -(-bits // bits_per_round)
    return [bits - bits_per_round * (n - 1)] + [bits_per_round] * (n - 1)


def radix_search(keys: torch.Tensor, pred: Predicate, *, weights: Optional[torch.Tensor] = None,
                 group=None, lo: int = 0, bits: int = 63, bits_per_round: int = 9) -> SearchResult:
    """Largest key ``P`` in ``[lo, lo + 2**bits)`` with ``pred(P, stats_below(P))`` true.

    ``keys``: local int64 keys inside the range (any count, possibly 0). ``weights``: optional
    local int64 ``[W, n]`` summed exactly alongside the counts (each row's global sum must stay
    below 2**63). ``pred(start, below)`` gets a candidate key and the global
    ``(count, *weight sums)`` of all keys strictly below it; it must be monotone (true up to some
    key, false after) and true at ``lo``. One all-reduce per round (see module docstring).
    """
    if keys.dtype != torch.int64 or keys.dim() != 1:
        raise ValueError(f"radix_search: keys must be a 1-D int64 tensor, got {keys.dtype} {tuple(keys.shape)}")
    n_w = 0 if weights is None else weights.shape[0]
    cand = keys
    cand_w = weights
    cur_lo, cur_bits = lo, bits
    below: tuple[int, ...] = (0,) * (1 + n_w)
    equal: tuple[int, ...] = below
    widths = round_widths(bits, bits_per_round)
    for r in widths:
        shift = cur_bits - r
        base = cur_lo >> shift
        nb = 1 << r
        idx = (cand >> shift) - base
        hist = torch.zeros(1 + n_w, nb, dtype=torch.int64, device=keys.device)
        hist[0] = torch.bincount(idx, minlength=nb)
        if n_w:
            hist[1:].index_add_(1, idx, cand_w)
        if group is not None:
            dist.all_reduce(hist, op=dist.ReduceOp.SUM, group=group)
        excl = (hist.cumsum(1) - hist).T.tolist()
        rows = hist.T.tolist()

        def stats(i: int) -> tuple[int, ...]:
            return tuple(b + e for b, e in zip(below, excl[i]))

        # Binary search for the last bucket start where pred holds (pred(start_0) holds by invariant).
        a, b = 0, nb - 1
        while a < b:
            mid = (a + b + 1) // 2
            if pred((base + mid) << shift, stats(mid)):
                a = mid
            else:
                b = mid - 1
        below = stats(a)
        equal = tuple(rows[a])
        cur_lo, cur_bits = (base + a) << shift, shift
        sel = idx == a
        cand = cand[sel]
        if n_w:
            cand_w = cand_w[:, sel]
    return SearchResult(key=cur_lo, below=below, equal=equal, rounds=len(widths))


# --------------------------------------------------------------------------- k-th smallest
def ordered_int64(values: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Map values to int64 keys with the same order; returns (keys, lo, bits) of their range.

    Floats: the sign-magnitude bit pattern is turned into two's-complement order (-0.0 sorts just
    below +0.0); NaN is rejected. Integers are used as they are.
    """
    if values.is_floating_point():
        if bool(torch.isnan(values).any()):
            raise ValueError("kth_smallest: values contain NaN; they have no order")
        if values.dtype == torch.float64:
            b = values.contiguous().view(torch.int64)
            return torch.where(b < 0, b ^ 0x7FFFFFFFFFFFFFFF, b), -(2**63), 64
        b = values.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
        return torch.where(b < 0, b ^ 0x7FFFFFFF, b), -(2**31), 32
    return values.to(torch.int64), -(2**63), 64


def _key_to_value(key: int, dtype: torch.dtype) -> float | int:
    if dtype == torch.float64:
        return bits_to_float(key ^ 0x7FFFFFFFFFFFFFFF if key < 0 else key)
    if dtype.is_floating_point:
        k = key ^ 0x7FFFFFFF if key < 0 else key
        return struct.unpack("<f", struct.pack("<i", k))[0]
    return key


def kth_smallest(values: torch.Tensor, k: int, *, group=None, bits_per_round: int = 9) -> float | int:
    """The k-th smallest (1-based) of the values held by all ranks of ``group``.

    ``group=None``: the local values only (``torch.kthvalue``). Distributed: a radix search over
    the order-preserving int64 keys with counts only (``ceil(64 / r)`` all-reduces of ``2**r``
    int64, or ``ceil(32 / r)`` for float32) and one all-reduce for the total count.
    """
    values = values.reshape(-1)
    if group is None:
        n = values.numel()
        if not 1 <= k <= n:
            raise ValueError(f"kth_smallest: k={k} outside [1, {n}]")
        return torch.kthvalue(values.cpu(), k).values.item()
    keys, lo, bits = ordered_int64(values)
    total = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
    dist.all_reduce(total, group=group)
    if not 1 <= k <= int(total):
        raise ValueError(f"kth_smallest: k={k} outside [1, {int(total)}] (global count)")
    res = radix_search(keys, lambda _start, below: below[0] <= k - 1, group=group, lo=lo, bits=bits,
                       bits_per_round=bits_per_round)
    return _key_to_value(res.key, values.dtype)


# --------------------------------------------------------------------------- prefix-mean search
@dataclass(frozen=True)
class PrefixMeanResult:
    """Longest ascending prefix with mean <= threshold, over the values of all ranks (global).

    ``boundary`` is None when every value fits; otherwise it is the smallest value ``y`` that
    cannot be wholly kept: all values ``< y`` are kept, all ``> y`` removed, and ``n_keep_equal``
    of the ``n_equal`` copies of ``y`` are kept. The sums are for statistics (float64); the
    decisions never depend on their rounding.
    """

    n_total: int
    sum_total: float
    boundary: Optional[float]
    n_below: int
    n_equal: int
    n_keep_equal: int
    sum_kept: float
    max_kept: float  # 0.0 when nothing is kept

    @property
    def n_kept(self) -> int:
        return self.n_total if self.boundary is None else self.n_below + self.n_keep_equal


def _keep_equal(n_below: int, s_below: int, q_y: int, tau_q: int, n_equal: int) -> int:
    # Largest j with s_below + j*q_y <= tau_q*(n_below + j); q_y > tau_q here.
    j = (tau_q * n_below - s_below) // (q_y - tau_q)
    assert 0 <= j < n_equal, (j, n_equal)
    return j


def fixed_totals(values: torch.Tensor, group=None) -> tuple[int, int]:
    """Global (count, fixed-point sum) of the values (one all-reduce of 4 int64 when distributed)."""
    limbs = to_fixed_limbs(values)
    local = torch.cat([torch.tensor([values.numel()], dtype=torch.int64, device=values.device), limbs.sum(1)])
    if group is not None:
        dist.all_reduce(local, group=group)
    t = local.tolist()
    return t[0], limbs_value(t[1:])


def _global_max(x: torch.Tensor, group) -> float:
    m = (x.max() if x.numel() else torch.zeros((), dtype=torch.float64, device=x.device)).reshape(1).clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    return float(m.item())


def prefix_mean_search(values: torch.Tensor, threshold: float, *, group=None,
                       totals: Optional[tuple[int, int]] = None, bits_per_round: int = 9) -> PrefixMeanResult:
    """Longest prefix of the ascending values whose mean is <= threshold (paper Algorithm 1).

    ``values``: float64 in ``[0, 512)``, this rank's share. ``totals``: the global
    (count, fixed sum) if the caller already reduced them (saves one all-reduce).
    Single process: sort + float64 cumsum, with the decision certified against the rounding
    error bounds and recomputed in exact fixed point only when it is too close to call
    (see :func:`_prefix_mean_local`). Distributed: 1 all-reduce for the totals (unless given),
    then, only if the total mean exceeds the threshold, a 63-bit radix search (7 all-reduces
    of 16 KiB at r = 9), and 1 all-reduce (max) of one float64 for ``max_kept``.
    """
    values = values.reshape(-1).to(torch.float64)
    _check_fixed_range(values, "prefix_mean_search")
    if group is None:
        return _prefix_mean_local(values, threshold)
    tau_q = threshold_to_fixed(threshold)
    n, s = totals if totals is not None else fixed_totals(values, group)
    if s <= tau_q * n:
        return PrefixMeanResult(n, fixed_to_float(s), None, n, 0, 0, fixed_to_float(s), _global_max(values, group))

    def pred(_start: int, below: tuple[int, ...]) -> bool:
        return limbs_value(below[1:]) <= tau_q * below[0]

    res = radix_search(float64_bits(values), pred, weights=to_fixed_limbs(values), group=group,
                       bits=63, bits_per_round=bits_per_round)
    y = bits_to_float(res.key)
    n_below, s_below = res.below[0], limbs_value(res.below[1:])
    q_y = fixed_of_float(y)
    j = _keep_equal(n_below, s_below, q_y, tau_q, res.equal[0])
    below_max = _global_max(values[values < y], group)
    return PrefixMeanResult(n, fixed_to_float(s), y, n_below, res.equal[0], j, fixed_to_float(s_below + j * q_y),
                            y if j else below_max)


# Rounding-error margins of the certified float64 fast paths: twice the unit roundoff on every
# float term, and 2**-82 per value for the fixed-point rounding (< 2 * 2**-84 per value).
_EPS = 2.0**-52
_QUANT = 2.0**-82
_TAU_CAP = VALUE_LIMIT - 12.0  # same cap as threshold_to_fixed


def _prefix_certain(m: int, cum_m: float, tau: float) -> Optional[bool]:
    """Is the exact (fixed-point) mean of the first m sorted values <= tau? None = too close to call
    from the float64 prefix sum ``cum_m`` (recursive-summation error <= m * u * sum)."""
    if m == 0:
        return True
    slack = tau * m - cum_m
    err = _EPS * (tau * m + 2.0 * m * cum_m + abs(slack)) + m * _QUANT
    return True if slack > err else False if slack < -err else None


def _prefix_mean_local(values: torch.Tensor, threshold: float) -> PrefixMeanResult:
    """Sort + float64 cumsum; the count of fitting prefixes is certified at the boundary (the
    exact predicate is monotone, so "fits at K, does not fit at K + 1" pins K) and the exact
    fixed-point computation runs only when the float64 margins cannot decide."""
    tau = min(float(threshold), _TAU_CAP)
    n = values.numel()
    srt = torch.sort(values).values
    cum = torch.cumsum(srt, 0)
    total = float(cum[-1]) if n else 0.0
    decided = _prefix_certain(n, total, tau)
    if decided is None:
        return _prefix_mean_exact(srt, threshold)
    if decided:
        return PrefixMeanResult(n, total, None, n, 0, 0, total, float(srt[-1]) if n else 0.0)
    k = torch.arange(1, n + 1, dtype=torch.float64, device=values.device)
    n_kept = int((cum <= tau * k).sum())
    cum_k = float(cum[n_kept - 1]) if n_kept else 0.0
    if _prefix_certain(n_kept, cum_k, tau) is not True or \
            _prefix_certain(n_kept + 1, float(cum[n_kept]), tau) is not False:
        return _prefix_mean_exact(srt, threshold)
    y = srt[n_kept]
    n_below = int(torch.searchsorted(srt, y, right=False))
    n_equal = int(torch.searchsorted(srt, y, right=True)) - n_below
    return PrefixMeanResult(n, total, float(y), n_below, n_equal, n_kept - n_below, cum_k,
                            float(srt[n_kept - 1]) if n_kept else 0.0)


def _prefix_mean_exact(srt: torch.Tensor, threshold: float) -> PrefixMeanResult:
    """Exact fixed-point version over sorted values (vectorised int64 limb cumsums)."""
    tau_q = threshold_to_fixed(threshold)
    n = srt.numel()
    cum = to_fixed_limbs(srt).cumsum(1)
    s = limbs_value(cum[:, -1].tolist()) if n else 0
    if s <= tau_q * n:
        return PrefixMeanResult(n, fixed_to_float(s), None, n, 0, 0, fixed_to_float(s),
                                float(srt[-1]) if n else 0.0)
    k = torch.arange(1, n + 1, dtype=torch.int64, device=srt.device)
    t = torch.tensor(_int_limbs(tau_q), dtype=torch.int64, device=srt.device)
    fits = _limbs_le_zero(cum - t[:, None] * k[None, :])
    n_kept = int(torch.argmin(fits.to(torch.int8)))  # first False; prefix means are monotone
    y = srt[n_kept]
    n_below = int(torch.searchsorted(srt, y, right=False))
    n_equal = int(torch.searchsorted(srt, y, right=True)) - n_below
    s_kept = limbs_value(cum[:, n_kept - 1].tolist()) if n_kept else 0
    return PrefixMeanResult(n, fixed_to_float(s), float(y), n_below, n_equal, n_kept - n_below,
                            fixed_to_float(s_kept), float(srt[n_kept - 1]) if n_kept else 0.0)


# --------------------------------------------------------------------------- capped-mean search
@dataclass(frozen=True)
class CapResult:
    """Largest cap ``c`` (a value present, or 0) with mean(min(v, c)) <= threshold; values > ``cap_bound`` go.

    ``cap_bound`` lies in ``[c, next larger value)`` (the distributed search returns the largest
    float satisfying the budget), so "v > cap_bound" and "v > c" select the same values.
    ``max_kept`` is c itself (0.0 when nothing is kept; the largest value when nothing exceeds).
    """

    n_total: int
    sum_total: float
    cap_bound: float  # +inf when nothing exceeds the budget
    n_kept: int
    sum_kept: float
    max_kept: float


def capped_mean_search(values: torch.Tensor, threshold: float, *, group=None,
                       totals: Optional[tuple[int, int]] = None, bits_per_round: int = 9) -> CapResult:
    """Cap for the released M2PO rule: largest value c with ``sum(min(v, c)) <= threshold * n``.

    Same cost model as :func:`prefix_mean_search`.
    """
    values = values.reshape(-1).to(torch.float64)
    _check_fixed_range(values, "capped_mean_search")
    if group is None:
        return _capped_local(values, threshold)
    tau_q = threshold_to_fixed(threshold)
    n, s = totals if totals is not None else fixed_totals(values, group)
    if s <= tau_q * n:
        return CapResult(n, fixed_to_float(s), math.inf, n, fixed_to_float(s), _global_max(values, group))
    budget = tau_q * n
    limit_bits = struct.unpack("<q", struct.pack("<d", VALUE_LIMIT))[0]

    def pred(start: int, below: tuple[int, ...]) -> bool:
        if start >= limit_bits:  # beyond every value: the capped sum is the full sum, over budget
            return False
        return limbs_value(below[1:]) + fixed_of_float(bits_to_float(start)) * (n - below[0]) <= budget

    res = radix_search(float64_bits(values), pred, weights=to_fixed_limbs(values), group=group,
                       bits=63, bits_per_round=bits_per_round)
    bound = bits_to_float(res.key)
    return CapResult(n, fixed_to_float(s), bound, res.below[0] + res.equal[0],
                     fixed_to_float(limbs_value(res.below[1:]) + limbs_value(res.equal[1:])),
                     _global_max(values[values <= bound], group))


def _cap_certain(i: int, n: int, cum_i: float, v_i: float, tau: float) -> Optional[bool]:
    """Is sum(min(v, v_i)) <= tau * n exactly (fixed point)? None = too close to call."""
    if i < 0:
        return True
    rest = v_i * (n - 1 - i)
    g = cum_i + rest
    slack = tau * n - g
    err = _EPS * (2.0 * (i + 1) * cum_i + 2.0 * rest + tau * n + abs(slack)) + n * _QUANT
    return True if slack > err else False if slack < -err else None


def _capped_local(values: torch.Tensor, threshold: float) -> CapResult:
    tau = min(float(threshold), _TAU_CAP)
    n = values.numel()
    srt = torch.sort(values).values
    cum = torch.cumsum(srt, 0)
    total = float(cum[-1]) if n else 0.0
    decided = _prefix_certain(n, total, tau)  # the cap at the largest value is the plain sum
    if decided is None:
        return _capped_exact(srt, threshold)
    if decided:
        return CapResult(n, total, math.inf, n, total, float(srt[-1]) if n else 0.0)
    above = torch.arange(n - 1, -1, -1, dtype=torch.float64, device=values.device)  # n - (i + 1)
    n_fit = int((cum + srt * above <= tau * n).sum())  # capped sums are monotone in the cap
    i = n_fit - 1
    prev = _cap_certain(i, n, float(cum[i]) if i >= 0 else 0.0, float(srt[i]) if i >= 0 else 0.0, tau)
    nxt = _cap_certain(n_fit, n, float(cum[n_fit]), float(srt[n_fit]), tau)
    if prev is not True or nxt is not False:
        return _capped_exact(srt, threshold)
    return _cap_result(srt, cum, n_fit, total, float)


def _cap_result(srt, cum_at, n_fit: int, total: float, to_float) -> CapResult:
    n = srt.numel()
    if n_fit == 0:
        return CapResult(n, total, 0.0, 0, 0.0, 0.0)
    c = srt[n_fit - 1]
    n_kept = int(torch.searchsorted(srt, c, right=True))
    return CapResult(n, total, float(c), n_kept, to_float(cum_at[n_kept - 1]), float(c))


def _capped_exact(srt: torch.Tensor, threshold: float) -> CapResult:
    tau_q = threshold_to_fixed(threshold)
    n = srt.numel()
    limbs = to_fixed_limbs(srt)
    cum = limbs.cumsum(1)
    s = limbs_value(cum[:, -1].tolist()) if n else 0
    if s <= tau_q * n:
        return CapResult(n, fixed_to_float(s), math.inf, n, fixed_to_float(s), float(srt[-1]) if n else 0.0)
    above = torch.arange(n - 1, -1, -1, dtype=torch.int64, device=srt.device)  # n - (i + 1)
    t = torch.tensor(_int_limbs(tau_q), dtype=torch.int64, device=srt.device)
    fits = _limbs_le_zero(cum + limbs * above[None, :] - n * t[:, None])
    n_fit = int(torch.argmin(fits.to(torch.int8)))  # first index whose cap breaks the budget
    return _cap_result(srt, cum.T, n_fit, fixed_to_float(s), lambda row: fixed_to_float(limbs_value(row.tolist())))
