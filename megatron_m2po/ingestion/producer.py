"""External rollout: producers that run outside the trainer (agent harnesses, tools, slime-style
rollout functions) and push version-tagged trajectories to the rollout store.

The protocol (four steps, any language; this module is the Python side of it)
-----------------------------------------------------------------------------
1. **Ask for the current weight version.** ``GET /v1/version`` on the ingestion endpoint --
   ``m2po store serve`` or the trainer's own endpoint when it runs with
   ``rollout.source=external`` (``store.serve_host:serve_port``) -- answers
   ``{"version": v}``: the number of optimizer updates the trainer has applied and published.
   ``null`` means nothing was published yet: the base model, version 0.
2. **Load the weights of a version.** Either from the disk weight-sync directory the trainer
   writes, ``<run_dir>/weights/v<version>/`` (``rollout.weight_sync_dir``): a complete HF model
   directory (safetensors + config + tokenizer files) with ``m2po_version.json`` =
   ``{"version": v}``; directories appear atomically (written as ``v<N>.tmp``, then renamed)
   and only the newest ``keep_last`` are kept, so load soon after you pick one. Or use engines
   the trainer updates itself (``rollout.external_addrs``): ``/model_info``'s ``weight_version`` and SGLang's
   ``meta_info["weight_version"]`` (per-token spans in ``meta_info["weight_versions"]``) say
   what they hold. The trainer publishes version ``v``
   (step 1) only after ``v<v>`` is complete.
3. **Generate with your own harness.** Keep, for every response token, the behaviour
   log-prob the sampler used (SGLang: ``output_token_logprobs``, i.e. ``log_softmax(logits /
   temperature)`` of the sampled token) and the version of the weights that produced it --
   the version of the weights you *loaded*, not the trainer's version at push time. A
   response that spanned a weight reload carries several versions (non-decreasing). Tokens
   you do not want trained on (tool output, environment text) get ``loss_mask = 0`` and any
   log-prob ``<= 0`` (0.0 is customary).
4. **Push groups.** All samples of one prompt form a :class:`~megatron_m2po.store.types.Group`
   of :class:`~megatron_m2po.store.types.Trajectory` records (prompt ids, response ids,
   behaviour log-probs, per-token versions, reward, loss mask, finish reason). ``POST
   /v1/groups`` with ``Authorization: Bearer <token>`` (``StoreClient.put_groups``); the
   server validates every field, refuses versions ahead of the trainer's (400; before the
   trainer published a version only version 0 exists), refuses sizes over its limits (400
   naming the field, the value and the limit; the client never retries a 4xx), and is
   idempotent by group id, so resending after a lost answer is safe (a duplicate even when
   the store is full). The token is a *producer* credential: ``POST /v1/version`` needs the
   trainer's token (403 otherwise). The trainer consumes
   them under ``store.max_staleness`` (bounded lag: ``trainer.mode=async``).

Python API
----------
* :class:`ExternalProducer` -- ``current_version()``, ``weights_for(version) -> WeightsRef``,
  ``push(groups)``; wraps :class:`~megatron_m2po.store.client.StoreClient`.
* :func:`make_group` and :class:`Completion` -- build a validated group from plain lists.
* :func:`slime_samples_to_groups` and :class:`SlimeRolloutAdapter` -- run a slime-style
  rollout function ``generate_rollout(args, rollout_id, data_buffer, evaluation=False)`` and
  convert the ``Sample`` objects it returns (slime ``slime/utils/types.py``: ``tokens`` = prompt
  + response ids, ``response_length``, ``rollout_log_probs``, ``loss_mask`` over the response,
  ``reward``, ``status``, ``group_index``, ``index``, ``weight_versions``) to groups.

``examples/external_producer.py`` is a complete harness built on this module.

Example::

    prod = ExternalProducer("http://trainer:8765", token=os.environ["M2PO_STORE_TOKEN"],
                            weights_dir="runs/x/weights", base_model_path="models/base")
    ref = prod.weights_for(prod.current_version())     # WeightsRef(path, version)
    ... generate with the model at ref.path ...
    prod.push([make_group("h1-p17", prompt_ids, [Completion(ids, logps, reward, ref.version)])])
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar, Union

import numpy as np

from megatron_m2po.store.client import StoreClient
from megatron_m2po.store.types import Group, Trajectory

__all__ = ["ExternalProducer", "WeightsRef", "Completion", "make_group", "latest_weights",
           "slime_samples_to_groups", "SlimeRolloutAdapter"]

_VDIR = re.compile(r"^v(\d+)$")
log = logging.getLogger(__name__)
T = TypeVar("T")


# --------------------------------------------------------------------------- weights

@dataclass(frozen=True, slots=True)
class WeightsRef:
    """An HF model directory and the weight version it holds (0 = the base model)."""

    path: str
    version: int


def latest_weights(weights_dir: Union[str, Path], *, max_version: Optional[int] = None) -> Optional[WeightsRef]:
    """The newest complete ``v<N>`` directory of the weight-sync dir (``N <= max_version``).

    Complete means: named ``v<N>`` (not ``.tmp``), holding ``m2po_version.json`` whose version is
    ``N`` and at least one ``*.safetensors`` file. Returns None when there is none.
    """
    root = Path(weights_dir)
    if not root.is_dir():
        return None
    found = []
    for p in root.iterdir():
        m = _VDIR.match(p.name)
        if not (m and p.is_dir()):
            continue
        n = int(m.group(1))
        if max_version is not None and n > max_version:
            continue
        try:
            meta = json.loads((p / "m2po_version.json").read_text())
        except (OSError, ValueError):
            continue
        if int(meta.get("version", -1)) != n or not any(p.glob("*.safetensors")):
            continue
        found.append((n, p))
    if not found:
        return None
    n, p = max(found)
    return WeightsRef(str(p), n)


# --------------------------------------------------------------------------- groups

@dataclass(slots=True)
class Completion:
    """One sampled response, as a harness has it.

    ``versions`` is one int for the whole response or one per token; ``logprobs`` are the
    behaviour log-probs of the response tokens (the sampler's); ``loss_mask`` defaults to all
    ones.
    """

    response_ids: Sequence[int]
    logprobs: Sequence[float]
    reward: float
    versions: Union[int, Sequence[int]]
    loss_mask: Optional[Sequence[int]] = None
    finish_reason: str = "stop"
    metadata: dict = field(default_factory=dict)


def make_group(group_id: str, prompt_ids: Sequence[int], completions: Sequence[Completion], *,
               metadata: Optional[dict] = None) -> Group:
    """A validated :class:`Group`; trajectory uids are ``f"{group_id}-{j}"``."""
    trajs = []
    for j, c in enumerate(completions):
        if c.logprobs is None or len(c.logprobs) != len(c.response_ids):
            raise ValueError(f"group {group_id!r} sample {j}: {len(c.response_ids)} response tokens but "
                             f"{None if c.logprobs is None else len(c.logprobs)} log-probs; every response token "
                             "needs the behaviour log-prob the sampler used (SGLang: return_logprob=True)")
        trajs.append(Trajectory(uid=f"{group_id}-{j}", group_id=group_id, prompt_ids=np.asarray(prompt_ids),
                                response_ids=np.asarray(c.response_ids), behav_logprobs=np.asarray(c.logprobs),
                                versions=np.asarray(c.versions), reward=float(c.reward),
                                loss_mask=None if c.loss_mask is None else np.asarray(c.loss_mask),
                                finish_reason=c.finish_reason, metadata={**(metadata or {}), **c.metadata}))
    g = Group(group_id, trajs)
    g.validate()
    return g


class ExternalProducer:
    """A producer outside the trainer: version, weights, push (see the module docstring).

    Args:
        store_url: ingestion endpoint (``m2po store serve`` or the trainer's).
        token: bearer token (default: the ``M2PO_STORE_TOKEN`` env var).
        weights_dir: the trainer's disk weight-sync directory (``<run_dir>/weights``).
        base_model_path: the base model (version 0), used until a ``v<N>`` directory exists.
        client: a :class:`StoreClient` to use instead of building one.
    """

    def __init__(self, store_url: str, token: Optional[str] = None, *, weights_dir: Optional[str] = None,
                 base_model_path: Optional[str] = None, client: Optional[StoreClient] = None, **client_kw: Any):
        self.client = client or StoreClient(store_url, token, **client_kw)
        self.weights_dir, self.base_model_path = weights_dir, base_model_path

    def current_version(self) -> int:
        """The trainer's published weight version (0 until it published one)."""
        v = self.client.get_version()
        return 0 if v is None else int(v)

    def weights_for(self, version: int) -> WeightsRef:
        """The newest weights at or below ``version``: ``weights_dir/v<N>``, else the base model (0)."""
        ref = latest_weights(self.weights_dir, max_version=version) if self.weights_dir else None
        if ref is not None:
            return ref
        if self.base_model_path is None:
            raise ValueError(f"no complete v<N> directory with N <= {version} in weights_dir={self.weights_dir!r} "
                             "and no base_model_path: pass base_model_path (the model at version 0) or point "
                             "weights_dir at the trainer's rollout.weight_sync_dir")
        return WeightsRef(str(self.base_model_path), 0)

    def load_weights(self, version: int, loader: Callable[[str], T], *, attempts: int = 5) -> tuple[T, WeightsRef]:
        """``loader(path)`` on the newest weights at or below ``version``, again on newer ones if
        the trainer prunes the chosen directory while it is being read (it keeps only the last
        few ``v<N>``); returns what the loader returned and the weights it read."""
        for attempt in range(attempts):
            ref = self.weights_for(version)
            try:
                return loader(ref.path), ref
            except (OSError, ValueError):
                if Path(ref.path).is_dir() or attempt == attempts - 1:
                    raise  # not a pruned directory: a real error
                log.info("weights %s were pruned while loading; taking the newest again", ref.path)
        raise AssertionError("unreachable")

    def push(self, groups: Iterable[Group]) -> dict:
        """Validate locally against the trainer's version, then POST; returns the server's answer."""
        groups = list(groups)
        cv = self.current_version()
        for g in groups:
            g.validate(current_version=cv)
        return self.client.put_groups(groups)


# --------------------------------------------------------------------------- slime adapter

_SLIME_STATUS = {"completed": "stop", "truncated": "length", "aborted": "abort", "failed": "abort"}


def _status(sample: Any) -> str:
    st = getattr(sample, "status", "completed")
    return str(getattr(st, "value", st)).lower()


def _json_safe(d: dict) -> dict:
    out = {}
    for k, v in (d or {}).items():
        try:
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError):
            continue
        out[str(k)] = v
    return out


def _sample_version(sample: Any, version: int, who: str) -> int:
    """The engine-reported versions (slime appends ``meta_info["weight_version"]`` per turn) win;
    the oldest one tags every token (staleness is then an upper bound). Otherwise ``version``."""
    reported = [str(v) for v in (getattr(sample, "weight_versions", None) or [])]
    if reported and all(v.strip().lstrip("-").isdigit() for v in reported):
        return min(int(v) for v in reported)
    if reported and version is None:
        raise ValueError(f"{who}: weight_versions={reported[:4]} are not integers and no version was given")
    if version is None:
        raise ValueError(f"{who}: the sample has no weight_versions; pass version= (the weight version "
                         "the harness generated with)")
    return int(version)


def _reward(sample: Any, reward_key: Optional[str], who: str) -> float:
    r = getattr(sample, "reward", None)
    if isinstance(r, dict):
        if reward_key is None or reward_key not in r:
            raise ValueError(f"{who}: reward is a dict with keys {sorted(r)}; pass reward_key= (slime: --reward-key)")
        r = r[reward_key]
    if r is None:
        raise ValueError(f"{who}: reward is None; score the samples inside the rollout function "
                         "(slime: --custom-rm-path / --rm-type) before converting")
    r = float(r)
    if not math.isfinite(r):
        raise ValueError(f"{who}: reward={r} is not finite")
    return r


def _to_trajectory(sample: Any, gid: str, uid: str, version: Optional[int], reward_key: Optional[str]) -> Trajectory:
    who = f"slime sample {uid} (group_index={getattr(sample, 'group_index', None)}, index={getattr(sample, 'index', None)})"
    status = _status(sample)
    if status not in _SLIME_STATUS:
        raise ValueError(f"{who}: status {status!r} was not generated (expected one of {sorted(_SLIME_STATUS)})")
    tokens = list(getattr(sample, "tokens", None) or [])
    n = int(getattr(sample, "response_length", 0) or 0)
    if n <= 0 or n >= len(tokens):
        raise ValueError(f"{who}: response_length={n} with {len(tokens)} tokens; tokens must be prompt + response "
                         "and both must be non-empty")
    lps = getattr(sample, "rollout_log_probs", None)
    if lps is None:
        raise ValueError(f"{who}: rollout_log_probs is missing. The behaviour log-probs are required (M2PO's ratio "
                         "needs them): request them from SGLang (return_logprob=True) and store them in "
                         "sample.rollout_log_probs, 0.0 for non-generated (loss_mask=0) tokens")
    lps = [float(x) for x in lps]
    if len(lps) != n:
        raise ValueError(f"{who}: {len(lps)} rollout_log_probs for response_length={n}")
    mask = getattr(sample, "loss_mask", None)
    mask = [1] * n if mask is None else [int(x) for x in mask]
    if len(mask) != n:
        raise ValueError(f"{who}: loss_mask has {len(mask)} entries for response_length={n}")
    if getattr(sample, "remove_sample", False):
        mask = [0] * n  # slime drops it from the loss; it still counts in its group's advantage
    v = _sample_version(sample, version, who)
    meta = {"source": "slime", "slime_status": status, "slime_index": getattr(sample, "index", None),
            "prompt_index": getattr(sample, "group_index", None)}
    label = getattr(sample, "label", None)
    if label is not None:
        meta["answer"] = str(label)
    meta.update(_json_safe(getattr(sample, "metadata", None) or {}))
    return Trajectory(uid=uid, group_id=gid, prompt_ids=np.asarray(tokens[:-n]), response_ids=np.asarray(tokens[-n:]),
                      behav_logprobs=np.asarray(lps), versions=np.full(n, v, dtype=np.int64),
                      reward=_reward(sample, reward_key, who), loss_mask=np.asarray(mask),
                      finish_reason=_SLIME_STATUS[status], metadata=meta)


def slime_samples_to_groups(samples: Any, *, version: Optional[int] = None, group_prefix: str = "slime",
                            reward_key: Optional[str] = None) -> list[Group]:
    """Convert a slime rollout output to validated groups.

    ``samples``: slime's ``RolloutFnTrainOutput`` (its ``.samples``), a ``list[list[Sample]]``
    (one inner list per prompt, slime's shape), or a flat ``list[Sample]`` grouped by
    ``group_index``. Group ids are ``f"{group_prefix}-g{group_index}"`` (the inner list's
    position when ``group_index`` is None), uids ``f"{group_id}-{j}"``. Token versions: the
    oldest of a sample's ``weight_versions`` when the engine reported integers, else
    ``version``. Samples with ``remove_sample=True`` are kept with ``loss_mask = 0``.
    """
    samples = getattr(samples, "samples", samples)
    if isinstance(samples, tuple):  # slime's async helpers return (output, aborted)
        samples = samples[0]
        samples = getattr(samples, "samples", samples)
    if not isinstance(samples, (list, tuple)):
        raise ValueError(f"slime rollout output must be list[list[Sample]] or list[Sample], got {type(samples).__name__}")
    buckets: dict[Any, list] = {}
    if samples and all(isinstance(g, (list, tuple)) for g in samples):
        for pos, grp in enumerate(samples):
            if any(isinstance(s, (list, tuple)) for s in grp):
                raise ValueError(f"group {pos}: nested lists of samples (slime's fan-out generate) are not supported; "
                                 "flatten each trajectory into one Sample with loss_mask=0 on non-generated tokens")
            gidx = {getattr(s, "group_index", None) for s in grp}
            key = gidx.pop() if len(gidx) == 1 and None not in gidx else pos
            if key in buckets:
                raise ValueError(f"two inner lists share group_index={key!r}")
            buckets[key] = list(grp)
    else:
        for i, s in enumerate(samples):
            gi = getattr(s, "group_index", None)
            if gi is None:
                raise ValueError(f"sample {i} of a flat list has group_index=None: group samples as "
                                 "list[list[Sample]] (one list per prompt) or set group_index")
            buckets.setdefault(gi, []).append(s)
    groups = []
    for key, grp in buckets.items():
        gid = f"{group_prefix}-g{key}"
        grp = sorted(grp, key=lambda s: (getattr(s, "index", None) is None, getattr(s, "index", 0) or 0))
        trajs = [_to_trajectory(s, gid, f"{gid}-{j}", version, reward_key) for j, s in enumerate(grp)]
        g = Group(gid, trajs)
        g.validate()
        groups.append(g)
    return groups


class SlimeRolloutAdapter:
    """Runs a slime-style rollout function and pushes its output as groups.

    ``rollout_fn(args, rollout_id, data_buffer, evaluation=False)`` may be sync or async and
    return ``RolloutFnTrainOutput`` or ``list[list[Sample]]``. Each :meth:`run` asks the trainer
    for its version first (used for samples without engine-reported versions: point the
    function's engines at the weights of that version, e.g. ``producer.weights_for(v)``).
    """

    def __init__(self, rollout_fn: Callable, args: Any, data_buffer: Any, producer: ExternalProducer, *,
                 reward_key: Optional[str] = None, group_prefix: str = "slime") -> None:
        params = [p for p in inspect.signature(rollout_fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(params) < 3:
            raise ValueError(f"rollout function {getattr(rollout_fn, '__name__', rollout_fn)!r} must take "
                             f"(args, rollout_id, data_buffer, evaluation=False); it takes {[p.name for p in params]}")
        self.fn, self.args, self.data_buffer, self.producer = rollout_fn, args, data_buffer, producer
        self.reward_key, self.group_prefix = reward_key, group_prefix

    def collect(self, rollout_id: int, version: Optional[int] = None) -> list[Group]:
        """Call the function once and convert; ``version`` defaults to the trainer's current one."""
        v = self.producer.current_version() if version is None else version
        out = self.fn(self.args, rollout_id, self.data_buffer, evaluation=False)
        if inspect.isawaitable(out):
            out = asyncio.run(_await(out))
        return slime_samples_to_groups(out, version=v, group_prefix=f"{self.group_prefix}-r{rollout_id}",
                                       reward_key=self.reward_key)

    def run(self, rollout_id: int, version: Optional[int] = None) -> dict:
        """:meth:`collect` then push; returns the server's answer."""
        return self.producer.push(self.collect(rollout_id, version))


async def _await(aw):
    return await aw
