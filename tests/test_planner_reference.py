"""The planner counts the frozen reference of algo.kl (plan/memory.py, actor/reference.py): its
weights at param_bytes per parameter of the stage, on the GPU only while the forward-backward's
activations are not."""

import pytest

from megatron_m2po.config import Config
from megatron_m2po.plan import memory as P


@pytest.mark.parametrize("tokens", [512, 65536])  # activations below, then above the reference's bytes
def test_reference_is_counted_as_a_transient_of_the_weights(tokens):
    m = P.model_shape("Qwen/Qwen3-8B")
    base = P.Layout(tp=2, pp=2, dp=2, micro_batch_tokens=tokens, seq_len=min(tokens, 4096))
    with_ref = P.Layout(**{**base.__dict__, "reference": True})
    for s0, s1 in zip(P.estimate(m, base), P.estimate(m, with_ref)):
        assert s0.reference == 0.0 and s1.reference == s1.weights == s0.weights > 0
        assert s1.total - s0.total == pytest.approx(max(s0.activations, s1.reference) - s0.activations)
    assert (P.estimate(m, with_ref)[0].total > P.estimate(m, base)[0].total) == (tokens == 512)


def test_layout_from_config_asks_for_the_reference_with_a_kl_coefficient():
    cfg = Config()
    assert not P.layout_from_config(cfg).reference
    cfg.algo.kl.coef = 0.05
    assert P.layout_from_config(cfg).reference


def test_the_distillation_teacher_is_counted_with_its_own_shape():
    """``algo.distill`` (actor/teacher.py): the teacher's weights, of its own shape split by the
    actor's layout, are a transient beside the reference (never on the GPU with the activations or
    each other) and a pinned copy in the node's host memory; the plan's table names it."""
    student, teacher = P.model_shape("Qwen/Qwen3-8B"), P.model_shape("Qwen/Qwen3-32B")
    base = P.Layout(tp=2, pp=2, dp=2, micro_batch_tokens=512, seq_len=512, reference=True)
    with_t = P.Layout(**{**base.__dict__, "teacher": teacher})
    for i, (s0, s1) in enumerate(zip(P.estimate(student, base), P.estimate(student, with_t))):
        vocab_p = P.padded_vocab(teacher.vocab, 2, base.vocab_divisible_by)
        by_hand = P.stage_params(teacher, base, i, vocab_p) * base.param_bytes  # dense: no experts
        assert s0.teacher == 0.0 and s1.teacher == pytest.approx(by_hand) and s1.teacher > 3 * s1.weights
        assert s1.total - s0.total == pytest.approx(max(s1.activations, s1.reference, s1.teacher)
                                                    - max(s0.activations, s0.reference))
    cfg = Config()
    cfg.model.hf_path = "Qwen/Qwen3-8B"
    assert P.layout_from_config(cfg).teacher is None
    cfg.algo.distill.teacher, cfg.algo.distill.coef = "Qwen/Qwen3-32B", 1.0
    assert P.layout_from_config(cfg).teacher == teacher
    cfg.algo.distill.mode = "sglang"  # teacher engines of their own: nothing in the trainer's memory
    assert P.layout_from_config(cfg).teacher is None
    p = P.plan(student, with_t)
    assert p.host.parts["teacher copy (pinned)"] == pytest.approx(p.worst.teacher * with_t.gpus_per_node)


def test_the_teachers_forward_is_in_the_step_time():
    """``--search`` charges a Megatron teacher's step: its weights back from pinned host memory (at
    ``h2d_gbs``) and a forward-only pass over every micro-batch of the step with one pipeline fill and
    drain. A teacher of the student's own shape costs exactly M2PO's forward-only mask pre-pass (the
    same passes) plus the copy; a teacher 4x the student's matmul size costs about 4x that."""
    from megatron_m2po.plan import search as S

    student = P.model_shape("Qwen/Qwen3-8B")
    work = S.Workload(sequences=64, seq_len=4096, packing=True, prepass=True, updates_per_step=1)
    lay = P.Layout(tp=2, pp=2, dp=1, micro_batch_tokens=4096, seq_len=4096)
    cm = S.CostModel()
    _, plain = S.step_time(student, lay, work, 1, cm)
    assert "teacher" not in plain
    same = P.Layout(**{**lay.__dict__, "teacher": student})
    _, t = S.step_time(student, same, work, 1, cm)
    copy = max(P.teacher_stage_bytes(same, i) for i in range(same.pp)) / (cm.h2d_gbs * 1e9)
    assert t["teacher"] == pytest.approx(plain["mask"] + copy, rel=1e-9)
    assert t["step"] == pytest.approx(plain["step"] + t["teacher"], rel=1e-9)
    big = P.model_shape("Qwen/Qwen3-32B")
    _, tb = S.step_time(student, P.Layout(**{**lay.__dict__, "teacher": big}), work, 1, cm)
    ratio = big.matmul_params() * big.layers / (student.matmul_params() * student.layers)
    assert 0.8 * ratio < tb["teacher"] / t["teacher"] < 1.2 * ratio
