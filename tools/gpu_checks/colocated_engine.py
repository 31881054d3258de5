"""Row 9's engine: the part of an SGLang 0.5.23 engine that one colocated cycle touches, on one device.

    python tools/gpu_checks/colocated_engine.py --hf DIR --port P --kv-gib G [--device cuda]

It holds the HF checkpoint's tensors on the device under their HF names (an engine's weights) and a
KV pool of ``--kv-gib``, and answers the routes ``ColocatedWeightSync`` and the colocated phases
call, with SGLang's request and response fields (``entrypoints/http_server.py``, ``managers/io_struct.py``):

- ``/update_weights_from_tensor``: the payload is read exactly as the CPU worker reads it, which is
  SGLang's reading (``megatron_m2po/standins/tensor_payload.py``: ``Base64Bytes``, ``SafeUnpickler``,
  the UUID device mapping of ``utils/patch_torch.py``, ``flattened_bucket``), then each tensor is
  copied into the parameter of its name (``default_weight_loader``: ``param.data.copy_``); a tied
  ``lm_head.weight`` is skipped as ``models/qwen2.py`` ``load_weights`` skips it. Into released
  weights it is refused: with torch-memory-saver the pages are unmapped and SGLang's copy would
  fault (an illegal address kills the scheduler); the refusal names it instead.
- ``/release_memory_occupation`` / ``/resume_memory_occupation`` with tags ``weights`` and
  ``kv_cache``: the tag's storages are freed (``resize_(0)``, then the caching allocator gives the
  blocks back to the driver) and allocated again on resume, content undefined (SGLang without
  ``--enable-weights-cpu-backup``). torch-memory-saver unmaps physical pages under a kept virtual
  range instead; both are one driver free and one allocate per region, which is what the row times.
  Resuming a tag that is not released is refused (SGLang's scheduler dies of a ``KeyError`` there).
- ``/pause_generation``, ``/continue_generation``, ``/begin_weight_update``, ``/end_weight_update``,
  ``/server_info`` (``tp_size`` 1, ``dp_size`` 1), ``/model_info`` (``weight_version``), ``/health``.
- ``/checksums`` (this row's own): an integer digest of every tensor's bytes, computed on the device
  (the trainer computes the same digest of what it pushed: equal digests mean equal bytes).

No generation: the row measures memory and the transfer, not decoding.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron_m2po.standins import tensor_payload  # noqa: E402
from megatron_m2po.utils.hf_dir import iter_safetensors  # noqa: E402

TAGS = ("weights", "kv_cache")


def digest(t: torch.Tensor, chunk: int = 1 << 26) -> int:
    """An integer digest of ``t``'s bytes (position-weighted sum, exact in int64), on its device."""
    b = t.detach().contiguous().view(-1).view(torch.uint8)
    total = 0
    for lo in range(0, b.numel(), chunk):
        part = b[lo:lo + chunk].to(torch.int64)
        w = torch.arange(lo, lo + part.numel(), device=b.device, dtype=torch.int64) % 251 + 1
        total += int((part * w).sum().item())
    return total


