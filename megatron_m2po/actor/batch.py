"""What the trainer hands to the actor, and how the actor lays it out over ranks and micro-batches.

The trainer splits a step's :class:`RolloutBatch` into optimizer mini-batches in order; every
rank gets each mini-batch's :class:`BatchPlan` (a few numbers per sample) and the samples of its
own data-parallel shard (:class:`ShardedBatch`). The actor assigns data-parallel shards
(:func:`balanced_shards`) and micro-batches (:func:`group_microbatches`,
:func:`make_microbatches`) from the plan alone. Every result is a pure function of the plan and
the layout, identical on every rank, and no loss quantity
depends on it: the loss denominator is the mini-batch's response-token count and the M2 mask is
ordered by the canonical token index (sample order in the mini-batch, then position).
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
        routed_experts: optional uint8 / uint16 [P + R - 1, layers, top_k] (:func:`compact_expert_ids`):
            the expert ids the engine's routers picked for every position but the last
            (``store.types.Trajectory``), replayed by the forward with ``algo.routing_replay=rollout``
            (``actor/routing_replay.py``). Kept compact all the way to the router: 48 layers x top-8
            are 384 B a token in uint8 against 3 KB in int64, and a step's samples travel to every
            rank (``parallel/rank0.py``); only the targets of one layer of one micro-batch are widened.
        teacher_logprobs: optional float32 [R]: the distillation teacher's log-probs stored with the
            trajectory (``algo.distill.mode=sglang``; trainer/distill.py puts them in the advantages).
    """

    uid: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behav_logprobs: np.ndarray
    advantages: np.ndarray
    loss_mask: np.ndarray
    versions: np.ndarray
    engine_logprobs: Optional[np.ndarray] = None
    routed_experts: Optional[np.ndarray] = None
    teacher_logprobs: Optional[np.ndarray] = None

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
        if self.teacher_logprobs is not None:
            self.teacher_logprobs = np.asarray(self.teacher_logprobs, dtype=np.float32).reshape(-1)
            if self.teacher_logprobs.shape[0] != r:
                raise ValueError(f"sample {self.uid!r}: teacher_logprobs has {self.teacher_logprobs.shape[0]} "
                                 f"entries, response has {r}")
        for name in ("behav_logprobs", "advantages", "loss_mask", "versions"):
            n = getattr(self, name).shape[0]
            if n != r:
                raise ValueError(f"sample {self.uid!r}: {name} has {n} entries, response has {r}")
        if self.routed_experts is not None:
            self.routed_experts = compact_expert_ids(self.routed_experts, f"sample {self.uid!r}")
            if self.routed_experts.ndim != 3 or self.routed_experts.shape[0] != self.length - 1:
                raise ValueError(f"sample {self.uid!r}: routed_experts has shape {list(self.routed_experts.shape)}, "
                                 f"expected [{self.length - 1}, layers, top_k]")

    @property
    def length(self) -> int:
        return int(self.prompt_ids.shape[0] + self.response_ids.shape[0])


def compact_expert_ids(ids, where: str = "routed experts") -> np.ndarray:
    """Expert ids in the smallest unsigned type that holds them: uint8 below 256 experts' ids (every
    model with at most 256 experts, Qwen3-30B-A3B's 128 among them), else uint16, the store's type
    (``store/sqlite.py`` ``routed_blob``). An array already uint8 / uint16 is returned as it is;
    ids outside ``[0, 65536)`` raise ValueError naming ``where``."""
    a = np.asarray(ids)
    if a.dtype in (np.uint8, np.uint16):
        return a
    if a.dtype.kind not in "iu":
        raise ValueError(f"{where}: routed experts must be integer expert ids, got dtype {a.dtype}")
    lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
    if lo < 0 or hi > 0xFFFF:
        raise ValueError(f"{where}: routed experts hold expert id {lo if lo < 0 else hi}, outside [0, 65536) "
                         "(the store keeps them as uint16)")
    return a.astype(np.uint8 if hi < 256 else np.uint16)


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


