"""Drift diagnostics (algo/diagnostics.py) against naive computations: the 99.9th percentile of
|log r| from the summed histogram (within one bin above the exact value), the sequence-level ESS
ratio, micro-batches merged and a sequence split over two context-parallel ranks."""

import math

import numpy as np
import pytest
import torch

from megatron_m2po.algo.diagnostics import EDGES, drift_metrics, finish_drift_metrics
from megatron_m2po.algo.metrics import merge_metrics, reduce_metrics
from megatron_m2po.standins.dist_testing import run_distributed


def _batch(seed=0, n_tok=5000, n_seq=40, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    delta = torch.randn(n_tok, generator=g, dtype=torch.float64) * scale
    delta[::997] = 3.0  # a few far tokens
    mask = torch.rand(n_tok, generator=g) > 0.1
    seq = torch.sort(torch.randint(0, n_seq, (n_tok,), generator=g)).values
    return delta, mask, seq


def _naive(delta, mask, seq):
    a = np.abs(delta[mask].numpy())
    p999 = float(np.sort(a)[math.ceil(0.999 * len(a)) - 1])  # the smallest value with >= 99.9 % at or below
    lw = {}
    for d, m, s in zip(delta.tolist(), mask.tolist(), seq.tolist()):
        if m:
            lw[s] = lw.get(s, 0.0) + d
    w = np.exp(np.array(list(lw.values())))
    return p999, float(w.sum() ** 2 / (len(w) * (w * w).sum()))


def test_percentile_and_ess_equal_naive_and_micro_batches_merge():
    delta, mask, seq = _batch()
    p_exact, ess_exact = _naive(delta, mask, seq)
    whole = finish_drift_metrics(reduce_metrics(drift_metrics(delta, mask, seq)))
    assert set(whole) == {"policy/abs_logratio_p999", "policy/seq_ess_ratio"}  # private records gone
    ratio = float(EDGES[1] / EDGES[0])  # one bin: 7.7 %
    assert p_exact <= whole["policy/abs_logratio_p999"] <= p_exact * ratio
    assert whole["policy/seq_ess_ratio"] == pytest.approx(ess_exact, rel=1e-12)
    # two micro-batches cut between sequences: the same numbers
    cut = int((seq < 20).sum())
    parts = [drift_metrics(delta[:cut], mask[:cut], seq[:cut]), drift_metrics(delta[cut:], mask[cut:], seq[cut:])]
    merged = finish_drift_metrics(reduce_metrics(merge_metrics(parts)))
    assert merged["policy/abs_logratio_p999"] == whole["policy/abs_logratio_p999"]
    assert merged["policy/seq_ess_ratio"] == pytest.approx(ess_exact, rel=1e-12)


def test_on_policy_update_reads_zero_and_one():
    delta = torch.zeros(100, dtype=torch.float64)
    out = finish_drift_metrics(reduce_metrics(drift_metrics(delta, torch.ones(100, dtype=torch.bool),
                                                             torch.arange(100) // 10)))
    assert out["policy/abs_logratio_p999"] == 0.0 and out["policy/seq_ess_ratio"] == pytest.approx(1.0)
    one_heavy = torch.zeros(20, dtype=torch.float64)
    one_heavy[0] = 50.0  # one sequence carries all the weight: ESS / n = 1 / n
    out = finish_drift_metrics(reduce_metrics(drift_metrics(one_heavy, torch.ones(20, dtype=torch.bool),
                                                             torch.arange(20) // 2)))
    assert out["policy/seq_ess_ratio"] == pytest.approx(1 / 10)
    assert out["policy/abs_logratio_p999"] == pytest.approx(float(EDGES[-1]))  # above the last edge


def _cp_rank(rank, world_size):
    import torch.distributed as dist

    delta, mask, seq = _batch(seed=3, n_tok=2000, n_seq=16)
    # context parallelism: every sequence's tokens alternate between the two ranks; ids shared
    mine = torch.arange(len(delta)) % world_size == rank
    rec = drift_metrics(delta[mine], mask[mine], seq[mine], seq_group=dist.group.WORLD, num_seqs=16)
    return finish_drift_metrics(reduce_metrics(rec, group=dist.group.WORLD))


def test_a_sequence_split_over_context_parallel_ranks_weighs_as_one():
    delta, mask, seq = _batch(seed=3, n_tok=2000, n_seq=16)
    whole = finish_drift_metrics(reduce_metrics(drift_metrics(delta, mask, seq)))
    for out in run_distributed(_cp_rank, 2, timeout_s=60):
        assert out["policy/seq_ess_ratio"] == pytest.approx(whole["policy/seq_ess_ratio"], rel=1e-12)
        assert out["policy/abs_logratio_p999"] == whole["policy/abs_logratio_p999"]
