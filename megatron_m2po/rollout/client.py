"""Asyncio client for an SGLang engine or an sglang-router (and for our CPU worker).

Routes and field names follow SGLang 0.5.23, the one supported version
(``rollout/sglang_version.py``; ``tests/rollout/test_sglang_contract.py`` checks them against the
wheel's source):

- ``python/sglang/srt/entrypoints/http_server.py``: ``/generate`` (POST|PUT, body =
  ``GenerateReqInput``), ``/health`` and ``/health_generate`` (both generate a token: 200, or
  503 while starting, unhealthy or paused), ``/ready`` (503 while paused), ``/get_model_info`` {model_path, tokenizer_path, is_generation,
  preferred_sampling_params, weight_version}, ``/get_server_info`` (server args + scheduler info
  + ``version``); SGLang 0.5.23 serves ``/model_info`` and ``/server_info`` (the ``get_`` forms are
  deprecated aliases) and has no ``/get_weight_version`` -- the version is ``/model_info``'s
  ``weight_version``; ``/flush_cache`` (GET|POST; 200, or
  400 while requests run), ``/abort_request`` {rid, abort_all}, ``/pause_generation`` and
  ``/continue_generation`` ({"message", "status": "ok"}), ``/update_weights_from_disk``
  {success, message, num_paused_requests}, ``/init_weights_update_group``,
  ``/update_weights_from_distributed``, ``/destroy_weights_update_group``,
  ``/update_weight_version`` {new_version, abort_all_requests}. The update routes set
  ``server_args.weight_version`` when the request carries ``weight_version``.
- 0.5.23 ``managers/scheduler_components/weight_updater.py``: ``/update_weights_from_distributed``
  (and ``_from_tensor``) fail with success=false (HTTP 400) outside a ``/begin_weight_update``
  {selector} ... ``/end_weight_update`` {} session; end fails only when no session is open. An
  update with ``flush_cache`` true (the default, also for ``/update_weights_from_disk``) fails
  after loading when requests are still running or queued; the weight pushes pause with retract
  (which empties the running batch) so their updates can flush the prefix cache
  (``weights/transport.py``).
- Colocated mode (0.5.23 ``managers/scheduler_components/weight_updater.py``):
  ``/release_memory_occupation`` and ``/resume_memory_occupation`` {tags: weights | kv_cache |
  cuda_graph, null = all} (200 with ``null``; release needs an idle engine), and
  ``/update_weights_from_tensor`` {serialized_named_tensors (base64 per TP rank), load_format,
  flush_cache, abort_all_requests, weight_version} -> {success, message}, inside an update session.
- LoRA (0.5.23 ``entrypoints/http_server.py``, ``managers/io_struct.py``): ``/load_lora_adapter``
  {lora_name, lora_path, pinned}, ``/load_lora_adapter_from_tensors`` {lora_name, config_dict,
  serialized_named_tensors, pinned, load_format, added_tokens_config}, ``/unload_lora_adapter``
  {lora_name} -> ``LoRAUpdateOutput`` {success, error_message, loaded_adapters} (400 on failure);
  ``/generate``'s ``lora_path`` names the adapter of a request.
- 0.5.23 ``utils/weight_versions.py``: ``meta_info["weight_versions"]`` = spans
  ``[{"version", "start", "end"}, ...]`` over the output tokens of a request that lived through
  weight updates (``GenerateOutput.token_weight_versions`` expands them per token).
- ``python/sglang/srt/managers/io_struct.py``: ``UpdateWeightFromDiskReqInput`` {model_path,
  load_format, abort_all_requests, weight_version, ...}; ``InitWeightsUpdateGroupReqInput``
  {master_address, master_port, rank_offset, world_size, group_name="weight_update_group",
  backend="nccl"}; ``UpdateWeightsFromDistributedReqInput`` {names, dtypes, shapes, group_name,
  flush_cache, abort_all_requests, weight_version, load_format}; ``PauseGenerationReqInput``
  {mode: "abort" (default) | "retract" | "in_place"}.
- ``python/sglang/srt/managers/tokenizer_manager.py``: ``meta_info`` = {id, finish_reason,
  prompt_tokens, weight_version, completion_tokens, cached_tokens, e2e_latency,
  output_token_logprobs: [[logprob, token_id, text|None], ...]}; ``finish_reason`` is
  {"type": "stop", "matched": id|str} | {"type": "length", "length": n} | {"type": "abort", ...}.
- ``python/sglang/srt/layers/sampler.py``: returned log-probs are ``log(softmax(logits / T))``
  before top-p/top-k truncation (``SGLANG_RETURN_ORIGINAL_LOGPROB`` switches to T = 1).
- sglang-router 0.3.2 (the Rust ``smg`` router, installed here): forwards ``/generate``,
  ``/get_model_info``, ``/flush_cache``, ``/health_generate``; registers workers with
  ``POST /workers {"url"}`` (202, asynchronous) / ``GET /workers`` / ``DELETE /workers/{id}``.
  It does *not* forward ``/abort_request`` (404), pause/continue or weight updates: send those to
  each engine (``EngineFleet.engine_urls``). ``SGLangClient.abort`` does so by itself: given
  ``engine_urls``, or when the base URL answers 404 (a router), it sends the abort to every
  worker the router lists (``GET /workers``); only the engine that owns the rid acts on it.

Retries: connection errors, timeouts of non-generate calls, HTTP 502/503/504 and other 5xx are
retried with exponential backoff and jitter; 4xx never (the request is wrong). A generate that
timed out is aborted on the engine (best effort) before the error is raised.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import random
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import aiohttp
import numpy as np

from megatron_m2po.utils.aio import gather_or_cancel
from megatron_m2po.utils.timing import TIMER

log = logging.getLogger("m2po.client")

class EngineError(RuntimeError):
    """An engine answered with an error, or could not be reached after the retries."""

    def __init__(self, url: str, route: str, message: str, status: Optional[int] = None) -> None:
        super().__init__(f"{url}{route}: {message}" + (f" (HTTP {status})" if status else ""))
        self.url, self.route, self.status = url, route, status


def timeout_message(timeout_s: float) -> str:
    """What a generate that ran past its timeout says: the setting, and the two usual causes."""
    return (f"timed out after {timeout_s:.0f}s (rollout.request_timeout_s): the engine stopped answering "
            "(see its log) or a response takes longer than that (raise it)")


_ABORT_FAILURES: dict[str, int] = {}


def log_abort_failure(url: str, rid: str, err: BaseException) -> None:
    """An abort that did not reach ``url``: the first one per engine is a warning, then one line per
    100 (an engine that stopped answering fails every abort of its in-flight requests at once; one
    line each drowned the error that ended the step)."""
    n = _ABORT_FAILURES[url] = _ABORT_FAILURES.get(url, 0) + 1
    if n == 1:
        log.warning("could not abort request %s on %s: %s (further failed aborts on this engine: one line per 100)",
                    rid, url, err)
    elif n % 100 == 0:
        log.warning("could not abort %d requests on %s so far; the last: %s", n, url, err)
    else:
        log.debug("could not abort request %s on %s: %s", rid, url, err)


@dataclass(slots=True)
class GenerateOutput:
    """One finished generation.

    ``output_logprobs[i]`` is the log-prob of ``output_ids[i]`` under the temperature-scaled
    distribution it was sampled from (SGLang convention); ``finish_reason`` is SGLang's dict
    (``type`` in stop / length / abort); ``weight_version`` is the engine's version string when
    the request finished; ``token_weight_versions`` gives the version per token, expanded from
    SGLang 0.5.23's ``meta_info["weight_versions"]`` spans (None when the engine sends no spans);
    ``cached_tokens`` is ``meta_info["cached_tokens"]``: prompt tokens served by the prefix cache.
    ``input_logprobs`` (a request with ``logprob_start_len`` L >= 0): ``meta_info["input_token_logprobs"]``'s
    values, the log-prob of each input token from position L on given the tokens before it, from the raw
    logits (no temperature); the first is None (SGLang 0.5.23 ``logprob_result_processor.py``
    ``_process_input_token_logprobs``: the token at L gets None even when L > 0).
    """

    output_ids: list[int]
    output_logprobs: Optional[list[float]]
    finish_reason: dict
    weight_version: str
    text: str
    rid: str = ""
    prompt_tokens: int = 0
    token_weight_versions: Optional[list[str]] = None
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache supplied (meta_info.cached_tokens)
    routed_experts: Optional[str] = None  # meta_info.routed_experts: base64 of int32 ids (routed_experts_array)
    input_logprobs: Optional[list[Optional[float]]] = None

    def routed_experts_array(self, num_layers: int, top_k: int, rows: int) -> np.ndarray:
        """``meta_info["routed_experts"]`` as int32 ``[rows, num_layers, top_k]``.

        SGLang 0.5.23 (``detokenizer_manager.py`` ``_b64_encode_per_request``,
        ``state_capturer/routed_experts.py`` ``extract_routed_experts_from_meta_info``): base64 of
        the int32 bytes of a ``[seqlen - 1 - routed_experts_start_len, layers, top_k]`` tensor, one
        row per position of prompt + output from ``routed_experts_start_len`` on, the last token
        excluded. An engine started without ``--enable-return-routed-experts`` silently omits the
        field (``_maybe_collect_routed_experts`` has no capturer): that is an error here."""
        if self.routed_experts is None:
            raise EngineError("", "/generate", "the engine returned no meta_info.routed_experts although the request "
                              "asked for them (return_routed_experts=true): SGLang only captures them when the "
                              "server is started with --enable-return-routed-experts")
        flat = np.frombuffer(base64.b64decode(self.routed_experts.encode("utf-8")), dtype=np.int32)
        if flat.size != rows * num_layers * top_k:
            raise EngineError("", "/generate", f"meta_info.routed_experts holds {flat.size} expert ids, expected {rows} "
                              f"positions x {num_layers} layers x top_k={top_k}; is the engine serving the same model?")
        return flat.reshape(rows, num_layers, top_k)

    @property
    def finish_type(self) -> str:
        return str((self.finish_reason or {}).get("type", ""))

    @property
    def aborted(self) -> bool:
        return self.finish_type == "abort"

    def version(self) -> int:
        """The weight version as an int (our versions are optimizer-update counts)."""
        try:
            return int(self.weight_version)
        except (TypeError, ValueError):
            raise ValueError(f"engine weight_version {self.weight_version!r} is not an integer; "
                             "start engines with an integer version (--weight-version 0)") from None

    @classmethod
    def from_json(cls, d: dict) -> "GenerateOutput":
        meta = d.get("meta_info", {})
        lps = meta.get("output_token_logprobs")
        ids = d.get("output_ids")
        if ids is None and lps is not None:
            ids = [int(x[1]) for x in lps]
        return cls(output_ids=list(ids or []),
                   output_logprobs=None if lps is None else [float(x[0]) for x in lps],
                   finish_reason=meta.get("finish_reason") or {}, weight_version=str(meta.get("weight_version")),
                   text=d.get("text", ""), rid=str(meta.get("id", "")),
                   prompt_tokens=int(meta.get("prompt_tokens", 0)),
                   cached_tokens=int(meta.get("cached_tokens") or 0),
                   routed_experts=meta.get("routed_experts"),
                   input_logprobs=None if meta.get("input_token_logprobs") is None else
                   [None if x[0] is None else float(x[0]) for x in meta["input_token_logprobs"]],
                   token_weight_versions=expand_weight_version_spans(meta.get("weight_versions"),
                                                                     len(ids or [])))


def expand_weight_version_spans(spans: Any, n: int) -> Optional[list[str]]:
    """Per-token versions from SGLang 0.5.23's ``meta_info["weight_versions"]`` spans.

    A span is ``{"version", "start", "end"}`` (``utils/weight_versions.py``
    ``add_weight_versions_to_meta_info``); the list form ``[version, start, end]`` is accepted
    too. None when there are no spans or they do not cover the ``n`` output tokens.
    """
    if not spans:
        return None
    out: list[Optional[str]] = [None] * n
    for sp in spans:
        if isinstance(sp, dict):
            v, a, b = sp.get("version"), sp.get("start"), sp.get("end")
        else:
            v, a, b = sp
        for i in range(max(0, int(a)), min(n, int(b))):
            out[i] = str(v)
    if any(v is None for v in out):
        return None
    return out  # type: ignore[return-value]


RETRY_STATUS = {500, 502, 503, 504}


def max_running_requests(server_info: Any) -> Optional[int]:
    """How many requests an engine runs at once, from its ``/server_info``; None when it does not say.

    SGLang 0.5.23 (``entrypoints/http_server.py`` ``server_info``): the top-level fields are the
    resolved start-up arguments, so ``max_running_requests`` is null unless the engine was started
    with ``--max-running-requests``; the value the schedulers actually use (capped by KV-cache memory)
    is ``internal_states[i]["effective_max_running_requests_per_dp"]``, one entry per data-parallel
    rank (``managers/scheduler_components/internal_state.py`` ``_add_topology``). Their sum is the
    engine's limit; the start-up argument is the fallback.
    """
    if not isinstance(server_info, dict):
        return None
    states = server_info.get("internal_states")
    if isinstance(states, list) and states:
        per_dp = [st.get("effective_max_running_requests_per_dp") if isinstance(st, dict) else None
                  for st in states]
        if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in per_dp):
            return sum(per_dp)
    top = server_info.get("max_running_requests")
    if isinstance(top, int) and not isinstance(top, bool) and top > 0:
        return top
    return None


def generate_payload(input_ids: Sequence[int], sampling_params: dict, return_logprob: bool, *, rid: Optional[str],
                     return_routed_experts: bool, routed_experts_start_len: int,
                     lora_path: Optional[str] = None, logprob_start_len: int = -1) -> dict:
    """The JSON body of one ``/generate`` request (SGLang's ``GenerateReqInput`` fields), with a fresh
    ``rid`` unless given; ``lora_path``: the name of a loaded LoRA adapter (None: the base model);
    ``logprob_start_len`` >= 0 asks for the input tokens' log-probs from there on (with ``return_logprob``).
    ``n > 1`` is refused: SGLang answers it with n outputs under new rids."""
    if (sampling_params or {}).get("n", 1) not in (None, 1):
        raise ValueError(f"sampling_params.n={sampling_params['n']}: SGLang answers n > 1 with a list of "
                         "n outputs under new rids; send n requests with n=1 instead")
    payload = {"input_ids": [int(t) for t in input_ids], "sampling_params": dict(sampling_params),
               "return_logprob": bool(return_logprob), "rid": rid or uuid.uuid4().hex}
    if return_routed_experts:
        payload.update(return_routed_experts=True, routed_experts_start_len=int(routed_experts_start_len))
    if lora_path is not None:
        payload["lora_path"] = str(lora_path)
    if logprob_start_len >= 0:
        payload["logprob_start_len"] = int(logprob_start_len)
    return payload


class _InFlight:
    """Generate requests this process has in flight to engines, over every client (a router's, or
    each engine's under ``rollout/dispatch.py``): the load over time, traced as the counter
    ``engine/inflight_reqs`` at every change (``logging.trace``). The engines' own ``/v1/loads``
    is a snapshot at a step's end, when a step's generation is usually done."""

    def __init__(self) -> None:
        self.n = 0

    def change(self, d: int) -> None:
        self.n += d
        if TIMER.trace:  # a generate request's hot path: nothing built when nothing is traced
            TIMER.counters({"engine/inflight_reqs": float(self.n)})


IN_FLIGHT = _InFlight()


class _Limiter:
    """An async limit on concurrent holders that can be raised or lowered while in use (a lowered
    limit lets no new holder in until enough have left). Bound to the event loop it is first used on."""

    def __init__(self, limit: int) -> None:
        self.limit, self.active = limit, 0
        self._cond = asyncio.Condition()

    async def __aenter__(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.active < self.limit)
            self.active += 1

    async def __aexit__(self, *exc) -> None:
        async with self._cond:
            self.active -= 1
            self._cond.notify()

    async def set_limit(self, limit: int) -> None:
        async with self._cond:
            self.limit = limit
            self._cond.notify_all()


class SGLangClient:
    """Client of one base URL (an engine or a router).

    Example::

        async with SGLangClient("http://127.0.0.1:30000", concurrency=64) as c:
            out = await c.generate([1, 2, 3], {"temperature": 1.0, "max_new_tokens": 64})
            await c.pause_generation(); await c.update_weights_from_disk(path, weight_version="7")
            await c.continue_generation()

    ``engine_urls`` (optional, with a router as ``base_url``) are the engines aborts go to.
    ``concurrency`` bounds in-flight ``generate`` calls (:meth:`set_concurrency` changes it while in
    use, e.g. when engines join the fleet); ``timeout_s`` is the total time of one generate request;
    control calls use ``control_timeout_s``. Use one client per event loop.
    """

    def __init__(self, base_url: str, *, concurrency: int = 64, timeout_s: float = 600.0,
                 max_retries: int = 3, backoff_s: float = 0.5, control_timeout_s: float = 60.0,
                 engine_urls: Optional[Sequence[str]] = None,
                 adapter: Optional[Callable[[], Optional[tuple[str, int]]]] = None) -> None:
        if concurrency < 1 or timeout_s <= 0 or max_retries < 0:
            raise ValueError(f"SGLangClient: concurrency={concurrency} (>=1), timeout_s={timeout_s} "
                             f"(>0), max_retries={max_retries} (>=0)")
        self.base_url = base_url.rstrip("/")
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.control_timeout_s = control_timeout_s
        self.concurrency = concurrency
        # Where aborts go when base_url is a router (None: ask the router for its workers).
        self.engine_urls = [u.rstrip("/") for u in engine_urls] if engine_urls else None
        self._sem: Optional[_Limiter] = None
        self._session: Optional[aiohttp.ClientSession] = None
        # LoRA adapter pushes (weights/lora_push.py ``AdapterPush.current``): the (name, version) of the
        # adapter a request without its own lora_path runs under (None: the base model). Its tokens are
        # tagged with that version: a request keeps its adapter to its end, across later pushes.
        self.adapter = adapter

    def _adapter_for(self, lora_path: Optional[str]) -> tuple[Optional[str], Optional[int]]:
        """``(lora_path to send, version to tag the tokens with or None)`` of one request."""
        if lora_path is not None or self.adapter is None:
            return lora_path, None
        cur = self.adapter()
        return (cur[0], int(cur[1])) if cur is not None else (None, None)

    @staticmethod
    def _tagged(out: "GenerateOutput", version: Optional[int]) -> "GenerateOutput":
        """Every token of a request under an adapter pushed as ``version`` is of that version (the
        engine's spans would name its own counter, which moves with later pushes)."""
        if version is not None:
            out.weight_version = str(version)
            out.token_weight_versions = [str(version)] * len(out.output_ids)
        return out

    async def __aenter__(self) -> "SGLangClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No connection limit: the limiter bounds generate calls, and a raised limit must not
            # queue behind a connector sized for the old one.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            self._sem = _Limiter(self.concurrency)
        return self._session

    async def set_concurrency(self, concurrency: int) -> None:
        """Change the bound on in-flight ``generate`` calls (call on the client's event loop)."""
        if concurrency < 1:
            raise ValueError(f"SGLangClient.set_concurrency({concurrency}): must be >= 1")
        self.concurrency = concurrency
        if self._sem is not None:
            await self._sem.set_limit(concurrency)

    async def request(self, method: str, route: str, payload: Any = None, *,
                      timeout_s: Optional[float] = None, retry: bool = True,
                      expect_json: bool = True) -> Any:
        """One HTTP call with retries; returns parsed JSON (or text), raises ``EngineError``."""
        url = self.base_url + route
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.control_timeout_s)
        attempts = (self.max_retries if retry else 0) + 1
        last = ""
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.backoff_s * (2 ** (attempt - 1)) * (0.5 + random.random()))
            try:
                async with self._sess().request(method, url, json=payload, timeout=timeout) as r:
                    text = await r.text()
                    if r.status in RETRY_STATUS:
                        last = f"HTTP {r.status}: {text[:300]}"
                        continue
                    if r.status >= 400:
                        raise EngineError(self.base_url, route, text[:2000], r.status)
                    if not expect_json:
                        return text
                    if not text:
                        return None
                    try:
                        return await r.json(content_type=None)
                    except ValueError:
                        return text
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                last = f"{type(e).__name__}: {e}"
            except asyncio.TimeoutError:
                last = f"timed out after {timeout.total:.0f}s"
        raise EngineError(self.base_url, route, f"failed after {attempts} attempt(s): {last}")

    # ------------------------------------------------------------------ generation
    async def generate(self, input_ids: Sequence[int], sampling_params: dict, return_logprob: bool = True,
                       *, rid: Optional[str] = None, return_routed_experts: bool = False,
                       routed_experts_start_len: int = 0, affinity: Optional[str] = None,
                       lora_path: Optional[str] = None, logprob_start_len: int = -1) -> GenerateOutput:
        """POST /generate for one prompt (under the LoRA adapter named ``lora_path``, if given). ``rid`` lets ``abort(rid)`` stop it later.
        ``return_routed_experts``: ask for every MoE layer's top-k expert ids of the positions from
        ``routed_experts_start_len`` on (:meth:`GenerateOutput.routed_experts_array`). ``affinity``
        is not sent: one URL has nothing to choose (a router picks by prompt prefix); the
        ``DispatchClient`` (``rollout/dispatch.py``) keeps requests with one key on one engine."""
        payload, adapter_version = self._generate_request(input_ids, sampling_params, return_logprob, rid,
                                                          return_routed_experts, routed_experts_start_len, lora_path,
                                                          logprob_start_len)
        rid = payload["rid"]
        async with self._sem:
            IN_FLIGHT.change(+1)
            try:
                # A generate that timed out is not retried: the engine may still be running it.
                out = await self._generate_with_retry(payload)
            except asyncio.CancelledError:
                await self._abort_quietly(rid)
                raise
            except EngineError as e:
                if "timed out" in str(e):
                    await self._abort_quietly(rid)
                raise
            finally:
                IN_FLIGHT.change(-1)
        return self._tagged(GenerateOutput.from_json(out), adapter_version)

    def _generate_request(self, input_ids: Sequence[int], sampling_params: dict, return_logprob: bool,
                          rid: Optional[str], return_routed_experts: bool, routed_experts_start_len: int,
                          lora_path: Optional[str], logprob_start_len: int = -1) -> tuple[dict, Optional[int]]:
        """A ``/generate`` body (under the adapter ``lora_path`` resolves to) and that adapter's version,
        with the HTTP session open (the plain and the dispatching client send the same body)."""
        lora_path, adapter_version = self._adapter_for(lora_path)
        payload = generate_payload(input_ids, sampling_params, return_logprob, rid=rid,
                                   return_routed_experts=return_routed_experts,
                                   routed_experts_start_len=routed_experts_start_len, lora_path=lora_path,
                                   logprob_start_len=logprob_start_len)
        self._sess()
        return payload, adapter_version

    async def _generate_with_retry(self, payload: dict) -> dict:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        url, last = self.base_url + "/generate", ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * (2 ** (attempt - 1)) * (0.5 + random.random()))
            try:
                async with self._sess().post(url, json=payload, timeout=timeout) as r:
                    text = await r.text()
                    if r.status in RETRY_STATUS:
                        last = f"HTTP {r.status}: {text[:300]}"
                        continue
                    if r.status >= 400:
                        raise EngineError(self.base_url, "/generate", text[:2000], r.status)
                    return await r.json(content_type=None)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                last = f"{type(e).__name__}: {e}"
            except asyncio.TimeoutError:
                raise EngineError(self.base_url, "/generate", timeout_message(self.timeout_s)) from None
        raise EngineError(self.base_url, "/generate", f"failed after {self.max_retries + 1} attempt(s): {last}")

    async def generate_many(self, prompts: Sequence[Sequence[int]], sampling_params: dict,
                            return_logprob: bool = True) -> list[GenerateOutput]:
        """Concurrent ``generate`` (bounded by ``concurrency``), results in prompt order."""
        return list(await gather_or_cancel(*(self.generate(p, sampling_params, return_logprob)
                                           for p in prompts)))

    async def abort(self, rid: Optional[str] = None, *, abort_all: bool = False,
                    timeout_s: Optional[float] = None) -> list[str]:
        """POST /abort_request {rid, abort_all}; returns the engine URLs that took it.

        sglang-router 0.3.2 has no ``/abort_request`` (404): behind it the abort goes to every
        engine (``engine_urls``, else the router's ``GET /workers``); SGLang ignores a rid it does
        not hold, so only the owner acts. Raises ``EngineError`` when an engine refuses or cannot
        be reached, or when the base URL answers 404 and lists no workers."""
        payload = {"rid": rid or "", "abort_all": abort_all}
        urls = self.engine_urls
        if urls is None:
            try:
                await self.request("POST", "/abort_request", payload, timeout_s=timeout_s, retry=False,
                                   expect_json=False)
                return [self.base_url]
            except EngineError as e:
                if e.status != 404:
                    raise
            urls = await self._router_workers(timeout_s)
        failed = []
        for url, res in zip(urls, await asyncio.gather(*(self._post_abort(u, payload, timeout_s) for u in urls),
                                                       return_exceptions=True)):
            if isinstance(res, BaseException):
                failed.append(f"{url}: {res}")
        if failed:
            raise EngineError(self.base_url, "/abort_request", "abort not delivered to " + "; ".join(failed))
        return list(urls)

    async def _router_workers(self, timeout_s: Optional[float]) -> list[str]:
        try:
            out = await self.request("GET", "/workers", timeout_s=timeout_s, retry=False)
        except EngineError as e:
            raise EngineError(self.base_url, "/abort_request", "answered 404 and is not an sglang-router "
                              f"either (GET /workers failed: {e}); point the client at an engine or pass "
                              "engine_urls") from None
        urls = [str(w.get("url", "")).rstrip("/") for w in (out or {}).get("workers", []) if w.get("url")]
        if not urls:
            raise EngineError(self.base_url, "/abort_request", f"the router lists no workers ({out!r})")
        return urls

    async def _post_abort(self, url: str, payload: dict, timeout_s: Optional[float]) -> None:
        async with self._sess().post(url + "/abort_request", json=payload,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s or self.control_timeout_s)) as r:
            if r.status != 200:
                raise EngineError(url, "/abort_request", (await r.text())[:300], r.status)

    async def _abort_quietly(self, rid: str) -> None:
        """Abort a request the caller gave up on; a failure is logged, never raised."""
        try:
            await asyncio.shield(self.abort(rid, timeout_s=5))
        except (EngineError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            log_abort_failure(self.base_url, rid, e)
        except asyncio.CancelledError:
            pass

    # ------------------------------------------------------------------ info
    async def health(self, timeout_s: float = 5.0) -> bool:
        """GET /health -> True on 200 (no retries)."""
        try:
            await self.request("GET", "/health", timeout_s=timeout_s, retry=False, expect_json=False)
            return True
        except EngineError:
            return False

    async def health_generate(self, timeout_s: float = 30.0) -> bool:
        try:
            await self.request("GET", "/health_generate", timeout_s=timeout_s, retry=False, expect_json=False)
            return True
        except EngineError:
            return False

    async def get_model_info(self) -> dict:
        return await self.request("GET", "/get_model_info")

    async def fleet_max_running(self) -> dict[str, Optional[int]]:
        """``{engine url: max_running_requests(its /server_info)}`` behind this URL: the workers of
        an sglang-router (``GET /workers``), or this engine alone."""
        try:
            out = await self.request("GET", "/workers", retry=False)
            urls = [str(w.get("url", "")).rstrip("/") for w in (out or {}).get("workers", []) if w.get("url")]
        except EngineError:
            urls = []
        if not urls:
            return {self.base_url: max_running_requests(await self.get_server_info())}
        infos = []
        for u in urls:
            async with SGLangClient(u, max_retries=self.max_retries, control_timeout_s=self.control_timeout_s) as c:
                infos.append(max_running_requests(await c.get_server_info()))
        return dict(zip(urls, infos))

    async def get_server_info(self) -> dict:
        """GET /server_info (SGLang 0.5.23's route; ``/get_server_info`` is its deprecated alias)."""
        return await self.request("GET", "/server_info")

    async def weight_version(self) -> str:
        """The served weight version: ``/model_info``'s ``weight_version`` (SGLang 0.5.23 has no
        ``/get_weight_version``)."""
        return str((await self.request("GET", "/model_info"))["weight_version"])

    async def begin_weight_update(self, selector: str = "all", timeout_s: Optional[float] = None) -> dict:
        """Open SGLang 0.5.23's weight-update session (``BeginWeightUpdateReqInput``)."""
        return _checked(self, "/begin_weight_update", await self.request(
            "POST", "/begin_weight_update", {"selector": selector}, timeout_s=timeout_s, retry=False))

    async def end_weight_update(self, timeout_s: Optional[float] = None) -> dict:
        """Close the session (``EndWeightUpdateReqInput`` has no fields)."""
        return _checked(self, "/end_weight_update", await self.request(
            "POST", "/end_weight_update", {}, timeout_s=timeout_s, retry=False))

    # ------------------------------------------------------------------ control
    async def pause_generation(self, mode: str = "in_place") -> dict:
        """Pause; ``in_place`` keeps in-flight requests with their KV cache, ``retract`` puts them
        back in the queue, ``abort`` ends them (``PauseGenerationReqInput.mode``)."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode {mode!r}: use 'in_place', 'retract' or 'abort'")
        return await self.request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict:
        return await self.request("POST", "/continue_generation", {})

    async def loads(self) -> dict:
        """GET /v1/loads: the engine's load snapshot (``loads[0]`` of SGLang 0.5.23's answer,
        ``entrypoints/v1_loads.py``): num_running_reqs, num_waiting_reqs, num_used_tokens, ..."""
        out = await self.request("GET", "/v1/loads", retry=False)
        loads = out.get("loads") if isinstance(out, dict) else None
        if not loads:
            raise EngineError(self.base_url, "/v1/loads", f"no load snapshot in the answer: {out!r}")
        return loads[0]

    async def slow_down(self, forward_sleep_time: Optional[float]) -> None:
        """POST /slow_down (SGLang's testing hook): sleep this long before each forward; None = off."""
        await self.request("POST", "/slow_down", {"forward_sleep_time": forward_sleep_time}, retry=False)

    async def flush_cache(self) -> bool:
        """True when flushed; False when the engine refused (requests still running)."""
        try:
            await self.request("POST", "/flush_cache", timeout_s=self.control_timeout_s, retry=False,
                               expect_json=False)
            return True
        except EngineError as e:
            if e.status == 400:
                return False
            raise

    async def update_weights_from_disk(self, model_path: str, *, weight_version: Optional[str] = None,
                                       load_format: Optional[str] = None, abort_all_requests: bool = False,
                                       flush_cache: bool = True, timeout_s: Optional[float] = None) -> dict:
        payload = {"model_path": model_path, "load_format": load_format,
                   "abort_all_requests": abort_all_requests, "weight_version": weight_version,
                   "flush_cache": flush_cache}
        return _checked(self, "/update_weights_from_disk", await self.request(
            "POST", "/update_weights_from_disk", payload, timeout_s=timeout_s, retry=False))

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, *, group_name: str = "weight_update_group",
                                        backend: str = "nccl", timeout_s: Optional[float] = None) -> dict:
        payload = {"master_address": master_address, "master_port": int(master_port),
                   "rank_offset": int(rank_offset), "world_size": int(world_size),
                   "group_name": group_name, "backend": backend}
        return _checked(self, "/init_weights_update_group", await self.request(
            "POST", "/init_weights_update_group", payload, timeout_s=timeout_s, retry=False))

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              *, group_name: str = "weight_update_group",
                                              weight_version: Optional[str] = None, flush_cache: bool = True,
                                              load_format: Optional[str] = None,
                                              abort_all_requests: bool = False,
                                              timeout_s: Optional[float] = None) -> dict:
        payload = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                   "flush_cache": flush_cache, "abort_all_requests": abort_all_requests,
                   "weight_version": weight_version, "load_format": load_format}
        return _checked(self, "/update_weights_from_distributed", await self.request(
            "POST", "/update_weights_from_distributed", payload, timeout_s=timeout_s, retry=False))

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self.request("POST", "/destroy_weights_update_group", {"group_name": group_name},
                                  retry=False)

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict:
        return await self.request("POST", "/update_weight_version",
                                  {"new_version": str(new_version), "abort_all_requests": abort_all_requests})

    # ------------------------------------------------------------------ colocated mode
    async def release_memory_occupation(self, tags: Optional[Sequence[str]] = None,
                                        timeout_s: Optional[float] = None) -> None:
        """POST /release_memory_occupation {tags} (0.5.23 ``ReleaseMemoryOccupationReqInput``; the
        scheduler's ``release_memory_occupation`` in ``managers/scheduler_components/weight_updater.py``).

        ``tags``: ``"weights"``, ``"kv_cache"``, ``"cuda_graph"``; None = all. Only an engine started
        with ``--enable-memory-saver`` frees anything. SGLang asserts the engine is idle (nothing
        running; nothing waiting unless paused with ``retract``) and flushes the radix cache with
        ``kv_cache``; releasing a tag twice, or a busy engine, kills its scheduler: never retried."""
        await self.request("POST", "/release_memory_occupation", {"tags": _memory_tags(tags)},
                           timeout_s=timeout_s, retry=False)

    async def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None,
                                       timeout_s: Optional[float] = None) -> None:
        """POST /resume_memory_occupation {tags}: map the released memory again (None = all tags).
        Resuming a tag that is not released kills SGLang's scheduler (``KeyError``): never retried.
        Weights come back with their old content only with ``--enable-weights-cpu-backup``; without
        it push the weights (:meth:`update_weights_from_tensor`) before generating."""
        await self.request("POST", "/resume_memory_occupation", {"tags": _memory_tags(tags)},
                           timeout_s=timeout_s, retry=False)

    async def update_weights_from_tensor(self, serialized_named_tensors: Sequence[str | bytes], *,
                                         load_format: Optional[str] = None, flush_cache: bool = True,
                                         weight_version: Optional[str] = None, abort_all_requests: bool = False,
                                         timeout_s: Optional[float] = None) -> dict:
        """POST /update_weights_from_tensor (0.5.23 ``UpdateWeightsFromTensorReqInput``).

        ``serialized_named_tensors``: one ``MultiprocessingSerializer`` payload per engine TP rank
        (``ForkingPickler`` bytes: CUDA IPC handles on GPUs), as base64 strings (bytes are encoded
        here); ``load_format`` None (a list of ``(name, tensor)``) or ``"flattened_bucket"``
        (``{"flattened_tensor", "metadata"}``). Like the distributed update it must run inside a
        ``begin_weight_update`` / ``end_weight_update`` session, into resumed weights; with
        ``flush_cache`` it fails after loading when requests still run. Raises ``EngineError``
        when the engine reports failure; never retried (the engine may have loaded part)."""
        payload = {"serialized_named_tensors": [p if isinstance(p, str) else base64.b64encode(p).decode("ascii")
                                                for p in serialized_named_tensors],
                   "load_format": load_format, "flush_cache": flush_cache, "weight_version": weight_version,
                   "abort_all_requests": abort_all_requests}
        return _checked(self, "/update_weights_from_tensor", await self.request(
            "POST", "/update_weights_from_tensor", payload, timeout_s=timeout_s, retry=False))

    # ------------------------------------------------------------------ LoRA adapters
    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, pinned: bool = False,
                                timeout_s: Optional[float] = None) -> dict:
        """POST /load_lora_adapter (0.5.23 ``LoadLoRAAdapterReqInput``): a PEFT directory on the
        engine's file system under ``lora_name``. Needs ``--enable-lora``; refused (``EngineError``,
        400 with ``error_message``) for a name already loaded, a rank above ``--max-lora-rank`` or a
        target outside ``--lora-target-modules``. Returns ``LoRAUpdateOutput`` {success,
        error_message, loaded_adapters}. Never retried."""
        return _checked(self, "/load_lora_adapter", await self.request(
            "POST", "/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path, "pinned": bool(pinned)},
            timeout_s=timeout_s, retry=False))

    async def load_lora_adapter_from_tensors(self, lora_name: str, config_dict: dict,
                                             serialized_named_tensors: Sequence[str | bytes], *,
                                             pinned: bool = False, load_format: Optional[str] = None,
                                             added_tokens_config: Optional[dict] = None,
                                             timeout_s: Optional[float] = None) -> dict:
        """POST /load_lora_adapter_from_tensors (0.5.23 ``LoadLoRAAdapterFromTensorsReqInput``):
        ``config_dict`` is the adapter's ``adapter_config.json``; ``serialized_named_tensors`` one
        ``MultiprocessingSerializer`` payload of a dict ``{peft name: tensor}`` per engine TP rank
        (``load_format="flattened_bucket"``: a bucket), base64 (bytes are encoded here). The adapter's
        path is then ``__tensor__``: once unloaded it cannot be reloaded by name. Never retried."""
        payload = {"lora_name": lora_name, "config_dict": dict(config_dict), "pinned": bool(pinned),
                   "serialized_named_tensors": [p if isinstance(p, str) else base64.b64encode(p).decode("ascii")
                                                for p in serialized_named_tensors],
                   "load_format": load_format, "added_tokens_config": added_tokens_config}
        return _checked(self, "/load_lora_adapter_from_tensors", await self.request(
            "POST", "/load_lora_adapter_from_tensors", payload, timeout_s=timeout_s, retry=False))

    async def unload_lora_adapter(self, lora_name: str, *, timeout_s: Optional[float] = None) -> dict:
        """POST /unload_lora_adapter {lora_name}: new requests stop finding the name at once; the
        answer comes when no request uses the adapter any more (SGLang waits for them). Unknown
        name: ``EngineError`` (400). Never retried."""
        return _checked(self, "/unload_lora_adapter", await self.request(
            "POST", "/unload_lora_adapter", {"lora_name": lora_name}, timeout_s=timeout_s, retry=False))


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang 0.5.23 constants.py GPU_MEMORY_ALL_TYPES


def _memory_tags(tags: Optional[Sequence[str]]) -> Optional[list[str]]:
    """SGLang takes any tag and releases nothing for an unknown one: a typo is refused here instead."""
    if tags is None:
        return None
    if isinstance(tags, str) or any(t not in MEMORY_TAGS for t in tags):
        raise ValueError(f"memory tags {tags!r}: a list of {', '.join(MEMORY_TAGS)} (or None for all)")
    return list(tags)


def _checked(c: SGLangClient, route: str, out: Any) -> dict:
    if not isinstance(out, dict) or not out.get("success", False):
        raise EngineError(c.base_url, route, f"engine reported failure: {out}")
    return out
