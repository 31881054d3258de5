"""The exact staleness schedule of the ``stale_k`` and ``sync`` modes (docs/design.md §3).

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
"""

from __future__ import annotations


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
