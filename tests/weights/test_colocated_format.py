"""The colocated transport's bucket format against SGLang 0.5.23's own reader and unpickler.

SGLang's side is read from the pinned wheel (never imported, as in test_weight_group_interop.py):
``weight_sync/tensor_bucket.py`` is executed as the module ``sglang.srt.weight_sync.tensor_bucket``
in a spawned process (a separate process, as an engine is: the CPU tensors cross in shared
memory), ``utils/common.py``'s ``SafeUnpickler`` (with ``_safe_load_torch_storage``) unpickles the
payload as ``MultiprocessingSerializer.deserialize`` does, and the reconstruction follows
``weight_updater.py`` ``_update_weights_from_flattened_bucket``.
"""

from __future__ import annotations

import ast
import base64
import io
import pickle
import sys
import types

import pytest
import torch
import torch.multiprocessing as mp

from megatron_m2po.weights.colocated import (EngineRank, colocated_assignment, pack_bucket, serialize_bucket,
                                             split_buckets)
from sglang_source import wheel as _wheel

BUCKET = "sglang/srt/weight_sync/tensor_bucket.py"
COMMON = "sglang/srt/utils/common.py"


def _sources() -> tuple[str, str]:
    with _wheel() as z:  # skips (fails under CI) without the wheel
        return z.read(BUCKET).decode(), z.read(COMMON).decode()


def _tensor_bucket_module(source: str, setitem=None) -> types.ModuleType:
    """SGLang's tensor_bucket.py; with ``setitem`` (``sys.modules.__setitem__`` or pytest's
    ``monkeypatch.setitem``) importable as ``sglang.srt.weight_sync.tensor_bucket`` (parents: empty
    packages), as the unpickler needs it."""
    mod = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")
    if setitem is not None:
        for name in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):
            setitem(sys.modules, name, types.ModuleType(name))
        setitem(sys.modules, mod.__name__, mod)
    exec(compile(source, BUCKET, "exec"), mod.__dict__)  # noqa: S102 - SGLang's own code
    return mod


def _safe_unpickler(common: str):
    tree = ast.parse(common)
    keep = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))
            and n.name in ("SafeUnpickler", "_safe_load_torch_storage")]
    ns = {"pickle": pickle, "torch": torch, "io": io}
    exec(compile(ast.Module(keep, []), COMMON, "exec"), ns)  # noqa: S102 - SGLang's own code
    return ns["SafeUnpickler"]


