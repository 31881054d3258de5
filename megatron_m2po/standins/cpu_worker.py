"""A CPU inference worker that speaks SGLang 0.5.23's HTTP protocol, refusals included.

    python -m megatron_m2po.standins.cpu_worker --model-path DIR --host 127.0.0.1 --port 30000

Serves an HF transformers causal LM (float32, one torch thread) so the CPU default, CI and the
quick-start run the same client, router and weight-sync code as production SGLang. The routes
are in ``cpu_worker_http.py``, the per-request sampling rules in ``sglang_sampling.py``; every
rule cites the SGLang 0.5.23 source it follows (``docs/sglang.md`` has the map).

- ``POST /generate`` -- ``input_ids`` (or ``text`` when the model dir has a tokenizer), a list of
  them for a batch; ``sampling_params`` (SGLang's JSON contract: unknown keys are a 400): stop
  strings / stop_token_ids / ignore_eos / no_stop_trim, temperature, top_p, top_k, min_p,
  frequency / presence / repetition penalties, min_new_tokens, ``n`` (a list of n samples under
  new rids), sampling_seed, custom_params (accepted; there is no custom logit processor, so
  ``custom_logit_processor`` is SGLang's 400); ``return_logprob`` with ``logprob_start_len``
  (``meta_info.input_token_logprobs`` ``[[logprob | null, id, text | null], ...]``);
  ``stream`` (server-sent events). Returns ``{"text", "output_ids", "meta_info": {"id",
  "finish_reason", "prompt_tokens", "completion_tokens", "weight_version", "weight_versions":
  [{"version", "start", "end"}, ...], "output_token_logprobs", ...}}`` -- the spans give the
  weight version that sampled each run of output tokens (``utils/weight_versions.py``).
  Grammars, beam search, watermarks, logit bias and top-logprobs are a 400 naming the field.
- Weight-update groups: the worker plays an SGLang engine with the m2po plugin installed
  (``rollout/sglang_plugin.py``: it states its NCCL version in each new group's store;
  ``M2PO_STANDIN_ENGINE_PLUGIN=0`` plays one without it) and, on gloo, fails a group's first
  broadcast as NCCL fails a communicator of two builds (``standins/nccl_emulation.py``; its version
  is ``M2PO_STANDIN_ENGINE_NCCL_VERSION``).
- ``/health`` = ``/health_generate`` (a one-token generation; 503 when no scheduler message
  arrives within ``SGLANG_HEALTH_CHECK_TIMEOUT`` s -- the case while paused), ``/ready`` (503
  while paused), ``/model_info`` (+ ``/get_model_info``), ``/server_info`` (+
  ``/get_server_info``), ``/flush_cache`` (400 unless idle; waiting requests do not count while
  the scheduler is paused), ``/abort_request`` {rid (prefix match), abort_all},
  ``/pause_generation`` {mode: abort (default) | retract | in_place}, ``/continue_generation``,
  ``/begin_weight_update`` / ``/end_weight_update`` (the session distributed updates need),
  ``/update_weights_from_disk``, ``/init_weights_update_group``,
  ``/update_weights_from_distributed`` (per-tensor broadcasts, or one uint8 broadcast with
  ``load_format="flattened_bucket"``), ``/destroy_weights_update_group``,
  ``/update_weight_version``, ``/slow_down`` {forward_sleep_time} (SGLang's testing hook),
  colocated mode's ``/release_memory_occupation`` / ``/resume_memory_occupation`` {tags} (with
  ``--enable-memory-saver`` the weights' storages really leave; ``--enable-weights-cpu-backup``
  brings them back bit-identical; a generation while released is refused) and
  ``/update_weights_from_tensor`` (shared-memory tensors standing in for CUDA IPC):
  ``cpu_memory_saver.py``, ``tensor_payload.py``, ``cpu_worker_colocated.py``,
  ``/v1/loads`` (``loads[0]``: num_running_reqs, num_waiting_reqs, num_used_tokens, ... plus
  ``num_generated_tokens`` and ``num_held_reqs``), LoRA (``--enable-lora``; ``/load_lora_adapter``,
  ``/load_lora_adapter_from_tensors``, ``/unload_lora_adapter``, ``/generate``'s ``lora_path``:
  ``cpu_worker_lora.py``). No ``/get_weight_version`` and no
  ``/get_load``: 0.5.23 has neither. sglang-router 0.3.2 probes ``/health``, ``/server_info``
  and ``/model_info`` before it routes to a worker; it has no ``/abort_request``.

Log-probs (matches SGLang's sampler): the returned log-prob of a sampled token is
``log_softmax(penalised logits / temperature)`` -- the temperature-scaled distribution *before*
top-p / top-k / min-p truncation. With ``temperature == 0`` (greedy) it is
``log_softmax(logits)``. The trainer recomputes with the same convention (docs/design.md §3,
"Log-prob convention").

Scheduling: continuous batching. New requests are prefilled as a left-padded batch and merged
into the running batch's KV cache; every step decodes one token for each running sequence;
finished rows leave the batch. All model work (steps and weight loads) runs on one executor
thread, so a weight update lands between two decode steps, never inside one. Pausing follows
SGLang: every mode holds new requests before the scheduler; ``in_place`` stops stepping with the
running requests and their caches kept, ``retract`` moves them back to the waiting queue (they
are prefilled again, output included, on ``continue_generation``), ``abort`` aborts everything.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import glob
import logging
import os
import threading
from multiprocessing import AuthenticationError
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch

from megatron_m2po.parallel.side_group import broadcast, new_side_group
from megatron_m2po.rollout import sglang_plugin
from megatron_m2po.standins import nccl_emulation
from megatron_m2po.standins import sglang_sampling as sampling
from megatron_m2po.standins.cpu_memory_saver import WEIGHTS, MemorySaver
from megatron_m2po.standins.cpu_prefix_cache import PrefixCache
from megatron_m2po.standins import cpu_worker_lora
from megatron_m2po.standins.hf_fused_experts import expert_target, is_fused_expert_name
from megatron_m2po.standins.memory_ledger import MemoryLedger
from megatron_m2po.standins import tensor_payload
from megatron_m2po.standins.cpu_worker_http import DEFAULT_GROUP, RequestError, WorkerApp
from megatron_m2po.standins.sglang_sampling import Sampling
from megatron_m2po.utils.hf_dir import iter_safetensors

log = logging.getLogger("m2po.cpu_worker")

PLUGIN_ENV = "M2PO_STANDIN_ENGINE_PLUGIN"  # "0": play an engine without the m2po SGLang plugin
# schedule_batch.py FINISH_ABORT().to_json(): a running request aborted by /abort_request.
_ABORT_RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
# tokenizer_manager.py _handle_abort_req: a request aborted before it was scheduled.
_ABORT_WAITING = {"type": "abort", "message": "Abort in waiting queue"}


@dataclass(eq=False)
class _Seq:
    rid: str
    prompt: list[int]
    sp: Sampling
    stop_ids: frozenset  # stop_token_ids | the model's and the tokenizer's EOS ids
    generator: Optional[torch.Generator]
    future: asyncio.Future
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    events: Optional[tuple] = None  # (asyncio.Queue, index): a streamed request's progress
    start: float = field(default_factory=time.time)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    input_logprobs: Optional[list] = None  # [(logprob | None, token_id), ...] from logprob_start_len
    finish: Optional[dict] = None
    aborted: bool = False
    abort_sent: bool = False  # tokenizer_manager.py ReqState.abort_sent: later aborts of this rid are ignored
    retractions: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (meta_info.cached_tokens)
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    lora_id: Optional[str] = None  # the LoRA adapter it runs under (cpu_worker_lora.py); None: the base model
    # routed experts [rows, layers, top_k] of the positions run so far (routed_capture.py), in pieces
    routed: list = field(default_factory=list)


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


def _unique_rows(seqs: list[_Seq], ctxs: list[list[int]]) -> tuple[list[int], list[_Seq], list[list[int]]]:
    """``(row of each sequence, representative sequence of each row, context of each row)``: rows
    with the same context, prompt log-prob start and LoRA adapter are one row of the prefill."""
    key_of = [(tuple(c), s.logprob_start_len if s.return_logprob else -1, s.lora_id) for s, c in zip(seqs, ctxs)]
    uniq: dict[tuple, int] = {}
    rows = [uniq.setdefault(k, len(uniq)) for k in key_of]
    first: dict[int, int] = {}
    for i, r in enumerate(rows):
        first.setdefault(r, i)
    return rows, [seqs[first[r]] for r in range(len(uniq))], [ctxs[first[r]] for r in range(len(uniq))]


def _prefill_inputs(rctx: list[list[int]], plen: list[int], P: int, E: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [U, E], mask [U, P + E], positions [U, E])``: each row's uncached tokens left-padded in
    the last ``E`` columns; the mask also marks its cached prefix, right-aligned in the first ``P``."""
    U = len(rctx)
    ids = torch.zeros(U, E, dtype=torch.long)
    mask = torch.zeros(U, P + E, dtype=torch.long)
    pos = torch.zeros(U, E, dtype=torch.long)
    for u, (c, n) in enumerate(zip(rctx, plen)):
        e = len(c) - n
        ids[u, E - e:] = torch.tensor(c[n:])
        pos[u, E - e:] = torch.arange(n, len(c))
        mask[u, P - n:P] = 1
        mask[u, P + E - e:] = 1
    return ids, mask, pos


