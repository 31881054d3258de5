"""What Megatron-Core's MoE layer needs on the CPU platform that gloo and a TE-less install lack.

Installed by ``standins/cpu_platform.py`` :func:`~megatron_m2po.standins.cpu_platform.enable` (change 9 there),
after the collective audit, so that the audit still checks every call made here.

1. **Uneven all-gather.** ``MoEAlltoAllTokenDispatcher`` with expert tensor parallelism > 1
   gathers each expert-TP rank's tokens with ``gather_from_sequence_parallel_region(...,
   output_split_sizes=...)`` (``megatron/core/transformer/moe/token_dispatcher.py``,
   ``dispatch_postprocess``), and the backward of ``reduce_scatter_to_sequence_parallel_region``
   with ``input_split_sizes`` (its combine) does the same. Both end in
   ``megatron/core/tensor_parallel/mappings.py`` ``_gather_along_first_dim``, which calls
   ``torch.distributed.all_gather(list(output.split(sizes)), input_)`` with tensors of different
   lengths. NCCL accepts that (``ProcessGroupNCCL::allgather`` falls back to a sequence of
   broadcasts when the output tensors differ in size); gloo refuses it ("ProcessGroupGloo::
   allgather: invalid tensor size at index 1"). :func:`install` wraps ``dist.all_gather``: when
   the outputs differ in size it pads every rank's input to the longest first dimension, gathers
   equal tensors and copies each rank's rows out. Equal sizes go straight to the original call,
   so gloo's own errors (a wrong number of outputs, a dtype mismatch) are unchanged. Gloo's
   ``reduce_scatter`` with uneven inputs and ``all_to_all_single`` with split sizes work as NCCL's
   (checked in ``tests/actor/test_moe.py``) and need nothing.
2. (``te_general_gemm`` without Transformer Engine is not emulated here: a TE-less install fails
   the same way on a GPU, so production binds the name, ``actor/model.py``
   ``actor/te_twin.py _bind_missing_te_gemm``.)
3. **Device-to-host moves of the dispatcher's split sizes.** ``MoEAlltoAllTokenDispatcher``
   moves its token counts off the GPU with ``moe_utils.maybe_move_tensor_to_cpu(t,
   as_numpy=True)`` (``_maybe_dtoh_and_synchronize``), which acts only ``if tensor.is_cuda``: on a
   GPU the all-to-all then gets numpy split sizes; on the CPU platform ``is_cuda`` is False, the
   counts stay tensors, and ``all_to_all_single`` refuses tensor split sizes (``TypeError:
   incompatible function arguments``). The function is replaced (in ``moe_utils`` and in
   ``token_dispatcher``, which imported it by name) by one that treats every tensor that would
   live on the GPU in production (not host-born, ``standins/collective_audit.py``) as
   ``is_cuda``: the same values, as numpy when asked, as on a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from megatron_m2po.standins import collective_audit

__all__ = ["install"]

_INSTALLED = False


def _uneven_all_gather(orig):
    @functools.wraps(orig)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        shapes = {tuple(t.shape[1:]) for t in tensor_list} | {tuple(tensor.shape[1:])}
        firsts = [t.shape[0] if t.dim() else 1 for t in tensor_list]
        if len(set(firsts)) <= 1 or len(shapes) != 1 or tensor.dim() == 0:
            return orig(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(firsts)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [tensor.new_empty((longest, *tensor.shape[1:])) for _ in tensor_list]
        orig(parts, padded, group=group)
        for out, part, n in zip(tensor_list, parts, firsts):
            out.copy_(part[:n])
        return _Done() if async_op else None

    all_gather.__m2po_uneven__ = True
    return all_gather


class _Done:
    """The work handle of an emulated (synchronous) collective."""

    def wait(self, *a: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` with "on the accelerator" as the platform tracks it."""
    if torch.is_tensor(tensor) and not collective_audit.is_host_born(tensor):
        tensor = tensor.detach().to("cpu", copy=True)
        collective_audit.track(torch.Tensor.cpu, (), {}, tensor)  # host memory now, as after a D2H copy
        if as_numpy:
            tensor = tensor.numpy()
    return tensor


def install() -> None:
    """Install the three changes (idempotent); called by ``standins.cpu_platform.enable``."""
    global _INSTALLED
    if _INSTALLED:
        return
    if not getattr(dist.all_gather, "__m2po_uneven__", False):
        dist.all_gather = _uneven_all_gather(dist.all_gather)
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:  # megatron not installed: nothing of its MoE layer to fix
        moe_utils = None
    if moe_utils is not None:
        from megatron.core.transformer.moe import token_dispatcher

        moe_utils.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu
        token_dispatcher.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu
    _INSTALLED = True
