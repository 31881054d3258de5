"""Colocated mode's phase sequence (``rollout.colocate=true``): engines and trainer time-share every GPU.

Two states, and the only two ways between them (every rank calls them at the same points of the
loop; rank 0 drives the engines through the rollout service):

* ``engines`` -- the engines hold weights + KV cache of the version the push controller names and
  generate; the trainer's parameters, gradients and optimizer states are off the device
  (``actor/offload.py``).
* ``trainer`` -- the engines have released weights and KV cache; the trainer is back and trains,
  evaluates its own log-probs, checkpoints.

:meth:`ColocatedPhases.to_trainer`: scheduled generation in flight drains, the engines release
``weights`` and ``kv_cache`` (``/release_memory_occupation``; SGLang 0.5.23 asserts an idle engine,
``managers/scheduler_components/weight_updater.py``), the trainer reloads.
:meth:`ColocatedPhases.to_engines`: the engines resume ``weights``, every rank pushes through the
colocated transport (``/update_weights_from_tensor``: weights the engines resumed without
``--enable-weights-cpu-backup`` hold nothing usable, ``model_executor/model_runner.py``, so every
resume is followed by a full push, even at an unchanged version), the trainer offloads (after the
push: the handles point into its parameters), the engines resume ``kv_cache``.

At the start the trainer offloads before the engines start (:meth:`ColocatedPhases.start`): they
load the base model, version 0, exactly as in the other modes, so the first generation needs no
push. A resume from a checkpoint goes to ``trainer`` to load it; the first generation after it
pushes the resumed version. Versions and per-token tags are the push controller's, as in every mode.

Peak per GPU: during the push the trainer's whole state and the engines' weights are resident (the
engines' KV cache is not); ``plan/colocated.py`` models the two phases around it.

CPU runs: the trainer records its resident bytes after every offload and reload into the stand-ins'
per-node memory ledger (``utils/standin.py`` seam ``memory_ledger``; off unless
``M2PO_STANDIN_GPU_LEDGER`` is set, never used on GPUs), where the CPU worker records its weights and
KV: a record that takes an emulated GPU past ``M2PO_STANDIN_GPU_BUDGET_BYTES`` fails the run as a
CUDA out-of-memory error would.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Optional

from megatron_m2po.utils.timing import TIMER

log = logging.getLogger(__name__)

__all__ = ["ColocatedPhases"]

ENGINES, TRAINER = "engines", "trainer"


def _ledger_recorder() -> Optional[Callable[[int, str, int], None]]:
    """The stand-ins' ledger ``record(gpu, owner, bytes)`` on a run without CUDA; None on GPUs."""
    import torch

    if torch.cuda.is_available():
        return None
    from megatron_m2po.utils.standin import load_standin

    return load_standin("memory_ledger").record


class ColocatedPhases:
    """The phase sequence of colocated mode (module docstring); one per rank.

    ``actor``: the rank's :class:`~megatron_m2po.actor.actor.MegatronActor` (``offload`` /
    ``reload``); ``from_rank0``: the loop's ``fn`` -> rank 0's result on every rank (an engine call
    that fails on rank 0 raises on every rank); ``rank`` / ``local_rank``: the ledger's owner and GPU.
    :meth:`attach` hands over the push controller (every rank) and rank 0's rollout service once
    they exist.

    Example (every rank)::

        phases = ColocatedPhases(actor, from_rank0=from_rank0, rank=0, local_rank=0)
        phases.start()                         # trainer offloaded; the engines may start now
        phases.attach(weights, service)        # service: None on ranks other than 0
        phases.to_trainer()                    # engines released, trainer reloaded: train
        seconds = phases.to_engines()          # weights pushed, trainer offloaded: generate
    """

    def __init__(self, actor: Any, *, from_rank0: Callable[..., Any], rank: int = 0,
                 local_rank: Optional[int] = None) -> None:
        self.actor = actor
        self._from_rank0 = from_rank0
        self.weights: Any = None
        self.service: Any = None
        self.state = TRAINER
        self._gpu = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else int(local_rank)
        self._owner = f"trainer/rank{rank}"
        self._record = _ledger_recorder()

    def attach(self, weights: Any, service: Any) -> None:
        """The push controller (every rank) and the rollout service (rank 0; None elsewhere)."""
        self.weights, self.service = weights, service

    # ------------------------------------------------------------------ transitions
    def start(self) -> None:
        """Before the engines start (all ranks): the trainer off the device; the engines then load the
        base model (version 0) and generate with it without a push."""
        if self.state == TRAINER:
            self._offload()
            self.state = ENGINES

    def to_trainer(self) -> None:
        """Engines release weights and KV cache (after the scheduled generation in flight), the
        trainer reloads. Nothing when the trainer is resident already."""
        if self.state == TRAINER:
            return
        with TIMER.phase("release"):
            self._from_rank0(lambda: self.service.release_engines(("weights", "kv_cache")),
                             what="the engines' memory release")
        self.state = TRAINER  # the engines hold nothing now, whatever the reload does
        rec = self.actor.reload()
        self._ledger(rec.resident_bytes)

    def to_engines(self) -> float:
        """Engines resume weights, every rank pushes the actor's weights into them, the trainer
        offloads, engines resume their KV cache. Returns the push's seconds (0.0 when the engines
        were generating already)."""
        if self.state == ENGINES:
            assert self.weights.version == self.actor.version, (self.weights.version, self.actor.version)
            return 0.0
        with TIMER.phase("resume"):
            self._from_rank0(lambda: self.service.resume_engines(("weights",)), what="the engines' weights resume")
        t0 = time.perf_counter()
        self.weights.push_actor(self.actor, phase="transfer")
        pushed = time.perf_counter() - t0
        self._offload()
        with TIMER.phase("resume"):
            self._from_rank0(lambda: self.service.resume_engines(("kv_cache",)), what="the engines' KV cache resume")
        self.state = ENGINES
        return pushed

    # ------------------------------------------------------------------ the trainer's side
    def _offload(self) -> None:
        rec = self.actor.offload()
        self._ledger(rec.resident_bytes)

    def _ledger(self, nbytes: int) -> None:
        """What the trainer holds on its GPU now, in the stand-ins' ledger (CPU runs only)."""
        if self._record is not None:
            self._record(self._gpu, self._owner, int(nbytes))