def _cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def _own_memory(model: torch.nn.Module) -> None:
    """Give every parameter and buffer memory of the worker's own, as SGLang's weights are: its
    ``model_loader/loader.py`` ``DefaultModelLoader.load_model`` builds the model on the device
    (``with target_device: _initialize_model``) and copies the checkpoint's tensors into it. A
    model from transformers' ``from_pretrained`` may instead hold views of the safetensors file's
    mapping (private, copied on first write); a push into such pages ran 1.3-2x slower than into
    the worker's own memory on this project's 2-core VM, long after the first write
    (``tools/benchmarks/weight_sync.py --colocated``). Tied tensors stay tied (one ``Parameter``)."""
    with torch.no_grad():
        for p in model.parameters():  # each Parameter once: tied weights are one object
            p.data = p.data.clone()
        for mod in model.modules():
            for name, b in mod.named_buffers(recurse=False):
                if b is not None:
                    setattr(mod, name, b.clone())


class Engine:
    """Model, scheduler and weight updates; the HTTP layer is ``cpu_worker_http.WorkerApp``."""

    def __init__(self, model_path: str, *, max_running: int = 64, seed: int = 0,
                 weight_version: str = "default", dist_timeout_s: float = 300.0,
                 quantization: Optional[str] = None, prefix_cache_mb: float = 256.0,
                 enable_return_routed_experts: bool = False, memory_saver: bool = False,
                 weights_cpu_backup: bool = False, gpu: int = 0, owner: str = "cpu_worker",
                 lora: Optional[cpu_worker_lora.LoRASettings] = None, tp_size: int = 1) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.model_path = model_path
        # SGLang's --tp-size as far as a client sees it: server_info's tp_size, and a per-rank
        # payload list read as that many rank processes read it (tensor_payload.read_per_rank);
        # the model itself is one whole copy.
        self.tp_size = int(tp_size)
        self.config = AutoConfig.from_pretrained(model_path)
        self.fp8 = None  # FP8 linears (megatron_m2po.weights.fp8.FP8Linears) when serving FP8
        from megatron_m2po.weights.fp8 import FP8Linears, fp8_block_of, is_fp8_config
        fp8_ckpt = is_fp8_config(self.config)
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization={quantization!r}: the CPU worker supports only 'fp8'")
        if fp8_ckpt:
            # An FP8 checkpoint: build the float model, then load weight + scale pairs through the
            # FP8 loader (load_weights), as SGLang's Fp8LinearMethod loads them.
            block = fp8_block_of(self.config)
            del self.config.quantization_config
            self.model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
            self.fp8 = FP8Linears(self.model, block)
            self.load_from_disk(model_path)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=torch.float32, attn_implementation="eager").eval()
            _own_memory(self.model)
            if quantization == "fp8":  # SGLang's online FP8 of a float checkpoint: per tensor here
                self.fp8 = FP8Linears(self.model, None)
                self.fp8.quantize_model(self.model)
        # SGLang's --enable-return-routed-experts (standins/routed_capture.py); None when off.
        self.routing = None
        if enable_return_routed_experts:
            from megatron_m2po.standins.routed_capture import RoutedExpertsCapture
            self.routing = RoutedExpertsCapture(self.model, self.config)
        # SGLang's --enable-lora (cpu_worker_lora.py): adapters per row of a batch; None when off.
        self.lora = cpu_worker_lora.LoRAServing(self.model, lora) if lora is not None else None
        self.tokenizer, self.eos_ids = self._tokenizer_and_eos(model_path)
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.context_len = int(getattr(self.config, "max_position_embeddings", 1 << 20))
        self.max_running = max_running
        self.weight_version = weight_version
        self._kept_buckets: list[torch.Tensor] = []  # load_serialized: the latest pushed host buckets, kept mapped
        self.dist_timeout_s = dist_timeout_s
        self.generator = torch.Generator().manual_seed(seed)
        # Two pause flags, as SGLang 0.5.23 has: the tokenizer manager's ``is_pause`` (new requests
        # wait for continue_generation; every mode) and the scheduler's ``_engine_paused`` (no
        # forward steps; in_place and retract only -- "abort" aborts everything instead).
        self.paused = False
        self.sched_paused = False
        # SGLang's /slow_down (scheduler.py: ``forward_sleep_time``, slept before each forward).
        self.forward_sleep_time: Optional[float] = None
        self.waiting: list[_Seq] = []
        self.prefilling: list[_Seq] = []
        self.live: dict[str, _Seq] = {}  # rid -> request not yet answered (tokenizer's rid_to_state)
        # rid -> abort_sent of requests that arrived while paused and wait in the tokenizer manager
        # (registered in rid_to_state, not yet sent to the scheduler).
        self.held: dict[str, bool] = {}
        self.batch = _Batch()
        # SGLang's radix cache (prompt KV reused across requests until a flush); model thread only.
        self.prefix_cache = PrefixCache(int(prefix_cache_mb * 2**20))
        self.prefill_tokens = 0  # tokens computed by prefills (/v1/loads total_prefill_uncached_tokens)
        self.qlock = threading.Lock()
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")
        self.groups: dict[str, Any] = {}
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.wake, self.resumed, self.step_lock = None, None, None  # asyncio objects of start()
        # Messages the tokenizer manager received from the scheduler (a counter and an event per
        # message): /health succeeds once one arrives after it started (http_server.py).
        self.received = 0
        self.receive_event: Optional[asyncio.Event] = None
        # --enable-memory-saver: release / resume, recorded in the node's memory ledger (cpu_memory_saver.py)
        self.memory = MemorySaver(self.model, enabled=memory_saver, cpu_backup=weights_cpu_backup, gpu=gpu,
                                  kv_bytes=self.prefix_cache.max_bytes, ledger=MemoryLedger.from_env(), owner=owner)

    def _tokenizer_and_eos(self, model_path: str) -> tuple[Any, frozenset]:
        """The model dir's tokenizer (None without one) and the EOS ids: the model's, and the
        tokenizer's too (Req._check_token_based_finish)."""
        tokenizer = None
        if glob.glob(os.path.join(model_path, "tokenizer*")):
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(model_path)
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None)
        eos_ids = frozenset([] if eos is None else ([eos] if isinstance(eos, int) else eos))
        if tokenizer is not None:
            extra = {tokenizer.eos_token_id} | set(getattr(tokenizer, "additional_stop_token_ids", None) or [])
            eos_ids |= frozenset(t for t in extra if t is not None)
        return tokenizer, eos_ids

    # ---------------------------------------------------------------- scheduler
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.wake, self.step_lock = asyncio.Event(), asyncio.Lock()
        self.resumed, self.receive_event = asyncio.Event(), asyncio.Event()
        self.resumed.set()
        self.loop_task = asyncio.create_task(self._run())

    async def run_model(self, fn, *args):
        return await self.loop.run_in_executor(self.executor, fn, *args)

    def note_receive(self) -> None:
        """A scheduler message reached the tokenizer manager (loop thread only)."""
        self.received += 1
        ev, self.receive_event = self.receive_event, asyncio.Event()
        ev.set()

    async def received_since(self, mark: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.received <= mark:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self.receive_event.wait(), left)
            except asyncio.TimeoutError:
                return self.received > mark
        return True

    async def wait_resumed(self) -> None:
        """tokenizer_manager.py generate_request: ``is_pause_cond.wait_for(not is_pause)``."""
        while self.paused:
            await self.resumed.wait()

    def pause(self) -> None:
        """The tokenizer manager's ``is_pause`` (every pause mode): new requests wait in
        :meth:`wait_resumed` until :meth:`resume`."""
        self.paused = True
        self.resumed.clear()

    def resume(self) -> None:
        """continue_generation: both pause flags off, held requests and the scheduler go on."""
        self.paused = self.sched_paused = False
        self.resumed.set()
        self.wake.set()

    def hold(self, rids: list[str]) -> None:
        """Requests that arrived while paused: registered (an abort by rid marks them), not yet
        sent to the scheduler (tokenizer_manager.py ``rid_to_state`` before the pause wait)."""
        self.held.update((r, False) for r in rids)

    def release(self, rids: list[str]) -> dict[str, bool]:
        """Stop holding ``rids``: rid -> ``abort_sent`` (True when an abort by rid hit it while held)."""
        return {r: self.held.pop(r, False) for r in rids}

    async def abort_all_and_wait(self) -> None:
        """pause_generation(mode="abort"): abort every request and return once none is live (a
        request that arrives meanwhile is aborted too)."""
        while self.live:
            self.abort(None, True)
            await asyncio.gather(*(asyncio.shield(s.future) for s in list(self.live.values())),
                                 return_exceptions=True)

    def slow_down(self, forward_sleep_time: Optional[float]) -> None:
        """SGLang's /slow_down: sleep this long before each forward step (None: not at all)."""
        self.forward_sleep_time = forward_sleep_time
        self.wake.set()

    async def _run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            while True:
                async with self.step_lock:
                    if self.sched_paused:
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
                    self.note_receive()

    def _resolve(self, seq: _Seq) -> None:
        def done() -> None:
            if self.live.get(seq.rid) is seq:
                del self.live[seq.rid]
            if not seq.future.done():
                seq.future.set_result(seq)
            if seq.events is not None:
                seq.events[0].put_nowait(seq.events[1])
        self.loop.call_soon_threadsafe(done)

    def _fail_all(self, message: str) -> None:
        with self.qlock:
            seqs, self.waiting, self.prefilling = self.batch.seqs + self.prefilling + self.waiting, [], []
        self.batch = _Batch()
        for s in seqs:
            s.finish = {"type": "abort", "message": message}
            self._resolve(s)

    @torch.no_grad()
    def _step(self) -> None:
        refusal = self.memory.refusal()
        if refusal is not None:  # requests retracted before a release, continued before a resume
            self._fail_all(refusal)
            return
        if len(self.batch):
            b = self.batch
            mask = torch.cat([b.mask, torch.ones(len(b), 1, dtype=torch.long)], 1)
            cache = self._make_cache(b.kv)
            if self.routing is not None:
                self.routing.begin()
            with self._adapters(b.seqs):
                out = self.model(input_ids=b.last[:, None], attention_mask=mask,
                                 position_ids=b.pos[:, None], past_key_values=cache, use_cache=True)
            if self.routing is not None:
                for s, rows in zip(b.seqs, self.routing.take(len(b), 1)):
                    s.routed.append(rows)
            b.kv, b.mask = _cache_tensors(out.past_key_values), mask
            b.pos = b.pos + 1
            b.last = self._sample(b.seqs, out.logits[:, -1].float())
        with self.qlock:
            room = max(self.max_running - len(self.batch), 0)
            if self.lora is None:
                new, self.waiting = self.waiting[:room], self.waiting[room:]
            else:  # scheduler.py can_schedule_lora_req: at most --max-loras-per-batch adapters run at once
                new, self.waiting = self.lora.admit(self.waiting, room, [s.lora_id for s in self.batch.seqs])
            self.prefilling = new  # abort() marks them like running requests
        if new:
            self.batch.merge(self._prefill(new))
        with self.qlock:
            self.prefilling = []
        finished = [i for i, s in enumerate(self.batch.seqs) if s.finish is not None]
        if finished:
            self._cache_finished(finished)
            done = [self.batch.seqs[i] for i in finished]
            self.batch.keep([i for i in range(len(self.batch)) if self.batch.seqs[i].finish is None])
            for s in done:
                self._resolve(s)

    def _cache_finished(self, rows: list[int]) -> None:
        """Keep the KV of finished requests in the prefix cache: SGLang 0.5.23 releases a finished
        request's KV into the radix tree (``mem_cache/common.py`` ``release_kv_cache(...,
        checkpoint=True)`` -> ``tree_cache.checkpoint(req, up_to=owned_kv_len)``): its prompt and
        every output token whose KV was computed (all but the last sampled one), so a multi-turn
        request that extends the conversation finds it cached. Aborted requests are not kept."""
        b = self.batch
        for i in rows:
            s = b.seqs[i]
            if str((s.finish or {}).get("type")) == "abort" or not s.output:
                continue
            ctx = s.prompt + s.output[:-1]
            cols = torch.nonzero(b.mask[i], as_tuple=False)[:, 0]
            if cols.numel() != len(ctx):  # the row's KV does not cover exactly this context
                continue
            entries = [(k[i][:, cols], v[i][:, cols]) for k, v in b.kv]
            if self.routing is not None:
                entries.append(self.routing.cache_entry(torch.cat(s.routed)))
            self.prefix_cache.insert(ctx, entries, 0, s.lora_id)
        self.prefix_cache.evict()

    def retract_all(self) -> None:
        """pause_generation(mode="retract") (scheduler.py pause_generation): running requests go
        back to the waiting queue with their output so far and are prefilled again on resume. Their KV
        is dropped, not kept in the prefix cache (schedule_batch.py ``release_req`` ->
        ``release_kv_cache(checkpoint=False)``), and so is their routing (``Req.reset_for_retract``:
        ``routed_experts = None``): the prefill again captures every position anew, under the weights
        of that time (``_prefill``), as SGLang's capturer writes the new KV slots
        (``state_capturer/base.py`` ``on_forward_end``) that ``get_topk`` reads at the finish."""
        with self.qlock:
            seqs = list(self.batch.seqs)
            self.batch = _Batch()
            self.waiting = seqs + self.waiting
        for s in seqs:
            s.retractions += 1
            s.routed = []  # Req.reset_for_retract; aborted while waiting, the request returns none

    def _adapters(self, seqs: list[_Seq]):
        """Context of a forward over ``seqs``' rows: each row under its LoRA adapter (cpu_worker_lora.py)."""
        return self.lora.rows([s.lora_id for s in seqs]) if self.lora is not None else contextlib.nullcontext()

    def _make_cache(self, kv):
        from transformers import DynamicCache
        return DynamicCache(ddp_cache_data=list(kv), config=self.config)

    def _prefill(self, seqs: list[_Seq]) -> _Batch:
        """Prompt (+ the output of a retracted request) of each row, on top of its longest cached
        prefix (``cpu_prefix_cache``); samples the next token.

        Rows with the same context and prompt log-prob start are computed once and copied (a
        group's samples arrive together; the result is the same as computing each). Layout of
        the batch: cached prefixes right-aligned in the first ``P`` columns, the computed tokens
        left-padded in the last ``E``; the mask marks both, positions are absolute."""
        ctxs = [s.prompt + s.output for s in seqs]
        rows, reps, rctx = _unique_rows(seqs, ctxs)
        matched = [self._match_prefix(s, c) for s, c in zip(reps, rctx)]
        plen = [n for n, _ in matched]
        P, E = max(plen), max(len(c) - n for c, n in zip(rctx, plen))
        ids, mask, pos = _prefill_inputs(rctx, plen, P, E)
        past = self._cached_past(matched, P)
        self.prefill_tokens += sum(len(c) - n for c, n in zip(rctx, plen))
        if self.routing is not None:
            self.routing.begin()
        with self._adapters(reps):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                             past_key_values=self._make_cache(past) if past else None)
        kv = _cache_tensors(out.past_key_values)
        logits = out.logits.float()
        routed = self._prefill_routing(matched, rctx, E) if self.routing is not None else None
        self._keep_prefilled(reps, rctx, plen, kv, logits, routed, P, E)
        for s, r in zip(seqs, rows):
            # schedule_batch.py: cached tokens are counted once, never after a retraction.
            if s.retractions == 0:
                s.cached_tokens += plen[r]
            if routed is not None:  # a retracted request's KV and routing are computed anew (retract_all):
                # the rows captured before the retraction are gone, as in SGLang
                s.routed = [routed[r]]
            if s.input_logprobs is None and reps[r].input_logprobs is not None and s is not reps[r]:
                s.input_logprobs = list(reps[r].input_logprobs)
        idx = torch.tensor(rows, dtype=torch.long)
        b = _Batch()
        b.seqs, b.mask = list(seqs), mask.index_select(0, idx)
        b.kv = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in kv]
        b.pos = torch.tensor([len(c) for c in ctxs], dtype=torch.long)
        b.last = self._sample(seqs, logits[:, -1].index_select(0, idx))
        return b

    def _match_prefix(self, s: _Seq, ctx: list[int]) -> tuple[int, Any]:
        """The longest cached prefix of ``ctx`` that the prefill may reuse: schedule_batch.py
        ``Req._compute_max_prefix_len``: the last token is always computed, and prompt log-probs
        from logprob_start_len need the logits from there on. The cache is keyed by the request's
        LoRA adapter (``Req.extra_key`` ends with its ``lora_id``), so KV of one adapter serves no other."""
        limit = len(ctx) - 1
        if s.return_logprob and s.logprob_start_len >= 0:
            limit = min(limit, s.logprob_start_len)
        return self.prefix_cache.match(ctx, limit, s.lora_id)

    def _cached_past(self, matched: list, P: int) -> Optional[list[tuple[torch.Tensor, torch.Tensor]]]:
        """The matched prefixes' KV per layer, ``[U, H, P, D]``, each right-aligned in the first ``P``
        columns (None when nothing matched)."""
        if not P:
            return None
        U = len(matched)
        layers = next(kv for _, kv in matched if kv is not None)[:self.config.num_hidden_layers]  # (+ routing)
        past = []
        for j, (k0, v0) in enumerate(layers):
            k = k0.new_zeros(U, k0.shape[0], P, k0.shape[2])
            v = v0.new_zeros(U, v0.shape[0], P, v0.shape[2])
            for u, (n, kv) in enumerate(matched):
                if n:
                    k[u, :, P - n:], v[u, :, P - n:] = kv[j]
            past.append((k, v))
        return past

    def _keep_prefilled(self, reps: list[_Seq], rctx: list, plen: list[int], kv: list, logits: torch.Tensor,
                        routed: Optional[list[torch.Tensor]], P: int, E: int) -> None:
        """Insert each unique row's computed KV (and routing) into the prefix cache, and take its
        prompt log-probs from the prefill's logits."""
        for u, (s, c, n) in enumerate(zip(reps, rctx, plen)):
            e = len(c) - n
            entries = [(k[u, :, P + E - e:], v[u, :, P + E - e:]) for k, v in kv]
            if routed is not None:
                entries.append(self.routing.cache_entry(routed[u][n:]))
            self.prefix_cache.insert(c, entries, n, s.lora_id)
            if s.return_logprob and s.input_logprobs is None and 0 <= s.logprob_start_len < len(s.prompt):
                s.input_logprobs = _input_logprobs(s, logits[u, E - e:], n)
        self.prefix_cache.evict()

    def _prefill_routing(self, matched: list, rctx: list, E: int) -> list[torch.Tensor]:
        """Routed experts ``[len(context), layers, top_k]`` of each unique prefill row: the cached
        prefix's from the prefix cache (captured when its KV was computed, as SGLang keeps them
        with the KV slot), the computed tokens' from this forward (left-padded in the last E)."""
        run = self.routing.take(len(rctx), E)
        out = []
        for u, ((n, kv), c) in enumerate(zip(matched, rctx)):
            fresh = run[u, E - (len(c) - n):]
            out.append(torch.cat([self.routing.from_cache_entry(kv[-1]), fresh]) if n else fresh)
        return out

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> torch.Tensor:
        """One token per row and its log-prob (``sglang_sampling``), then SGLang's finish checks
        in ``Req.update_finish_state`` order: abort, stop string, stop token, length."""
        nxt = torch.empty(len(seqs), dtype=torch.long)
        for i, s in enumerate(seqs):
            if s.sp.max_new_tokens == 0:  # prompt log-probs only; finished in submit()
                nxt[i] = 0
                continue
            row = sampling.penalise(s.sp, logits[i], s.output, s.stop_ids)
            tok, lp = sampling.sample(s.sp, row, s.generator or self.generator)
            nxt[i] = tok
            s.output.append(tok)
            s.logprobs.append(lp)
            s.versions.append(self.weight_version)
            if s.aborted:  # to_finish: the request ran this one more step
                s.finish = dict(_ABORT_RUNNING)
            elif (r := sampling.stop_reason(s.sp, s.output, s.stop_ids, self.tokenizer)) is not None:
                s.finish = r
            elif s.sp.max_new_tokens is not None and len(s.output) >= s.sp.max_new_tokens:
                s.finish = {"type": "length", "length": s.sp.max_new_tokens}
            elif len(s.prompt) + len(s.output) >= self.context_len:
                s.finish = {"type": "length", "length": len(s.output)}
            if s.events is not None and s.finish is None:
                self.loop.call_soon_threadsafe(s.events[0].put_nowait, s.events[1])
        return nxt

    # ---------------------------------------------------------------- requests
    def make_seq(self, input_ids: list[int], params: Optional[dict], rid: Optional[str], *,
                 return_logprob: bool = False, logprob_start_len: Optional[int] = -1,
                 return_text_in_logprobs: bool = False, return_routed_experts: bool = False,
                 routed_experts_start_len: int = 0) -> _Seq:
        """Validate one request as SGLang 0.5.23 does (``sglang_sampling.parse``, then
        ``tokenizer_manager.py`` ``_validate_one_request``, then the scheduler's
        ``logprob_start_len`` check); raises ContractError / ParamError / RequestError."""
        sp = sampling.parse(params, self.tokenizer, self.vocab_size)
        if not input_ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
            raise RequestError("input_ids must be a non-empty list of ints")
        if min(input_ids) < 0 or max(input_ids) >= self.vocab_size:
            raise RequestError(f"input_ids contain ids outside [0, {self.vocab_size})")
        if len(input_ids) >= self.context_len:
            raise RequestError(f"The input ({len(input_ids)} tokens) is longer than the model's "
                               f"context length ({self.context_len} tokens).")
        mnt = sp.max_new_tokens
        if mnt is not None and len(input_ids) + mnt > self.context_len:
            # SGLang 0.5.23 managers/tokenizer_manager.py _validate_one_request (no auto-truncate)
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} "
                f"tokens. You requested a total of {len(input_ids) + mnt} tokens: {len(input_ids)} tokens "
                f"from the input messages and {mnt} tokens for the completion. Please reduce the number "
                f"of tokens in the input messages or the completion to fit within the limit.")
        start = -1 if logprob_start_len is None or not return_logprob else int(logprob_start_len)
        if start > len(input_ids):  # scheduler.py handle_generate_request: an abort with status 400
            raise RequestError(f"req.logprob_start_len={start} is higher than the number of input tokens "
                               f"len(req.origin_input_ids)={len(input_ids)}. Please use a smaller "
                               "logprob_start_len.")
        if start < -1:
            raise RequestError(f"logprob_start_len={start}: use -1 (output log-probs only) or a prompt position")
        if return_routed_experts:  # scheduler.py handle_generate_request: an abort naming the value
            from megatron_m2po.standins.routed_capture import RoutedExpertsCapture
            if isinstance(routed_experts_start_len, bool) or not isinstance(routed_experts_start_len, int):
                raise RequestError(f"routed_experts_start_len={routed_experts_start_len!r} must be an integer")
            msg = RoutedExpertsCapture.check_start(routed_experts_start_len, len(input_ids))
            if msg is not None:
                raise RequestError(msg)
        gen = torch.Generator().manual_seed(sp.sampling_seed) if sp.sampling_seed is not None else None
        return _Seq(rid=rid or uuid.uuid4().hex, prompt=list(input_ids), sp=sp,
                    stop_ids=sp.stop_token_ids | self.eos_ids, generator=gen,
                    future=self.loop.create_future(), return_logprob=bool(return_logprob),
                    logprob_start_len=start, return_text_in_logprobs=bool(return_text_in_logprobs),
                    return_routed_experts=bool(return_routed_experts),
                    routed_experts_start_len=int(routed_experts_start_len))

    def submit(self, seq: _Seq) -> None:
        """Queue a request (``max_new_tokens == 0``: answered at once, prompt only)."""
        self.live[seq.rid] = seq
        if seq.sp.max_new_tokens == 0:
            seq.finish = {"type": "length", "length": 0}
            if seq.return_logprob and 0 <= seq.logprob_start_len < len(seq.prompt):
                with self.qlock:  # prompt log-probs need a forward: let the scheduler run it
                    self.waiting.append(seq)
                self.wake.set()
                return
            self._resolve(seq)
            return
        with self.qlock:
            self.waiting.append(seq)
        self.wake.set()

    async def generate_one(self, seq: _Seq) -> dict:
        self.submit(seq)
        try:
            await asyncio.shield(seq.future)
        except asyncio.CancelledError:
            # tokenizer_manager.py: a client that disconnects aborts its request.
            self.abort(seq.rid, False)
            raise
        return self.response(seq)

    def meta(self, seq: _Seq, finished: bool) -> dict:
        """``meta_info`` as tokenizer_manager.py ``_handle_batch_output`` builds it (and
        ``_handle_abort_req`` for a request aborted while waiting)."""
        n = len(seq.output)
        if seq.finish == _ABORT_WAITING:
            meta = {"id": seq.rid, "finish_reason": dict(seq.finish), "weight_version": self.weight_version,
                    "e2e_latency": time.time() - seq.start}
        else:
            meta = {"id": seq.rid, "finish_reason": dict(seq.finish) if finished else None,
                    "prompt_tokens": len(seq.prompt), "weight_version": self.weight_version,
                    "num_retractions": seq.retractions, "reasoning_tokens": 0, "completion_tokens": n,
                    "cached_tokens": seq.cached_tokens, "e2e_latency": time.time() - seq.start}
        meta["weight_versions"] = _version_spans(seq.versions[:n], self.weight_version)
        if seq.return_logprob:
            def fmt(pairs):  # detokenize_logprob_tokens: (logprob, token_id, text | None)
                if seq.return_text_in_logprobs and self.tokenizer is not None:
                    return [[lp, t, self.tokenizer.decode([t])] for lp, t in pairs]
                return [[lp, t, None] for lp, t in pairs]
            meta["input_token_logprobs"] = fmt(seq.input_logprobs or [])
            meta["output_token_logprobs"] = fmt(zip(seq.logprobs[:n], seq.output[:n]))
            meta["output_token_logprobs_length"] = n
        meta["completion_tokens"] = n
        if finished and seq.return_routed_experts and self.routing is not None and seq.routed:
            # _maybe_collect_routed_experts at the finish; without the server flag there is no field
            meta["routed_experts"] = self.routing.encode(torch.cat(seq.routed), len(seq.prompt) + n,
                                                         seq.routed_experts_start_len)
        return meta

    def response(self, seq: _Seq) -> dict:
        text = sampling.output_text(seq.sp, seq.output, seq.finish, self.tokenizer)
        return {"text": text, "output_ids": list(seq.output), "meta_info": self.meta(seq, True)}

    def partial(self, seq: _Seq) -> dict:
        """A streamed chunk before the end: everything so far (non-incremental streaming)."""
        out = list(seq.output)
        text = "" if self.tokenizer is None else self.tokenizer.decode(
            out, skip_special_tokens=seq.sp.skip_special_tokens)
        meta = self.meta(seq, False)
        meta["completion_tokens"] = len(out)
        return {"text": text, "output_ids": out, "meta_info": meta}

    def abort(self, rid: Optional[str], abort_all: bool) -> int:
        """tokenizer_manager.py ``abort_request`` + scheduler.py ``abort_request``: an empty rid
        without abort_all, or a rid the server does not know, is ignored; otherwise every request
        whose rid *starts with* it (or all) is aborted: a waiting one at once, a running one after
        one more decode step (its partial output is returned with finish_reason abort). A request
        held by a pause is not in the scheduler yet: aborting it by rid does nothing (and, as the
        tokenizer marks ``abort_sent``, neither does any later abort of that rid); it runs after
        continue_generation."""
        if not abort_all:
            if not rid:
                return 0
            if rid in self.held:  # the scheduler does not have it: the abort is lost (0.5.23)
                self.held[rid] = True
                return 0
            s = self.live.get(rid)
            if s is None or s.abort_sent:
                return 0
            s.abort_sent = True
        with self.qlock:
            hits = [s for s in self.live.values() if abort_all or s.rid.startswith(rid)]
            waiting = [s for s in self.waiting if any(s is h for h in hits)]
            self.waiting = [s for s in self.waiting if not any(s is w for w in waiting)]
            for s in hits:
                s.aborted = True
        for s in waiting:
            s.finish = dict(_ABORT_WAITING)
            self._resolve(s)
        self.wake.set()
        return len(hits)

    def load(self) -> dict:
        """Core fields of SGLang 0.5.23's ``LoadSnapshot`` (``managers/load_snapshot.py``)."""
        with self.qlock:
            running, waiting = list(self.batch.seqs) + list(self.prefilling), list(self.waiting)
        used = sum(len(s.prompt) + len(s.output) for s in running)
        return {"dp_rank": 0, "num_running_reqs": len(running), "num_waiting_reqs": len(waiting),
                "num_waiting_uncached_tokens": sum(len(s.prompt) for s in waiting),
                "num_used_tokens": used, "num_total_tokens": used, "num_active_tokens": used,
                "max_running_requests": self.max_running,
                # Cumulative tokens prefilled (SGLang: extend tokens of prefill batches; here the tokens
                # computed, a batch's identical contexts once): prefix-cache hits are not computed.
                "total_prefill_uncached_tokens": self.prefill_tokens,
                # Not in SGLang (tests wait on them): tokens sampled so far by the running requests,
                # and requests held by a pause before reaching the scheduler.
                "num_generated_tokens": sum(len(s.output) for s in running), "num_held_reqs": len(self.held)}

    def busy(self) -> bool:
        with self.qlock:
            return bool(self.waiting) or bool(self.prefilling) or len(self.batch) > 0

    def flushable(self) -> bool:
        """scheduler.py ``flush_cache``: ``is_fully_idle(ignore_waiting=self._engine_paused)`` --
        no running request, and no waiting one unless the scheduler is paused (retract)."""
        with self.qlock:
            return not len(self.batch) and not self.prefilling and (not self.waiting or self.sched_paused)

    def flush(self) -> bool:
        """scheduler.py ``flush_cache``: drop the prefix cache when ``flushable``; False (nothing
        dropped) otherwise. Runs on the model thread (``run_model``), between two steps, as
        SGLang's runs in the scheduler's loop."""
        if not self.flushable():
            return False
        self.prefix_cache.reset()
        return True

    # ---------------------------------------------------------------- memory occupation
    def release_memory(self, tags: Optional[list]) -> None:
        """SGLang's ``release_memory_occupation`` (``cpu_memory_saver.py``); model thread only."""
        self.memory.release(tags, self.flushable(), self.prefix_cache.reset)
        self._kept_buckets = []  # the pushes' host buckets (load_serialized) are the trainer's to free

    def resume_memory(self, tags: Optional[list]) -> None:
        """SGLang's ``resume_memory_occupation`` (``cpu_memory_saver.py``); model thread only."""
        self.memory.resume(tags)

    def memory_refusal(self, what: str = "a generation", weights_only: bool = False) -> Optional[str]:
        """Why ``what`` cannot run now (None: it can): its memory is released (``cpu_memory_saver.py``).
        None while the constructor loads an FP8 checkpoint (nothing is released before the engine runs)."""
        memory = getattr(self, "memory", None)
        return None if memory is None else memory.refusal(what, (WEIGHTS,) if weights_only else None)

    def load_serialized(self, payloads: list[bytes], load_format: Optional[str]) -> int:
        """``/update_weights_from_tensor``'s load: this rank's payload (``tp_worker.py``
        ``deserialize_own_rank``: index 0, TP=1) read by ``tensor_payload.py``, then :meth:`load_weights`."""
        if not payloads:
            raise ValueError("serialized_named_tensors is empty: one payload per engine TP rank is needed "
                             "(SGLang 0.5.23 indexes it by tp_rank: IndexError)")
        try:
            obj = tensor_payload.read_per_rank(payloads, self.tp_size)[0]  # ranks > 0 load theirs and drop it
        except AuthenticationError:
            raise ValueError("cannot open the payload's shared-memory tensors (AuthenticationError): the sender "
                             "used torch's file_descriptor sharing strategy, which only its own children can "
                             "open; use torch.multiprocessing.set_sharing_strategy('file_system')") from None
        except (OSError, EOFError) as e:  # e.g. a shared-memory segment its sender already freed
            raise ValueError(f"cannot open the payload's tensors: {type(e).__name__}: {e}") from None
        n = self.load_weights(tensor_payload.named_tensors(obj, load_format))
        if isinstance(obj, dict) and isinstance(obj.get("flattened_tensor"), torch.Tensor):
            # Keep the two latest buckets mapped. A host bucket mapped afresh costs a page fault per
            # page read, which opening a CUDA IPC handle (device memory, already resident) does not;
            # the trainer reuses its two host buckets (weights/colocated_bucket.py HostBuckets), so
            # with the mapping kept torch's shared_cache (reductions.py rebuild_storage_filename)
            # hands back the same storage and a push pays each mapping once. Dropped on release.
            flat = obj["flattened_tensor"]
            kept = [t for t in self._kept_buckets if t.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()]
            self._kept_buckets = (kept + [flat])[-2:]
        return n

    # ---------------------------------------------------------------- weights
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the model in place (HF names); unknown names or shapes fail.

        MoE experts come under the checkpoint's per-expert names, as SGLang 0.5.23's Qwen3-MoE
        loader reads them, and fill transformers' fused expert tensors (``hf_fused_experts.py``).

        FP8 engines take FP8 pairs (``.weight`` float8 + ``.weight_scale_inv`` per block, or
        ``.weight_scale`` per tensor) by SGLang 0.5.23's rules for the format (per-tensor FP8 loads
        once); see ``megatron_m2po/weights/fp8.py``. Refused while the weights are released."""
        refusal = self.memory_refusal("a weight update", weights_only=True)
        if refusal is not None:
            raise ValueError(refusal)
        if self.fp8 is not None:
            named = self.fp8.convert(named)
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        bad, n = [], 0
        with torch.no_grad():
            for name, t in named:
                # MoE experts: per-expert names as SGLang loads them, into transformers' fused tensors
                dst = params.get(name) if not is_fused_expert_name(name) else None
                dst = dst if dst is not None else expert_target(params, name)
                if dst is None:
                    if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                        continue
                    bad.append(f"{name} (fused expert tensor: SGLang loads per-expert names, "
                               "mlp.experts.<e>.gate_proj / up_proj / down_proj.weight)"
                               if is_fused_expert_name(name) else f"{name} (unknown)")
                    continue
                if tuple(dst.shape) != tuple(t.shape):
                    bad.append(f"{name} (shape {tuple(t.shape)} != {tuple(dst.shape)})")
                    continue
                dst.copy_(t.to(dst.dtype))
                n += 1
        if bad:
            raise ValueError(f"{len(bad)} tensors do not fit the model: {bad[:8]}")
        return n

    def load_from_disk(self, path: str) -> int:
        n = self.load_weights(iter_safetensors(path))
        if self.fp8 is not None:
            self.fp8.after_loading()
        return n

    def weights_by_name(self, name: str, truncate_size: int) -> Optional[list]:
        """SGLang 0.5.23 models/llama.py ``get_weights_by_name``: the parameter as float32 nested
        lists, its first ``truncate_size`` rows; a tied lm_head.weight answers with
        embed_tokens.weight; None for an unknown name."""
        params = dict(self.model.named_parameters())
        if name == "lm_head.weight" and getattr(self.config, "tie_word_embeddings", False):
            name = "model.embed_tokens.weight"
        if name not in params:
            return None
        return params[name].detach().to(torch.float32).numpy().tolist()[:truncate_size]

    def init_group(self, req: dict) -> None:
        backend = req.get("backend", "nccl")
        if backend != "gloo":
            raise ValueError(f"backend={backend!r}: the CPU worker joins weight-update groups over "
                             "gloo only (set backend='gloo')")
        name = req.get("group_name", DEFAULT_GROUP)
        if name in self.groups:
            raise ValueError(f"group {name!r} already exists; destroy it first")
        pg = new_side_group("gloo", req["master_address"], int(req["master_port"]),
                            rank=int(req["rank_offset"]), world_size=int(req["world_size"]),
                            group_name=name, timeout_s=self.dist_timeout_s)
        self.groups[name] = pg
        if os.environ.get(PLUGIN_ENV, "1") != "0":
            # What the m2po SGLang plugin's hook does after SGLang's join (rollout/sglang_plugin.py).
            sglang_plugin.publish(pg, int(req["rank_offset"]), sglang_plugin.local_nccl_version("gloo"))

    def drop_group(self, name: str) -> Any:
        """Forget weight-update group ``name``; returns it (None if there is none) for the caller
        to destroy outside the model thread."""
        return self.groups.pop(name, None)

    def receive(self, req: dict) -> list[tuple[str, torch.Tensor]]:
        name = req.get("group_name", DEFAULT_GROUP)
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


def _input_logprobs(s: _Seq, rows: torch.Tensor, first: int = 0) -> list:
    """``meta_info.input_token_logprobs`` from ``logprob_start_len`` L (rows: the prefill logits of
    the prompt from position ``first <= L`` on; the positions before came from the prefix cache). logprob_result_processor.py ``_process_input_token_logprobs``: values are
    ``[None] + logprobs[:-1]`` -- the token at L gets None even when L > 0 -- from
    ``log_softmax`` of the raw logits (logprob_processor.py ``InputLogprobProcessor``: no
    temperature, no penalties); ids are ``prompt[L:]`` with the last vocabulary id reported as 0
    (SGLang clips ``x < vocab_size - 1``, meant for multimodal hashes)."""
    n, start = len(s.prompt), s.logprob_start_len
    vals: list = [None]
    if n - start > 1:
        lp = torch.log_softmax(rows[start - first:n - 1 - first], -1)
        vals += lp.gather(1, torch.tensor(s.prompt[start + 1:n])[:, None])[:, 0].tolist()
    vocab = rows.shape[-1]
    return [(v, t if t < vocab - 1 else 0) for v, t in zip(vals, s.prompt[start:])]


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


class _DropH2Probe(logging.Filter):
    """sglang-router first tries HTTP/2 on each worker; aiohttp logs that probe as an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "PRI/Upgrade" not in record.getMessage() and "PRI/Upgrade" not in str(record.exc_info)


