"""A slow environment: the arithmetic task with a configurable latency per step (the agentic regime).

    m2po train examples/agentic_slow.yaml rollout.agentic.env_args.latency_s=2.0 trainer.mode=async

Each step waits ``latency_s`` seconds (an environment doing work elsewhere: a test suite, a web
page, a sandboxed build) before it grades the model's ``\\boxed{}`` answer: 1 and done when right,
otherwise the problem is asked again. Used to measure how much of the trainer's time goes idle
while episodes run long, sync vs async (docs/agentic.md, "Measurements").
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from megatron_m2po.rewards.extract import extract_last_boxed
from megatron_m2po.rollout.episodes import Environment, StepResult


class SlowEnv(Environment):
    def __init__(self, latency_s: float = 1.0) -> None:
        if latency_s < 0:
            raise ValueError(f"latency_s={latency_s} must be >= 0")
        self.latency_s = float(latency_s)
        self.problem, self.answer = "", ""

    async def reset(self, row: Any) -> Optional[str]:
        self.problem, self.answer = row.problem, str(row.answer).strip()
        return None

    async def step(self, action: str) -> StepResult:
        await asyncio.sleep(self.latency_s)  # elapsed time is what this environment models
        got = (extract_last_boxed(action) or "").strip()
        if got == self.answer:
            return StepResult("", 1.0, True, {"latency_s": self.latency_s})
        return StepResult(f"\n{self.problem}=", 0.0, False, {"latency_s": self.latency_s})
