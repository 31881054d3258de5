"""Wire and storage encodings of prompt groups.

Two encodings of a batch of :class:`~megatron_m2po.store.types.Group` for the HTTP ingestion
API (``POST /v1/groups``), both decoded strictly: any malformed field raises
:class:`PayloadError` (a ``ValueError``) naming the field, before anything is stored.

**JSON** (``Content-Type: application/json``)::

    {"groups": [{"group_id": "g1", "trajectories": [
        {"uid": "g1/0", "group_id": "g1", "prompt_ids": [1, 2], "response_ids": [3, 4],
         "behav_logprobs": [-0.1, -2.3], "versions": [7, 7],     # or 7, or {"runs": [[7, 2]]}
         "reward": 1.0, "loss_mask": [1, 1], "finish_reason": "stop", "metadata": {},
         "recomputed_behav_logprobs": null, "routed_experts": null}]}]}

``group_id`` inside a trajectory may be omitted (it defaults to the group's); ``reward``,
``loss_mask``, ``finish_reason``, ``metadata``, ``recomputed_behav_logprobs`` and
``routed_experts`` (MoE routing, a ``[P + R - 1][layers][top_k]`` nested list of expert ids,
``types.Trajectory``) are optional.
``NaN`` / ``Infinity`` literals are rejected.

**Binary** (``Content-Type: application/x-m2po-groups``), for large batches — a JSON header
followed by raw little-endian arrays, no third-party dependency::

    b"M2RG" | u16 format=1 | u16 flags=0 | u32 header_len | header (UTF-8 JSON) | payload

The header is ``{"groups": [{"group_id": ..., "trajectories": [T, ...]}]}`` where each ``T``
holds the scalar fields of a trajectory (uid, reward, finish_reason, metadata) plus the counts
``n_prompt``, ``n_response``, ``n_runs``, the flags ``has_loss_mask``,
``has_recomputed`` and, with routed experts, ``routed_shape`` ``[layers, top_k]``. The payload holds, per trajectory in header order: ``prompt_ids`` (<i4 x
n_prompt), ``response_ids`` (<i4 x n_response), ``behav_logprobs`` (<f4 x n_response), the
version runs (<i8 x 2 x n_runs: version, count pairs), ``loss_mask`` (u1 x n_response, when
flagged), ``recomputed_behav_logprobs`` (<f4 x n_response, when flagged), the routed experts
(<u2 x (n_prompt + n_response - 1) x layers x top_k, with ``routed_shape``). The payload length
must match the header exactly.

Versions are run-length encoded everywhere (a response generated at one version is one run).
:func:`group_digest` is the content hash used for idempotency: a re-sent group with the same
digest is a duplicate; a different digest under a known id is a conflict.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from typing import Any, Iterable, Optional

import numpy as np

from megatron_m2po.store.types import Group, Trajectory

__all__ = [
    "PayloadError", "PayloadTooLarge", "JSON_CONTENT_TYPE", "BINARY_CONTENT_TYPE", "rle_encode", "rle_decode",
    "encode_json", "decode_json", "encode_binary", "decode_binary", "decode_payload",
    "group_digest", "group_to_dict", "group_from_dict",
]

JSON_CONTENT_TYPE = "application/json"
BINARY_CONTENT_TYPE = "application/x-m2po-groups"
MAGIC = b"M2RG"
FORMAT = 1
_PREAMBLE = struct.Struct("<4sHHI")
_ARRAY_FIELDS = ("prompt_ids", "response_ids", "behav_logprobs", "loss_mask", "recomputed_behav_logprobs")


class PayloadError(ValueError):
    """A request body cannot be decoded into groups; the message names the field."""


class PayloadTooLarge(PayloadError):
    """A part of the body is over a size limit checked before it is parsed (HTTP 413)."""


# Limits checked against *declared* sizes before anything is allocated (issue 17).
MAX_GROUPS_PER_REQUEST = 4096
MAX_TRAJECTORIES_PER_GROUP = 4096
MAX_TOKENS_PER_ARRAY = 1 << 21          # prompt or response tokens of one trajectory
MAX_VERSION = (1 << 63) - 1
MAX_METADATA_DEPTH = 16
MAX_METADATA_BYTES = 64 * 1024
MAX_ID_CHARS = 1024                     # uid, group_id
# JSON (a body, or the header of the binary framing) is parsed into Python objects before any
# field can be checked, and the parser builds up to ~25 bytes of objects per byte of input
# (``[[],[],...]``); so JSON is bounded on its own: larger batches use the binary framing, whose
# arrays are checked against the header before they are copied.
MAX_JSON_BYTES = 8 << 20
# The costliest constructs per byte are containers (an empty list is 3 bytes of JSON and ~64 bytes
# of Python) and short strings (~50 bytes each): both are counted in the raw bytes before parsing
# (every '[' / '{' and every '"', escaped or in a string or not: an upper bound).
MAX_JSON_CONTAINERS = 1 << 18
MAX_JSON_STRINGS = 1 << 20
MAX_INT_DIGITS = 40                     # no field takes an integer beyond the float range (~39 digits)


def check_metadata(where: str, md: Any) -> dict:
    """metadata must be a JSON object nested at most MAX_METADATA_DEPTH deep, at most MAX_METADATA_BYTES."""
    if not isinstance(md, dict):
        raise PayloadError(f"{where}.metadata must be an object, got {type(md).__name__}")
    stack = [(md, 1)]
    while stack:
        x, d = stack.pop()
        if d > MAX_METADATA_DEPTH:
            raise PayloadError(f"{where}.metadata is nested deeper than the limit of {MAX_METADATA_DEPTH} levels")
        if isinstance(x, dict):
            stack.extend((v, d + 1) for v in x.values())
        elif isinstance(x, list):
            stack.extend((v, d + 1) for v in x)
    try:
        n = len(json.dumps(md, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise PayloadError(f"{where}.metadata is not JSON with finite numbers: {e}") from None
    if n > MAX_METADATA_BYTES:
        raise PayloadError(f"{where}.metadata is {n} bytes of JSON, over the limit of {MAX_METADATA_BYTES} bytes")
    return md


def _check_len(where: str, n: int) -> int:
    if n > MAX_TOKENS_PER_ARRAY:
        raise PayloadError(f"{where} declares {n} tokens, over the limit of {MAX_TOKENS_PER_ARRAY}")
    return n


# ----------------------------------------------------------------------------- versions (RLE)

def rle_encode(versions: np.ndarray) -> np.ndarray:
    """Per-token versions -> int64 [n_runs, 2] of (version, count)."""
    v = np.asarray(versions, dtype=np.int64).reshape(-1)
    if v.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    starts = np.concatenate(([0], np.flatnonzero(np.diff(v)) + 1))
    counts = np.diff(np.concatenate((starts, [v.size])))
    return np.stack([v[starts], counts], axis=1).astype(np.int64)


def rle_decode(runs: np.ndarray, expected: Optional[int] = None, where: str = "versions") -> np.ndarray:
    """Expand (version, count) runs; with ``expected`` the counts must sum to it (checked first)."""
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    if (runs[:, 1] < 0).any():
        raise PayloadError(f"{where}: version runs have a negative count: {runs[runs[:, 1] < 0][0].tolist()}")
    total = sum(int(c) for c in runs[:, 1])  # Python ints: no int64 wrap-around
    if expected is not None and total != expected:
        raise PayloadError(f"{where}: runs cover {total} tokens, but the response has {expected} "
                           "(runs are checked before they are expanded)")
    if total > MAX_TOKENS_PER_ARRAY:
        raise PayloadError(f"{where}: runs cover {total} tokens, over the limit of {MAX_TOKENS_PER_ARRAY}")
    return np.repeat(runs[:, 0], runs[:, 1])


# ----------------------------------------------------------------------------- JSON

def _reject_constant(name: str) -> Any:
    raise PayloadError(f"JSON constant {name} is not allowed (numbers must be finite)")


def _int_list(where: str, x: Any) -> np.ndarray:
    if not isinstance(x, list):
        raise PayloadError(f"{where} must be a list of integers, got {_kind(x)}")
    _check_len(where, len(x))
    for i, e in enumerate(x):
        if isinstance(e, bool) or not isinstance(e, int):
            raise PayloadError(f"{where}[{i}]={_short(e)} is not an integer")
        if not -(1 << 63) <= e < (1 << 63):
            raise PayloadError(f"{where}[{i}]={_short(e)} is out of the int64 range")
    try:
        return np.asarray(x, dtype=np.int64)
    except OverflowError:
        raise PayloadError(f"{where} holds an integer out of the int64 range") from None


def _float_list(where: str, x: Any) -> np.ndarray:
    if not isinstance(x, list):
        raise PayloadError(f"{where} must be a list of numbers, got {_kind(x)}")
    _check_len(where, len(x))
    for i, e in enumerate(x):
        if isinstance(e, bool) or not isinstance(e, (int, float)):
            raise PayloadError(f"{where}[{i}]={_short(e)} is not a number")
        if isinstance(e, int) and abs(e) > 1 << 128:
            raise PayloadError(f"{where}[{i}]={_short(e)} is out of the float range")
    return np.asarray(x, dtype=np.float32)


def _check_int32(where: str, a: np.ndarray) -> np.ndarray:
    if a.size and (a.min() < 0 or a.max() > np.iinfo(np.int32).max):
        raise PayloadError(f"{where} holds token ids outside [0, 2^31): min {a.min()}, max {a.max()}")
    return a.astype(np.int32)


def _str_field(where: str, x: Any) -> str:
    if not isinstance(x, str) or not x:
        raise PayloadError(f"{where} must be a non-empty string, got {_short(x)}")
    if len(x) > MAX_ID_CHARS:
        raise PayloadError(f"{where} has {len(x)} characters, over the limit of {MAX_ID_CHARS}")
    return x


def _kind(x: Any) -> str:
    return repr(x) if isinstance(x, _HugeInt) else type(x).__name__


def _short(x: Any) -> str:
    r = repr(x) if not isinstance(x, int) or x.bit_length() < 200 else f"an integer of {x.bit_length()} bits"
    return r if len(r) <= 80 else r[:77] + "..."


def _reward(where: str, x: Any) -> Optional[float]:
    if x is None:
        return None
    if isinstance(x, int) and not isinstance(x, bool) and abs(x) > 1 << 128:
        raise PayloadError(f"{where}={_short(x)} must be a finite number or null (out of the float range)")
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise PayloadError(f"{where}={_short(x)} must be a finite number or null")
    return float(x)


def _versions_from_json(where: str, x: Any, n: int) -> np.ndarray:
    if isinstance(x, int) and not isinstance(x, bool):
        if not 0 <= x <= MAX_VERSION:
            raise PayloadError(f"{where}={_short(x)} is outside [0, {MAX_VERSION}]")
        return np.full(n, x, dtype=np.int64)
    if isinstance(x, dict):
        if set(x) != {"runs"}:
            raise PayloadError(f"{where} as an object must be {{\"runs\": [[version, count], ...]}}")
        runs = x["runs"]
        if not isinstance(runs, list) or not all(isinstance(r, list) and len(r) == 2 for r in runs):
            raise PayloadError(f"{where}.runs must be a list of [version, count] pairs")
        if len(runs) > n:
            raise PayloadError(f"{where}.runs has {len(runs)} runs for {n} response tokens")
        flat = _int_list(f"{where}.runs", [e for r in runs for e in r])
        return rle_decode(flat.reshape(-1, 2), n, where)
    return _int_list(where, x)


def traj_from_dict(d: Any, group_id: str, where: str) -> Trajectory:
    if not isinstance(d, dict):
        raise PayloadError(f"{where} must be an object, got {type(d).__name__}")
    known = {"uid", "group_id", "prompt_ids", "response_ids", "behav_logprobs", "versions", "reward",
             "loss_mask", "finish_reason", "metadata", "recomputed_behav_logprobs", "routed_experts"}
    extra = sorted(set(d) - known)
    if extra:
        raise PayloadError(f"{where} has unknown field(s) {extra}; known: {sorted(known)}")
    for req in ("uid", "prompt_ids", "response_ids", "behav_logprobs", "versions"):
        if req not in d:
            raise PayloadError(f"{where} is missing the required field {req!r}")
    uid = _str_field(f"{where}.uid", d["uid"])
    w = f"trajectory {uid!r}"
    gid = _str_field(f"{w}.group_id", d.get("group_id", group_id))
    if gid != group_id:
        raise PayloadError(f"{w}.group_id={gid!r} differs from its group's group_id {group_id!r}")
    resp = _check_int32(f"{w}.response_ids", _int_list(f"{w}.response_ids", d["response_ids"]))
    mask = d.get("loss_mask")
    rec = d.get("recomputed_behav_logprobs")
    fr = d.get("finish_reason", "stop")
    if not isinstance(fr, str):
        raise PayloadError(f"{w}.finish_reason must be a string, got {_short(fr)}")
    md = check_metadata(w, d.get("metadata", {}))
    return Trajectory(
        uid=uid, group_id=gid,
        prompt_ids=_check_int32(f"{w}.prompt_ids", _int_list(f"{w}.prompt_ids", d["prompt_ids"])),
        response_ids=resp,
        behav_logprobs=_float_list(f"{w}.behav_logprobs", d["behav_logprobs"]),
        versions=_versions_from_json(f"{w}.versions", d["versions"], resp.shape[0]),
        reward=_reward(f"{w}.reward", d.get("reward")),
        loss_mask=None if mask is None else _int_list(f"{w}.loss_mask", mask).clip(-1, 2).astype(np.int16),
        finish_reason=fr, metadata=md,
        recomputed_behav_logprobs=None if rec is None else _float_list(f"{w}.recomputed_behav_logprobs", rec),
        routed_experts=_routed_from_json(f"{w}.routed_experts", d.get("routed_experts")),
    )


_MAX_ROUTED_LAYERS, _MAX_ROUTED_TOPK = 1024, 256


def _routed_from_json(where: str, x: Any) -> Optional[np.ndarray]:
    """A ``[tokens][layers][top_k]`` nested list of integer expert ids (the row count is checked by
    ``types.RoutingSpec.check`` against the token count); None when absent."""
    if x is None:
        return None
    if not isinstance(x, list):
        raise PayloadError(f"{where} must be a [tokens][layers][top_k] nested list of expert ids, got {_kind(x)}")
    _check_len(where, len(x))
    if x and (not isinstance(x[0], list) or len(x[0]) > _MAX_ROUTED_LAYERS
              or (x[0] and (not isinstance(x[0][0], list) or len(x[0][0]) > _MAX_ROUTED_TOPK))):
        raise PayloadError(f"{where} must be a [tokens][layers][top_k] nested list (at most {_MAX_ROUTED_LAYERS} "
                           f"layers, top_k <= {_MAX_ROUTED_TOPK})")
    try:
        a = np.asarray(x)
    except (ValueError, OverflowError):
        a = None
    if a is None or a.ndim != 3 or (a.size and a.dtype.kind not in "iu"):
        raise PayloadError(f"{where} must be a [tokens][layers][top_k] nested list of integers (the same "
                           "layers and top_k for every token)")
    if a.size and (int(a.min()) < 0 or int(a.max()) > 0xFFFF):
        raise PayloadError(f"{where} holds expert ids outside [0, 65536): min {int(a.min())}, max {int(a.max())}")
    return a.astype(np.int32)


def _groups_list(doc: Any) -> list:
    if not isinstance(doc, dict) or "groups" not in doc:
        raise PayloadError("body must be an object with a 'groups' list")
    extra = sorted(set(doc) - {"groups"})
    if extra:
        raise PayloadError(f"body has unknown field(s) {extra}; only 'groups' is allowed")
    gl = doc["groups"]
    if not isinstance(gl, list) or not gl:
        raise PayloadError("'groups' must be a non-empty list")
    if len(gl) > MAX_GROUPS_PER_REQUEST:
        raise PayloadError(f"'groups' has {len(gl)} groups, over the limit of {MAX_GROUPS_PER_REQUEST} per request")
    return gl


def _group_header(i: int, g: Any) -> tuple[str, list]:
    if not isinstance(g, dict):
        raise PayloadError(f"groups[{i}] must be an object, got {type(g).__name__}")
    extra = sorted(set(g) - {"group_id", "trajectories"})
    if extra:
        raise PayloadError(f"groups[{i}] has unknown field(s) {extra}")
    gid = _str_field(f"groups[{i}].group_id", g.get("group_id"))
    tl = g.get("trajectories")
    if not isinstance(tl, list) or not tl:
        raise PayloadError(f"group {gid!r}: 'trajectories' must be a non-empty list")
    if len(tl) > MAX_TRAJECTORIES_PER_GROUP:
        raise PayloadError(f"group {gid!r}: 'trajectories' has {len(tl)} entries, over the limit of "
                           f"{MAX_TRAJECTORIES_PER_GROUP} per group")
    return gid, tl


def group_from_dict(i: int, g: Any) -> Group:
    gid, tl = _group_header(i, g)
    return Group(gid, [traj_from_dict(t, gid, f"group {gid!r} trajectories[{j}]") for j, t in enumerate(tl)])


def _traj_to_dict(t: Trajectory) -> dict:
    return {
        "uid": t.uid, "group_id": t.group_id, "prompt_ids": t.prompt_ids.tolist(),
        "response_ids": t.response_ids.tolist(), "behav_logprobs": t.behav_logprobs.tolist(),
        "versions": {"runs": rle_encode(t.versions).tolist()}, "reward": t.reward,
        "loss_mask": t.loss_mask.tolist(), "finish_reason": t.finish_reason, "metadata": t.metadata,
        "recomputed_behav_logprobs": (None if t.recomputed_behav_logprobs is None
                                      else t.recomputed_behav_logprobs.tolist()),
        "routed_experts": None if t.routed_experts is None else t.routed_experts.tolist(),
    }


def group_to_dict(g: Group) -> dict:
    return {"group_id": g.group_id, "trajectories": [_traj_to_dict(t) for t in g.trajectories]}


def encode_json(groups: Iterable[Group]) -> bytes:
    return json.dumps({"groups": [group_to_dict(g) for g in groups]}, allow_nan=False).encode()


class _HugeInt:
    """An integer literal longer than any field takes, kept unconverted (Python's conversion is
    quadratic in the digits); every field check refuses it by name, as it would a wrong type."""

    __slots__ = ("digits",)

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"an integer literal of {self.digits} digits (over the limit of {MAX_INT_DIGITS})"


def _parse_int(s: str) -> Any:
    digits = len(s) - s.startswith("-")
    return _HugeInt(digits) if digits > MAX_INT_DIGITS else int(s)


def _load_json(body: bytes, what: str) -> Any:
    if len(body) > MAX_JSON_BYTES:
        raise PayloadTooLarge(f"{what} is {len(body)} bytes of JSON, over the limit of {MAX_JSON_BYTES} bytes "
                              f"for JSON; send smaller batches or the binary framing ({BINARY_CONTENT_TYPE!r}, "
                              "what StoreClient sends by default)")
    n_cont = body.count(b"[") + body.count(b"{")
    if n_cont > MAX_JSON_CONTAINERS:
        raise PayloadError(f"{what} holds up to {n_cont} JSON arrays and objects ('[' and '{{' bytes), over the limit "
                           f"of {MAX_JSON_CONTAINERS}; send smaller batches or the binary framing")
    n_str = body.count(b'"') // 2
    if n_str > MAX_JSON_STRINGS:
        raise PayloadError(f"{what} holds up to {n_str} JSON strings, over the limit of {MAX_JSON_STRINGS}; send "
                           "smaller batches or the binary framing")
    try:
        return json.loads(body.decode("utf-8"), parse_constant=_reject_constant, parse_int=_parse_int)
    except PayloadError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PayloadError(f"{what} is not valid UTF-8 JSON: {e}") from None
    except RecursionError:  # the C parser recurses once per level of nesting
        raise PayloadError(f"{what} is nested too deeply (JSON arrays or objects inside each other "
                           f"~{sys.getrecursionlimit()} levels; metadata may nest {MAX_METADATA_DEPTH})") from None


def decode_json(body: bytes) -> list[Group]:
    return [group_from_dict(i, g) for i, g in enumerate(_groups_list(_load_json(body, "body")))]


# ----------------------------------------------------------------------------- binary

def encode_binary(groups: Iterable[Group]) -> bytes:
    header: list[dict] = []
    parts: list[bytes] = []
    for g in groups:
        tl = []
        for t in g.trajectories:
            runs = rle_encode(t.versions)
            tl.append({"uid": t.uid, "reward": t.reward, "finish_reason": t.finish_reason,
                       "metadata": t.metadata, "n_prompt": int(t.prompt_ids.size),
                       "n_response": int(t.response_ids.size), "n_runs": int(runs.shape[0]),
                       "has_loss_mask": True, "has_recomputed": t.recomputed_behav_logprobs is not None})
            if t.routed_experts is not None:
                tl[-1]["routed_shape"] = [int(t.routed_experts.shape[1]), int(t.routed_experts.shape[2])]
            parts += [t.prompt_ids.astype("<i4").tobytes(), t.response_ids.astype("<i4").tobytes(),
                      t.behav_logprobs.astype("<f4").tobytes(), runs.astype("<i8").tobytes(),
                      t.loss_mask.astype("u1").tobytes()]
            if t.recomputed_behav_logprobs is not None:
                parts.append(t.recomputed_behav_logprobs.astype("<f4").tobytes())
            if t.routed_experts is not None:
                if t.routed_experts.size and (t.routed_experts.min() < 0 or t.routed_experts.max() > 0xFFFF):
                    raise ValueError(f"trajectory {t.uid!r}: routed experts outside [0, 65536) do not fit uint16")
                parts.append(t.routed_experts.astype("<u2").tobytes())
        header.append({"group_id": g.group_id, "trajectories": tl})
    hb = json.dumps({"groups": header}, allow_nan=False).encode()
    return b"".join([_PREAMBLE.pack(MAGIC, FORMAT, 0, len(hb)), hb, *parts])


def _count(where: str, t: dict, key: str) -> int:
    n = t.get(key)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise PayloadError(f"{where}.{key}={_short(n)} must be a non-negative integer")
    return n


def _array_counts(where: str, t: dict) -> tuple[int, int, int]:
    """A binary trajectory header's ``(n_prompt, n_response, n_runs)``, each bounded."""
    npr, nr, nrun = (_count(where, t, k) for k in ("n_prompt", "n_response", "n_runs"))
    _check_len(f"{where}.n_prompt", npr)
    _check_len(f"{where}.n_response", nr)
    if nrun > max(nr, 1):
        raise PayloadError(f"{where}.n_runs={nrun} exceeds n_response={nr}")
    return npr, nr, nrun


