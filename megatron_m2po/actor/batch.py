"""What the trainer hands to the actor: response-annotated token sequences.

Every rank receives the same global :class:`RolloutBatch`; the actor splits it into optimizer
mini-batches in the given order, then over data-parallel ranks and micro-batches itself, so the
result does not depend on which rank produced the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass(slots=True)
class Sample:
    """One prompt + response, with what the loss needs per response token.

    Attributes:
        uid: unique sample id; with the token position it is the canonical order key that breaks
            ties of the global M2 mask deterministically.
        prompt_ids: int [P]. response_ids: int [R].
        behav_logprobs: float32 [R], log-probs of the behaviour policy (the weights that sampled).
        advantages: float32 [R] (GRPO broadcasts the sample's scalar advantage).
        loss_mask: uint8 [R], 1 where the token is trained on.
        versions: int64 [R], weight version that produced each token (for staleness metrics).
        engine_logprobs: optional float32 [R]: the engine's log-probs when ``behav_logprobs`` were
            recomputed by the trainer (TIS weight and the train-vs-engine mismatch KL).
    """

    uid: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behav_logprobs: np.ndarray
    advantages: np.ndarray
    loss_mask: np.ndarray
    versions: np.ndarray
    engine_logprobs: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int64).reshape(-1)
        self.response_ids = np.asarray(self.response_ids, dtype=np.int64).reshape(-1)
        r = self.response_ids.shape[0]
        self.behav_logprobs = np.asarray(self.behav_logprobs, dtype=np.float32).reshape(-1)
        adv = np.asarray(self.advantages, dtype=np.float32)
        self.advantages = np.full(r, float(adv), np.float32) if adv.ndim == 0 else adv.reshape(-1)
        self.loss_mask = np.asarray(self.loss_mask, dtype=np.uint8).reshape(-1)
        v = np.asarray(self.versions, dtype=np.int64)
        self.versions = np.full(r, int(v), np.int64) if v.ndim == 0 else v.reshape(-1)
        if self.engine_logprobs is not None:
            self.engine_logprobs = np.asarray(self.engine_logprobs, dtype=np.float32).reshape(-1)
        for name in ("behav_logprobs", "advantages", "loss_mask", "versions"):
            n = getattr(self, name).shape[0]
            if n != r:
                raise ValueError(f"sample {self.uid!r}: {name} has {n} entries, response has {r}")

    @property
    def length(self) -> int:
        return int(self.prompt_ids.shape[0] + self.response_ids.shape[0])


@dataclass(slots=True)
class RolloutBatch:
    """An ordered list of samples (e.g. all trajectories of one training step)."""

    samples: list[Sample] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.samples)

    def split(self, n: int) -> list["RolloutBatch"]:
        """``n`` consecutive, equally sized parts (optimizer mini-batches), in order."""
        if n < 1 or len(self.samples) % n:
            raise ValueError(f"cannot split {len(self.samples)} samples into {n} equal mini-batches")
        k = len(self.samples) // n
        return [RolloutBatch(self.samples[i * k:(i + 1) * k]) for i in range(n)]

    @property
    def num_response_tokens(self) -> int:
        return int(sum(int(s.loss_mask.sum()) for s in self.samples))
