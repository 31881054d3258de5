"""Collectives on the CPU platform refuse what NCCL would refuse: host tensors on accelerator groups.

On GPUs the trainer's default process group and every group Megatron-Core derives from it are
NCCL, and NCCL has no CPU backend: ``dist.all_reduce(torch.tensor([1]))`` on such a group fails
with "No backend type associated with device type cpu" (``ProcessGroup::getBackend`` in torch's
``ProcessGroup.hpp``). On the CPU platform every group is gloo, which takes the same call, so a
tensor created without a device passes every CPU test and stops the first step on a cluster.
This module makes the emulation fail the same way.

Two facts are tracked:

- **Host-born tensors**: a tensor that lives in host memory on a GPU machine too. A torch call
  that takes no tensor argument and names no device (``torch.tensor([1])``, ``torch.zeros(3)``,
  ``torch.from_numpy(a)``) makes one, as does ``Tensor.cpu()``; a call whose tensor arguments are
  all host-born, naming no device, makes another (``t.long()``, ``t * 2``, ``torch.stack([a, b])``).
  A call that names a device is given the benefit of the doubt: ``device=x.device`` is a CPU
  device here even when ``x`` would be on the GPU in production. ``Tensor.cuda()`` / ``.to("cuda")``
  give an accelerator tensor, as on a GPU (``standins/cpu_platform.py`` makes them keep the data here).
- **Accelerator groups**: every group except those created with an explicit ``backend="gloo"``
  (``dist.new_group(..., backend="gloo")``, Megatron's ``*_gloo`` groups). The default group is an
  accelerator group: the actor creates it as NCCL whenever CUDA is present (``actor/actor.py``
  ``init_parallel``), and Megatron's groups without a backend inherit it (``parallel_state.py``
  ``create_group(backend=None)``).

The public collectives of ``torch.distributed`` that take tensors (``all_reduce``, ``broadcast``,
``all_gather``, ``all_gather_into_tensor``, ``reduce_scatter``, ``reduce_scatter_tensor``,
``reduce``, ``gather``, ``scatter``, ``all_to_all``, ``all_to_all_single``, ``send``, ``recv``
and ``batch_isend_irecv``'s ops) are wrapped: a host-born tensor on an accelerator group raises
``RuntimeError`` with NCCL's message and what to do. Object collectives
(``broadcast_object_list`` ...) place their own buffers and are not checked; nor are calls that
bypass the module attribute (``from torch.distributed import all_reduce`` before :func:`install`,
or ``ProcessGroup`` methods called directly). ``isend`` / ``irecv`` stay unwrapped: ``P2POp``
checks them by identity; the batched path checks its ops instead.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["install", "is_host_born", "mark_host_group", "track", "to_accelerator", "to_accelerator_module"]

HOST_ATTR = "_m2po_host_born"
_HOST_GROUPS: "set[int]" = set()  # id() of groups that are gloo in production too
_INSTALLED = False

# (function name, positional index of the group argument); tensors are found in every argument.
_COLLECTIVES: dict[str, int] = {
    "all_reduce": 2, "broadcast": 2, "reduce": 3, "all_gather": 2, "all_gather_into_tensor": 2,
    "reduce_scatter": 3, "reduce_scatter_tensor": 3, "gather": 3, "scatter": 3, "all_to_all": 2,
    "all_to_all_single": 4, "send": 2, "recv": 2,
}


def is_host_born(t: Any) -> bool:
    """Whether ``t`` is a tensor that would live in host memory on a GPU machine too."""
    return isinstance(t, torch.Tensor) and t.__dict__.get(HOST_ATTR, False)


def mark_host_group(group: Any) -> Any:
    """Declare ``group`` a host (gloo) group in production too; returns it."""
    if group is not None:
        _HOST_GROUPS.add(id(group))
    return group


def _tensors(values) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def _mark(result: Any) -> None:
    if isinstance(result, torch.Tensor):
        result.__dict__[HOST_ATTR] = True
    elif isinstance(result, (list, tuple)):
        for r in result:
            if isinstance(r, torch.Tensor):
                r.__dict__[HOST_ATTR] = True


def track(func: Callable, args: tuple, kwargs: dict, result: Any) -> Any:
    """Mark ``result`` host-born when ``func(*args, **kwargs)``, which names no device, makes a host
    tensor (see the module docstring). Called by the CPU platform's torch-function mode."""
    if not isinstance(result, (torch.Tensor, list, tuple)):
        return result
    if func is torch.Tensor.cpu:
        _mark(result)
        return result
    inputs = _tensors(args) + _tensors(kwargs.values())
    if all(t.__dict__.get(HOST_ATTR, False) for t in inputs):  # no tensor input: a factory
        _mark(result)
    return result


def to_accelerator(t: torch.Tensor) -> torch.Tensor:
    """What ``t.cuda()`` / ``t.to("cuda")`` gives on the CPU platform: ``t`` itself unless it is host-born,
    else an alias of its data that is not (on a GPU the copy is a new tensor; the original stays on the host)."""
    if not is_host_born(t):
        return t
    alias = t.view_as(t)
    alias.__dict__.pop(HOST_ATTR, None)
    return alias


def to_accelerator_module(module: torch.nn.Module) -> torch.nn.Module:
    """What ``module.cuda()`` does to the audit's marks: its parameters and buffers are on the accelerator."""
    for t in list(module.parameters()) + list(module.buffers()):
        t.__dict__.pop(HOST_ATTR, None)
    return module


def _group_of(args: tuple, kwargs: dict, pos: int) -> Any:
    if "group" in kwargs:
        return kwargs["group"]
    return args[pos] if len(args) > pos else None


def _refuse(name: str, tensors: list[torch.Tensor], group: Any) -> None:
    host = [t for t in tensors if is_host_born(t)]
    if not host or id(group) in _HOST_GROUPS:
        return
    t = host[0]
    which = "the default group" if group is None else f"group {getattr(group, 'group_name', group)!r}"
    raise RuntimeError(
        f"No backend type associated with device type cpu: torch.distributed.{name} on {which}, which is NCCL "
        f"on GPUs, got a host tensor (shape {tuple(t.shape)}, {t.dtype}) created without a device. "
        "NCCL refuses it on the first step on a GPU cluster (gloo here would take it). Create the tensor on "
        "the group's device (torch.device('cuda', torch.cuda.current_device()) when "
        "dist.get_backend(group) == 'nccl') or use a gloo group (standins/collective_audit.py).")


def _checked(name: str, fn: Callable, pos: int) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        _refuse(name, _tensors(args) + _tensors(kwargs.values()), _group_of(args, kwargs, pos))
        return fn(*args, **kwargs)

    call.__m2po_audited__ = True
    return call


def _checked_batch(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(p2p_op_list, *args, **kwargs):
        for op in p2p_op_list:
            _refuse(f"batch_isend_irecv ({getattr(op.op, '__name__', op.op)})", [op.tensor], op.group)
        return fn(p2p_op_list, *args, **kwargs)

    call.__m2po_audited__ = True
    return call


def _new_group(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        group = fn(*args, **kwargs)
        if backend is not None and str(backend).lower() == "gloo":
            mark_host_group(group)
        return group

    return call


def install() -> None:
    """Wrap ``torch.distributed``'s tensor collectives and ``new_group`` (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    for name, pos in _COLLECTIVES.items():
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "__m2po_audited__", False):
            setattr(dist, name, _checked(name, fn, pos))
    dist.batch_isend_irecv = _checked_batch(dist.batch_isend_irecv)
    dist.new_group = _new_group(dist.new_group)
    _INSTALLED = True
