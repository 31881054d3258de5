"""Engine GPU placement on the trainer's node and the layouts refused before anything starts
(``rollout/placement.py``): pure functions over the config and a torchrun worker's environment."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megatron_m2po.config import load_config
from megatron_m2po.rollout.engines import EngineFleet, FleetError
from megatron_m2po.rollout.placement import (node_gpus, placement, ray_local_gpus,
                                             stage_sender_ranks)

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples"


def _torchrun(local: int, world: int, **kw) -> dict[str, str]:
    return {"LOCAL_WORLD_SIZE": str(local), "WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0", **kw}


def test_engines_go_after_the_trainers_gpus_when_none_are_given():
    # The 8B recipe without its engine_gpu_ids on one 8-GPU node under GPUS_PER_NODE=4.
    cfg = load_config(EX / "qwen3-8b.yaml", ["rollout.engine_gpu_ids=[]"])
    assert placement(cfg, node_gpus(_torchrun(4, 4), count=8)) == [["4"], ["5"], ["6"], ["7"]]
    cfg = load_config(EX / "qwen3-8b.yaml", ["rollout.engine_gpu_ids=[]", "rollout.num_engines=2",
                                             "rollout.engine_tp=2"])
    assert placement(cfg, node_gpus(_torchrun(4, 4), count=8)) == [["4", "5"], ["6", "7"]]
    # The indices are the trainer's visible GPUs: its CUDA_VISIBLE_DEVICES maps them to the node's.
    node = node_gpus(_torchrun(2, 2, CUDA_VISIBLE_DEVICES="2,3,6,7"))
    assert node.count == 4
    cfg = load_config(EX / "qwen3-8b.yaml", ["rollout.engine_gpu_ids=[]", "rollout.num_engines=2"])
    assert placement(cfg, node) == [["6"], ["7"]]


def test_the_recipes_place_their_engines_after_the_trainer():
    for name in ("qwen3-8b", "qwen2.5-math-7b"):
        cfg = load_config(EX / f"{name}.yaml")
        assert placement(cfg, node_gpus(_torchrun(4, 4), count=8)) == [["4"], ["5"], ["6"], ["7"]], name
        # Run with all 8 GPUs training (GPUS_PER_NODE=8): the engines' GPUs would be the trainer's.
        with pytest.raises(ValueError, match=r"GPUs \[4, 5, 6, 7\] are the trainer's.*rollout.colocate=true"):
            placement(cfg, node_gpus(_torchrun(8, 8), count=8))


def test_too_few_gpus_after_the_trainer_names_what_to_set():
    cfg = load_config(EX / "qwen3-8b.yaml", ["rollout.engine_gpu_ids=[]"])
    with pytest.raises(ValueError, match=r"after the trainer's 6 GPU\(s\) \(LOCAL_WORLD_SIZE=6\) need GPUs 6-9, "
                                         r"but this node has 8.*rollout.engine_gpu_ids"):
        placement(cfg, node_gpus(_torchrun(6, 6), count=8))
    with pytest.raises(ValueError, match=r"lists 3 GPUs but rollout.num_engines x rollout.engine_tp = 4 x 1 = 4"):
        placement(load_config(EX / "qwen3-8b.yaml", ["rollout.engine_gpu_ids=[4,5,6]"]),
                  node_gpus(_torchrun(4, 4), count=8))
    with pytest.raises(ValueError, match="each GPU once"):
        placement(load_config(EX / "qwen3-8b.yaml", ["rollout.engine_gpu_ids=[4,5,6,6]"]),
                  node_gpus(_torchrun(4, 4), count=8))


def test_colocation_is_explicit():
    over = ["rollout.engine_gpu_ids=[0,1,2,3]"]
    with pytest.raises(ValueError, match=r"GPUs \[0, 1, 2, 3\] are the trainer's \(its LOCAL_WORLD_SIZE=4 ranks"):
        placement(load_config(EX / "qwen3-8b.yaml", over), node_gpus(_torchrun(4, 4), count=8))
    cfg = load_config(EX / "qwen3-8b.yaml", over + ["rollout.colocate=true"])
    assert placement(cfg, node_gpus(_torchrun(4, 4), count=8)) == [["0"], ["1"], ["2"], ["3"]]


def test_cpu_workers_and_other_launchers_take_no_gpu():
    cfg = load_config(EX / "tiny_cpu.yaml")
    assert placement(cfg, node_gpus(_torchrun(2, 2), count=None)) == [[], []]


def test_stage_senders_follow_megatrons_rank_order():
    assert stage_sender_ranks(32, 2) == [0, 16]
    assert stage_sender_ranks(32, 8) == [0, 4, 8, 12, 16, 20, 24, 28]
    assert stage_sender_ranks(4, 1) == [0]


def _disaggregated_32b(*extra: str):
    # The 32B recipe (TP=2 x PP=8: eight pipeline senders) with the NCCL weight sync and two TP-2 engines
    # on GPUs 4-7 of rank 0's node, after the trainer's four ranks there.
    return load_config(EX / "qwen3-32b.yaml", ["rollout.launcher=local", "rollout.router_addr=null",
                                               "rollout.num_engines=2", "rollout.engine_tp=2",
                                               "rollout.engine_gpu_ids=[4,5,6,7]", "parallel.tensor_parallel=2",
                                               "parallel.pipeline_parallel=8", "parallel.context_parallel=1",
                                               "rollout.weight_sync=distributed", *extra])


def test_distributed_sync_refuses_engines_other_nodes_cannot_reach():
    node = node_gpus(_torchrun(4, 32), count=8)
    with pytest.raises(ValueError, match=r"stages \[1, 2, 3, 4, 5, 6, 7\] \(global ranks \[4, 8, 12, 16, 20, 24, 28\]\) "
                                         r"run on other nodes.*rollout.host='127.0.0.1'.*set rollout.host"):
        placement(_disaggregated_32b(), node)
    with pytest.raises(ValueError, match="rollout.host='0.0.0.0'"):
        placement(_disaggregated_32b("rollout.host=0.0.0.0"), node)
    assert placement(_disaggregated_32b("rollout.host=node0.cluster"), node) == [["4", "5"], ["6", "7"]]


def test_colocated_engines_take_the_trainers_gpus_and_their_own_transport():
    """Semantics changed on purpose (issue 40): rollout.colocate=true time-shares the trainer's GPUs, so
    engine ranks sit on the stage senders' GPUs too and NCCL's weight sync is refused at load time
    (it used to be refused by placement only for an engine on a sender's GPU); disk, the default,
    becomes the in-place colocated transport."""
    from megatron_m2po.utils.settings import ConfigError

    over = ["rollout.launcher=local", "rollout.router_addr=null", "rollout.num_engines=4", "rollout.engine_tp=2",
            "rollout.engine_gpu_ids=[]", "rollout.colocate=true", "parallel.tensor_parallel=2",
            "parallel.pipeline_parallel=8", "parallel.context_parallel=1"]
    with pytest.raises(ConfigError, match="rollout.colocate=true with rollout.weight_sync=distributed.*set it to "
                                          "colocated"):
        load_config(EX / "qwen3-32b.yaml", over + ["rollout.weight_sync=distributed"])
    cfg = load_config(EX / "qwen3-32b.yaml", over + ["rollout.weight_sync=disk"])
    assert cfg.rollout.weight_sync == "colocated"
    assert placement(cfg, node_gpus(_torchrun(8, 8), count=8)) == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    with pytest.raises(ConfigError, match="rollout.weight_sync=colocated needs rollout.colocate=true"):
        load_config(EX / "qwen3-32b.yaml", ["rollout.weight_sync=colocated"])
    with pytest.raises(ConfigError, match="use disaggregated engines"):
        load_config(EX / "qwen3-32b.yaml", over + ["trainer.mode=async"])


def test_a_local_ray_cluster_gets_the_gpus_after_the_trainers():
    r = load_config(EX / "qwen3-8b.yaml", ["rollout.launcher=ray"]).rollout
    assert ray_local_gpus(r, node_gpus(_torchrun(4, 4), count=8)) == ["4", "5", "6", "7"]
    assert ray_local_gpus(r, node_gpus(_torchrun(2, 2, CUDA_VISIBLE_DEVICES="1,3,5"))) == ["5"]
    with pytest.raises(ValueError, match="leave 0 after the trainer's 8.*RAY_ADDRESS"):
        ray_local_gpus(r, node_gpus(_torchrun(8, 8), count=8))


def test_fleet_reports_an_impossible_placement_before_launching(tmp_path, monkeypatch):
    for k, v in _torchrun(8, 8).items():
        monkeypatch.setenv(k, v)
    cfg = load_config(EX / "qwen3-8b.yaml").rollout
    fleet = EngineFleet(cfg, "unused", run_dir=str(tmp_path), node=node_gpus(count=8, trainer_on_gpu=True))
    with pytest.raises(FleetError, match="are the trainer's"):
        fleet.start()
    assert not (tmp_path / "engines").exists()  # nothing was launched


@pytest.mark.slow  # a Ray cluster started end to end
def test_ray_cluster_started_here_hands_out_only_the_engine_gpus(tmp_path, monkeypatch):
    """A local Ray cluster started from a torchrun worker: engine actors get GPUs of ``local_gpus``
    only, and the engine child inherits none of the trainer's variables (Ray's workers inherit the
    starting process's environment)."""
    ray = pytest.importorskip("ray")
    from megatron_m2po.rollout.launcher import EngineSpec
    from megatron_m2po.rollout.ray_launcher import RayLauncher
    from waiting import wait_until

    for k, v in {**_torchrun(2, 2), "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_PORT": "1",
                 "CUDA_DEVICE_MAX_CONNECTIONS": "1", "CUDA_VISIBLE_DEVICES": "0,1,5,7"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    r = load_config(EX / "qwen3-8b.yaml", ["rollout.launcher=ray", "rollout.num_engines=2"]).rollout
    local = ray_local_gpus(r, node_gpus())
    assert local == ["5", "7"]
    launcher = RayLauncher(num_cpus=0.5, num_gpus=1, local_gpus=local, place_timeout_s=120,
                           init_kwargs={"num_cpus": 1, "object_store_memory": 100 * 2**20, "log_to_driver": False})
    outs = [tmp_path / f"env_{i}.json" for i in range(2)]
    handles = []
    try:
        for i, out in enumerate(outs):
            cmd = [sys.executable, "-c", "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))",
                   str(out), "--port", "1"]
            handles.append(launcher.launch(EngineSpec(i, "127.0.0.1", 1, cmd, {}, tmp_path / f"engine_{i}.log")))
        wait_until(lambda: all(o.is_file() and o.stat().st_size for o in outs), what="both engines' environments",
                   timeout=60)
        envs = [json.loads(o.read_text()) for o in outs]
        assert sorted(e["CUDA_VISIBLE_DEVICES"] for e in envs) == ["5", "7"]
        for e in envs:
            assert not [k for k in e if k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "CUDA_DEVICE_MAX_CONNECTIONS")
                        or k.startswith("TORCHELASTIC_")], e
        import os
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,5,7"  # this process's value is back
    finally:
        for h in handles:
            h.stop()
        ray.shutdown()
