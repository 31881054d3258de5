"""Where engines the trainer starts itself run on its node, and the layouts refused before anything starts.

Pure functions over the config and the trainer's environment (``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``,
``CUDA_VISIBLE_DEVICES``) and the node's GPU count, so every rule is tested on CPU
(``tests/rollout/test_placement.py``). The trainer's ranks on a node use the node's visible GPUs
``0 .. LOCAL_WORLD_SIZE-1`` (``actor.init_parallel``: ``torch.cuda.set_device(LOCAL_RANK)``); GPU
indices in ``rollout.engine_gpu_ids`` are indices into the same visible list, and an engine's
``CUDA_VISIBLE_DEVICES`` gets the entries they name (the physical ids when the trainer was started
with a ``CUDA_VISIBLE_DEVICES`` of its own).

- ``rollout.launcher=local``, SGLang engines: with ``rollout.engine_gpu_ids`` empty, the engines take
  the GPUs after the trainer's (``LOCAL_WORLD_SIZE ..``), one block of ``engine_tp`` each; too few GPUs
  is an error. Engine GPUs that are also the trainer's (colocation) need ``rollout.colocate=true``;
  with it and ``engine_gpu_ids`` empty, the engines take the trainer's GPUs ``0 ..`` (time-sharing:
  docs/design.md §5 "Colocated mode"; the colocated transport refuses a trainer GPU no engine rank
  shares, ``weights/colocated.py`` ``colocated_assignment``).
- ``rollout.launcher=ray`` with a Ray cluster this process starts (no ``RAY_ADDRESS``): the cluster
  gets only the node's GPUs after the trainer's (:func:`ray_local_gpus`).
- ``rollout.weight_sync=distributed``: every pipeline stage's sender (global rank ``p * WORLD_SIZE / PP``:
  tensor-, context- and data-parallel rank 0 in Megatron-Core's ``tp-cp-ep-dp-pp`` rank order) joins one
  NCCL group with the engines. An engine on a sender's GPU is refused (NCCL refuses two ranks of one
  group on one device: "Duplicate GPU detected"); engines bound to a loopback or wildcard address
  are refused when a sender runs on another node (it posts to the engine's URL and the engine
  connects back: ``rollout.host`` must be this node's reachable address).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from megatron_m2po.config import Config
from megatron_m2po.rollout.settings import RolloutConfig

__all__ = ["NodeGPUs", "node_gpus", "engine_gpus", "check_weight_sync_placement", "ray_local_gpus",
           "stage_sender_ranks", "placement", "cuda_count"]


@dataclass(frozen=True)
class NodeGPUs:
    """The trainer's view of its node.

    ``visible``: the trainer's ``CUDA_VISIBLE_DEVICES`` entries (None: unset, GPU ``i`` is ``"i"``);
    ``count``: GPUs the trainer process sees (None: unknown, e.g. no CUDA in this process);
    ``trainer``: how many of them the trainer's ranks on this node use (``LOCAL_WORLD_SIZE``);
    ``world``: trainer ranks in all (``WORLD_SIZE``)."""

    trainer: int
    world: int
    count: Optional[int] = None
    visible: Optional[tuple[str, ...]] = None

    def physical(self, index: int) -> str:
        """The ``CUDA_VISIBLE_DEVICES`` entry of visible GPU ``index``."""
        return self.visible[index] if self.visible is not None else str(index)


def node_gpus(env: Optional[Mapping[str, str]] = None, *, count: Optional[int] = None,
              trainer_on_gpu: bool = True) -> NodeGPUs:
    """The node as ``env`` (default: this process's environment) describes it. Under torchrun the
    trainer uses ``LOCAL_WORLD_SIZE`` GPUs of the node; a single process on a GPU uses one;
    ``trainer_on_gpu=False`` (no trainer on this node's GPUs, e.g. ``m2po eval``): none."""
    env = os.environ if env is None else env
    vis = env.get("CUDA_VISIBLE_DEVICES")
    visible = tuple(v.strip() for v in vis.split(",") if v.strip()) if vis is not None else None
    if "LOCAL_WORLD_SIZE" in env:
        local = int(env["LOCAL_WORLD_SIZE"])
    else:  # not under torchrun: one trainer process (on GPU 0 when it trains on a GPU), or none
        local = 1 if trainer_on_gpu else 0
    world = int(env.get("WORLD_SIZE", "1"))
    if count is None and visible is not None:
        count = len(visible)
    return NodeGPUs(trainer=local, world=world, count=count, visible=visible)


def _span(ids: list[int]) -> str:
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1)) else str(ids)