def init_torch_distributed(host: str, nccl_port: Optional[int], dist_timeout: Optional[int]) -> str:
    """The engine's own default process group, created at start-up as SGLang 0.5.23 creates it.

    SGLang's scheduler (``managers/scheduler.py`` -> ``distributed/bootstrap.py``
    ``init_parallel_runtime``) calls ``init_distributed_environment`` (``distributed/parallel_state.py``):
    ``torch.distributed.init_process_group(backend, init_method="tcp://<--host or 127.0.0.1>:<nccl_port>",
    world_size=tp*pp, rank, timeout=--dist-timeout)``, with ``nccl_port`` = ``--nccl-port`` or a free port
    below the ephemeral range (``server_args.py`` ``PortArgs.init_new``, ``utils/network.py``
    ``get_free_port_below_ephemeral``) and no timeout by default. One CPU worker is one rank on gloo
    (SGLang's backend for device "cpu" is gloo too). The ``tcp://`` rendezvous reads the process
    environment (torch ``distributed/rendezvous.py`` ``_create_c10d_store``): with
    ``TORCHELASTIC_USE_AGENT_STORE=True`` -- inherited from a torchrun worker -- rank 0 does not host the
    store but waits as a client of one nobody hosts, so the worker never comes up, exactly as SGLang
    does not. Launchers give engines an explicit environment (``rollout/launcher.py`` ``engine_env``).
    Weight-update groups (``parallel/side_group.py``) are built beside this group, as in SGLang.
    Returns the init method used."""
    import datetime

    import torch.distributed as dist

    port = nccl_port or _free_port_below_ephemeral()
    bind = host or "127.0.0.1"
    init_method = f"tcp://[{bind}]:{port}" if ":" in bind else f"tcp://{bind}:{port}"
    timeout = datetime.timedelta(seconds=dist_timeout) if dist_timeout else None
    log.info("init torch.distributed: backend=gloo init_method=%s world_size=1 rank=0", init_method)
    dist.init_process_group(backend="gloo", init_method=init_method, world_size=1, rank=0, timeout=timeout)
    return init_method


