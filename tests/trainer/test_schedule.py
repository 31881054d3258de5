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
