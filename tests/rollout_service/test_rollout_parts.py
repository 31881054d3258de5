"""The rank-0 rollout side's parts, each built alone from its own config sections: scheduled
generation and the leaser over a real store with a custom producer (the ``rollout.producer``
extension point: no engines), the weight-push controller with a disk weight sync and no engines,
and the group-id format (the resume contract)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_m2po.config import DataConfig, RolloutConfig, StoreConfig, TrainerConfig
from megatron_m2po.data.dataset import build_prompt_dataset
from megatron_m2po.rollout import group_ids
from megatron_m2po.rollout.producer import ProducerContext
from megatron_m2po.rollout_service.groups import GroupSampler
from megatron_m2po.rollout_service.leaser import Leaser
from megatron_m2po.rollout_service.scheduled import ScheduledGeneration
from megatron_m2po.store.store import RolloutStore
from megatron_m2po.store.types import Group, Trajectory
from megatron_m2po.utils.background_loop import BackgroundLoop
from megatron_m2po.weights.disk import DiskWeightSync
from megatron_m2po.weights.distributed import DistributedWeightSync
from megatron_m2po.weights.push import WeightPushController
from megatron_m2po.weights.stage import run_stage

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from m2po_char_tokenizer import build_char_tokenizer  # noqa: E402
from waiting import wait_until  # noqa: E402

N = 3  # prompts per step


async def unnamed_producer(ctx: ProducerContext, prompts: list) -> list[Group]:
    """A custom producer that names its groups its own way (the generator renames them)."""
    out = []
    for p, item in enumerate(prompts):
        trajs = [Trajectory(uid=f"mine-{p}-{j}", group_id=f"mine-{p}", prompt_ids=np.asarray(item.prompt_ids),
                            response_ids=np.arange(4), behav_logprobs=np.full(4, -0.5, np.float32),
                            versions=np.full(4, ctx.version, np.int64), reward=float(j), finish_reason="stop",
                            metadata={"prompt_index": int(item.index)})
                 for j in range(ctx.n_samples)]
        out.append(Group(f"mine-{p}", trajs))
    return out


async def failing_producer(ctx: ProducerContext, prompts: list) -> list[Group]:
    raise RuntimeError("the reward service is down")


@pytest.fixture
def side(tmp_path):
    """A store, a prompt stream, a background loop: what the parts share on rank 0."""
    trainer = TrainerConfig(prompts_per_step=N, prompts_per_update=N, run_dir=str(tmp_path), wait_timeout_s=600)
    tok = build_char_tokenizer()
    store = RolloutStore(str(tmp_path / "s.sqlite"))
    bg = BackgroundLoop("test-rollout")
    ns = SimpleNamespace(trainer=trainer, tok=tok, store=store, bg=bg, stop=threading.Event(),
                         weights=WeightPushController.follower(),
                         dataset=lambda: build_prompt_dataset(
                             DataConfig(template="raw", synthetic_num_problems=64, synthetic_eval_size=0), tok,
                             trainer.seed))
    yield ns
    bg.close()
    store.close()


def _generator(side, producer=unnamed_producer, dataset=None) -> ScheduledGeneration:
    sampler = GroupSampler(RolloutConfig(n_samples_per_prompt=2), seed=side.trainer.seed, tokenizer=side.tok,
                           reward=None, producer=producer, client=None, store=side.store, weights=side.weights)
    return ScheduledGeneration(side.trainer, sampler=sampler, dataset=dataset or side.dataset(), store=side.store,
                               bg=side.bg, stop_event=side.stop)


def test_a_scheduled_step_is_generated_under_its_ids_leased_and_not_generated_again(side):
    gen = _generator(side)
    leaser = Leaser(side.trainer, StoreConfig(), side.store, stop_event=side.stop, sources=[gen])
    side.weights.version = 0
    gen.generate(2, background=True)
    groups, lease = leaser.take_step(2, version=0, generated_at=0)
    assert [g.group_id for g in groups] == group_ids.step_group_ids(2, N) == [f"s000002-g{i:05d}" for i in range(N)]
    assert [t.uid for t in groups[0].trajectories] == ["s000002-g00000-0", "s000002-g00000-1"]
    leaser.ack(lease)
    assert gen.idle()
    # A resumed run draws the same prompts for step 2 and finds its groups: nothing is generated.
    again = _generator(side)
    assert again.generate(2).result(timeout=5) == 0 and again.idle()
    assert again.missing_steps([2, 3]) == [3]


def test_a_producer_error_reaches_the_waiting_leaser(side):
    gen = _generator(side, producer=failing_producer)
    leaser = Leaser(side.trainer, StoreConfig(), side.store, stop_event=side.stop, sources=[gen])
    gen.generate(0, background=True)
    # Not "did not arrive within 600s": the leaser asks the generator while it waits.
    with pytest.raises(RuntimeError, match="the reward service is down"):
        leaser.take_step(0, version=0, generated_at=0)


def test_a_step_nothing_generates_fails_at_once_and_a_stop_request_ends_the_wait(side):
    from megatron_m2po.rollout_service.waiting import StopRequested

    gen = _generator(side)
    leaser = Leaser(side.trainer, StoreConfig(), side.store, stop_event=side.stop, sources=[gen])
    with pytest.raises(RuntimeError, match="step 6: waiting for 3 groups generated at version 0, but no generation "
                                           "is in flight.*they can never come"):
        leaser.take_step(5, version=10, generated_at=0)
    side.stop.set()
    with pytest.raises(StopRequested, match="stopped while waiting for the rollouts of step 2"):
        leaser.take_async(1, version=0)


def test_weight_push_controller_alone_with_a_disk_sync(tmp_path):
    """EngineControl without engines holds the push: begin waits for generation first and records
    the trainer's version in the store; finish makes it the engines' served version and the
    controller's; a refit needs a version on disk; the transport says whether it can refit one
    engine alone."""
    from megatron_m2po.rollout_service.engine_control import EngineControl
    from megatron_m2po.utils.background_loop import BackgroundLoop

    store = RolloutStore(str(tmp_path / "s.sqlite"))
    bg = BackgroundLoop("test-engines")
    events = []
    engines = EngineControl(store=store, bg=bg,
                            transport=lambda urls: DiskWeightSync(urls, str(tmp_path / "weights"), timeout_s=30),
                            drain=lambda: events.append(("drain", store.current_version)))
    sync = engines.transport
    ctl = WeightPushController(sync, engines=engines)
    try:
        assert ctl.leads and ctl.version == 0 and engines.check() == [] and engines.restart_dead() == []
        engines.refit("http://e0")  # version 0: the engine launched from the base model, nothing to load
        with pytest.raises(RuntimeError, match="engine http://e0 was restarted at weight version 3, but there is no "
                                               "on-disk copy"):
            sync.refit("http://e0", 3)
        plan = ctl.begin(1, 1)
        assert events == [("drain", None)] and store.current_version == 1 and ctl.version == 0
        weights = [("model.embed_tokens.weight", torch.arange(6, dtype=torch.float32).reshape(2, 3))]
        stats = ctl.finish(plan, [run_stage(plan, 0, iter(weights))])
        assert ctl.version == engines.version == 1 and stats.version == 1 and (tmp_path / "weights" / "v1").is_dir()
        assert sync.can_refit_alone and sync.latest_dir == str(tmp_path / "weights" / "v1")
    finally:
        engines.close()
        bg.close()
        store.close()
    follower = WeightPushController.follower()
    assert not follower.leads and follower.version == 0
    assert not DistributedWeightSync([], backend="gloo").can_refit_alone


def test_group_ids_are_one_format_for_the_trainer_and_the_producers():
    ctx = ProducerContext(client=None, tokenizer=None, reward=None, sampling_params={}, n_samples=1, version=0,
                          group_prefix=group_ids.step_prefix(7), positions=[4, 9])
    assert [ctx.group_id(0), ctx.group_id(1)] == ["s000007-g00004", "s000007-g00009"]
    assert all(g.startswith(group_ids.of_step(7)) for g in group_ids.step_group_ids(7, 12))
    assert not group_ids.step_group_ids(70, 1)[0].startswith(group_ids.of_step(7))
    assert group_ids.trajectory_uid("s000007-g00004", 3) == "s000007-g00004-3"
    assert not group_ids.async_prefix(1_700_000_000_000, 5).startswith("s")
    assert group_ids.eval_prefix("synthetic", 10) == "eval-synthetic-10"


def test_ingestion_server_alone_serves_the_store_to_token_holders_and_no_one_sets_the_version(tmp_path,
                                                                                               monkeypatch):
    import json
    import urllib.error
    import urllib.request

    from megatron_m2po.ingestion.endpoint import IngestionServer

    store = RolloutStore(str(tmp_path / "s.sqlite"))
    bg = BackgroundLoop("test-ingestion")
    cfg = StoreConfig(serve_port=0, token_env="M2PO_TEST_INGEST_TOKEN")
    try:
        monkeypatch.delenv("M2PO_TEST_INGEST_TOKEN", raising=False)
        with pytest.raises(ValueError, match=r"set the ingestion token in \$M2PO_TEST_INGEST_TOKEN"):
            IngestionServer(cfg, store, bg).start()
        monkeypatch.setenv("M2PO_TEST_INGEST_TOKEN", "tok")
        server = IngestionServer(cfg, store, bg)
        url = server.start(str(tmp_path / "weights"))
        store.set_version(3)

        def call(path, method="GET", body=None):
            req = urllib.request.Request(url + path, method=method, data=body,
                                         headers={"Authorization": "Bearer tok", "Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read())

        assert call("/v1/version") == {"version": 3}
        with pytest.raises(urllib.error.HTTPError) as e:  # the producers' token cannot set the version
            call("/v1/version", "POST", json.dumps({"version": 9}).encode())
        assert e.value.code == 403 and store.current_version == 3
        server.close()
        with pytest.raises(urllib.error.URLError):
            call("/v1/version")
    finally:
        bg.close()
        store.close()


def test_the_async_loop_keeps_batches_in_flight_up_to_its_capacity(side, tmp_path):
    """Async mode generates several batches at once (one at a time, a slow batch -- a long
    episode, a slow reward -- leaves engines and trainer waiting), and never holds more than its
    capacity: stored unconsumed groups plus the batches in flight. Here a step is two updates of
    N prompts, pushes follow every update and ``max_staleness`` is 6: two steps of data (3 x 2 - 1
    + 1 = 6), i.e. 4 batches of N groups."""
    import asyncio

    from megatron_m2po.rollout_service.continuous import ContinuousGeneration

    gate, started, running, peak = threading.Event(), [0], [0], [0]

    async def gated_producer(ctx: ProducerContext, prompts: list) -> list[Group]:
        started[0] += 1
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        # the batch "generates" until the test lets it finish
        await asyncio.get_running_loop().run_in_executor(None, gate.wait)
        running[0] -= 1
        return await unnamed_producer(ctx, prompts)

    trainer = TrainerConfig(prompts_per_step=2 * N, prompts_per_update=N, run_dir=str(tmp_path), wait_timeout_s=600)
    sampler = GroupSampler(RolloutConfig(n_samples_per_prompt=2), seed=trainer.seed, tokenizer=side.tok, reward=None,
                           producer=gated_producer, client=None, store=side.store, weights=side.weights)
    loop = ContinuousGeneration(trainer, StoreConfig(max_staleness=6), sampler=sampler, dataset=side.dataset(),
                                store=side.store, bg=side.bg, stop_timeout_s=60)
    assert loop.capacity == 4 * N
    # A tighter bound holds less: max_staleness 5 leaves one step of data (2 x 2 - 1 + 1 = 4 <= 5).
    assert ContinuousGeneration(trainer, StoreConfig(max_staleness=5), sampler=sampler, dataset=None, store=side.store,
                                bg=side.bg, stop_timeout_s=1).capacity == 2 * N
    loop.start()
    try:
        wait_until(lambda: started[0] == 4, what="four batches generating at once (the loop's capacity)",
                   hopeless=lambda: "the loop ended" if loop._future.done() else None)
        gate.set()
        wait_until(lambda: side.store.counts()["available"] == 4 * N, what=f"{4 * N} groups stored")
        loop.raise_failed()
    finally:
        gate.set()
        loop.stop()
    assert peak[0] == 4 and started[0] == 4  # full: no fifth batch while 4N groups wait unconsumed
