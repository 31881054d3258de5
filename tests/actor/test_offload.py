"""The trainer's offload / reload (actor/offload.py) is an exact round trip: training with an
offload and a reload around every update ends bit-identical to training without, over DP=2 gloo,
with and without the distributed optimizer, fp32 and bf16 (Megatron's main parameters); and the
offload leaves nothing of the training state on the device but the module buffers it states."""

from __future__ import annotations

import os

import pytest

import actor_testlib as lib
from megatron_m2po.standins.dist_testing import run_distributed

pytestmark = pytest.mark.slow  # engine processes, routers or multi-rank sweeps in module fixtures: the full suite's lane

UPDATES = 3
CASES = (("fp32", True), ("bf16", True), ("fp32", False), ("bf16", False))


def _state(actor) -> list:
    """Weights, main parameters and Adam moments (lib.snapshot's tensors), flattened."""
    params, mains, opts, *_ = lib.snapshot(actor)
    moments = [v for st in opts for s in st["state"].values() for v in s.values() if hasattr(v, "dim")]
    return params + [t for m in mains for t in m] + moments


def _train(actor, batches, offload: bool) -> list[dict]:
    records = []
    for b in batches:
        if offload:
            records.append(actor.offload())
            assert actor.offloaded
            records.append(actor.reload())
        actor.train_update(b)
    return records


def _train_two_phase(actor, batches) -> list[dict]:
    """The colocated cycle (trainer/colocated.py): states off, the weights read (the push), the
    rest off, everything back; the weights must read the same as before the first half."""
    import torch

    out = []
    for b in batches:
        weights = [p.detach().clone() for p in actor.model[0].parameters()]
        states = actor.offload_states()
        read = [bool(torch.equal(a, p.detach())) for a, p in zip(weights, actor.model[0].parameters())]
        rest = actor.offload()
        out.append({"states": states, "read": read, "rest": rest, "reload": actor.reload()})
        actor.train_update(b)
    return out


def _case(root: str, dtype: str, dist_opt: bool):
    import torch

    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch

    cfg = lib.actor_config(os.path.join(root, "qwen2"), tp=1, pp=1, mbs=2, dist_opt=dist_opt)
    cfg.model.dtype = "bfloat16" if dtype == "bf16" else "float32"
    actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=10))
    try:
        batches = [RolloutBatch(lib.make_samples(4, seed=10 + i)) for i in range(UPDATES)]
        start = lib.snapshot(actor)
        _train(actor, batches, offload=False)
        plain = _state(actor)
        lib.restore(actor, start)
        records = _train(actor, batches, offload=True)
        moved = _state(actor)
        lib.restore(actor, start)
        two_phase = _train_two_phase(actor, batches)
        staged = _state(actor)
        with pytest.raises(RuntimeError, match="without a preceding"):
            actor.reload()
        first = actor.offload()
        with pytest.raises(RuntimeError, match="offloaded already"):
            actor.offload()
        actor.reload()
        same = [bool(torch.equal(a, b)) and a.dtype == b.dtype for a, b in zip(plain, moved)]
        same_staged = [bool(torch.equal(a, b)) and a.dtype == b.dtype for a, b in zip(plain, staged)]
        return {"same": same, "n": (len(plain), len(moved)), "records": records, "first": first,
                "two_phase": two_phase, "same_staged": same_staged}
    finally:
        actor.close()


def _offload_round_trips(rank, world_size, root):
    import multiprocessing

    import torch

    multiprocessing.current_process()._config["daemon"] = False
    if rank == 0:
        lib.make_tiny_hf("qwen2", os.path.join(root, "qwen2"), tie=False, seed=3)
    torch.distributed.barrier()
    return {f"{d}-{'distopt' if o else 'ddp'}": _case(root, d, o) for d, o in CASES}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("offload"))
    return run_distributed(_offload_round_trips, 2, (root,), timeout_s=300)


@pytest.mark.parametrize("case", [f"{d}-{'distopt' if o else 'ddp'}" for d, o in CASES])
def test_offload_round_trip_is_bit_exact(results, case):
    for r in results:
        out = r[case]
        assert out["n"][0] == out["n"][1] and out["n"][0] > 0
        assert all(out["same"]), f"{case}: {out['same'].count(False)} tensors differ after offload/reload"


@pytest.mark.parametrize("case", [f"{d}-{'distopt' if o else 'ddp'}" for d, o in CASES])
def test_offload_releases_everything_but_module_buffers(results, case):
    for r in results:
        recs = r[case]["records"]
        offs, rels = recs[0::2], recs[1::2]
        for off, rel in zip(offs, rels):
            assert off.direction == "offload" and rel.direction == "reload"
            # measured after the offload: no parameter, gradient, main parameter or Adam state left
            assert {k: v for k, v in off.resident.items() if k != "module_buffers"} == \
                {"params": 0, "grads": 0, "main_params": 0, "optimizer_states": 0}
            assert off.released["params"] > 0 and off.released["grads"] > 0
            # what the reload brought back is what the offload took
            assert rel.released == off.released and rel.copied == off.copied
            assert rel.resident_bytes == off.released_bytes + off.resident_bytes
        bf16, distopt = case.startswith("bf16"), case.endswith("distopt")
        # fp32 main parameters exist apart from the weights only with 16-bit weights
        assert (offs[0].released.get("main_params", 0) > 0) == bf16
        # Adam's moments exist after the first update
        assert "optimizer_states" not in offs[0].released and offs[1].released["optimizer_states"] > 0
        # the distributed optimizer shards fp32 main parameters over DP=2: half the parameters at
        # 4 bytes, as many bytes as the whole bf16 buffer; the two fp32 moments, twice that (+ Adam's steps;
        # the buffer is padded to a multiple of DP)
        if distopt and bf16:
            assert offs[1].released["main_params"] == pytest.approx(offs[1].released["params"], rel=0.01)  # padding
            assert offs[1].released["optimizer_states"] == pytest.approx(2 * offs[1].released["params"], rel=0.01)


@pytest.mark.parametrize("case", [f"{d}-{'distopt' if o else 'ddp'}" for d, o in CASES])
def test_states_leave_first_and_the_weights_stay_readable_for_the_push(results, case):
    """``offload_states`` (before the colocated push) frees the gradients and moves the optimizer's
    main parameters and states, and leaves every parameter on the device with its values (an fp32
    model's main parameters are its parameters: they stay too); ``offload`` then takes the rest;
    training through the two halves is bit-identical to training without any offload."""
    for r in results:
        out = r[case]
        assert all(out["same_staged"]), f"{case}: {out['same_staged'].count(False)} tensors differ"
        for cyc in out["two_phase"]:
            states, rest, reload = cyc["states"], cyc["rest"], cyc["reload"]
            assert all(cyc["read"]) and len(cyc["read"]) > 0
            left = {k: v for k, v in states.resident.items() if k != "module_buffers"}
            assert left["params"] > 0 and left["grads"] == left["main_params"] == left["optimizer_states"] == 0, left
            assert states.released["grads"] > 0 and "params" not in states.released
            assert rest.released["params"] == left["params"] and set(rest.released) == {"params"}
            assert {k: v for k, v in rest.resident.items() if k != "module_buffers"} == \
                {"params": 0, "grads": 0, "main_params": 0, "optimizer_states": 0}
            both = {k: states.released.get(k, 0) + rest.released.get(k, 0) for k in set(states.released) | set(rest.released)}
            assert reload.released == both
