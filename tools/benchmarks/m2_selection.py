"""Benchmark the M2PO mask selection (megatron_m2po.algo.m2_mask).

Single process: ``m2po_mask`` (fast path: one sort + exact fixed-point cumsum) against a plain
float64 sort + cumsum implementation of Algorithm 1, for 1e5 ... 3e7 tokens.
Distributed (gloo, CPU): ``m2po_mask(group=...)`` (radix select, a fixed number of small
all-reduces) against all-gathering every rank's tokens and running the sort + cumsum reference
on the concatenation, at world sizes 2 and 4.

    python tools/benchmarks/m2_selection.py                      # default sizes
    python tools/benchmarks/m2_selection.py --sizes 1e5,1e6 --dist-sizes 1e5 --worlds 2

Prints one table per part with the median time of ``--repeat`` runs and the ratio
ours / reference (< 1 = ours faster), plus whether the masks agree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megatron_m2po.algo.m2_mask import m2po_mask
from megatron_m2po.standins.dist_testing import run_distributed

TAU = 0.04


def make_tokens(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    delta = (torch.distributions.StudentT(2.0).sample((n,)) * 0.25).float()
    adv = torch.randn(n, generator=g)
    valid = torch.rand(n, generator=g) < 0.95
    return delta, adv, valid


def reference_mask(delta: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor, tau: float = TAU) -> torch.Tensor:
    """Algorithm 1 as sort + float64 cumsum (ties by index, the same default as m2po_mask)."""
    d = delta.double().clamp(-20, 20)
    tr = valid & (((adv > 0) & (d > 0)) | ((adv < 0) & (d < 0)))
    idx = tr.nonzero().flatten()
    v = d[idx].square()
    srt, order = torch.sort(v, stable=True)
    cum = torch.cumsum(srt, 0)
    k = int((cum <= tau * torch.arange(1, v.numel() + 1, dtype=torch.float64)).sum())
    keep = valid.clone()
    keep[idx[order[k:]]] = False
    return keep


def timed(fn, repeat: int):
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def single_process(sizes, repeat):
    rows = []
    for n in sizes:
        delta, adv, valid = make_tokens(n, 0)
        t_ref, k_ref = timed(lambda: reference_mask(delta, adv, valid), repeat)
        t_ours, (k_ours, st) = timed(lambda: m2po_mask(delta, adv, valid, threshold=TAU), repeat)
        rows.append((n, t_ours, t_ref, t_ours / t_ref, bool(torch.equal(k_ours, k_ref)), st.mask_frac))
        print(f"  single n={n:.0e}: ours {t_ours:.3f}s ref {t_ref:.3f}s", file=sys.stderr, flush=True)
    return rows


def _dist_worker(rank, world, n_total, repeat):
    torch.set_num_threads(1)
    n = n_total // world
    delta, adv, valid = make_tokens(n, 1000 + rank)
    grp = dist.group.WORLD

    def ours():
        return m2po_mask(delta, adv, valid, threshold=TAU, group=grp)[0]

    def gathered():
        parts = [torch.empty_like(delta) for _ in range(world)]
        aparts = [torch.empty_like(adv) for _ in range(world)]
        vparts = [torch.empty_like(valid) for _ in range(world)]
        dist.all_gather(parts, delta, group=grp)
        dist.all_gather(aparts, adv, group=grp)
        dist.all_gather(vparts, valid, group=grp)
        keep = reference_mask(torch.cat(parts), torch.cat(aparts), torch.cat(vparts))
        return keep[rank * n:(rank + 1) * n]

    res = {}
    for name, fn in (("ours", ours), ("ref", gathered)):
        times = []
        for _ in range(repeat):
            dist.barrier(group=grp)
            t0 = time.perf_counter()
            out = fn()
            dist.barrier(group=grp)
            times.append(time.perf_counter() - t0)
        res[name] = (statistics.median(times), out)
    return res["ours"][0], res["ref"][0], bool(torch.equal(res["ours"][1], res["ref"][1]))


def distributed(sizes, worlds, repeat):
    rows = []
    for world in worlds:
        for n in sizes:
            out = run_distributed(_dist_worker, world, args=(int(n), repeat), timeout_s=1800)
            t_ours = max(o[0] for o in out)
            t_ref = max(o[1] for o in out)
            rows.append((world, n, t_ours, t_ref, t_ours / t_ref, all(o[2] for o in out)))
            print(f"  dist world={world} n={n:.0e}: ours {t_ours:.3f}s ref {t_ref:.3f}s", file=sys.stderr, flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1e5,1e6,1e7,3e7", help="single-process token counts")
    p.add_argument("--dist-sizes", default="1e5,1e6,1e7", help="total token counts of the distributed runs")
    p.add_argument("--worlds", default="2,4", help="gloo world sizes")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the single-process part")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(args.threads)
    sizes = [int(float(s)) for s in args.sizes.split(",") if s]
    dsizes = [int(float(s)) for s in args.dist_sizes.split(",") if s]
    worlds = [int(w) for w in args.worlds.split(",") if w]

    single = single_process(sizes, args.repeat)
    print(f"\nSingle process ({args.threads} thread(s)), median of {args.repeat}: m2po_mask vs float64 sort + cumsum")
    print(f"{'tokens':>10} {'ours [s]':>10} {'ref [s]':>10} {'ours/ref':>9} {'same mask':>10} {'mask_frac':>10}")
    for n, to, tr, ratio, same, frac in single:
        print(f"{n:>10.0e} {to:>10.3f} {tr:>10.3f} {ratio:>9.2f} {str(same):>10} {frac:>10.4f}")
    if dsizes and worlds:
        rows = distributed(dsizes, worlds, args.repeat)
        print(f"\nDistributed (gloo, 1 thread per rank), slowest rank, median of {args.repeat}: "
              "m2po_mask(group) vs all-gather + sort + cumsum")
        print(f"{'world':>6} {'tokens':>10} {'ours [s]':>10} {'ref [s]':>10} {'ours/ref':>9} {'same mask':>10}")
        for world, n, to, tr, ratio, same in rows:
            print(f"{world:>6} {n:>10.0e} {to:>10.3f} {tr:>10.3f} {ratio:>9.2f} {str(same):>10}")


if __name__ == "__main__":
    main()
