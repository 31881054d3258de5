"""SGLang 0.5.23's memory release and resume (``--enable-memory-saver``), for the CPU worker.

What SGLang does (``managers/scheduler_components/weight_updater.py``
``release_memory_occupation`` / ``resume_memory_occupation``, ``utils/torch_memory_saver_adapter.py``,
``constants.py`` ``GPU_MEMORY_ALL_TYPES``), and what the worker does instead where SGLang dies:

- Tags ``kv_cache``, ``weights``, ``cuda_graph``; ``tags`` None or ``[]`` = all three. Every tag is
  added to ``offload_tags`` (an unknown one too: it releases nothing, and resuming it is fine).
- Release asserts the engine is fully idle (``is_fully_idle(ignore_waiting=<scheduler paused>)``:
  nothing running, nothing waiting unless paused with retract). A failed assert kills SGLang's
  scheduler; the worker refuses with :class:`OccupationError`, releasing nothing.
- ``kv_cache``: torch-memory-saver pauses the KV pool (its pages are unmapped) and the radix cache
  is flushed. ``weights``: the model's buffers are stashed (cloned), then the weight pages are
  unmapped; the content is thrown away unless ``--enable-weights-cpu-backup`` (a CPU copy).
  ``cuda_graph``: nothing to release on CPU.
- Without ``--enable-memory-saver`` SGLang's adapter is a no-op: the tags are recorded and the cache
  flushed, but nothing leaves the device (the ledger keeps the bytes: a trainer that reloads then
  finds its GPU full, as it would).
- Releasing a tag again: torch-memory-saver refuses to pause a paused region ("Cannot pause
  allocation that is already paused") and the weights' stash reads unmapped memory -- the scheduler
  dies. Resuming a tag that is not released: ``offload_tags.remove`` raises ``KeyError`` -- it dies
  too. The worker refuses both (:class:`OccupationError`).
- Resume ``weights``: new pages are mapped at the same addresses and the buffers come back from the
  stash; the parameters hold the CPU backup when there is one, else whatever the new pages hold --
  the worker fills them with NaN, so a run that forgets to push weights after a resume fails loudly.
- While ``weights`` or ``kv_cache`` are released (memory saver on), a forward reads unmapped memory:
  SGLang crashes with an illegal memory access. The worker refuses the request instead
  (:meth:`MemorySaver.refusal`), and refuses a weight update while ``weights`` are released.

Here the parameters' storages really leave: each is resized to 0 bytes (any read fails), and
resized back on resume. What the worker holds per GPU goes to the node's memory ledger
(``memory_ledger.py``): weights and KV bytes under ``<owner>:weights`` / ``<owner>:kv_cache``,
0 while released.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional

import torch

from megatron_m2po.standins.memory_ledger import MemoryLedger

log = logging.getLogger("m2po.cpu_worker")

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"  # constants.py GPU_MEMORY_TYPE_*
ALL_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)  # constants.py GPU_MEMORY_ALL_TYPES
NOT_IDLE = "release_memory_occupation should be called only when server is idle."


class OccupationError(RuntimeError):
    """A release / resume / request that SGLang's scheduler would die of; the worker refuses it."""


