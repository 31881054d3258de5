"""The training loop's config sections: ``trainer`` (mode, steps, batch sizes), ``checkpoint``
and ``logging``.

Read by ``trainer/`` (the loop, its schedule, the token dump, the run report) and by the rank-0
rollout service for the step sizes; it imports only the settings machinery.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_m2po.utils.settings import ConfigError, check_ranges
from megatron_m2po.utils.settings import setting as _f

__all__ = ["TrainerConfig", "CheckpointConfig", "LoggingConfig"]

@dataclass
class TrainerConfig:
    """The training loop (docs/design.md §3)."""

    mode: Literal["sync", "stale_k", "async"] = _f("stale_k", help="sync (on-policy), stale_k (controlled staleness), async (bounded lag).")
    stale_k: int = _f(0, ge=0, help="Staleness k of stale_k mode (updates between generation and first use).")
    num_steps: int = _f(100, ge=1, help="Training steps (each does num_updates_per_step optimizer updates).")
    prompts_per_step: int = _f(256, ge=1, help="Prompts per training step (x n_samples_per_prompt trajectories).")
    prompts_per_update: int = _f(64, ge=1, help="Prompts per optimizer mini-batch.")
    sync_every_updates: int = _f(1, ge=1, help="async: push weights to the engines every N optimizer updates.")
    seed: int = _f(1234, help="Global seed (data order, sampling, init).")
    run_dir: str = _f("runs/default", help="Output directory: metrics, checkpoints, store, weights.")
    eval_every_steps: int = _f(0, ge=0, help="Held-out evaluation every N steps (0 = off).")
    eval_samples: int = _f(1, ge=1, help="Samples per held-out problem (avg@k).")
    eval_at_start: bool = _f(True, help="With eval_every_steps > 0: evaluate the base model once before the first "
                             "step (logged at step 0), so the held-out curve starts where training starts.")
    wait_timeout_s: float = _f(3600.0, ge=1, help="Longest the trainer waits for data (a step's rollouts, a "
                               "generation, an evaluation) before it fails with a message naming what it waited for; "
                               "SIGINT / SIGTERM end such a wait at once.")

    @property
    def num_updates_per_step(self) -> int:
        return self.prompts_per_step // self.prompts_per_update

    def validate(self) -> None:
        """Field ranges, then a whole number of optimizer updates per step."""
        check_ranges(self, "trainer")
        if self.prompts_per_step % self.prompts_per_update:
            raise ConfigError(
                f"trainer.prompts_per_step={self.prompts_per_step} must be a multiple of "
                f"trainer.prompts_per_update={self.prompts_per_update} (each step does a whole number of updates)")


@dataclass
class CheckpointConfig:
    """Checkpointing (Megatron distributed checkpoint + extra state)."""

    dir: str = _f("", help="Checkpoint directory (default: <run_dir>/checkpoints).")
    save_every_steps: int = _f(10, ge=0, help="Save every N steps (0 = only at the end and on a signal).")
    keep_last: int = _f(2, ge=1, help="Checkpoints kept on disk.")
    resume: bool = _f(True, help="Resume from the newest complete checkpoint when one exists.")
    export_hf_at_end: bool = _f(True, help="Export HF safetensors of the final weights.")

    def validate(self) -> None:
        check_ranges(self, "checkpoint")


@dataclass
class LoggingConfig:
    """Metrics sinks. JSONL and TensorBoard are always written."""

    wandb_project: str = _f("", help="Weights & Biases project (empty = off).")
    wandb_run_name: str = _f("", help="W&B run name.")
    progress: bool = _f(True, help="Rich progress display on rank 0.")
    dump_tokens_every: int = _f(0, ge=0, help="Write token-level data (entropy, log-ratio, advantage sign, staleness, "
                                "GRPO clip / M2PO mask decisions) of every N-th training step to "
                                "<run_dir>/tokens/step_NNNNNN.npz (0 = never); read by `m2po experiment entropy`.")
    access_log: bool = _f(False, help="Print aiohttp's access line of every request to the trainer's ingestion server "
                          "(rollout.source=external) on the console; off, requests are only counted "
                          "(server/requests in its GET /v1/stats).")
    dump_tokens_max: int = _f(200_000, ge=1, help="At most this many response tokens per dumped step (a seeded uniform "
                              "subset beyond it): bounds a dump to ~10 MB.")
    trace: bool = _f(False, help="Write <run_dir>/trace.json, a Chrome / Perfetto trace (open it in "
                     "https://ui.perfetto.dev) of every trainer rank's phases (pushes, waits for data, mask "
                     "pass, forward-backward, optimizer, checkpoints, evaluation), the driver's generation and "
                     "rewards, and the engines' load; each rank also leaves <run_dir>/trace/rank<R>.json. "
                     "Draw it with tools/plot_trace.py.")

    def validate(self) -> None:
        check_ranges(self, "logging")
