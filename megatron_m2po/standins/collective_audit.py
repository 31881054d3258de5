"""Collectives on the CPU platform refuse what NCCL would refuse (host tensors on accelerator groups)
and count what they would stage on the GPU.

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
``RuntimeError`` with NCCL's message and what to do. Calls that bypass the module attribute
(``from torch.distributed import all_reduce`` before :func:`install`, or ``ProcessGroup`` methods
called directly) are not checked. ``isend`` / ``irecv`` stay unwrapped: ``P2POp`` checks them by
identity; the batched path checks its ops instead.

**Staging.** What a collective holds on the accelerator is counted too (:func:`staging_peak`, the
largest single call on this rank since :func:`reset_staging`; host groups count nothing): a tensor
collective, the bytes of its tensors; an object collective (``broadcast_object_list``,
``scatter_object_list``, ``all_gather_object``, ``gather_object``, ``send_object_list``,
``recv_object_list``), what torch allocates for it on the group's device, from the pickled sizes
of the objects (:func:`object_staging_bytes`). On NCCL that device is the GPU
(``_get_object_coll_device``), so ``scatter_object_list`` of a step's samples from rank 0 stages
every rank's pickled part there, each padded to the largest; on gloo it stages nothing on a GPU,
which is why no CPU run could see it. The sizes a rank cannot know alone (the largest object of
a scatter on a receiver, of a gather off the destination) are exchanged with the unwrapped
object collective right after the call.
"""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["install", "is_host_born", "mark_host_group", "track", "to_accelerator", "to_accelerator_module",
           "StagingPeak", "staging_peak", "reset_staging", "object_staging_bytes", "pickled_size"]

HOST_ATTR = "_m2po_host_born"
_HOST_GROUPS: "set[int]" = set()  # id() of groups that are gloo in production too
_INSTALLED = False
_ORIGINAL: dict[str, Callable] = {}  # the unwrapped object collectives (the audit's own size exchanges)

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
        tensors, group = _tensors(args) + _tensors(kwargs.values()), _group_of(args, kwargs, pos)
        _refuse(name, tensors, group)
        if id(group) not in _HOST_GROUPS:
            _note(name, _tensor_bytes(tensors))
        return fn(*args, **kwargs)

    call.__m2po_audited__ = True
    return call


