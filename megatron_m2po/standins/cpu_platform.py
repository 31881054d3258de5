"""CPU emulation of the CUDA calls Megatron-Core makes, so the real Megatron code path runs on gloo.

Megatron-Core 0.16 assumes a GPU: it calls ``torch.cuda.current_device()`` in ~175 places,
allocates with ``device="cuda"`` / ``.cuda()`` in ~80, keeps its model-parallel RNG streams in
the CUDA generator, and asserts CUDA tensor type names in the optimizer. Patching call sites one
by one does not scale and breaks with every release; one global layer does. :func:`enable`
installs it, once, and only on a machine without CUDA (it raises otherwise: on a GPU the real
CUDA path must run, never this emulation).

What :func:`enable` changes, and why:

1. ``torch.cuda.current_device`` -> 0, ``device_count`` -> 1, ``set_device`` / ``synchronize`` /
   ``empty_cache`` / ``reset_peak_memory_stats`` -> no-ops, ``memory_allocated`` /
   ``max_memory_allocated`` / ``memory_reserved`` / ``max_memory_reserved`` -> 0,
   ``memory_stats`` -> {}: Megatron queries these for placement and logging only.
   ``torch.cuda.is_available()`` is left False (honest for code that branches on it).
2. ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` / ``manual_seed_all`` /
   ``initial_seed`` -> the CPU default generator, and Megatron's
   ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` likewise: the
   model-parallel RNG tracker forks "the CUDA generator", which on CPU is the one generator
   that dropout and init actually draw from. Megatron's warning "CPU RNG state changed within
   GPU RNG context" is then expected (both are the same generator) and is filtered out.
3. ``Tensor.cuda`` / ``Module.cuda`` -> no-ops returning self (data stays on the CPU; a host-born
   tensor, change 8, gives an alias that is not);
   ``Tensor.pin_memory`` -> identity (pinning needs a CUDA host allocator).
4. A ``torch.overrides.TorchFunctionMode`` (pushed once, never popped) rewrites every
   ``device=`` argument that names CUDA (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")``,
   or a bare int index) to ``"cpu"`` and drops ``pin_memory=True``, on every torch function
   and tensor method (factories, ``Tensor.to``, ``Tensor.new_*``). Positional device
   arguments of ``Tensor.to`` are rewritten too.
5. ``Tensor.type()`` without arguments reports ``torch.cuda.FloatTensor`` (and the Half /
   BFloat16 / other names) for CPU tensors: Megatron's optimizer and grad clipping assert
   these names (``param.grad.type() == 'torch.cuda.FloatTensor'``). With an argument,
   ``Tensor.type(dtype)`` keeps its conversion behaviour.
6. ``torch.cuda.Stream`` / ``Event`` / ``current_stream`` / ``stream`` / ``nvtx`` ranges ->
   small CPU stand-ins that do nothing (there is one synchronous CPU stream).
7. The autograd engine does not carry torch-function modes into backward
   (``torch._C._len_torch_function_stack()`` is 0 inside ``Function.backward``), so change 4
   would not apply to the allocations Megatron makes in backward: the sequence-parallel
   gather of ``_ReduceScatterToSequenceParallelRegion.backward`` (``tensor_parallel/mappings.py``,
   ``torch.empty(..., device=torch.cuda.current_device())``) and the forward that full
   recomputation re-runs in ``CheckpointFunction.backward`` (``tensor_parallel/random.py``).
   ``BackwardCFunction.apply`` (``torch/autograd/function.py``, the entry point of every custom
   Function's backward) is wrapped to re-enter the mode when it is not already active.

8. Collectives refuse what NCCL refuses: the mode of change 4 also marks tensors born in host
   memory (created without a device, or by ``.cpu()``), and ``torch.distributed``'s tensor
   collectives raise NCCL's "No backend type associated with device type cpu" for such a tensor
   on a group that is NCCL on GPUs (every group but explicit gloo ones). Gloo would take it, and
   the first step on a cluster would not (``standins/collective_audit.py``).

10. Weight-update groups compare NCCL versions as NCCL's communicator init does
   (``standins/nccl_emulation.py``): this process states ``M2PO_STANDIN_TRAINER_NCCL_VERSION``.

Nothing else in the package special-cases the CPU beyond choosing gloo, the local layer spec
and turning fused kernels off (see ``actor/model.py``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_m2po.standins import collective_audit, moe_cpu, nccl_emulation

__all__ = ["enable", "is_enabled"]

_ENABLED = False
_MODE: "_CpuDeviceMode | None" = None

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.int16: "torch.cuda.ShortTensor",
    torch.int8: "torch.cuda.CharTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def is_enabled() -> bool:
    return _ENABLED


def _is_cuda_device(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, int) and not isinstance(d, bool)


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU on every torch call (change 4)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        named = kwargs.get("device") is not None
        if named and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, int, torch.device)) \
                and not isinstance(args[1], bool):
            named = True
            if _is_cuda_device(args[1]):
                args = (args[0], "cpu", *args[2:])
        out = func(*args, **kwargs)
        if named:  # a named device may be the accelerator's in production (device=x.device): not host-born
            return collective_audit.to_accelerator(out) if isinstance(out, torch.Tensor) else out
        return collective_audit.track(func, args, kwargs, out)


class _NullStream:
    """A CPU stand-in for ``torch.cuda.Stream`` / ``Event`` (change 6): everything is synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *a: Any) -> None: ...
    def wait_event(self, *a: Any) -> None: ...
    def synchronize(self) -> None: ...
    def record(self, *a: Any) -> None: ...
    def record_event(self, *a: Any) -> "_NullStream":
        return _NullStream()
    def query(self) -> bool:
        return True
    def wait(self, *a: Any) -> None: ...
    def elapsed_time(self, *a: Any) -> float:
        return 0.0

    def __enter__(self) -> "_NullStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _RngWarningFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _tensor_type(orig):
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = _CUDA_TYPE_NAMES.get(self.dtype)
            if name is not None and self.device.type == "cpu":
                return name
            return orig(self)
        return orig(self, dtype, non_blocking, **kwargs)

    return type_


