"""Rewards: math-verify scoring of the last ``\\boxed{}`` answer, custom reward functions by
dotted path, and a process pool with per-call timeouts (docs/design.md §3, paper appendix B).

Trainer-facing API (see :mod:`megatron_m2po.rewards.registry` for the full contract)::

    from megatron_m2po.rewards import get_reward_fn
    reward = get_reward_fn(cfg.reward)
    res = reward.score_batch(texts, answers)   # RewardResult(scores, statuses, n_timeouts, n_errors, ...)
    reward.close()

Pure helpers usable anywhere: :func:`extract_last_boxed`, :func:`grade_math` (no timeout).
"""

from megatron_m2po.rewards.extract import extract_last_boxed
from megatron_m2po.rewards.math_grader import grade_math
from megatron_m2po.rewards.registry import (
    BUILTIN_REWARDS,
    RewardFunction,
    RewardResult,
    batch_reward,
    check_reward_target,
    get_reward_fn,
)

__all__ = [
    "get_reward_fn",
    "RewardFunction",
    "RewardResult",
    "batch_reward",
    "check_reward_target",
    "BUILTIN_REWARDS",
    "extract_last_boxed",
    "grade_math",
]
