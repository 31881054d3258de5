"""The payloads of ``/update_weights_from_tensor``, read as SGLang 0.5.23 reads them.

- HTTP (``managers/io_struct.py`` ``UpdateWeightsFromTensorReqInput.serialized_named_tensors:
  Annotated[List[bytes], Base64Bytes()]``; ``utils/msgspec_utils.py`` ``Base64Bytes``): one
  base64 string per engine tensor-parallel rank, decoded with ``validate=True`` (anything else is
  FastAPI's 422); then ``utils/common.py`` ``normalize_serialized_named_tensor_payload`` keeps bytes
  that look like a pickle and base64-decodes the rest once more.
- ``managers/tp_worker.py`` ``deserialize_own_rank``: rank ``r`` reads entry ``r`` only (the CPU
  worker is rank 0 of a TP=1 engine), with ``MultiprocessingSerializer.deserialize``
  (``utils/common.py``): a ``SafeUnpickler`` that resolves only the globals on its allow-list and
  answers any other with ``RuntimeError("Blocked unsafe global (<module>.<name>) during pickle
  deserialization")``. :data:`ALLOWED` is the part of SGLang's list that exists without CUDA
  (``tests/standins/test_cpu_worker_colocated.py`` checks it is a subset); SGLang's own data classes
  on the list (``weight_sync/tensor_bucket.py`` ``FlattenedTensorMetadata`` / ``FlattenedTensorBucket``,
  ``LocalSerializedTensor``) resolve to the look-alikes below.
- The sender pickles with ``ForkingPickler`` (:func:`serialize` = ``MultiprocessingSerializer.serialize``):
  a CUDA tensor travels as a CUDA IPC handle; a CPU tensor as a shared-memory handle, which stands in
  for it here. Use torch's ``file_system`` sharing strategy for CPU tensors sent to another process
  (``torch.multiprocessing.set_sharing_strategy("file_system")``): the default ``file_descriptor``
  strategy hands the descriptor over a socket authenticated with the *parent's* multiprocessing
  key, which an unrelated process (the worker) does not share, so the load fails.
- ``model_executor/model_runner_components/weight_updater.py`` ``update_weights_from_tensor``:
  ``load_format`` None = a list of ``(name, tensor | LocalSerializedTensor)``; ``"flattened_bucket"`` =
  ``{"flattened_tensor": uint8 tensor, "metadata": [objects with name, shape, dtype, start_idx,
  end_idx, numel]}`` (``_update_weights_from_flattened_bucket``; any object with those attributes --
  ``types.SimpleNamespace`` is on the allow-list -- works there); ``"direct"`` = SGLang's internal
  parameter names (fused ``qkv_proj`` / ``gate_up_proj``), which the CPU worker, an HF model, does
  not have: refused here; any other format is SGLang's ``NotImplementedError(f"Unknown
  load_format={load_format}")`` (custom loaders need ``--custom-weight-loader``, which the worker lacks).
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

import torch
from torch.multiprocessing import reductions

_DTYPES = ("bcomplex32", "bfloat16", "bit", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "cdouble",
           "cfloat", "chalf", "complex128", "complex32", "complex64", "double", "float", "float16", "float32",
           "float4_e2m1fn_x2", "float64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
           "float8_e8m0fnu", "half", "int", "int1", "int16", "int2", "int3", "int32", "int4", "int5", "int6", "int64",
           "int7", "int8", "long", "qint32", "qint8", "quint2x4", "quint4x2", "quint8", "short", "uint1", "uint16",
           "uint2", "uint3", "uint32", "uint4", "uint5", "uint6", "uint64", "uint7", "uint8")
_TENSOR_TYPES = ("BFloat16", "Bool", "Byte", "Char", "Double", "Float", "Half", "Int", "Long", "Short")
_STORAGES = ("BFloat16", "Bool", "Byte", "Char", "ComplexDouble", "ComplexFloat", "Double", "Float", "Half", "Int",
             "Long", "QInt32", "QInt8", "QUInt2x4", "QUInt4x2", "QUInt8", "Short")

# utils/common.py SafeUnpickler.ALLOWED_GLOBALS, less its CUDA / NPU / SGLang-module entries.
ALLOWED: frozenset = frozenset(
    [("builtins", n) for n in ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list",
                               "range", "set", "slice", "str", "tuple")]
    + [("collections", n) for n in ("OrderedDict", "defaultdict", "deque", "Counter")]
    + [("copyreg", "__newobj__"), ("copyreg", "__newobj_ex__"), ("functools", "partial"), ("itertools", "chain"),
       ("itertools", "repeat"), ("multiprocessing.reduction", "_rebuild_partial"),
       ("multiprocessing.reduction", "_rebuild_socket"), ("multiprocessing.resource_sharer", "DupFd"),
       ("types", "SimpleNamespace"), ("_codecs", "encode")]
    + [("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch", "dtype"), ("torch", "UntypedStorage"),
       ("torch.nn.parameter", "Parameter"), ("torch.serialization", "_get_layout"),
       ("torch.storage", "UntypedStorage"), ("torch.storage", "_UntypedStorage"), ("torch.storage", "TypedStorage"),
       ("torch._tensor", "_rebuild_from_type_v2")]
    + [("torch", f"{t}Tensor") for t in _TENSOR_TYPES]
    + [("torch", f"{s}Storage") for s in _STORAGES]
    + [("torch", d) for d in _DTYPES]
    + [("torch._utils", n) for n in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                                      "_rebuild_parameter", "_rebuild_parameter_with_state", "_rebuild_qtensor",
                                      "_rebuild_sparse_tensor", "_rebuild_meta_tensor_no_storage",
                                      "_rebuild_wrapper_subclass", "_rebuild_device_tensor_from_numpy",
                                      "_rebuild_device_tensor_from_cpu_tensor")]
    + [("torch.multiprocessing.reductions", n) for n in (
        "rebuild_tensor", "rebuild_meta_tensor", "rebuild_cuda_tensor", "rebuild_nested_tensor",
        "rebuild_sparse_coo_tensor", "rebuild_sparse_compressed_tensor", "rebuild_storage_fd",
        "rebuild_storage_filename", "rebuild_storage_empty", "rebuild_typed_storage", "rebuild_typed_storage_child")]
    + [("torch", q) for q in ("per_tensor_affine", "per_tensor_symmetric", "per_channel_affine",
                              "per_channel_symmetric", "per_channel_affine_float_qparams")])


@dataclass
class FlattenedTensorMetadata:
    """``weight_sync/tensor_bucket.py`` ``FlattenedTensorMetadata`` (what its pickles resolve to here)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """``weight_sync/tensor_bucket.py`` ``FlattenedTensorBucket``'s pickled state (on SGLang's allow-list,
    but not what ``load_format="flattened_bucket"`` takes: that is a dict)."""