def enable() -> None:
    """Install the CPU emulation (idempotent). Raises RuntimeError when CUDA is available."""
    global _ENABLED, _MODE
    if _ENABLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("cpu_platform.enable() called on a machine with CUDA: the emulation must never "
                           "replace the real GPU path; do not call it when torch.cuda.is_available()")
    _answer_device_queries(torch.cuda)
    _cpu_generator_plays_cuda(torch.cuda)
    _moves_stay_on_cpu()
    _null_streams(torch.cuda)

    # 4. device-argument rewriting, for the rest of the process
    _MODE = _CpuDeviceMode()
    _MODE.__enter__()

    # 8. collectives refuse host tensors on groups that are NCCL in production
    collective_audit.install()
    moe_cpu.install()  # 9. what Megatron's MoE layer needs that gloo / a TE-less install lack (standins/moe_cpu.py)
    # 10. weight-update groups compare NCCL versions as NCCL does (standins/nccl_emulation.py)
    nccl_emulation.enable(nccl_emulation.trainer_version())

    _mode_in_backward(_MODE)
    _megatron_rng_on_cpu()
    _ENABLED = True


def _answer_device_queries(cuda: Any) -> None:
    """1. device queries, synchronisation, memory statistics."""
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, lambda *a, **k: 0)
    cuda.memory_stats = lambda *a, **k: {}
    cuda.get_device_capability = lambda *a, **k: (0, 0)
    cuda.get_device_name = lambda *a, **k: "cpu (emulated cuda)"


def _cpu_generator_plays_cuda(cuda: Any) -> None:
    """2. RNG: the CPU default generator plays the CUDA generator."""
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the generator directly.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed)) and None
    cuda.manual_seed_all = cuda.manual_seed
    cuda.random.manual_seed = cuda.manual_seed
    cuda.random.manual_seed_all = cuda.manual_seed
    cuda.initial_seed = torch.initial_seed


def _moves_stay_on_cpu() -> None:
    """3. ``.cuda()`` / ``pin_memory``, and 5. the CUDA type names."""
    torch.Tensor.cuda = lambda self, *a, **k: collective_audit.to_accelerator(self)
    torch.nn.Module.cuda = lambda self, *a, **k: collective_audit.to_accelerator_module(self)
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    torch.Tensor.type = _tensor_type(torch.Tensor.type)


def _null_streams(cuda: Any) -> None:
    """6. streams, events, nvtx."""
    cuda.Stream = _NullStream
    cuda.Event = _NullStream
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None
    cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()


def _mode_in_backward(mode: _CpuDeviceMode) -> None:
    """7. the same rewriting inside custom autograd Functions' backward."""
    from torch.autograd import function as autograd_function

    backward_apply = autograd_function.BackwardCFunction.apply

    def apply_with_mode(self, *args):
        if mode in torch.overrides._get_current_function_mode_stack():
            return backward_apply(self, *args)
        with mode:
            return backward_apply(self, *args)

    autograd_function.BackwardCFunction.apply = apply_with_mode


def _megatron_rng_on_cpu() -> None:
    """2 (Megatron side): its own copies of the CUDA RNG accessors."""
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:  # megatron not installed: the torch-level layer is still useful
        return
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    logging.getLogger(mrandom.__name__).addFilter(_RngWarningFilter())
