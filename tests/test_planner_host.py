"""The planner's host memory per node (plan/host.py): the reference copy and colocated mode's
offloaded state, at their exact pinned size, plus a stated allowance per GPU process; a layout
over the node's RAM is refused with what to change, by ``m2po plan`` and by ``--search``."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_m2po.cli import main
from megatron_m2po.config import load_config
from megatron_m2po.plan import host as H
from megatron_m2po.plan import memory as P
from megatron_m2po.plan import search as S

EX = Path(__file__).resolve().parents[1] / "examples"
GiB = 1024 ** 3
COLOCATED = ["rollout.colocate=true", "rollout.engine_gpu_ids=[0,1,2,3,4,5,6,7]", "rollout.num_engines=8",
             "rollout.engine_mem_fraction=0.8"]
M7B = P.MODELS["qwen2.5-math-7b"]


def _plan(*overrides: str, **kw):
    cfg = load_config(EX / "qwen2.5-math-7b.yaml", list(overrides))
    return P.plan_from_config(cfg, M7B, nnodes=1, gpus_per_node=8, **kw)


def test_host_memory_by_hand():
    """Colocated with the KL reference on one 8-GPU node: per trainer process the stage's bf16
    weights twice (the reference copy and the offloaded parameters) and its optimizer states; eight
    trainer and eight engine processes at the allowance each."""
    p = _plan(*COLOCATED, "algo.kl.coef=0.001")
    w, lay = p.worst, p.layout
    assert lay.offload and lay.engine_procs == 8 and lay.reference
    params = P.stage_params(M7B, lay, w.stage, P.padded_vocab(M7B.vocab, lay.tp))
    assert w.reference == w.weights == params * 2
    assert p.host.parts == {"reference copy (pinned)": 8 * params * 2,
                            "offloaded trainer state (pinned)": 8 * (params * 2 + w.optimizer),
                            "processes": 16 * H.PROCESS_GIB * GiB}
    assert p.host.budget == H.NODE_GIB * GiB and p.host.ok and p.ok
    # disaggregated (the recipe's engines on node 0's other GPUs), no KL: nothing pinned
    q = _plan()
    assert q.host.pinned == 0 and not q.layout.offload
    assert q.host.parts["processes"] == (8 + q.layout.engine_procs) * H.PROCESS_GIB * GiB
    # LoRA: the reference is the base with the adapters off (no copy); the optimizer is the adapters'
    lo = _plan(*COLOCATED, "algo.kl.coef=0.001", "model.lora.rank=16")
    assert lo.host.parts["reference copy (pinned)"] == 0
    assert lo.host.parts["offloaded trainer state (pinned)"] < p.host.parts["offloaded trainer state (pinned)"] / 2


def test_a_node_without_the_ram_is_refused_with_what_to_change(capsys):
    need = _plan(*COLOCATED, "algo.kl.coef=0.001").host.total / GiB
    p = _plan(*COLOCATED, "algo.kl.coef=0.001", host_mem_gib=need - 1)
    assert not p.ok and p.refusal is None  # the GPUs fit: the only refusal is the node's RAM
    msg = p.errors[-1]
    assert msg.startswith(f"host memory per node needs {need:.1f} GiB of {need - 1:.0f} GiB")
    assert "parallel.use_distributed_optimizer=true" in msg and "model.lora.rank > 0" in msg
    assert _plan(*COLOCATED, "algo.kl.coef=0.001", host_mem_gib=need + 1).ok
    args = ["plan", str(EX / "qwen2.5-math-7b.yaml"), *COLOCATED, "algo.kl.coef=0.001", "--nnodes", "1",
            "--gpus-per-node", "8", "--host-mem-gib",
            f"{need - 1:g}"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "REJECTED: host memory per node needs" in " ".join(out.split())
    assert main(args[:-2] + ["--host-mem-gib", f"{need + 1:g}"]) == 0
    assert "host memory per node:" in capsys.readouterr().out


def test_search_keeps_only_layouts_that_fit_the_nodes_ram():
    """Colocated 7B with the reference: the layouts differ in what they pin (the offloaded
    optimizer states are sharded or not, the stages smaller or larger); on a node whose RAM holds
    only some of them, the search ranks exactly those."""
    cfg = load_config(EX / "qwen2.5-math-7b.yaml", [*COLOCATED, "algo.kl.coef=0.001"])
    free = S.search_config(cfg, M7B, nnodes=1, gpus_per_node=8)
    needs = sorted(c.plan.host.total for c in free.ranked)
    ram = (needs[0] + needs[-1]) / 2
    assert needs[0] < ram < needs[-1]
    tight = S.search_config(cfg, M7B, nnodes=1, gpus_per_node=8, host_mem_gib=ram / GiB)
    fitting = [c for c in free.ranked if c.plan.host.total <= ram]
    assert [c.label() for c in tight.ranked] == [c.label() for c in fitting]
    assert any(not c.plan.host.ok and c.plan.errors[-1].startswith("host memory per node needs")
               for c in tight.rejected)
    with pytest.raises(P.PlanError):
        S.search_config(cfg, M7B, nnodes=1, gpus_per_node=8, host_mem_gib=1.0).best  # noqa: B018