def _check_binary_length(doc: Any, payload: int) -> None:
    """The header's declared array sizes must add up to the payload, checked before any copy."""
    want = 0
    for i, g in enumerate(_groups_list(doc)):
        gid, tl = _group_header(i, g)
        for j, t in enumerate(tl):
            if not isinstance(t, dict):
                raise PayloadError(f"group {gid!r} trajectories[{j}] must be an object")
            npr, nr, nrun = _array_counts(f"group {gid!r} trajectories[{j}]", t)
            want += 4 * npr + 8 * nr + 16 * nrun + nr * bool(t.get("has_loss_mask", False)) \
                + 4 * nr * bool(t.get("has_recomputed", False)) \
                + 2 * _routed_count(f"group {gid!r} trajectories[{j}]", t, npr + nr - 1)
    if want != payload:
        what = (f"{payload - want} trailing bytes after the last array" if payload > want
                else f"{want - payload} bytes missing")
        raise PayloadError(f"binary payload has {payload} bytes, the header's counts declare {want}: {what} "
                           "(lengths disagree with the header)")


def _routed_count(where: str, t: dict, rows: int) -> int:
    """Entries of a binary trajectory's routed experts: ``rows x layers x top_k`` (0 without)."""
    shape = t.get("routed_shape")
    if shape is None:
        return 0
    if (not isinstance(shape, list) or len(shape) != 2
            or any(isinstance(n, bool) or not isinstance(n, int) for n in shape)
            or not (1 <= shape[0] <= _MAX_ROUTED_LAYERS and 1 <= shape[1] <= _MAX_ROUTED_TOPK)):
        raise PayloadError(f"{where}.routed_shape={_short(shape)} must be [layers, top_k] with 1 <= layers <= "
                           f"{_MAX_ROUTED_LAYERS} and 1 <= top_k <= {_MAX_ROUTED_TOPK}")
    return max(rows, 0) * shape[0] * shape[1]