@dataclass(slots=True)
class BatchPlan:
    """What every rank knows of one optimizer mini-batch: sizes and versions, not the tokens.

    Enough to compute the data-parallel shards and micro-batch plans, the loss denominator,
    the canonical token order and the staleness metrics on every rank, while each rank holds
    the samples of its own shard only (:class:`ShardedBatch`). A few numbers per sample.

    Attributes:
        lengths: int64 [n], prompt + response tokens per sample.
        response_lengths: int64 [n]. loss_tokens: int64 [n], ``loss_mask`` sums.
        version_base: the smallest weight version of a loss token (0 when there is none).
        version_counts: int64 [k], loss tokens per version ``version_base + j``.
    """

    lengths: np.ndarray
    response_lengths: np.ndarray
    loss_tokens: np.ndarray
    version_base: int
    version_counts: np.ndarray

    @classmethod
    def of(cls, samples: list[Sample]) -> "BatchPlan":
        v = np.concatenate([s.versions[s.loss_mask > 0] for s in samples]) if samples else np.zeros(0, np.int64)
        base = int(v.min()) if v.size else 0
        return cls(lengths=np.array([s.length for s in samples], np.int64),
                   response_lengths=np.array([s.response_ids.shape[0] for s in samples], np.int64),
                   loss_tokens=np.array([int(s.loss_mask.sum()) for s in samples], np.int64),
                   version_base=base, version_counts=np.bincount(v - base) if v.size else np.zeros(0, np.int64))

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_tokens.sum())


@dataclass(slots=True)
class ShardedBatch:
    """One optimizer mini-batch as one data-parallel rank receives it: the global plan and the
    samples of its shard (``samples[i]`` is mini-batch sample ``i``)."""

    plan: BatchPlan
    samples: dict[int, Sample]


# --------------------------------------------------------------------------------------------
# Inside the actor: data-parallel shards, micro-batch plans, packed or padded micro-batches
# --------------------------------------------------------------------------------------------


def sequence_work(length: int, hidden_size: int) -> float:
    """Relative training cost of one sequence of ``length`` tokens.

    Per layer and token the dense projections cost ~``24 h^2`` FLOPs (QKV, output, a 4h MLP);
    causal attention adds ~``2 h L`` per token (``QK^T`` and ``AV`` over half the sequence on
    average). Divided by ``24 h^2``: ``L * (1 + L / (12 h))``. At long context the quadratic
    term matters (L = 16k, h = 5120: +27 %).
    """
    return float(length) * (1.0 + float(length) / (12.0 * hidden_size))


