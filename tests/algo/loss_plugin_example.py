"""A policy loss defined outside the package and loaded through ``algo.plugins``.

Used by tests/algo/test_loss_registry.py (``algo.plugins=[loss_plugin_example]``,
``algo.loss=scaled_pg_example``): a plain policy gradient ``scale * r * A`` whose ``scale`` is
the loss's own setting (``algo.loss_options.scale``). ``CALLS`` records every call in this
process, so the test can check the trainer really ran it.
"""

from dataclasses import dataclass, field

from megatron_m2po.algo.losses import LossInputs, register_loss
from megatron_m2po.algo.metrics import Metric

CALLS: list[int] = []  # loss tokens of each micro-batch the loss was called on


@dataclass
class ScaledPGSettings:
    scale: float = field(default=1.0, metadata={"gt": 0.0, "help": "Multiplies the objective."})


@register_loss("scaled_pg_example", settings=ScaledPGSettings)
def scaled_pg(x: LossInputs, s: ScaledPGSettings):
    CALLS.append(x.n_tokens)
    return s.scale * x.ratio * x.advantages, {"example/scale": Metric(s.scale, "max")}
