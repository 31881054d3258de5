"""Dynamic sampling (DAPO, arXiv 2503.14476 §3.2): which generated groups may train.

A GRPO group whose rewards are all equal has advantage zero for every sample: it adds no
gradient, only dilutes the step (and the token-mean denominator). ``rollout.filter=zero_variance``
drops such groups before they reach the store's training queue, and the generators make up for
them with more prompts (:mod:`megatron_m2po.rollout_service.groups`; docs/design.md §3a). Dropped
groups are counted, never silent: :class:`FilterCounters` feeds ``rollout/filtered_groups``.

Groups with an unscored trajectory (reward ``None``, scored later through the store) are kept:
their variance is not known yet.

verl's DAPO recipe (``docs/algo/dapo.md``, ``FilterGroupsConfig`` in
``verl/trainer/config/algorithm.py``: ``enable``, ``metric``, ``max_num_gen_batches``, <= 0
unlimited) keeps a group whose metric has non-zero std and generates further batches of
``gen_batch_size`` prompts until the train batch is full; here a group is dropped when its
rewards are all *exactly* equal, rounds are sized to the shortfall, and the cap
(``rollout.filter_max_rounds``) always holds.
"""

from __future__ import annotations

import threading

from megatron_m2po.store.types import Group

FILTERS = ("none", "zero_variance")


def has_reward_variance(group: Group) -> bool:
    """Whether ``group``'s rewards are not all equal (an unscored group counts as informative)."""
    rewards = [t.reward for t in group.trajectories]
    if any(r is None for r in rewards):
        return True
    return len({float(r) for r in rewards}) > 1


def split_groups(groups: list[Group], kind: str) -> tuple[list[Group], list[Group]]:
    """``(kept, dropped)`` under filter ``kind`` (``"none"`` keeps everything), order preserved."""
    if kind == "none":
        return list(groups), []
    if kind != "zero_variance":
        raise ValueError(f"rollout.filter={kind!r}: use one of {list(FILTERS)}")
    kept = [g for g in groups if has_reward_variance(g)]
    keep = {id(g) for g in kept}
    return kept, [g for g in groups if id(g) not in keep]


class FilterCounters:
    """Thread-safe counters of the filter (generation runs on the background loop, the trainer
    reads them): groups generated, dropped (equal rewards), surplus (informative, but beyond what
    the step needed, not stored) and over-sampling rounds. :meth:`take` returns the counts since
    the previous call (one step's metrics); ``totals`` since the process started."""

    KEYS = ("generated_groups", "filtered_groups", "surplus_groups", "oversample_rounds")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals = dict.fromkeys(self.KEYS, 0)
        self._taken = dict.fromkeys(self.KEYS, 0)

    def add(self, **counts: int) -> None:
        unknown = set(counts) - set(self.KEYS)
        assert not unknown, unknown
        with self._lock:
            for k, v in counts.items():
                self.totals[k] += int(v)

    def take(self) -> dict[str, float]:
        """``rollout/<key>`` (sums) since the previous :meth:`take`."""
        with self._lock:
            out = {f"rollout/{k}": float(self.totals[k] - self._taken[k]) for k in self.KEYS}
            self._taken = dict(self.totals)
        return out
