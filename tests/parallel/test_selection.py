"""Exact distributed order statistics (parallel/selection.py)."""

import math
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from megatron_m2po.parallel import selection as sel
from megatron_m2po.standins.dist_testing import run_distributed


def test_fixed_point_limbs_are_exact_ceil():
    g = torch.Generator().manual_seed(0)
    vals = torch.cat([torch.rand(2000, generator=g, dtype=torch.float64) * 400,
                      torch.rand(200, generator=g, dtype=torch.float64) * 1e-20,
                      torch.tensor([0.0, 2.0**-84, 2.0**-85, 3 * 2.0**-86, 399.99999999, 1e-300, 0.04])])
    limbs = sel.to_fixed_limbs(vals).T
    assert int(limbs.min()) >= 0 and int(limbs.max()) < 2**31
    for v, row in zip(vals.tolist(), limbs.tolist()):
        exact = math.ceil(Fraction(v) * 2**84)
        assert sel.limbs_value(row) == exact == sel.fixed_of_float(v), v
    assert sel.threshold_to_fixed(0.04) == math.floor(Fraction(0.04) * 2**84)
    with pytest.raises(ValueError, match=r"in \[0, 512.0\)"):
        sel.prefix_mean_search(torch.tensor([1.0, 600.0, -1.0]), 0.1)


def test_limb_sign_is_exact():
    # Values around 0 that float64 could not tell apart: 2**93 + 1 - (2**93 + 1) etc.
    rows = [[1, 0, 0], [0, 0, 0], [-1, 0, 0], [0, 1, -1], [2**31 - 1, 2**31 - 1, -1],
            [-(2**40), 2**9, 0], [-(2**40), 2**9 + 1, 0], [5, -3, 1]]
    got = sel._limbs_le_zero(torch.tensor(rows, dtype=torch.int64).T).tolist()
    assert got == [sel.limbs_value(r) <= 0 for r in rows]


def test_prefix_mean_and_cap_local_match_brute_force():
    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        n = int(torch.randint(1, 40, (1,), generator=g))
        v = (torch.randint(0, 5, (n,), generator=g).double() / 8) ** 2 if trial % 2 else \
            torch.rand(n, generator=g, dtype=torch.float64) ** 3
        tau = [0.0, 0.01, 0.05, 0.2, 1 / 16][trial % 5]
        srt = sorted(Fraction(x) for x in v.tolist())
        k = max([m for m in range(n + 1) if m == 0 or sum(srt[:m]) <= Fraction(tau) * m])
        res = sel.prefix_mean_search(v, tau)
        assert res.n_kept == k
        assert res.sum_kept == pytest.approx(float(sum(srt[:k])), rel=1e-12)
        assert res.max_kept == (float(srt[k - 1]) if k else 0.0)
        caps = [c for c in srt if sum(min(x, c) for x in srt) <= Fraction(tau) * n]
        kept = srt if sum(srt) <= Fraction(tau) * n else [x for x in srt if caps and x <= max(caps)]
        cres = sel.capped_mean_search(v, tau)
        assert cres.n_kept == len(kept) and cres.max_kept == (float(kept[-1]) if kept else 0.0)


def test_certified_float_path_equals_exact_path_and_falls_back_when_close(monkeypatch):
    # Means exactly at tau (dyadic values) cannot be decided from float64 sums: the exact
    # fixed-point path must take over; elsewhere the float path must agree with it.
    calls = {"prefix": 0, "cap": 0}
    exact_p, exact_c = sel._prefix_mean_exact, sel._capped_exact

    def spy_p(*a):
        calls["prefix"] += 1
        return exact_p(*a)

    def spy_c(*a):
        calls["cap"] += 1
        return exact_c(*a)

    monkeypatch.setattr(sel, "_prefix_mean_exact", spy_p)
    monkeypatch.setattr(sel, "_capped_exact", spy_c)
    g = torch.Generator().manual_seed(8)
    for trial in range(300):
        n = int(torch.randint(1, 300, (1,), generator=g))
        if trial % 3 == 0:
            v = (torch.randint(0, 9, (n,), generator=g).double() / 4) ** 2
            tau = [0.25, 1.0, 0.5625, 0.0][trial % 4]  # values of the grid: exact-equality cases
        else:
            v = torch.distributions.StudentT(1.5).sample((n,)).double().clamp(-20, 20) ** 2
            tau = [0.04, 0.3, 0.0][trial % 3]
        fast = sel.prefix_mean_search(v, tau)
        exact = exact_p(torch.sort(v).values, tau)
        assert (fast.n_kept, fast.boundary, fast.n_equal, fast.max_kept) == \
            (exact.n_kept, exact.boundary, exact.n_equal, exact.max_kept)
        fc, ec = sel.capped_mean_search(v, tau), exact_c(torch.sort(v).values, tau)
        assert (fc.n_kept, fc.cap_bound, fc.max_kept) == (ec.n_kept, ec.cap_bound, ec.max_kept)
    assert 10 < calls["prefix"] < 250 and 10 < calls["cap"] < 250, calls


