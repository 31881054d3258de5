"""Colocated mode's engine relaunch (issue 40, trainer/colocated.py "Relaunch"), unit level: the phase
sequence around a dead engine with a fake trainer and engines (EngineControl's verbs), in every phase it can die in.

The rule checked in each case: an engine is relaunched only while the trainer is off the device (a
relaunched engine holds its whole memory at start-up), and it generates only after a push that
reached it. The end-to-end run (real CPU worker, SIGKILL, the memory ledger) is in
``test_colocated.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_m2po.trainer.colocated import ENGINES, TRAINER, ColocatedPhases


class _Actor:
    """The actor's offload interface (actor/actor.py): ``offload_states`` takes the gradients and
    optimizer states (the weights stay: the push reads them), ``offload`` the rest."""

    version = 3

    def __init__(self, events: list) -> None:
        self.events, self.resident, self.states = events, True, True  # resident: the weights

    @property
    def offloaded(self) -> bool:
        return not (self.resident and self.states)

    def offload_states(self):
        assert self.resident and self.states
        self.events.append("offload states")
        self.states = False
        return SimpleNamespace(resident_bytes=1)

    def offload(self):
        self.events.append("offload")
        self.resident = self.states = False
        return SimpleNamespace(resident_bytes=0)

    def reload(self):
        self.events.append("reload")
        self.resident = self.states = True
        return SimpleNamespace(resident_bytes=2)


class _Engines:
    """EngineControl's verbs colocated mode uses (rollout_service/engine_control.py), one engine ``e0``;
    ``dies_in``: the call that finds it dead (the engine died before it)."""

    def __init__(self, events: list, actor: _Actor, dies_in: str = "") -> None:
        self.events, self.actor, self.dies_in = events, actor, dies_in
        self.is_dead, self.pending = False, []

    def _call(self, name: str) -> list:
        self.events.append(name)
        if name == self.dies_in:
            self.is_dead, self.dies_in = True, ""  # once
        return ["e0"] if self.is_dead else []

    def release(self, tags):
        return self._call("release " + "+".join(tags))

    def resume(self, tags):
        return self._call("resume " + "+".join(tags))

    def dead(self):
        return ["e0"] if self.is_dead else []

    def relaunch(self, release):
        if not self.is_dead:
            return []
        assert not self.actor.resident, "an engine relaunched next to the resident trainer: out of memory"
        self.events.append("relaunch, release " + "+".join(release))
        self.is_dead, self.pending = False, ["e0"]
        return ["e0"]


class _Weights:
    """The push controller: a push to a dead engine fails once and is repeated after ``relaunch``."""

    def __init__(self, events: list, engines: _Engines, relaunch) -> None:
        self.events, self.engines, self.version, self.relaunch = events, engines, 0, relaunch

    def push_actor(self, actor, *, phase):
        assert actor.resident
        if self.engines.is_dead:
            self.events.append("push failed")
            assert self.relaunch() == ["e0"]
        self.events.append("push")
        self.version, self.engines.pending = actor.version, []  # finish() admits the relaunched engines


def _phases(dies_in: str = ""):
    events: list = []
    actor = _Actor(events)
    service = _Engines(events, actor, dies_in)
    phases = ColocatedPhases(actor, from_rank0=lambda fn, what="": fn(), rank=0, local_rank=0)
    phases.attach(_Weights(events, service, relaunch=phases.relaunch_in_push), service)
    return phases, service, events


def test_died_while_generating_is_relaunched_before_the_trainer_reloads_and_pushed_next():
    phases, service, events = _phases(dies_in="release weights+kv_cache")
    phases.start()
    phases.to_trainer()
    assert events == ["offload", "release weights+kv_cache", "relaunch, release weights+kv_cache", "reload"]
    assert phases.state == TRAINER and service.pending == ["e0"]
    events.clear()
    phases.to_engines()
    assert events == ["offload states", "resume weights", "push", "offload", "resume kv_cache"]
    assert service.pending == [] and phases.state == ENGINES


def test_died_while_the_trainer_holds_the_gpus_is_relaunched_with_the_trainer_offloaded_around_it():
    phases, service, events = _phases(dies_in="resume weights")
    phases.start()
    phases.to_trainer()
    events.clear()
    phases.to_engines()
    assert events == ["offload states", "resume weights", "offload", "relaunch, release kv_cache", "reload",
                      "offload states", "push", "offload", "resume kv_cache"]
    assert service.pending == [] and phases.weights.version == 3


def test_died_before_the_push_is_relaunched_by_the_push_controller_hook():
    phases, service, events = _phases()
    phases.start()
    phases.to_trainer()
    events.clear()

    def dies_now(actor, *, phase, push=phases.weights.push_actor):
        service.is_dead = True  # after the resume answered: the push finds it
        return push(actor, phase=phase)
    phases.weights.push_actor = dies_now
    phases.to_engines()
    assert events == ["offload states", "resume weights", "push failed", "offload", "relaunch, release kv_cache",
                      "reload", "offload states", "push", "offload", "resume kv_cache"]


def test_died_after_the_push_or_between_steps_is_refit_by_a_cycle_before_it_generates():
    phases, service, events = _phases(dies_in="resume kv_cache")
    phases.start()
    phases.to_trainer()
    events.clear()
    phases.to_engines()
    # Relaunched with the base weights while the engines generate: released and pushed before anyone generates.
    assert events == ["offload states", "resume weights", "push", "offload", "resume kv_cache", "relaunch, release ",
                      "release weights+kv_cache", "reload", "offload states", "resume weights", "push", "offload",
                      "resume kv_cache"]
    assert service.pending == [] and phases.state == ENGINES
    events.clear()
    service.is_dead = True  # dies between two steps, the engines resident: relaunched now, refit when asked for
    phases.check_engines()
    assert events == ["relaunch, release "] and service.pending == ["e0"]
    events.clear()
    phases.to_engines()
    assert events == ["release weights+kv_cache", "reload", "offload states", "resume weights", "push", "offload",
                      "resume kv_cache"]
    assert phases.to_engines() == 0.0  # nothing pending: the engines generate as they are


def test_check_engines_relaunches_nothing_while_the_trainer_holds_the_gpus():
    phases, service, events = _phases()
    phases.start()
    phases.to_trainer()
    service.is_dead = True
    events.clear()
    phases.check_engines()
    assert events == []  # the next to_engines finds it (its resume fails), with the trainer offloaded around it


def test_an_engine_that_keeps_dying_after_the_push_ends_the_run_with_its_name():
    phases, service, events = _phases()
    phases.start()
    phases.to_trainer()

    def always_dead(tags):
        events.append("resume " + "+".join(tags))
        if tags == ("kv_cache",):
            service.is_dead = True
        return ["e0"] if service.is_dead else []
    service.resume = always_dead
    with pytest.raises(RuntimeError, match=r"died after the push in 3 moves .*e0"):
        phases.to_engines()


def test_a_failed_push_with_no_dead_engine_offloads_nothing_and_relaunches_nothing():
    """The push controller's ``relaunch`` hook returns nothing: it raises the push's error at once."""
    phases, service, events = _phases()
    phases.start()
    phases.to_trainer()
    events.clear()
    assert phases.weights.relaunch() == []
    assert events == [] and phases.actor.resident
