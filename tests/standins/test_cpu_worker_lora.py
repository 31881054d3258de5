"""LoRA in the CPU worker (``standins/cpu_worker_lora.py``, ``cpu_worker_lora_routes.py``), held to
HF ``peft`` (the adapter merged into the base with ``merge_and_unload``: the independent reference)
and to SGLang 0.5.23's own source (the pinned wheel, read with zipfile and ast).

One worker for the module: ``--lora-paths a1=<dir> --max-lora-rank 8 --lora-target-modules q_proj
o_proj down_proj --max-loras-per-batch 3`` (q_proj stands for SGLang's stacked qkv_proj, so k/v
adapters fit too; gate/up do not). Each test loads what it needs under its own names and unloads it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from types import SimpleNamespace

import aiohttp
import pytest
import torch
from aiohttp import web

from megatron_m2po.rollout.client import EngineError, SGLangClient
from megatron_m2po.standins import cpu_worker_lora, cpu_worker_lora_routes, tensor_payload
from megatron_m2po.utils.net import free_port
from rollout_testlib import cpu_worker_process, hf_logprobs
from sglang_source import class_fields, sglang_routes, sources, tuple_const
from waiting import async_wait_until, wait_until

pytestmark = pytest.mark.slow  # engine processes, routers or multi-rank sweeps in module fixtures: the full suite's lane

PROMPT = [5, 9, 14, 3, 22, 7]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
SERVER_TARGETS = ["q_proj", "o_proj", "down_proj"]
ADAPTERS = {  # name -> (rank, alpha, targets, seed)
    "a1": (4, 8, ["q_proj", "v_proj", "o_proj", "down_proj"], 1),
    "a2": (8, 16, ["q_proj", "k_proj", "down_proj"], 2),
    "rank16": (16, 16, ["q_proj"], 3),
    "gate": (4, 8, ["q_proj", "up_proj"], 4),
}


def _peft_adapter(base, out_dir, rank: int, alpha: int, targets: list[str], seed: int):
    """A saved peft adapter on a copy of ``base`` with random A and B (peft's default B = 0 would
    change nothing), and the HF model with it merged in."""
    import copy

    from peft import LoraConfig, get_peft_model
    base = copy.deepcopy(base)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                                            init_lora_weights=False))
    model.save_pretrained(str(out_dir))
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """name -> (adapter dir, merged HF model)."""
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("adapters")
    return {n: (str(root / n), _peft_adapter(base, root / n, *spec)) for n, spec in ADAPTERS.items()}


@pytest.fixture(scope="module")
def worker(tiny_model_dir, adapters, tmp_path_factory):
    """An engine of tp_size 2 as a client sees it: every per-rank payload is read by two ranks."""
    args = ["--lora-paths", f"a1={adapters['a1'][0]}", "--max-lora-rank", "8", "--lora-target-modules",
            *SERVER_TARGETS, "--max-loras-per-batch", "3", "--tp-size", "2"]
    with cpu_worker_process(tiny_model_dir, args, tmp_path_factory.mktemp("logs") / "worker.log") as url:
        yield url


async def _post(url: str, route: str, body) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + route, json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
            return r.status, await r.json(content_type=None)


def _check(out, merged, prompt=PROMPT):
    torch.testing.assert_close(torch.tensor(out.output_logprobs), hf_logprobs(merged, prompt, out.output_ids, 0.0),
                               atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def sgl():
    return sources()


def test_fields_routes_and_messages_are_sglangs(sgl):
    fields, routes = class_fields(sgl), sglang_routes(sgl)
    base = {"rid", "http_worker_ipc"}
    assert set(cpu_worker_lora_routes.LOAD_FIELDS) <= fields["LoadLoRAAdapterReqInput"]
    assert set(cpu_worker_lora_routes.TENSOR_FIELDS) <= fields["LoadLoRAAdapterFromTensorsReqInput"]
    assert set(cpu_worker_lora_routes.UNLOAD_FIELDS) <= fields["UnloadLoRAAdapterReqInput"]
    assert set(cpu_worker_lora_routes.OUTPUT_FIELDS) == fields["LoRAUpdateOutput"] - base
    assert set(cpu_worker_lora_routes.GENERATE_FIELDS) <= fields["GenerateReqInput"]
    assert routes["/load_lora_adapter"] == "LoadLoRAAdapterReqInput"
    assert routes["/load_lora_adapter_from_tensors"] == "LoadLoRAAdapterFromTensorsReqInput"
    assert routes["/unload_lora_adapter"] == "UnloadLoRAAdapterReqInput"
    assert cpu_worker_lora.SUPPORTED_TARGETS == tuple_const(sgl, "sglang/srt/utils/common.py",
                                                            "SUPPORTED_LORA_TARGET_MODULES")
    manager = sgl["sglang/srt/lora/lora_manager.py"]
    for text in ("because it is already loaded", "is incompatible with the current ",
                 "lora_alpha / self.config.r"):
        assert text in manager or text in sgl["sglang/srt/lora/lora.py"], text
    assert cpu_worker_lora.NOT_ENABLED in sgl["sglang/srt/managers/tokenizer_control_mixin.py"]
    tm = sgl["sglang/srt/managers/tokenizer_manager.py"]
    assert "Got LoRA adapter that has never been loaded" in tm and "was requested, but LoRA is not enabled" in tm
    assert "does not exist. Loaded LoRAs" in sgl["sglang/srt/lora/lora_registry.py"]
    assert cpu_worker_lora.TENSOR_PATH in sgl["sglang/srt/managers/io_struct.py"]
    assert "lora_id" in sgl["sglang/srt/managers/schedule_batch.py"]  # Req: extra_key += lora_id (radix cache)


def test_start_up_checks(tiny_model_dir, adapters):
    """check_lora_server_args's refusals (the launch fails), and an initial adapter outside
    --lora-target-modules (init_lora_shapes)."""
    p = argparse.ArgumentParser()
    p.add_argument("--x", default=None)
    cpu_worker_lora.add_args(p)
    with pytest.raises(ValueError, match="specify both --max-lora-rank and --lora-target-modules"):
        cpu_worker_lora.settings_from_args(p.parse_args(["--enable-lora", "--max-lora-rank", "8"]))
    with pytest.raises(ValueError, match="'all' is specified in --lora-target-modules, it should be the only"):
        cpu_worker_lora.settings_from_args(p.parse_args(["--lora-paths", "x=y", "--lora-target-modules", "all",
                                                         "q_proj"]))
    with pytest.raises(ValueError, match="max_loaded_loras should be greater than or equal to max_loras_per_batch"):
        cpu_worker_lora.settings_from_args(p.parse_args(["--lora-paths", "x=y", "--max-loaded-loras", "2"]))
    assert cpu_worker_lora.settings_from_args(p.parse_args([])) is None
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    s = cpu_worker_lora.settings_from_args(p.parse_args(["--lora-paths", f"g={adapters['gate'][0]}",
                                                         "--lora-target-modules", "q_proj"]))
    with pytest.raises(cpu_worker_lora.LoRAStartError, match=r"contains target modules \['gate_up_proj'\]"):
        cpu_worker_lora.LoRAServing(model, s)
    s = cpu_worker_lora.settings_from_args(p.parse_args(["--lora-paths", f"g={adapters['gate'][0]}"]))
    served = cpu_worker_lora.LoRAServing(model, s)  # rank and targets from the adapter
    assert served.max_lora_rank == 4 and served.target_modules == {"qkv_proj", "gate_up_proj"}
    # can_schedule_lora_req: at most --max-loras-per-batch adapters (the base counts) run at once
    served.max_loras_per_batch = 2
    waiting = [SimpleNamespace(lora_id=i) for i in (None, "a", "b", "a", None)]
    new, rest = served.admit(waiting, 10, [])
    assert [w.lora_id for w in new] == [None, "a", "a", None] and [w.lora_id for w in rest] == ["b"]
    new, rest = served.admit(waiting, 10, ["b"])
    assert [w.lora_id for w in new] == [None, "b", None] and [w.lora_id for w in rest] == ["a", "a"]


def test_adapter_equals_peft_merged_and_base_without_it(worker, tiny_model_dir, adapters):
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    async def go():
        async with SGLangClient(worker, max_retries=0) as c:
            return await c.generate(PROMPT, GREEDY, lora_path="a1"), await c.generate(PROMPT, GREEDY)
    with_a1, plain = asyncio.run(go())
    _check(with_a1, adapters["a1"][1])
    _check(plain, base)
    assert with_a1.output_ids != plain.output_ids or not torch.allclose(
        torch.tensor(with_a1.output_logprobs), torch.tensor(plain.output_logprobs), atol=1e-2)


def test_rows_of_one_batch_under_different_adapters(worker, adapters):
    """The same prompt under a1, a2 and the base in one batch: each row is its own adapter's
    single-row result, and the prefix cache keeps the adapters' KV apart."""
    async def go():
        async with SGLangClient(worker, max_retries=0) as c:
            await c.load_lora_adapter("b2", adapters["a2"][0])
            try:
                await c.flush_cache()
                single = [await c.generate(PROMPT, GREEDY, lora_path=n) for n in ("a1", "b2", None)]
                status, batch = await _post(worker, "/generate", {"input_ids": [PROMPT] * 3, "sampling_params": GREEDY,
                                                                  "return_logprob": True,
                                                                  "lora_path": ["a1", "b2", None]})
                assert status == 200, batch
            finally:
                await c.unload_lora_adapter("b2")
            return single, batch
    single, batch = asyncio.run(go())
    assert [s.cached_tokens for s in single] == [0, 0, 0]  # KV of a1 is not served to b2, nor to the base
    for s, b in zip(single, batch):
        assert s.output_ids == b["output_ids"]
        torch.testing.assert_close(torch.tensor([x[0] for x in b["meta_info"]["output_token_logprobs"]]),
                                   torch.tensor(s.output_logprobs), atol=1e-5, rtol=1e-5)
    _check(single[1], adapters["a2"][1])


