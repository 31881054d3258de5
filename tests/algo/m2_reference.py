"""Independent, literal references for the M2PO mask (exact rational arithmetic, plain loops).

Shared by the single- and multi-process tests, and a generator of adversarial random cases.
"""

from __future__ import annotations

import heapq
from fractions import Fraction

import torch


def _trust_values(delta, adv, valid):
    """{index: exact v} over the trust region, delta clamped to [-20, 20] in float64."""
    out = {}
    for i in range(len(delta)):
        if not valid[i]:
            continue
        d = min(max(float(delta[i]), -20.0), 20.0)  # float64, like the implementation's upcast
        a = float(adv[i])
        if (a > 0 and d > 0) or (a < 0 and d < 0):
            out[i] = Fraction(d) ** 2
    return out


def remove_rule(delta, adv, valid, tau, order_key=None):
    """Paper Algorithm 1, literally: while the mean of the remaining v exceeds tau, remove the
    current argmax (among equal v the one with the highest order key, default: highest index)."""
    vals = _trust_values(delta, adv, valid)
    key = (lambda i: int(order_key[i])) if order_key is not None else (lambda i: i)
    remaining = set(vals)
    total = sum(vals.values(), Fraction(0))
    tau = Fraction(tau)
    heap = [(-v, -key(i), i) for i, v in vals.items()]
    heapq.heapify(heap)
    removed = []
    while remaining and total > tau * len(remaining):
        _, _, i = heapq.heappop(heap)  # the current argmax of (v, key)
        remaining.remove(i)
        total -= vals[i]
        removed.append(i)
    return _result(vals, remaining, removed, valid)


def cap_rule(delta, adv, valid, tau):
    """The released code's rule (``_solve_tau_from_sorted_delta2``), ported as a loop over the
    ascending v with exact sums and ``<=`` in place of its 1e-12 slacks: the cap is the value
    before the first k whose capped sum ``csum[k] + v[k] * (n - k - 1)`` exceeds tau * n (0 if
    k = 0); tokens with v above the cap are masked."""
    vals = _trust_values(delta, adv, valid)
    n = len(vals)
    srt = sorted(vals.values())
    target = Fraction(tau) * n
    cap = None  # None = nothing exceeds the budget
    if sum(srt, Fraction(0)) > target:
        csum = Fraction(0)
        for k in range(n):
            csum += srt[k]
            if csum + srt[k] * (n - k - 1) > target:
                cap = srt[k - 1] if k > 0 else Fraction(0)
                break
    removed = [i for i, v in vals.items() if cap is not None and v > cap]
    remaining = set(vals) - set(removed)
    return _result(vals, remaining, removed, valid)


def _result(vals, remaining, removed, valid):
    keep = torch.tensor([bool(valid[i]) for i in range(len(valid))], dtype=torch.bool)
    for i in removed:
        keep[i] = False
    n_t = len(vals)
    kept_vals = [vals[i] for i in remaining]
    n_valid = int(sum(bool(x) for x in valid))
    return dict(
        keep=keep,
        n_trust=n_t,
        n_masked=len(removed),
        m2_before=float(sum(vals.values(), Fraction(0)) / n_t) if n_t else 0.0,
        m2_after=float(sum(kept_vals, Fraction(0)) / len(kept_vals)) if kept_vals else 0.0,
        threshold_value=float(max(kept_vals)) if kept_vals else 0.0,
        mask_frac=len(removed) / n_valid if n_valid else 0.0,
    )


def random_case(g: torch.Generator, n_max: int = 150):
    """One adversarial case: heavy tails, exact duplicates, zero runs, empty trust regions ..."""

    def rint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    n = rint(0, n_max)
    kind = rint(0, 7)
    if kind == 0:  # heavy tails (Student-t, df 1..3)
        df = float(torch.rand(1, generator=g) * 2 + 1)
        delta = torch.distributions.StudentT(df).sample((n,)) * 0.3 if n else torch.zeros(0)
        delta = delta.clamp(-1e6, 1e6)  # Student-t(1) can overflow float32; clamp is then tested too
    elif kind == 1:  # coarse grid: many exact duplicates, ties at the boundary
        delta = torch.randint(-6, 7, (n,), generator=g).float() / 8
    elif kind == 2:  # all zero
        delta = torch.zeros(n)
    elif kind == 3:  # small, many below tau
        delta = torch.randn(n, generator=g) * 0.1
    elif kind == 4:  # huge: beyond the clamp
        delta = torch.randn(n, generator=g) * 40
    elif kind == 5:  # one value repeated plus a few others
        delta = torch.full((n,), 0.5)
        if n:
            delta[torch.randint(0, n, (max(n // 4, 1),), generator=g)] = torch.randn(max(n // 4, 1), generator=g)
    elif kind == 6:  # tiny values (fixed-point resolution region) with some big ones
        delta = torch.randn(n, generator=g) * 1e-20
        if n:
            delta[: n // 5] = torch.randn(n // 5, generator=g)
    else:  # mix of grid and continuous
        delta = torch.where(torch.rand(n, generator=g) < 0.5, torch.randint(-3, 4, (n,), generator=g).float() / 4,
                            torch.randn(n, generator=g))
    adv_kind = rint(0, 3)
    if adv_kind == 0:
        adv = torch.randn(n, generator=g)
    elif adv_kind == 1:
        adv = torch.randint(-1, 2, (n,), generator=g).float()  # includes zeros
    elif adv_kind == 2:
        adv = torch.zeros(n)  # empty trust region
    else:
        adv = -torch.sign(delta) * torch.rand(n, generator=g)  # opposite signs: empty trust region
    valid = torch.rand(n, generator=g) < 0.9
    tau = [0.04, 0.0, 1e-3, 0.25, 10.0, float(torch.rand(1, generator=g))][rint(0, 5)]
    if rint(0, 1):
        order_key = torch.randperm(3 * n + 1, generator=g)[:n].to(torch.int64)
    else:
        order_key = None
    if rint(0, 3) == 0:
        delta = delta.double()
    return delta, adv, valid, tau, order_key
