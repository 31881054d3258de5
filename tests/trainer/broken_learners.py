"""Learners that must fail the reward-rise test (tools/test_margins.py's broken variants).

``algo.plugins=broken_learners algo.loss=flipped_pg``: a policy gradient with the advantage's
sign flipped -- it pushes probability toward the wrong answers.
"""

from megatron_m2po.algo.losses import LossInputs, register_loss


@register_loss("flipped_pg")
def flipped_pg(x: LossInputs, settings=None):
    return -x.ratio * x.advantages, {}