def balanced_shards(lengths: list[int], dp_size: int, hidden_size: int) -> list[list[int]]:
    """Assign sequences (by index) to ``dp_size`` data-parallel ranks with near-equal work.

    Longest-processing-time-first: sequences by decreasing :func:`sequence_work` (ties by index)
    each go to the rank with the least work so far (ties: the lowest rank). Deterministic, so
    every rank computes the same assignment; each shard lists its indices in increasing order.
    With ``len(lengths) >= dp_size`` every rank gets at least one sequence. Greedy LPT is within
    4/3 of the optimum and, with many sequences, close to equal.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1")
    work = [sequence_work(n, hidden_size) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (-work[i], i))
    load = [0.0] * dp_size
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    for i in order:
        r = min(range(dp_size), key=lambda k: (load[k], k))
        shards[r].append(i)
        load[r] += work[i]
    return [sorted(x) for x in shards]


def dp_shard(n: int, dp_size: int, dp_rank: int) -> range:
    """Contiguous, canonical share of ``n`` samples for one data-parallel rank (sizes differ by <= 1)."""
    base, extra = divmod(n, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return range(start, start + base + (1 if dp_rank < extra else 0))


def _rows(lengths: list[int], packing: bool, pad_multiple: int, seq_multiple: int = 1) -> int:
    """Token rows a micro-batch of these sequences occupies (packed: the sum of the lengths, each
    rounded up to ``seq_multiple``; padded: B x longest), rounded up to ``pad_multiple``."""
    if packing:
        total = sum(-(-n // seq_multiple) * seq_multiple for n in lengths)
        return -(-total // pad_multiple) * pad_multiple
    return len(lengths) * (-(-max(lengths) // pad_multiple) * pad_multiple)


def group_microbatches(lengths: list[int], indices: list[int], *, micro_batch_size: int,
                       max_tokens: Optional[int], packing: bool, pad_multiple: int = 1,
                       seq_multiple: int = 1) -> list[list[int]]:
    """The micro-batch plan of one shard: lists of indices into ``lengths``.

    Without ``max_tokens``: ``micro_batch_size`` consecutive sequences each. With it: token
    budget micro-batches, first-fit over the sequences by decreasing length (ties by index): a
    sequence joins the first micro-batch whose rows (:func:`_rows`: packed sum, or padded
    ``B x longest``) stay within ``max_tokens``, else opens a new one; a sequence longer than
    the budget gets a micro-batch of its own. Micro-batches come out in the order they were
    opened, each listing its indices in increasing order. Deterministic: every pipeline stage of
    a replica computes the same plan.
    """
    idx = list(indices)
    if max_tokens is None:
        return [idx[k:k + micro_batch_size] for k in range(0, len(idx), micro_batch_size)]
    order = sorted(idx, key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        for g in groups:
            if _rows([lengths[j] for j in g] + [lengths[i]], packing, pad_multiple, seq_multiple) <= max_tokens:
                g.append(i)
                break
        else:
            groups.append([i])
    return [sorted(g) for g in groups]


@dataclass(slots=True)
class MicroBatch:
    """Token rows (packed or right-padded) plus the flattened response tokens they predict.

    Padded (``cu_seqlens`` is None): ``tokens`` is ``[B, S]``, every sequence right-padded to the
    longest one (rounded up to ``pad_multiple``). With right padding and a causal mask, real
    tokens never attend to padding, so no attention mask is needed. Response token ``j`` of a
    sample with prompt length ``P`` is predicted by the hidden state at row ``(b, P + j - 1)``.

    Packed (``cu_seqlens`` int32 ``[n + 1]``): ``tokens`` is ``[1, T]``, the sequences
    concatenated; attention stays within each sequence and positions restart at 0 in each
    (Megatron's THD path, ``PackedSeqParams``). When ``T`` must be a multiple of ``pad_multiple``
    the padding forms one extra pseudo-sequence at the end (its own block of the mask, so real
    tokens never see it). Response token ``j`` of the sequence starting at row ``o`` is
    predicted by row ``(0, o + P + j - 1)``.

    Attributes (``T`` = response tokens of the micro-batch, sample-major, position-minor):
        tokens, position_ids: int64 [B, S] (packed: [1, T]; positions restart per sequence).
        row_pos, row_seq: int64 [T], position / batch row of the predicting hidden state.
        targets: int64 [T]. behav_logprobs, advantages: float32 [T]. loss_mask: bool [T].
        engine_logprobs: float32 [T] or None (only when every sample has them).
        teacher_logprobs: float32 [T] or None: the distillation teacher's stored log-probs
            (``algo.distill.mode=sglang``; only when every sample has them).
        seq_index: int64 [T], sample index within the micro-batch (sequence-level losses).
        token_index: int64 [T], canonical index of the token in its optimizer mini-batch
            (sample order, then position): the tie-break order of the global M2 mask.
        sample_index: the mini-batch indices of the B samples.
        cu_seqlens: int32 [n + 1] cumulative sequence lengths (packed), else None.
        max_seqlen: the longest (pseudo-)sequence of a packed micro-batch; 0 when padded.
        routed_experts: uint8 / uint16 [layers, B, S, top_k] (packed: [layers, 1, T, top_k]) expert
            ids per token row to replay, or None (only when every sample has them); the compact type
            of the samples (:func:`compact_expert_ids`; uint16 when any sample needs it), widened to
            int64 one layer at a time where the router takes them (``RoutingReplay.targets``). A
            sequence's last token and padding rows, which no sample records, hold experts
            ``0 .. top_k - 1``: their outputs reach no predicting row (causal attention, right padding).
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
    cu_seqlens: Optional[torch.Tensor] = None
    max_seqlen: int = 0
    routed_experts: Optional[torch.Tensor] = None
    teacher_logprobs: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        return int(self.targets.shape[0])

    @property
    def num_rows(self) -> int:
        """Token rows the model processes (padding included)."""
        return int(self.tokens.numel())


def _check_sample(s: Sample) -> None:
    if s.prompt_ids.shape[0] < 1 or s.response_ids.shape[0] < 1:
        raise ValueError(f"sample {s.uid!r} has {s.prompt_ids.shape[0]} prompt and "
                         f"{s.response_ids.shape[0]} response tokens; both must be >= 1")


def make_microbatches(samples, groups: list[list[int]], *, pad_multiple: int = 1, packing: bool = False,
                      response_lengths=None, seq_multiple: int = 1) -> list[MicroBatch]:
    """One :class:`MicroBatch` per group of mini-batch indices (see :func:`group_microbatches`),
    packed or right-padded, with the length rounded up to ``pad_multiple``. Packed, every sequence
    is also padded on its right to a multiple of ``seq_multiple`` (context parallelism, see
    :func:`cp_pad_multiple`); the padding belongs to its sequence in ``cu_seqlens``.

    ``samples`` is the mini-batch's list of samples, or a mapping from index to sample holding
    at least the grouped ones together with ``response_lengths`` of the whole mini-batch (for the
    canonical token index)."""
    if response_lengths is None:
        response_lengths = [s.response_ids.shape[0] for s in samples]
    offsets = np.concatenate([[0], np.cumsum(np.asarray(response_lengths, np.int64))])
    out = []
    for part in groups:
        for i in part:
            _check_sample(samples[i])
        lengths = [samples[i].length for i in part]
        row_pos, row_seq, seq_index, tok_index = [], [], [], []
        cu_seqlens, max_seqlen = None, 0
        if packing:
            total = _rows(lengths, True, pad_multiple, seq_multiple)
            tokens = np.zeros((1, total), np.int64)
            positions = np.zeros((1, total), np.int64)
            starts = np.concatenate([[0], np.cumsum([-(-n // seq_multiple) * seq_multiple for n in lengths])])
            bounds = list(starts) + ([total] if total > starts[-1] else [])
            cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
            max_seqlen = int(max(np.diff(bounds)))
            for k in range(len(bounds) - 1):
                positions[0, bounds[k]:bounds[k + 1]] = np.arange(bounds[k + 1] - bounds[k])
        else:
            seq = -(-max(lengths) // pad_multiple) * pad_multiple
            tokens = np.zeros((len(part), seq), np.int64)
            positions = np.broadcast_to(np.arange(seq, dtype=np.int64), (len(part), seq)).copy()
        for b, i in enumerate(part):
            s = samples[i]
            p, r = s.prompt_ids.shape[0], s.response_ids.shape[0]
            row, o = (0, int(starts[b])) if packing else (b, 0)
            tokens[row, o:o + p] = s.prompt_ids
            tokens[row, o + p:o + p + r] = s.response_ids
            row_pos.append(np.arange(o + p - 1, o + p - 1 + r))
            row_seq.append(np.full(r, row))
            seq_index.append(np.full(r, b))
            tok_index.append(np.arange(offsets[i], offsets[i] + r))
        cat = lambda name: np.concatenate([getattr(samples[i], name) for i in part])  # noqa: E731
        has_engine = all(samples[i].engine_logprobs is not None for i in part)
        has_teacher = all(samples[i].teacher_logprobs is not None for i in part)
        routed = _routed_rows([samples[i] for i in part], tokens.shape,
                              [(0, int(starts[b])) if packing else (b, 0) for b in range(len(part))])
        out.append(MicroBatch(
            tokens=torch.from_numpy(tokens),
            position_ids=torch.from_numpy(positions),
            row_pos=torch.from_numpy(np.concatenate(row_pos)),
            row_seq=torch.from_numpy(np.concatenate(row_seq)),
            targets=torch.from_numpy(cat("response_ids")),
            behav_logprobs=torch.from_numpy(cat("behav_logprobs")),
            advantages=torch.from_numpy(cat("advantages")),
            loss_mask=torch.from_numpy(cat("loss_mask")).bool(),
            engine_logprobs=torch.from_numpy(cat("engine_logprobs")) if has_engine else None,
            seq_index=torch.from_numpy(np.concatenate(seq_index)),
            token_index=torch.from_numpy(np.concatenate(tok_index)),
            sample_index=list(part),
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            routed_experts=routed,
            teacher_logprobs=torch.from_numpy(cat("teacher_logprobs")) if has_teacher else None,
        ))
    return out


def _routed_rows(samples: list, shape: tuple, origins: list[tuple[int, int]]) -> Optional[torch.Tensor]:
    """The routed experts of a micro-batch's token rows, ``[layers, *shape, top_k]`` (MicroBatch);
    None unless every sample has them."""
    if not samples or any(s.routed_experts is None for s in samples):
        return None
    ids = [compact_expert_ids(s.routed_experts, f"sample {s.uid!r}") for s in samples]  # also ones set after __init__
    layers, k = ids[0].shape[1:]
    dtype = np.uint16 if any(a.dtype == np.uint16 for a in ids) else np.uint8
    out = np.broadcast_to(np.arange(k, dtype=dtype), (*shape, layers, k)).copy()
    for s, a, (row, o) in zip(samples, ids, origins):
        if a.shape[1:] != (layers, k):
            raise ValueError(f"sample {s.uid!r}: routed_experts has {list(a.shape[1:])} layers x top_k, "
                             f"other samples {[layers, k]}")
        out[row, o:o + s.length - 1] = a
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(out, 2, 0)))


# --------------------------------------------------------------------------------------------
# Context parallelism: Megatron's load-balanced split of each sequence over the CP ranks
# --------------------------------------------------------------------------------------------


def cp_pad_multiple(cp_size: int, tp_size: int, sequence_parallel: bool) -> int:
    """What each sequence (packed) or the row length (padded) is padded to under context parallelism.

    Every sequence is cut into ``2 x CP`` equal chunks (below), and with sequence parallelism each
    rank's ``2`` chunks are scattered over the TP ranks again: ``2 CP`` (``x TP`` with SP), the
    rule of TE's THD kernels (``cu_seqlens_padded`` divisible by ``2 CP``) and of Megatron-LM's
    packed-sequence batches with CP and SP. ``1`` without CP (no per-sequence padding)."""
    if cp_size == 1:
        return 1
    return 2 * cp_size * (tp_size if sequence_parallel else 1)


def cp_local_rows(lengths: np.ndarray, cp_size: int, cp_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``(global, position)``: the rows a CP rank holds of sequences of ``lengths`` (each a
    multiple of ``2 CP``) laid end to end, in its local order, and each row's position within
    its sequence.

    Megatron's load-balanced split (``megatron/core/utils.py`` ``get_batch_on_this_cp_rank``;
    for THD, TE's ``thd_get_partitioned_indices``): a sequence of ``L`` tokens is cut into
    ``2 CP`` chunks of ``L / (2 CP)``; rank ``r`` holds chunk ``r`` then chunk ``2 CP - 1 - r``
    (causal attention then costs every rank the same). Packed, each sequence is split on its
    own and rank ``r``'s part of sequence ``s`` starts at local row ``cu_seqlens[s] / CP``."""
    glob, pos = [], []
    start = 0
    for n in (int(x) for x in lengths):
        if n % (2 * cp_size):
            raise AssertionError(f"sequence of {n} rows is not padded to a multiple of 2 x CP = {2 * cp_size}")
        c = n // (2 * cp_size)
        for k in (cp_rank, 2 * cp_size - 1 - cp_rank):
            glob.append(start + np.arange(k * c, (k + 1) * c))
            pos.append(np.arange(k * c, (k + 1) * c))
        start += n
    if not glob:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(glob).astype(np.int64), np.concatenate(pos).astype(np.int64)


def cp_split(mb: MicroBatch, cp_size: int, cp_rank: int) -> MicroBatch:
    """The part of a whole micro-batch (from :func:`make_microbatches`, padded to
    :func:`cp_pad_multiple`) that CP rank ``cp_rank`` processes (:func:`cp_local_rows`).

    ``tokens`` / ``position_ids`` keep the rank's rows (padded: ``[B, S / CP]``; packed:
    ``[1, T / CP]``), ``position_ids`` holding each row's *original* position (RoPE rotates by
    it: Megatron's ``get_pos_emb_on_this_cp_rank`` / ``_get_thd_freqs_on_this_cp_rank`` pick the
    same positions). ``cu_seqlens`` / ``max_seqlen`` stay global (the padded whole sequences, as
    TE and Megatron's THD RoPE expect them under CP). The per-token fields keep only the response
    tokens whose predicting row is local, with ``row_pos`` made local; ``token_index`` (the
    canonical order key of the global mask) and ``seq_index`` are those of the whole micro-batch,
    so every token appears on exactly one CP rank with its original key."""
    if cp_size == 1:
        return mb
    s = mb.tokens.shape[1]
    # packed: every sequence of the pack is split; padded: every row alike (one "sequence" of S)
    lengths = np.diff(mb.cu_seqlens.cpu().numpy().astype(np.int64)) if mb.cu_seqlens is not None else np.array([s])
    glob, _ = cp_local_rows(lengths, cp_size, cp_rank)
    index = torch.from_numpy(glob).to(mb.tokens.device)
    tokens, positions = mb.tokens[:, index], mb.position_ids[:, index]
    local_of = np.full(s, -1, np.int64)  # global row -> local row (-1: another CP rank's)
    local_of[glob] = np.arange(glob.shape[0])
    local = torch.from_numpy(local_of)[mb.row_pos.cpu()]
    keep = local >= 0
    pick = lambda t: None if t is None else t[keep.to(t.device)]  # noqa: E731
    return MicroBatch(
        tokens=tokens, position_ids=positions, row_pos=local[keep].to(mb.row_pos.device), row_seq=pick(mb.row_seq),
        targets=pick(mb.targets), behav_logprobs=pick(mb.behav_logprobs), advantages=pick(mb.advantages),
        loss_mask=pick(mb.loss_mask), engine_logprobs=pick(mb.engine_logprobs), seq_index=pick(mb.seq_index),
        token_index=pick(mb.token_index), sample_index=list(mb.sample_index), cu_seqlens=mb.cu_seqlens,
        max_seqlen=mb.max_seqlen,
        routed_experts=None if mb.routed_experts is None else mb.routed_experts[:, :, index.to(mb.routed_experts.device)],
        teacher_logprobs=pick(mb.teacher_logprobs))