def _free_port_below_ephemeral(low: int = 22000, high: int = 29999, attempts: int = 64) -> int:
    """SGLang 0.5.23 ``utils/network.py`` ``get_free_port_below_ephemeral``: a free port in
    [low, min(high, ephemeral start - 1)] (bound later, so kept out of the range connect() uses)."""
    import random
    import socket
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = min(high, int(f.read().split()[0]) - 1)
    except (OSError, ValueError, IndexError):
        high = min(high, 32767)
    if high - low + 1 >= attempts:
        for port in random.sample(range(low, high + 1), attempts):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("0.0.0.0", port))
                except OSError:
                    continue
                return port
    from megatron_m2po.utils.net import free_port
    return free_port("")


def ledger_gpu(base_gpu_id: int) -> int:
    """The node's GPU index of an engine on ``--base-gpu-id`` (its ``CUDA_VISIBLE_DEVICES`` entry when
    set), under which it records in the memory ledger (``memory_ledger.py``)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return base_gpu_id
    if base_gpu_id >= len(visible) or not visible[base_gpu_id].isdigit():
        raise ValueError(f"--base-gpu-id {base_gpu_id} with CUDA_VISIBLE_DEVICES={','.join(visible)}: the "
                         "memory ledger needs an integer GPU index there")
    return int(visible[base_gpu_id])


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
    p.add_argument("--nccl-port", type=int, default=None,
                   help="Port of the worker's own torch.distributed init (SGLang's flag; default: a free port).")
    p.add_argument("--dist-timeout", type=int, default=None,
                   help="Timeout (s) of that init (SGLang's flag; default: torch's).")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="Capture every MoE layer's top-k expert ids per token (SGLang's flag); requests ask "
                        "for them with return_routed_experts.")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="Serve FP8 (modelopt fake quantisation); an FP8 checkpoint is detected from config.json.")
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="SGLang's flag: /release_memory_occupation frees the weights / KV (cpu_memory_saver.py).")
    p.add_argument("--enable-weights-cpu-backup", action="store_true",
                   help="SGLang's flag: released weights are kept in a CPU copy and come back on resume "
                        "(without it their content after a resume is undefined: NaN here).")
    p.add_argument("--base-gpu-id", type=int, default=0,
                   help="SGLang's flag: the engine's GPU among CUDA_VISIBLE_DEVICES (the memory ledger's GPU).")
    p.add_argument("--tp-size", type=int, default=1,
                   help="SGLang's flag, as a client sees it: server_info's tp_size, and per-rank payloads "
                        "(/update_weights_from_tensor, /load_lora_adapter_from_tensors) read by that many ranks, "
                        "each its own entry; the model is served whole.")
    cpu_worker_lora.add_args(p)
    args = p.parse_args(argv)
    try:
        lora = cpu_worker_lora.settings_from_args(args)
    except ValueError as e:  # SGLang's launch fails on these checks (arg_groups/lora_hook.py)
        p.error(str(e))
    if not os.path.isfile(os.path.join(args.model_path, "config.json")):
        p.error(f"--model-path {args.model_path!r} is not an HF model directory (no config.json)")
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.server").addFilter(_DropH2Probe())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    from aiohttp import web
    # Before the model loads, as SGLang's scheduler initialises its process groups before load_model.
    init_torch_distributed(args.host, args.nccl_port, args.dist_timeout)
    nccl_emulation.enable(nccl_emulation.engine_version())  # weight-update groups check versions as NCCL does
    try:
        engine = Engine(args.model_path, max_running=args.max_running_requests, seed=args.seed,
                        weight_version=args.weight_version, dist_timeout_s=args.dist_timeout_s,
                        quantization=args.quantization,
                        enable_return_routed_experts=args.enable_return_routed_experts,
                        memory_saver=args.enable_memory_saver, weights_cpu_backup=args.enable_weights_cpu_backup,
                        gpu=ledger_gpu(args.base_gpu_id), owner=f"cpu_worker@{args.host}:{args.port}", lora=lora,
                        tp_size=args.tp_size)
    except cpu_worker_lora.LoRAStartError as e:
        p.error(str(e))
    log.info("serving %s on http://%s:%d", args.model_path, args.host, args.port)
    web.run_app(WorkerApp(engine).build(), host=args.host, port=args.port, print=None, access_log=None,
                shutdown_timeout=2.0)


if __name__ == "__main__":
    main()
