"""Which tokens the stored routed experts produced (``rollout/routing_versions.py``), on hand-made
versions: a token at position ``p`` needs every row of ``[0, p)`` computed by its own version. The
engine-backed cases (a push in flight, an agentic turn after a push) are in ``test_routed_experts.py``."""

from __future__ import annotations

import types

import numpy as np
import pytest

from megatron_m2po.rollout.routing_versions import (RoutedRows, keep_replayable, mismatched_tokens,
                                                    response_routing_version, row_version_spans)


def test_a_token_needs_every_row_before_it_from_its_own_version():
    # prompt of 3, response of 4: rows 0..5. A retract at a push after 2 tokens: every row is version 1.
    got = mismatched_tokens(3, np.array([0, 0, 1, 1]), None, np.full(6, 1))
    assert got.tolist() == [True, True, False, False]
    # Rows kept from before the push (an agentic turn): token j (position 3 + j) reads rows [0, 3 + j).
    rows = np.array([0, 0, 0, 0, 1, 1])
    assert mismatched_tokens(3, np.array([0, 0, 1, 1]), None, rows).tolist() == [False, False, True, True]
    # Token 1 (position 4) reads rows 0..3, all version 0; token 2 reads row 4 too.
    assert mismatched_tokens(3, np.array([0, 0, 0, 0]), None, rows).tolist() == [False, False, True, True]
    # Observations (loss_mask 0) are never counted.
    assert mismatched_tokens(3, np.array([0, 0, 1, 1]), np.array([1, 0, 0, 1]), np.full(6, 1)).tolist() == \
        [True, False, False, False]
    with pytest.raises(ValueError, match="5 row versions for 3 \\+ 4 tokens; expected 6"):
        mismatched_tokens(3, np.zeros(4), None, np.zeros(5))


def test_replay_masks_the_mismatched_tokens_and_the_record_counts_them_either_way():
    versions, rows = np.array([0, 0, 1, 1]), np.array([1, 1, 1, 1, 1, 1])
    mask, rec = keep_replayable(3, versions, None, rows, replay=True)
    assert mask.tolist() == [0, 0, 1, 1] and mask.dtype == np.uint8
    assert rec == {"row_versions": [[1, 0, 6]], "model_tokens": 4, "mismatched_tokens": 2}
    mask, rec = keep_replayable(3, versions, np.array([1, 1, 0, 1]), rows, replay=False)
    assert mask.tolist() == [1, 1, 0, 1] and rec["mismatched_tokens"] == 2 and rec["model_tokens"] == 3
    assert row_version_spans(np.array([0, 0, 2, 2, 2, 3])) == [[0, 0, 2], [2, 2, 5], [3, 5, 6]]
    assert row_version_spans(np.array([], np.int64)) == []


def test_an_episode_asks_from_zero_once_its_rows_come_from_two_versions():
    r = RoutedRows()
    assert r.ask_from() == 0
    r.add(np.zeros((4, 2, 2)), 0, 0)
    assert r.ask_from() == 4
    r.add(np.ones((3, 2, 2)), 4, 1)  # the turn after a push: its rows are newer than the kept ones
    assert r.ask_from() == 0 and r.row_versions(9).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1]
    r.add(np.full((9, 2, 2), 2), 0, 1)  # asked from 0: the kept rows are replaced
    assert r.ask_from() == 9 and r.row_versions(9).tolist() == [1] * 9 and len(r.pieces) == 1
    with pytest.raises(AssertionError, match="leave a gap"):
        r.add(np.zeros((1, 2, 2)), 10, 1)
    with pytest.raises(AssertionError, match="overlap"):
        r.add(np.zeros((1, 2, 2)), 5, 1)


def test_a_responses_rows_carry_the_version_of_its_last_token():
    out = types.SimpleNamespace(token_weight_versions=["3", "3", "4"], weight_version="5")
    assert response_routing_version(out, 0) == 4
    assert response_routing_version(types.SimpleNamespace(token_weight_versions=None, weight_version="5"), 0) == 5
    assert response_routing_version(types.SimpleNamespace(token_weight_versions=None, weight_version="x"), 2) == 2
