"""Which weights computed the routed experts a trajectory keeps, and which of its tokens they produced.

MoE routing replay (``algo.routing_replay=rollout``, docs/moe.md) trains a token with the experts
stored for the positions before it. That is exact only when those are the experts whose forwards
computed the token's behaviour log-prob. What SGLang 0.5.23 returns (``srt/state_capturer/base.py``
``BaseTopkCapturer``, ``srt/managers/schedule_batch.py``, ``scheduler.py`` ``pause_generation``):

- the ids are captured per KV slot by the forward that computes that slot (``on_forward_end``:
  ``host_cache.buffer[out_cache_loc] = ...``) and read once, when the request finishes
  (``batch_result_processor.py`` ``_maybe_collect_routed_experts`` -> ``get_topk``: the slots of
  ``req_to_token[req][start_len : seqlen - 1]``); nothing is returned before the finish;
- every weight push pauses with ``retract`` (``weights/transport.py``): ``retract_all`` ->
  ``release_req`` frees the request's KV (``release_kv_cache(..., checkpoint=False)``, nothing kept
  in the radix tree, which the push's update then flushes) and ``Req.reset_for_retract`` drops
  ``routed_experts``; on ``continue_generation`` the request is prefilled again, prompt and output so
  far, by the new weights, which write new slots. So a response's rows all come from the weights of
  its last retraction, i.e. the version of its last sampled token (``meta_info["weight_versions"]``),
  and the routing the old weights used for the tokens sampled before the push is gone;
- an agentic turn re-sends the conversation: after a push the flushed cache has none of it, so the
  engine recomputes the earlier turns' positions under the new weights, while the rows kept from
  the earlier turns (``routed_experts_start_len`` asks only from where they stop) are the old ones.

Keeping the rows captured before a push would not be exact either: the tokens sampled *after* it
were computed over the prefix re-prefilled by the new weights, i.e. with the new weights' routing of
every earlier position. A trajectory that spans a push has no single routing that produced all its
log-probs, and Megatron's ``RouterReplay`` replays one ``[tokens, top_k]`` tensor per layer (no
per-token fallback). So each stored row is tagged with the version whose forward computed it, and a
model token is replayed exactly when every row before it carries the token's own version: then the
rows are those its log-prob was computed over (a push flushes the cache and retracts the running
requests, so a forward at version ``v`` attends only to KV computed at ``v``). The other model tokens
are *mismatched*: counted (``metadata["routing"]["mismatched_tokens"]``, metric
``rollout/routing_version_mismatch``) and, when routing is replayed, masked from the loss.

A retraction for memory (``ScheduleBatch.retract_decode``) recomputes rows under the same weights:
the same routing up to the batch-dependent numerics, like any engine-versus-trainer recompute. A
push with ``pause_mode="in_place"`` (never used by the trainer) keeps old KV in use, so its tags
over-count mismatches (the version tags themselves are not exact there: docs/sglang.md).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

__all__ = ["RoutedRows", "keep_replayable", "mismatched_tokens", "response_routing_version", "row_version_spans"]


def response_routing_version(out: Any, fallback: int) -> int:
    """The version whose forwards computed every routed-experts row of the finished response ``out``
    (a ``GenerateOutput``): the version of its last sampled token (per-token spans); without spans the
    engine's version at the finish; ``fallback`` when it reports neither as an integer."""
    tv = getattr(out, "token_weight_versions", None)
    if tv:
        return int(tv[-1])
    try:
        return int(out.weight_version)
    except (TypeError, ValueError):
        return int(fallback)


