"""Typed records that cross process boundaries: a trajectory and a prompt group.

A :class:`Trajectory` is one sampled response to one prompt. Its response tokens carry the
behaviour log-probs the engine reported and, per token, the weight *version* (number of
optimizer updates applied) of the weights that produced it: a partial rollout that spanned a
weight update carries several versions. A :class:`Group` is the ``n`` samples of one prompt;
groups are the unit of storage and consumption because GRPO normalises within a group.

``validate()`` checks the contract and raises ``ValueError`` naming the field and the value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import numpy as np

FINISH_REASONS = ("stop", "length", "abort")


def _arr(x: Any, dtype: Any) -> np.ndarray:
    a = np.asarray(x, dtype=dtype)
    return a.reshape(-1)


@dataclass(slots=True)
class Trajectory:
    """One response.

    Attributes:
        uid: globally unique id of this sample (idempotency key; canonical order key).
        group_id: id of the prompt group (all samples of one prompt share it).
        prompt_ids: prompt token ids, int32 [P].
        response_ids: response token ids, int32 [R].
        behav_logprobs: behaviour-policy log-prob of each response token, float32 [R], finite, <= 0.
        versions: weight version that produced each response token, int64 [R], non-decreasing.
        reward: scalar reward, or None until scored.
        loss_mask: 1 where a response token is trained on (0 for tool/env tokens, and with routing
            replay for tokens whose stored routing did not compute them: rollout/routing_versions.py),
            uint8 [R].
        finish_reason: "stop", "length" or "abort".
        metadata: free-form JSON-serialisable dict (prompt index, answer, engine, ...).
        recomputed_behav_logprobs: optional trainer-side behaviour log-probs [R] (TIS / mismatch).
        routed_experts: optional MoE routing the engine used, int32 ``[P + R - 1, layers, top_k]``:
            row ``i`` holds the top-k expert ids each layer's router picked for the token at
            position ``i`` of prompt + response (SGLang 0.5.23's ``meta_info["routed_experts"]``
            with ``routed_experts_start_len=0``: every position but the last, whose forward
            never ran). Replayed by the trainer with ``algo.routing_replay=rollout``.
        teacher_logprobs: optional float32 [R]: a distillation teacher's log-prob of each response
            token (``algo.distill.mode=sglang``: the teacher engines' scoring, stored with the
            trajectory so a resumed or replayed step reads the same numbers; any value where
            ``loss_mask`` is 0, finite and <= 0 where it is 1).
    """

    uid: str
    group_id: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behav_logprobs: np.ndarray
    versions: np.ndarray
    reward: Optional[float] = None
    loss_mask: Optional[np.ndarray] = None
    finish_reason: str = "stop"
    metadata: dict = field(default_factory=dict)
    recomputed_behav_logprobs: Optional[np.ndarray] = None
    routed_experts: Optional[np.ndarray] = None
    teacher_logprobs: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        self.prompt_ids = _arr(self.prompt_ids, np.int32)
        self.response_ids = _arr(self.response_ids, np.int32)
        self.behav_logprobs = _arr(self.behav_logprobs, np.float32)
        v = np.asarray(self.versions, dtype=np.int64)
        if v.ndim == 0:  # a single version for the whole response
            v = np.full(self.response_ids.shape[0], int(v), dtype=np.int64)
        self.versions = v.reshape(-1)
        if self.loss_mask is None:
            self.loss_mask = np.ones(self.response_ids.shape[0], dtype=np.uint8)
        else:
            self.loss_mask = _arr(self.loss_mask, np.uint8)
        if self.recomputed_behav_logprobs is not None:
            self.recomputed_behav_logprobs = _arr(self.recomputed_behav_logprobs, np.float32)
        if self.teacher_logprobs is not None:
            self.teacher_logprobs = _arr(self.teacher_logprobs, np.float32)
        if self.routed_experts is not None:
            a = np.asarray(self.routed_experts)
            if a.dtype.kind not in "iu":
                raise ValueError(f"trajectory {self.uid!r}: routed_experts must hold integer expert ids, "
                                 f"got dtype {a.dtype}")
            self.routed_experts = a.astype(np.int32)

    @property
    def num_tokens(self) -> int:
        return int(self.prompt_ids.shape[0] + self.response_ids.shape[0])

    @property
    def min_version(self) -> int:
        return int(self.versions.min()) if self.versions.size else -1

    @property
    def max_version(self) -> int:
        return int(self.versions.max()) if self.versions.size else -1

    def validate(self, *, current_version: Optional[int] = None, allow_empty: bool = False,
                 routing: Optional["RoutingSpec"] = None) -> None:
        """Raise ValueError naming the offending field and value (``routing``: the model's
        routed-experts shape, checked by :meth:`RoutingSpec.check`)."""
        who = f"trajectory {self.uid!r}"
        if not isinstance(self.uid, str) or not self.uid:
            raise ValueError(f"trajectory uid must be a non-empty string, got {self.uid!r}")
        if not isinstance(self.group_id, str) or not self.group_id:
            raise ValueError(f"{who}: group_id must be a non-empty string, got {self.group_id!r}")
        r = self.response_ids.shape[0]
        if self.prompt_ids.shape[0] == 0:
            raise ValueError(f"{who}: prompt_ids is empty")
        if r == 0 and not allow_empty:
            raise ValueError(f"{who}: response_ids is empty (an empty response cannot be trained on; "
                             "drop it or allow empty responses explicitly)")
        for name in ("behav_logprobs", "versions", "loss_mask"):
            n = getattr(self, name).shape[0]
            if n != r:
                raise ValueError(f"{who}: {name} has {n} entries but response_ids has {r}")
        if self.recomputed_behav_logprobs is not None and self.recomputed_behav_logprobs.shape[0] != r:
            raise ValueError(f"{who}: recomputed_behav_logprobs has {self.recomputed_behav_logprobs.shape[0]} "
                             f"entries but response_ids has {r}")
        lp = self.behav_logprobs
        if r:
            bad = np.flatnonzero(~np.isfinite(lp))
            if bad.size:
                raise ValueError(f"{who}: behav_logprobs[{bad[0]}]={lp[bad[0]]} is not finite")
            bad = np.flatnonzero(lp > 1e-6)
            if bad.size:
                raise ValueError(f"{who}: behav_logprobs[{bad[0]}]={lp[bad[0]]} > 0 is not a log-probability")
            tea = self.teacher_logprobs
            if tea is not None:
                if tea.shape[0] != r:
                    raise ValueError(f"{who}: teacher_logprobs has {tea.shape[0]} entries but response_ids has {r}")
                on = self.loss_mask > 0
                bad = np.flatnonzero(on & (~np.isfinite(tea) | (tea > 1e-6)))
                if bad.size:
                    raise ValueError(f"{who}: teacher_logprobs[{bad[0]}]={tea[bad[0]]} on a trained token must be "
                                     "finite and <= 0 (a log-probability)")
            rec = self.recomputed_behav_logprobs
            if rec is not None:
                bad = np.flatnonzero(~np.isfinite(rec) | (rec > 1e-6))
                if bad.size:
                    raise ValueError(f"{who}: recomputed_behav_logprobs[{bad[0]}]={rec[bad[0]]} must be finite "
                                     "and <= 0 (a log-probability)")
            if (self.prompt_ids < 0).any() or (self.response_ids < 0).any():
                raise ValueError(f"{who}: token ids must be >= 0")
            if (self.versions < 0).any():
                raise ValueError(f"{who}: versions[{int(np.flatnonzero(self.versions < 0)[0])}] is negative")
            if (np.diff(self.versions) < 0).any():
                i = int(np.flatnonzero(np.diff(self.versions) < 0)[0])
                raise ValueError(f"{who}: versions decrease at token {i + 1} "
                                 f"({self.versions[i]} -> {self.versions[i + 1]}); weights only move forward")
            if current_version is not None and self.max_version > current_version:
                raise ValueError(f"{who}: versions reach {self.max_version}, ahead of the trainer's current "
                                 f"version {current_version} (a producer cannot use weights that do not exist yet)")
            if self.loss_mask.size and (int(self.loss_mask.max()) > 1 or int(self.loss_mask.min()) < 0):
                raise ValueError(f"{who}: loss_mask must hold only 0 and 1")
        if self.reward is not None and (isinstance(self.reward, bool) or not isinstance(self.reward, (int, float))
                                        or (isinstance(self.reward, int) and abs(self.reward) > 1 << 128)
                                        or not math.isfinite(self.reward)):
            raise ValueError(f"{who}: reward={self.reward!r} must be a finite number or None")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"{who}: finish_reason={self.finish_reason!r} is not one of {list(FINISH_REASONS)}")
        if not isinstance(self.metadata, dict):
            raise ValueError(f"{who}: metadata must be a dict, got {type(self.metadata).__name__}")
        if self.routed_experts is not None or (routing is not None and routing.required):
            (routing or RoutingSpec.ANY).check(self)


@dataclass(slots=True)
class Group:
    """All samples of one prompt; stored and served atomically."""

    group_id: str
    trajectories: list[Trajectory]

    def validate(self, *, current_version: Optional[int] = None, allow_empty: bool = False,
                 routing: Optional["RoutingSpec"] = None) -> None:
        if not self.trajectories:
            raise ValueError(f"group {self.group_id!r} has no trajectories")
        seen = set()
        for t in self.trajectories:
            if t.group_id != self.group_id:
                raise ValueError(f"group {self.group_id!r}: trajectory {t.uid!r} has group_id {t.group_id!r}")
            if t.uid in seen:
                raise ValueError(f"group {self.group_id!r}: duplicate uid {t.uid!r}")
            seen.add(t.uid)
            t.validate(current_version=current_version, allow_empty=allow_empty, routing=routing)

    @property
    def min_version(self) -> int:
        return min(t.min_version for t in self.trajectories)

    @property
    def max_version(self) -> int:
        return max(t.max_version for t in self.trajectories)

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.trajectories)


@dataclass(frozen=True)
class RoutingSpec:
    """The routed-experts layout a store accepts: ``[P + R - 1, num_layers, top_k]`` ids in
    ``[0, num_experts)``, distinct within a row (a router picks ``top_k`` different experts).

    ``required``: every trajectory must carry routed experts (``algo.routing_replay=rollout``
    replays them; a trajectory without them could not be trained on, so it is refused at
    ingest rather than at the trainer). ``num_layers == 0`` checks only what holds for any model
    (integer ids, rank 3, the token count, distinct ids)."""

    num_layers: int = 0
    top_k: int = 0
    num_experts: int = 0
    required: bool = False

    ANY: ClassVar["RoutingSpec"]

    def to_json(self) -> str:
        return json.dumps({"num_layers": self.num_layers, "top_k": self.top_k, "num_experts": self.num_experts,
                           "required": self.required})

    @classmethod
    def from_json(cls, s: str) -> "RoutingSpec":
        d = json.loads(s)
        return cls(int(d["num_layers"]), int(d["top_k"]), int(d["num_experts"]), bool(d["required"]))

    def check(self, t: Trajectory) -> None:
        who = f"trajectory {t.uid!r}"
        a = t.routed_experts
        if a is None:
            raise ValueError(f"{who}: routed_experts are missing, and this store replays routing "
                             "(algo.routing_replay=rollout): request them from SGLang (return_routed_experts=true, "
                             "engines started with --enable-return-routed-experts) and send them with every trajectory")
        rows = t.num_tokens - 1
        if a.ndim != 3 or a.shape[0] != rows:
            raise ValueError(f"{who}: routed_experts has shape {list(a.shape)}, expected [{rows}, layers, top_k] "
                             f"(one row per position of the {t.num_tokens} prompt + response tokens but the last)")
        if self.num_layers and a.shape[1:] != (self.num_layers, self.top_k):
            raise ValueError(f"{who}: routed_experts has {a.shape[1]} layers x {a.shape[2]} experts per token, the "
                             f"model has {self.num_layers} layers x top_k={self.top_k}")
        if a.size:
            lo, hi = int(a.min()), int(a.max())
            if lo < 0 or (self.num_experts and hi >= self.num_experts):
                bad = np.argwhere((a < 0) | (a >= (self.num_experts or np.iinfo(np.int32).max)))[0].tolist()
                raise ValueError(f"{who}: routed_experts{bad} = {int(a[tuple(bad)])} is not an expert id in "
                                 f"[0, {self.num_experts or 'num_experts'})")
            s = np.sort(a, axis=-1)
            dup = np.argwhere((s[..., 1:] == s[..., :-1]).any(-1))
            if dup.size:
                i, layer = dup[0].tolist()
                raise ValueError(f"{who}: routed_experts of position {i}, layer {layer} repeat an expert "
                                 f"({a[i, layer].tolist()}); a router picks top_k distinct experts")


RoutingSpec.ANY = RoutingSpec()