def test_load_from_tensors_equals_load_from_disk(worker, adapters):
    import json

    from safetensors.torch import load_file
    path = adapters["a2"][0]
    config = json.load(open(os.path.join(path, "adapter_config.json")))
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")  # CPU tensors to another process (tensor_payload.py)

    async def go():
        async with SGLangClient(worker, max_retries=0) as c:
            # one payload per TP rank (the worker is an engine of tp_size 2); fewer is SGLang's IndexError
            with pytest.raises(EngineError, match="1 serialized payload.s. for an engine of tp_size 2"):
                await c.load_lora_adapter_from_tensors("t2", config, [tensor_payload.serialize(tensors)])
            out = await c.load_lora_adapter_from_tensors("t2", config,
                                                         [tensor_payload.serialize(tensors) for _ in range(2)])
            assert out["loaded_adapters"]["t2"] == "__tensor__"
            await c.load_lora_adapter("d2", path)
            try:
                return [await c.generate(PROMPT, GREEDY, lora_path=n) for n in ("t2", "d2")]
            finally:
                await c.unload_lora_adapter("t2")
                await c.unload_lora_adapter("d2")
                # tokenizer_manager.py _resolve_lora_path reloads an unloaded name from its path: "__tensor__"
                with pytest.raises(EngineError, match="Failed to implicitly load LoRA adapter t2"):
                    await c.generate(PROMPT, GREEDY, lora_path="t2")
    try:
        t2, d2 = asyncio.run(go())
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    assert t2.output_ids == d2.output_ids and t2.output_logprobs == d2.output_logprobs
    _check(t2, adapters["a2"][1])