class RoutedRows:
    """An episode's routed experts so far, position ``0`` up to ``covered``, each row tagged with the
    version whose forward computed it (one piece per turn that returned rows)."""

    def __init__(self) -> None:
        self.pieces: list[np.ndarray] = []
        self.tags: list[int] = []  # one version per piece
        self.covered = 0

    def ask_from(self) -> int:
        """``routed_experts_start_len`` of the next turn: where the rows stop, or ``0`` when they come
        from more than one version. Then a push came since the older rows were computed and the engine
        recomputes those positions under the newer weights (its cache was flushed): asking from 0
        replaces them with the rows the next turn's tokens are computed over."""
        return 0 if len(set(self.tags)) > 1 else self.covered

    def add(self, rows: np.ndarray, start: int, version: int) -> None:
        """A turn's rows of positions ``[start, start + len(rows))``, computed at ``version``."""
        if start > self.covered:
            raise AssertionError(f"routed rows from {start} leave a gap after {self.covered}")
        if start == 0:
            self.pieces, self.tags = [], []
        elif start < self.covered:
            raise AssertionError(f"routed rows from {start} overlap the rows up to {self.covered}")
        self.pieces.append(np.asarray(rows))
        self.tags.append(int(version))
        self.covered = start + len(rows)

    def row_versions(self, rows: int) -> np.ndarray:
        """int64 ``[rows]``: the version of each stored row; positions past ``covered`` (never run by
        the engine, no trained token depends on them) take the last version."""
        if not self.pieces:
            return np.zeros(rows, np.int64)
        v = np.concatenate([np.full(len(p), t, np.int64) for p, t in zip(self.pieces, self.tags)])
        return np.concatenate([v, np.full(max(rows - len(v), 0), v[-1] if len(v) else 0, np.int64)])[:rows]


def mismatched_tokens(prompt_len: int, versions: np.ndarray, loss_mask: Optional[np.ndarray],
                      row_versions: np.ndarray) -> np.ndarray:
    """bool ``[R]``: the model tokens (``loss_mask`` 1; all when None) whose behaviour log-prob was not
    computed over the stored routing. Response token ``j`` sits at position ``P + j``; its log-prob
    came from the forward at position ``P + j - 1`` over the rows of positions ``[0, P + j)``, which
    must all carry ``versions[j]``."""
    versions = np.asarray(versions, np.int64)
    r = versions.shape[0]
    rv = np.asarray(row_versions, np.int64)
    if rv.shape[0] < prompt_len + r - 1:
        raise ValueError(f"{rv.shape[0]} row versions for {prompt_len} + {r} tokens; expected {prompt_len + r - 1}")
    model = np.ones(r, bool) if loss_mask is None else np.asarray(loss_mask).astype(bool)
    if r == 0:
        return model
    last = prompt_len + np.arange(r) - 1  # the last row each token's log-prob depends on
    lo, hi = np.minimum.accumulate(rv), np.maximum.accumulate(rv)
    return model & ((lo[last] != versions) | (hi[last] != versions))


def row_version_spans(row_versions: np.ndarray) -> list[list[int]]:
    """``[[version, start, end], ...]`` runs of ``row_versions`` (``metadata["routing"]["row_versions"]``,
    SGLang's ``weight_versions`` span form over rows instead of output tokens)."""
    rv = np.asarray(row_versions, np.int64)
    if rv.size == 0:
        return []
    cut = np.flatnonzero(np.diff(rv)) + 1
    starts, ends = np.r_[0, cut], np.r_[cut, rv.size]
    return [[int(rv[a]), int(a), int(b)] for a, b in zip(starts, ends)]


def keep_replayable(prompt_len: int, versions: np.ndarray, loss_mask: Optional[np.ndarray],
                    row_versions: np.ndarray, *, replay: bool) -> tuple[np.ndarray, dict]:
    """``(loss_mask, metadata["routing"])`` of a trajectory: with ``replay`` (routing is replayed) the
    mismatched tokens (:func:`mismatched_tokens`) are masked from the loss; the record keeps the rows'
    versions, the model tokens and the mismatched ones either way."""
    r = np.asarray(versions).shape[0]
    mask = np.ones(r, np.uint8) if loss_mask is None else np.array(loss_mask, np.uint8)
    bad = mismatched_tokens(prompt_len, versions, mask, row_versions)
    record = {"row_versions": row_version_spans(row_versions), "model_tokens": int(mask.sum()),
              "mismatched_tokens": int(bad.sum())}
    if replay:
        mask[bad] = 0
    return mask, record
