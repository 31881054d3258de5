"""Group ids: the one place that knows their format (the resume contract, docs/design.md §5b).

A scheduled step's groups are ``s<step:06d>-g<position:05d>``: a resumed run re-draws the same
prompts for the same step, finds the groups the store already holds by these ids and generates
only the missing ones, so the format must never change between a run and its resume. A
trajectory is ``<group id>-<sample index>``. Async generation (``a<ms:013d>-<seq:06d>``) and
evaluation (``eval-<set>-<step>``) use prefixes of their own, which no step's prefix matches.

Both ``trainer/`` (which schedules and leases steps) and ``rollout/`` (whose producers name the
groups they make) import this module; it imports nothing.
"""

from __future__ import annotations


def step_prefix(step: int) -> str:
    """The prefix of every group id of scheduled step ``step`` (``s000003``)."""
    return f"s{int(step):06d}"


def group_id(prefix: str, position: int) -> str:
    """The id of the group at ``position`` in a batch with ``prefix`` (``s000003-g00002``)."""
    return f"{prefix}-g{int(position):05d}"


def step_group_ids(step: int, n: int) -> list[str]:
    """The ids of the ``n`` groups of scheduled step ``step``, in position order."""
    return [group_id(step_prefix(step), i) for i in range(n)]


def of_step(step: int) -> str:
    """What every group id of ``step`` starts with, and no other step's does (``s000003-``)."""
    return step_prefix(step) + "-"


def trajectory_uid(gid: str, sample: int) -> str:
    """The uid of sample ``sample`` of group ``gid``."""
    return f"{gid}-{int(sample)}"


def async_prefix(millis: int, seq: int) -> str:
    """The prefix of the ``seq``-th batch of continuous (async) generation, started at ``millis``."""
    return f"a{int(millis):013d}-{int(seq):06d}"


def eval_prefix(name: str, step: int) -> str:
    """The prefix of the evaluation of set ``name`` after ``step`` steps."""
    return f"eval-{name}-{step}"