def engine_gpus(r: RolloutConfig, node: NodeGPUs) -> list[list[int]]:
    """Visible-GPU indices of each locally launched SGLang engine (``[]`` per engine for CPU workers).

    Raises ``ValueError`` naming what to set when the node cannot hold them."""
    if r.engine != "sglang":
        return [[] for _ in range(r.num_engines)]
    need = r.num_engines * r.engine_tp
    trainer = list(range(node.trainer))
    if r.engine_gpu_ids:
        ids = list(r.engine_gpu_ids)
        if len(ids) != need:
            raise ValueError(f"rollout.engine_gpu_ids={ids} lists {len(ids)} GPUs but rollout.num_engines x "
                             f"rollout.engine_tp = {r.num_engines} x {r.engine_tp} = {need}: list {need} GPUs")
        if len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(f"rollout.engine_gpu_ids={ids}: each GPU once, indices >= 0")
    elif r.colocate:  # time-sharing: the engines sit on the trainer's own GPUs, in order
        ids = list(range(need))
    else:
        ids = list(range(node.trainer, node.trainer + need))
    if node.count is not None and max(ids) >= node.count:
        what = (f"rollout.engine_gpu_ids={ids}" if r.engine_gpu_ids else
                f"{r.num_engines} engine(s) x rollout.engine_tp={r.engine_tp} after the trainer's {node.trainer} "
                f"GPU(s) (LOCAL_WORLD_SIZE={node.trainer}) need GPUs {_span(ids)}")
        raise ValueError(f"{what}, but this node has {node.count} GPU(s): lower the trainer's GPUs per node "
                         "(GPUS_PER_NODE) or rollout.num_engines, set rollout.engine_gpu_ids (with "
                         "rollout.colocate=true to share the trainer's), or run the engines on their own nodes "
                         "(scripts/launch_sglang_fleet.sh + rollout.launcher=external)")
    shared = sorted(set(ids) & set(trainer))
    if shared and not r.colocate:
        raise ValueError(f"rollout.engine_gpu_ids={ids}: GPUs {shared} are the trainer's (its "
                         f"LOCAL_WORLD_SIZE={node.trainer} ranks on this node use GPUs {_span(trainer)}). Set "
                         f"rollout.colocate=true to share them (and rollout.engine_mem_fraction to leave the "
                         "trainer room; `m2po plan` reserves it), list GPUs after the trainer's, or run fewer "
                         "trainer processes per node (GPUS_PER_NODE)")
    return [ids[i * r.engine_tp:(i + 1) * r.engine_tp] for i in range(r.num_engines)]


def stage_sender_ranks(world: int, pipeline_parallel: int) -> list[int]:
    """Global rank of each pipeline stage's weight sender: tensor-, context- and data-parallel rank 0
    of the stage (``weights/hf_export.py`` ``stage_layout``); Megatron-Core 0.16's default rank order
    ``tp-cp-ep-dp-pp`` puts stage ``p`` at ranks ``p * world/PP ..``."""
    return [p * (world // pipeline_parallel) for p in range(pipeline_parallel)]


def _local_only(host: str) -> bool:
    if host in ("", "0.0.0.0", "::", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: taken as reachable


def check_weight_sync_placement(cfg: Config, node: NodeGPUs, gpus: list[list[int]]) -> None:
    """Refuse what ``rollout.weight_sync=distributed`` cannot do with engines launched on this node
    (global rank 0's node): see the module docstring. ``gpus``: :func:`engine_gpus`."""
    r = cfg.rollout
    if r.weight_sync != "distributed" or r.launcher != "local" or r.source == "external":
        return
    senders = stage_sender_ranks(node.world, cfg.parallel.pipeline_parallel)
    remote = [(p, s) for p, s in enumerate(senders) if s // max(node.trainer, 1) != 0]
    if remote and _local_only(r.host):
        raise ValueError(
            f"rollout.weight_sync=distributed: the senders of pipeline stages {[p for p, _ in remote]} (global ranks "
            f"{[s for _, s in remote]}) run on other nodes, but the engines launched here bind rollout.host="
            f"{r.host!r}, which those nodes cannot reach (they post to the engine's URL and the engine joins their "
            "group): set rollout.host to this node's address as the other nodes reach it, or use "
            "rollout.weight_sync=disk")
    on_node = {s % max(node.trainer, 1): (p, s) for p, s in enumerate(senders) if s < node.trainer}
    for i, ids in enumerate(gpus):
        clash = sorted(set(ids) & set(on_node))
        if clash:
            p, s = on_node[clash[0]]
            raise ValueError(
                f"rollout.weight_sync=distributed: engine {i} runs on GPU(s) {ids} and GPU {clash[0]} is the one of "
                f"pipeline stage {p}'s weight sender (global rank {s}); NCCL refuses a group with two members on "
                f"one GPU. Set rollout.engine_gpu_ids to GPUs no stage sender uses (senders on this node: GPUs "
                f"{sorted(on_node)}), or use rollout.weight_sync=disk")


def ray_local_gpus(r: RolloutConfig, node: NodeGPUs) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` of a Ray cluster this process starts on its node: the node's GPUs
    after the trainer's (Ray would otherwise hand the trainer's GPUs to engine actors). Raises
    when none are left for SGLang engines."""
    if r.engine != "sglang":
        return []
    if node.count is None:
        return [node.physical(i) for i in range(node.trainer, node.trainer + r.num_engines * r.engine_tp)]
    left = [node.physical(i) for i in range(node.trainer, node.count)]
    if len(left) < r.engine_tp:
        raise ValueError(f"rollout.launcher=ray without RAY_ADDRESS starts a Ray cluster on this node, and its "
                         f"{node.count} GPU(s) leave {len(left)} after the trainer's {node.trainer}: an engine needs "
                         f"rollout.engine_tp={r.engine_tp}. Set RAY_ADDRESS to a cluster with rollout nodes, or run "
                         "fewer trainer processes per node (GPUS_PER_NODE)")
    return left


def placement(cfg: Config, node: Optional[NodeGPUs] = None) -> list[list[str]]:
    """``CUDA_VISIBLE_DEVICES`` entries of each engine ``rollout.launcher=local`` starts, after every
    check above (the trainer's driver calls it before starting anything)."""
    if node is None:
        node = node_gpus(count=cuda_count(), trainer_on_gpu=cuda_count() is not None)
    gpus = engine_gpus(cfg.rollout, node)
    check_weight_sync_placement(cfg, node, gpus)
    return [[node.physical(i) for i in ids] for ids in gpus]


def cuda_count() -> Optional[int]:
    """GPUs this process sees, None without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else None
