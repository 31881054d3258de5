"""Rollout routing replay (R3): the trainer's MoE layers use the experts the engine picked.

With ``algo.routing_replay=rollout`` every trajectory carries the top-k expert ids each MoE layer
of the engine chose for each token (``store.types.Trajectory.routed_experts``, SGLang's
``return_routed_experts``). The forwards that compute log-probs and gradients replay them:
the token goes to the same experts as in the engine, with the trainer's own router weights over
those experts (``softmax`` of the trainer's router logits at the replayed ids), so the router
still gets gradients and only the discrete choice is taken from the rollout.

Mechanism: Megatron-Core 0.16.1's own hook. ``TransformerConfig.moe_enable_routing_replay``
gives every ``TopKRouter`` a ``RouterReplay`` (``moe/router.py``, ``moe/router_replay.py``);
with action ``REPLAY_FORWARD`` ``moe_utils.topk_routing_with_score_function`` takes the
instance's ``target_topk_idx`` instead of ``torch.topk`` and gathers the scores there
(``RouterReplay.get_replay_topk``). The fused TE router (``moe_router_fusion``) bypasses the
hook, so it is off (``actor/model.py``). This module only feeds the targets:

- *Which routers*: the ``RouterReplay`` of each MoE layer of each model chunk this rank holds
  (pipeline parallel: only the local stage's layers), keyed by the layer's global number
  (``TransformerLayer.layer_number - 1``), which indexes the trajectory's layer axis.
- *When*: in the schedule's ``forward_step``, right before the chunk's forward, for that
  micro-batch and that chunk only. A forward reads ``target_topk_idx`` synchronously, so this
  is right under 1F1B and interleaved schedules with several micro-batches in flight.
  Selective recompute does not re-run the router.
- *Full activation recompute* re-runs each router in the backward, when ``target_topk_idx``
  holds the targets set last (under 1F1B another micro-batch's). Megatron never switches to
  ``REPLAY_BACKWARD`` (which pops ``replay_backward_list`` in FIFO order) itself; this module
  does, in the routers' ``get_replay_topk`` (``_recompute_aware``): a replayed router that runs
  with gradients enabled in a model built with full recompute is inside a recompute. Why, in
  Megatron-Core 0.16.1: ``TransformerBlock.forward`` of a training-mode model with
  ``recompute_granularity='full'`` runs ``_checkpointed_forward``, which with
  ``recompute_method='uniform'`` (``actor/model.py``, 1 layer per group) wraps *every* layer of
  the chunk in ``tensor_parallel.checkpoint``; ``CheckpointFunction.forward`` runs the layers
  under ``torch.no_grad()`` and ``CheckpointFunction.backward`` re-runs them under
  ``torch.enable_grad()``. Forward-only passes (log-probs) run under ``no_grad`` and replay
  forward. The FIFO order is right because each chunk's micro-batches run their backwards in
  the order of their forwards (``schedules.py``: 1F1B ``forward_backward_pipelining_without_
  interleaving`` pops ``output_tensors.pop(0)``; the interleaved schedule pops
  ``output_tensors[model_chunk_id].pop(0)``; without pipelining each backward follows its
  forward), and each ``RouterReplay`` belongs to one chunk. Only a training forward whose layers
  will be recomputed (full recompute, gradients on) keeps its entry in the FIFO; after a run
  every FIFO must be empty (``clear`` asserts it), which catches a count mismatch (a kept
  forward that was not recomputed); a recompute with nothing left to pop raises too.
- *Token order*: the router sees ``hidden.view(-1, E)`` of ``[S, B, H]``: sequence-major, then
  batch row; with sequence parallelism the TP rank's contiguous ``S / TP`` slice (Megatron's
  scatter along the sequence dimension); with context parallelism the CP rank's rows, which
  ``batch.cp_split`` already selected; packed micro-batches have ``B = 1``. Rows that no
  trajectory routes (each sequence's last token, padding) get experts ``0 .. k-1``: nothing
  read from them reaches a predicting row.
- *Afterwards*: targets and actions are cleared (``clear_indices`` also empties the
  instance's backward list, which ``set_target_indices`` appends to).

Every token of a replayed batch must have routing data: a sample without it is refused
(``ValueError`` naming it). There is no per-token fallback: Megatron's hook replays a whole
``[tokens, top_k]`` tensor per layer.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch


def _recompute_aware(rr, replay_topk):
    """``rr.get_replay_topk`` for a model built with full recompute: with action ``REPLAY_FORWARD``
    and gradients enabled the router runs in ``CheckpointFunction.backward``'s recompute (module
    docstring), so it replays with ``REPLAY_BACKWARD``: the oldest target of this router's FIFO,
    i.e. the micro-batch whose backward runs now. ``replay_topk`` is the instance's original
    bound method (``RouterReplay.get_replay_topk``, Megatron-Core 0.16.1)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if rr.router_replay_action != RouterReplayAction.REPLAY_FORWARD or not torch.is_grad_enabled():
            return replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        if not rr.replay_backward_list:
            raise AssertionError("routing replay: a recomputed router found no targets left in its backward "
                                 "FIFO (more recomputes than training forwards of its chunk)")
        rr.router_replay_action = RouterReplayAction.REPLAY_BACKWARD
        try:
            return replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        finally:
            rr.router_replay_action = RouterReplayAction.REPLAY_FORWARD

    return get_replay_topk


