"""Rank 0's held-out evaluation: avg@k accuracy at the rollout temperature with the engines' weights."""

from __future__ import annotations

from typing import Any, Callable

from megatron_m2po.rollout import group_ids
from megatron_m2po.trainer.generation import GroupMaker
from megatron_m2po.utils.background_loop import BackgroundLoop
from megatron_m2po.utils.faults import fault_point


class Evaluator:
    """Samples ``samples`` responses per item of every evaluation set and scores them.

    ``eval_sets``: name -> prompt items (``data.eval_*``); ``correct``: the reward at which a
    response counts as correct (``reward.correct``); ``drain``: waits until no generation is in
    flight (an evaluation must not overlap a scheduled step's generation); ``wait(fut, what)``:
    the bounded, interruptible wait of the rollout side (:func:`~.waiting.wait_future`)."""

    def __init__(self, eval_sets: dict[str, list], *, samples: int, correct: float, maker: GroupMaker,
                 bg: BackgroundLoop, drain: Callable[[], None], wait: Callable[[Any, str], Any]):
        self.eval_sets, self.samples, self.correct = eval_sets, samples, correct
        self.maker, self.bg, self.drain, self.wait = maker, bg, drain, wait

    def evaluate(self, step: int) -> dict[str, float]:
        """``eval/<set>/acc`` for every evaluation set, after ``step`` steps."""
        self.drain()
        out = {}
        for name, items in self.eval_sets.items():
            ctx = self.maker.context(group_ids.eval_prefix(name, step), n_samples=self.samples)
            groups = self.wait(self.bg.submit(self.maker.producer(ctx, items)), f"the evaluation on {name!r}")
            fault_point("evaluation")
            rewards = [float(t.reward) for g in groups for t in g.trajectories]
            correct = sum(r >= self.correct for r in rewards)
            out[f"eval/{name}/acc"] = correct / max(1, len(rewards))
        return out
