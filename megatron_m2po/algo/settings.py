"""The ``algo`` config section: which policy loss, its settings, and the advantage estimator.

The loss-specific sub-sections (``algo.m2po``, ``algo.grpo``, ..., ``algo.kl``) are the loss
settings of ``algo/loss_settings.py``; this section composes them with the loss-independent
fields. It imports only the settings machinery and the loss settings, so that loading a config
does not import torch; the loss registry (``algo/registry.py``, torch) is imported only when the
section validates ``algo.loss``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_m2po.algo.loss_settings import (BUILTIN_LOSS_SETTINGS, AReaLM2POConfig, CISPOConfig, GRPOConfig,
                                             DistillConfig, GSPOConfig, IcePopConfig, KLConfig, M2POConfig, MISConfig,
                                             VCPOConfig)
from megatron_m2po.utils.settings import ConfigError, check_ranges, settings_from_dict
from megatron_m2po.utils.settings import setting as _f

__all__ = ["AlgoConfig"]

@dataclass
class AlgoConfig:
    """Policy loss and advantage estimation (docs/design.md §3).

    ``loss`` names an entry of the loss registry (``algo/losses.py``); a loss's own settings live
    in its section (``algo.m2po.*``, ``algo.grpo.*``, ``algo.gspo.*``, ``algo.cispo.*``, ``algo.icepop.*``,
    ``algo.mis.*``, ``algo.areal_m2po.*``, ``algo.vcpo.*``), or, for a
    plugin loss that declares a settings dataclass, in ``algo.loss_options``.
    """

    loss: str = _f("m2po", help="Policy loss: a name registered with megatron_m2po.algo.losses.register_loss "
                   "(built in: m2po, grpo, no_tr, gspo, cispo, icepop, mis, areal_m2po, vcpo; algo.plugins may "
                   "register more).")
    plugins: list[str] = _f(factory=list, help="Modules imported when the config is validated (dotted paths, e.g. "
                            "my_pkg.losses), so that their register_loss calls run.")
    m2po: M2POConfig = field(default_factory=M2POConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    gspo: GSPOConfig = field(default_factory=GSPOConfig)
    cispo: CISPOConfig = field(default_factory=CISPOConfig)
    icepop: IcePopConfig = field(default_factory=IcePopConfig)
    mis: MISConfig = field(default_factory=MISConfig)
    areal_m2po: AReaLM2POConfig = field(default_factory=AReaLM2POConfig)
    vcpo: VCPOConfig = field(default_factory=VCPOConfig)
    kl: KLConfig = field(default_factory=KLConfig)  # reference-model KL, any loss (algo/kl.py)
    distill: DistillConfig = field(default_factory=DistillConfig)  # on-policy distillation (algo/distill.py)
    loss_options: dict[str, Any] = _f(factory=dict, help="Settings of a plugin loss, checked against the settings "
                                      "dataclass it registered (built-in losses read algo.<loss>.*).")
    logratio_clamp: float = _f(20.0, gt=0.0, help="log(pi_theta / pi_behav) is clamped to [-c, c] before exp.")
    tis: bool = _f(False, help="Truncated importance sampling weight min(p_train_behav / p_engine_behav, C) (paper eq. 6).")
    tis_cap: float = _f(2.0, gt=0.0, help="C of the TIS weight.")
    recompute_behav_logprobs: bool = _f(False, help="Recompute behaviour log-probs with the trainer at generation time "
                                        "(enables TIS and the mismatch KL).")
    advantage: Literal["grpo", "grpo_no_std"] = _f("grpo", help="Advantage estimator: GRPO group normalisation.")
    adv_eps: float = _f(1e-6, gt=0.0, help="Added to the group std in the GRPO advantage.")
    entropy_coef: float = _f(0.0, ge=0.0, help="Entropy bonus coefficient.")
    routing_replay: Literal["none", "rollout"] = _f(
        "none", help="MoE routing replay (R3): 'rollout' replays the experts the engine's routers picked for every "
        "token (rollout.return_routed_experts) in the trainer's forwards that compute log-probs and gradients, "
        "instead of routing with the trainer's router (docs/moe.md).")

    def validate(self) -> None:
        """Field ranges, ``algo.loss`` and its settings, then the TIS pairing."""
        check_ranges(self, "algo")
        self._check_loss()
        if self.tis and not self.recompute_behav_logprobs:
            raise ConfigError("algo.tis=true needs algo.recompute_behav_logprobs=true (TIS compares trainer and engine "
                              "behaviour log-probs)")
        try:
            self.distill.check()
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _check_loss(self) -> None:
        """``algo.loss`` names a registered loss (after importing ``algo.plugins``); its settings are valid."""
        if not self.plugins and self.loss in BUILTIN_LOSS_SETTINGS:  # no torch needed (loss_settings.py)
            self._check_builtin_loss()
            return
        from megatron_m2po.algo import losses  # the registry; imports torch, so only when validating

        try:
            losses.load_plugins(self.plugins)
        except ValueError as e:
            raise ConfigError(str(e)) from e.__cause__
        try:
            spec = losses.get_loss(self.loss)
        except ValueError as e:
            raise ConfigError(f"algo.loss={self.loss!r}: {e}") from None
        if self.loss_options and (spec.settings is None or isinstance(getattr(self, spec.name, None), spec.settings)):
            where = f"it reads algo.{spec.name}.*" if spec.settings is not None else "it has no settings"
            raise ConfigError(f"algo.loss_options={self.loss_options!r} is only read by a plugin loss that registers a "
                              f"settings dataclass; loss {self.loss!r} ignores it ({where})")
        if spec.settings is not None and not isinstance(getattr(self, spec.name, None), spec.settings):
            # a plugin's settings: checked like the rest of the tree, then stored complete and coerced
            self.loss_options = dataclasses.asdict(settings_from_dict(spec.settings, self.loss_options,
                                                                      "algo.loss_options"))
        self._check_settings(losses.loss_settings(spec, self))

    def _check_builtin_loss(self) -> None:
        """:meth:`_check_loss` for a built-in loss without plugins, the same rules on the same
        settings, from the table of ``loss_settings.BUILTIN_LOSS_SETTINGS``."""
        cls = BUILTIN_LOSS_SETTINGS[self.loss]
        if self.loss_options:
            where = f"it reads algo.{self.loss}.*" if cls is not None else "it has no settings"
            raise ConfigError(f"algo.loss_options={self.loss_options!r} is only read by a plugin loss that registers a "
                              f"settings dataclass; loss {self.loss!r} ignores it ({where})")
        self._check_settings(getattr(self, self.loss) if cls is not None else None)

    @staticmethod
    def _check_settings(settings) -> None:
        try:
            if hasattr(settings, "check"):
                settings.check()
        except ValueError as e:
            raise ConfigError(str(e)) from None
