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
