"""Rewards: math-verify scoring of the last ``\boxed{}`` answer, custom reward functions by
dotted path, and a process pool with per-call timeouts (docs/design.md §3, paper appendix B).

Trainer-facing API (see :mod:`megatron_m2po.rewards.registry` for the full contract)::

    from megatron_m2po.rewards import get_reward_fn
    reward = get_reward_fn(cfg.reward)
    res = reward.score_batch(texts, answers)   # RewardResult(scores, statuses, n_timeouts, n_errors, ...)
    reward.close()

Pure helpers usable anywhere: :func:`extract_last_boxed`, :func:`grade_math` (no timeout).

The names below load their module on first use, so importing a section of the config
(``rewards/settings.py``) does not import the whole package."""

from __future__ import annotations

from megatron_m2po.utils.lazy import lazy_exports

_WHERE = {
    **{n: "registry" for n in ('get_reward_fn', 'RewardFunction', 'RewardResult', 'batch_reward', 'check_reward_target', 'BUILTIN_REWARDS')},
    **{n: "extract" for n in ('extract_last_boxed',)},
    **{n: "math_grader" for n in ('grade_math',)},
}
__all__ = list(_WHERE)
__getattr__ = lazy_exports(__name__, _WHERE)