@dataclass
class LocalSerializedTensor:
    """``model_runner_components/weight_updater.py`` ``LocalSerializedTensor``: one serialized tensor
    per engine TP rank; rank ``r`` deserializes ``values[r]``."""

    values: list

    def get(self, rank: int) -> Any:
        return deserialize(self.values[rank])


_SGLANG_CLASSES = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"): FlattenedTensorBucket,
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"):
        LocalSerializedTensor,
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): LocalSerializedTensor,
}


def rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """torch's ``rebuild_cuda_tensor`` as an SGLang engine has it: ``utils/patch_torch.py``
    ``monkey_patch_torch_reductions`` replaces it at start-up by ``_rebuild_cuda_tensor_modified``,
    which reads the device argument (index 6) as a UUID string (what the sender's patched
    ``reduce_tensor`` writes, and ``weights/colocated_bucket.py``) and maps it to this process's
    device index; an unknown UUID is its ``Exception("Invalid device_uuid=...")``."""
    i, dev = 6, args[6]
    if isinstance(dev, str):
        for d in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
            if str(torch.cuda.get_device_properties(d).uuid) == dev:
                dev = d
                break
        else:
            raise Exception("Invalid device_uuid=" + dev)
    elif not isinstance(dev, int):
        raise Exception(f"Unknown type: device_maybe_uuid={dev!r}")
    return reductions.rebuild_cuda_tensor(*args[:i], dev, *args[i + 1:])


EXPANDABLE_SEGMENT_REBUILD = ("megatron_m2po.weights.colocated_bucket", "rebuild_expandable_segment")


