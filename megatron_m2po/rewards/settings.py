"""The ``reward`` config section: which reward function and its scoring limits.

Read by ``rewards/registry.py`` (``get_reward_fn``), ``rewards/pool.py`` and ``rewards/http.py``;
it imports only the settings machinery.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_m2po.utils.settings import ConfigError, check_ranges
from megatron_m2po.utils.settings import setting as _f

__all__ = ["RewardConfig"]

@dataclass
class RewardConfig:
    """Reward function (docs/design.md §3, paper appendix B)."""

    fn: str = _f("math", help="'math' (math-verify), 'http' (a reward model server at reward.url) or a custom "
                 "'module:function' (per item or @batch_reward; may be 'async def').")
    correct: float = _f(1.0, help="Reward of a verified-correct final answer.")
    wrong: float = _f(0.1, help="Reward of an extracted but wrong answer.")
    no_answer: float = _f(0.0, help="Reward when no \\boxed{} answer is found.")
    timeout_s: float = _f(5.0, gt=0, help="Per-response scoring timeout (a timeout scores no_answer and is counted).")
    num_workers: int = _f(2, ge=1, help="Scoring processes.")
    url: str = _f("", help="reward.fn=http: the reward server's endpoint (http://host:port/path), POSTed "
                  '{"responses": [...], "answers": [...]} and answering {"scores": [...]} (rewards/http.py).')
    batch_size: int = _f(64, ge=1, help="reward.fn=http: responses per request.")
    max_concurrency: int = _f(4, ge=1, help="reward.fn=http: requests in flight at once.")
    request_timeout_s: float = _f(60.0, gt=0, help="reward.fn=http: deadline of one request; after the retries a "
                                  "timed-out batch scores no_answer and is counted (reward/n_timeouts).")
    max_retries: int = _f(2, ge=0, help="reward.fn=http: extra attempts of a request that cannot connect, times out "
                          "or gets 429 / 5xx (backoff 0.5 s, 1 s, ...); a server still unreachable stops the run.")

    def validate(self) -> None:
        """Field ranges, then ``reward.url`` given exactly when ``reward.fn=http`` reads it."""
        check_ranges(self, "reward")
        if self.fn.strip() == "http" and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"reward.fn=http needs reward.url=http://host:port/path of the reward server (got "
                              f"reward.url={self.url!r})")
        if self.url and self.fn.strip() != "http":
            raise ConfigError(f"reward.url={self.url!r} is only read with reward.fn=http (got reward.fn={self.fn!r})")
