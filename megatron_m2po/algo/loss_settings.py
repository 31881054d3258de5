"""Settings of the built-in policy losses: the config sections ``algo.m2po``, ``algo.grpo``,
``algo.gspo``, ``algo.cispo`` (``megatron_m2po.config.AlgoConfig``).

Each loss owns its dataclass; the loss registry (``algo/losses.py``) names it in the loss's
:class:`~megatron_m2po.algo.losses.LossSpec`. Fields carry ``help`` and numeric ranges
(``ge``/``gt``/``le``/``lt``) in their metadata, which the config loader enforces; ``check()``
holds the cross-field rules (ValueError naming the keys). No torch and no config import here,
so that ``config.py`` can build its tree from these classes without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

__all__ = ["M2POConfig", "GRPOConfig", "GSPOConfig", "CISPOConfig"]


def _f(default: Any, *, help: str, ge: float | None = None, gt: float | None = None, lt: float | None = None) -> Any:
    return field(default=default, metadata={"help": help, "ge": ge, "gt": gt, "le": None, "lt": lt})


@dataclass
class M2POConfig:
    """Settings of ``algo.loss=m2po`` (paper Algorithm 1; docs/design.md §3)."""

    threshold: float = _f(0.04, ge=0.0, help="M2PO budget tau on the mean of (log r)^2 over trust-region tokens.")
    rule: Literal["remove", "cap"] = _f("remove", help="'remove' = paper Algorithm 1; 'cap' = the released code's rule.")
    scope: Literal["global", "microbatch"] = _f("global", help="'global' = whole optimizer mini-batch over all DP x CP ranks "
                                                "(a forward-only pre-pass); 'microbatch' = per micro-batch per rank "
                                                "(released code).")
    mask_strategy: Literal["prepass", "correct", "auto"] = _f(
        "auto", help="How the actor gets the exact global mask (scope=global; the same update either way): "
        "'prepass' = a forward-only pass over the mini-batch before forward-backward; 'correct' = "
        "forward-backward with a running estimate of the mask (Algorithm 1 over the tokens seen so far), then the "
        "exact mask, then a forward-backward "
        "of the difference on only the sequences (truncated after their last changed token) whose "
        "keep changed; 'auto' = 'correct' while the previous update's measured correction cost is "
        "below a pre-pass (the first update takes the pre-pass, which measures it), else 'prepass'. "
        "'correct' needs model dropout 0 (auto takes the pre-pass there).")

    def check(self) -> None:
        if self.rule == "remove" and self.scope == "microbatch":
            raise ValueError("algo.m2po.rule='remove' with algo.m2po.scope='microbatch' is not a supported pairing: "
                             "use scope=global (paper) or rule=cap (released code)")
        if self.mask_strategy == "correct" and self.scope == "microbatch":
            raise ValueError("algo.m2po.mask_strategy='correct' chooses how the global mask is taken; with "
                             "algo.m2po.scope='microbatch' there is none: use mask_strategy=prepass / auto or "
                             "scope=global")


@dataclass
class GRPOConfig:
    """Settings of ``algo.loss=grpo`` (PPO clip, clip-higher, dual clip)."""

    eps_low: float = _f(0.2, gt=0.0, lt=1.0, help="PPO clip: ratio lower bound 1 - eps_low.")
    eps_high: float = _f(0.2, gt=0.0, help="PPO clip: ratio upper bound 1 + eps_high (clip-higher when > eps_low).")
    dual_clip: Optional[float] = _f(None, gt=1.0, help="Dual-clip constant c (> 1) for negative advantages; None = off.")

    def check(self) -> None:
        if self.eps_high < self.eps_low:
            raise ValueError(f"algo.grpo.eps_high={self.eps_high} < algo.grpo.eps_low={self.eps_low}: clip-higher "
                             "needs eps_high >= eps_low")


@dataclass
class GSPOConfig:
    """Settings of ``algo.loss=gspo`` (sequence-level ratio clip)."""

    eps_low: float = _f(3e-4, gt=0.0, help="GSPO sequence-ratio clip, low side.")
    eps_high: float = _f(4e-4, gt=0.0, help="GSPO sequence-ratio clip, high side.")


@dataclass
class CISPOConfig:
    """Settings of ``algo.loss=cispo`` (stop-gradient clipped ratio)."""

    eps_high: float = _f(2.0, gt=0.0, help="The stop-grad ratio is clipped to at most 1 + eps_high.")