class _SafeUnpickler(pickle.Unpickler):
    """utils/common.py ``SafeUnpickler``: only allowed globals resolve (``rebuild_cuda_tensor`` to
    SGLang's patched one, :func:`rebuild_cuda_tensor`)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SGLANG_CLASSES:
            return _SGLANG_CLASSES[(module, name)]
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return rebuild_cuda_tensor
        if (module, name) == EXPANDABLE_SEGMENT_REBUILD:
            # the CPU platform's stand-in for rebuild_cuda_tensor on memory from the sender's expandable
            # segments: it fails there as pidfd_getfd does without ptrace rights (weights/colocated_bucket.py)
            return super().find_class(module, name)
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def serialize(obj: Any, output_str: bool = False) -> bytes | str:
    """``MultiprocessingSerializer.serialize``: ``ForkingPickler`` bytes (base64 text with ``output_str``)."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    out = buf.getvalue()
    return base64.b64encode(out).decode("utf-8") if output_str else out


def deserialize(data: bytes | str) -> Any:
    """``MultiprocessingSerializer.deserialize`` (base64 text is decoded first)."""
    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    return _SafeUnpickler(io.BytesIO(data)).load()


def read_per_rank(payloads: list, tp_size: int) -> list:
    """What the ``tp_size`` rank processes of an engine read (``tp_worker.py`` ``deserialize_own_rank``:
    rank ``r`` deserializes entry ``r`` only), in rank order. Each entry is unpickled once, as in its
    own process: a shared-memory tensor's unpickling releases the reference its pickling took
    (torch ``reductions.py`` ``reduce_storage`` / ``rebuild_storage_filename``), so a sender that
    pickles once and repeats the payload for every rank releases the segment before every rank is
    done with it (its name is gone: a later load of the same tensors fails, ``shm_open ... No such
    file``), here as in SGLang. Fewer entries than ranks is SGLang's ``IndexError``: a ValueError."""
    if len(payloads) < tp_size:
        raise ValueError(f"{len(payloads)} serialized payload(s) for an engine of tp_size {tp_size}: one per TP "
                         "rank is needed (SGLang 0.5.23 indexes the list by tp_rank: IndexError)")
    return [deserialize(payloads[r]) for r in range(tp_size)]


def http_payloads(value: Any) -> list[bytes]:
    """``serialized_named_tensors`` of an HTTP body -> raw payloads, one per TP rank (``Base64Bytes``
    then ``normalize_serialized_named_tensor_payload``). ``ValueError``: SGLang's 422."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"serialized_named_tensors must be a list of base64 strings, got {type(value).__name__}")
    out = []
    for v in value:
        try:
            raw = base64.b64decode(v, validate=True)
        except binascii.Error:
            raise ValueError("serialized_named_tensors: Expected base64-encoded bytes") from None
        if not (len(raw) >= 2 and raw[0] == 0x80 and raw[1] <= pickle.HIGHEST_PROTOCOL):
            try:  # normalize_serialized_named_tensor_payload: base64 of base64
                raw = base64.b64decode(raw, validate=True)
            except (binascii.Error, ValueError):
                pass
        out.append(raw)
    return out


def named_tensors(obj: Any, load_format: Optional[str], tp_rank: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` list a deserialized payload holds under ``load_format`` (see the module
    docstring); ``ValueError`` where SGLang's scheduler would raise (and die)."""
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or not {"flattened_tensor", "metadata"} <= set(obj):
            raise ValueError("load_format='flattened_bucket' takes {'flattened_tensor': tensor, 'metadata': [...]}, "
                             f"got {type(obj).__name__} (SGLang 0.5.23 subscripts it: TypeError / KeyError)")
        flat = obj["flattened_tensor"]
        try:  # tensor_bucket.py FlattenedTensorBucket.reconstruct_tensors
            return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in obj["metadata"]]
        except (AttributeError, RuntimeError, TypeError) as e:
            raise ValueError(f"flattened_bucket metadata does not fit the flattened tensor: {e}") from None
    if load_format == "direct":
        raise ValueError("load_format='direct' loads SGLang's internal parameter names (fused qkv_proj / "
                         "gate_up_proj) with default_weight_loader; the CPU worker serves an HF model and does not "
                         "emulate them: send HF names with load_format=None or 'flattened_bucket'")
    if load_format is not None:
        raise ValueError(f"Unknown load_format={load_format}")
    if not isinstance(obj, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in obj):
        raise ValueError(f"load_format=None takes a list of (name, tensor) pairs, got {type(obj).__name__}")
    out = []
    for name, t in obj:  # weight_updater.py _unwrap_tensor
        t = t.get(tp_rank) if isinstance(t, LocalSerializedTensor) else t
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {type(t).__name__} is not a tensor")
        out.append((str(name), t))
    return out
