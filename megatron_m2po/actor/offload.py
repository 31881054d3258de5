"""The trainer's offload and reload for colocated mode (docs/design.md, issue 40).

While colocated engines generate, the trainer's parameters, gradients and optimizer states leave
the GPU; before the next update they come back bit for bit. What moves, and by whose code:

* **Parameter buffers** (the distributed optimizer: every parameter is a view into its DDP
  buffer's ``param_data``): megatron-core 0.16.1's own ``_ParamAndGradBuffer.offload_to_cpu`` /
  ``reload_from_cpu(move_params=True, move_grads=False)`` (``distributed/param_and_grad_buffer.py``):
  a copy to ``param_data_cpu``, then ``storage().resize_(0)``; reload resizes and copies back, and
  every view (the parameters, the buckets, the fp32 main shards of fp32 parameters) is valid again.
  We hand it its host buffer (``param_data_cpu``, pinned on CUDA at its exact size, allocated once): left to itself it
  makes one with ``param_data.cpu().pin_memory()``, which is the *same* tensor on a host-only
  platform (``.cpu()`` of a host tensor returns it; ``standins/cpu_platform.py`` makes pinning the
  identity), so its ``resize_(0)`` would destroy the only copy. verl does the same
  (``verl/utils/megatron_utils.py`` ``offload_megatron_model_to_cpu`` / ``load_megatron_model_to_gpu``).
* **Gradient buffers**: ``DistributedDataParallel.offload_grad_buffers`` / ``restore_grad_buffers``
  (``distributed/distributed_data_parallel.py``): freed, not copied (``resize_(0)``), and zeroed
  when restored; the next update zeroes them first anyway (``zero_grad_buffer``), so nothing is lost.
* **Everything else the update needs** -- parameters outside a parameter buffer (no distributed
  optimizer: Megatron allocates ``param_data`` only with it), the optimizer's fp32 main parameters
  (``Float16OptimizerWithFloat16Params.fp32_from_float16_groups``, the distributed optimizer's
  ``shard_fp32_from_float16_groups``; both are the torch optimizer's ``param_groups``), Adam's
  ``exp_avg`` / ``exp_avg_sq``, and any ``.grad`` that is not a view of a gradient buffer -- moves
  by the same storage mechanism (:class:`_StorageMover`): each device storage is copied into a host
  buffer and resized to 0, so every tensor and view that shares it (dict entries, ``main_param``
  handles, the optimizer's groups) sees its data again after reload. Megatron's own
  ``MegatronOptimizer.offload_to_cpu`` / ``restore_from_cpu`` (``optimizer/optimizer.py``) is not
  used: it re-points ``p.data`` to a new tensor, which for fp32 parameters detaches the optimizer's
  parameters from the model (``FP32Optimizer`` holds the model parameters themselves; the
  distributed optimizer's fp32 shards are views into ``param_data``, ``distrib_optimizer.py``
  ``_build_model_and_main_param_groups``) and so leaves two copies after restore; and it tests
  ``is_cuda``, so on the CPU platform it moves nothing and no CPU test could check it. verl moves
  the distributed optimizer's main shards and states by ``.data`` re-pointing too
  (``offload_megatron_copy_params``, ``offload_megatron_optimizer``) and misses the non-distributed
  ``Float16Optimizer``'s ``fp32_from_float16_groups``, which the storage walk here covers.

What stays on the device is *measured*, not assumed: :meth:`TrainerOffload.census` walks every
tensor the actor's model chunks and optimizer reach (parameters, gradients, module buffers, main
parameters, optimizer states), one count per storage, and the record of an offload holds it
(module buffers such as RoPE's ``inv_freq`` stay; so do tensors on the host already, e.g. torch
Adam's ``step``). On CUDA the record adds ``torch.cuda.memory_allocated`` / ``memory_reserved``
before and after (the CUDA context and NCCL's buffers are outside torch's allocator: the planner
states them, ``plan/colocated.py``).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from typing import Iterator

import torch

from megatron_m2po.utils.pinned import host_empty, host_like

__all__ = ["KINDS", "OFFLOADED", "RESIDENT", "STATES", "OffloadRecord", "TrainerOffload"]

# What the record counts bytes of. ``module_buffers`` are never moved (resident by design).
KINDS = ("params", "grads", "main_params", "optimizer_states", "module_buffers")
# TrainerOffload.state: everything on the device; gradients and optimizer states off (the weights
# readable: the colocated push); everything off.
RESIDENT, STATES, OFFLOADED = "resident", "states", "offloaded"


@dataclass(frozen=True, slots=True)
class OffloadRecord:
    """What one :meth:`TrainerOffload.offload` or :meth:`~TrainerOffload.reload` did, in bytes.

    Attributes:
        direction: ``"offload"`` or ``"reload"``.
        copied: bytes copied device -> host (offload) or host -> device (reload), per kind
            (gradients are freed and re-zeroed, never copied).
        released: device bytes freed (offload) or allocated again (reload), per kind.
        resident: the census after the call (:meth:`TrainerOffload.census`): device bytes of the
            actor's tensors, per kind.
        allocated_before, allocated_after, reserved_after: ``torch.cuda.memory_allocated`` /
            ``memory_reserved`` (0 on the CPU platform, where ``resident`` is the measure).
        seconds: wall time of the call, synchronised.
    """

    direction: str
    copied: dict[str, int] = field(default_factory=dict)
    released: dict[str, int] = field(default_factory=dict)
    resident: dict[str, int] = field(default_factory=dict)
    allocated_before: int = 0
    allocated_after: int = 0
    reserved_after: int = 0
    seconds: float = 0.0

    @property
    def released_bytes(self) -> int:
        return int(sum(self.released.values()))

    @property
    def resident_bytes(self) -> int:
        return int(sum(self.resident.values()))


def _add(d: dict[str, int], kind: str, n: int) -> None:
    d[kind] = d.get(kind, 0) + int(n)


@contextlib.contextmanager
def _megatron_storage_calls() -> Iterator[None]:
    """Around megatron-core 0.16.1's buffer offload / reload: they resize ``tensor.storage()``
    (``param_and_grad_buffer.py`` ``offload_to_cpu`` / ``reload_from_cpu``), which makes torch warn
    "TypedStorage is deprecated" once per process, in every colocated run; that one warning is
    silenced here, where its cause is known (nothing of ours uses typed storages)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
        yield


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of ``storage`` (what a copy of the whole storage reads / writes)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _host_buffer(nbytes: int) -> torch.Tensor:
    """Host memory for exactly ``nbytes``: pinned where CUDA is (asynchronous copies; no
    power-of-two rounding, ``utils/pinned.py``), plain elsewhere."""
    return host_empty(nbytes, pin=torch.cuda.is_available())