def _dist_worker(rank, world, payload):
    out = {}
    grp = dist.group.WORLD
    for name, values, counts, k in payload["kth"]:
        lo = sum(counts[:rank])
        out[("kth", name, k)] = sel.kth_smallest(values[lo:lo + counts[rank]], k, group=grp)
    for i, (v, counts, tau) in enumerate(payload["search"]):
        lo = sum(counts[:rank])
        mine = v[lo:lo + counts[rank]]
        out[("prefix", i)] = sel.prefix_mean_search(mine, tau, group=grp)
        out[("cap", i)] = sel.capped_mean_search(mine, tau, group=grp).n_kept
    # Collective count of a bare radix search does not depend on the number of keys.
    counts = {}
    orig = dist.all_reduce

    def counted(t, *a, **kw):
        counts[n]["calls"] += 1
        counts[n]["bytes"] += t.numel() * t.element_size()
        return orig(t, *a, **kw)

    dist.all_reduce = counted
    try:
        for n in (1_000, 100_000):
            counts[n] = {"calls": 0, "bytes": 0}
            x = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)) * 3
            sel.prefix_mean_search(x, 0.5, group=grp)
            sel.kth_smallest(x, n // 2, group=grp)
    finally:
        dist.all_reduce = orig
    out["counts"] = counts
    return out


@pytest.mark.multiproc
def test_distributed_selection_equals_local():
    g = torch.Generator().manual_seed(11)
    world = 3
    kth = []
    f64 = torch.cat([torch.randn(50, generator=g, dtype=torch.float64) * 1e3,
                     torch.tensor([0.0, -0.0, 1e-310, -1e-310, 5.0, 5.0, 5.0, -math.inf, math.inf],
                                  dtype=torch.float64)])
    f32 = torch.randn(41, generator=g)
    i64 = torch.randint(-(2**62), 2**62, (33,), generator=g)
    for name, vals in (("f64", f64), ("f32", f32), ("i64", i64)):
        n = vals.numel()
        counts = [n - 10, 0, 10]  # one rank empty
        for k in (1, 2, n // 2, n - 1, n):
            kth.append((name, vals, counts, k))
    search = []
    for i in range(6):
        n = 300
        v = (torch.randint(0, 9, (n,), generator=g).double() / 8) ** 2 if i % 2 else \
            torch.distributions.StudentT(1.5).sample((n,)).double().clamp(-20, 20) ** 2
        search.append((v, [0, 120, 180] if i % 3 == 0 else [50, 200, 50], [0.04, 0.5, 0.0][i % 3]))
    res = run_distributed(_dist_worker, world, args=({"kth": kth, "search": search},), timeout_s=120)
    for name, vals, _counts, k in kth:
        expect = torch.sort(vals).values[k - 1].item()
        for r in range(world):
            got = res[r][("kth", name, k)]
            assert got == expect, (name, k, got, expect)
    for i, (v, _counts, tau) in enumerate(search):
        local = sel.prefix_mean_search(v, tau)
        for r in range(world):
            got = res[r][("prefix", i)]
            assert (got.n_total, got.boundary, got.n_below, got.n_equal, got.n_keep_equal, got.max_kept) == \
                (local.n_total, local.boundary, local.n_below, local.n_equal, local.n_keep_equal, local.max_kept), i
            assert got.sum_kept == pytest.approx(local.sum_kept, rel=1e-12)
        assert all(res[r][("cap", i)] == sel.capped_mean_search(v, tau).n_kept for r in range(world)), i
    c = res[0]["counts"]
    assert c[1_000] == c[100_000]
    # prefix: totals (4 int64) + 7 rounds of 512 x 4 int64 + max (1 float64); kth (float64 keys,
    # 64 bits): total + 8 rounds of counts (2 buckets, then 7 x 512).
    assert c[1_000]["calls"] == 1 + 7 + 1 + 1 + 8
    assert c[1_000]["bytes"] == 4 * 8 + 7 * 512 * 4 * 8 + 8 + 8 + (2 + 7 * 512) * 8
