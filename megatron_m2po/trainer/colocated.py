"""Colocated mode's phase sequence (``rollout.colocate=true``): engines and trainer time-share every GPU.

Two states, and the only two ways between them (every rank calls them at the same points of the
loop; rank 0 drives the engines through their owner, ``EngineControl``):

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
push: the handles point into its parameters; its gradients and optimizer states left before the
engines resumed, ``actor.offload_states``), the engines resume ``kv_cache``.

At the start the trainer offloads before the engines start (:meth:`ColocatedPhases.start`): they
load the base model, version 0, exactly as in the other modes, so the first generation needs no
push. A resume from a checkpoint goes to ``trainer`` to load it; the first generation after it
pushes the resumed version. Versions and per-token tags are the push controller's, as in every mode.

Relaunch (issue 40). An engine that dies is relaunched only where the node's memory allows it: SGLang
0.5.23 has no way to start an engine released -- with ``--enable-memory-saver`` it loads the model and
reserves its KV cache at start-up (``model_executor/model_runner.py`` ``initialize``: ``load_model``,
then the KV pool in the saver's ``kv_cache`` region, ``mem_cache/memory_pool.py``), and releases only
when asked (``entrypoints/http_server.py`` ``release_memory_occupation``) -- so the trainer must be
off the device while it starts. It is
relaunched *pending* (out of the router, ``EngineFleet.check_and_restart(refit=False)``), brought to
the state of the others, and admitted by the next full push (``WeightPushController.finish``):

* died while the engines generate (its requests in flight are retried on the other engines by the
  router or the dispatching client, as in every mode; with one engine the generation fails, as in
  every mode): found by the release of :meth:`ColocatedPhases.to_trainer` and relaunched before the
  trainer reloads (or by :meth:`ColocatedPhases.check_engines` before a step that starts with the
  engines resident), released with the others, pushed at the next move to the engines. It is not
  refit at once: a push needs the trainer's parameters on every GPU, where the other engines hold
  their KV cache (``engine_mem_fraction``) -- a whole release / reload cycle of every engine, i.e.
  the next move to the engines anyway. Only when a relaunched engine
  still waits while the loop asks for the engines does that cycle run at once (to_trainer, then
  to_engines), so no engine ever serves base weights;
* died while the trainer holds the GPUs: found by the resume of :meth:`to_engines`; the trainer
  offloads, the engine is relaunched and releases its KV cache (the others hold only their weights
  then), the trainer reloads, and the push goes to every engine;
* died during the push: the push fails; the same offload / relaunch / reload
  (:meth:`relaunch_in_push`, the push controller's ``relaunch``) and the push is repeated once.

Each relaunch costs one extra offload and reload of the trainer at most (time ``relaunch`` in the
metrics); versions and per-token tags stay the push controller's.

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
MAX_CYCLES = 3  # cycles of one move to the engines (an engine that dies after the push is refit by another)


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
    :meth:`attach` hands over the push controller (every rank) and rank 0's engines (EngineControl) once
    they exist.

    Example (every rank)::

        phases = ColocatedPhases(actor, from_rank0=from_rank0, rank=0, local_rank=0)
        phases.start()                         # trainer offloaded; the engines may start now
        phases.attach(weights, engines)        # engines: None on ranks other than 0
        phases.to_trainer()                    # engines released, trainer reloaded: train
        seconds = phases.to_engines()          # weights pushed, trainer offloaded: generate
    """

    def __init__(self, actor: Any, *, from_rank0: Callable[..., Any], rank: int = 0,
                 local_rank: Optional[int] = None) -> None:
        self.actor = actor
        self._from_rank0 = from_rank0
        self.weights: Any = None
        self.engines: Any = None
        self.state = TRAINER
        self._gpu = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else int(local_rank)
        self._owner = f"trainer/rank{rank}"
        self._record = _ledger_recorder()

    def attach(self, weights: Any, engines: Any) -> None:
        """The push controller (every rank) and the engines' owner (rank 0's
        ``rollout_service/engine_control.py`` ``EngineControl``; None elsewhere). A push that fails
        because an engine died relaunches it through :meth:`relaunch_in_push`, which the controller
        was built with (its ``relaunch``)."""
        self.weights, self.engines = weights, engines

    # ------------------------------------------------------------------ transitions
    def start(self) -> None:
        """Before the engines start (all ranks): the trainer off the device; the engines then load the
        base model (version 0) and generate with it without a push."""
        if self.state == TRAINER:
            self._offload()
            self.state = ENGINES

    def to_trainer(self) -> None:
        """Engines release weights and KV cache (after the scheduled generation in flight), the
        trainer reloads. Nothing when the trainer is resident already.

        An engine found dead here (it died while the engines generated; its requests in flight were
        retried on the others) is relaunched before the reload, while its share of the GPU is free,
        and released like the others: it gets the weights with the next push."""
        if self.state == TRAINER:
            return
        with TIMER.phase("release"):
            dead = self._from_rank0(lambda: self.engines.release(("weights", "kv_cache")),
                                    what="the engines' memory release")
        if dead:
            self._relaunch(("weights", "kv_cache"), offload=False)
        self.state = TRAINER  # the engines hold nothing now, whatever the reload does
        self._reload()

    def to_engines(self) -> float:
        """Engines resume weights, every rank pushes the actor's weights into them, the trainer
        offloads, engines resume their KV cache. Returns the push's seconds (0.0 when the engines
        were generating already).

        Dead engines (module docstring, "Relaunch") are relaunched with the trainer offloaded and
        brought to the others' state; relaunched engines that still hold the base weights (pending)
        while the engines generate are refit by a whole cycle through the trainer first."""
        pushed = 0.0
        for _ in range(MAX_CYCLES):
            if self.state == ENGINES:
                if not self._from_rank0(lambda: bool(self.engines.pending), what="the relaunched engines"):
                    assert self.weights.version == self.actor.version, (self.weights.version, self.actor.version)
                    return pushed
                self.to_trainer()  # the relaunched engines hold the base weights: the push refits them
            pushed += self._resume_and_push()
        raise RuntimeError(f"engines died after the push in {MAX_CYCLES} moves to the engines in a row: "
                           f"{self._from_rank0(lambda: self.engines.pending)}; see their logs in "
                           "<run_dir>/engines/")

    def _resume_and_push(self) -> float:
        """:meth:`to_engines` from ``trainer``: resume weights, push, offload, resume KV cache; the
        push's seconds. An engine that dies after the push is relaunched pending (base weights).

        The trainer's gradients and optimizer states leave before the engines resume their weights
        (``actor.offload_states``): the push reads the weights only, so its peak on a shared GPU is
        the trainer's weights beside the engine's (``plan/colocated.py``, the pushing phase)."""
        self._offload_states()
        with TIMER.phase("resume"):
            dead = self._from_rank0(lambda: self.engines.resume(("weights",)),
                                    what="the engines' weights resume")
        if dead:  # died while the trainer held the GPUs: relaunched as the others are now, weights resident
            self._relaunch(("kv_cache",), offload=True)
        t0 = time.perf_counter()
        self.weights.push_actor(self.actor, phase="transfer")
        pushed = time.perf_counter() - t0
        self._offload()
        with TIMER.phase("resume"):
            dead = self._from_rank0(lambda: self.engines.resume(("kv_cache",)),
                                    what="the engines' KV cache resume")
        self.state = ENGINES
        if dead:  # the trainer is offloaded: relaunched now, with base weights, out of the router
            self._relaunch((), offload=False)
        return pushed

    def check_engines(self) -> None:
        """All ranks, before a step (the loop's engine check in colocated mode). While the engines
        generate (the trainer offloaded) dead engines are relaunched now, out of the router until the
        next move to the engines refits them; while the trainer holds the GPUs nothing is relaunched
        (a fresh engine's memory would not fit): the next :meth:`to_engines` finds them."""
        if self.state == ENGINES:
            self._relaunch((), offload=False)

    # ------------------------------------------------------------------ relaunch
    def _relaunch(self, release: tuple[str, ...], *, offload: bool) -> list[str]:
        """All ranks: rank 0 relaunches the dead engines and releases ``release`` on them; with
        ``offload`` the trainer leaves the GPUs around it (it is resident, and a relaunched engine
        loads its weights and reserves its KV cache at start-up). Returns their URLs."""
        states_off = self.actor.offloaded  # between offload_states and the push: back to that state after
        if offload:
            if not self._from_rank0(lambda: bool(self.engines.dead()), what="the engine check"):
                return []
            self._offload()
        with TIMER.phase("relaunch"):
            urls = self._from_rank0(lambda: self.engines.relaunch(release), what="the engines' relaunch")
        if offload:
            self._reload()
            if states_off:
                self._offload_states()
        if urls and self.engines is not None:
            log.warning("relaunched %d engine(s) %s (the trainer %s); they get the weights with the next push",
                        len(urls), ", ".join(urls), "offloaded around it" if offload else "offloaded")
        return urls

    def relaunch_in_push(self) -> list[str]:
        """All ranks, after a failed push (the push controller's ``relaunch``): the others hold their
        weights, not their KV cache; so does the relaunched engine, whose base weights the repeated
        push overwrites."""
        return self._relaunch(("kv_cache",), offload=True)

    # ------------------------------------------------------------------ the trainer's side
    def _offload(self) -> None:
        rec = self.actor.offload()
        self._ledger(rec.resident_bytes)

    def _offload_states(self) -> None:
        rec = self.actor.offload_states()
        self._ledger(rec.resident_bytes)

    def _reload(self) -> None:
        rec = self.actor.reload()
        self._ledger(rec.resident_bytes)

    def _ledger(self, nbytes: int) -> None:
        """What the trainer holds on its GPU now, in the stand-ins' ledger (CPU runs only)."""
        if self._record is not None:
            self._record(self._gpu, self._owner, int(nbytes))
