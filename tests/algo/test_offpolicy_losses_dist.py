"""The batch-level quantities of the off-policy losses are the one-process ones however the tokens
are spread: 4 gloo ranks as 2 data-parallel replicas x 2 context-parallel ranks (each replica
holds whole sequences, its CP ranks hold parts of each), against one process holding everything.

* ``vcpo``: each sequence's log-weight summed over its CP parts, the truncated IS weight, and the
  ESS step-size factor over the DP group (the same float on every rank);
* ``mis`` at sequence level: the sequence ratio that masks a whole sequence;
* ``areal_m2po``: its M2 mask over all loss tokens of the DP x CP group (``m2po_mask(region="all",
  keep_one=True)``), including the keep-one case with the smallest value tied across ranks.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_m2po.algo.losses import compute_policy_loss
from megatron_m2po.algo.m2_mask import m2po_mask
from megatron_m2po.algo.offpolicy_losses import ess_lr_scale
from megatron_m2po.config import AlgoConfig, MISConfig, VCPOConfig
from megatron_m2po.standins.dist_testing import run_distributed

pytestmark = pytest.mark.multiproc

LENGTHS = [5, 9, 3, 7, 6, 4]  # sequence s lives on DP replica s % 2
ALGO = AlgoConfig(vcpo=VCPOConfig(is_threshold=2.0), mis=MISConfig(level="sequence", threshold=1.5))


def _tokens():
    g = torch.Generator().manual_seed(11)
    n = sum(LENGTHS)
    seq = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    behav = torch.rand(n, generator=g, dtype=torch.float64) * -3.0
    delta = torch.randn(n, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) < 0.85
    cp = torch.randint(0, 2, (n,), generator=g)  # which CP rank of its replica holds each token
    return seq, behav, delta, adv, mask, cp


def _loss(name, idx, seq_ids, num_seqs, seq_group, stash):
    seq, behav, delta, adv, mask, _ = _tokens()
    logp = (behav + delta)[idx].clone().requires_grad_()
    loss, _ = compute_policy_loss(name, logp, behav[idx], adv[idx], mask[idx], denominator=50.0, algo_cfg=ALGO,
                                  seq_index=seq_ids, seq_group=seq_group, num_seqs=num_seqs, stash=stash)
    loss.backward()
    return loss.item(), logp.grad.tolist()


def _worker(rank, world):
    dp, cp = rank // 2, rank % 2
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in order
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    seq, _, _, _, _, cp_of = _tokens()
    mine = [s for s in range(len(LENGTHS)) if s % 2 == dp]
    idx = torch.tensor([i for i in range(seq.numel()) if int(seq[i]) in mine and int(cp_of[i]) == cp])
    local_ids = torch.tensor([mine.index(int(seq[i])) for i in idx])
    out = {"idx": idx.tolist()}
    for name in ("vcpo", "mis"):
        stash: list = []
        out[name] = _loss(name, idx, local_ids, len(mine), cp_groups[dp], stash)
        if name == "vcpo":
            out["scale"] = ess_lr_scale(stash, ALGO.vcpo, group=dp_groups[cp])[0]
    # areal_m2po's mask over the whole DP x CP group; three cases (see the single-process side)
    out["areal"] = [m2po_mask(d[idx], a[idx], v[idx], threshold=t, group=dist.group.WORLD, order_key=idx,
                              region="all", keep_one=True)[0].tolist() for d, a, v, t in _areal_cases()]
    return out


def _areal_cases():
    seq, _, delta, adv, mask, _ = _tokens()
    tied, valid = delta.abs() + 0.2, mask.clone()
    tied[[2, 20]] = 0.1  # the two smallest, in sequences 0 and 3 (different replicas); nothing fits tau = 1e-4
    valid[[2, 20]] = True
    return [(delta, adv, mask, 0.1), (delta, adv, mask, 1e-9), (tied, adv, valid, 1e-4)]


def test_offpolicy_batch_quantities_are_layout_invariant():
    results = run_distributed(_worker, 4, timeout_s=120)
    seq, behav, delta, adv, mask, _ = _tokens()
    n = seq.numel()
    every = torch.arange(n)
    for name in ("vcpo", "mis"):
        stash: list = []
        loss, grad = _loss(name, every, seq, len(LENGTHS), None, stash)
        if name == "vcpo":
            scale = ess_lr_scale(stash, ALGO.vcpo)[0]
            assert 0.0 < scale < 1.0
            assert len({r["scale"] for r in results}) == 1  # the same float on every rank
            assert results[0]["scale"] == pytest.approx(scale, rel=1e-12)
        assert sum(r[name][0] for r in results) == pytest.approx(loss, rel=1e-12), name
        got = [0.0] * n
        for r in results:
            for i, g in zip(r["idx"], r[name][1]):
                got[i] = g
        assert got == pytest.approx(grad, rel=1e-12, abs=1e-15), name
        if name == "mis":  # a masked sequence and a kept one
            assert 0 < sum(g == 0.0 for g in grad) < n
    for k, (d, a, v, t) in enumerate(_areal_cases()):
        ref, _ = m2po_mask(d, a, v, threshold=t, order_key=every, region="all", keep_one=True)
        got = [False] * n
        for r in results:
            for i, kept in zip(r["idx"], r["areal"][k]):
                got[i] = kept
        assert got == ref.tolist(), k
        assert (int(ref.sum()) == 1) == (k > 0), (k, int(ref.sum()))
    assert ref[2] and not ref[20]  # the tie at the minimum: the lower order key is kept
