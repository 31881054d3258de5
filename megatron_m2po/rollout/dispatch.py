"""Client-side dispatch of ``/generate`` over several engines, without sglang-router.

Why: the pinned sglang-router 0.3.2 re-serialises ``/generate`` from a typed request that has no
``return_routed_experts`` (measured: the router binary has no such string), so behind it the
engines never see the field and MoE routing replay gets no routed experts. With
``rollout.use_router=false`` the trainer talks to the engines itself through a
:class:`DispatchClient`; the request body reaches SGLang 0.5.23 unchanged.

Policy (close to what users get from the router's ``cache_aware`` policy where it matters):

- **Affinity.** Requests that carry the same ``affinity`` key (the producers pass the group id:
  every sample of a prompt group and every turn of its agentic episodes) go to the engine the key
  was first given to, so SGLang's radix cache reuses the shared prompt. A key is given to the
  engine with the fewest in-flight requests when first seen; the map is bounded (least recently
  used keys are forgotten). A key whose engine is down or gone is given to another engine.
- **Least in-flight.** A request without a key goes to the up engine with the fewest in-flight
  requests (ties: the one sent the fewest so far, then fleet order: round robin when idle).
- **Balance.** As the router's ``cache_aware`` policy does past its default thresholds
  (``balance_abs_threshold=64``, ``balance_rel_threshold=1.5``), a key whose engine has more than
  64 and 1.5x the in-flight requests of the least busy up engine is given to that one instead.
- **Per-engine concurrency.** Each engine has its own bound on in-flight requests (the fleet's
  :meth:`~megatron_m2po.rollout.engines.EngineFleet.dispatch_limits`: what the engine reports it
  can run, or ``rollout.concurrency`` split over the engines). A request waits for a free slot of
  its engine; a keyed request waits for its own engine (the prefix cache is worth more than a
  slot elsewhere), as the router's cache-aware policy prefers the matching worker.
- **Failures.** A connection error or an HTTP 5xx marks the engine down: it gets no new requests
  and the request is retried on another engine (the same retry budget and backoff as
  :meth:`SGLangClient._generate_with_retry`: ``max_retries`` retries). A 4xx is raised (the request
  is wrong); a timed-out or cancelled request is aborted on its engine. When every engine is down
  the down ones are tried again (they may be back). :meth:`set_engines` (the fleet announces its
  engines on start, every restart check and admission) replaces the set and clears the down marks of
  the engines it lists: they were just checked healthy.
- **Fleet-wide calls** (abort, pause / continue, flush_cache, weight version, health, loads,
  server info, disk weight updates, memory release / resume, LoRA adapter loads and unloads) go to every
  engine; an abort of one ``rid`` goes to the engine
  that runs it. Distributed weight updates need a rank offset per engine: use
  :class:`~megatron_m2po.weights.distributed.DistributedWeightSync` with the fleet's engine URLs.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import aiohttp

from megatron_m2po.rollout.client import (RETRY_STATUS, EngineError, GenerateOutput, SGLangClient,
                                          log_abort_failure, max_running_requests, timeout_message)

log = logging.getLogger("m2po.dispatch")

MAX_AFFINITY_KEYS = 65536


@dataclass
class _Slot:
    url: str
    limit: int
    inflight: int = 0
    down: bool = False
    sent: int = 0  # requests sent to it (metrics, tests)


class DispatchClient(SGLangClient):
    """An :class:`SGLangClient` over several engines (module docstring: the policy).

    Example::

        async with DispatchClient({"http://a:30000": 64, "http://b:30000": 64}) as c:
            out = await c.generate(ids, params, affinity="step3/g0")   # group g0 sticks to one engine
            await c.pause_generation(); ...; await c.continue_generation()   # every engine

    ``engines``: ``{url: max in-flight requests}`` (a sequence of URLs: ``concurrency`` split over
    them). Use one client per event loop; :meth:`set_engines` on that loop.
    """

    def __init__(self, engines: Mapping[str, int] | Sequence[str], *, concurrency: int = 64,
                 timeout_s: float = 600.0, max_retries: int = 3, backoff_s: float = 0.5,
                 control_timeout_s: float = 60.0, max_affinity_keys: int = MAX_AFFINITY_KEYS,
                 adapter: Optional[Callable[[], Optional[tuple[str, int]]]] = None) -> None:
        limits = dict(engines) if isinstance(engines, Mapping) else split_limits(list(engines), concurrency)
        if not limits:
            raise ValueError("DispatchClient: no engines; pass {url: max in-flight requests}")
        self._slots: dict[str, _Slot] = {}
        super().__init__(next(iter(limits)), concurrency=max(1, sum(limits.values())), timeout_s=timeout_s,
                         max_retries=max_retries, backoff_s=backoff_s, control_timeout_s=control_timeout_s,
                         adapter=adapter)
        self._apply(limits)
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._max_keys = max_affinity_keys
        self._owner: dict[str, str] = {}  # rid -> engine url of in-flight requests
        self._cond: Optional[asyncio.Condition] = None
        self._clients: dict[str, SGLangClient] = {}

    # ------------------------------------------------------------------ engines
    @property
    def engine_urls(self) -> list[str]:  # type: ignore[override]
        return list(self._slots)

    @engine_urls.setter
    def engine_urls(self, _value) -> None:  # the base class assigns it; the slots are the truth here
        pass

    def engine_stats(self) -> dict[str, dict]:
        """``{url: {limit, inflight, down, sent}}`` now."""
        return {u: {"limit": s.limit, "inflight": s.inflight, "down": s.down, "sent": s.sent}
                for u, s in self._slots.items()}

    def engine_of(self, affinity: str) -> Optional[str]:
        """The engine the key ``affinity`` is given to (None: not seen, or forgotten)."""
        return self._affinity.get(affinity)

    def _apply(self, limits: Mapping[str, int]) -> None:
        new = {}
        for url, limit in limits.items():
            if int(limit) < 1:
                raise ValueError(f"DispatchClient: engine {url} limit {limit}: must be >= 1")
            u = url.rstrip("/")
            # the same slot object: requests in flight release the slot they took
            slot = self._slots.get(u) or _Slot(u, int(limit))
            slot.limit, slot.down = int(limit), False
            new[u] = slot
        self._slots = new
        self.base_url = next(iter(new))
        self.concurrency = sum(s.limit for s in new.values())

    async def set_engines(self, limits: Mapping[str, int]) -> None:
        """The fleet's engines now (``{url: limit}``): new ones get requests, gone ones none (their
        in-flight requests finish), listed ones are up again. Call on the client's event loop."""
        if not limits:
            raise ValueError("DispatchClient.set_engines: no engines")
        gone = [u for u in self._slots if u not in {k.rstrip("/") for k in limits}]
        joined = [k.rstrip("/") for k in limits if k.rstrip("/") not in self._slots]
        self._apply(limits)
        for k in [k for k, u in self._affinity.items() if u in gone]:
            del self._affinity[k]
        if gone:
            log.info("engines left the dispatch set: %s", ", ".join(gone))
        if joined:
            log.info("engines joined the dispatch set: %s", ", ".join(joined))
        await self._notify()

    async def set_concurrency(self, concurrency: int) -> None:
        """Split ``concurrency`` over the current engines (:func:`split_limits`)."""
        if concurrency < 1:
            raise ValueError(f"DispatchClient.set_concurrency({concurrency}): must be >= 1")
        for url, limit in split_limits(list(self._slots), concurrency).items():
            self._slots[url].limit = limit
        self.concurrency = concurrency
        await self._notify()

    async def _notify(self) -> None:
        if self._cond is not None:
            async with self._cond:
                self._cond.notify_all()

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def _pick(self, affinity: Optional[str]) -> tuple[Optional[_Slot], bool]:
        """(engine for this request or None to wait, whether it has a free slot)."""
        up = [s for s in self._slots.values() if not s.down] or list(self._slots.values())
        if affinity is not None:
            url = self._affinity.get(affinity)
            s = self._slots.get(url) if url else None
            if s is not None and (not s.down or s in up) and not _imbalanced(s, up):
                self._affinity.move_to_end(affinity)
                return s, s.inflight < s.limit
        free = [s for s in up if s.inflight < s.limit]
        if not free:
            return None, False
        best = min(free, key=lambda s: (s.inflight, s.sent))  # ties: fewest sent so far (round robin)
        if affinity is not None:
            self._affinity[affinity] = best.url
            self._affinity.move_to_end(affinity)
            while len(self._affinity) > self._max_keys:
                self._affinity.popitem(last=False)
        return best, True

    async def _acquire(self, affinity: Optional[str]) -> _Slot:
        async with self._condition():
            while True:
                slot, free = self._pick(affinity)
                if slot is not None and free:
                    slot.inflight += 1
                    slot.sent += 1
                    return slot
                await self._cond.wait()

    async def _release(self, slot: _Slot) -> None:
        async with self._condition():
            slot.inflight -= 1
            self._cond.notify_all()

    async def _mark_down(self, slot: _Slot, why: str) -> None:
        if not slot.down and slot.url in self._slots:
            log.warning("engine %s marked down (%s): no new requests until the fleet lists it again", slot.url, why)
        slot.down = True
        await self._notify()

    # ------------------------------------------------------------------ generation
    async def generate(self, input_ids: Sequence[int], sampling_params: dict, return_logprob: bool = True,
                       *, rid: Optional[str] = None, return_routed_experts: bool = False,
                       routed_experts_start_len: int = 0, affinity: Optional[str] = None,
                       lora_path: Optional[str] = None, logprob_start_len: int = -1) -> GenerateOutput:
        """:meth:`SGLangClient.generate` on the engine the policy picks; ``affinity`` (e.g. the group
        id) keeps requests with the same key on one engine."""
        payload, adapter_version = self._generate_request(input_ids, sampling_params, return_logprob, rid,
                                                          return_routed_experts, routed_experts_start_len, lora_path,
                                                          logprob_start_len)
        rid = payload["rid"]
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * (2 ** (attempt - 1)) * (0.5 + random.random()))
            slot = await self._acquire(affinity)
            self._owner[rid] = slot.url
            try:
                async with self._sess().post(slot.url + "/generate", json=payload, timeout=timeout) as r:
                    text = await r.text()
                    if r.status in RETRY_STATUS:
                        last = f"{slot.url}: HTTP {r.status}: {text[:300]}"
                        await self._mark_down(slot, f"HTTP {r.status}")
                        continue
                    if r.status >= 400:
                        raise EngineError(slot.url, "/generate", text[:2000], r.status)
                    out = await r.json(content_type=None)
                    if slot.down:  # it answered: back in service
                        slot.down = False
                    return self._tagged(GenerateOutput.from_json(out), adapter_version)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                last = f"{slot.url}: {type(e).__name__}: {e}"
                await self._mark_down(slot, type(e).__name__)
            except asyncio.TimeoutError:
                await self._abort_on(slot.url, rid)
                raise EngineError(slot.url, "/generate", timeout_message(self.timeout_s)) from None
            except asyncio.CancelledError:
                await self._abort_on(slot.url, rid)
                raise
            finally:
                self._owner.pop(rid, None)
                await asyncio.shield(self._release(slot))
        raise EngineError(self.base_url, "/generate", f"failed after {self.max_retries + 1} attempt(s) over "
                          f"{len(self._slots)} engine(s): {last}")

    async def _abort_on(self, url: str, rid: str) -> None:
        try:
            await asyncio.shield(self._post_abort(url, {"rid": rid, "abort_all": False}, 5))
        except (EngineError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            log_abort_failure(url, rid, e)
        except asyncio.CancelledError:
            pass

    # ------------------------------------------------------------------ every engine
    async def abort(self, rid: Optional[str] = None, *, abort_all: bool = False,
                    timeout_s: Optional[float] = None) -> list[str]:
        """``/abort_request`` on the engine running ``rid`` (every engine when unknown or ``abort_all``);
        returns the URLs that took it. Raises ``EngineError`` naming the engines it did not reach."""
        payload = {"rid": rid or "", "abort_all": abort_all}
        owner = None if abort_all or not rid else self._owner.get(rid)
        urls = [owner] if owner else list(self._slots)
        res = await asyncio.gather(*(self._post_abort(u, payload, timeout_s) for u in urls), return_exceptions=True)
        failed = [f"{u}: {r}" for u, r in zip(urls, res) if isinstance(r, BaseException)]
        if failed:
            raise EngineError(self.base_url, "/abort_request", "abort not delivered to " + "; ".join(failed))
        return urls

    def client_for(self, url: str) -> SGLangClient:
        """A plain client of one engine of the set (shares nothing with the dispatch)."""
        url = url.rstrip("/")
        if url not in self._clients:
            self._clients[url] = SGLangClient(url, max_retries=self.max_retries, backoff_s=self.backoff_s,
                                              control_timeout_s=self.control_timeout_s, timeout_s=self.timeout_s)
        return self._clients[url]

    async def _each(self, method: str, *args, **kwargs) -> dict[str, Any]:
        """``{url: client_for(url).method(...)}`` over every engine; raises the first failure, naming it."""
        urls = list(self._slots)
        res = await asyncio.gather(*(getattr(self.client_for(u), method)(*args, **kwargs) for u in urls),
                                   return_exceptions=True)
        for u, r in zip(urls, res):
            if isinstance(r, BaseException):
                if isinstance(r, EngineError):
                    raise r
                raise EngineError(u, f" ({method})", f"{type(r).__name__}: {r}") from r
        return dict(zip(urls, res))

    async def request(self, method: str, route: str, payload: Any = None, **kw) -> Any:
        """Not one engine: a call that has no fleet-wide meaning here is refused."""
        raise EngineError(self.base_url, route, f"DispatchClient has no single engine for {method} {route}; use "
                          "client_for(url) for one engine, or the fleet-wide methods")

    async def health(self, timeout_s: float = 5.0) -> bool:
        return all((await self._each("health", timeout_s)).values())

    async def health_generate(self, timeout_s: float = 30.0) -> bool:
        return all((await self._each("health_generate", timeout_s)).values())

    async def get_model_info(self) -> dict:
        """The first engine's ``/model_info`` (every engine serves the same model);
        :meth:`weight_version` checks the versions of all."""
        return await self.client_for(self.base_url).get_model_info()

    async def get_server_info(self) -> dict[str, dict]:  # type: ignore[override]
        """``{url: /server_info}`` of every engine."""
        return await self._each("get_server_info")

    async def fleet_max_running(self) -> dict[str, Optional[int]]:
        return {u: max_running_requests(i) for u, i in (await self.get_server_info()).items()}

    async def weight_version(self) -> str:
        """The version every engine serves; ``EngineError`` naming them when they differ."""
        got = await self._each("weight_version")
        if len(set(got.values())) != 1:
            raise EngineError(self.base_url, "/model_info", "engines serve different weight versions: "
                              + ", ".join(f"{u}={v}" for u, v in got.items()))
        return next(iter(got.values()))

    async def loads(self) -> dict:
        """The engines' ``/v1/loads`` snapshots, integer fields summed."""
        out: dict[str, int] = {}
        for snap in (await self._each("loads")).values():
            for k, v in snap.items():
                if isinstance(v, int) and not isinstance(v, bool):
                    out[k] = out.get(k, 0) + v
        return out

    async def pause_generation(self, mode: str = "in_place") -> dict:  # type: ignore[override]
        return await self._each("pause_generation", mode)

    async def continue_generation(self) -> dict:  # type: ignore[override]
        return await self._each("continue_generation")

    async def flush_cache(self) -> bool:
        return all((await self._each("flush_cache")).values())

    async def slow_down(self, forward_sleep_time: Optional[float]) -> None:
        await self._each("slow_down", forward_sleep_time)

    async def update_weights_from_disk(self, model_path: str, **kw) -> dict:  # type: ignore[override]
        return await self._each("update_weights_from_disk", model_path, **kw)

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict:
        return await self._each("update_weight_version", new_version, abort_all_requests)

    async def begin_weight_update(self, selector: str = "all", timeout_s: Optional[float] = None) -> dict:
        return await self._each("begin_weight_update", selector, timeout_s)

    async def end_weight_update(self, timeout_s: Optional[float] = None) -> dict:
        return await self._each("end_weight_update", timeout_s)

    async def init_weights_update_group(self, *a, **kw) -> dict:
        raise EngineError(self.base_url, "/init_weights_update_group", "each engine needs its own rank_offset: use "
                          "DistributedWeightSync(fleet.engine_urls) (weights/distributed.py)")

    async def update_weights_from_distributed(self, *a, **kw) -> dict:
        raise EngineError(self.base_url, "/update_weights_from_distributed", "use DistributedWeightSync"
                          "(fleet.engine_urls) (weights/distributed.py): the groups are per engine")

    async def release_memory_occupation(self, tags: Optional[Sequence[str]] = None,
                                        timeout_s: Optional[float] = None) -> None:
        await self._each("release_memory_occupation", tags, timeout_s)

    async def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None,
                                       timeout_s: Optional[float] = None) -> None:
        await self._each("resume_memory_occupation", tags, timeout_s)

    async def update_weights_from_tensor(self, *a, **kw) -> dict:
        raise EngineError(self.base_url, "/update_weights_from_tensor", "each engine takes the handles of the "
                          "trainer ranks on its own GPUs: call client_for(url).update_weights_from_tensor per engine")

    async def load_lora_adapter(self, lora_name: str, lora_path: str, **kw) -> dict:  # type: ignore[override]
        """Every engine loads the adapter (a path each engine can read); ``{url: LoRAUpdateOutput}``."""
        return await self._each("load_lora_adapter", lora_name, lora_path, **kw)

    async def load_lora_adapter_from_tensors(self, lora_name: str, config_dict: dict,  # type: ignore[override]
                                             serialized_named_tensors, **kw) -> dict:
        """Every engine loads the same payloads: they must be readable by each (CPU tensors in shared
        memory of one node); engines that need their own: ``client_for(url)`` per engine."""
        return await self._each("load_lora_adapter_from_tensors", lora_name, config_dict, serialized_named_tensors,
                                **kw)

    async def unload_lora_adapter(self, lora_name: str, **kw) -> dict:  # type: ignore[override]
        return await self._each("unload_lora_adapter", lora_name, **kw)

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close()
        self._clients.clear()
        await super().close()


# sglang-router 0.3.2's cache_aware defaults (sglang_router/router_args.py: balance_abs_threshold=64,
# balance_rel_threshold=1.5): past both, the router sends to the least loaded worker, cache or not.
BALANCE_ABS, BALANCE_REL = 64, 1.5


def _imbalanced(slot: _Slot, up: list[_Slot]) -> bool:
    """The key's engine is so much busier than the least busy one that the router would balance."""
    least = min(s.inflight for s in up)
    return slot.inflight - least > BALANCE_ABS and slot.inflight > least * BALANCE_REL


def split_limits(urls: Sequence[str], total: int) -> dict[str, int]:
    """``total`` in-flight requests split over ``urls`` as evenly as integers allow (the first
    ``total % n`` get one more), at least one each."""
    n = len(urls)
    if n == 0:
        return {}
    return {u.rstrip("/"): max(1, total // n + (1 if i < total % n else 0)) for i, u in enumerate(urls)}