class Engine:
    def __init__(self, hf_dir: str, device: str, kv_bytes: int) -> None:
        self.device = torch.device(device)
        cfg = json.loads((Path(hf_dir) / "config.json").read_text())
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.params = {n: t.to(self.device, copy=True) for n, t in iter_safetensors(hf_dir)}
        self.kv = torch.zeros(kv_bytes, dtype=torch.uint8, device=self.device)
        self._sizes = {id(t): t.untyped_storage().nbytes() for t in self._tensors("weights") + self._tensors("kv_cache")}
        self.released: set[str] = set()
        self.version = "0"
        self.loaded_bytes = 0
        self.open_s = self.copy_s = 0.0  # seconds opening handles / copying them into the weights
        self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _tensors(self, tag: str) -> list[torch.Tensor]:
        return list(self.params.values()) if tag == "weights" else [self.kv]

    def release(self, tags: list[str]) -> float:
        t0 = time.perf_counter()
        for tag in tags:
            if tag in self.released:
                continue
            for t in self._tensors(tag):
                t.untyped_storage().resize_(0)
            self.released.add(tag)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._sync()
        return time.perf_counter() - t0

    def resume(self, tags: list[str]) -> float:
        missing = [t for t in tags if t not in self.released]
        if missing:
            raise ValueError(f"resume_memory_occupation of {missing}, which are not released (SGLang's scheduler "
                             "dies of a KeyError there)")
        t0 = time.perf_counter()
        for tag in tags:
            for t in self._tensors(tag):
                t.untyped_storage().resize_(self._sizes[id(t)])
            self.released.discard(tag)
        self._sync()
        return time.perf_counter() - t0

    def update(self, body: dict) -> dict:
        if "weights" in self.released:
            raise ValueError("update_weights_from_tensor into released weights: resume_memory_occupation "
                             "tags=['weights'] first (with torch-memory-saver the copy would fault)")
        t0 = time.perf_counter()
        raw = tensor_payload.http_payloads(body.get("serialized_named_tensors"))
        obj = tensor_payload.deserialize(raw[0])  # opens the handles
        t1 = time.perf_counter()
        n = 0
        for name, t in tensor_payload.named_tensors(obj, body.get("load_format")):
            if self.tied and name == "lm_head.weight":
                continue
            p = self.params.get(name)
            if p is None or p.shape != t.shape or p.dtype != t.dtype:
                raise ValueError(f"{name}: {tuple(t.shape)} {t.dtype} does not match the engine's "
                                 f"{None if p is None else (tuple(p.shape), p.dtype)}")
            p.copy_(t)
            n += t.numel() * t.element_size()
        self._sync()
        t2 = time.perf_counter()
        del obj
        self.open_s += t1 - t0
        self.copy_s += t2 - t1
        self.loaded_bytes += n
        if body.get("weight_version") is not None:
            self.version = str(body["weight_version"])
        return {"success": True, "message": "Succeeded to update model weights.", "load_s": time.perf_counter() - t0}

    def checksums(self) -> dict[str, int]:
        if "weights" in self.released:
            raise ValueError("checksums of released weights")
        return {n: digest(t) for n, t in self.params.items()}

    def used_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device)) if self.device.type == "cuda" else 0

    def reserved_bytes(self) -> int:
        return int(torch.cuda.memory_reserved(self.device)) if self.device.type == "cuda" else 0


def make_app(engine: Engine):
    from aiohttp import web

    async def body(request) -> dict:
        return await request.json() if request.can_read_body else {}

    def ok(extra=None):
        return web.json_response({"success": True, "message": "", **(extra or {})})

    def refused(e: Exception):
        return web.json_response({"success": False, "message": str(e)}, status=400)

    async def update(request):
        try:
            return web.json_response(engine.update(await body(request)))
        except ValueError as e:
            return refused(e)

    async def release(request):
        tags = (await body(request)).get("tags") or list(TAGS)
        return ok({"seconds": engine.release(tags), "used_bytes": engine.used_bytes()})

    async def resume(request):
        try:
            tags = (await body(request)).get("tags") or list(TAGS)
            return ok({"seconds": engine.resume(tags), "used_bytes": engine.used_bytes()})
        except ValueError as e:
            return refused(e)

    async def checksums(request):
        try:
            return web.json_response(engine.checksums())
        except ValueError as e:
            return refused(e)

    async def plain(request):
        return ok()

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/update_weights_from_tensor", update)
    app.router.add_post("/release_memory_occupation", release)
    app.router.add_post("/resume_memory_occupation", resume)
    for route in ("/pause_generation", "/continue_generation", "/begin_weight_update", "/end_weight_update"):
        app.router.add_post(route, plain)
    app.router.add_get("/server_info", lambda r: web.json_response({"tp_size": 1, "dp_size": 1}))
    app.router.add_get("/model_info", lambda r: web.json_response({"weight_version": engine.version}))
    app.router.add_get("/health", lambda r: web.Response(text=""))
    app.router.add_get("/checksums", checksums)
    app.router.add_get("/memory", lambda r: web.json_response({"used_bytes": engine.used_bytes(),
                                                               "loaded_bytes": engine.loaded_bytes,
                                                               "reserved_bytes": engine.reserved_bytes(),
                                                               "open_s": engine.open_s, "copy_s": engine.copy_s}))
    return app


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--hf", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--kv-gib", type=float, default=1.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    torch.multiprocessing.set_sharing_strategy("file_system")
    from aiohttp import web

    engine = Engine(a.hf, a.device, int(a.kv_gib * 2**30))
    web.run_app(make_app(engine), host="127.0.0.1", port=a.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
