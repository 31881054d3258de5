"""Wire encodings: round trips, run-length versions, digests, strict decoding."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_m2po.store.codec import (PayloadError, decode_binary, decode_json, decode_payload, encode_binary,
                                       encode_json, group_digest, rle_decode, rle_encode)
from store_testlib import make_group, same_group


def test_rle_roundtrip_and_hand_values():
    assert rle_encode(np.array([3, 3, 3, 4, 7, 7])).tolist() == [[3, 3], [4, 1], [7, 2]]
    assert rle_encode(np.array([], np.int64)).shape == (0, 2)
    rng = np.random.default_rng(0)
    for _ in range(20):
        v = np.sort(rng.integers(0, 5, rng.integers(0, 50)))
        assert np.array_equal(rle_decode(rle_encode(v)), v)


@pytest.mark.parametrize("enc,dec", [(encode_json, decode_json), (encode_binary, decode_binary)])
def test_roundtrip(enc, dec):
    groups = [make_group("a", 3, n=3), make_group("b", versions=[[1, 1, 2, 2, 2], [2] * 6])]
    groups[0].trajectories[1].recomputed_behav_logprobs = -np.arange(6, dtype=np.float32) / 7
    groups[0].trajectories[2].reward = None
    groups[1].trajectories[0].metadata = {"nested": {"x": [1, 2]}, "s": "é"}
    back = dec(enc(groups))
    assert all(same_group(x, y) for x, y in zip(groups, back))
    assert np.array_equal(back[0].trajectories[1].recomputed_behav_logprobs,
                          groups[0].trajectories[1].recomputed_behav_logprobs)
    assert [group_digest(g) for g in back] == [group_digest(g) for g in groups]


def test_binary_is_compact():
    g = [make_group("a", 3, n=8, resp_len=4000)]
    n_tok = sum(t.response_ids.size for t in g[0].trajectories)
    assert len(encode_binary(g)) < 9.5 * n_tok < len(encode_json(g)) / 2  # 4+4+1 bytes per response token


def test_json_versions_forms():
    doc = {"groups": [{"group_id": "g", "trajectories": [
        {"uid": "u0", "prompt_ids": [1], "response_ids": [2, 3, 4], "behav_logprobs": [-1, -1, -1], "versions": 5},
        {"uid": "u1", "prompt_ids": [1], "response_ids": [2, 3, 4], "behav_logprobs": [-1, -1, -1],
         "versions": {"runs": [[5, 1], [6, 2]]}}]}]}
    g = decode_json(json.dumps(doc).encode())[0]
    assert g.trajectories[0].versions.tolist() == [5, 5, 5] and g.trajectories[1].versions.tolist() == [5, 6, 6]
    assert g.trajectories[0].group_id == "g" and g.trajectories[0].loss_mask.tolist() == [1, 1, 1]


def test_digest_sensitive_to_every_field():
    base = group_digest(make_group("a", 1))
    for mutate in (lambda t: t.response_ids.__setitem__(0, 999), lambda t: t.behav_logprobs.__setitem__(0, -9),
                   lambda t: t.versions.__setitem__(-1, 2), lambda t: t.loss_mask.__setitem__(0, 1 - t.loss_mask[0]),
                   lambda t: setattr(t, "reward", 0.25), lambda t: t.metadata.update(x=1),
                   lambda t: setattr(t, "finish_reason", "length")):
        g = make_group("a", 1)
        mutate(g.trajectories[0])
        assert group_digest(g) != base
    assert group_digest(make_group("a", 1)) == base


def test_strict_decoding_names_the_field():
    good = encode_binary([make_group("a", 1)])
    with pytest.raises(PayloadError, match="lengths disagree"):
        decode_binary(good[:-3])
    with pytest.raises(PayloadError, match="trailing bytes"):
        decode_binary(good + b"\0\0")
    with pytest.raises(PayloadError, match="expected b'M2RG'"):
        decode_binary(b"XXXX" + good[4:])
    with pytest.raises(PayloadError, match="NaN is not allowed"):
        decode_json(b'{"groups": [{"group_id": "g", "trajectories": [{"uid": "u", "prompt_ids": [1], '
                    b'"response_ids": [1], "behav_logprobs": [NaN], "versions": 0}]}]}')
    with pytest.raises(PayloadError, match=r"trajectory 'u'.prompt_ids\[1\]='x' is not an integer"):
        decode_json(b'{"groups": [{"group_id": "g", "trajectories": [{"uid": "u", "prompt_ids": [1, "x"], '
                    b'"response_ids": [1], "behav_logprobs": [-1], "versions": 0}]}]}')
    with pytest.raises(PayloadError, match="Content-Type 'text/plain' unsupported"):
        decode_payload(good, "text/plain")


def test_binary_lengths_checked_before_any_array_is_copied():
    import tracemalloc
    body = encode_binary([make_group("big", 0, n=4, resp_len=500_000)])  # ~18 MB of arrays
    for bad in (body[:-1], body + b"\0"):
        tracemalloc.start()
        with pytest.raises(PayloadError, match="lengths disagree"):
            decode_binary(bad)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < len(body) // 20, peak  # nothing proportional to the arrays was allocated
