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
  is right under 1F1B and interleaved schedules with several micro-batches in flight. Full
  activation recompute re-runs the router in the backward with ``REPLAY_FORWARD``, i.e. the
  last targets set: right without pipelining (each micro-batch's backward follows its forward),
  wrong with pipeline parallelism, which the config refuses (Megatron never switches to
  ``REPLAY_BACKWARD`` itself). Selective recompute does not re-run the router.
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

from typing import Optional

import torch


class RoutingReplay:
    """Feeds Megatron-Core's ``RouterReplay`` instances of this rank's model chunks."""

    def __init__(self, chunks: list, *, num_layers: int, tp_size: int, tp_rank: int, sequence_parallel: bool) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self.num_layers = num_layers
        self.tp_size, self.tp_rank, self.sp = tp_size, tp_rank, sequence_parallel
        self.per_chunk: list[list[tuple[int, "RouterReplay"]]] = []
        for c in chunks:
            entries = []
            for layer in c.decoder.layers:
                rr = getattr(getattr(getattr(layer, "mlp", None), "router", None), "router_replay", None)
                if rr is not None:
                    entries.append((int(layer.layer_number) - 1, rr))
            self.per_chunk.append(entries)
        if not any(self.per_chunk) and num_layers:
            raise AssertionError("routing replay is on but no MoE layer has a RouterReplay "
                                 "(TransformerConfig.moe_enable_routing_replay)")

    def layer_ids(self, chunk: int) -> list[int]:
        return [i for i, _ in self.per_chunk[chunk]]

    def targets(self, routed: torch.Tensor, layer: int) -> torch.Tensor:
        """``[tokens, top_k]`` ids the router of global layer ``layer`` sees, from a micro-batch's
        ``routed_experts`` ``[layers, B, S, top_k]`` (module docstring, token order)."""
        ids = routed[layer]
        if self.sp and self.tp_size > 1:
            s = ids.shape[1]
            assert s % self.tp_size == 0, f"sequence of {s} rows is not a multiple of TP={self.tp_size}"
            ids = ids[:, self.tp_rank * (s // self.tp_size):(self.tp_rank + 1) * (s // self.tp_size)]
        return ids.transpose(0, 1).reshape(-1, ids.shape[-1])

    def set(self, routed: Optional[torch.Tensor], chunk: int) -> None:
        """Targets of one micro-batch for the routers of model chunk ``chunk``, action REPLAY_FORWARD."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if routed is None:
            raise ValueError("algo.routing_replay=rollout: a micro-batch has no routed experts")
        if routed.shape[0] != self.num_layers:
            raise ValueError(f"routed experts cover {routed.shape[0]} layers, the model has {self.num_layers}")
        for layer, rr in self.per_chunk[chunk]:
            rr.clear_indices()  # one target per forward; the backward list is unused (no REPLAY_BACKWARD)
            rr.set_target_indices(self.targets(routed, layer).long())
            rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def clear(self) -> None:
        for entries in self.per_chunk:
            for _, rr in entries:
                rr.clear_indices()
                rr.clear_router_replay_action()

    def close(self) -> None:
        """Drop this model's instances from Megatron's global list (several actors in one process)."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        mine = {id(rr) for entries in self.per_chunk for _, rr in entries}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]