@dataclass(slots=True)
class _Moved:
    kind: str
    owner: torch.Tensor      # a tensor of the storage (kept: the storage outlives the offload)
    nbytes: int
    host: torch.Tensor       # uint8 [nbytes] on the host


class _StorageMover:
    """Copies whole device storages to host buffers and frees them (``resize_(0)``), then back.

    Host buffers are kept for the next cycle when the same tensor owns a storage of the same size
    (pinning is slow); a tensor seen through several views or dicts is moved once."""

    def __init__(self) -> None:
        self.moved: list[_Moved] = []
        self._hosts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(owner) -> (owner, host)

    def offload(self, tensors: Iterator[tuple[str, torch.Tensor]], device: torch.device,
                copied: dict[str, int], released: dict[str, int], *, keep: frozenset[int] = frozenset()) -> None:
        """Moves every device storage the tensors reach but those in ``keep`` (data pointers)."""
        assert not self.moved, "offload called twice without reload"
        seen: set[int] = set(keep)
        for kind, t in tensors:
            s = t.untyped_storage()
            n = s.nbytes()
            if t.device.type != device.type or n == 0 or s.data_ptr() in seen:
                continue  # on the host already, freed already (a Megatron buffer's view), counted or kept
            seen.add(s.data_ptr())
            kept = self._hosts.get(id(t))
            host = kept[1] if kept is not None and kept[0] is t and kept[1].numel() == n else _host_buffer(n)
            host.copy_(_byte_view(s), non_blocking=True)
            self.moved.append(_Moved(kind, t, n, host))
            _add(copied, kind, n)
            _add(released, kind, n)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the host copies are complete before the storages are freed
        for m in self.moved:
            m.owner.untyped_storage().resize_(0)
        self._hosts = {id(m.owner): (m.owner, m.host) for m in self.moved}

    def reload(self, copied: dict[str, int], released: dict[str, int]) -> None:
        for m in self.moved:
            s = m.owner.untyped_storage()
            s.resize_(m.nbytes)
            _byte_view(s).copy_(m.host, non_blocking=True)
            _add(copied, m.kind, m.nbytes)
            _add(released, m.kind, m.nbytes)
        self.moved = []


