"""A CPU inference worker that speaks the subset of SGLang 0.5.23's HTTP protocol we use.

    python -m megatron_m2po.rollout.cpu_worker --model-path DIR --host 127.0.0.1 --port 30000

Serves an HF transformers causal LM (float32, one torch thread) so the CPU default, CI and the
quick-start run the same client, router and weight-sync code as production SGLang. Routes and
JSON shapes follow SGLang (see ``client.py`` for the source files they were checked against):

- ``POST /generate`` -- ``input_ids`` (or ``text`` when the model dir has a tokenizer), a list of
  them for a batch, ``sampling_params`` {temperature, top_p, top_k, max_new_tokens,
  stop_token_ids, ignore_eos, sampling_seed}, ``return_logprob``, ``rid``. Returns
  ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "cached_tokens", "weight_version", "e2e_latency",
  "output_token_logprobs": [[logprob, token_id, null], ...]}}`` and, as SGLang 0.5.23
  (``utils/weight_versions.py`` ``add_weight_versions_to_meta_info``),
  ``meta_info["weight_versions"]`` = ``[{"version", "start", "end"}, ...]``: the weight version
  that sampled each run of output tokens (a partial rollout that spans an update has several).
- ``/health``, ``/health_generate``, ``/get_model_info`` (+ ``/model_info``),
  ``/get_server_info`` (+ ``/server_info``), ``/flush_cache``, ``/begin_weight_update``,
  ``/end_weight_update`` (no ``/get_weight_version``: 0.5.23 removed it),
  ``/abort_request``, ``/pause_generation`` {mode: abort | retract | in_place; SGLang's default
  is abort}, ``/continue_generation``, ``/update_weights_from_disk``,
  ``/init_weights_update_group``, ``/update_weights_from_distributed`` (per-tensor broadcasts,
  or one uint8 broadcast with ``load_format="flattened_bucket"``), ``/destroy_weights_update_group``,
  ``/update_weight_version``, ``/slow_down`` {forward_sleep_time} (sleep before each decode
  step; SGLang's testing hook), ``/v1/loads`` (``loads[0]``: num_running_reqs, num_waiting_reqs,
  num_used_tokens, ... plus ``num_generated_tokens``). sglang-router 0.3.2 probes ``/health``, ``/server_info`` and
  ``/model_info`` before it routes to a worker.

Log-probs (matches SGLang's sampler): the returned log-prob of a sampled token is
``log_softmax(logits / temperature)`` -- the temperature-scaled distribution *before* top-p /
top-k truncation (SGLang computes ``log(probs)`` from the same tensor it then truncates for
sampling). With ``temperature == 0`` (greedy) it is ``log_softmax(logits)``. With top_p < 1 the
sampled distribution is the truncated, renormalised one, so the returned value is not its
log-prob; the trainer recomputes with the same convention (docs/design.md §3, "Log-prob convention").

Scheduling: continuous batching. New requests are prefilled as a left-padded batch and merged
into the running batch's KV cache; every step decodes one token for each running sequence;
finished and aborted rows leave the batch. All model work (steps and weight loads) runs on one
executor thread, so a weight update lands between two decode steps, never inside one.
``pause_generation(mode=in_place)`` stops stepping; in-flight requests stay with their caches
and resume on ``continue_generation``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import glob
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch

from megatron_m2po.parallel.side_group import broadcast, destroy_side_group, new_side_group
from megatron_m2po.utils.hf_dir import iter_safetensors

log = logging.getLogger("m2po.cpu_worker")

_VERSION = "0.5.23"  # the SGLang version it emulates, in server_info's "version" as SGLang's __version__
_DEFAULT_GROUP = "weight_update_group"
_SUPPORTED_SAMPLING = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                       "ignore_eos", "sampling_seed", "skip_special_tokens", "no_stop_trim",
                       "spaces_between_special_tokens", "n", "stop", "min_p",
                       "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens"}
# Parameters we accept only at their neutral value (anything else would change log-probs silently).
_NEUTRAL = {"n": 1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
            "repetition_penalty": 1.0, "min_new_tokens": 0, "stop": None}


class RequestError(ValueError):
    """A bad request: answered with HTTP 400 and the message."""


@dataclass
class _Seq:
    rid: str
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_ids: frozenset
    generator: Optional[torch.Generator]
    future: asyncio.Future
    start: float = field(default_factory=time.time)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish: Optional[dict] = None
    aborted: bool = False


class _Batch:
    """Running rows: left-padded KV cache [B, H, L, D] per layer plus a [B, L] validity mask."""

    def __init__(self) -> None:
        self.seqs: list[_Seq] = []
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.pos = torch.zeros(0, dtype=torch.long)  # position of the next token per row
        self.last = torch.zeros(0, dtype=torch.long)  # token to feed next per row

    def __len__(self) -> int:
        return len(self.seqs)

    def keep(self, rows: list[int]) -> None:
        idx = torch.tensor(rows, dtype=torch.long)
        self.seqs = [self.seqs[i] for i in rows]
        if not rows:
            self.kv, self.mask = [], torch.zeros(0, 0, dtype=torch.long)
            self.pos = self.last = torch.zeros(0, dtype=torch.long)
            return
        mask = self.mask.index_select(0, idx)
        cols = mask.any(0).nonzero()
        first = int(cols[0]) if len(cols) else mask.shape[1]
        self.mask = mask[:, first:]
        self.kv = [(k.index_select(0, idx)[:, :, first:], v.index_select(0, idx)[:, :, first:])
                   for k, v in self.kv]
        self.pos, self.last = self.pos.index_select(0, idx), self.last.index_select(0, idx)

    def merge(self, other: "_Batch") -> None:
        if not len(self):
            self.__dict__.update(other.__dict__)
            return
        length = max(self.mask.shape[1], other.mask.shape[1])

        def lpad(t: torch.Tensor, dim: int) -> torch.Tensor:
            extra = length - t.shape[dim]
            if extra == 0:
                return t
            shape = list(t.shape)
            shape[dim] = extra
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        self.kv = [(torch.cat([lpad(k1, 2), lpad(k2, 2)]), torch.cat([lpad(v1, 2), lpad(v2, 2)]))
                   for (k1, v1), (k2, v2) in zip(self.kv, other.kv)]
        self.mask = torch.cat([lpad(self.mask, 1), lpad(other.mask, 1)])
        self.seqs += other.seqs
        self.pos = torch.cat([self.pos, other.pos])
        self.last = torch.cat([self.last, other.last])


def _cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


class Engine:
    """Model, scheduler and weight updates; the HTTP layer is in ``make_app``."""

    def __init__(self, model_path: str, *, max_running: int = 64, seed: int = 0,
                 weight_version: str = "default", dist_timeout_s: float = 300.0,
                 quantization: Optional[str] = None) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.model_path = model_path
        self.config = AutoConfig.from_pretrained(model_path)
        self.fp8 = None  # FP8 emulation (megatron_m2po.rollout.fp8.FakeQuantFP8) when serving FP8
        from megatron_m2po.rollout.fp8 import is_fp8_config
        fp8_ckpt = is_fp8_config(self.config)
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization={quantization!r}: the CPU worker supports only 'fp8'")
        if fp8_ckpt:
            # An FP8 checkpoint: build the float model, wrap it in modelopt fake quantisation,
            # then load weight + weight_scale pairs through the FP8 loader (load_weights).
            del self.config.quantization_config
            self.model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=torch.float32, attn_implementation="eager").eval()
        if fp8_ckpt or quantization == "fp8":
            from megatron_m2po.rollout.fp8 import FakeQuantFP8
            self.fp8 = FakeQuantFP8(self.model)  # a float checkpoint is quantised on load
            self.model = self.fp8.model.eval()
        if fp8_ckpt:
            self.load_from_disk(model_path)
        self.tokenizer = None
        if glob.glob(os.path.join(model_path, "tokenizer*")):
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None)
        self.eos_ids = frozenset([] if eos is None else ([eos] if isinstance(eos, int) else eos))
        self.context_len = int(getattr(self.config, "max_position_embeddings", 1 << 20))
        self.max_running = max_running
        self.weight_version = weight_version
        self.dist_timeout_s = dist_timeout_s
        self.generator = torch.Generator().manual_seed(seed)
        self.paused = False
        # SGLang's /slow_down (scheduler.py: ``forward_sleep_time``, slept before each forward).
        self.forward_sleep_time: Optional[float] = None
        self.waiting: list[_Seq] = []
        self.batch = _Batch()
        self.qlock = threading.Lock()
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")
        self.groups: dict[str, Any] = {}
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.wake: Optional[asyncio.Event] = None
        self.step_lock: Optional[asyncio.Lock] = None

    # ---------------------------------------------------------------- scheduler
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.wake, self.step_lock = asyncio.Event(), asyncio.Lock()
        self.loop_task = asyncio.create_task(self._run())

    async def run_model(self, fn, *args):
        return await self.loop.run_in_executor(self.executor, fn, *args)

    async def _run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            while True:
                async with self.step_lock:
                    if self.paused:
                        await self.run_model(self._evict_aborted)
                        break
                    with self.qlock:
                        idle = not self.waiting and not len(self.batch)
                    if idle:
                        break
                    if self.forward_sleep_time:
                        await asyncio.sleep(self.forward_sleep_time)
                    try:
                        await self.run_model(self._step)
                    except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
                        log.exception("step failed")
                        self._fail_all(f"worker step failed: {e}")

    def _resolve(self, seq: _Seq) -> None:
        def done() -> None:
            if not seq.future.done():
                seq.future.set_result(seq)
        self.loop.call_soon_threadsafe(done)

    def _fail_all(self, message: str) -> None:
        with self.qlock:
            seqs, self.waiting = self.batch.seqs + self.waiting, []
        self.batch = _Batch()
        for s in seqs:
            s.finish = {"type": "abort", "message": message}
            self._resolve(s)

    def _evict_aborted(self) -> None:
        with self.qlock:
            gone = [s for s in self.waiting if s.aborted]
            self.waiting = [s for s in self.waiting if not s.aborted]
        keep = [i for i, s in enumerate(self.batch.seqs) if not s.aborted]
        gone += [s for s in self.batch.seqs if s.aborted]
        if len(keep) != len(self.batch):
            self.batch.keep(keep)
        for s in gone:
            s.finish = s.finish or {"type": "abort", "message": "Abort request."}
            self._resolve(s)

    @torch.no_grad()
    def _step(self) -> None:
        self._evict_aborted()
        if len(self.batch):
            b = self.batch
            mask = torch.cat([b.mask, torch.ones(len(b), 1, dtype=torch.long)], 1)
            cache = self._make_cache(b.kv)
            out = self.model(input_ids=b.last[:, None], attention_mask=mask,
                             position_ids=b.pos[:, None], past_key_values=cache, use_cache=True)
            b.kv, b.mask = _cache_tensors(out.past_key_values), mask
            b.pos = b.pos + 1
            b.last = self._sample(b.seqs, out.logits[:, -1].float())
        with self.qlock:
            room = max(self.max_running - len(self.batch), 0)
            new, self.waiting = self.waiting[:room], self.waiting[room:]
        if new:
            self.batch.merge(self._prefill(new))
        finished = [i for i, s in enumerate(self.batch.seqs) if s.finish is not None]
        if finished:
            done = [self.batch.seqs[i] for i in finished]
            self.batch.keep([i for i in range(len(self.batch)) if self.batch.seqs[i].finish is None])
            for s in done:
                self._resolve(s)

    def _make_cache(self, kv):
        from transformers import DynamicCache
        return DynamicCache(ddp_cache_data=list(kv), config=self.config)

    def _prefill(self, seqs: list[_Seq]) -> _Batch:
        length = max(len(s.prompt) for s in seqs)
        ids = torch.zeros(len(seqs), length, dtype=torch.long)
        mask = torch.zeros(len(seqs), length, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, length - len(s.prompt):] = torch.tensor(s.prompt)
            mask[i, length - len(s.prompt):] = 1
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        b = _Batch()
        b.seqs, b.kv, b.mask = list(seqs), _cache_tensors(out.past_key_values), mask
        b.pos = torch.tensor([len(s.prompt) for s in seqs], dtype=torch.long)
        b.last = self._sample(seqs, out.logits[:, -1].float())
        return b

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> torch.Tensor:
        """One token per row; record its log-prob (SGLang convention, see module docstring)."""
        nxt = torch.empty(len(seqs), dtype=torch.long)
        for i, s in enumerate(seqs):
            row = logits[i]
            if s.temperature < 1e-6:
                logp = torch.log_softmax(row, -1)
                tok = int(torch.argmax(row))
            else:
                logp = torch.log_softmax(row / s.temperature, -1)
                probs = logp.exp()
                if s.top_p < 1.0 or 0 < s.top_k < row.numel():
                    p_sort, p_idx = probs.sort(descending=True)
                    csum = p_sort.cumsum(0)
                    p_sort = p_sort.clone()
                    if 0 < s.top_k < row.numel():
                        p_sort[s.top_k:] = 0.0
                    p_sort[(csum - p_sort) > s.top_p] = 0.0
                    j = torch.multinomial(p_sort, 1, generator=s.generator or self.generator)
                    tok = int(p_idx[j])
                else:
                    tok = int(torch.multinomial(probs, 1, generator=s.generator or self.generator))
            nxt[i] = tok
            s.output.append(tok)
            s.logprobs.append(float(logp[tok]))
            s.versions.append(self.weight_version)
            if tok in s.stop_ids:
                s.finish = {"type": "stop", "matched": tok}
            elif len(s.output) >= s.max_new_tokens or len(s.prompt) + len(s.output) >= self.context_len:
                s.finish = {"type": "length", "length": len(s.output)}
        return nxt

    # ---------------------------------------------------------------- requests
    def make_seq(self, input_ids: list[int], params: dict, rid: Optional[str]) -> _Seq:
        params = dict(params or {})
        unknown = set(params) - _SUPPORTED_SAMPLING
        if unknown:
            raise RequestError(f"sampling_params {sorted(unknown)} are not supported by the CPU worker")
        for k, neutral in _NEUTRAL.items():
            if params.get(k, neutral) not in (neutral, None) and not (k == "stop" and not params[k]):
                raise RequestError(f"sampling_params.{k}={params[k]!r} is not supported by the CPU "
                                   f"worker (only {neutral!r})")
        if not input_ids or not all(isinstance(t, int) for t in input_ids):
            raise RequestError("input_ids must be a non-empty list of ints")
        vocab = self.model.get_input_embeddings().weight.shape[0]
        if min(input_ids) < 0 or max(input_ids) >= vocab:
            raise RequestError(f"input_ids contain ids outside [0, {vocab})")
        if len(input_ids) >= self.context_len:
            raise RequestError(f"The input ({len(input_ids)} tokens) is longer than the model's "
                               f"context length ({self.context_len} tokens).")
        if params.get("max_new_tokens") is not None and len(input_ids) + int(params["max_new_tokens"]) > self.context_len:
            # SGLang 0.5.23 managers/tokenizer_manager.py _validate_one_request (no auto-truncate)
            mnt = int(params["max_new_tokens"])
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} "
                f"tokens. You requested a total of {len(input_ids) + mnt} tokens: {len(input_ids)} tokens "
                f"from the input messages and {mnt} tokens for the completion. Please reduce the number "
                f"of tokens in the input messages or the completion to fit within the limit.")
        temperature = float(params.get("temperature", 1.0))
        top_p, top_k = float(params.get("top_p", 1.0)), int(params.get("top_k", -1))
        max_new = int(params.get("max_new_tokens", 128))
        if temperature < 0 or not 0 < top_p <= 1 or max_new < 0:
            raise RequestError(f"bad sampling params: temperature={temperature} top_p={top_p} "
                               f"max_new_tokens={max_new}")
        stop = set(params.get("stop_token_ids") or [])
        if not params.get("ignore_eos", False):
            stop |= self.eos_ids
        seed = params.get("sampling_seed")
        gen = torch.Generator().manual_seed(int(seed)) if seed is not None else None
        return _Seq(rid=rid or uuid.uuid4().hex, prompt=list(input_ids), max_new_tokens=max_new,
                    temperature=temperature, top_p=top_p, top_k=top_k, stop_ids=frozenset(stop),
                    generator=gen, future=self.loop.create_future())

    async def generate_one(self, seq: _Seq, return_logprob: bool) -> dict:
        if seq.max_new_tokens == 0:
            seq.finish = {"type": "length", "length": 0}
        else:
            with self.qlock:
                self.waiting.append(seq)
            self.wake.set()
            await seq.future
        meta = {"id": seq.rid, "finish_reason": seq.finish, "prompt_tokens": len(seq.prompt),
                "weight_version": self.weight_version, "completion_tokens": len(seq.output),
                "cached_tokens": 0, "e2e_latency": time.time() - seq.start,
                "weight_versions": _version_spans(seq.versions, self.weight_version)}
        if return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(seq.logprobs, seq.output)]
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output, skip_special_tokens=True)
        return {"text": text, "output_ids": list(seq.output), "meta_info": meta}

    def abort(self, rid: Optional[str], abort_all: bool) -> int:
        n = 0
        with self.qlock:
            for s in self.waiting + self.batch.seqs:
                if abort_all or (rid and s.rid == rid):
                    s.aborted, n = True, n + 1
        self.wake.set()
        return n

    def load(self) -> dict:
        """Core fields of SGLang 0.5.23's ``LoadSnapshot`` (``managers/load_snapshot.py``)."""
        with self.qlock:
            running, waiting = list(self.batch.seqs), list(self.waiting)
        used = sum(len(s.prompt) + len(s.output) for s in running)
        return {"dp_rank": 0, "num_running_reqs": len(running), "num_waiting_reqs": len(waiting),
                "num_waiting_uncached_tokens": sum(len(s.prompt) for s in waiting),
                "num_used_tokens": used, "num_total_tokens": used, "num_active_tokens": used,
                "max_running_requests": self.max_running,
                # Not in SGLang: tokens sampled so far by the running requests (tests wait on it).
                "num_generated_tokens": sum(len(s.output) for s in running)}

    def busy(self) -> bool:
        with self.qlock:
            return bool(self.waiting) or len(self.batch) > 0

    # ---------------------------------------------------------------- weights
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the model in place (HF names); unknown names or shapes fail.

        FP8 engines take FP8 pairs (``.weight`` float8 + ``.weight_scale``) or float weights
        (quantised on load); see ``megatron_m2po/rollout/fp8.py``.
        """
        if self.fp8 is not None:
            named = self.fp8.convert(named)
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        bad, n = [], 0
        with torch.no_grad():
            for name, t in named:
                if name not in params:
                    if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                        continue
                    bad.append(f"{name} (unknown)")
                    continue
                if tuple(params[name].shape) != tuple(t.shape):
                    bad.append(f"{name} (shape {tuple(t.shape)} != {tuple(params[name].shape)})")
                    continue
                params[name].copy_(t.to(params[name].dtype))
                n += 1
        if bad:
            raise ValueError(f"{len(bad)} tensors do not fit the model: {bad[:8]}")
        return n

    def load_from_disk(self, path: str) -> int:
        n = self.load_weights(iter_safetensors(path))
        if self.fp8 is not None:
            self.fp8.check_complete()
        return n

    def init_group(self, req: dict) -> None:
        backend = req.get("backend", "nccl")
        if backend != "gloo":
            raise ValueError(f"backend={backend!r}: the CPU worker joins weight-update groups over "
                             "gloo only (set backend='gloo')")
        name = req.get("group_name", _DEFAULT_GROUP)
        if name in self.groups:
            raise ValueError(f"group {name!r} already exists; destroy it first")
        self.groups[name] = new_side_group("gloo", req["master_address"], int(req["master_port"]),
                                           rank=int(req["rank_offset"]), world_size=int(req["world_size"]),
                                           group_name=name, timeout_s=self.dist_timeout_s)

    def receive(self, req: dict) -> list[tuple[str, torch.Tensor]]:
        name = req.get("group_name", _DEFAULT_GROUP)
        if name not in self.groups:
            raise ValueError(f"group {name!r} not in {sorted(self.groups)}; call "
                             "/init_weights_update_group first")
        pg = self.groups[name]
        names, dtypes, shapes = req["names"], req["dtypes"], req["shapes"]
        tensors = [torch.empty(s, dtype=getattr(torch, d.replace("torch.", ""))) for d, s in zip(dtypes, shapes)]
        if req.get("load_format") == "flattened_bucket":
            flat = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8)
            broadcast(pg, flat, self.dist_timeout_s).wait()
            off = 0
            for t in tensors:
                nb = t.numel() * t.element_size()
                t.view(-1).view(torch.uint8).copy_(flat[off:off + nb])
                off += nb
        else:
            works = [broadcast(pg, t, self.dist_timeout_s) for t in tensors]
            for w in works:
                w.wait()
        return list(zip(names, tensors))


# -------------------------------------------------------------------- HTTP layer
def _version_spans(versions: list[str], current: str) -> list[dict]:
    """Per-token versions as SGLang 0.5.23's spans (``utils/weight_versions.py``
    ``compute_weight_version_spans`` + ``add_weight_versions_to_meta_info``): runs of one version
    ``{"version", "start", "end"}``; no output tokens -> one empty span of the current version."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans or [{"version": current, "start": 0, "end": 0}]


