"""The HTTP layer of the CPU worker: SGLang 0.5.23's routes (``entrypoints/http_server.py``) over
``cpu_worker.Engine`` (which imports this module). Each handler names the SGLang function whose behaviour it follows."""

from __future__ import annotations

import asyncio
import datetime
import glob
import json
import logging
import os
import time
import uuid
from typing import Optional

from aiohttp import web

from megatron_m2po.parallel.side_group import destroy_side_group
from megatron_m2po.standins import sglang_sampling as sampling
from megatron_m2po.standins.cpu_worker_colocated import ColocatedRoutes
from megatron_m2po.standins.cpu_worker_lora_routes import LoRARequestError, LoRARoutes, lora_path_per_prompt
from megatron_m2po.rollout.sglang_version import SUPPORTED_SGLANG

_VERSION = SUPPORTED_SGLANG  # the SGLang version it emulates: server_info's "version" (SGLang's __version__)
DEFAULT_GROUP = "weight_update_group"
log = logging.getLogger("m2po.cpu_worker")
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # sglang/srt/constants.py


class RequestError(ValueError):
    """A bad request: answered with HTTP 400 and the message."""


def _ok(payload: dict, status: int = 200) -> web.Response:
    return web.json_response(payload, status=status)


def _err(message: str, status: int = 400) -> web.Response:
    return _ok({"error": {"message": message}}, status)


async def _body(request) -> dict:
    """The request's JSON body ({} when there is none); invalid JSON is a 400 naming the error."""
    if not request.can_read_body:
        return {}
    try:
        data = await request.json()
    except json.JSONDecodeError as e:
        raise web.HTTPBadRequest(text=f"invalid JSON: {e}") from None
    return data or {}