def decode_binary(body: bytes) -> list[Group]:
    if len(body) < _PREAMBLE.size:
        raise PayloadError(f"binary body has {len(body)} bytes, shorter than the {_PREAMBLE.size}-byte preamble")
    magic, fmt, flags, hlen = _PREAMBLE.unpack_from(body, 0)
    if magic != MAGIC:
        raise PayloadError(f"binary body starts with {magic!r}, expected {MAGIC!r}")
    if fmt != FORMAT or flags != 0:
        raise PayloadError(f"binary format {fmt} flags {flags} unsupported (this server reads format {FORMAT}, flags 0)")
    if _PREAMBLE.size + hlen > len(body):
        raise PayloadError(f"binary header_len={hlen} runs past the end of the {len(body)}-byte body")
    doc = _load_json(body[_PREAMBLE.size:_PREAMBLE.size + hlen], "binary header")
    _check_binary_length(doc, len(body) - _PREAMBLE.size - hlen)
    mv = memoryview(body)
    off = _PREAMBLE.size + hlen
    groups = []
    for i, g in enumerate(_groups_list(doc)):
        gid, tl = _group_header(i, g)
        trajs = []
        for j, t in enumerate(tl):
            where = f"group {gid!r} trajectories[{j}]"
            if not isinstance(t, dict):
                raise PayloadError(f"{where} must be an object")
            known = {"uid", "reward", "finish_reason", "metadata", "n_prompt", "n_response", "n_runs",
                     "has_loss_mask", "has_recomputed", "routed_shape"}
            if set(t) - known:
                raise PayloadError(f"{where} has unknown field(s) {sorted(set(t) - known)}")
            uid = _str_field(f"{where}.uid", t.get("uid"))
            where = f"trajectory {uid!r}"
            npr, nr, nrun = _array_counts(where, t)
            sizes = [("prompt_ids", "<i4", npr), ("response_ids", "<i4", nr), ("behav_logprobs", "<f4", nr),
                     ("versions", "<i8", 2 * nrun)]
            if t.get("has_loss_mask", False):
                sizes.append(("loss_mask", "u1", nr))
            if t.get("has_recomputed", False):
                sizes.append(("recomputed_behav_logprobs", "<f4", nr))
            if t.get("routed_shape") is not None:
                sizes.append(("routed_experts", "<u2", _routed_count(where, t, npr + nr - 1)))
            arrs = {}
            for name, dt, n in sizes:
                nb = np.dtype(dt).itemsize * n
                if off + nb > len(body):
                    raise PayloadError(f"{where}.{name}: payload ends at byte {len(body)}, "
                                       f"{nb} more bytes expected at {off} (lengths disagree with the header)")
                arrs[name] = np.frombuffer(mv[off:off + nb], dtype=dt).copy()
                off += nb
            runs = arrs.pop("versions").reshape(-1, 2)
            versions = rle_decode(runs, nr, f"{where}.versions")
            fr = t.get("finish_reason", "stop")
            md = t.get("metadata", {})
            if not isinstance(fr, str):
                raise PayloadError(f"{where}.finish_reason must be a string, got {_short(fr)}")
            check_metadata(where, md)
            trajs.append(Trajectory(
                uid=uid, group_id=gid, prompt_ids=_check_int32(f"{where}.prompt_ids", arrs["prompt_ids"]),
                response_ids=_check_int32(f"{where}.response_ids", arrs["response_ids"]),
                behav_logprobs=arrs["behav_logprobs"], versions=versions,
                reward=_reward(f"{where}.reward", t.get("reward")), loss_mask=arrs.get("loss_mask"),
                finish_reason=fr, metadata=md,
                recomputed_behav_logprobs=arrs.get("recomputed_behav_logprobs"),
                routed_experts=None if "routed_experts" not in arrs else
                arrs["routed_experts"].reshape(max(npr + nr - 1, 0), *t["routed_shape"])))
        groups.append(Group(gid, trajs))
    if off != len(body):
        raise PayloadError(f"binary body has {len(body) - off} trailing bytes after the last array "
                           "(lengths disagree with the header)")
    return groups


