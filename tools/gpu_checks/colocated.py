"""Row 9: one colocated cycle on one GPU -- release, reload, train, resume, transfer, offload, resume.

The actor (Qwen2.5-1.5B shape, random weights, bf16, the distributed optimizer as the colocated
recipe runs it) and an engine process (``colocated_engine.py``: the base checkpoint's tensors on the
same GPU under HF names, and a KV pool) time-share one GPU through colocated mode's own calls, in the
order ``trainer/colocated.py`` runs them:

    to_trainer: engine releases weights + kv_cache; actor.reload(); one M2PO update
    to_engines: engine resumes weights; ColocatedWeightSync.push(actor.iter_hf_weights()) (CUDA IPC
                handles in flattened buckets, /update_weights_from_tensor); actor.offload();
                engine resumes kv_cache

Claims (PASS / FAIL): after every push the engine holds the trainer's weights bit for bit (an exact
integer digest of every tensor's bytes, computed on the GPU by both processes; the updates must have
moved the weights away from the base model the engine started with); after every offload
the actor's census leaves only module buffers on the device and ``torch.cuda.memory_allocated`` of
the trainer falls to at most 1 % of its training state (the caching allocator's blocks are given
back: ``empty_cache``). Reported (INFO): seconds of each phase (median of ``repeats`` cycles), the
push's GB/s beside a plain device-to-device copy of the same bytes in one process (the limit: the
engine must write every byte once; the push also packs each bucket, a second copy), and the GPU's
memory in use (``mem_get_info``, both processes) in each state against the sum of both resident.

``--cpu-smoke``: the tiny model on CPU, the engine's tensors in host memory, the handles shared
memory (the CPU worker's transport); the machinery only.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

from megatron_m2po.utils.net import free_port, unreachable

from .colocated_engine import digest
from .models import _actor_config, make_batch, make_random_qwen2
from .report import Row
from .throughput import QWEN25_15B

COLOCATED_CHECK = "colocated cycle (release / transfer / resume)"
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=256, max_position_embeddings=512, tie_word_embeddings=True)


def _call(url: str, route: str, body=None, timeout: float = 600.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + route, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = r.read()
    return json.loads(out) if out else {}


def _wait_healthy(url: str, proc: subprocess.Popen, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine process exited with {proc.returncode} before answering /health")
        if unreachable(url, "/health", timeout_s=2.0) is None:
            return
        time.sleep(0.2)  # polling the engine's start-up; the deadline names what did not happen
    raise RuntimeError(f"the engine at {url} did not answer /health within {deadline_s:.0f}s")


def _gpu_used() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _copy_gbps(named: list, cuda: bool) -> float:
    """Best of 3: one plain copy of the same tensors into preallocated ones (the limit of a push)."""
    dst = [torch.empty_like(t) for _, t in named]
    n = sum(t.numel() * t.element_size() for _, t in named)
    best = math.inf
    for _ in range(3):
        _sync(cuda)
        t0 = time.perf_counter()
        for d, (_, t) in zip(dst, named):
            d.copy_(t)
        _sync(cuda)
        best = min(best, time.perf_counter() - t0)
    del dst
    return n / best / 1e9


def row_colocated(smoke: bool, work: Path, bucket_mb: float = 512.0, repeats: int = 3) -> list[Row]:
    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch
    from megatron_m2po.weights.colocated import ColocatedWeightSync, Phases, run_colocated_stage

    torch.multiprocessing.set_sharing_strategy("file_system")  # host handles for the CPU smoke
    cuda = torch.cuda.is_available() and not smoke
    shape = TINY if smoke else QWEN25_15B
    hf = make_random_qwen2(work / ("coloc-tiny" if smoke else "coloc-1.5b"), seed=3, init_std=0.02, **shape)
    n, (p, r) = (4, (16, 48)) if smoke else (8, (512, 1536))
    samples = make_batch(n, vocab=shape["vocab_size"], prompt=(p, p), response=(r, r), seed=11)
    for s in samples:
        s.behav_logprobs = np.full(len(s.response_ids), -math.log(shape["vocab_size"]), np.float32)
    cfg = _actor_config(hf, "bfloat16", parallel={"use_distributed_optimizer": True})
    actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=100))
    kv_gib = 0.01 if smoke else 24.0
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = None
    times: dict[str, list[float]] = {k: [] for k in ("release", "reload", "train", "resume_weights", "push",
                                                     "offload", "resume_kv")}
    used: dict[str, float] = {}
    split: dict[str, list[float]] = {}  # where the push's seconds went
    buckets = 0
    bad: list[str] = []
    try:
        actor.train_step(RolloutBatch(samples))  # optimizer states exist, kernels warm
        named = list(actor.iter_hf_weights())
        push_bytes = sum(t.numel() * t.element_size() for _, t in named)
        copy_gbps = _copy_gbps(named, cuda)
        del named
        train_rec = actor.offload()  # colocated start: the trainer leaves, the engine loads the base model
        state_bytes = train_rec.released_bytes
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if smoke:
            env["CUDA_VISIBLE_DEVICES"] = ""
        engine = subprocess.Popen([sys.executable, str(Path(__file__).with_name("colocated_engine.py")), "--hf",
                                   str(hf), "--port", str(port), "--kv-gib", str(kv_gib),
                                   "--device", "cuda" if cuda else "cpu"], env=env)
        _wait_healthy(url, engine, 600.0)
        base = _call(url, "/checksums")  # the base model: each push must change what the engine holds
        if cuda:
            used["engines, base model"] = _gpu_used()
        sync = ColocatedWeightSync([url], bucket_mb=bucket_mb, timeout_s=600.0, pause_mode="retract")
        for cycle in range(repeats):
            t0 = time.perf_counter()
            _call(url, "/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
            times["release"].append(time.perf_counter() - t0)
            if cuda:  # what the released engine keeps in torch's allocator (its CUDA context is outside it)
                used["engine reserved, released (GiB)"] = _call(url, "/memory")["reserved_bytes"] / 2**30
            times["reload"].append(actor.reload().seconds)
            _sync(cuda)
            t0 = time.perf_counter()
            actor.train_step(RolloutBatch(samples))
            _sync(cuda)
            times["train"].append(time.perf_counter() - t0)
            if cuda:
                used["trainer, training"] = max(used.get("trainer, training", 0.0), _gpu_used())
            t0 = time.perf_counter()
            _call(url, "/resume_memory_occupation", {"tags": ["weights"]})
            times["resume_weights"].append(time.perf_counter() - t0)
            want = {n: digest(t) for n, t in actor.iter_hf_weights()}
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            # sync.push(...) with the stage's phases kept: pack, pickle the handles, wait for the engine
            _sync(cuda)
            t0 = time.perf_counter()
            for _ in actor.iter_hf_weights():  # the actor's HF conversion alone (the push iterates it)
                pass
            _sync(cuda)
            hf_s = time.perf_counter() - t0
            before_engine = _call(url, "/memory")
            t0 = time.perf_counter()
            plan, ph = sync.begin(cycle + 1, 1), Phases()
            begin_s = time.perf_counter() - t0
            res = run_colocated_stage(plan, 0, actor.iter_hf_weights(), ph)
            t0 = time.perf_counter()
            stats = sync.finish(plan, [res])
            finish_s = time.perf_counter() - t0
            after_engine = _call(url, "/memory")
            times["push"].append(stats.seconds)
            buckets = ph.buckets
            for k, v in (("push: begin (pause, begin_weight_update)", begin_s),
                         ("push: finish (end_weight_update, continue)", finish_s),
                         ("actor HF conversion alone", hf_s), ("push: pack", ph.pack_s), ("push: pickle", ph.serialize_s), ("push: wait", ph.wait_s),
                         ("engine: open handles", after_engine["open_s"] - before_engine["open_s"]),
                         ("engine: copy", after_engine["copy_s"] - before_engine["copy_s"])):
                split.setdefault(k, []).append(v)
            if cuda:
                used["trainer push peak above its state (GiB)"] = (torch.cuda.max_memory_allocated() - before) / 2**30
            got = _call(url, "/checksums")
            wrong = sorted(n for n, d in want.items() if n in got and got[n] != d)
            absent = sorted(n for n in got if n not in want and not (shape["tie_word_embeddings"] and n == "lm_head.weight"))
            if not any(base.get(n) != d for n, d in want.items()):
                bad.append(f"cycle {cycle}: the update left every tensor as in the base model (no teeth)")
            if wrong or absent:
                bad.append(f"cycle {cycle}: {len(wrong)} tensors differ ({wrong[:3]}), {len(absent)} never pushed "
                           f"({absent[:3]})")
            rec = actor.offload()
            times["offload"].append(rec.seconds)
            if cuda:
                used["trainer reserved, offloaded (GiB)"] = rec.reserved_after / 2**30
            if cuda:
                left = rec.allocated_after
                if left > 0.01 * state_bytes:
                    bad.append(f"cycle {cycle}: {left / 2**20:.0f} MiB still allocated by the trainer after offload "
                               f"(state {state_bytes / 2**30:.2f} GiB)")
            kinds = sorted(k for k, v in rec.resident.items() if v and k != "module_buffers")
            if kinds:
                bad.append(f"cycle {cycle}: after offload the census still has {kinds} on the device")
            t0 = time.perf_counter()
            _call(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
            times["resume_kv"].append(time.perf_counter() - t0)
            if cuda:
                used["engines, generating"] = max(used.get("engines, generating", 0.0), _gpu_used())
    finally:
        if engine is not None:
            engine.terminate()
            try:
                engine.wait(30)
            except subprocess.TimeoutExpired:
                engine.kill()
        if actor.offloaded:
            actor.reload()
        actor.close()
    med = {k: statistics.median(v) for k, v in times.items() if v}
    gbps = push_bytes / med["push"] / 1e9
    label = ("tiny Qwen2 (smoke), host memory" if smoke else
             f"Qwen2.5-1.5B shape, bf16, distributed optimizer, KV pool {kv_gib:g} GiB, one GPU")
    what = f"{label}; {push_bytes / 2**30:.2f} GiB pushed, trainer state {state_bytes / 2**30:.2f} GiB; {repeats} cycles"
    claim = Row(COLOCATED_CHECK, what,
                "; ".join(bad) if bad else f"engine == trainer bit for bit after each of {repeats} pushes; "
                "offload leaves only module buffers",
                "digests equal; offload leaves <= 1 % of the state allocated", "FAIL" if bad else "PASS",
                {"bad": bad})
    phases = ", ".join(f"{k} {v:.3f}s" for k, v in med.items())
    res = (f"{phases}; push {gbps:.1f} GB/s vs plain copy {copy_gbps:.1f} GB/s (ratio {gbps / copy_gbps:.2f})")
    res += " (" + ", ".join(f"{k} {statistics.median(v):.3f}s" for k, v in split.items()) + f", {buckets} buckets)"
    if used:
        res += "; GPU used " + ", ".join(f"{k} {v:.1f} GiB" for k, v in used.items())
    info = Row("colocated cycle timing", what, res, "reported (median of the cycles)", "INFO",
               dict(med, push_gbps=gbps, copy_gbps=copy_gbps, push_bytes=push_bytes, state_bytes=state_bytes,
                    **{f"gpu_used/{k}": v for k, v in used.items()},
                    **{f"split/{k}": statistics.median(v) for k, v in split.items()}))
    return [claim, info]
