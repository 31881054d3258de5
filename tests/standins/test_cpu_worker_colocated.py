"""Colocated mode in the CPU worker: SGLang 0.5.23's /release_memory_occupation,
/resume_memory_occupation and /update_weights_from_tensor, against SGLang's own source (the pinned
wheel, read with zipfile and ast) and against HF transformers.

One worker process (``--enable-memory-saver --enable-weights-cpu-backup``, recording into a memory
ledger) for the module; tensors come from another process through shared memory, as CUDA IPC
handles do on GPUs. Every test leaves the worker resumed, idle and outside an update session.
"""

from __future__ import annotations

import ast
import asyncio
import os
import socket
import subprocess
import sys

import aiohttp
import pytest
import torch

from megatron_m2po.rollout.client import EngineError, SGLangClient
from megatron_m2po.rollout.dispatch import DispatchClient
from megatron_m2po.standins import cpu_memory_saver, cpu_worker_colocated, memory_ledger, tensor_payload
from megatron_m2po.utils.net import free_port
from rollout_testlib import build_tiny_qwen2, hf_logprobs
from sglang_source import class_fields, sources
from waiting import async_wait_until, wait_until

pytestmark = pytest.mark.slow  # engine processes, routers or multi-rank sweeps in module fixtures: the full suite's lane

PROMPT = [5, 9, 14, 3, 22, 7]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
BUDGET = 300 << 20  # the worker holds ~0.1 MiB of weights and reserves 256 MiB of KV (its prefix cache)


@pytest.fixture(scope="module")
def sgl():
    return sources()


def test_fields_and_facts_are_sglangs(sgl):
    fields = class_fields(sgl)
    assert set(cpu_worker_colocated.UPDATE_FIELDS) <= fields["UpdateWeightsFromTensorReqInput"]
    for cls in ("ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput"):
        assert set(cpu_worker_colocated.OCCUPATION_FIELDS) == fields[cls] - {"rid", "http_worker_ipc"}
    consts = sgl["sglang/srt/constants.py"]
    for tag in cpu_memory_saver.ALL_TAGS:
        assert f'"{tag}"' in consts
    updater = sgl["sglang/srt/managers/scheduler_components/weight_updater.py"]
    assert cpu_memory_saver.NOT_IDLE in updater and "self.offload_tags.remove(tag)" in updater
    runner = sgl["sglang/srt/model_executor/model_runner_components/weight_updater.py"]
    assert 'load_format == "flattened_bucket"' in runner and 'f"Unknown load_format={load_format}"' in runner
    bucket = ast.parse(sgl["sglang/srt/weight_sync/tensor_bucket.py"])
    meta = next(c for c in ast.walk(bucket) if isinstance(c, ast.ClassDef) and c.name == "FlattenedTensorMetadata")
    assert [s.target.id for s in meta.body if isinstance(s, ast.AnnAssign)] == \
        list(tensor_payload.FlattenedTensorMetadata.__dataclass_fields__)


def test_the_unpickler_allows_only_what_sglangs_allows(sgl):
    tree = ast.parse(sgl["sglang/srt/utils/common.py"])
    safe = next(c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == "SafeUnpickler")
    allowed = next(ast.literal_eval(s.value) for s in safe.body if isinstance(s, ast.Assign)
                   and s.targets[0].id == "ALLOWED_GLOBALS")
    assert tensor_payload.ALLOWED <= allowed, sorted(tensor_payload.ALLOWED - allowed)
    assert {("torch.multiprocessing.reductions", "rebuild_storage_filename"), ("types", "SimpleNamespace"),
            ("torch._utils", "_rebuild_tensor_v2")} <= tensor_payload.ALLOWED
    blocked = tensor_payload.serialize(socket.getaddrinfo)
    with pytest.raises(RuntimeError, match=r"Blocked unsafe global \(socket.getaddrinfo\)"):
        tensor_payload.deserialize(blocked)


class _CudaHandle:
    """Pickles as the trainer's CUDA IPC handle does (``colocated_bucket._reduce_tensor``: the device
    argument, index 6, a UUID string)."""

    def __init__(self, device) -> None:
        self.device = device

    def __reduce__(self):
        from torch.multiprocessing import reductions

        return reductions.rebuild_cuda_tensor, (torch.Tensor, (4,), (1,), 0, torch.UntypedStorage, torch.uint8,
                                                self.device, b"handle", 4, 0, b"ref", 0, b"event", False)