def make_app(engine: Engine):
    from aiohttp import web

    def ok(payload: dict, status: int = 200):
        return web.json_response(payload, status=status)

    async def body(request) -> dict:
        if not request.can_read_body:
            return {}
        try:
            data = await request.json()
        except json.JSONDecodeError as e:
            raise web.HTTPBadRequest(text=f"invalid JSON: {e}") from None
        return data or {}

    async def generate(request):
        req = await body(request)
        if req.get("stream"):
            return ok({"error": {"message": "stream=True is not supported by the CPU worker"}}, 400)
        if req.get("top_logprobs_num") or req.get("token_ids_logprob"):
            return ok({"error": {"message": "top_logprobs_num / token_ids_logprob are not supported"}}, 400)
        if req.get("logprob_start_len") not in (None, -1):
            # SGLang would return teacher-forced prompt log-probs from this position; refuse
            # rather than answer an empty input_token_logprobs.
            return ok({"error": {"message": "logprob_start_len (prompt log-probs) is not supported by the "
                                            "CPU worker"}}, 400)
        ids, text = req.get("input_ids"), req.get("text")
        if ids is None and text is not None:
            if engine.tokenizer is None:
                return ok({"error": {"message": "text input needs a tokenizer in the model dir; "
                                                "send input_ids"}}, 400)
            ids = ([engine.tokenizer.encode(t) for t in text] if isinstance(text, list)
                   else engine.tokenizer.encode(text))
        if ids is None:
            return ok({"error": {"message": "one of input_ids / text is required"}}, 400)
        batch = bool(ids) and isinstance(ids[0], list)
        items = ids if batch else [ids]
        params, rids, rlp = req.get("sampling_params"), req.get("rid"), req.get("return_logprob", False)
        try:
            seqs = []
            for i, item in enumerate(items):
                p = params[i] if isinstance(params, list) else params
                r = rids[i] if isinstance(rids, list) else (f"{rids}_{i}" if batch and rids else rids)
                seqs.append(engine.make_seq(item, p, r))
        except (RequestError, TypeError, ValueError) as e:
            return ok({"error": {"message": str(e)}}, 400)
        lps = rlp if isinstance(rlp, list) else [rlp] * len(seqs)
        outs = await asyncio.gather(*(engine.generate_one(s, bool(lp)) for s, lp in zip(seqs, lps)))
        return web.json_response(outs if batch else outs[0])

    async def health(request):
        return web.Response(status=200)

    async def health_generate(request):
        if engine.busy() or engine.paused:
            return web.Response(status=200)
        seq = engine.make_seq([0], {"max_new_tokens": 1, "temperature": 0.0}, f"HEALTH_CHECK_{time.time()}")
        try:
            await asyncio.wait_for(engine.generate_one(seq, False), 20)
        except asyncio.TimeoutError:
            return web.Response(status=503)
        return web.Response(status=200)

    def model_info():
        return {"model_path": engine.model_path, "tokenizer_path": engine.model_path if engine.tokenizer else None,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": engine.weight_version, "model_type": getattr(engine.config, "model_type", None),
                "architectures": getattr(engine.config, "architectures", None)}

    async def get_model_info(request):
        return ok(model_info())

    async def get_server_info(request):
        return ok({"model_path": engine.model_path, "tokenizer_path": model_info()["tokenizer_path"],
                   "tp_size": 1, "dp_size": 1, "pp_size": 1, "context_length": engine.context_len,
                   "max_running_requests": engine.max_running, "weight_version": engine.weight_version,
                   "quantization": "fp8" if engine.fp8 is not None else None,
                   "version": _VERSION, "engine": "m2po-cpu-worker", "internal_states": [{}]})

    async def flush_cache(request):
        if engine.busy():
            return web.Response(text="Cache not flushed: there are running or waiting requests.\n", status=400)
        return web.Response(text="Cache flushed.\n", status=200)

    async def abort_request(request):
        req = await body(request)
        engine.abort(req.get("rid"), bool(req.get("abort_all", False)))
        return web.Response(status=200)

    async def pause_generation(request):
        req = await body(request)
        mode = req.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return ok({"error": {"message": f"Invalid mode: {mode!r}. Expected one of "
                                            "['abort', 'retract', 'in_place']."}}, 400)
        async with engine.step_lock:  # returns only after the current step ends
            engine.paused = True
        if mode == "abort":
            engine.abort(None, True)
            await engine.run_model(engine._evict_aborted)
        return ok({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(request):
        engine.paused = False
        engine.wake.set()
        return ok({"message": "Generation continued successfully.", "status": "ok"})

    # SGLang 0.5.23 managers/scheduler_components/weight_updater.py: a weight-update session;
    # distributed updates outside it fail, begin inside one and end outside one fail (HTTP 400).
    session: dict = {"open": False}

    async def begin_weight_update(request):
        await body(request)
        if session["open"]:
            return ok({"success": False, "message": "a weight-update session is already open; "
                                                    "call end_weight_update() first"}, 400)
        session["open"] = True
        return ok({"success": True, "message": "Success"})

    async def end_weight_update(request):
        await body(request)
        if not session["open"]:
            return ok({"success": False, "message": "no weight-update session is open; "
                                                    "call begin_weight_update() first"}, 400)
        session["open"] = False
        return ok({"success": True, "message": "Success"})

    def flush_after_update(req: dict, success_msg: str):
        # weight_updater.py flush_cache_after_weight_update: flush_cache defaults to true and a
        # flush refused because requests run or wait fails the (already applied) update.
        if req.get("flush_cache", True) and engine.busy():
            return ok({"success": False, "message": "Weights were updated, but the cache was not flushed because "
                       "requests are still running or queued. Retract or finish them, then call /flush_cache."},
                      400)
        return None

    def set_version(v) -> None:
        if v is not None:
            engine.weight_version = str(v)

    async def update_from_disk(request):
        req = await body(request)
        if req.get("abort_all_requests"):
            engine.abort(None, True)
        path = req.get("model_path", "")
        try:
            await engine.run_model(engine.load_from_disk, path)
        except Exception as e:  # noqa: BLE001 - reported to the caller
            return ok({"success": False, "message": f"Failed to update weights: {e}.",
                       "num_paused_requests": 0}, 400)
        engine.model_path = path
        set_version(req.get("weight_version"))
        msg = "Succeeded to update model weights."
        if req.get("weight_version") is not None:
            msg += f" Weight version updated to {req['weight_version']}."
        refused = flush_after_update(req, msg)
        if refused is not None:
            return refused
        return ok({"success": True, "message": msg, "num_paused_requests": 0})

    # SGLang's scheduler runs one request at a time and its group set-up and broadcasts block it
    # (managers/communicator.py queues each kind; scheduler_components/weight_updater.py):
    # weight-update group requests are served one after another, never side by side.
    group_ops = asyncio.Lock()

    async def init_group(request):
        req = await body(request)
        try:
            async with group_ops:
                await asyncio.to_thread(engine.init_group, req)
        except Exception as e:  # noqa: BLE001
            return ok({"success": False, "message": f"Failed to initialize custom process group: {e}."}, 400)
        return ok({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_group(request):
        req = await body(request)
        name = req.get("group_name", _DEFAULT_GROUP)
        async with group_ops:
            pg = engine.groups.pop(name, None)
        if pg is None:
            return ok({"success": False, "message": f"group {name!r} does not exist"}, 400)
        destroy_side_group(pg)  # weight_updater.py: torch.distributed.destroy_process_group(pg)
        return ok({"success": True, "message": "Succeeded to destroy custom process group."})

    async def update_from_distributed(request):
        req = await body(request)
        if not session["open"]:
            return ok({"success": False, "message": "update_weights_from_distributed must run between "
                                                    "begin_weight_update() and end_weight_update()"}, 400)
        if req.get("abort_all_requests"):
            engine.abort(None, True)
        try:
            async with group_ops:
                named = await asyncio.to_thread(engine.receive, req)
                await engine.run_model(engine.load_weights, named)
        except Exception as e:  # noqa: BLE001
            return ok({"success": False, "message": f"Failed to update parameter online: {e}."}, 400)
        set_version(req.get("weight_version"))
        msg = "Succeeded to update parameter online."
        if req.get("weight_version") is not None:
            msg += f" Weight version updated to {req['weight_version']}."
        refused = flush_after_update(req, msg)
        if refused is not None:
            return refused
        return ok({"success": True, "message": msg})

    async def slow_down(request):
        # SGLang: SlowDownReqInput(forward_sleep_time: Optional[float]); None turns it off.
        req = await body(request)
        t = req.get("forward_sleep_time")
        if t is not None and (not isinstance(t, (int, float)) or t < 0):
            return ok({"error": {"message": f"forward_sleep_time must be a number >= 0 or null, got {t!r}"}}, 400)
        engine.forward_sleep_time = float(t) if t else None
        engine.wake.set()
        return ok({})

    async def v1_loads(request):
        # SGLang 0.5.23 entrypoints/v1_loads.py: per-DP-rank load snapshots.
        return ok({"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": _VERSION,
                   "accelerator": None, "num_accelerators": 1, "loads": [engine.load()]})

    async def update_weight_version(request):
        req = await body(request)
        if req.get("abort_all_requests"):
            engine.abort(None, True)
        set_version(req.get("new_version"))
        return ok({"success": True, "message": f"Weight version updated to {req.get('new_version')}",
                   "new_version": req.get("new_version")})

    # SGLang 0.5.23 http_server.py /get_weights_by_name (GetWeightsByNameReqInput {name,
    # truncate_size=100}) -> models/llama.py get_weights_by_name: the parameter as float32 nested
    # lists, its first truncate_size rows; a tied lm_head.weight answers with embed_tokens.weight;
    # an unknown name is a 400 {"error": {"message": "Get parameter by name failed"}}.
    def weights_by_name(name: str, truncate_size: int):
        params = dict(engine.model.named_parameters())
        if name == "lm_head.weight" and getattr(engine.config, "tie_word_embeddings", False):
            name = "model.embed_tokens.weight"
        if name not in params:
            return None
        return params[name].detach().to(torch.float32).numpy().tolist()[:truncate_size]

    async def get_weights_by_name(request):
        req = await body(request)
        out = await engine.run_model(weights_by_name, str(req.get("name", "")), int(req.get("truncate_size", 100)))
        if out is None:
            return ok({"error": {"message": "Get parameter by name failed"}}, 400)
        return ok(out)

    async def on_startup(app):
        await engine.start()

    app = web.Application(client_max_size=1 << 30)
    app.on_startup.append(on_startup)
    r = app.router
    r.add_route("POST", "/generate", generate)
    r.add_route("PUT", "/generate", generate)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    for p in ("/get_model_info", "/model_info"):
        r.add_get(p, get_model_info)
    for p in ("/get_server_info", "/server_info"):
        r.add_get(p, get_server_info)
    r.add_post("/begin_weight_update", begin_weight_update)
    r.add_post("/end_weight_update", end_weight_update)
    r.add_route("*", "/flush_cache", flush_cache)
    r.add_post("/abort_request", abort_request)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/update_weights_from_disk", update_from_disk)
    r.add_post("/init_weights_update_group", init_group)
    r.add_post("/destroy_weights_update_group", destroy_group)
    r.add_post("/update_weights_from_distributed", update_from_distributed)
    r.add_post("/update_weight_version", update_weight_version)
    r.add_route("GET", "/slow_down", slow_down)
    r.add_route("POST", "/slow_down", slow_down)
    r.add_get("/v1/loads", v1_loads)
    r.add_route("GET", "/get_weights_by_name", get_weights_by_name)
    r.add_route("POST", "/get_weights_by_name", get_weights_by_name)
    return app


class _DropH2Probe(logging.Filter):
    """sglang-router first tries HTTP/2 on each worker; aiohttp logs that probe as an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "PRI/Upgrade" not in record.getMessage() and "PRI/Upgrade" not in str(record.exc_info)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="HF model directory (config + safetensors).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-running-requests", type=int, default=64, help="Rows in the running batch.")
    p.add_argument("--seed", type=int, default=0, help="Seed of requests without sampling_seed.")
    p.add_argument("--weight-version", default="default", help="Initial weight version tag.")
    p.add_argument("--dist-timeout-s", type=float, default=300.0,
                   help="Timeout of weight-update group collectives.")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads.")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="Serve FP8 (modelopt fake quantisation); an FP8 checkpoint is detected from config.json.")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.model_path, "config.json")):
        p.error(f"--model-path {args.model_path!r} is not an HF model directory (no config.json)")
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.server").addFilter(_DropH2Probe())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    from aiohttp import web
    engine = Engine(args.model_path, max_running=args.max_running_requests, seed=args.seed,
                    weight_version=args.weight_version, dist_timeout_s=args.dist_timeout_s,
                    quantization=args.quantization)
    log.info("serving %s on http://%s:%d", args.model_path, args.host, args.port)
    web.run_app(make_app(engine), host=args.host, port=args.port, print=None, access_log=None,
                shutdown_timeout=2.0)


if __name__ == "__main__":
    main()