def decode_payload(body: bytes, content_type: str) -> list[Group]:
    """Decode a request body by its content type (JSON or the binary framing)."""
    ct = (content_type or "").split(";")[0].strip().lower()
    if ct == JSON_CONTENT_TYPE:
        return decode_json(body)
    if ct == BINARY_CONTENT_TYPE:
        return decode_binary(body)
    raise PayloadError(f"Content-Type {content_type!r} unsupported; use {JSON_CONTENT_TYPE!r} "
                       f"or {BINARY_CONTENT_TYPE!r}")


# ----------------------------------------------------------------------------- digest

def group_digest(g: Group) -> str:
    """SHA-256 over a canonical encoding of the group (order of trajectories included)."""
    h = hashlib.sha256()
    h.update(g.group_id.encode())
    for t in g.trajectories:
        scal = json.dumps([t.uid, t.group_id, t.reward, t.finish_reason, t.metadata,
                           t.recomputed_behav_logprobs is not None], sort_keys=True, allow_nan=False)
        h.update(struct.pack("<Q", len(scal)) + scal.encode())
        for a in (t.prompt_ids.astype("<i4"), t.response_ids.astype("<i4"), t.behav_logprobs.astype("<f4"),
                  rle_encode(t.versions).astype("<i8"), t.loss_mask.astype("u1"),
                  t.recomputed_behav_logprobs.astype("<f4") if t.recomputed_behav_logprobs is not None
                  else np.zeros(0, "<f4")):
            b = a.tobytes()
            h.update(struct.pack("<Q", len(b)) + b)
        if t.routed_experts is not None:  # absent: the digest of a group without routing is unchanged
            h.update(b"routed" + struct.pack("<3Q", *t.routed_experts.shape) + t.routed_experts.astype("<i4").tobytes())
    return h.hexdigest()
