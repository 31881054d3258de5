"""Reward functions for the end-to-end `m2po eval` test (loaded by dotted path in workers)."""


def has_digit(response, answer):
    """1.0 when the response contains a digit: frequent enough under a random tiny model that
    avg@k is neither 0 nor 1, and recomputable from the saved responses."""
    return 1.0 if any(c.isdigit() for c in response) else 0.0
