"""The frozen reference policy of the reference-model KL (``algo.kl.coef > 0``; algo/kl.py).

:class:`FrozenReference` is a second copy of the *base* model: built by the actor's own
``actor.model.build_model`` from ``model.hf_path`` (the base HF checkpoint, never a training
checkpoint: a resumed run keeps the same reference), so it has the actor's layout -- the same
TP / PP / VPP / CP / EP shards on the same Megatron parallel groups, the same layer spec and
precision -- with ``requires_grad=False``, in eval mode, with no DDP wrapper, gradient buffer or
optimizer state. Its log-probs come from the actor's own schedule and fused vocab-parallel
log-prob path (the actor's ``run_schedule`` / ``token_logprobs``, the passes of its
``global_mask.MaskHost`` interface; ``parallel/logprobs.py``) over the
*same micro-batches* as the policy's forward-backward, so every layout and micro-batching gives
the same reference log-probs as the policy path gives policy log-probs.

Memory: the weights live in host memory between uses: one host buffer of exactly their bytes
(pinned on a GPU at its exact size, ``utils/pinned.py``), a view of it per parameter and buffer.
:meth:`FrozenReference.logprobs` copies them to the device (``non_blocking``), runs the forward
and points the modules back at the host copies (the device copies are freed; the weights never
change, so nothing is copied back). The planner counts the device copy while it is resident
(``plan/memory.py``, ``reference_bytes``) and the host buffer in the node's host memory
(``plan/host.py``). On the CPU platform the "device" is host memory: moving is a no-op.

The seam: a reference is anything with ``logprobs(actor, mbs) -> list`` (one float tensor per
micro-batch on the last pipeline stage, ``None`` each elsewhere) and ``close()``. Under LoRA
(``model.lora.rank > 0``) it is :class:`AdapterDisabledReference`: the actor's own chunks with
the adapters disabled (``actor/lora.py``; no copy, no extra memory) -- the base model, which the
frozen copy would also be. :func:`make_reference` is the one place that chooses.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_m2po.utils.pinned import host_empty

__all__ = ["FrozenReference", "AdapterDisabledReference", "make_reference"]


_ALIGN = 256  # bytes: every host copy starts at a multiple (any dtype's alignment, and the DMA engine's)


def _host_copies(tensors: list[torch.Tensor], *, pin: bool) -> list[torch.Tensor]:
    """One host buffer of exactly the tensors' bytes (pinned on a GPU, so that the copies to the
    device run asynchronously; ``utils/pinned.py``: no power-of-two rounding per tensor), a view
    of it per tensor holding that tensor's values."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // _ALIGN) * _ALIGN
    flat = host_empty(total, pin=pin)
    out = []
    for t, off, n in zip(tensors, offsets, sizes):
        h = flat[off:off + n].view(t.dtype).view(t.shape)
        h.copy_(t.data)
        out.append(h)
    return out


class FrozenReference:
    """A frozen, host-resident copy of the base model in the actor's layout (module docstring)."""

    def __init__(self, chunks: list, device: torch.device) -> None:
        self.chunks = chunks
        self.device = device
        self._tensors: list[torch.Tensor] = []
        for chunk in chunks:
            chunk.eval()
            for p in chunk.parameters():
                p.requires_grad_(False)
            self._tensors += list(chunk.parameters()) + list(chunk.buffers())
        self._host = _host_copies(self._tensors, pin=device.type == "cuda")
        self._offload()

    @classmethod
    def build(cls, cfg: Any, device: torch.device) -> "FrozenReference":
        """Build it from ``cfg.model.hf_path`` in the current Megatron parallel state (the
        actor's ``ActorConfig`` with ``hf_path`` resolved)."""
        from megatron_m2po.actor.model import build_model

        chunks, _ = build_model(cfg)
        return cls(chunks, device)

    @property
    def resident(self) -> bool:
        """Whether the weights are on the device now (only inside :meth:`logprobs` on a GPU)."""
        return any(t.data.device.type != "cpu" for t in self._tensors)

    def _load(self) -> None:
        for t, h in zip(self._tensors, self._host):
            t.data = h.to(self.device, non_blocking=True)

    def _offload(self) -> None:
        for t, h in zip(self._tensors, self._host):
            t.data = h

    def logprobs(self, actor, mbs: list) -> list[Optional[torch.Tensor]]:
        """Reference log-probs of the response tokens of each micro-batch in ``mbs`` (last
        pipeline stage: one float tensor each, aligned with the actor's ``token_logprobs`` of
        the same micro-batch; other stages: ``None`` each). Collective over the actor's groups;
        ``actor`` is a ``global_mask.MaskHost`` (its passes, device and stage are all it uses)."""
        if not mbs:
            return []
        self._load()
        try:
            return _reference_pass(actor, mbs, self.chunks)
        finally:
            self._offload()

    def close(self) -> None:
        self._offload()
        self.chunks, self._tensors, self._host = [], [], []


def _reference_pass(actor, mbs: list, models: list) -> list[Optional[torch.Tensor]]:
    """Forward-only log-probs of ``mbs`` through ``models`` with the actor's schedule and
    log-prob path (no routing replay: ``run_schedule`` replays for the policy's own pass only)."""
    def loss_fn(mb, model, hidden):
        logp, _ = actor.token_logprobs(mb, model, hidden, with_entropy=False)
        return (torch.zeros((), device=actor.device), torch.tensor(mb.num_tokens, dtype=torch.int), logp.detach())

    with torch.no_grad():
        out = actor.run_schedule(mbs, loss_fn, forward_only=True, models=models)
    return list(out) if actor.is_last_stage else [None] * len(mbs)


class AdapterDisabledReference:
    """The reference under LoRA: the actor's own (DDP-wrapped) chunks run with every adapter
    skipped (``lora.adapters_disabled``), i.e. the frozen base model, in the actor's layout and
    micro-batches. Nothing is copied; the base weights never change under LoRA."""

    def logprobs(self, actor, mbs: list) -> list[Optional[torch.Tensor]]:
        """As :meth:`FrozenReference.logprobs`."""
        from megatron_m2po.actor.lora import adapters_disabled

        if not mbs:
            return []
        with adapters_disabled(actor.model):
            return _reference_pass(actor, mbs, actor.model)

    def close(self) -> None:
        pass


def make_reference(cfg: Any, device: torch.device) -> Optional[FrozenReference | AdapterDisabledReference]:
    """The reference the config asks for: None with ``algo.kl.coef == 0``; under LoRA
    (``model.lora.rank > 0``) the actor with its adapters disabled; else a :class:`FrozenReference`
    of the base model."""
    if cfg.algo.kl.coef == 0:
        return None
    if cfg.model.lora.rank:
        return AdapterDisabledReference()
    return FrozenReference.build(cfg, device)
