"""Synthetic arithmetic task for the tiny CPU default and tests.

Problems are short integer expressions such as ``3+14-2`` with exact answers (``"15"``),
produced as DeepScaleR-schema rows (``problem``, ``answer``) so they go through the same
dataset, template and math-verify reward path as real data. Knobs (``DataConfig``):
operand range ``[synthetic_min_operand, synthetic_max_operand]``, ``synthetic_num_operands``
and the operator characters ``synthetic_ops`` (any of ``+-*``; ``*`` binds tighter, as usual).

Determinism and held-out split: :func:`synthetic_splits` draws the evaluation problems first
(unique, from a stream seeded by ``seed``), then the training problems from an independent
stream, rejecting every evaluation problem, so held-out accuracy measures problems never
trained on. Training problems may repeat (the dataset is a stream of prompts). The same seed
always gives the same rows (Python's ``random.Random`` with a string seed).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from megatron_m2po.data.io import PromptRow

__all__ = ["SyntheticTask", "evaluate_expression", "synthetic_splits"]

OPS = "+-*"


def evaluate_expression(operands: list[int], ops: list[str]) -> int:
    """Exact value of ``operands[0] ops[0] operands[1] ...`` with ``*`` before ``+``/``-``."""
    if len(ops) != len(operands) - 1:
        raise ValueError(f"{len(operands)} operands need {len(operands) - 1} operators, got {len(ops)}")
    total = 0
    sign = 1
    term = operands[0]
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            term *= x
        elif op in "+-":
            total += sign * term
            sign = 1 if op == "+" else -1
            term = x
        else:
            raise ValueError(f"unknown operator {op!r}; allowed: {OPS}")
    return total + sign * term


@dataclass(frozen=True)
class SyntheticTask:
    """Generator of arithmetic problems (see module docstring)."""

    min_operand: int = 0
    max_operand: int = 20
    num_operands: int = 2
    ops: str = "+-"

    def __post_init__(self) -> None:
        if self.min_operand < 0 or self.max_operand < self.min_operand:
            raise ValueError(f"synthetic operand range [{self.min_operand}, {self.max_operand}] is empty or negative; "
                             "need 0 <= synthetic_min_operand <= synthetic_max_operand")
        if self.num_operands < 2:
            raise ValueError(f"synthetic_num_operands={self.num_operands} must be >= 2")
        bad = sorted(set(self.ops) - set(OPS))
        if not self.ops or bad:
            raise ValueError(f"synthetic_ops={self.ops!r} must be a non-empty string of characters from {OPS!r}"
                             + (f" (unknown: {bad})" if bad else ""))

    @classmethod
    def from_config(cls, data_cfg) -> "SyntheticTask":
        return cls(min_operand=data_cfg.synthetic_min_operand, max_operand=data_cfg.synthetic_max_operand,
                   num_operands=data_cfg.synthetic_num_operands, ops=data_cfg.synthetic_ops)

    @property
    def space_size(self) -> int:
        """Number of distinct problem strings."""
        n_vals = self.max_operand - self.min_operand + 1
        return n_vals ** self.num_operands * len(set(self.ops)) ** (self.num_operands - 1)

    def sample(self, rng: random.Random) -> PromptRow:
        """One problem row drawn from ``rng``."""
        operands = [rng.randint(self.min_operand, self.max_operand) for _ in range(self.num_operands)]
        ops = [rng.choice(self.ops) for _ in range(self.num_operands - 1)]
        problem = str(operands[0]) + "".join(f"{o}{x}" for o, x in zip(ops, operands[1:]))
        return PromptRow(problem=problem, answer=str(evaluate_expression(operands, ops)))

    def generate(self, n: int, seed: int | str, *, exclude: frozenset[str] = frozenset(),
                 unique: bool = False) -> list[PromptRow]:
        """``n`` rows from a stream seeded by ``seed``, skipping problems in ``exclude``."""
        free = self.space_size - len(exclude)
        if unique and n > free:
            raise ValueError(f"cannot draw {n} distinct synthetic problems: the task has only {free} "
                             f"(operands {self.min_operand}..{self.max_operand}, {self.num_operands} operands, "
                             f"ops {self.ops!r}); widen the range or lower the count")
        if n > 0 and free <= 0:
            raise ValueError("every synthetic problem is excluded (held out); widen the operand range")
        rng = random.Random(f"m2po-synthetic:{seed}")
        rows: list[PromptRow] = []
        seen: set[str] = set()
        while len(rows) < n:
            row = self.sample(rng)
            if row["problem"] in exclude or (unique and row["problem"] in seen):
                continue
            seen.add(row["problem"])
            rows.append(row)
        return rows


def synthetic_splits(data_cfg, seed: int) -> tuple[list[PromptRow], list[PromptRow]]:
    """(train rows, held-out eval rows) of the synthetic task of ``data_cfg``, disjoint."""
    task = SyntheticTask.from_config(data_cfg)
    n_eval = int(data_cfg.synthetic_eval_size)
    if n_eval and 2 * n_eval > task.space_size:
        raise ValueError(f"data.synthetic_eval_size={n_eval} would hold out more than half of the "
                         f"{task.space_size} distinct synthetic problems; widen the operand range or lower it")
    eval_rows = task.generate(n_eval, f"eval:{seed}", unique=True)
    held_out = frozenset(r["problem"] for r in eval_rows)
    train_rows = task.generate(int(data_cfg.synthetic_num_problems), f"train:{seed}", exclude=held_out)
    return train_rows, eval_rows
