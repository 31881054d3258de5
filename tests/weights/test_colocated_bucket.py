"""Reused host buckets of the colocated transport (``weights/colocated_bucket.py`` ``HostBuckets``)
and the order of a stage's hand-overs (``weights/colocated.py`` ``run_colocated_stage``): a bucket
takes other bytes only once every engine has answered for it, concurrent pushes never share one,
and the bucket carrying the version is posted after every other one has answered. The engine here
is a stand-in in this process that reads the shared memory through SGLang's payload reader
(``standins/tensor_payload.py``) after a delay, so a bucket rewritten too early shows in its bytes."""

from __future__ import annotations

import asyncio
import threading

import torch

from megatron_m2po.standins import tensor_payload
from megatron_m2po.weights import colocated
from megatron_m2po.weights.colocated import ColocatedPlan, Phases, run_colocated_stage
from megatron_m2po.weights.colocated_bucket import HostBuckets, pack_bucket

CPU = torch.device("cpu")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_bucket_is_reused_only_once_given_back_and_never_after_a_failure():
    pool = HostBuckets(keep=2)
    a, b = pool.lease(100, CPU, capacity=1000), pool.lease(50, CPU, capacity=1000)
    assert _storage(a) != _storage(b) and a.numel() == 100 and a.untyped_storage().nbytes() == 1000
    pool.give_back(a)
    again = pool.lease(900, CPU)  # fits the given-back one: reused, not the one still leased
    assert _storage(again) == _storage(a) and again.numel() == 900
    fresh = pool.lease(10, CPU)  # b was never given back (its push failed): never handed out again
    assert _storage(fresh) not in (_storage(a), _storage(b))
    big = pool.lease(5000, CPU, capacity=1000)  # larger than the bucket size: its own size
    assert big.untyped_storage().nbytes() == 5000


def test_pack_from_views_keeps_every_byte():
    g = torch.Generator().manual_seed(0)
    named = [("t", torch.randn(4, 6, generator=g).t()), ("b", torch.randn(5, generator=g).to(torch.bfloat16)),
             ("i", torch.arange(3)), ("s", torch.tensor(2.5))]
    flat, metas = pack_bucket(named, pool=HostBuckets(), capacity=4096)
    for m, (name, t) in zip(metas, named):
        assert torch.equal(flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape), t), name


def test_concurrent_leases_never_share_a_bucket():
    """Three pushes lease, fill, hold and give back side by side: each finds its own bytes at the end."""
    pool, bad = HostBuckets(keep=2), []
    held = threading.Barrier(3)  # every push holds a filled bucket before any checks or gives it back

    def push(seed: int) -> None:
        for i in range(100):
            flat = pool.lease(64 + (seed + i) % 64, CPU, capacity=256)
            flat.fill_(seed)
            held.wait(timeout=30)
            bad.extend([seed] if not bool((flat == seed).all()) else [])
            pool.give_back(flat)
    threads = [threading.Thread(target=push, args=(s,)) for s in range(3)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert not bad


class _Engine:
    """Loads a payload as the CPU worker does, but a bucket only once the sender has posted the next
    (polled, 10 s deadline; the last bucket is posted after every other answered, so the one
    before it does not wait)."""

    base_url = "http://engine"

    def __init__(self, n_buckets: int) -> None:
        self.n = n_buckets
        self.log: list[tuple[str, object]] = []
        self.got: dict[str, torch.Tensor] = {}
        self.in_flight = 0
        self._posted: asyncio.Condition | None = None  # made on the loop that posts

    def _posts(self) -> int:
        return sum(kind == "post" for kind, _ in self.log)

    async def update_weights_from_tensor(self, payloads, *, load_format, flush_cache, weight_version, timeout_s):
        self._posted = self._posted or asyncio.Condition()
        self.in_flight += 1
        k = self._posts()
        self.log.append(("post", weight_version))
        obj = tensor_payload.deserialize(payloads[0])
        async with self._posted:
            self._posted.notify_all()
            if k + 1 < self.n - 1:  # wait for the next post (10 s deadline: then load anyway)
                try:
                    await asyncio.wait_for(self._posted.wait_for(lambda: self._posts() >= k + 2), 10)
                except asyncio.TimeoutError:
                    pass
        for name, t in tensor_payload.named_tensors(obj, load_format):
            self.got[name] = t.clone()
        self.log.append(("answer", (weight_version, self.in_flight)))
        self.in_flight -= 1
        return {"success": True}


def test_a_stage_overlaps_buckets_without_rewriting_one_in_flight(monkeypatch):
    engine = _Engine(12)

    async def each_engine(urls, fn, what, timeout_s):
        return [await fn(engine)]
    monkeypatch.setattr(colocated, "each_engine", each_engine)
    g = torch.Generator().manual_seed(1)
    weights = [(f"w{i}", torch.randn(1000, generator=g)) for i in range(12)]  # 4000 B each: one per bucket
    plan = ColocatedPlan("colocated", 7, ("http://engine",), 1, 30.0, bucket_bytes=4100, flush_last=True,
                         engine_tp=(1,))
    phases = Phases()
    res = run_colocated_stage(plan, 0, iter(weights), phases)
    assert not res.error and phases.buckets == 12 and res.n_tensors == 12
    for name, t in weights:
        assert torch.equal(engine.got[name], t), name  # no bucket was rewritten while an engine read it
    answers = [v for kind, v in engine.log if kind == "answer"]
    assert max(n for _, n in answers) == 2  # the next bucket was queued while one loaded
    versions = [v for kind, v in engine.log if kind == "post"]
    assert versions[:-1] == [None] * 11 and versions[-1] == "7"
    last_post = max(i for i, (kind, _) in enumerate(engine.log) if kind == "post")
    assert sum(kind == "answer" for kind, _ in engine.log[:last_post]) == 11  # the version went last


def test_split_buckets_first_bucket_smaller():
    """The first bucket closes at ``first_bytes``, the others at ``bucket_bytes`` (a tensor counts
    its bytes plus one element of alignment slack); a tensor larger than the limit goes alone."""
    from megatron_m2po.weights.colocated_bucket import split_buckets

    ts = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 10, 10, 10, 60, 10])]
    sizes = [[n for n, _ in b] for b in split_buckets(ts, bucket_bytes=100, first_bytes=50)]
    assert sizes == [["t0"], ["t1", "t2"], ["t3", "t4"], ["t5"], ["t6"]]
    assert [[n for n, _ in b] for b in split_buckets(ts, bucket_bytes=100)] == \
        [["t0", "t1"], ["t2", "t3"], ["t4"], ["t5"], ["t6"]]