def test_refusals_are_sglangs(worker, adapters, sgl):
    async def go():
        async with SGLangClient(worker, max_retries=0) as c:
            for name, match in (("rank16", "with rank 16 is incompatible with the current LoRA memory pool"),
                                ("gate", "with rank 4 is incompatible")):  # up_proj is not in the targets
                status, out = await _post(worker, "/load_lora_adapter", {"lora_name": name,
                                                                          "lora_path": adapters[name][0]})
                assert status == 400 and not out["success"] and match in out["error_message"], out
                assert out["loaded_adapters"] == {"a1": adapters["a1"][0]}
            status, out = await _post(worker, "/load_lora_adapter", {"lora_name": "a1", "lora_path": adapters["a2"][0]})
            assert status == 400 and out["error_message"] == "Failed to load LoRA adapter a1 because it is already loaded"
            with pytest.raises(EngineError, match="Got LoRA adapter that has never been loaded: nope") as e:
                await c.generate(PROMPT, GREEDY, lora_path="nope")
            assert e.value.status == 400
            status, out = await _post(worker, "/unload_lora_adapter", {"lora_name": "nope"})
            assert status == 400 and out == {"success": False, "loaded_adapters": None, "error_message":
                                             "LoRA with name nope does not exist. Loaded LoRAs: odict_keys(['a1'])"}
            status, out = await _post(worker, "/load_lora_adapter", {"lora_name": "x"})
            assert status == 422 and out["detail"][0]["loc"] == ["body", "lora_path"]
            status, out = await _post(worker, "/generate", {"input_ids": [PROMPT] * 2, "lora_path": ["a1"]})
            assert status == 400 and "lora_path has 1 entries for 2 prompts" in out["error"]["message"]
            return await c.get_server_info()
    info = asyncio.run(go())
    lora_fields = sgl["sglang/srt/arg_groups/fields/lora.py"]  # server_info = the resolved server args
    for key in ("enable_lora", "max_lora_rank", "lora_target_modules", "lora_paths", "max_loras_per_batch",
                "max_loaded_loras"):
        assert f"    {key}: A[" in lora_fields and key in info, key
    assert (info["enable_lora"], info["max_lora_rank"], info["max_loras_per_batch"]) == (True, 8, 3)
    assert info["lora_target_modules"] == ["down_proj", "o_proj", "qkv_proj"]
    assert [p[1:] for p in info["lora_paths"]] == [["a1", adapters["a1"][0], False]]


