"""External rollout: a store server + examples/external_producer.py (subprocess, tiny HF model and
tokenizer built here) push groups that a RolloutStore consumer leases under the bounded policy;
the slime-style adapter on hand-built slime Samples."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch

from megatron_m2po.ingestion.producer import (Completion, ExternalProducer, SlimeRolloutAdapter, latest_weights,
                                             make_group, slime_samples_to_groups)
from megatron_m2po.weights.disk import DiskWeightSync
from megatron_m2po.store.client import StoreClient, StoreClientError
from megatron_m2po.store.store import RolloutStore, bounded

REPO = Path(__file__).resolve().parents[2]
TOKEN = "test-token-external"


def build_tiny_tokenizer_and_model(path: Path) -> str:
    """Character-level tokenizer over digits/operators/braces + a random Qwen2 of that vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    specials = ["<unk>", "<pad>", "<eos>"]
    chars = list("0123456789+-*=\\{}boxed ")
    vocab = {t: i for i, t in enumerate(specials + sorted(set(chars)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    hf_tok.save_pretrained(str(path))
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id, tie_word_embeddings=False)
    Qwen2ForCausalLM(cfg).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> str:
    return build_tiny_tokenizer_and_model(tmp_path_factory.mktemp("ext_base"))


@pytest.fixture(scope="module")
def store_server(tmp_path_factory):
    db = tmp_path_factory.mktemp("ext_store") / "rollouts.sqlite"
    env = {**os.environ, "M2PO_STORE_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "megatron_m2po.cli", "store", "serve", "--path", str(db),
                             "--port", "0"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and url is None:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        m = re.search(r"on (http://\S+)", line)
        url = m.group(1) if m else None
    assert url, f"store server did not start (rc={proc.poll()})"
    try:
        yield url, str(db)
    finally:
        proc.terminate()
        proc.wait(10)


def _hf_logprobs(model_dir: str, prompt: np.ndarray, response: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)[len(prompt) - 1:-1]
    return logp.gather(1, torch.tensor(response, dtype=torch.long)[:, None])[:, 0].numpy()


@pytest.mark.slow  # examples/external_producer.py end to end
def test_external_producer_example_end_to_end(base_model, store_server, tmp_path):
    url, db = store_server
    # The trainer has applied one update: it publishes v1 on disk, then its version.
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    named = [(n, p.detach() + 0.3 * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]
    sync = DiskWeightSync([], str(tmp_path / "weights"), base_model_dir=base_model)
    v1_dir, _, _ = sync.export(named, 1)
    sync.close()
    (tmp_path / "weights" / "v2.tmp").mkdir()  # a half-written version is never picked
    client = StoreClient(url, TOKEN)
    client.set_version(1)
    assert latest_weights(tmp_path / "weights").version == 1

    cmd = [sys.executable, str(REPO / "examples" / "external_producer.py"), "--store-url", url,
           "--weights-dir", str(tmp_path / "weights"), "--base-model", base_model, "--rounds", "2",
           "--prompts-per-round", "2", "--n-samples", "3", "--max-new-tokens", "8", "--group-prefix", "ext-test"]
    r = subprocess.run(cmd, env={**os.environ, "M2PO_STORE_TOKEN": TOKEN}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pushed 2 groups (stored 2" in r.stderr

    # The trainer side: lease under the bounded policy at version 2 and validate.
    store = RolloutStore(db)
    try:
        lease = store.lease(bounded(max_staleness=4), n_groups=4, current_version=2, step=0)
        assert len(lease.groups) == 4 and lease.staleness == [1, 1, 1, 1]
        for grp in lease.groups:
            grp.validate(current_version=2)
            assert grp.group_id.startswith("ext-test-r") and len(grp.trajectories) == 3
            for t in grp.trajectories:
                assert (t.versions == 1).all()
                assert t.metadata["weights"] == v1_dir
                assert t.reward in (0.0, 0.1, 1.0)
                assert t.finish_reason in ("stop", "length") and 1 <= len(t.response_ids) <= 8
                # Behaviour log-probs are those of the v1 weights (independent HF forward), not the base's.
                np.testing.assert_allclose(t.behav_logprobs, _hf_logprobs(v1_dir, t.prompt_ids, t.response_ids),
                                           atol=2e-4)
        store.ack(lease)
    finally:
        store.close()


def test_push_refuses_versions_ahead_of_the_trainer(base_model, store_server):
    url, _ = store_server
    prod = ExternalProducer(url, TOKEN, base_model_path=base_model)
    v = prod.current_version()
    ahead = make_group("ahead-1", [3, 4], [Completion([5, 6], [-0.5, -1.0], 1.0, v + 1)])
    with pytest.raises(ValueError, match="ahead of the trainer's current version"):
        prod.push([ahead])
    with pytest.raises(StoreClientError, match="ahead of the trainer"):  # the server checks too
        prod.client.put_groups([ahead])
    assert prod.weights_for(v).path == base_model  # no weights_dir: the base model, version 0
    assert prod.weights_for(v).version == 0


def test_make_group_requires_logprobs():
    with pytest.raises(ValueError, match="needs the behaviour log-prob"):
        make_group("g", [1, 2], [Completion([3, 4, 5], [-0.1, -0.2], 0.0, 0)])


# ----------------------------------------------------------------------------- slime adapter

@dataclass
class SlimeSample:
    """The fields of slime's ``slime.utils.types.Sample`` the adapter reads (same names/semantics)."""

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: Optional[int] = None
    index: Optional[int] = None
    prompt: str = ""
    tokens: list = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Optional[str] = None
    reward: Any = None
    loss_mask: Optional[list] = None
    weight_versions: list = field(default_factory=list)
    rollout_log_probs: Optional[list] = None
    remove_sample: bool = False
    status: "SlimeSample.Status" = Status.PENDING
    metadata: dict = field(default_factory=dict)


def _slime_sample(gi, idx, prompt, resp, *, reward=1.0, status=SlimeSample.Status.COMPLETED, mask=None, lps=None,
                  wv=()):
    lps = [-0.1 * (k + 1) for k in range(len(resp))] if lps is None else lps
    return SlimeSample(group_index=gi, index=idx, tokens=list(prompt) + list(resp), response_length=len(resp),
                       label="7", reward=reward, loss_mask=mask, rollout_log_probs=lps, status=status,
                       weight_versions=list(wv), metadata={"turns": 2, "obj": object()})


def test_slime_samples_convert_to_groups():
    data = [
        [_slime_sample(0, 1, [5, 6, 7], [8, 9], reward=0.1, status=SlimeSample.Status.TRUNCATED),
         _slime_sample(0, 0, [5, 6, 7], [10, 11, 12, 2], mask=[1, 0, 0, 1], lps=[-0.5, 0.0, 0.0, -0.25])],
        [_slime_sample(1, 2, [4], [3], wv=["5", "4"]), _slime_sample(1, 3, [4], [3, 3], reward={"acc": 0.0})],
    ]
    groups = slime_samples_to_groups(data, version=6, group_prefix="s", reward_key="acc")
    assert [g.group_id for g in groups] == ["s-g0", "s-g1"]
    g0, g1 = groups
    # Sorted by slime's sample index; tokens split into prompt + response by response_length.
    a, b = g0.trajectories
    assert a.uid == "s-g0-0" and a.prompt_ids.tolist() == [5, 6, 7] and a.response_ids.tolist() == [10, 11, 12, 2]
    assert a.loss_mask.tolist() == [1, 0, 0, 1] and a.behav_logprobs.tolist() == [-0.5, 0.0, 0.0, -0.25]
    assert b.response_ids.tolist() == [8, 9] and b.finish_reason == "length" and b.reward == pytest.approx(0.1)
    assert a.versions.tolist() == [6, 6, 6, 6]                    # no engine versions: the given one
    assert g1.trajectories[0].versions.tolist() == [4]            # engine-reported: the oldest
    assert g1.trajectories[1].reward == 0.0                       # dict reward through reward_key
    assert a.metadata["answer"] == "7" and a.metadata["turns"] == 2 and "obj" not in a.metadata

    # A flat list is grouped by group_index; a RolloutFnTrainOutput-like object by its .samples.
    flat = [s for grp in data for s in grp]
    again = slime_samples_to_groups(type("Out", (), {"samples": flat})(), version=6, group_prefix="s",
                                    reward_key="acc")
    assert [[t.uid for t in g.trajectories] for g in again] == [[t.uid for t in g.trajectories] for g in groups]


@pytest.mark.parametrize("mutate, message", [
    (lambda s: setattr(s, "rollout_log_probs", None), "rollout_log_probs is missing"),
    (lambda s: setattr(s, "rollout_log_probs", [-0.1]), "1 rollout_log_probs for response_length=2"),
    (lambda s: setattr(s, "status", SlimeSample.Status.PENDING), "was not generated"),
    (lambda s: setattr(s, "reward", None), "reward is None"),
    (lambda s: setattr(s, "reward", {"acc": 1.0}), "pass reward_key"),
    (lambda s: setattr(s, "response_length", 0), "response_length=0"),
    (lambda s: setattr(s, "loss_mask", [1]), "loss_mask has 1 entries"),
])
def test_slime_adapter_errors_name_the_problem(mutate, message):
    s = _slime_sample(0, 0, [1, 2], [3, 4])
    mutate(s)
    with pytest.raises(ValueError, match=message):
        slime_samples_to_groups([[s]], version=0)


def test_slime_rollout_function_through_adapter(base_model, store_server):
    url, db = store_server
    calls = []

    async def generate_rollout(args, rollout_id, data_buffer, evaluation=False):  # slime's signature
        calls.append((args["n"], rollout_id, evaluation))
        prompts = data_buffer[rollout_id]
        return [[_slime_sample(gi, gi * args["n"] + j, p, [7, 8 + j], reward=float(j == 0))
                 for j in range(args["n"])] for gi, p in enumerate(prompts)]

    prod = ExternalProducer(url, TOKEN, base_model_path=base_model)
    adapter = SlimeRolloutAdapter(generate_rollout, {"n": 2}, {3: [[1, 2], [3]]}, prod, group_prefix="slime-test")
    res = adapter.run(3)
    assert calls == [(2, 3, False)]
    assert sorted(res["stored"]) == ["slime-test-r3-g0", "slime-test-r3-g1"]
    v = prod.current_version()
    store = RolloutStore(db)
    try:
        stored = {g.group_id: g for g in store.lease(bounded(max_staleness=4), n_groups=2, current_version=v).groups}
    finally:
        store.close()
    g = stored["slime-test-r3-g1"]
    assert [t.response_ids.tolist() for t in g.trajectories] == [[7, 8], [7, 9]]
    assert all((t.versions == v).all() for t in g.trajectories)
    with pytest.raises(ValueError, match="must take"):
        SlimeRolloutAdapter(lambda args: None, None, None, prod)


def test_load_weights_retries_when_the_trainer_prunes_the_directory(tmp_path):
    """The trainer keeps only the last few v<N>: a directory may vanish while a producer reads it."""
    import json as _json
    import shutil

    from megatron_m2po.ingestion.producer import ExternalProducer

    for v in (1, 2):
        d = tmp_path / f"v{v}"
        d.mkdir()
        (d / "m2po_version.json").write_text(_json.dumps({"version": v}))
        (d / "model.safetensors").write_bytes(b"x")
    producer = ExternalProducer("http://127.0.0.1:9", None, weights_dir=str(tmp_path))
    calls = []

    def loader(path):
        calls.append(path)
        if path.endswith("v2"):
            shutil.rmtree(path)  # pruned under the reader
            raise OSError(f"{path}: no such directory")
        return "model@" + path

    model, ref = producer.load_weights(2, loader)
    assert ref.version == 1 and model == f"model@{tmp_path / 'v1'}" and len(calls) == 2

    def broken(path):
        raise ValueError("not a model")  # a real error in an existing directory is not retried

    with pytest.raises(ValueError, match="not a model"):
        producer.load_weights(1, broken)


@pytest.mark.slow  # examples/external_producer.py end to end
def test_external_producer_example_exits_with_one_line_when_the_trainer_is_gone(base_model, tmp_path):
    """The server closes its port mid-run (a finished trainer): exit 3 and one line, no traceback."""
    db = tmp_path / "gone.sqlite"
    env = {**os.environ, "M2PO_STORE_TOKEN": TOKEN}
    server = subprocess.Popen([sys.executable, "-m", "megatron_m2po.cli", "store", "serve", "--path", str(db),
                               "--port", "0"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    producer = None
    try:
        url = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and url is None:
            line = server.stdout.readline()
            if not line and server.poll() is not None:
                break
            m = re.search(r"on (http://\S+)", line)
            url = m.group(1) if m else None
        assert url, f"store server did not start (rc={server.poll()})"
        cmd = [sys.executable, str(REPO / "examples" / "external_producer.py"), "--store-url", url,
               "--base-model", base_model, "--rounds", "1000", "--prompts-per-round", "1", "--n-samples", "2",
               "--max-new-tokens", "4", "--group-prefix", "ext-gone"]
        producer = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline:
            line = producer.stderr.readline()
            if not line:
                break
            seen.append(line)
            if "round 0:" in line:
                break
        assert seen and "round 0:" in seen[-1], "the producer pushed no round:\n" + "".join(seen)
        server.terminate()  # the trainer finished: its port closes
        server.wait(30)
        _, err = producer.communicate(timeout=120)
    finally:
        for p in (producer, server):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert producer.returncode == 3, "".join(seen) + err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if "round " not in ln]
    assert len(lines) == 1 and lines[0].startswith(f"external_producer: the trainer at {url} is gone"), err


def test_the_old_producer_import_path_still_works_and_names_the_new_one():
    """Producers written against ``megatron_m2po.rollout.external`` (before external ingestion became
    one package) keep working: the same objects, and a DeprecationWarning naming the new path."""
    import importlib
    sys.modules.pop("megatron_m2po.rollout.external", None)
    with pytest.warns(DeprecationWarning, match="megatron_m2po.ingestion.producer"):
        old = importlib.import_module("megatron_m2po.rollout.external")
    assert old.ExternalProducer is ExternalProducer and old.make_group is make_group
    with pytest.raises(AttributeError):
        _ = old.no_such_name
