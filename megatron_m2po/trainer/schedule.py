"""The run modes as schedules (sync / stale_k / async), and the exact staleness schedule of the
``stale_k`` and ``sync`` modes (docs/design.md §3).

Versions count optimizer updates. Step ``s`` performs ``U`` updates, from version ``u = s*U``
to ``u + U``; its mini-batch ``j`` is trained at version ``u + j``. The rollouts of step ``s``
are generated with the weights of version ``g(s) = u - k`` when ``u >= k`` (so mini-batch ``j``
has staleness exactly ``k + j``), and with the base weights (version 0) while version ``k`` does
not exist yet (fresh prompts for every such step). ``k = 0`` is on-policy: the first
mini-batch of every step has staleness 0.

The trainer walks versions in increasing order; at every version ``v`` it reached it generates
the data of all steps with ``g(s) == v`` (``events_at``), in step order. The data of a step can
therefore be produced up to ``k`` updates before it is needed, which is what lets generation
overlap training.

:class:`RunSchedule` and its subclasses (one per ``trainer.mode``, :func:`make_schedule`) say
what the training step generates, what it leases and when it pushes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_m2po.trainer.settings import TrainerConfig
    from megatron_m2po.rollout_service.service import RolloutService


def generation_version(step: int, updates_per_step: int, k: int) -> int:
    """Weight version whose rollouts step ``step`` trains on."""
    if step < 0 or updates_per_step < 1 or k < 0:
        raise ValueError(f"bad schedule arguments: step={step}, updates_per_step={updates_per_step}, k={k}")
    return max(0, step * updates_per_step - k)


def events_at(version: int, updates_per_step: int, k: int, num_steps: int) -> list[int]:
    """Steps (ascending) whose rollouts are generated at weight version ``version``."""
    if version == 0:
        # Every step that starts before version k exists trains on base-model rollouts.
        last = min(num_steps, k // updates_per_step + 1)
        return [s for s in range(last) if generation_version(s, updates_per_step, k) == 0]
    s, rem = divmod(version + k, updates_per_step)
    return [s] if rem == 0 and s < num_steps else []


def expected_staleness(step: int, minibatch: int, updates_per_step: int, k: int) -> int:
    """Staleness of mini-batch ``minibatch`` of ``step`` under the schedule."""
    return step * updates_per_step + minibatch - generation_version(step, updates_per_step, k)


# ---------------------------------------------------------------------- run modes as objects
class RunSchedule:
    """What a run mode (``trainer.mode``) decides; the training step asks it and runs straight.

    * what to generate: :meth:`steps_to_generate` at a version the trainer reached (scheduled
      steps), :attr:`background` (whether that overlaps training), :attr:`continuous` (the engines
      generate from the start of the run, on their own);
    * what to lease: :meth:`lease`;
    * when to push: :meth:`push_after_update` (besides the pushes generation at a new version needs);
    * resume: :meth:`catch_up_candidates` / :meth:`mark_caught_up`, :attr:`retires_ahead`,
      :attr:`redraws_step_prompts`, :meth:`state_dict` / :meth:`load_state_dict` (checkpointed).

    A new mode is a subclass registered in :data:`SCHEDULES` (and a ``trainer.mode`` literal).
    """

    mode = ""
    k = 0
    background = False
    continuous = False
    #: At a restart, unconsumed groups with tokens newer than the resume version are retired (they
    #: were made by weights that no longer exist); a schedule whose ids and versions are fixed keeps them.
    retires_ahead = False
    #: A step's prompts are drawn by its generation events at the step's start, and a resumed step
    #: draws them again: a checkpoint of a step stopped while waiting for its data records the
    #: dataset position from before those draws.
    redraws_step_prompts = False

    def __init__(self, trainer: "TrainerConfig"):
        self.updates_per_step, self.num_steps = trainer.num_updates_per_step, trainer.num_steps
        # Resume bookkeeping of the catch-up: steps generated off-schedule (step -> version), and the
        # step count up to which every generation event happened at its scheduled version.
        self.caught_up: dict[int, int] = {}
        self.scheduled_through = trainer.num_steps

    def steps_to_generate(self, version: int, start_step: int) -> list[int]:
        """Steps (ascending, none before ``start_step``) to generate with the weights of ``version``."""
        return []

    def lease(self, service: "RolloutService", step: int) -> tuple[list, Any]:
        """Rank 0: lease the groups ``step`` trains on from the rollout service; returns (groups, lease)."""
        raise NotImplementedError

    def push_after_update(self, version: int) -> bool:
        """Whether to push the weights after the update that made ``version``."""
        return False

    def catch_up_candidates(self, version: int, start_step: int) -> list[int]:
        """Steps whose generation event lies before the resume point ``version`` and that no
        checkpointed run scheduled (``trainer.num_steps`` raised since): generated now if missing."""
        return []

    def mark_caught_up(self, steps: list[int], version: int) -> None:
        """``steps`` are (or were, before a crash) generated off-schedule at ``version``."""
        self.caught_up.update({s: version for s in steps})

    def state_dict(self) -> dict:
        return {"mode": self.mode, "stale_k": self.k, "scheduled_through": self.num_steps,
                "caught_up": sorted(self.caught_up.items())}

    def load_state_dict(self, state: dict) -> None:
        # Checkpoints without these predate the catch-up: their run scheduled every step it trains.
        self.scheduled_through = int(state.get("scheduled_through", self.num_steps))
        self.caught_up = {int(s): int(v) for s, v in state.get("caught_up", [])}


class ExactSchedule(RunSchedule):
    """``stale_k``: step ``s`` trains on rollouts generated at :func:`generation_version` (``k``
    updates before its first update), generated in the background when ``k > 0``; exactly
    those groups are leased."""

    mode = "stale_k"
    redraws_step_prompts = True

    def __init__(self, trainer: "TrainerConfig"):
        super().__init__(trainer)
        self.k = self._k(trainer)
        self.background = self.k > 0  # on-policy data is needed right away; stale data overlaps training

    @staticmethod
    def _k(trainer: "TrainerConfig") -> int:
        return trainer.stale_k

    def generated_at(self, step: int) -> int:
        """The version whose weights generated (or generate) the rollouts of ``step``."""
        return self.caught_up.get(step, generation_version(step, self.updates_per_step, self.k))

    def steps_to_generate(self, version: int, start_step: int) -> list[int]:
        return [s for s in events_at(version, self.updates_per_step, self.k, self.num_steps) if s >= start_step]

    def lease(self, service: "RolloutService", step: int) -> tuple[list, Any]:
        return service.lease(step, step * self.updates_per_step, generated_at=self.generated_at(step))

    def catch_up_candidates(self, version: int, start_step: int) -> list[int]:
        # Steps the checkpointed run scheduled at their exact version, and those it caught up itself, are not.
        return [s for s in range(max(start_step, self.scheduled_through), self.num_steps)
                if generation_version(s, self.updates_per_step, self.k) < version and s not in self.caught_up]


class SyncSchedule(ExactSchedule):
    """``sync``: on-policy, the exact schedule with ``k = 0`` (mini-batch ``j`` has staleness ``j``)."""

    mode = "sync"

    @staticmethod
    def _k(trainer: "TrainerConfig") -> int:
        return 0


class AsyncSchedule(RunSchedule):
    """``async``: the engines generate continuously from the start; weights are pushed every
    ``trainer.sync_every_updates`` updates; any groups within ``store.max_staleness`` are leased."""

    mode = "async"
    continuous = True
    retires_ahead = True

    def __init__(self, trainer: "TrainerConfig"):
        super().__init__(trainer)
        self.sync_every_updates = trainer.sync_every_updates

    def lease(self, service: "RolloutService", step: int) -> tuple[list, Any]:
        return service.lease(step, step * self.updates_per_step)

    def push_after_update(self, version: int) -> bool:
        return version % self.sync_every_updates == 0


SCHEDULES: dict[str, type[RunSchedule]] = {"sync": SyncSchedule, "stale_k": ExactSchedule, "async": AsyncSchedule}


def make_schedule(trainer: "TrainerConfig") -> RunSchedule:
    """The schedule of ``trainer.mode``."""
    try:
        cls = SCHEDULES[trainer.mode]
    except KeyError:
        raise ValueError(f"trainer.mode={trainer.mode!r}: use one of {sorted(SCHEDULES)}") from None
    return cls(trainer)
