"""Settings of the built-in policy losses: the config sections ``algo.m2po``, ``algo.grpo``,
``algo.gspo``, ``algo.cispo``, ``algo.icepop``, ``algo.mis``, ``algo.areal_m2po``, ``algo.vcpo``
(``megatron_m2po.algo.settings.AlgoConfig``), and ``algo.kl``, the reference-model KL term every loss takes.

Each loss owns its dataclass; the loss registry (``algo/registry.py``) names it in the loss's
:class:`~megatron_m2po.algo.registry.LossSpec`. Fields carry ``help`` and numeric ranges
(``ge``/``gt``/``le``/``lt``) in their metadata, which the config loader enforces; ``check()``
holds the cross-field rules (ValueError naming the keys). No torch and no config import here
(only the settings machinery of ``utils/settings.py``), so that ``algo/settings.py`` and
``config.py`` can build the tree from these classes without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megatron_m2po.utils.settings import setting as _f

__all__ = ["M2POConfig", "GRPOConfig", "GSPOConfig", "CISPOConfig", "IcePopConfig", "MISConfig", "AReaLM2POConfig",
           "VCPOConfig", "KLConfig", "KL_ESTIMATORS", "DistillConfig", "BUILTIN_LOSS_SETTINGS"]


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


@dataclass
class IcePopConfig:
    """Settings of ``algo.loss=icepop`` (two-sided token masking of the ratio; algo/offpolicy_losses.py)."""

    low: float = _f(0.5, gt=0.0, help="IcePop alpha: tokens whose ratio pi_theta / pi_behav is below it are masked.")
    high: float = _f(5.0, gt=0.0, help="IcePop beta: tokens whose ratio is above it are masked.")

    def check(self) -> None:
        if self.high <= self.low:
            raise ValueError(f"algo.icepop.high={self.high} <= algo.icepop.low={self.low}: the kept ratio range "
                             "[low, high] must not be empty (IcePop: alpha=0.5, beta=5)")


@dataclass
class MISConfig:
    """Settings of ``algo.loss=mis`` (masked importance sampling; algo/offpolicy_losses.py)."""

    level: Literal["token", "sequence"] = _f(
        "sequence", help="'token': each token's ratio is masked on its own; 'sequence': the product of the "
        "sequence's token ratios (Seq-MIS) masks the whole sequence.")
    threshold: float = _f(2.0, gt=0.0, help="C: a ratio above it is masked (weight 0); below, it is the IS weight.")


@dataclass
class AReaLM2POConfig:
    """Settings of ``algo.loss=areal_m2po`` (AReaL's M2PO as merged in its PR 480; algo/offpolicy_losses.py)."""

    threshold: float = _f(0.04, ge=0.0, help="M2 budget over all loss tokens (AReaL actor.m2_threshold).")
    behav_imp_weight_cap: Optional[float] = _f(
        5.0, gt=0.0, help="Tokens whose behaviour importance weight pi_prox / pi_behav exceeds it are dropped "
        "(AReaL actor.behav_imp_weight_cap; 5.0 in its gsm8k_m2po.yaml); null = no cap.")
    scope: Literal["global", "microbatch"] = _f(
        "global", help="'global' = the mask over the whole optimizer mini-batch on every DP x CP rank (a forward-only "
        "pre-pass); 'microbatch' = per micro-batch per rank, as AReaL's loss function computes it.")


@dataclass
class VCPOConfig:
    """Settings of ``algo.loss=vcpo`` (ESS-scaled step size; algo/offpolicy_losses.py)."""

    is_threshold: float = _f(8.0, gt=0.0, help="C of the sequence-level truncated IS weight min(prod_t r_t, C) "
                             "(the authors' recipes: rollout_is=sequence, threshold 8).")
    ess_rule: Literal["sqrt", "linear"] = _f("sqrt", help="The update's LR is lr * min(1, ess_ratio / base_ess_ratio) "
                                             "** 0.5 ('sqrt', the paper's rule for Adam) or ** 1 ('linear').")
    base_ess_ratio: float = _f(1.0, gt=0.0, le=1.0, help="ESS ratio at and above which the LR is not reduced.")
    ess_clipped: bool = _f(False, help="Compute the ESS from the truncated weights min(w, C) instead of w "
                           "(the authors' ess_scaling.use_clipped; false in their recipes).")


KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass
class KLConfig:
    """Reference-model KL (``algo.kl``; every loss; algo/kl.py, actor/reference.py, docs/design.md §3)."""

    coef: float = _f(0.0, ge=0.0, help="Coefficient of the reference-model KL penalty: of the term added to the "
                     "policy loss (placement=loss: verl actor.kl_loss_coef, slime --kl-coef) or of the penalty taken "
                     "from the reward (placement=reward: verl algorithm.kl_ctrl.kl_coef); 0 = off (no reference model "
                     "is built).")
    estimator: Literal["k1", "k2", "k3"] = _f(
        "k3", help="Per-token estimator of KL(pi_theta || pi_ref) from d = logp - ref_logp (Schulman, "
        "'Approximating KL divergence'; verl core_algos.kl_penalty): 'k1' = d, 'k2' = d^2 / 2, 'k3' = "
        "exp(-d) + d - 1 with -d clamped to [-20, 20] and the result to [-10, 10] (verl low_var_kl).")
    placement: Literal["loss", "reward"] = _f(
        "loss", help="Where the penalty goes: 'loss' = a term coef * token-mean(k) of the policy log-probs added to "
        "every update's loss (verl use_kl_loss); 'reward' = coef * sum_t k(behav_logp_t, ref_logp_t) over a "
        "trajectory's loss tokens subtracted from its reward before the GRPO advantages (verl use_kl_in_reward; "
        "behaviour log-probs: the recomputed ones with algo.recompute_behav_logprobs), by a reference pass over "
        "the whole step; no loss term then.")


@dataclass
class DistillConfig:
    """On-policy distillation (``algo.distill``; every loss; algo/distill.py, trainer/distill.py):
    a teacher scores every sampled response token and its per-token reverse KL
    ``log pi_student - log pi_teacher`` enters the advantage or the loss."""

    teacher: str = _f("", help="The teacher: an HF model directory (or a tiny base name) whose tokenizer equals the "
                      "student's (refused by name otherwise). Empty: no distillation.")
    coef: float = _f(0.0, ge=0.0, help="Weight of the reverse KL; 0 = off (no teacher is built).")
    mode: Literal["megatron", "sglang"] = _f(
        "megatron", help="Where the teacher runs: 'megatron' = a frozen copy built by the actor's own build_model in "
        "the actor's layout, host-resident between uses like the reference (actor/reference.py); 'sglang' = teacher "
        "engines (started like the rollout fleet, or at teacher_addrs) score each leased response once, and the "
        "log-probs are stored with it (rollout_service/teacher.py).")
    teacher_addrs: list[str] = _f(factory=list, help="mode=sglang: http://host:port of teacher SGLang servers started "
                                  "elsewhere (serving algo.distill.teacher); empty: start teacher_engines here.")
    teacher_engines: int = _f(1, ge=1, help="mode=sglang without teacher_addrs: teacher engines to start, of "
                              "rollout.engine's kind through rollout.launcher.")
    teacher_engine_tp: int = _f(1, ge=1, help="mode=sglang: tensor-parallel size of each started teacher engine.")
    teacher_gpu_ids: list[int] = _f(factory=list, help="mode=sglang, launcher=local: the node's GPUs for the started "
                                    "teacher engines (teacher_engines x teacher_engine_tp of them, apart from the "
                                    "rollout engines' and the trainer's).")
    placement: Literal["advantage", "loss"] = _f(
        "advantage", help="'advantage' = A_t - coef * (behav_logp_t - teacher_logp_t) on every loss token, the "
        "student's log-prob at sampling time (slime --opd-type, prime-rl); 'loss' = coef * token-mean of the "
        "estimator of KL(student || teacher) on the current log-probs added to every update's loss, masked like "
        "every token term.")
    estimator: Literal["k1", "k2", "k3"] = _f(
        "k3", help="placement=loss: the per-token estimator of d = logp - teacher_logp (as algo.kl.estimator).")

    def check(self) -> None:
        if self.coef > 0 and not self.teacher:
            raise ValueError("algo.distill.coef > 0 needs algo.distill.teacher (an HF model directory whose "
                             "tokenizer equals the student's)")


# The built-in losses' names and settings classes (None: no settings), as algo/losses.py and
# algo/offpolicy_losses.py register them. Validating a config that names one of them, without
# plugins, reads this table instead of the registry, so `m2po config` / `m2po plan` (and a recipe's
# --dry-run) never import torch; tests/algo/test_loss_registry.py holds it equal to the registry.
BUILTIN_LOSS_SETTINGS: dict[str, Optional[type]] = {
    "m2po": M2POConfig, "no_tr": None, "grpo": GRPOConfig, "gspo": GSPOConfig, "cispo": CISPOConfig,
    "icepop": IcePopConfig, "mis": MISConfig, "areal_m2po": AReaLM2POConfig, "vcpo": VCPOConfig}
