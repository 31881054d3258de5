"""rollout.launcher=ray on a local 2-CPU Ray cluster: two CPU workers as Ray actors behind the real
sglang-router; a killed actor is detected, replaced, refit and registered again."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

ray = pytest.importorskip("ray")

from megatron_m2po.config import RolloutConfig  # noqa: E402
from megatron_m2po.rollout.client import SGLangClient  # noqa: E402
from megatron_m2po.rollout.engines import EngineFleet, FleetError  # noqa: E402
from megatron_m2po.rollout.ray_launcher import RayHandle, RayLauncher  # noqa: E402
from megatron_m2po.weights.disk import DiskWeightSync  # noqa: E402
from rollout_testlib import hf_logprobs  # noqa: E402
from waiting import wait_until  # noqa: E402

pytestmark = pytest.mark.slow  # engine processes, routers or multi-rank sweeps in module fixtures: the full suite's lane

PROMPTS = [[2, 3, 4, 5], [9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] not in ("Z", "X")
    except FileNotFoundError:
        return False


async def _generate(url: str, prompts, params):
    async with SGLangClient(url, concurrency=8, timeout_s=60) as c:
        return await c.generate_many(prompts, params)


def _versions(urls):
    async def go():
        out = []
        for u in urls:
            async with SGLangClient(u) as c:
                out.append(await c.weight_version())
        return out
    return asyncio.run(go())


@pytest.fixture(scope="module")
def ray_fleet(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    # address="local": a fresh 2-CPU cluster even when RAY_ADDRESS points at another one.
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20,
             log_to_driver=False)
    run_dir = tmp_path_factory.mktemp("ray_run")
    cfg = RolloutConfig(engine="cpu_worker", launcher="ray", num_engines=2, base_port=0, use_router=True,
                        concurrency=8, weight_sync_timeout_s=30.0, ray_cpus_per_engine=1.0)
    state = {"refits": [], "version": 0}
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def refit(url: str) -> None:
        state["refits"].append(url)
        state["sync"].push(state["sync"].latest_dir, state["version"], engine_urls=[url])

    fleet = EngineFleet(cfg, tiny_model_dir, run_dir=str(run_dir), refit_fn=refit, startup_timeout_s=120)
    try:
        fleet.start()
        state["sync"] = DiskWeightSync(fleet.engine_urls, str(run_dir / "weights"), base_model_dir=tiny_model_dir,
                                       timeout_s=30)
        yield fleet, model, state
    finally:
        if "sync" in state:
            state["sync"].close()
        fleet.stop()
        ray.shutdown()


@pytest.mark.slow  # a Ray cluster and its engines, end to end
def test_engines_are_ray_actors_with_resources(ray_fleet):
    fleet, model, _ = ray_fleet
    assert isinstance(fleet.launcher, RayLauncher)
    assert (fleet.launcher.num_cpus, fleet.launcher.num_gpus) == (1.0, 0.0)
    handles = [e.handle for e in fleet.engines]
    assert all(isinstance(h, RayHandle) and h.alive() for h in handles)
    assert fleet.engine_urls == [h.url for h in handles]
    # Each actor holds one CPU: the 2-CPU cluster is full.
    assert ray.available_resources().get("CPU", 0.0) == 0.0
    # The engine runs as a child of the actor process, not of this driver.
    for h in handles:
        info = ray.get(h.actor.info.remote())
        assert info["actor_pid"] != os.getpid() and info["pid"] == h.pid and _pid_alive(h.pid)


def test_generate_through_router_matches_hf(ray_fleet):
    fleet, model, _ = ray_fleet
    outs = asyncio.run(_generate(fleet.url, PROMPTS, GREEDY))
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.output_ids) == 6
        ref = hf_logprobs(model, prompt, out.output_ids, 0.0)
        torch.testing.assert_close(torch.tensor(out.output_logprobs), ref, atol=1e-4, rtol=0)
        with torch.no_grad():  # greedy: every token is the argmax of HF's next-token logits
            logits = model(torch.tensor([prompt + out.output_ids])).logits[0, len(prompt) - 1:-1]
        assert out.output_ids == logits.argmax(-1).tolist()


def test_killed_actor_is_replaced_and_refit(ray_fleet):
    fleet, model, state = ray_fleet
    # New weights at version 1 on both engines.
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    state["version"] = 1
    state["sync"].push(list(model.named_parameters()), 1)
    assert _versions(fleet.engine_urls) == ["1", "1"]

    victim = fleet.engines[0]
    old_handle, old_pid = victim.handle, victim.handle.pid
    ray.kill(old_handle.actor, no_restart=True)
    wait_until(lambda: not old_handle.alive(), what="the ray.kill'ed actor counting as dead", timeout=60)
    # the engine child dies with its actor (PDEATHSIG)
    wait_until(lambda: not _pid_alive(old_pid), what=f"engine process {old_pid} exiting with its actor", timeout=60)

    restarted = fleet.check_and_restart()
    assert restarted == [victim.url] and victim.restarts == 1
    assert victim.handle is not old_handle and victim.handle.alive() and victim.handle.pid != old_pid
    assert state["refits"] == [victim.url]            # refit before it was registered again
    assert _versions(fleet.engine_urls) == ["1", "1"]  # the new engine serves the current weights
    workers = {w["url"].rstrip("/") for w in fleet._router_workers() if w.get("is_healthy")}
    assert workers == set(fleet.engine_urls)
    assert victim.url.startswith("http://127.0.0.1:")  # rollout.host is loopback: bound and advertised as is
    assert fleet.check_and_restart() == []          # nothing else is dead

    # Both engines (router picks either) generate with the refit weights.
    for url in fleet.engine_urls + [fleet.url]:
        outs = asyncio.run(_generate(url, PROMPTS[:2], GREEDY))
        for prompt, out in zip(PROMPTS[:2], outs):
            ref = hf_logprobs(model, prompt, out.output_ids, 0.0)
            torch.testing.assert_close(torch.tensor(out.output_logprobs), ref, atol=1e-4, rtol=0)
            assert set(out.token_weight_versions or ["1"]) == {"1"}


def test_unplaceable_engine_is_a_clear_error(ray_fleet, tmp_path):
    from megatron_m2po.rollout.launcher import EngineSpec
    launcher = RayLauncher(num_cpus=3.0, place_timeout_s=2.0)
    spec = EngineSpec(9, "127.0.0.1", 1, ["true"], {}, tmp_path / "e.log")
    with pytest.raises(FleetError, match=r"num_cpus=3\.0.*ray_cpus_per_engine"):
        launcher.launch(spec)


def test_from_config_requests_gpus_for_sglang():
    cfg = RolloutConfig(engine="sglang", launcher="ray", engine_tp=4, ray_cpus_per_engine=8.0)
    launcher = RayLauncher.from_config(cfg)
    assert (launcher.num_cpus, launcher.num_gpus) == (8.0, 4.0)
    cfg = RolloutConfig(engine="cpu_worker", launcher="ray", engine_tp=4)
    assert RayLauncher.from_config(cfg).num_gpus == 0.0


@pytest.mark.slow  # a Ray cluster and its engines, end to end
def test_ray_engine_starts_with_sglang_python(ray_fleet, tiny_model_dir, tmp_path, monkeypatch):
    """The Ray actor runs the fleet's SGLang command, i.e. ``$SGLANG_PYTHON -m sglang.launch_server``."""
    from rollout_testlib import sglang_python_standin
    standin = sglang_python_standin(tmp_path)
    monkeypatch.setenv("SGLANG_PYTHON", standin)
    cfg = RolloutConfig(engine="sglang", launcher="ray", num_engines=1, base_port=0)
    fleet = EngineFleet(cfg, tiny_model_dir, run_dir=str(tmp_path))
    spec = fleet._spec(0, fleet._engine_port(0))
    handle = RayLauncher(num_cpus=0.0).launch(spec)  # the module's cluster is full: no CPU reservation
    try:
        wait_until(lambda: asyncio.run(_healthy(handle.url)), what=f"engine at {handle.url} healthy",
                   timeout=120, hopeless=lambda: not handle.alive() and f"it exited; see {spec.log_path}")
    finally:
        handle.stop()
    log = spec.log_path.read_text()
    assert f"{standin} -m sglang.launch_server" in log and "sglang-python called with: -m sglang.launch_server" in log


async def _healthy(url: str) -> bool:
    async with SGLangClient(url, max_retries=0) as c:
        return await c.health(2.0)