class TrainerOffload:
    """Takes an actor's parameters, gradients and optimizer states off the device and back.

    Lifecycle: resident -> :meth:`offload` -> offloaded -> :meth:`reload` -> resident; calling
    either out of turn raises ``RuntimeError``. Nothing may read the actor's weights while it is
    offloaded (their storages are empty). Rank-local: no collective.

    Example:
        >>> off = TrainerOffload(actor.model, actor.optimizer, actor.device)
        >>> rec = off.offload()      # rec.released: bytes per kind; rec.resident: what stayed
        >>> off.reload()             # bit-identical state
    """

    def __init__(self, ddp_chunks: list, optimizer, device: torch.device) -> None:
        self._chunks = list(ddp_chunks)
        self._optimizer = optimizer
        self._device = device
        self._states = _StorageMover()   # gradients, main parameters, optimizer states
        self._params = _StorageMover()   # parameters outside Megatron's buffers
        self.state = RESIDENT

    @property
    def offloaded(self) -> bool:
        """Whether anything is off the device (:data:`STATES` or :data:`OFFLOADED`)."""
        return self.state != RESIDENT

    def _buffers(self) -> list:
        """Megatron's DDP parameter-and-gradient buffers of every chunk (dense and expert)."""
        out: list = []
        for ddp in self._chunks:
            out += list(ddp.buffers) + list(ddp.expert_parallel_buffers)
        return out

    def _inner_optimizers(self) -> list:
        """The torch optimizers under Megatron's wrappers (a ``ChainedOptimizer`` holds several)."""
        wrappers = getattr(self._optimizer, "chained_optimizers", [self._optimizer])
        return [w.optimizer for w in wrappers if getattr(w, "optimizer", None) is not None]

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(kind, tensor)`` of everything the update reads, model first (a storage is counted
        under the first kind that reaches it: an fp32 parameter the optimizer holds is ``params``)."""
        for ddp in self._chunks:
            for p in ddp.parameters():
                yield "params", p
                for g in (getattr(p, "main_grad", None), p.grad):
                    if isinstance(g, torch.Tensor):
                        yield "grads", g
        for opt in self._inner_optimizers():
            for group in opt.param_groups:
                for p in group["params"]:
                    yield "main_params", p
                    if p.grad is not None:
                        yield "grads", p.grad
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        yield "optimizer_states", v

    def census(self) -> dict[str, int]:
        """Device bytes of the actor's tensors now, per kind (one count per storage; module buffers
        included). On the CPU platform every tensor is on the 'device'; host copies are not walked."""
        out = {k: 0 for k in KINDS}
        seen: set[int] = set()
        # ``ddp.buffers`` is Megatron's list of gradient buffers (it shadows nn.Module.buffers)
        module_buffers = [("module_buffers", b) for ddp in self._chunks for b in ddp.module.buffers()]
        for kind, t in [*self._tensors(), *module_buffers]:
            s = t.untyped_storage()
            if t.device.type != self._device.type or s.nbytes() == 0 or s.data_ptr() in seen:
                continue
            seen.add(s.data_ptr())
            out[kind] += s.nbytes()
        return out

    def _param_storages(self) -> frozenset[int]:
        """Data pointers of the storages the model's parameters live in (Megatron's parameter
        buffers and every parameter's own): what a push reads, kept by :meth:`offload_states`."""
        ptrs = {p.untyped_storage().data_ptr() for ddp in self._chunks for p in ddp.parameters()}
        ptrs |= {b.param_data.untyped_storage().data_ptr() for b in self._buffers() if b.param_data is not None}
        return frozenset(ptrs)

    def offload_states(self) -> OffloadRecord:
        """The first half of :meth:`offload`: gradients (freed), the optimizer's main parameters and
        states (copied) off the device; the parameters stay, so the weights can still be read (the
        colocated push: its peak holds the weights, not the whole training state). A storage that
        a parameter shares (an fp32 model's main parameters are the parameters themselves, or views
        of Megatron's parameter buffer) stays with the parameters."""
        if self.state != RESIDENT:
            raise RuntimeError(f"the trainer is offloaded already ({self.state}): reload() it before offloading again")
        t0, before = time.perf_counter(), _allocated()
        copied: dict[str, int] = {}
        released: dict[str, int] = {}
        cuda = torch.cuda.is_available()
        self._move_states(copied, released, cuda)
        if cuda:
            torch.cuda.empty_cache()  # the engines resume their weights next
        return self._record("offload", t0, before, copied, released)

    def _move_states(self, copied: dict[str, int], released: dict[str, int], cuda: bool) -> None:
        """:meth:`offload_states`' moves, counted into ``copied`` / ``released``."""
        if cuda:
            torch.cuda.synchronize()  # the last update's kernels are done with what moves
        for buf in self._buffers():
            if buf.grad_data is not None:
                _add(released, "grads", buf.grad_data.untyped_storage().nbytes())
        with _megatron_storage_calls():
            for ddp in self._chunks:
                ddp.offload_grad_buffers(synchronize=cuda, empty_cache=False)
        self._states.offload(self._tensors(), self._device, copied, released, keep=self._param_storages())
        self.state = STATES

    def offload(self) -> OffloadRecord:
        """Everything but the census's ``module_buffers`` off the device (module docstring); after
        :meth:`offload_states`, the parameters that it left. The record counts this call's moves."""
        if self.state == OFFLOADED:
            raise RuntimeError("the trainer is offloaded already: reload() it before offloading again")
        t0, before = time.perf_counter(), _allocated()
        copied: dict[str, int] = {}
        released: dict[str, int] = {}
        cuda = torch.cuda.is_available()
        if self.state == RESIDENT:
            self._move_states(copied, released, cuda)
        elif cuda:
            torch.cuda.synchronize()  # a push's copies are done with what moves
        for buf in self._buffers():
            data = buf.param_data
            if data is not None and data.untyped_storage().nbytes() > 0:
                if buf.param_data_cpu is None:  # our host buffer (module docstring: why not Megatron's)
                    buf.param_data_cpu = host_like(data, pin=cuda)
                n = data.untyped_storage().nbytes()
                with _megatron_storage_calls():
                    buf.offload_to_cpu(move_params=True, move_grads=False)
                _add(copied, "params", n)
                _add(released, "params", n)
        self._params.offload(self._tensors(), self._device, copied, released)
        self.state = OFFLOADED
        if cuda:
            # Blocks an engine opened through CUDA IPC (weight buckets of the last push) stay reserved
            # until the trainer learns they were closed: ipc_collect() frees those first, then
            # empty_cache() gives every free block back to the driver (the engines allocate next).
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
        return self._record("offload", t0, before, copied, released)

    def reload(self) -> OffloadRecord:
        """Everything :meth:`offload` (or :meth:`offload_states`) moved back, bit-identical;
        gradient buffers re-zeroed."""
        if self.state == RESIDENT:
            raise RuntimeError("the trainer is not offloaded: nothing to reload")
        t0, before = time.perf_counter(), _allocated()
        copied: dict[str, int] = {}
        released: dict[str, int] = {}
        for buf in self._buffers():
            data = buf.param_data
            if data is not None and data.untyped_storage().nbytes() == 0 and buf.param_data_cpu is not None:
                with _megatron_storage_calls():
                    buf.reload_from_cpu(move_params=True, move_grads=False)
                n = data.untyped_storage().nbytes()
                _add(copied, "params", n)
                _add(released, "params", n)
        with _megatron_storage_calls():
            for ddp in self._chunks:
                ddp.restore_grad_buffers(synchronize=False)
        for buf in self._buffers():
            if buf.grad_data is not None:
                _add(released, "grads", buf.grad_data.untyped_storage().nbytes())
        self._params.reload(copied, released)
        self._states.reload(copied, released)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the host-to-device copies are complete before training reads them
        self.state = RESIDENT
        return self._record("reload", t0, before, copied, released)

    def _record(self, direction: str, t0: float, before: int, copied: dict[str, int],
                released: dict[str, int]) -> OffloadRecord:
        reserved = torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
        return OffloadRecord(direction, copied, released, self.census(), before, _allocated(), reserved,
                             time.perf_counter() - t0)


def _allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
