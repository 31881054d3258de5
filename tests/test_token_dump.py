"""Token dumps (``logging.dump_tokens_every``) and ``m2po experiment entropy``: the per-token
decisions against naive references, assembly of the actor's micro-batch records, the size bound,
and the entropy analysis by hand. (The dump of a real run is checked against the run's own
metrics in tests/test_reproducibility.py.)"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_m2po.actor.batch import RolloutBatch, Sample, make_microbatches
from megatron_m2po.actor.global_mask import TokenRecord
from megatron_m2po.config import load_config
from megatron_m2po.experiment.entropy import entropy_stats, load_dumps
from megatron_m2po.experiment.entropy import run as entropy_run
from megatron_m2po.trainer.token_dump import TokenDump, grpo_clipped, m2po_masked, read_token_dump

REPO = Path(__file__).resolve().parents[1]


class _FakeActor:
    """What TokenDump uses of the actor: its stage, TP rank and the token observer."""

    is_last_stage, tp_rank, token_hook = True, 0, None

    def observe_tokens(self, hook) -> None:
        self.token_hook = hook


def _microbatches(samples, indices, size: int):
    """Micro-batches of ``size`` consecutive samples of ``indices`` (the padded layout)."""
    idx = list(indices)
    return make_microbatches(samples, [idx[k:k + size] for k in range(0, len(idx), size)])


def test_grpo_clipped_matches_the_ppo_objective_by_hand():
    eps = 0.2
    # (log r, A) -> clipped?  r > 1 + eps with A > 0, r < 1 - eps with A < 0 take the clipped branch
    cases = [(np.log(1.3), 1.0, True), (np.log(1.1), 1.0, False), (np.log(1.3), -1.0, False),
             (np.log(0.7), -1.0, True), (np.log(0.7), 1.0, False), (np.log(0.9), -1.0, False),
             (np.log(1.3), 0.0, False)]
    lr = np.array([c[0] for c in cases], np.float32)
    adv = np.array([c[1] for c in cases], np.float32)
    assert grpo_clipped(lr, adv, eps, eps).tolist() == [c[2] for c in cases]
    # clip-higher: a wider upper bound clips less
    assert grpo_clipped(np.array([np.log(1.25)]), np.array([1.0]), 0.2, 0.28).tolist() == [False]


def _naive_m2po(delta, adv, tau):
    """Algorithm 1 by brute force: drop the trust-region token with the largest delta^2 (lowest
    index first among ties is kept) until the mean of the rest is <= tau."""
    tr = [i for i in range(len(delta)) if (adv[i] > 0 and delta[i] > 0) or (adv[i] < 0 and delta[i] < 0)]
    kept = sorted(tr, key=lambda i: (delta[i] ** 2, i))
    while kept and sum(delta[i] ** 2 for i in kept) / len(kept) > tau:
        kept.pop()
    return {i for i in tr if i not in kept}


def test_m2po_masked_matches_a_brute_force_algorithm_1():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(5, 40))
        delta = rng.normal(0, 0.4, n)
        adv = rng.choice([-1.0, 1.0, 0.5, -0.5], n)
        valid = np.ones(n, bool)
        got = set(np.flatnonzero(m2po_masked(delta, adv, valid, 0.04, "remove")).tolist())
        assert got == _naive_m2po(delta.tolist(), adv.tolist(), 0.04)
    # invalid tokens are never reported as masked
    assert not m2po_masked(np.array([3.0, 3.0]), np.array([1.0, 1.0]), np.array([False, False]), 0.04,
                           "remove").any()


def _samples(rng, n, version):
    out = []
    for i in range(n):
        r = int(rng.integers(2, 6))
        out.append(Sample(uid=f"u{i}", prompt_ids=np.arange(3), response_ids=rng.integers(0, 50, r),
                          behav_logprobs=-rng.random(r).astype(np.float32), advantages=np.full(r, rng.normal(), np.float32),
                          loss_mask=(rng.random(r) > 0.2).astype(np.uint8), versions=np.full(r, version)))
    return out


def _dump_cfg(tmp_path, **logging):
    ov = [f"logging.{k}={v}" for k, v in logging.items()] + [f"trainer.run_dir={tmp_path}"]
    return load_config(str(REPO / "examples" / "staleness_tiny.yaml"), ov)


def test_dump_assembles_micro_batches_across_ranks_and_writes_the_step(tmp_path):
    """Two updates; each mini-batch's tokens arrive as micro-batches in shuffled order (as shards of
    several data-parallel ranks would); the file holds every loss token once, in canonical order."""
    rng = np.random.default_rng(1)
    cfg = _dump_cfg(tmp_path, dump_tokens_every=2)
    actor = _FakeActor()
    dump = TokenDump(cfg, actor, tmp_path)
    assert [s for s in range(6) if dump.wants(s)] == [1, 3, 5]
    dump.begin(3)
    expect_logp, first = [], 0
    minis = [RolloutBatch(_samples(rng, 5, version=10)), RolloutBatch(_samples(rng, 4, version=10))]
    for j, mini in enumerate(minis):
        mbs = _microbatches(mini.samples, range(len(mini.samples)), 2)
        n = sum(s.response_ids.shape[0] for s in mini.samples)
        logp = -rng.random(n).astype(np.float32)
        ent = rng.random(n).astype(np.float32)
        expect_logp.append(logp)
        for mb in reversed(mbs):
            idx = mb.token_index.numpy()
            actor.token_hook(TokenRecord(12 + j, None, mb, torch.from_numpy(logp[idx]), torch.from_numpy(ent[idx]),
                                         None))
        dump.end_update(mini, 12 + j, first)
        first += len(mini.samples)
    path = dump.write()
    assert actor.token_hook is None and path == tmp_path / "tokens" / "step_000003.npz"
    d, meta = read_token_dump(path)
    assert meta["step"] == 3 and meta["loss"] == "m2po" and meta["m2po_threshold"] == 0.04
    samples = [s for m in minis for s in m.samples]
    valid = np.concatenate([s.loss_mask for s in samples]).astype(bool)
    assert meta["tokens_total"] == valid.sum() == len(d["token"])
    np.testing.assert_array_equal(d["token"], np.concatenate([s.response_ids for s in samples])[valid])
    np.testing.assert_array_equal(d["logp"], np.concatenate(expect_logp)[valid])
    np.testing.assert_array_equal(d["staleness"], np.concatenate(
        [np.full(s.response_ids.shape[0], 12 + j - 10) for j, m in enumerate(minis) for s in m.samples])[valid])
    np.testing.assert_array_equal(d["sample"], np.concatenate(
        [np.full(s.response_ids.shape[0], i) for i, s in enumerate(samples)])[valid])
    behav = np.concatenate([s.behav_logprobs for s in samples])[valid]
    np.testing.assert_allclose(d["logratio"], d["logp"] - behav, rtol=0, atol=1e-6)
    assert (d["keep"] == -1).all()  # no loss mask was recorded


def test_dump_size_is_bounded_by_a_seeded_subset(tmp_path):
    rng = np.random.default_rng(2)
    cfg = _dump_cfg(tmp_path, dump_tokens_every=1, dump_tokens_max=7)
    actor = _FakeActor()
    paths = []
    for out in ("a", "b"):
        dump = TokenDump(cfg, actor, tmp_path / out)
        dump.begin(0)
        mini = RolloutBatch(_samples(np.random.default_rng(3), 6, version=0))
        n = sum(s.response_ids.shape[0] for s in mini.samples)
        for mb in _microbatches(mini.samples, range(6), 64):
            actor.token_hook(TokenRecord(0, "prepass", mb, torch.from_numpy(-rng.random(n).astype(np.float32)),
                                         torch.zeros(n), torch.ones(n, dtype=torch.bool)))
        dump.end_update(mini, 0, 0)
        paths.append(dump.write())
    a, meta = read_token_dump(paths[0])
    b, _ = read_token_dump(paths[1])
    assert len(a["token"]) == 7 < meta["tokens_total"]
    np.testing.assert_array_equal(a["sample"], b["sample"])  # the same subset: seeded by run seed and step
    np.testing.assert_array_equal(a["pos"], b["pos"])
    assert (a["keep"] == 1).all()


def test_dump_refuses_tokens_nobody_recorded(tmp_path):
    cfg = _dump_cfg(tmp_path, dump_tokens_every=1)
    actor = _FakeActor()
    dump = TokenDump(cfg, actor, tmp_path)
    dump.begin(0)
    with pytest.raises(RuntimeError, match="not recorded"):
        dump.end_update(RolloutBatch(_samples(np.random.default_rng(4), 2, 0)), 0, 0)


def _synthetic(n=400, seed=5):
    rng = np.random.default_rng(seed)
    ent = rng.random(n).astype(np.float32) * 2
    lr = (rng.normal(0, 0.05, n) * (1 + 4 * ent)).astype(np.float32)  # high entropy -> large |log r|
    adv = rng.choice([-1.0, 1.0], n).astype(np.float32)
    clip = grpo_clipped(lr, adv, 0.2, 0.2)
    mask = m2po_masked(lr, adv, np.ones(n, bool), 0.04, "remove")
    return {"entropy": ent, "logratio": lr, "advantage": adv, "grpo_clipped": clip, "m2po_masked": mask,
            "staleness": np.where(np.arange(n) < n // 2, 2, 8).astype(np.int32), "update": np.zeros(n, np.int32)}


def test_entropy_stats_by_hand():
    d = {"entropy": np.array([0.1, 0.2, 1.0, 2.0], np.float32),
         "logratio": np.log(np.array([1.001, 0.999, 1.5, 0.5])).astype(np.float32),
         "grpo_clipped": np.array([False, False, True, True]), "m2po_masked": np.array([False, False, False, True])}
    s = entropy_stats(d, n_bins=2)
    assert s["tokens"] == 4
    assert s["clipped"]["n"] == 2 and s["clipped"]["entropy_mean"] == pytest.approx(1.5)
    assert s["masked"]["n"] == 1 and s["masked"]["entropy_mean"] == pytest.approx(2.0)
    assert s["both"]["n"] == 1 and s["clipped_only"]["n"] == 1 and s["masked_only"]["n"] == 0
    assert s["jaccard"] == pytest.approx(0.5)
    # |r - 1| = 0.001, 0.001, 0.5, 0.5 -> two log bins with two tokens each
    assert [b["n"] for b in s["bins"]] == [2, 2]
    assert [b["entropy_mean"] for b in s["bins"]] == pytest.approx([0.15, 1.5])
    assert s["spearman_entropy_vs_dev"] > 0.8


def test_entropy_command_on_dumped_steps(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "tokens").mkdir(parents=True)
    for step in (4, 9):
        d = _synthetic(seed=step)
        np.savez(run_dir / "tokens" / f"step_{step:06d}.npz", **d, meta_step=np.asarray(step),
                 meta_stale_k=np.asarray(8), meta_eps_low=np.asarray(0.2), meta_eps_high=np.asarray(0.2),
                 meta_m2po_threshold=np.asarray(0.04), meta_loss=np.asarray("grpo"))
    data, metas = load_dumps(run_dir)
    assert len(data["entropy"]) == 800 and sorted(m["step"] for m in metas) == [4, 9]
    args = argparse.Namespace(run_dir=str(run_dir), min_staleness=None, bins=8, out=None)
    assert entropy_run(args) == 0
    stats = json.loads((run_dir / "entropy" / "entropy.json").read_text())
    assert stats["min_staleness"] == 8 and stats["tokens"] == 400  # half the tokens are 8 updates old
    assert stats["steps"] == [4, 9]
    # the data were made so that removed tokens have high entropy
    assert stats["clipped"]["entropy_mean"] > stats["all"]["entropy_mean"]
    assert (run_dir / "entropy" / "entropy.png").stat().st_size > 10000
    assert "GRPO clip removes" in (run_dir / "entropy" / "entropy.md").read_text()
    with pytest.raises(ValueError, match="at least 9 updates old"):
        entropy_run(argparse.Namespace(run_dir=str(run_dir), min_staleness=9, bins=8, out=None))
    with pytest.raises(ValueError, match="dump_tokens_every"):
        entropy_run(argparse.Namespace(run_dir=str(tmp_path), min_staleness=None, bins=8, out=None))


def _dp_dump_worker(rank, world, payload):
    """One data-parallel rank: records the micro-batches of its shard of each mini-batch."""
    from megatron_m2po.actor.batch import dp_shard

    cfg, minis, values, out = payload
    actor = _FakeActor()
    dump = TokenDump(cfg, actor, Path(out))
    dump.begin(0)
    first = 0
    for j, (mini, (logp, ent)) in enumerate(zip(minis, values)):
        for mb in _microbatches(mini.samples, dp_shard(len(mini.samples), world, rank), 2):
            idx = mb.token_index.numpy()
            actor.token_hook(TokenRecord(4 + j, None, mb, torch.from_numpy(logp[idx]), torch.from_numpy(ent[idx]),
                                         None))
        dump.end_update(mini, 4 + j, first)
        first += len(mini.samples)
    return str(dump.write())


@pytest.mark.multiproc
def test_dump_over_data_parallel_ranks_equals_one_process(tmp_path):
    """Two gloo ranks, each recording its data-parallel shard: rank 0 writes the same file as one
    process recording everything."""
    from megatron_m2po.standins.dist_testing import run_distributed

    rng = np.random.default_rng(6)
    cfg = _dump_cfg(tmp_path, dump_tokens_every=1)
    minis = [RolloutBatch(_samples(rng, 5, version=0)), RolloutBatch(_samples(rng, 6, version=1))]
    values = []
    for m in minis:
        n = sum(s.response_ids.shape[0] for s in m.samples)
        values.append((-rng.random(n).astype(np.float32), rng.random(n).astype(np.float32)))
    res = run_distributed(_dp_dump_worker, 2, args=((cfg, minis, values, str(tmp_path / "dp")),), timeout_s=120)
    assert res[1] == "None" and res[0].endswith("step_000000.npz")
    single = _dp_dump_worker(0, 1, (cfg, minis, values, str(tmp_path / "one")))
    a, b = read_token_dump(Path(res[0]))[0], read_token_dump(Path(single))[0]
    assert set(a) == set(b) and len(a["token"]) > 20
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
