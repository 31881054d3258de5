"""The CPU worker's routes of colocated mode: SGLang 0.5.23's ``/release_memory_occupation``,
``/resume_memory_occupation`` and ``/update_weights_from_tensor`` (``entrypoints/http_server.py``).

A mixin of ``cpu_worker_http.WorkerApp`` (which registers the routes); the engine side is
``cpu_memory_saver.py`` (release / resume), ``tensor_payload.py`` (the payloads) and
``cpu_worker.Engine.load_weights`` (the load every weight update shares, FP8 included).

- Release / resume: body ``ReleaseMemoryOccupationReqInput`` / ``ResumeMemoryOccupationReqInput``
  ``{"tags": [...] | null}``; the answer is 200 with a JSON ``null`` (the route returns nothing).
  Where SGLang's scheduler dies (release while busy, a tag released twice, a resume of a tag not
  released, an out-of-memory resume) the worker answers 400 ``{"error": {"message"}}`` and keeps
  its state (``cpu_memory_saver.py`` lists each case).
- ``/update_weights_from_tensor`` (``managers/io_struct.py`` ``UpdateWeightsFromTensorReqInput``):
  ``serialized_named_tensors`` (base64, one per TP rank), ``load_format``, ``flush_cache`` (true),
  ``abort_all_requests`` (false), ``weight_version``, ``torch_empty_cache`` (nothing to empty on CPU).
  As in ``managers/tokenizer_control_mixin.py`` ``update_weights_from_tensor`` the abort comes
  first; then ``managers/scheduler_components/weight_updater.py``: outside a
  ``/begin_weight_update`` session it fails (400, success false); otherwise it loads, records the
  version and flushes the cache (``flush_cache_after_weight_update``). Answer ``{"success",
  "message"}`` (``"Success"``, plus `` Weight version updated to <v>.``). A payload SGLang cannot
  read, or an update into released weights, makes SGLang's scheduler raise (and die); the worker
  answers 400 with success false and the reason.
"""

from __future__ import annotations

from aiohttp import web

from megatron_m2po.standins import tensor_payload
from megatron_m2po.standins.cpu_memory_saver import OccupationError
from megatron_m2po.standins.memory_ledger import GpuBudgetExceeded

UPDATE_FIELDS = ("serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version",
                 "torch_empty_cache")  # UpdateWeightsFromTensorReqInput fields the worker reads
OCCUPATION_FIELDS = ("tags",)  # Release- / ResumeMemoryOccupationReqInput


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def _json(request) -> dict:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"invalid JSON: {e}") from None
    return body or {}


class ColocatedRoutes:
    """Handlers of the colocated routes (``engine`` and the update session are ``WorkerApp``'s)."""

    async def release_memory_occupation(self, request):
        body = await _json(request)
        try:
            await self.engine.run_model(self.engine.release_memory, body.get(OCCUPATION_FIELDS[0]))
        except (OccupationError, ValueError) as e:
            return _error(str(e))
        return web.json_response(None)

    async def resume_memory_occupation(self, request):
        body = await _json(request)
        try:
            await self.engine.run_model(self.engine.resume_memory, body.get(OCCUPATION_FIELDS[0]))
        except GpuBudgetExceeded as e:  # torch-memory-saver's cuMemCreate fails: CUDA out of memory
            return _error(f"CUDA out of memory on resume (SGLang's scheduler dies): {e}")
        except (OccupationError, ValueError) as e:
            return _error(str(e))
        return web.json_response(None)

    async def update_weights_from_tensor(self, request):
        body = await _json(request)
        try:
            payloads = tensor_payload.http_payloads(body.get("serialized_named_tensors"))
        except ValueError as e:  # FastAPI's body validation
            return web.json_response({"detail": [{"loc": ["body", "serialized_named_tensors"], "msg": str(e)}]},
                                     status=422)
        if body.get("abort_all_requests"):
            self.engine.abort(None, True)
        if not self.session_open:
            return web.json_response({"success": False, "message": "update_weights_from_tensor must run between "
                                      "begin_weight_update() and end_weight_update()"}, status=400)
        refusal = self.engine.memory_refusal("update_weights_from_tensor", weights_only=True)
        if refusal is not None:
            return web.json_response({"success": False, "message": refusal}, status=400)
        try:
            await self.engine.run_model(self.engine.load_serialized, payloads, body.get("load_format"))
        except (ValueError, RuntimeError, TypeError) as e:
            return web.json_response({"success": False, "message": f"Failed to update weights from tensor: {e} "
                                      "(SGLang 0.5.23's scheduler raises here and dies)"}, status=400)
        version = body.get("weight_version")
        message = "Success"
        if version is not None:
            self.engine.weight_version = str(version)
            message += f" Weight version updated to {version}."
        refused = await self._flush_after_update(body)
        if refused is not None:
            return refused
        return web.json_response({"success": True, "message": message})
