"""On-policy distillation (``algo.distill``; algo/distill.py, actor/teacher.py, trainer/distill.py).

Hand-computed values for the advantage and loss placements and their metrics; a teacher of another
tokenizer refused in one line; the megatron teacher's log-probs equal an independent HF forward of
the teacher at TP=2, PP=2 and CP=2 (gloo); both placements on the actor, end to end through
``distill_step`` and ``train_update``."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

import actor_testlib as lib
from megatron_m2po.algo.distill import distill_loss_term, distill_step_metrics, distilled_advantages
from megatron_m2po.standins.dist_testing import run_distributed


def test_advantage_placement_by_hand():
    adv = np.array([0.5, 0.5, 0.5, 0.5], np.float32)
    behav = np.array([-1.0, -2.0, -0.5, -3.0], np.float32)
    teacher = np.array([-0.5, -3.0, -0.5, np.nan], np.float32)  # the last is no loss token: ignored
    mask = np.array([1, 1, 1, 0], np.uint8)
    got = distilled_advantages(adv, behav, teacher, mask, coef=2.0)
    # A - 2 * (behav - teacher): 0.5 - 2 * (-0.5) = 1.5, 0.5 - 2 * 1.0 = -1.5, 0.5 - 0 = 0.5; masked: as it was
    np.testing.assert_array_equal(got, np.array([1.5, -1.5, 0.5, 0.5], np.float32))
    assert got.dtype == np.float32
    m = distill_step_metrics([adv, np.array([-1.0, 1.0], np.float32)], [behav, np.array([-1.0, -1.0], np.float32)],
                             [teacher, np.array([-2.0, -1.0], np.float32)], [mask, np.array([1, 1], np.uint8)], 2.0)
    # loss tokens: d = -0.5, 1.0, 0.0 | 1.0, 0.0 -> mean 1.5 / 5; teacher -0.5 -3 -0.5 -2 -1 -> -7 / 5
    assert m["distill/reverse_kl"] == pytest.approx(0.3) and m["distill/teacher_logprob"] == pytest.approx(-1.4)
    # |A| over loss tokens: 0.5 x 3 + 1 + 1 = 3.5; |2 d|: 1 + 2 + 0 + 2 + 0 = 5 -> 5 / 8.5
    assert m["distill/advantage_share"] == pytest.approx(5 / 8.5)
    with pytest.raises(ValueError, match="1 non-finite teacher log-probs on loss tokens, at token indices \\[1\\]"):
        distilled_advantages(adv, behav, np.array([0.0, np.inf, 0.0, 0.0]), mask, 1.0)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_loss_placement_by_hand(estimator):
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([-0.5, -3.0, 7.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 0], dtype=torch.uint8)
    term, m = distill_loss_term(logp, teacher, mask, denominator=4.0, coef=0.5, estimator=estimator)
    d = np.array([-0.5, 1.0])  # logp - teacher on the loss tokens
    k = d if estimator == "k1" else np.exp(-d) + d - 1
    assert float(term.detach()) == pytest.approx(0.5 * k.sum() / 4.0)
    term.backward()
    dk = np.ones(2) if estimator == "k1" else 1 - np.exp(-d)  # dk/dlogp
    np.testing.assert_allclose(logp.grad.numpy(), np.r_[0.5 * dk / 4.0, 0.0])
    assert m["distill/reverse_kl"].value == pytest.approx(0.25) and m["loss/distill"].value == pytest.approx(float(term.detach()))
    assert m["distill/teacher_logprob"].value == pytest.approx(-1.75)


def _tokenized(d: str, extra: str = "") -> str:
    from megatron_m2po.standins import tiny_base as tb

    tok = tb.build_tokenizer()
    if extra:
        tok.add_special_tokens({"additional_special_tokens": [extra]})
    tok.save_pretrained(d)
    return d


def test_a_teacher_of_another_tokenizer_is_refused_in_one_line(tmp_path):
    from megatron_m2po.utils.hf_dir import check_same_tokenizer
    from megatron_m2po.utils.errors import UserError

    a, b, c = (_tokenized(str(tmp_path / n), x) for n, x in (("a", ""), ("b", ""), ("c", "<tool>")))
    check_same_tokenizer(a, b)
    with pytest.raises(UserError) as e:
        check_same_tokenizer(a, c)
    msg = str(e.value)
    assert msg.startswith(f"algo.distill.teacher={c}: its tokenizer is not the student's ({a})") and "\n" not in msg


def _models(root: str) -> tuple[str, str]:
    student, teacher = os.path.join(root, "student"), os.path.join(root, "teacher")
    if torch.distributed.get_rank() == 0:
        _tokenized(lib.make_tiny_hf("qwen3", student, seed=4))
        _tokenized(lib.make_tiny_hf("qwen3", teacher, seed=9, layers=4))  # another model: deeper, other weights
    torch.distributed.barrier()
    return student, teacher


def _teacher_layouts(rank, world_size, root, layouts):
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import BatchPlan, RolloutBatch, ShardedBatch
    from megatron_m2po.trainer.distill import distill_step

    student, teacher = _models(root)
    samples = lib.make_samples(8, seed=5)
    out = []
    for tp, pp, cp, placement in layouts:
        cfg = lib.actor_config(student, tp=tp, pp=pp, mbs=2)
        cfg.parallel.context_parallel, cfg.parallel.packing = cp, cp > 1
        cfg.algo.distill.teacher, cfg.algo.distill.coef, cfg.algo.distill.placement = teacher, 0.5, placement
        actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=10))
        lps = actor.teacher_logprobs(RolloutBatch(samples))
        res = {"layout": (tp, pp, cp, placement), "teacher": lps}
        if placement == "advantage":  # the trainer's step: this rank's shard, rank 0 the whole step too
            plan = BatchPlan.of(samples)
            mine = [copy.copy(s) for s in samples]
            shard = ShardedBatch(plan, {i: mine[i] for i in actor.shards(plan)[actor.dp_rank]})
            lead = [copy.copy(s) for s in samples] if rank == 0 else None
            res["metrics"] = distill_step(actor, [shard], lead, cfg.algo)
            res["advantages"] = {i: s.advantages for i, s in shard.samples.items()}
            res["lead"] = None if lead is None else [s.advantages for s in lead]
        else:
            res["update"] = actor.train_step(RolloutBatch(samples), num_minibatches=1)[0]
        actor.close()
        if placement == "loss":  # mode=sglang: no teacher in the actor, the scores the samples carry
            cfg.algo.distill.mode = "sglang"
            actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=10))
            assert actor.teacher is None
            scored = [copy.copy(s) for s in samples]
            for smp, lp in zip(scored, lps):
                smp.teacher_logprobs = lp
            res["update_sglang"] = actor.train_step(RolloutBatch(scored), num_minibatches=1)[0]
            actor.close()
        out.append(res)
    return out


@pytest.mark.slow  # two gloo ranks, four actors: the full suite's lane
def test_megatron_teacher_equals_hf_at_tp2_pp2_cp2_and_both_placements(tmp_path):
    """The teacher (another model than the student, same tokenizer) gives the log-probs of an HF
    forward of the teacher at TP=2, PP=2 and CP=2; the advantage placement writes A - coef * (behav -
    teacher) into every rank's shard and rank 0's whole step, with the step's metrics on every rank;
    the loss placement adds ``loss/distill`` to the update's loss, and gives the very same update in
    mode=sglang from the teacher's scores carried by the samples (no teacher in the actor)."""
    layouts = [(2, 1, 1, "advantage"), (1, 2, 1, "loss"), (1, 1, 2, "advantage")]
    per_rank = run_distributed(_teacher_layouts, 2, args=(str(tmp_path), layouts), timeout_s=420)
    samples = lib.make_samples(8, seed=5)
    want = [lib.hf_logprobs(str(tmp_path / "teacher"), s.prompt_ids, s.response_ids) for s in samples]
    student = [lib.hf_logprobs(str(tmp_path / "student"), s.prompt_ids, s.response_ids) for s in samples]
    assert not np.allclose(np.concatenate(want), np.concatenate(student), atol=1e-2)  # a different model
    for rank, results in enumerate(per_rank):
        for res in results:
            for got, ref in zip(res["teacher"], want):
                np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5, err_msg=str(res["layout"]))
            if res["layout"][3] == "advantage":
                expect = [distilled_advantages(s.advantages, s.behav_logprobs, t, s.loss_mask, 0.5)
                          for s, t in zip(samples, want)]
                for i, a in res["advantages"].items():
                    np.testing.assert_allclose(a, expect[i], rtol=0, atol=1e-5)
                if rank == 0:
                    assert len(res["lead"]) == 8
                    for a, e in zip(res["lead"], expect):
                        np.testing.assert_allclose(a, e, rtol=0, atol=1e-5)
                m = distill_step_metrics([s.advantages for s in samples], [s.behav_logprobs for s in samples], want,
                                         [s.loss_mask for s in samples], 0.5)
                assert res["metrics"] == pytest.approx(m, abs=1e-5)
            else:
                u = res["update"]
                assert u["loss/total"] == pytest.approx(u["loss/policy"] + u["loss/distill"], rel=1e-5, abs=1e-9)
                assert u["loss/distill"] > 0 and np.isfinite(u["distill/reverse_kl"])
                # the same update from the scores stored with the samples (mode=sglang, no teacher pass)
                assert res["update_sglang"] == pytest.approx(u, rel=1e-6, abs=1e-9)