class RoutingReplay:
    """Feeds Megatron-Core's ``RouterReplay`` instances of this rank's model chunks."""

    def __init__(self, chunks: list, *, num_layers: int, tp_size: int, tp_rank: int, sequence_parallel: bool) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self.num_layers = num_layers
        self.tp_size, self.tp_rank, self.sp = tp_size, tp_rank, sequence_parallel
        self.per_chunk: list[list[tuple[int, "RouterReplay"]]] = []
        self.recompute = False  # full activation recompute: routers re-run in the backward
        for c in chunks:
            entries = []
            for layer in c.decoder.layers:
                rr = getattr(getattr(getattr(layer, "mlp", None), "router", None), "router_replay", None)
                if rr is not None:
                    entries.append((int(layer.layer_number) - 1, rr))
                    if layer.config.recompute_granularity == "full":
                        if layer.config.recompute_method != "uniform":
                            raise AssertionError(  # 'block' leaves layers outside the checkpoint: grad mode can't tell
                                "routing replay with full recompute needs recompute_method='uniform', got "
                                f"{layer.config.recompute_method!r}")
                        self.recompute = True
                        rr.get_replay_topk = _recompute_aware(rr, rr.get_replay_topk)
            self.per_chunk.append(entries)
        if not any(self.per_chunk) and num_layers:
            raise AssertionError("routing replay is on but no MoE layer has a RouterReplay "
                                 "(TransformerConfig.moe_enable_routing_replay)")

    def layer_ids(self, chunk: int) -> list[int]:
        return [i for i, _ in self.per_chunk[chunk]]

    def targets(self, routed: torch.Tensor, layer: int) -> torch.Tensor:
        """``[tokens, top_k]`` int64 ids the router of global layer ``layer`` sees, from a micro-batch's
        compact ``routed_experts`` ``[layers, B, S, top_k]`` (uint8 / uint16, ``batch.MicroBatch``;
        module docstring, token order). Only this layer's slice is widened to the int64 that
        ``RouterReplay.get_replay_topk`` gathers the scores with: on the device the compact tensor
        meets only views and this one copy (uint16 is one of torch's "barebones" unsigned types:
        copies are implemented for it, most other kernels are not)."""
        ids = routed[layer]
        if self.sp and self.tp_size > 1:
            s = ids.shape[1]
            assert s % self.tp_size == 0, f"sequence of {s} rows is not a multiple of TP={self.tp_size}"
            ids = ids[:, self.tp_rank * (s // self.tp_size):(self.tp_rank + 1) * (s // self.tp_size)]
        return ids.to(torch.int64).transpose(0, 1).reshape(-1, ids.shape[-1])

    def set(self, routed: Optional[torch.Tensor], chunk: int) -> None:
        """Targets of one micro-batch for the routers of model chunk ``chunk``, action REPLAY_FORWARD;
        kept in the routers' backward FIFO only for a forward whose layers the backward recomputes."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if routed is None:
            raise ValueError("algo.routing_replay=rollout: a micro-batch has no routed experts")
        if routed.shape[0] != self.num_layers:
            raise ValueError(f"routed experts cover {routed.shape[0]} layers, the model has {self.num_layers}")
        keep = self.recompute and torch.is_grad_enabled()
        for layer, rr in self.per_chunk[chunk]:
            rr.set_target_indices(self.targets(routed, layer))  # also appends to replay_backward_list
            if not keep:
                rr.replay_backward_list.pop()
            rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def clear(self) -> None:
        """After a schedule run. Every recompute must have consumed its forward's targets: an entry
        left in a backward FIFO means a count mismatch (unless the run is failing anyway)."""
        failing = sys.exc_info()[0] is not None
        left = {layer: len(rr.replay_backward_list) for entries in self.per_chunk for layer, rr in entries
                if rr.replay_backward_list}
        for entries in self.per_chunk:
            for _, rr in entries:
                rr.clear_indices()
                rr.clear_router_replay_action()
        if left and not failing:
            raise AssertionError(f"routing replay: targets left in the backward FIFO after the run (layer: count) "
                                 f"{left}: fewer recomputes than kept training forwards")

    def close(self) -> None:
        """Drop this model's instances from Megatron's global list (several actors in one process)."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        mine = {id(rr) for entries in self.per_chunk for _, rr in entries}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]
