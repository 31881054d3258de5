"""What the trainer hands to the actor: response-annotated token sequences.

Every rank receives the same global :class:`RolloutBatch`; the actor splits it into optimizer
mini-batches in the given order, then over data-parallel ranks and micro-batches itself, so the
result does not depend on which rank produced the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch


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


# --------------------------------------------------------------------------------------------
# Inside the actor: data-parallel shards and right-padded micro-batches
# --------------------------------------------------------------------------------------------


def dp_shard(n: int, dp_size: int, dp_rank: int) -> range:
    """Contiguous, canonical share of ``n`` samples for one data-parallel rank (sizes differ by <= 1)."""
    base, extra = divmod(n, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return range(start, start + base + (1 if dp_rank < extra else 0))


@dataclass(slots=True)
class MicroBatch:
    """Right-padded token rows plus the flattened response tokens they predict.

    Sequences are padded (not packed) to the longest one of the micro-batch: with right padding
    and a causal mask, real tokens never attend to padding, so no attention mask is needed and
    the same path runs with the local and the Transformer Engine layer specs (packing into THD
    needs TE kernels). Response token ``j`` of a sample with prompt length ``P`` is predicted by
    the hidden state at position ``P + j - 1``.

    Attributes (``T`` = response tokens of the micro-batch, sample-major, position-minor):
        tokens, position_ids: int64 [B, S].
        row_pos, row_seq: int64 [T], position / batch row of the predicting hidden state.
        targets: int64 [T]. behav_logprobs, advantages: float32 [T]. loss_mask: bool [T].
        engine_logprobs: float32 [T] or None (only when every sample has them).
        seq_index: int64 [T], sample index within the micro-batch (sequence-level losses).
        token_index: int64 [T], canonical index of the token in its optimizer mini-batch
            (sample order, then position): the tie-break order of the global M2 mask.
        sample_index: the mini-batch indices of the B samples.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    row_pos: torch.Tensor
    row_seq: torch.Tensor
    targets: torch.Tensor
    behav_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    engine_logprobs: Optional[torch.Tensor]
    seq_index: torch.Tensor
    token_index: torch.Tensor
    sample_index: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.targets.shape[0])


def make_microbatches(samples: list[Sample], indices: range | list[int], micro_batch_size: int,
                      *, pad_multiple: int = 1) -> list[MicroBatch]:
    """Micro-batches of ``micro_batch_size`` consecutive samples ``samples[i] for i in indices``."""
    offsets = np.concatenate([[0], np.cumsum([s.response_ids.shape[0] for s in samples])])
    idx = list(indices)
    out = []
    for k in range(0, len(idx), micro_batch_size):
        part = idx[k:k + micro_batch_size]
        for i in part:
            s = samples[i]
            if s.prompt_ids.shape[0] < 1 or s.response_ids.shape[0] < 1:
                raise ValueError(f"sample {s.uid!r} has {s.prompt_ids.shape[0]} prompt and "
                                 f"{s.response_ids.shape[0]} response tokens; both must be >= 1")
        seq = -(-max(samples[i].length for i in part) // pad_multiple) * pad_multiple
        tokens = np.zeros((len(part), seq), np.int64)
        row_pos, row_seq, seq_index, tok_index = [], [], [], []
        for b, i in enumerate(part):
            s = samples[i]
            p, r = s.prompt_ids.shape[0], s.response_ids.shape[0]
            tokens[b, :p] = s.prompt_ids
            tokens[b, p:p + r] = s.response_ids
            row_pos.append(np.arange(p - 1, p - 1 + r))
            row_seq.append(np.full(r, b))
            seq_index.append(np.full(r, b))
            tok_index.append(np.arange(offsets[i], offsets[i] + r))
        cat = lambda name: np.concatenate([getattr(samples[i], name) for i in part])  # noqa: E731
        has_engine = all(samples[i].engine_logprobs is not None for i in part)
        out.append(MicroBatch(
            tokens=torch.from_numpy(tokens),
            position_ids=torch.arange(seq, dtype=torch.int64).expand(len(part), seq).contiguous(),
            row_pos=torch.from_numpy(np.concatenate(row_pos)),
            row_seq=torch.from_numpy(np.concatenate(row_seq)),
            targets=torch.from_numpy(cat("response_ids")),
            behav_logprobs=torch.from_numpy(cat("behav_logprobs")),
            advantages=torch.from_numpy(cat("advantages")),
            loss_mask=torch.from_numpy(cat("loss_mask")).bool(),
            engine_logprobs=torch.from_numpy(cat("engine_logprobs")) if has_engine else None,
            seq_index=torch.from_numpy(np.concatenate(seq_index)),
            token_index=torch.from_numpy(np.concatenate(tok_index)),
            sample_index=part,
        ))
    return out