class MemorySaver:
    """The occupation state of one engine: released tags, the model's storages, the ledger records.

    ``kv_bytes``: what the engine reserves for KV (the ledger's ``kv_cache`` entry while resident).
    ``ledger`` / ``gpu`` / ``owner``: where to record (None: no ledger). Methods run on the worker's
    model thread (between two scheduler steps), as SGLang runs them in its scheduler loop.
    """

    def __init__(self, model: torch.nn.Module, *, enabled: bool, cpu_backup: bool, kv_bytes: int,
                 ledger: Optional[MemoryLedger] = None, gpu: int = 0, owner: str = "cpu_worker") -> None:
        self.model, self.enabled, self.cpu_backup, self.kv_bytes = model, enabled, cpu_backup, int(kv_bytes)
        self.ledger, self.gpu, self.owner = ledger, gpu, owner
        self.offload_tags: set[str] = set()
        self.stashed_buffers: Optional[list[tuple[str, torch.Tensor]]] = None
        self.backup: Optional[list[torch.Tensor]] = None
        self.sizes: list[int] = []  # bytes of each tensor's storage while released
        if enabled:  # every storage resizable (a checkpoint's may be a read-only file mapping)
            for t in self._tensors():
                if not t.untyped_storage().resizable():
                    t.data = t.data.clone()
        self.weights_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                  for t in self._tensors()}.values())
        self._record(WEIGHTS, self.weights_bytes)
        self._record(KV_CACHE, self.kv_bytes)

    def _tensors(self) -> list[torch.Tensor]:
        seen, out = set(), []
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
        return out

    def _record(self, tag: str, nbytes: int) -> None:
        if self.ledger is not None:
            self.ledger.record(self.gpu, f"{self.owner}:{tag}", nbytes)

    @staticmethod
    def tags_of(tags: Optional[Iterable[str]]) -> list[str]:
        """The tags a request names (None or empty: all of them)."""
        if tags is not None and (isinstance(tags, str) or not all(isinstance(t, str) for t in tags)):
            raise ValueError(f"tags must be a list of strings or null, got {tags!r}")
        return list(tags) if tags else list(ALL_TAGS)

    def refusal(self, what: str = "a generation", tags: Optional[Iterable[str]] = None) -> Optional[str]:
        """Why ``what`` cannot run now (None: it can): the memory of ``tags`` (default: weights and KV)
        released under the memory saver."""
        gone = [t for t in (tags or (WEIGHTS, KV_CACHE)) if t in self.offload_tags] if self.enabled else []
        if not gone:
            return None
        return (f"{what} reached an engine whose {' and '.join(gone)} memory is released "
                "(/release_memory_occupation); SGLang 0.5.23 would read unmapped device memory and crash "
                "(illegal memory access). Call /resume_memory_occupation first.")

    def release(self, tags: Optional[Iterable[str]], idle: bool, flush: Callable[[], object]) -> None:
        tags = self.tags_of(tags)
        if not idle:
            raise OccupationError(NOT_IDLE + " (SGLang 0.5.23 asserts it; the failed assert kills its scheduler)")
        again = [t for t in tags if t in self.offload_tags and t in ALL_TAGS]
        if again and self.enabled:
            raise OccupationError(f"release_memory_occupation: {again} already released (torch-memory-saver: "
                                  "'Cannot pause allocation that is already paused'; SGLang's scheduler dies)")
        self.offload_tags.update(tags)
        if KV_CACHE in tags:
            flush()
            if self.enabled:
                self._record(KV_CACHE, 0)
        if WEIGHTS in tags:
            # weight_updater.py _export_static_state: the buffers, cloned, before the pages go
            self.stashed_buffers = [(n, b.detach().clone()) for n, b in self.model.named_buffers()]
            if self.enabled:
                self._release_weights()

    def _release_weights(self) -> None:
        tensors = self._tensors()
        # torch_memory_saver region(enable_cpu_backup=True): the content is copied to host memory
        self.backup = [t.detach().clone() for t in tensors] if self.cpu_backup else None
        self.sizes = [t.untyped_storage().nbytes() for t in tensors]
        for t in tensors:
            t.untyped_storage().resize_(0)
        self._record(WEIGHTS, 0)
        log.info("released %d weight bytes (cpu backup: %s)", self.weights_bytes, self.cpu_backup)

    def resume(self, tags: Optional[Iterable[str]]) -> None:
        tags = self.tags_of(tags)
        missing = [t for t in tags if t not in self.offload_tags]
        if missing:
            raise OccupationError(f"resume_memory_occupation: {missing} not released (SGLang 0.5.23: KeyError in "
                                  "offload_tags.remove; its scheduler dies)")
        if WEIGHTS in tags:
            if self.enabled:
                self._record(WEIGHTS, self.weights_bytes)  # GpuBudgetExceeded: nothing resumed
                self._resume_weights()
            self._restore_buffers()
            self.offload_tags.discard(WEIGHTS)
        if KV_CACHE in tags:
            if self.enabled:
                self._record(KV_CACHE, self.kv_bytes)
            self.offload_tags.discard(KV_CACHE)
        self.offload_tags.difference_update(tags)

    def _resume_weights(self) -> None:
        with torch.no_grad():
            for i, t in enumerate(self._tensors()):
                t.untyped_storage().resize_(self.sizes[i])
                if self.backup is not None:
                    t.copy_(self.backup[i])
                elif t.is_floating_point():
                    t.fill_(float("nan"))  # the new pages' content is undefined
                else:
                    t.zero_()
        self.backup = None
        log.info("resumed %d weight bytes (%s)", self.weights_bytes,
                 "from the cpu backup" if self.cpu_backup else "content undefined: NaN until weights are pushed")

    def _restore_buffers(self) -> None:
        # weight_updater.py _import_static_state
        named = dict(self.model.named_buffers())
        with torch.no_grad():
            for name, value in self.stashed_buffers or []:
                named[name][...] = value
        self.stashed_buffers = None
