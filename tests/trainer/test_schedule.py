"""The stale-k schedule against a literal simulation of docs/design.md §3."""

import pytest

from megatron_m2po.trainer.schedule import events_at, expected_staleness, generation_version


@pytest.mark.parametrize("U", [1, 2, 4])
@pytest.mark.parametrize("k", [0, 1, 3, 4, 8, 9])
def test_schedule_matches_literal_definition(U, k):
    num_steps = 12
    generated = {}
    # Walk versions in order, as the trainer does, and record when each step's data is made.
    for v in range(num_steps * U + 1):
        for s in events_at(v, U, k, num_steps):
            assert s not in generated, f"step {s} generated twice"
            generated[s] = v
    assert sorted(generated) == list(range(num_steps)), "every step gets its data exactly once"
    for s in range(num_steps):
        u = s * U
        want = u - k if u >= k else 0  # base-model rollouts until version k exists
        assert generated[s] == want == generation_version(s, U, k)
        assert generated[s] <= u, "data exists before the step starts"
        for j in range(U):
            stale = expected_staleness(s, j, U, k)
            assert stale == (u + j) - want
            if u >= k:
                assert stale == k + j


def test_on_policy_first_minibatch_has_zero_staleness():
    for s in range(5):
        assert expected_staleness(s, 0, 4, 0) == 0


def test_bad_arguments():
    with pytest.raises(ValueError):
        generation_version(-1, 4, 0)
    with pytest.raises(ValueError):
        generation_version(0, 0, 0)


# ---------------------------------------------------------------------- the run modes as schedule objects
def _trainer_cfg(mode, *, U=2, k=3, num_steps=8, sync_every=2):
    from megatron_m2po.config import TrainerConfig

    return TrainerConfig(mode=mode, stale_k=k, num_steps=num_steps, prompts_per_step=4 * U, prompts_per_update=4,
                         sync_every_updates=sync_every)


def test_each_mode_is_a_schedule_object():
    from megatron_m2po.trainer.schedule import AsyncSchedule, ExactSchedule, SyncSchedule, make_schedule

    sync, stale, asy = (make_schedule(_trainer_cfg(m)) for m in ("sync", "stale_k", "async"))
    assert type(sync) is SyncSchedule and sync.k == 0 and not sync.background  # stale_k=3 is not sync's
    assert type(stale) is ExactSchedule and stale.k == 3 and stale.background
    assert type(asy) is AsyncSchedule and asy.continuous and asy.retires_ahead
    assert not sync.continuous and not stale.continuous and not sync.retires_ahead and not stale.retires_ahead
    assert sync.redraws_step_prompts and stale.redraws_step_prompts and not asy.redraws_step_prompts
    assert make_schedule(_trainer_cfg("stale_k", k=0)).background is False  # on-policy data is needed at once
    bad = _trainer_cfg("sync")
    bad.mode = "lockstep"
    with pytest.raises(ValueError, match="trainer.mode='lockstep'.*'async', 'stale_k', 'sync'"):
        make_schedule(bad)


@pytest.mark.parametrize("mode,k", [("sync", 0), ("stale_k", 0), ("stale_k", 3), ("stale_k", 4)])
def test_exact_schedules_generate_every_step_once_at_its_version_and_never_push_between(mode, k):
    """Walking versions as the training step does, the schedule generates what events_at says,
    each step once at generation_version, none before the start step; it never asks for a push of
    its own (the push before a generation at a new version is the trainer's)."""
    from megatron_m2po.trainer.schedule import make_schedule

    U, num_steps, start = 2, 8, 3
    sched = make_schedule(_trainer_cfg(mode, U=U, k=k, num_steps=num_steps))
    generated = {}
    for v in range(num_steps * U + 1):
        assert not sched.push_after_update(v)
        for s in sched.steps_to_generate(v, start):
            assert s not in generated
            generated[s] = v
    want_k = 0 if mode == "sync" else k
    assert sorted(generated) == list(range(start, num_steps))  # every step from the start, once
    for s, v in generated.items():
        assert v == generation_version(s, U, want_k) == sched.generated_at(s)


def test_async_schedule_generates_nothing_scheduled_and_pushes_every_n_updates():
    from megatron_m2po.trainer.schedule import make_schedule

    sched = make_schedule(_trainer_cfg("async", sync_every=3))
    assert all(sched.steps_to_generate(v, 0) == [] for v in range(20))
    assert [v for v in range(1, 13) if sched.push_after_update(v)] == [3, 6, 9, 12]
    assert sched.catch_up_candidates(10, 0) == []


def test_catch_up_and_its_checkpoint_state():
    """A run checkpointed with num_steps=4 resumes with num_steps=8 at version 8 (U=2, k=3): steps
    4.. whose event (2s-3) lies before version 8 were never scheduled (4: 5, 5: 7); once caught
    up they are leased at the resume version, and the checkpoint carries that."""
    from megatron_m2po.trainer.schedule import make_schedule

    sched = make_schedule(_trainer_cfg("stale_k", U=2, k=3, num_steps=8))
    sched.load_state_dict({"scheduled_through": 4, "caught_up": []})
    assert sched.catch_up_candidates(8, 4) == [4, 5]
    sched.mark_caught_up([4, 5], 8)
    assert sched.generated_at(4) == sched.generated_at(5) == 8 and sched.generated_at(6) == 9
    assert sched.catch_up_candidates(8, 4) == []
    state = sched.state_dict()
    assert state == {"mode": "stale_k", "stale_k": 3, "scheduled_through": 8, "caught_up": [(4, 8), (5, 8)]}
    again = make_schedule(_trainer_cfg("stale_k", U=2, k=3, num_steps=8))
    again.load_state_dict(state)
    assert again.caught_up == {4: 8, 5: 8} and again.catch_up_candidates(8, 4) == []
    old = make_schedule(_trainer_cfg("stale_k", U=2, k=3, num_steps=8))
    old.load_state_dict({"step": 4})  # a checkpoint from before the catch-up: every step was scheduled
    assert old.scheduled_through == 8 and old.catch_up_candidates(8, 4) == []