def _checked_batch(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(p2p_op_list, *args, **kwargs):
        for op in p2p_op_list:
            _refuse(f"batch_isend_irecv ({getattr(op.op, '__name__', op.op)})", [op.tensor], op.group)
        _note("batch_isend_irecv", _tensor_bytes([op.tensor for op in p2p_op_list if id(op.group) not in _HOST_GROUPS]))
        return fn(p2p_op_list, *args, **kwargs)

    call.__m2po_audited__ = True
    return call


# ------------------------------------------------------------------------------------------ staging


@dataclass(frozen=True)
class StagingPeak:
    """The most bytes one collective call held on this rank's accelerator, and which call."""

    bytes: int = 0
    call: str = ""


_PEAK = StagingPeak()


def staging_peak() -> StagingPeak:
    """This rank's :class:`StagingPeak` since :func:`reset_staging` (or :func:`install`)."""
    return _PEAK


def reset_staging() -> None:
    global _PEAK
    _PEAK = StagingPeak()


def _note(call: str, nbytes: int) -> None:
    global _PEAK
    if nbytes > _PEAK.bytes:
        _PEAK = StagingPeak(int(nbytes), call)


def _tensor_bytes(tensors: list) -> int:
    """Bytes of ``tensors``, a tensor passed twice (one buffer sent to several peers) once."""
    seen = {(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if isinstance(t, torch.Tensor)}
    return sum(n for _, n in seen)


def pickled_size(obj: Any) -> int:
    """Bytes of ``obj`` as torch's object collectives pickle it (``distributed_c10d._object_to_tensor``)."""
    f = io.BytesIO()
    dist.distributed_c10d._pickler(f).dump(obj)
    return f.tell()


def object_staging_bytes(name: str, sizes: list[int], *, world: int, me: int, root: Optional[int] = None) -> int:
    """Bytes torch's object collective ``name`` allocates on the device of group rank ``me`` of a
    ``world``-rank group (torch 2.13 ``distributed_c10d.py``; the device is the GPU on NCCL).

    ``sizes``: the pickled sizes (:func:`pickled_size`) of the objects the call moves: the list of
    ``broadcast_object_list`` / ``send_object_list`` / ``recv_object_list``, one per group rank for
    ``scatter_object_list`` / ``all_gather_object`` / ``gather_object``. ``root``: the group rank of
    the source (broadcast, scatter) or destination (gather); for the point-to-point pair, ``me ==
    root`` is the sender. What each allocates, by torch's code (``M`` the largest size, ``S`` the sum,
    ``n`` the count; 8 B per int64 size tensor):

    - ``broadcast_object_list``: source ``_object_to_tensor`` per object (``S``), their sizes and
      ``torch.cat`` of them (``16n``), and ``torch.cat`` of the objects when ``n > 1`` (``S`` more);
      others the sizes and ``S``.
    - ``scatter_object_list``: source one tensor per rank ``resize_``-d to ``M`` (``world x M``), its
      own receive buffer ``M``, the sizes (``8 world``) and its size scalar; others ``M`` and two scalars.
    - ``all_gather_object``: every rank its tensor resized to ``M``, the ``world x M`` coalesced
      output, the sizes (``8 world + 8``).
    - ``gather_object``: every rank its tensor resized to ``M`` and the sizes; the destination
      also the ``world x M`` output.
    - ``send_object_list``: as a broadcast source; ``recv_object_list``: as a broadcast receiver.
    """
    n, total, big = len(sizes), sum(sizes), max(sizes, default=0)
    if name in ("broadcast_object_list", "send_object_list") and (name == "send_object_list" or me == root):
        return total + 16 * n + (total if n > 1 else 0)
    if name in ("broadcast_object_list", "recv_object_list"):
        return total + 8 * n
    if name == "scatter_object_list":
        return world * big + big + 8 * world + 8 if me == root else big + 16
    if name == "all_gather_object":
        return (world + 1) * big + 8 * world + 8
    if name == "gather_object":
        return big + 8 * world + 8 + (world * big if me == root else 0)
    raise ValueError(f"object collective {name!r}: no staging rule")


def _group_rank(group: Any, global_or_group: Optional[int], group_form: Optional[int]) -> int:
    """The group rank of a ``src`` / ``dst`` given as a global rank or as ``group_src`` / ``group_dst``."""
    if group_form is not None:
        return int(group_form)
    g = group if group is not None else dist.group.WORLD
    return dist.get_group_rank(g, 0 if global_or_group is None else int(global_or_group))


def _object_call(name: str, fn: Callable) -> Callable:
    """``fn`` (an object collective), counting what it stages on the accelerator (:func:`_note`)."""
    params = {"broadcast_object_list": ("object_list", "src", "group", "group_src"),
              "scatter_object_list": ("scatter_object_output_list", "scatter_object_input_list", "src", "group",
                                      "group_src"),
              "all_gather_object": ("object_list", "obj", "group"),
              "gather_object": ("obj", "object_gather_list", "dst", "group", "group_dst"),
              "send_object_list": ("object_list", "dst", "group", "device", "group_dst"),
              "recv_object_list": ("object_list", "src", "group", "device", "group_src")}[name]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        a = dict(zip(params, args), **kwargs)
        out = fn(*args, **kwargs)
        group = a.get("group")
        device = a.get("device")
        if id(group) in _HOST_GROUPS or (device is not None and torch.device(device).type == "cpu"):
            return out  # staged in host memory, as on GPUs
        me = dist.get_rank(group)
        if me < 0:  # not a member: torch returned without a collective
            return out
        world = dist.get_world_size(group)
        if name == "broadcast_object_list":
            sizes = [pickled_size(o) for o in a["object_list"]]
            root = _group_rank(group, a.get("src"), a.get("group_src"))
        elif name == "scatter_object_list":
            root = _group_rank(group, a.get("src"), a.get("group_src"))
            box = [[pickled_size(o) for o in a["scatter_object_input_list"]] if me == root else None]
            _ORIGINAL["broadcast_object_list"](box, group=group, group_src=root)  # receivers learn the largest
            sizes = box[0]
        elif name == "all_gather_object":
            sizes, root = [pickled_size(o) for o in a["object_list"]], None
        elif name == "gather_object":
            sizes = [0] * world
            _ORIGINAL["all_gather_object"](sizes, pickled_size(a["obj"]), group=group)
            root = _group_rank(group, a.get("dst"), a.get("group_dst"))
        else:  # the point-to-point pair: the sender's list, or what the receiver got
            sizes = [pickled_size(o) for o in a["object_list"]]
            root = me if name == "send_object_list" else None
        _note(name, object_staging_bytes(name, sizes, world=world, me=me, root=root))
        return out

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
    """Wrap ``torch.distributed``'s tensor and object collectives and ``new_group`` (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    for name, pos in _COLLECTIVES.items():
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "__m2po_audited__", False):
            setattr(dist, name, _checked(name, fn, pos))
    for name in ("broadcast_object_list", "scatter_object_list", "all_gather_object", "gather_object",
                 "send_object_list", "recv_object_list"):
        _ORIGINAL[name] = getattr(dist, name)
        setattr(dist, name, _object_call(name, _ORIGINAL[name]))
    dist.batch_isend_irecv = _checked_batch(dist.batch_isend_irecv)
    dist.new_group = _new_group(dist.new_group)
    _INSTALLED = True
