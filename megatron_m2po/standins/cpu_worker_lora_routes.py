"""The CPU worker's LoRA routes and the adapter look-up of ``/generate``: SGLang 0.5.23's
``/load_lora_adapter``, ``/load_lora_adapter_from_tensors`` and ``/unload_lora_adapter``
(``entrypoints/http_server.py``), with the tokenizer manager's registry rules
(``managers/tokenizer_control_mixin.py``, ``managers/tokenizer_manager.py``, ``lora/lora_registry.py``).

A mixin of ``cpu_worker_http.WorkerApp``; the adapters themselves are ``cpu_worker_lora.LoRAServing``.

- Bodies (``managers/io_struct.py``): ``LoadLoRAAdapterReqInput`` {lora_name, lora_path, pinned};
  ``LoadLoRAAdapterFromTensorsReqInput`` {lora_name, config_dict, serialized_named_tensors (base64,
  one per TP rank; rank 0 here), pinned, added_tokens_config, load_format (None: a dict name ->
  tensor; ``flattened_bucket``)}; ``UnloadLoRAAdapterReqInput`` {lora_name}. A missing field is a 422.
- Answer ``LoRAUpdateOutput`` {success, error_message, loaded_adapters ({name: path}; an adapter from
  tensors has the path ``__tensor__``)}: 200 on success, else 400. A refusal of the tokenizer
  manager (LoRA off, an unknown name to unload, an unload still pending) has ``loaded_adapters`` null.
- Loads and unloads run one at a time (``lora_update_lock``). A load gets a fresh ``lora_id``
  (``uuid4``): the prefix cache never mixes KV of two loads of one name. With ``--max-loaded-loras``
  a load past the limit unloads the least recently used unpinned adapter.
- Unload while requests use the adapter (``_unload_lora_adapter_locked``): the name leaves the
  registry at once, the answer waits until no request holds the adapter, then it is unloaded.
- ``/generate`` ``lora_path`` (a name, or one per prompt; ``_validate_and_resolve_lora`` /
  ``_resolve_lora_path``): refused when LoRA is off, when a name was never loaded, or when more
  distinct names than ``--max-loaded-loras`` come in one request; a name that was loaded once and
  since unloaded is loaded again from its path (an adapter from tensors cannot be: its path is
  ``__tensor__``, and the request fails naming it). The request holds its adapters until it ends.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Optional

import torch
from aiohttp import web

from megatron_m2po.standins import tensor_payload
from megatron_m2po.standins import cpu_worker_lora
from megatron_m2po.standins.cpu_worker_lora import NOT_ENABLED, TENSOR_PATH

LOAD_FIELDS = ("lora_name", "lora_path", "pinned")  # LoadLoRAAdapterReqInput fields the worker reads
TENSOR_FIELDS = ("lora_name", "config_dict", "serialized_named_tensors", "pinned", "added_tokens_config",
                 "load_format")  # LoadLoRAAdapterFromTensorsReqInput
UNLOAD_FIELDS = ("lora_name",)  # UnloadLoRAAdapterReqInput
OUTPUT_FIELDS = ("success", "error_message", "loaded_adapters")  # LoRAUpdateOutput
GENERATE_FIELDS = ("lora_path",)  # GenerateReqInput


class LoRARequestError(ValueError):
    """A ``/generate`` whose ``lora_path`` SGLang refuses: HTTP 400 with the message."""


def _answer(out: dict) -> web.Response:
    return web.json_response(out, status=200 if out.get("success") else 400)


def _refused(message: str) -> web.Response:
    return _answer({"success": False, "error_message": message, "loaded_adapters": None})


async def _body(request, required: tuple[str, ...]) -> tuple[Optional[dict], Optional[web.Response]]:
    try:
        body = await request.json() if request.can_read_body else {}
    except ValueError as e:
        return None, web.json_response({"detail": [{"loc": ["body"], "msg": f"invalid JSON: {e}"}]}, status=422)
    missing = [f for f in required if not isinstance(body, dict) or f not in body]
    if missing:  # FastAPI's validation of the body model
        return None, web.json_response({"detail": [{"loc": ["body", f], "msg": "Field required"} for f in missing]},
                                       status=422)
    return body, None


class LoRARoutes:
    """Handlers of the LoRA routes and the ``lora_path`` look-up (``engine`` is ``WorkerApp``'s)."""

    def _lora_routes(self, r) -> None:
        self.lora_ops = asyncio.Lock()  # tokenizer_manager.py lora_update_lock
        self.lora_idle = asyncio.Condition()  # notified when a request lets its adapters go
        self.pending_unloads: dict[str, str] = {}  # name -> lora_id of an unload under way
        r.add_post("/load_lora_adapter", self._via_scheduler(self.load_lora_adapter))
        r.add_post("/load_lora_adapter_from_tensors", self._via_scheduler(self.load_lora_adapter_from_tensors))
        r.add_post("/unload_lora_adapter", self._via_scheduler(self.unload_lora_adapter))

    def _lora_server_info(self) -> dict:
        """``/server_info``'s LoRA fields (the resolved server args, ``server_args.py`` ``resolved_dict``)."""
        lora = self.engine.lora
        if lora is None:
            return {"enable_lora": None, "max_lora_rank": None, "lora_target_modules": None, "lora_paths": None,
                    "max_loras_per_batch": 8, "max_loaded_loras": None}
        return {"enable_lora": True, "max_lora_rank": lora.max_lora_rank,
                "lora_target_modules": sorted(lora.target_modules), "max_loras_per_batch": lora.max_loras_per_batch,
                "max_loaded_loras": lora.max_loaded_loras,
                # LoRARef is an array_like msgspec struct: [lora_id, lora_name, lora_path, pinned]
                "lora_paths": [[cpu_worker_lora.initial_lora_id(n, p), n, p, pin] for n, p, pin in lora.settings.lora_paths]}

    # ---------------------------------------------------------------- routes
    async def load_lora_adapter(self, request):
        body, bad = await _body(request, LOAD_FIELDS[:2])
        if bad is not None:
            return bad
        if self.engine.lora is None:
            return _refused(NOT_ENABLED)
        async with self.lora_ops:
            return _answer(await self._load_locked(str(body["lora_name"]), str(body["lora_path"]),
                                                   bool(body.get("pinned", False))))

    async def load_lora_adapter_from_tensors(self, request):
        body, bad = await _body(request, TENSOR_FIELDS[:3])
        if bad is not None:
            return bad
        if self.engine.lora is None:
            return _refused(NOT_ENABLED)
        try:
            payloads = tensor_payload.http_payloads(body["serialized_named_tensors"])
            tensors = await self.engine.run_model(_adapter_tensors, payloads, body.get("load_format"),
                                                  self.engine.tp_size)
        except ValueError as e:  # SGLang's tp_worker raises here (its scheduler dies); a clear 400 instead
            return _refused(f"cannot read serialized_named_tensors: {e}")
        config = body["config_dict"]
        if not isinstance(config, dict):
            return _refused(f"config_dict must be the adapter_config.json object, got {type(config).__name__}")
        async with self.lora_ops:
            return _answer(await self._load_locked(str(body["lora_name"]), TENSOR_PATH, bool(body.get("pinned", False)),
                                                   (config, tensors, body.get("added_tokens_config"))))

    async def unload_lora_adapter(self, request):
        body, bad = await _body(request, UNLOAD_FIELDS)
        if bad is not None:
            return bad
        if self.engine.lora is None:
            return _refused(NOT_ENABLED)
        async with self.lora_ops:
            try:
                return _answer(await self._unload_locked(str(body["lora_name"])))
            except ValueError as e:
                return _refused(str(e))

    # ---------------------------------------------------------------- load / unload (under lora_ops)
    async def _load_locked(self, name: str, path: str, pinned: bool, source=None) -> dict:
        """``tokenizer_control_mixin.py`` ``load_lora_adapter`` (``_from_tensors``): the backend
        load, then the registry, then the LRU eviction past ``--max-loaded-loras``."""
        lora = self.engine.lora
        if name in self.pending_unloads:
            return {"success": False, "error_message": f"LoRA adapter '{name}' has an incomplete unload. Retry the "
                    "unload before loading it again.", "loaded_adapters": None}
        lora_id = uuid.uuid4().hex
        out = await self.engine.run_model(lora.load_backend, lora_id, name, path, pinned, source)
        if not out["success"]:
            return out
        lora.registry[name] = lora_id
        lora.ref_cache[name] = (path, pinned)
        lora.inflight[lora_id] = 0
        while lora.max_loaded_loras is not None and len(lora.registry) > lora.max_loaded_loras:
            lru = next((n for n, i in lora.registry.items() if not lora.loaded[i].pinned), None)
            if lru is None:
                return {"success": False, "error_message": "Didn't find any LoRA adapters when trying to evict LRU "
                        f"LoRA adapter. LoRA registry is: {dict(lora.registry)}", "loaded_adapters": None}
            evicted = await self._unload_locked(lru)
            if not evicted["success"]:
                return {"success": False, "error_message": f"Error while unloading LRU LoRA adapter '{lru}': "
                        f"{evicted['error_message']}", "loaded_adapters": None}
            out["loaded_adapters"].pop(lru, None)
        return out

    async def _unload_locked(self, name: str) -> dict:
        """``_unload_lora_adapter_locked``: unregister (new requests no longer find the name), wait
        until no request holds the adapter, then unload it from the backend."""
        lora = self.engine.lora
        lora_id = self.pending_unloads.get(name)
        if lora_id is None:
            if name not in lora.registry:  # lora_registry.py unregister
                raise ValueError(f"LoRA with name {name} does not exist. Loaded LoRAs: odict_keys({list(lora.registry)})")
            lora_id = lora.registry.pop(name)
            self.pending_unloads[name] = lora_id
        async with self.lora_idle:
            await self.lora_idle.wait_for(lambda: lora.inflight.get(lora_id, 0) == 0)
        lora.inflight.pop(lora_id, None)
        out = await self.engine.run_model(lora.unload_backend, lora_id)
        self.pending_unloads.pop(name, None)
        return out

    # ---------------------------------------------------------------- /generate
    async def lora_acquire(self, names: list[Optional[str]], batch: bool) -> list[Optional[str]]:
        """The ``lora_id`` of each request's ``lora_path`` (None: the base model), held until
        :meth:`lora_release`; ``LoRARequestError`` with SGLang's message when refused."""
        if not any(names):
            return [None] * len(names)
        lora = self.engine.lora
        if lora is None:
            first = next(n for n in names if n)
            raise LoRARequestError(f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the "
                                   "server with --enable-lora flag and preload adapters using --lora-paths or "
                                   "/load_lora_adapter endpoint.")
        unique = set(names)
        if lora.max_loaded_loras is not None and len(unique) > lora.max_loaded_loras:
            raise LoRARequestError(f"Received request with {len(unique)} unique loras requested but max loaded loras "
                                   f"is {lora.max_loaded_loras}")
        for name in sorted(n for n in unique if n is not None and n not in lora.registry):
            if name not in lora.ref_cache:
                raise LoRARequestError(f"Got LoRA adapter that has never been loaded: {name}\n"
                                       f"All loaded adapters: dict_keys({list(lora.ref_cache)}).")
            path, pinned = lora.ref_cache[name]
            async with self.lora_ops:  # tokenizer_manager.py: "Reloading evicted adapter"
                out = await self._load_locked(name, path, pinned) if name not in lora.registry else {"success": True}
            if not out["success"] and "already loaded" not in out["error_message"]:
                raise LoRARequestError(f"Failed to implicitly load LoRA adapter {name}: {out['error_message']}")
        ids = []
        for name in names:  # lora_registry.py acquire
            if name is not None and name not in lora.registry:
                raise LoRARequestError(f"The following requested LoRA adapters are not loaded: {name}\n"
                                       f"Loaded adapters: odict_keys({list(lora.registry)}).")
            if name is not None:
                lora.registry.move_to_end(name)
            ids.append(lora.registry[name] if name is not None else None)
        for i in ids:
            if i is not None:
                lora.inflight[i] += 1
        return ids

    async def lora_release(self, ids: list[Optional[str]]) -> None:
        """The requests of ``ids`` ended: they no longer hold their adapters (``lora_registry.py`` release)."""
        lora = self.engine.lora
        if lora is None or not any(ids):
            return
        for i in ids:
            if i is not None and i in lora.inflight:
                lora.inflight[i] -= 1
        async with self.lora_idle:
            self.lora_idle.notify_all()


def lora_path_per_prompt(lora_path, prompts: int) -> list:
    """``io_struct.py`` ``_normalize_lora_paths``: ``/generate``'s ``lora_path`` (a name, or one
    per prompt) as one entry per prompt; ``LoRARequestError`` when a list does not match the prompts."""
    if isinstance(lora_path, list):
        if len(lora_path) != prompts:
            raise LoRARequestError(f"lora_path has {len(lora_path)} entries for {prompts} prompts")
        return list(lora_path)
    if lora_path is not None and not isinstance(lora_path, str):
        raise LoRARequestError(f"lora_path should be a list or a string, got {type(lora_path).__name__}")
    return [lora_path] * prompts


def _adapter_tensors(payloads: list[bytes], load_format: Optional[str], tp_size: int = 1) -> dict:
    """``tp_worker.py`` ``load_lora_adapter_from_tensors``: each rank's payload, read by that rank
    (``tensor_payload.read_per_rank``); rank 0's, a dict name -> tensor (``flattened_bucket``: the
    bucket's tensors), is the adapter's. The other ranks' tensors are kept with it until it is
    unloaded, as each rank's ``LoRAAdapter`` keeps the tensors it loaded (``lora.py``
    ``_process_weight``: ``loaded_weight.cpu()``, the same storage for a CPU tensor)."""
    if not payloads:
        raise ValueError("serialized_named_tensors is empty: one payload per engine TP rank is needed")
    try:
        ranks = tensor_payload.read_per_rank(payloads, tp_size)
    except (OSError, EOFError, RuntimeError) as e:
        raise ValueError(f"{type(e).__name__}: {e}") from None
    obj = ranks[0]
    if load_format == "flattened_bucket":
        return cpu_worker_lora.RankTensors(tensor_payload.named_tensors(obj, load_format), ranks=ranks)
    if not isinstance(obj, dict) or not all(isinstance(t, torch.Tensor) for t in obj.values()):
        raise ValueError(f"load_format=None takes a dict name -> tensor (SGLang passes it to the LoRA loader as "
                         f"is), got {type(obj).__name__}")
    return cpu_worker_lora.RankTensors({str(k): t for k, t in obj.items()}, ranks=ranks)