def test_cuda_handles_resolve_their_device_by_uuid_as_sglangs_patch_does(sgl):
    """An engine resolves ``rebuild_cuda_tensor`` to ``patch_torch.py``'s ``_rebuild_cuda_tensor_modified``,
    which reads index 6 as a UUID; torch's own would take the UUID string for an index. The GPU row 9
    (``tools/gpu_check.py --only colocated``) opens real handles through this path."""
    src = sgl["sglang/srt/utils/patch_torch.py"]
    assert "_REDUCE_TENSOR_ARG_DEVICE_INDEX = 6" in src and 'raise Exception("Invalid device_uuid="' in src
    uuid = "GPU-00000000-1111-2222-3333-444444444444"  # no such device here (or on any machine)
    with pytest.raises(Exception, match=f"Invalid device_uuid={uuid}"):
        tensor_payload.deserialize(tensor_payload.serialize(_CudaHandle(uuid)))
    with pytest.raises(Exception, match="Unknown type"):
        tensor_payload.deserialize(tensor_payload.serialize(_CudaHandle(1.5)))


def test_released_weights_leave_and_come_back(tmp_path):
    """Without the CPU backup (SGLang's default) the resumed content is undefined (NaN here); the
    buffers come back from the stash either way; the storages hold nothing while released."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(build_tiny_qwen2(tmp_path / "m"), dtype=torch.float32).eval()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    for backup in (True, False):
        saver = cpu_memory_saver.MemorySaver(model, enabled=True, cpu_backup=backup, kv_bytes=0)
        saver.release(["weights"], idle=True, flush=lambda: None)
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        assert saver.refusal() is not None and saver.refusal(tags=["kv_cache"]) is None
        saver.resume(["weights"])
        state = model.state_dict()
        for n, t in before.items():
            if backup or "rotary" in n:
                assert torch.equal(state[n], t), n
            else:
                assert torch.isnan(state[n]).all(), n
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(before[n])
    with pytest.raises(cpu_memory_saver.OccupationError, match="only when server is idle"):
        saver.release(None, idle=False, flush=lambda: None)


def _file_mappings(suffix: str) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of files whose name ends in ``suffix`` (Linux)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].endswith(suffix):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
@pytest.mark.parametrize("tie", [False, True])
def test_worker_weights_live_in_its_own_memory_not_the_checkpoint_mapping(tmp_path, tie):
    """SGLang builds its model on the device and copies the checkpoint in (``loader.py``
    ``DefaultModelLoader.load_model``). transformers' ``from_pretrained`` leaves parameters as views
    of the safetensors file's private mapping (checked here, so the test sees what it guards
    against), into which every push wrote 1.3-2x slower than into own memory; the worker's must not
    be, and tied weights stay one tensor."""
    from transformers import AutoModelForCausalLM

    from megatron_m2po.standins.cpu_worker import Engine

    model_dir = build_tiny_qwen2(tmp_path / "m", seed=3, tie=tie)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mapped = _file_mappings(".safetensors")

    def in_file(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() < hi for lo, hi in mapped)
    assert mapped and any(in_file(p) for p in hf.parameters()), "transformers no longer maps the checkpoint"
    engine = Engine(model_dir)
    mapped = _file_mappings(".safetensors")
    assert not [n for n, p in engine.model.named_parameters() if in_file(p)]
    assert not [n for n, b in engine.model.named_buffers() if b.numel() and in_file(b)]
    for (n, a), b in zip(hf.state_dict().items(), engine.model.state_dict().values()):
        assert torch.equal(a, b), n
    assert (engine.model.lm_head.weight is engine.model.get_input_embeddings().weight) == tie


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    model_dir = build_tiny_qwen2(tmp_path_factory.mktemp("colocated_model"), seed=5)
    ledger_dir = tmp_path_factory.mktemp("ledger")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update({memory_ledger.LEDGER_ENV: str(ledger_dir), memory_ledger.BUDGET_ENV: str(BUDGET),
                memory_ledger.NODE_ENV: "colocated-test"})
    port = free_port()
    log = open(tmp_path_factory.mktemp("logs") / "worker.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "megatron_m2po.standins.cpu_worker", "--model-path", model_dir,
                             "--port", str(port), "--enable-memory-saver", "--enable-weights-cpu-backup"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: asyncio.run(SGLangClient(url, max_retries=0).health(1.0)), what="the worker healthy",
                   timeout=120, hopeless=lambda: proc.poll() is not None and f"it exited ({log.name})")
        yield url, model_dir, memory_ledger.MemoryLedger(ledger_dir, "colocated-test", BUDGET)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


async def _post(url: str, route: str, body=None):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + route, json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
            return r.status, await r.json(content_type=None)


def test_release_refuses_generation_and_resume_gives_the_same_tokens(worker):
    url, _, ledger = worker

    async def go():
        async with SGLangClient(url, max_retries=0) as c:
            before = await c.generate(PROMPT, GREEDY)
            resident = ledger.resident(0)
            assert sorted(resident) == [f"cpu_worker@127.0.0.1:{url.rsplit(':', 1)[1]}:{t}"
                                        for t in ("kv_cache", "weights")]
            await c.release_memory_occupation()
            assert ledger.resident(0) == {}
            with pytest.raises(EngineError, match="weights and kv_cache memory is released") as e:
                await c.generate(PROMPT, GREEDY)
            assert e.value.status == 400
            assert not await c.health(5.0)
            await c.begin_weight_update()
            status, out = await _post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [
                tensor_payload.serialize([("model.norm.weight", torch.ones(32))], output_str=True)]})
            assert status == 400 and not out["success"] and "weights" in out["message"], out
            await c.end_weight_update()
            with pytest.raises(EngineError, match="already released"):
                await c.release_memory_occupation(["weights"])
            await c.resume_memory_occupation(["weights"])
            with pytest.raises(EngineError, match="kv_cache memory is released"):
                await c.generate(PROMPT, GREEDY)
            with pytest.raises(EngineError, match="not released"):
                await c.resume_memory_occupation()  # weights are resumed already: SGLang's KeyError
            # the trainer back on the GPU: the KV no longer fits, as CUDA would say on resume
            ledger.record(0, "trainer", BUDGET - (200 << 20))
            try:
                with pytest.raises(EngineError, match="CUDA out of memory on resume"):
                    await c.resume_memory_occupation(["kv_cache"])
            finally:
                ledger.record(0, "trainer", 0)
            await c.resume_memory_occupation(["kv_cache"])
            after = await c.generate(PROMPT, GREEDY)
            assert after.output_ids == before.output_ids and after.output_logprobs == before.output_logprobs
            assert await c.health(5.0)
            await c.resume_memory_occupation(["cuda_graph"])  # released with the rest (tags=None)
            with pytest.raises(ValueError, match="memory tags"):
                await c.release_memory_occupation(["weight"])
    asyncio.run(go())


def test_release_needs_an_idle_engine(worker):
    """Running requests refuse a release; paused with retract they wait and do not count
    (``is_fully_idle(ignore_waiting=_engine_paused)``), and continued while released they fail."""
    url = worker[0]

    async def go():
        async with SGLangClient(url, max_retries=0) as c:
            await c.slow_down(0.05)
            task = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 400, "temperature": 0.0,
                                                           "ignore_eos": True}))
            try:
                await async_wait_until(lambda: _running(c), what="a running request", timeout=30)
                with pytest.raises(EngineError, match="only when server is idle"):
                    await c.release_memory_occupation(["kv_cache"])
                await c.pause_generation("retract")
                await c.release_memory_occupation()
                await c.continue_generation()
                out = await task
                assert out.aborted and "released" in out.finish_reason["message"], out.finish_reason
            finally:
                await c.slow_down(None)
                if not task.done():
                    await c.abort(abort_all=True)
                    await asyncio.gather(task, return_exceptions=True)
            await c.resume_memory_occupation()
            assert (await c.generate(PROMPT, GREEDY)).finish_type == "length"
    asyncio.run(go())


async def _running(c: SGLangClient) -> bool:
    return (await c.loads())["num_running_reqs"] > 0


SENDER = """
import sys, types, torch, torch.multiprocessing as mp
from transformers import AutoModelForCausalLM
from megatron_m2po.standins import tensor_payload
model_dir, seed, fmt, ref = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
mp.set_sharing_strategy("file_system")  # CPU tensors to an unrelated process (tensor_payload.py)
torch.manual_seed(seed)
sd = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
new = [(n, t + 0.3 * torch.randn_like(t)) for n, t in sd.items() if "rotary" not in n]
torch.save(dict(new), ref)
if fmt == "flattened_bucket":
    flat = torch.cat([t.flatten().view(torch.uint8) for _, t in new])
    meta, off = [], 0
    for n, t in new:
        nb = t.numel() * t.element_size()
        meta.append(types.SimpleNamespace(name=n, shape=t.shape, dtype=t.dtype, start_idx=off, end_idx=off + nb,
                                          numel=nb))
        off += nb
    obj = {"flattened_tensor": flat, "metadata": meta}