class WorkerApp(ColocatedRoutes, LoRARoutes):
    """SGLang 0.5.23's HTTP routes over one ``cpu_worker.Engine``; :meth:`build` returns the aiohttp app.

    The routes, by concern (each group's table is one method):

    * generation: ``/generate`` (JSON or server-sent events);
    * health and information: ``/health``, ``/health_generate``, ``/ready``, ``/model_info``,
      ``/server_info``, ``/v1/loads``, ``/get_weights_by_name``;
    * cache and scheduling: ``/flush_cache``, ``/abort_request``, ``/pause_generation``,
      ``/continue_generation``, ``/slow_down``;
    * weights: the update session (``/begin_weight_update``, ``/end_weight_update``), updates from
      disk and from a distributed group, the group's set-up and tear-down, ``/update_weight_version``;
    * colocated mode (``cpu_worker_colocated.py``): ``/release_memory_occupation``,
      ``/resume_memory_occupation``, ``/update_weights_from_tensor``. While weights or KV are released
      (``--enable-memory-saver``) a generation -- a health check's too -- is refused (400 naming the
      released memory; SGLang would read unmapped memory and crash), and so is a weight update while
      the weights are released.
    * LoRA (``cpu_worker_lora_routes.py``): ``/load_lora_adapter``, ``/load_lora_adapter_from_tensors``,
      ``/unload_lora_adapter``; ``/generate``'s ``lora_path``.

    The state the HTTP layer keeps itself (the rest is the engine's): the deferred cache flush in
    progress, the weight-update session, the lock that serialises weight-update group requests.
    """

    def __init__(self, engine):
        self.engine = engine
        self.health_generates = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower() not in (
            "0", "false", "no", "off")
        self.health_timeout_s = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))
        self.flush_pending = False  # flush_wrapper.py: one deferred flush at a time
        # SGLang 0.5.23 managers/scheduler_components/weight_updater.py: a weight-update session;
        # distributed updates outside it fail, begin inside one and end outside one fail (HTTP 400).
        self.session_open = False
        # SGLang's scheduler runs one request at a time and its group set-up and broadcasts block it
        # (managers/communicator.py queues each kind; scheduler_components/weight_updater.py):
        # weight-update group requests are served one after another, never side by side.
        self.group_ops = asyncio.Lock()

    def build(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.on_startup.append(self._on_startup)
        self._generation_routes(app.router)
        self._health_and_info_routes(app.router)
        self._cache_and_scheduling_routes(app.router)
        self._weight_routes(app.router)
        self._lora_routes(app.router)
        return app

    async def _on_startup(self, app) -> None:
        await self.engine.start()

    def _via_scheduler(self, fn):
        """A control request answered by the scheduler: its reply is a message to the tokenizer
        manager (what /health waits for)."""
        async def handler(request):
            try:
                return await fn(request)
            finally:
                self.engine.note_receive()
        return handler

    # -- generation -------------------------------------------------------------------------------

    def _generation_routes(self, r) -> None:
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)

    def _expand(self, req: dict) -> tuple[list, bool]:
        """GenerateReqInput normalisation (io_struct.py ``_handle_parallel_sampling``,
        ``_normalize_batch_inputs``, ``_normalize_rid``, ``_normalize_logprob_params``) and
        tokenizer_manager.py ``_handle_batch_request``: -> (per-request kwargs, is_batch).
        ``n`` > 1 turns a request into a batch of n samples per prompt, each with a new rid."""
        if req.get("custom_logit_processor"):
            # tokenizer_manager.py _validate_one_request; the worker has no such flag.
            raise sampling.ParamError("The server is not configured to enable custom logit processor. "
                                      "Please set `--enable-custom-logit-processor` to enable this feature.")
        if req.get("top_logprobs_num") or req.get("token_ids_logprob"):
            raise sampling.ParamError("top_logprobs_num / token_ids_logprob are not supported by the CPU "
                                      "worker; use return_logprob (sampled tokens) and logprob_start_len")
        ids, text = req.get("input_ids"), req.get("text")
        if ids is None and text is not None:
            tokenizer = self.engine.tokenizer
            if tokenizer is None:
                raise RequestError("text input needs a tokenizer in the model dir; send input_ids")
            ids = [tokenizer.encode(t) for t in text] if isinstance(text, list) else tokenizer.encode(text)
        if ids is None:
            raise RequestError("one of input_ids / text is required")
        batch = bool(ids) and isinstance(ids[0], list)
        items = ids if batch else [ids]
        params = req.get("sampling_params")
        plist = params if isinstance(params, list) else None
        if plist is not None:
            if len(plist) != len(items):
                raise RequestError(f"sampling_params has {len(plist)} entries for {len(items)} prompts")
            n = (plist[0] or {}).get("n", 1) if plist else 1
            if any((p or {}).get("n", 1) != n for p in plist):
                raise sampling.ParamError("The parallel_sample_num should be the same for all samples in "
                                          "sample params.")
        else:
            n = (params or {}).get("n", 1) if isinstance(params, dict) else 1
        n = 1 if n is None else n
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise sampling.ParamError(f"sampling_params.n must be an integer >= 1, got {n!r}")
        if n > 1:
            batch = True
        per = {}
        for key, default in (("return_logprob", False), ("logprob_start_len", -1),
                             ("return_text_in_logprobs", False), ("return_routed_experts", False),
                             ("routed_experts_start_len", 0)):
            v = req.get(key)
            if isinstance(v, list):
                if n > 1:
                    raise sampling.ParamError(f"Cannot use list {key} with parallel_sample_num > 1")
                if len(v) != len(items):
                    raise RequestError(f"{key} has {len(v)} entries for {len(items)} prompts")
                per[key] = v
            else:
                per[key] = [default if v is None else v] * len(items)
        rid = req.get("rid")
        if not batch:
            rids = [rid if rid is not None else uuid.uuid4().hex]
        elif n > 1:  # every sample gets a fresh rid (regenerate_rid): the caller's rid names none
            rids = [None] * len(items)
        elif rid is None:
            rids = [uuid.uuid4().hex for _ in items]
        elif isinstance(rid, str):
            rids = [f"{rid}_{i}" for i in range(len(items))]
        elif isinstance(rid, list):
            if len(rid) != len(items):
                raise sampling.ParamError("The specified rids length mismatch with the batch_size for batch "
                                          "processing.")
            rids = rid
        else:
            raise sampling.ParamError("The rid should be a string or a list of strings.")
        loras = lora_path_per_prompt(req.get("lora_path"), len(items))
        out = []
        for i, item in enumerate(items):
            kw = dict(input_ids=item, params=plist[i] if plist is not None else params, lora_path=loras[i],
                      return_logprob=per["return_logprob"][i], logprob_start_len=per["logprob_start_len"][i],
                      return_text_in_logprobs=per["return_text_in_logprobs"][i],
                      return_routed_experts=per["return_routed_experts"][i],
                      routed_experts_start_len=per["routed_experts_start_len"][i])
            for _ in range(n):
                out.append(dict(kw, rid=uuid.uuid4().hex if n > 1 else rids[i]))
        return out, batch

    async def generate(self, request):
        req = await _body(request)
        params = req.get("sampling_params")
        try:  # api_contract.py generate_contract_error: HTTP 400 {"error": "<text>"}, streaming or not
            for p in (params if isinstance(params, list) else [params]):
                if p is not None:
                    sampling.check_contract(p)
        except sampling.ContractError as e:
            return _ok({"error": str(e)}, 400)
        stream = bool(req.get("stream"))
        lora_ids: list = []
        try:
            reqs, batch = self._expand(req)
            if self.engine.paused:  # tokenizer_manager.py generate_request: rid registered, then the wait
                held = [r["rid"] for r in reqs]
                self.engine.hold(held)
                try:
                    await self.engine.wait_resumed()
                finally:
                    sent = self.engine.release(held)
            else:
                sent = {}
            refusal = self.engine.memory_refusal()
            if refusal is not None:  # cpu_memory_saver.py: SGLang would crash on unmapped memory
                raise RequestError(refusal)
            # tokenizer_manager.py _validate_and_resolve_lora, after the pause wait (cpu_worker_lora_routes.py)
            lora_ids = await self.lora_acquire([r.pop("lora_path") for r in reqs], batch)
            seqs = [self.engine.make_seq(r.pop("input_ids"), r.pop("params"), r.pop("rid"), **r) for r in reqs]
            for s, lora_id in zip(seqs, lora_ids):
                s.abort_sent, s.lora_id = sent.get(s.rid, False), lora_id
        except sampling.ContractError as e:
            await self.lora_release(lora_ids)
            return _ok({"error": str(e)}, 400)
        except (sampling.ParamError, RequestError, LoRARequestError, TypeError, ValueError) as e:
            await self.lora_release(lora_ids)
            if stream:  # http_server.py stream_results: the error is an SSE event of a 200 answer
                return await self._sse(request, [], error=str(e))
            return _err(str(e))
        try:
            if stream:
                return await self._sse(request, seqs, batch=batch)
            outs = await asyncio.gather(*(self.engine.generate_one(s) for s in seqs))
        finally:
            await asyncio.shield(self.lora_release(lora_ids))
        return web.json_response(outs if batch else outs[0])

    async def _sse(self, request, seqs: list, *, batch: bool = False, error: Optional[str] = None):
        """stream=true: ``data: <json>\\n\\n`` events, then ``data: [DONE]`` (http_server.py
        ``serve_generate_request``). Each event carries everything generated so far
        (non-incremental streaming, SGLang's default); batch events add ``index``
        (tokenizer_manager.py ``_stream_batch_responses``). A chunk is held back while the text
        could still become a stop string (``check_match_stop_str_prefix``)."""
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        if error is not None:
            await send({"error": {"message": error, "type": "invalid_request_error", "code": 400,
                                  "retryable": False}})
        queue: asyncio.Queue = asyncio.Queue()
        for i, s in enumerate(seqs):
            s.events = (queue, i)
            self.engine.submit(s)
        pending, sent = set(range(len(seqs))), [0] * len(seqs)
        try:
            while pending:
                i = await queue.get()
                s = seqs[i]
                if i not in pending:
                    continue
                if s.future.done():
                    chunk = self.engine.response(s)
                    pending.discard(i)
                else:
                    n, interval = len(s.output), s.sp.stream_interval or 1
                    if not (interval == 1 or n - sent[i] >= interval or (sent[i] == 0 and n > 0)):
                        continue
                    if sampling.holds_stop_prefix(s.sp, s.output, self.engine.tokenizer):
                        continue
                    chunk, sent[i] = self.engine.partial(s), n
                if batch:
                    chunk["index"] = i
                await send(chunk)
        except (asyncio.CancelledError, ConnectionResetError):
            for i in pending:
                self.engine.abort(seqs[i].rid, False)
            raise
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- health and information -------------------------------------------------------------------

    def _health_and_info_routes(self, r) -> None:
        r.add_get("/health", self.health_generate)
        r.add_get("/ready", self.ready)
        r.add_get("/health_generate", self.health_generate)
        for p in ("/get_model_info", "/model_info"):
            r.add_get(p, self.get_model_info)
        for p in ("/get_server_info", "/server_info"):
            r.add_get(p, self.get_server_info)
        r.add_get("/v1/loads", self._via_scheduler(self.v1_loads))
        r.add_route("GET", "/get_weights_by_name", self._via_scheduler(self.get_weights_by_name))
        r.add_route("POST", "/get_weights_by_name", self._via_scheduler(self.get_weights_by_name))

    async def health_generate(self, request):
        """/health and /health_generate (http_server.py ``health_generate``; /health generates too
        unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false): a one-token request is sent
        (skipped by the scheduler when it is busy, which answers at once), and the check passes
        when any scheduler message arrives after it started; after SGLANG_HEALTH_CHECK_TIMEOUT
        seconds without one it is 503. While generation is paused (any mode) the request waits
        in the tokenizer manager, so a paused, quiet server answers 503."""
        if request.path == "/health" and not self.health_generates:
            return web.Response(status=200)
        if self.engine.memory_refusal() is not None:  # its generation is refused (cpu_memory_saver.py)
            return web.Response(status=503)
        mark = self.engine.received

        async def send() -> None:
            await self.engine.wait_resumed()
            if self.engine.busy():  # scheduler.py: skipped, "ongoing requests already carry health info"
                self.engine.note_receive()
                return
            seq = self.engine.make_seq([0], {"max_new_tokens": 1, "temperature": 0.0},
                                       f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}")
            self.engine.submit(seq)

        task = asyncio.create_task(send())
        healthy = await self.engine.received_since(mark, self.health_timeout_s)
        task.cancel()
        return web.Response(status=200 if healthy else 503)

    async def ready(self, request):
        # http_server.py /ready: tokenizer_manager.is_ready() = not paused and healthy.
        return web.Response(status=503 if self.engine.paused else 200)

    def _model_info(self):
        e = self.engine
        return {"model_path": e.model_path, "tokenizer_path": e.model_path if e.tokenizer else None,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": e.weight_version, "model_type": getattr(e.config, "model_type", None),
                "architectures": getattr(e.config, "architectures", None)}

    async def get_model_info(self, request):
        return _ok(self._model_info())

    async def get_server_info(self, request):
        e = self.engine
        return _ok({"model_path": e.model_path, "tokenizer_path": self._model_info()["tokenizer_path"],
                     "tp_size": e.tp_size, "dp_size": 1, "pp_size": 1, "context_length": e.context_len,
                     "max_running_requests": e.max_running, "weight_version": e.weight_version,
                     "quantization": "fp8" if e.fp8 is not None else None,
                     "version": _VERSION, "engine": "m2po-cpu-worker",
                     # One entry per DP rank, as http_server.py server_info builds it from the
                     # schedulers' get_internal_state (scheduler_components/internal_state.py
                     # _add_topology): what the scheduler runs at once, after memory sizing.
                     "internal_states": [{"effective_max_running_requests_per_dp": e.max_running}],
                     # server_args.enable_return_routed_experts (arg_groups/fields/exec_.py)
                     "enable_return_routed_experts": e.routing is not None,
                     **self._lora_server_info()})

    async def v1_loads(self, request):
        # SGLang 0.5.23 entrypoints/v1_loads.py: per-DP-rank load snapshots.
        return _ok({"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": _VERSION,
                    "accelerator": None, "num_accelerators": 1, "loads": [self.engine.load()]})

    # SGLang 0.5.23 http_server.py /get_weights_by_name (GetWeightsByNameReqInput {name,
    # truncate_size=100}) -> Engine.weights_by_name; an unknown name is a 400
    # {"error": {"message": "Get parameter by name failed"}}.
    async def get_weights_by_name(self, request):
        req = await _body(request)
        out = await self.engine.run_model(self.engine.weights_by_name, str(req.get("name", "")),
                                          int(req.get("truncate_size", 100)))
        if out is None:
            return _ok({"error": {"message": "Get parameter by name failed"}}, 400)
        return _ok(out)

    # -- cache and scheduling ---------------------------------------------------------------------

    def _cache_and_scheduling_routes(self, r) -> None:
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("GET", "/slow_down", self._via_scheduler(self.slow_down))
        r.add_route("POST", "/slow_down", self._via_scheduler(self.slow_down))

    async def flush_cache(self, request):
        # http_server.py flush_cache(timeout) -> scheduler_components/flush_wrapper.py: timeout 0
        # flushes at once when scheduler.py flush_cache allows it (no running request; no waiting
        # one unless the scheduler is paused); timeout > 0 defers until fully idle -- nothing
        # running and nothing waiting, paused or not -- or answers "Timed out" (one deferred flush
        # at a time). A flush drops the prefix cache.
        self.engine.note_receive()
        try:
            timeout = float(request.query.get("timeout", 0) or 0)
        except ValueError:
            return web.Response(text=f"timeout={request.query.get('timeout')!r}: a number >= 0\n", status=422)
        if timeout > 0:
            if self.flush_pending:
                return web.Response(text="Another flush_cache is already in progress.", status=400)
            self.flush_pending = True
            try:
                deadline = time.monotonic() + timeout
                while self.engine.busy():  # waits on scheduler messages (each step sends one)
                    left = deadline - time.monotonic()
                    if left <= 0 or not await self.engine.received_since(self.engine.received, left):
                        if self.engine.busy():
                            return web.Response(text="Timed out waiting for idle state.", status=400)
            finally:
                self.flush_pending = False
        if not await self.engine.run_model(self.engine.flush):
            return web.Response(text="Flush cache failed.\n", status=400)
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n", status=200)

    async def abort_request(self, request):
        req = await _body(request)
        self.engine.abort(req.get("rid"), bool(req.get("abort_all", False)))
        return web.Response(status=200)

    async def pause_generation(self, request):
        """tokenizer_manager.py / scheduler.py ``pause_generation``: every mode makes new requests
        wait; "in_place" stops the scheduler with its requests and caches as they are; "retract"
        stops it and moves running requests back to the waiting queue (their KV is freed, so a
        cache flush is legal); "abort" (the default) aborts everything and returns once no request
        is left, without stopping the scheduler."""
        req = await _body(request)
        mode = req.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _err(f"Invalid mode: {mode!r}. Expected one of ['abort', 'retract', 'in_place'].")
        self.engine.pause()
        if mode == "abort":
            await self.engine.abort_all_and_wait()
        else:
            async with self.engine.step_lock:  # returns only after the current step ends
                self.engine.sched_paused = True
                if mode == "retract":
                    await self.engine.run_model(self.engine.retract_all)
            self.engine.note_receive()
        return _ok({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request):
        self.engine.resume()
        self.engine.note_receive()
        return _ok({"message": "Generation continued successfully.", "status": "ok"})

    async def slow_down(self, request):
        # SGLang: SlowDownReqInput(forward_sleep_time: Optional[float]); None turns it off.
        req = await _body(request)
        t = req.get("forward_sleep_time")
        if t is not None and (not isinstance(t, (int, float)) or t < 0):
            return _ok({"error": {"message": f"forward_sleep_time must be a number >= 0 or null, got {t!r}"}}, 400)
        self.engine.slow_down(float(t) if t else None)
        return _ok({})

    # -- weights ----------------------------------------------------------------------------------

    def _weight_routes(self, r) -> None:
        r.add_post("/begin_weight_update", self._via_scheduler(self.begin_weight_update))
        r.add_post("/end_weight_update", self._via_scheduler(self.end_weight_update))
        r.add_post("/update_weights_from_disk", self._via_scheduler(self.update_from_disk))
        r.add_post("/init_weights_update_group", self._via_scheduler(self.init_group))
        r.add_post("/destroy_weights_update_group", self._via_scheduler(self.destroy_group))
        r.add_post("/update_weights_from_distributed", self._via_scheduler(self.update_from_distributed))
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/update_weights_from_tensor", self._via_scheduler(self.update_weights_from_tensor))
        for method in ("GET", "POST"):  # http_server.py api_route(methods=["GET", "POST"])
            r.add_route(method, "/release_memory_occupation", self._via_scheduler(self.release_memory_occupation))
            r.add_route(method, "/resume_memory_occupation", self._via_scheduler(self.resume_memory_occupation))

    async def begin_weight_update(self, request):
        await _body(request)
        if self.session_open:
            return _ok({"success": False, "message": "a weight-update session is already open; "
                                                     "call end_weight_update() first"}, 400)
        self.session_open = True
        return _ok({"success": True, "message": "Success"})

    async def end_weight_update(self, request):
        await _body(request)
        if not self.session_open:
            return _ok({"success": False, "message": "no weight-update session is open; "
                                                     "call begin_weight_update() first"}, 400)
        self.session_open = False
        if self.engine.fp8 is not None:
            # end_weight_update -> DefaultModelLoader.postprocess_weights (process_weights_after_loading).
            # Stricter than SGLang: an FP8 weight whose scale never came (or the reverse) is an error here.
            try:
                await self.engine.run_model(self.engine.fp8.after_loading)
            except ValueError as e:
                return _ok({"success": False, "message": str(e)}, 400)
        return _ok({"success": True, "message": "Success"})

    async def _flush_after_update(self, req: dict):
        # weight_updater.py flush_cache_after_weight_update: flush_cache defaults to true and a
        # flush refused because requests run or wait fails the (already applied) update. Without
        # a flush the prefix cache keeps the KV the old weights computed, and later requests reuse it.
        if req.get("flush_cache", True) and not await self.engine.run_model(self.engine.flush):
            return _ok({"success": False, "message": "Weights were updated, but the cache was not flushed because "
                        "requests are still running or queued. Retract or finish them, then call /flush_cache."},
                       400)
        return None

    def _set_version(self, v) -> None:
        if v is not None:
            self.engine.weight_version = str(v)

    async def update_from_disk(self, request):
        req = await _body(request)
        if req.get("abort_all_requests"):
            self.engine.abort(None, True)
        path = req.get("model_path", "")
        refusal = self.engine.memory_refusal("update_weights_from_disk", weights_only=True)
        if refusal is not None:
            return _ok({"success": False, "message": refusal, "num_paused_requests": 0}, 400)
        if not glob.glob(os.path.join(path, "*.safetensors")):  # loader.py _prepare_weights: nothing loaded
            return _ok({"success": False, "message": f"Failed to get weights iterator: Cannot find any model weights "
                        f"with `{path}`.", "num_paused_requests": 0}, 400)
        try:
            await self.engine.run_model(self.engine.load_from_disk, path)
        except Exception as e:  # noqa: BLE001 - reported to the caller
            # model_runner_components/weight_updater.py update_weights_from_disk: "Rolling back to
            # original weights" reloads from model_config.model_path, which already names the new
            # directory. When that raises too, the exception leaves the scheduler (scheduler.py
            # run_scheduler_process: "Scheduler hit an exception", SIGQUIT to the server): the
            # engine is gone and the caller gets no answer. (Per-tensor FP8 always ends here.)
            try:
                await self.engine.run_model(self.engine.load_from_disk, path)
            except Exception as again:  # noqa: BLE001
                log.error("Scheduler hit an exception: rolling back to %s failed: %s", path, again)
                logging.shutdown()
                os._exit(1)
            return _ok({"success": False, "message": f"Failed to update weights: {e}.\nRolling back to original "
                        "weights.", "num_paused_requests": 0}, 400)
        self.engine.model_path = path
        self._set_version(req.get("weight_version"))
        msg = "Succeeded to update model weights."
        if req.get("weight_version") is not None:
            msg += f" Weight version updated to {req['weight_version']}."
        refused = await self._flush_after_update(req)
        if refused is not None:
            return refused
        return _ok({"success": True, "message": msg, "num_paused_requests": 0})

    async def init_group(self, request):
        req = await _body(request)
        try:
            async with self.group_ops:
                await asyncio.to_thread(self.engine.init_group, req)
        except Exception as e:  # noqa: BLE001
            return _ok({"success": False, "message": f"Failed to initialize custom process group: {e}."}, 400)
        return _ok({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_group(self, request):
        req = await _body(request)
        name = req.get("group_name", DEFAULT_GROUP)
        async with self.group_ops:
            pg = self.engine.drop_group(name)
        if pg is None:
            return _ok({"success": False, "message": f"group {name!r} does not exist"}, 400)
        destroy_side_group(pg)  # weight_updater.py: torch.distributed.destroy_process_group(pg)
        return _ok({"success": True, "message": "Succeeded to destroy custom process group."})

    async def update_from_distributed(self, request):
        req = await _body(request)
        if not self.session_open:
            return _ok({"success": False, "message": "update_weights_from_distributed must run between "
                                                     "begin_weight_update() and end_weight_update()"}, 400)
        if req.get("abort_all_requests"):
            self.engine.abort(None, True)
        try:
            async with self.group_ops:
                named = await asyncio.to_thread(self.engine.receive, req)
                await self.engine.run_model(self.engine.load_weights, named)
        except Exception as e:  # noqa: BLE001
            # weight_updater.py load_weights_from_distributed: the tensors before the failing one stay loaded.
            return _ok({"success": False, "message": f"Failed to update parameter online: {e}. The full weights of the "
                        "ModelRunner are partially updated. Please discard the whole weights."}, 400)
        self._set_version(req.get("weight_version"))
        msg = "Succeeded to update parameter online."
        if req.get("weight_version") is not None:
            msg += f" Weight version updated to {req['weight_version']}."
        refused = await self._flush_after_update(req)
        if refused is not None:
            return refused
        return _ok({"success": True, "message": msg})

    async def update_weight_version(self, request):
        req = await _body(request)
        if req.get("abort_all_requests"):
            self.engine.abort(None, True)
        self._set_version(req.get("new_version"))
        return _ok({"success": True, "message": f"Weight version updated to {req.get('new_version')}",
                    "new_version": req.get("new_version")})
