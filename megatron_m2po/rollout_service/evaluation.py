"""Rank 0's held-out evaluation: avg@k accuracy at the rollout temperature with the engines' weights."""

from __future__ import annotations

from megatron_m2po.rollout import group_ids
from megatron_m2po.rollout_service.groups import GroupSampler
from megatron_m2po.rollout_service.scheduled import ScheduledGeneration
from megatron_m2po.utils.background_loop import BackgroundLoop
from megatron_m2po.utils.faults import fault_point


class Evaluator:
    """Samples ``samples`` responses per item of every evaluation set and scores them.

    ``eval_sets``: name -> prompt items (``data.eval_*``); ``correct``: the reward at which a
    response counts as correct (``reward.correct``); ``scheduled``: scheduled generation, drained
    first (an evaluation must not overlap a scheduled step's generation) and whose bounded,
    interruptible wait (:func:`~.waiting.wait_future`) the evaluation waits with."""

    def __init__(self, eval_sets: dict[str, list], *, samples: int, correct: float, sampler: GroupSampler,
                 bg: BackgroundLoop, scheduled: ScheduledGeneration):
        self.eval_sets, self.samples, self.correct = eval_sets, samples, correct
        self.sampler, self.bg, self.scheduled = sampler, bg, scheduled

    def evaluate(self, step: int) -> dict[str, float]:
        """``eval/<set>/acc`` for every evaluation set, after ``step`` steps."""
        self.scheduled.drain()
        out = {}
        for name, items in self.eval_sets.items():
            ctx = self.sampler.context(group_ids.eval_prefix(name, step), n_samples=self.samples)
            groups = self.scheduled.wait(self.bg.submit(self.sampler.producer(ctx, items)),
                                         f"the evaluation on {name!r}", interruptible=True)
            fault_point("evaluation")
            rewards = [float(t.reward) for g in groups for t in g.trajectories]
            correct = sum(r >= self.correct for r in rewards)
            out[f"eval/{name}/acc"] = correct / max(1, len(rewards))
        return out