else:
    obj = new
print(tensor_payload.serialize(obj, output_str=True), flush=True)
sys.stdin.read()  # keep the shared memory alive until the engine has loaded it
"""


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_update_from_tensor_of_another_process_matches_transformers(worker, tmp_path, load_format):
    from transformers import AutoModelForCausalLM
    url, model_dir, _ = worker
    ref = tmp_path / "new_weights.pt"
    sender = subprocess.Popen([sys.executable, "-c", SENDER, model_dir, "11", str(load_format), str(ref)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        payload = sender.stdout.readline().strip()
        assert payload, "the sender printed no payload"

        async def go():
            async with SGLangClient(url, max_retries=0) as c:
                await c.begin_weight_update()
                try:
                    out = await c.update_weights_from_tensor([payload], load_format=load_format, weight_version="7")
                finally:
                    await c.end_weight_update()
                assert out["message"] == "Success Weight version updated to 7."
                return await c.generate(PROMPT, {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3})
        got = asyncio.run(go())
    finally:
        sender.stdin.close()
        sender.wait(30)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.load_state_dict(torch.load(ref), strict=False)
    want = hf_logprobs(hf, PROMPT, got.output_ids, 1.0)
    assert got.weight_version == "7"
    torch.testing.assert_close(torch.tensor(got.output_logprobs), want, atol=1e-4, rtol=1e-4)
    orig = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert not torch.allclose(hf_logprobs(orig, PROMPT, got.output_ids, 1.0), want, atol=1e-2)


def test_update_from_tensor_refusals(worker):
    url = worker[0]
    t = [("model.norm.weight", torch.ones(32))]

    async def go():
        async with SGLangClient(url, max_retries=0) as c:
            status, out = await _post(url, "/update_weights_from_tensor",
                                      {"serialized_named_tensors": [tensor_payload.serialize(t, output_str=True)]})
            assert status == 400 and out["message"] == ("update_weights_from_tensor must run between "
                                                        "begin_weight_update() and end_weight_update()")
            status, out = await _post(url, "/update_weights_from_tensor", {"serialized_named_tensors": ["%%"]})
            assert status == 422, out
            await c.begin_weight_update()
            strategy = torch.multiprocessing.get_sharing_strategy()
            try:
                torch.multiprocessing.set_sharing_strategy("file_descriptor")
                with pytest.raises(EngineError, match=r"set_sharing_strategy\('file_system'\)"):
                    await c.update_weights_from_tensor([tensor_payload.serialize(t)])
                torch.multiprocessing.set_sharing_strategy("file_system")
                for fmt, payload, why in [("bucket", t, "Unknown load_format=bucket"),
                                          ("direct", t, "load_format='direct'"),
                                          (None, [("model.nope", torch.ones(2))], "model.nope"),
                                          (None, socket.getaddrinfo, "Blocked unsafe global")]:
                    with pytest.raises(EngineError, match=why):
                        await c.update_weights_from_tensor([tensor_payload.serialize(payload)], load_format=fmt)
                fan = DispatchClient([url])
                try:
                    with pytest.raises(EngineError, match="per engine"):
                        await fan.update_weights_from_tensor([])
                    await fan.release_memory_occupation(["kv_cache"])
                    await fan.resume_memory_occupation(["kv_cache"])
                finally:
                    await fan.close()
            finally:
                torch.multiprocessing.set_sharing_strategy(strategy)
                await c.end_weight_update()
    asyncio.run(go())