def test_unload_waits_for_the_requests_using_the_adapter(worker, adapters):
    """_unload_lora_adapter_locked: the name is gone at once, the unload ends after the request."""
    async def go():
        async with SGLangClient(worker, max_retries=0) as c:
            await c.load_lora_adapter("u1", adapters["a2"][0])
            await c.slow_down(0.05)
            try:
                gen = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0.0},
                                                     lora_path="u1"))
                await async_wait_until(lambda: _running(c), what="the request under u1 running")
                unload = asyncio.create_task(c.unload_lora_adapter("u1"))
                done, _ = await asyncio.wait([gen, unload], return_when=asyncio.FIRST_COMPLETED)
                assert gen in done, "the unload answered while a request still used the adapter"
                out = await gen
                assert (await unload)["loaded_adapters"] == {"a1": adapters["a1"][0]}
            finally:
                await c.slow_down(None)
            again = await c.generate(PROMPT, GREEDY, lora_path="u1")  # reloaded from its path (_resolve_lora_path)
            await c.unload_lora_adapter("u1")
            return out, again
    out, again = asyncio.run(go())
    assert len(out.output_ids) == 12
    _check(out, adapters["a2"][1])
    _check(again, adapters["a2"][1])


def test_dispatch_client_fans_adapter_calls_out(worker, adapters):
    from megatron_m2po.rollout.dispatch import DispatchClient

    async def go():
        async with DispatchClient([worker], max_retries=0) as c:
            loaded = await c.load_lora_adapter("f2", adapters["a2"][0])
            assert loaded[worker]["loaded_adapters"]["f2"] == adapters["a2"][0]
            try:
                return await c.generate(PROMPT, GREEDY, lora_path="f2")
            finally:
                await c.unload_lora_adapter("f2")
    _check(asyncio.run(go()), adapters["a2"][1])


