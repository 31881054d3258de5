"""Global M2PO mask over gloo ranks == the single-process mask on the concatenated tokens.

Each multi-process test spawns its ranks once and runs many cases inside (spawning is the
expensive part on a 2-core machine).
"""

import pytest
import torch
import torch.distributed as dist

from megatron_m2po.algo.m2_mask import m2po_mask
from megatron_m2po.standins.dist_testing import run_distributed
from m2_reference import random_case, remove_rule

pytestmark = pytest.mark.multiproc


def _split_counts(n: int, world: int, g: torch.Generator) -> list[int]:
    """Uneven split of n tokens over ranks; rank 1 (if any) always gets none."""
    cuts = sorted(torch.randint(0, n + 1, (world - 1,), generator=g).tolist())
    counts = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    if world > 1:
        counts[0] += counts[1]
        counts[1] = 0
    return counts


def _cases(world: int):
    g = torch.Generator().manual_seed(7 + world)
    cases = []
    for i in range({1: 30, 2: 24, 4: 12}[world]):  # 4 ranks on 2 cores: fewer, collectives are slow
        delta, adv, valid, tau, key = random_case(g, n_max=120)
        if i % 3 != 0:  # two in three: a regime where the cut falls inside the trust region
            n = delta.numel()
            delta = (torch.distributions.StudentT(1.5).sample((n,)) * 0.3 if i % 3 == 1
                     else torch.randint(-6, 7, (n,), generator=g).float() / 8)
            adv = torch.randn(n, generator=g)
            tau = 0.04
        rule = "cap" if i % 4 == 3 else "remove"
        cases.append((delta, adv, valid, tau, key, rule, _split_counts(delta.numel(), world, g)))
    # Boundary ties spread over ranks, with and without explicit keys.
    n = 64
    delta = torch.full((n,), 0.5)
    delta[::4] = 2.0**-10
    adv = torch.ones(n)
    valid = torch.ones(n, dtype=torch.bool)
    key = torch.randperm(n, generator=g).to(torch.int64) * 7 + 3
    for k in (None, key):
        cases.append((delta, adv, valid, 0.1, k, "remove", _split_counts(n, world, g)))
    return cases


def _mask_worker(rank, world, cases):
    out = []
    for delta, adv, valid, tau, key, rule, counts in cases:
        lo = sum(counts[:rank])
        hi = lo + counts[rank]
        k = None if key is None else key[lo:hi]
        keep, st = m2po_mask(delta[lo:hi], adv[lo:hi], valid[lo:hi], threshold=tau, rule=rule,
                             group=dist.group.WORLD, order_key=k)
        out.append((keep.tolist(), st))  # plain lists: tensors do not outlive the worker
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_global_mask_equals_single_process_on_concatenation(world):
    cases = _cases(world)
    results = run_distributed(_mask_worker, world, args=(cases,), timeout_s=120)
    n_masked_cases = 0
    for i, (delta, adv, valid, tau, key, rule, counts) in enumerate(cases):
        keep_ref, st_ref = m2po_mask(delta, adv, valid, threshold=tau, rule=rule, order_key=key)
        keep = torch.tensor(sum((results[r][i][0] for r in range(world)), []), dtype=torch.bool)
        assert torch.equal(keep, keep_ref), (i, rule, counts)
        for r in range(world):  # global stats on every rank: counts exact, float64 sums to rounding
            st = results[r][i][1]
            assert (st.n_trust, st.n_masked, st.n_valid, st.threshold_value, st.mask_frac) == \
                (st_ref.n_trust, st_ref.n_masked, st_ref.n_valid, st_ref.threshold_value, st_ref.mask_frac), (i, r)
            assert st.m2_before == pytest.approx(st_ref.m2_before, rel=1e-12, abs=1e-30)
            assert st.m2_after == pytest.approx(st_ref.m2_after, rel=1e-12, abs=1e-30)
            assert results[0][i][1] == st  # bit-identical across ranks
        n_masked_cases += 0 < st_ref.n_masked < st_ref.n_trust
    # The last two cases cut inside the tie run: check them against the literal reference too.
    for delta, adv, valid, tau, key, _, _ in cases[-2:]:
        ref = remove_rule(delta, adv, valid, tau, key)
        keep_ref, st = m2po_mask(delta, adv, valid, threshold=tau, order_key=key)
        assert torch.equal(keep_ref, ref["keep"]) and 0 < st.n_masked < 48
    assert n_masked_cases >= 5


def _count_worker(rank, world, sizes):
    calls = {"n": 0, "bytes": 0, "names": []}
    originals = {}

    def wrap(name):
        fn = getattr(dist, name)
        originals[name] = fn

        def counted(tensor_or_list, *args, **kwargs):
            ts = tensor_or_list if isinstance(tensor_or_list, (list, tuple)) else [tensor_or_list]
            if name == "all_gather":  # (output_list, input)
                ts = [args[0]]
            calls["n"] += 1
            calls["bytes"] += sum(t.numel() * t.element_size() for t in ts)
            calls["names"].append(name)
            return fn(tensor_or_list, *args, **kwargs)

        setattr(dist, name, counted)

    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter",
                 "all_to_all", "gather", "scatter"):
        wrap(name)
    try:
        out = {}
        for n in sizes:
            g = torch.Generator().manual_seed(100 + rank)
            local = n // world + (rank * 37)  # uneven
            delta = torch.distributions.StudentT(1.5).sample((local,)) * 0.3
            adv = torch.randn(local, generator=g)
            valid = torch.rand(local, generator=g) < 0.9
            key = torch.arange(local, dtype=torch.int64) * world + rank
            # Ties at the boundary: quantised deltas, so the cut falls inside a run of equal values.
            tied = (delta * 16).round() / 16
            for label, d, k, rule in (("remove", delta, key, "remove"), ("cap", delta, None, "cap"),
                                      ("ties_key", tied, key, "remove"), ("ties_default", tied, None, "remove")):
                before = (calls["n"], calls["bytes"], len(calls["names"]))
                _, st = m2po_mask(d, adv, valid, group=dist.group.WORLD, order_key=k, rule=rule)
                assert 0 < st.n_masked < st.n_trust, (label, st)
                out[(label, n)] = (calls["n"] - before[0], calls["bytes"] - before[1],
                                   tuple(calls["names"][before[2]:]))
        return out
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def test_collectives_do_not_grow_with_token_count():
    res = run_distributed(_count_worker, 2, args=([1_000, 100_000],), timeout_s=120)[0]
    for label in ("remove", "cap", "ties_key", "ties_default"):
        small, big = res[(label, 1_000)], res[(label, 100_000)]
        assert small == big, (label, small, big)
        n_calls, n_bytes, _ = big
        assert n_calls <= 17 and n_bytes <= 160_000, (label, big)
    # The plain cases: totals + 7 radix rounds of 512 x 4 int64 + 1 max.
    assert res[("remove", 100_000)][0] == 9 and res[("remove", 100_000)][1] == 5 * 8 + 7 * 512 * 4 * 8 + 8
    assert "all_gather" in res[("ties_default", 100_000)][2]