def _engine_read(bucket_src: str, common_src: str, payload: str, q) -> None:
    """An engine rank's load of one payload, as SGLang 0.5.23 runs it."""
    try:
        mod = _tensor_bucket_module(bucket_src, setitem=type(sys.modules).__setitem__)
        data = _safe_unpickler(common_src)(io.BytesIO(base64.b64decode(payload, validate=True))).load()
        metas = [mod.FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                             end_idx=m.end_idx, numel=m.numel) for m in data["metadata"]]
        bucket = mod.FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=metas)
        q.put([(n, str(t.dtype), tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
               for n, t in bucket.reconstruct_tensors()])
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q.put(f"{type(e).__name__}: {e}")


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.layers.0.mlp.down_proj.weight", torch.randn(5, 7, generator=g).to(torch.float8_e4m3fn)),
        ("model.layers.0.mlp.down_proj.weight_scale_inv", torch.rand(1, 1, generator=g)),
        ("model.embed_tokens.weight", torch.randn(3, 3, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(9, generator=g)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(4, 6, generator=g).t()),  # not contiguous
        ("counts", torch.arange(3, dtype=torch.int64)),
    ]


def test_sglang_reader_in_another_process_gets_every_tensor_exactly():
    bucket_src, common_src = _sources()
    named = _named()
    flat, metas = pack_bucket(named)
    payload = serialize_bucket(flat, metas)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_engine_read, args=(bucket_src, common_src, payload, q), daemon=True)
    p.start()
    try:
        got = q.get(timeout=25)  # ``flat`` is alive until the reader answered (the handle points into it)
    finally:
        p.join(10)
    assert not isinstance(got, str), got
    want = [(n, str(t.dtype), tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            for n, t in named]
    assert got == want


def test_uniform_bucket_equals_sglangs_own_writer(monkeypatch):
    """Without alignment gaps (one dtype) the bytes and metadata are those of SGLang's writer."""
    bucket_src, _ = _sources()
    mod = _tensor_bucket_module(bucket_src, setitem=monkeypatch.setitem)
    named = [(f"w{i}", torch.randn(i + 1, 3).to(torch.bfloat16)) for i in range(4)]
    ref = mod.FlattenedTensorBucket(named_tensors=named)
    flat, metas = pack_bucket(named)
    assert torch.equal(flat, ref.get_flattened_tensor())
    fields = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")
    assert [[getattr(m, f) for f in fields] for m in metas] == [[getattr(m, f) for f in fields]
                                                              for m in ref.get_metadata()]


def test_sglang_unpickler_refuses_anything_else_we_might_send(monkeypatch):
    """The payload uses only globals SGLang's SafeUnpickler allows, and that unpickler does refuse
    others: the reader above is not one that trusts everything."""
    bucket_src, common_src = _sources()
    _tensor_bucket_module(bucket_src, setitem=monkeypatch.setitem)
    unpickler = _safe_unpickler(common_src)
    flat, metas = pack_bucket(_named()[:2])
    data = unpickler(io.BytesIO(base64.b64decode(serialize_bucket(flat, metas)))).load()
    assert [m.name for m in data["metadata"]] == [n for n, _ in _named()[:2]]
    with pytest.raises(RuntimeError, match="Blocked unsafe global"):
        unpickler(io.BytesIO(pickle.dumps(types.SimpleNamespace(f=print)))).load()


def test_buckets_split_at_the_size_limit():
    named = [(f"t{i}", torch.zeros(250, dtype=torch.float32)) for i in range(10)]  # 1000 B each
    sizes = [[n for n, _ in b] for b in split_buckets(named, 2100)]
    assert sizes == [["t0", "t1"], ["t2", "t3"], ["t4", "t5"], ["t6", "t7"], ["t8", "t9"]]
    big = [("small", torch.zeros(10)), ("huge", torch.zeros(10_000)), ("after", torch.zeros(10))]
    assert [[n for n, _ in b] for b in split_buckets(big, 1000)] == [["small"], ["huge"], ["after"]]
    for b in split_buckets(named, 2100):
        assert pack_bucket(b)[0].numel() <= 2100


def test_each_engine_rank_is_served_by_the_trainer_rank_on_its_gpu():
    got = colocated_assignment([0, 1, 2, 3], [("http://e0", [0, 1]), ("http://e1", [2, 3])])
    assert got == {EngineRank("http://e0", 0, 0): 0, EngineRank("http://e0", 1, 1): 1,
                   EngineRank("http://e1", 0, 2): 2, EngineRank("http://e1", 1, 3): 3}
    with pytest.raises(ValueError, match=r"trainer GPU\(s\) \[2, 3\] host no engine rank"):
        colocated_assignment([0, 1, 2, 3], [("http://e0", [0, 1])])
    with pytest.raises(ValueError, match="engine http://e1 TP rank 0 is on GPU 4, where no trainer rank runs"):
        colocated_assignment([0, 1], [("http://e0", [0, 1]), ("http://e1", [4])])


def test_servers_of_a_node_and_refusal_across_nodes():
    from megatron_m2po.weights.colocated import colocated_servers

    assert colocated_servers(["http://e0/", "http://e1"], [[2, 3], [0, 1]], [0, 1, 2, 3], 4) == \
        {"http://e0": [2, 3], "http://e1": [0, 1]}
    with pytest.raises(ValueError, match="handles do not cross nodes"):
        colocated_servers(["http://e0"], [[0, 1]], [0, 1], 4)