async def _running(c) -> bool:
    return (await c.loads())["num_running_reqs"] > 0


def test_lora_off_refusals():
    """Without --enable-lora: the LoRA routes and a generate with lora_path are SGLang's 400."""
    class App(cpu_worker_lora_routes.LoRARoutes):
        engine = SimpleNamespace(lora=None)

        def _via_scheduler(self, fn):
            return fn

    async def go():
        app, web_app = App(), web.Application()
        app._lora_routes(web_app.router)
        runner = web.AppRunner(web_app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            for route, body in (("/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}),
                                ("/unload_lora_adapter", {"lora_name": "a"})):
                status, out = await _post(f"http://127.0.0.1:{port}", route, body)
                assert status == 400 and out == {"success": False, "error_message": cpu_worker_lora.NOT_ENABLED,
                                                 "loaded_adapters": None}
            with pytest.raises(cpu_worker_lora_routes.LoRARequestError, match="LoRA adapter 'a' was requested, but "
                               "LoRA is not enabled"):
                await app.lora_acquire([None, "a"], True)
            assert await app.lora_acquire([None], False) == [None]
        finally:
            await runner.cleanup()
    asyncio.run(go())


def test_adapter_push_loads_routes_tags_and_unloads(worker, adapters, tmp_path):
    """weights/lora_push.py ``AdapterPush`` on this worker (one worker start for both modules' worth
    of checks): version 1 is a2's tensors, 2 and 3 a1's. After each push a request without its own
    ``lora_path`` runs under the newest adapter (equal to peft's merged model) and every token is
    tagged with that version; the engine reports it; past ``keep=2`` the oldest is unloaded in the
    background; a relaunched engine (``refit``) loads the current one again; version 4 goes from
    memory (``/load_lora_adapter_from_tensors``, shared-memory handles) instead of a directory."""
    import json

    from safetensors.torch import load_file

    from megatron_m2po.utils.background_loop import BackgroundLoop
    from megatron_m2po.weights.lora_push import AdapterPush, adapter_name

    def tensors(name):
        d = adapters[name][0]
        return list(load_file(os.path.join(d, "adapter_model.safetensors")).items()), \
            json.load(open(os.path.join(d, "adapter_config.json")))

    a2, a2_cfg = tensors("a2")
    a1, _ = tensors("a1")
    bg = BackgroundLoop("test-adapters")
    push = AdapterPush(tmp_path, {**a2_cfg, "r": 8, "lora_alpha": 16,
                                  "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]},
                       client_for=lambda url: SGLangClient(url, max_retries=0), bg=bg, keep=2)

    async def generate():
        async with SGLangClient(worker, max_retries=0) as c:
            c.adapter = lambda: push.current
            return await c.generate(PROMPT, GREEDY), await c.weight_version()

    async def loaded() -> set:
        async with SGLangClient(worker, max_retries=0) as c:
            out = await c.load_lora_adapter("probe", adapters["a2"][0])
            await c.unload_lora_adapter("probe")
            return set(out["loaded_adapters"]) - {"probe", "a1"}

    try:
        assert push.current is None  # version 0: the base, no lora_path
        push.push(a2, 1, [worker])
        out, served = bg.run(generate())
        _check(out, adapters["a2"][1])
        assert out.token_weight_versions == ["1"] * len(out.output_ids) and served == "1"
        push.push(a1, 2, [worker])
        push.push(a1, 3, [worker])
        out, served = bg.run(generate())
        assert out.token_weight_versions == ["3"] * len(out.output_ids) and served == "3"
        wait_until(lambda: bg.run(loaded()) == {adapter_name(2), adapter_name(3)},
                   what="m2po_v1 unloaded once two newer versions are loaded", timeout=60)
        assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == ["v2", "v3"]  # v1's directory pruned
        async def forget_v3():  # the engine forgets v3, as a relaunched one holds nothing
            async with SGLangClient(worker, max_retries=0) as c:
                await c.unload_lora_adapter(adapter_name(3))
        bg.run(forget_v3())
        push.refit(worker, 3)  # its record is dropped and v3 loaded again
        assert push.loaded[worker] == [3]
        out, served = bg.run(generate())
        assert out.token_weight_versions == ["3"] * len(out.output_ids)
        # model.lora.adapter_transport=memory: /load_lora_adapter_from_tensors, no directory
        push.in_memory = True
        push.push(a2, 4, [worker])
        out, served = bg.run(generate())
        _check(out, adapters["a2"][1])
        assert out.token_weight_versions == ["4"] * len(out.output_ids) and served == "4"
        assert not (tmp_path / "lora" / "v4").exists()
    finally:
        async def unload_all():
            async with SGLangClient(worker, max_retries=0) as c:
                for n in (adapter_name(2), adapter_name(3), adapter_name(4)):
                    try:
                        await c.unload_lora_adapter(n)
                    except EngineError:
                        pass
        bg.run(unload_all())
        bg.close()


def test_in_memory_adapter_survives_an_engine_releasing_it_and_refits(worker, adapters, tmp_path):
    """``model.lora.adapter_transport=memory`` on an engine of tp_size 2: the adapter is pickled once
    per TP rank (SGLang's ``entrypoints/engine.py`` ``_serialize_tensors_per_rank``). Each rank's
    unpickling releases the reference one pickling took (torch ``reductions.py``), so one payload
    repeated for both ranks released the shared-memory segment twice: once the engine let the
    adapter go (as the ranks of an engine that is relaunched do), its name was gone, and the refit
    of the relaunched engine failed (``unable to open shared memory object ... No such file``)."""
    import json

    from safetensors.torch import load_file

    from megatron_m2po.utils.background_loop import BackgroundLoop
    from megatron_m2po.weights.lora_push import AdapterPush, adapter_name

    d = adapters["a2"][0]
    a2 = list(load_file(os.path.join(d, "adapter_model.safetensors")).items())
    cfg = json.load(open(os.path.join(d, "adapter_config.json")))
    bg = BackgroundLoop("test-adapters-tp2")
    push = AdapterPush(tmp_path, {**cfg, "r": 8, "lora_alpha": 16,
                                  "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]},
                       client_for=lambda url: SGLangClient(url, max_retries=0), bg=bg, keep=2, in_memory=True)

    async def tp_size() -> int:
        async with SGLangClient(worker, max_retries=0) as c:
            return int((await c.get_server_info())["tp_size"])

    async def release(name: str) -> None:
        async with SGLangClient(worker, max_retries=0) as c:
            await c.unload_lora_adapter(name)

    async def generate():
        async with SGLangClient(worker, max_retries=0) as c:
            c.adapter = lambda: push.current
            return await c.generate(PROMPT, GREEDY)

    try:
        assert bg.run(tp_size()) == 2
        push.push(a2, 7, [worker])
        bg.run(release(adapter_name(7)))  # the engine lets it go: both ranks' references end
        push.refit(worker, 7)  # the relaunched engine loads the same tensors again
        out = bg.run(generate())
        _check(out, adapters["a2"][1])
        assert out.token_weight_versions == ["7"] * len(out.output_ids)
    finally:
        try:
            bg.run(release(adapter_name(7)))
        except EngineError:
            pass
        bg.close()
