"""Actor checkpoints: Megatron distributed checkpoint + RNG + step/version + extra state, atomically.

Layout of one checkpoint directory ``<dir>/<name>/``::

    dist/            megatron.core.dist_checkpointing (torch_dist): model sharded_state_dict and the
                     optimizer's sharded state (any TP / PP / DP layout can reload it)
    rng/rank_<r>.pt  per-rank RNG: torch CPU (+ CUDA), Megatron's model-parallel tracker, numpy, random
    actor.json       version, scheduler state, layout it was written with, the last update's metrics
                     (what mask_strategy=auto chooses from)
    extra_state.json the caller's dict (e.g. the rollout-store cursor), JSON

Atomicity: every rank writes into ``<name>.tmp``; after a barrier rank 0 renames it to ``<name>``
and then writes ``<dir>/latest`` (the name, via a temporary file and ``os.replace``). A crash at any
point leaves either the previous complete checkpoint as ``latest`` or the new one; a partial
``.tmp`` directory is never read. ``load_checkpoint`` accepts a checkpoint directory or its parent
(then ``latest`` is followed).

Resuming restores weights, Adam moments and step counts, the LR schedule, RNG streams and
``actor.version``, so the next update is the one an uninterrupted run would have made (tested).

Mixture-of-experts models: the experts are saved as one global tensor per expert linear
(Megatron's ``TEGroupedMLP`` layout, ``actor/experts.py``), so the *weights* load at any expert
layout (``model_only=True``; tested EP=2 <-> EP=1 at DP=2, ``tests/actor/test_moe_checkpoint.py``).
A full resume (optimizer included) needs the expert layout it was saved with: Megatron gives the
experts their own optimizer when expert parallelism is on (``chained_1`` beside the dense
``chained_0``; one optimizer at EP=1), so the optimizer's keys change with EP, and the
distributed optimizer's 'dp_reshardable' state is laid out per expert-data-parallel group.
``load_checkpoint`` refuses that with a ValueError naming both layouts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_m2po.utils import lifeline
from megatron_m2po.utils.faults import fault_point

__all__ = ["save_checkpoint", "load_checkpoint", "resolve_checkpoint", "latest_checkpoint", "LATEST"]

LATEST = "latest"
_FORMAT = 1
_OPT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}

log = logging.getLogger(__name__)


def _chunk_state(chunk) -> dict:
    """A chunk's sharded state: under LoRA the adapters only. The frozen base is ``model.hf_path``'s,
    which every start loads first (``build_model``); a Qwen2.5-32B checkpoint is then ~0.5 GB of
    adapters and their optimizer state instead of 65 GB of weights as well."""
    from megatron_m2po.actor.lora import has_adapters, is_adapter_key

    sd = chunk.sharded_state_dict()
    return {k: v for k, v in sd.items() if is_adapter_key(k)} if has_adapters([chunk]) else sd


def _load_chunk(chunk, state: dict) -> None:
    """Load a chunk's saved state; under LoRA only the base (from ``model.hf_path``) may be missing."""
    from megatron_m2po.actor.lora import has_adapters, is_adapter_key

    if not has_adapters([chunk]):
        chunk.load_state_dict(state)
        return
    missing, unexpected = chunk.load_state_dict(state, strict=False)
    lost = [k for k in missing if is_adapter_key(k)]
    if lost or unexpected:
        raise ValueError(f"the checkpoint does not match this LoRA model: adapters missing {lost[:4]}, unexpected "
                         f"{list(unexpected)[:4]}: resume with the model.lora settings it was saved with")


def _sharded_state(actor, is_loading: bool, with_optimizer: bool = True) -> dict:
    model_sd = {}
    if len(actor.chunks) == 1:
        model_sd["model"] = _chunk_state(actor.chunks[0])
    else:
        for i, c in enumerate(actor.chunks):
            model_sd[f"model{i}"] = _chunk_state(c)
    state = dict(model_sd)
    if not with_optimizer:
        return state
    # Distributed optimizer: 'dp_reshardable' (reloads at the same TP / PP layout, any DP size). The
    # default format is no longer loadable in 0.16, and 'fully_reshardable' fails to load with the torch
    # Adam fallback (no TE / apex: it drops the 'step' entry it then copies). The plain optimizer's
    # state is per parameter and reshards freely.
    state["optimizer"] = actor.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPT_METADATA)
    return state


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate(),
          "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _set_rng_state(st: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["random"])
    tensor_parallel.get_cuda_rng_tracker().set_states(st["tracker"])
    if torch.cuda.is_available() and "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"])


def save_checkpoint(actor, path: str, extra_state: dict[str, Any]) -> None:
    """Write a complete checkpoint of ``actor`` to ``path`` (collective; see the module doc)."""
    from megatron.core import dist_checkpointing

    try:
        extra_json = json.dumps(extra_state)
    except TypeError as e:
        raise ValueError(f"extra_state must be JSON-serialisable (plain dicts, lists, numbers, strings): {e}") from None
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "dist").mkdir(parents=True)
        (tmp / "rng").mkdir()
    dist.barrier()
    # a never-stepped torch Adam (a run saved before its first update, a converted or weights-only
    # loaded actor) has no state: the distributed optimizer's state_dict asserts on the missing step
    materialise_optimizer_state(actor.optimizer)
    _own_writer_results_queue()
    # The writer processes Megatron forks for this save die with the trainer (utils/lifeline.py).
    with lifeline.forks_die_with_process():
        dist_checkpointing.save(_sharded_state(actor, is_loading=False), str(tmp / "dist"))
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank}.pt")
    if rank == 0:
        meta = {"format": _FORMAT, "version": actor.version, "scheduler": actor.scheduler.state_dict(),
                "adam_step": _adam_step(actor.optimizer),
                "world_size": dist.get_world_size(), "tensor_parallel": dist.get_world_size(actor.pg.tp),
                "pipeline_parallel": dist.get_world_size(actor.pg.pp), "hf_path": actor.cfg.model.hf_path,
                "expert_layout": _expert_layout(actor),
                # model.lora: the adapters' settings (m2po convert rebuilds them); the base is hf_path's
                "lora": dataclasses.asdict(actor.cfg.model.lora) if actor.cfg.model.lora.rank > 0 else None,
                # expert adapters as one stacked tensor per matrix (actor/lora.py ExpertLoRA): the
                # distributed optimizer's state follows the parameters' order and sizes
                "expert_adapters": EXPERT_ADAPTER_LAYOUT if _has_expert_adapters(actor) else None,
                # the previous update's metrics: mask_strategy=auto's choice (the same on every rank)
                "mask_hint": actor.mask_hint}
        (tmp / "actor.json").write_text(json.dumps(meta, indent=1))
        (tmp / "extra_state.json").write_text(extra_json)
    fault_point("checkpoint_write")  # <name>.tmp complete, not renamed: a crash here keeps the previous `latest`
    dist.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_latest(final.parent, final.name)
    dist.barrier()


def _own_writer_results_queue() -> None:
    """Give Megatron's checkpoint writer an in-process results queue instead of a manager process.

    megatron-core 0.16.1 ``dist_checkpointing/strategies/filesystem_async.py``
    ``_get_write_results_queue`` creates, on the first save of a process, a ``spawn`` context
    ``Manager().Queue()`` and caches it in the module's ``_results_queue``: a manager server process
    (the trainer's ``__main__`` re-imported: ~4 s of CPU and ~330 MB per rank) that lives as long as
    the trainer and, started with no initializer, also after a ``kill -9``. A queue shared between
    processes is needed only for an *asynchronous* save, whose writer runs in a forked process. This
    project's saves are synchronous (``dist_checkpointing.save`` without ``async_sharded_save``:
    ``async_utils.py`` ``AsyncRequest.execute_sync`` calls ``write_preloaded_data_multiproc`` in the
    calling process, which forks the per-bucket writers, collects their results over its own local
    queue and puts the dict into ``_results_queue``; ``retrieve_write_results`` then takes it with
    ``get_nowait()`` in the same process). A thread-safe ``queue.Queue`` does exactly that: no process,
    and ``put`` completes before ``get_nowait`` (a multiprocessing queue's feeder thread would race
    it).
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):  # not megatron-core 0.16's layout: its own queue
        log.warning("megatron.core filesystem_async has no _results_queue (not megatron-core 0.16.1): its "
                    "checkpoint writer may start a manager process that outlives a killed trainer")
        return
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _expert_layout(actor) -> list[int]:
    """[expert parallel, expert tensor parallel] as configured (ETP defaults to TP, as in Megatron)."""
    p = actor.cfg.parallel
    return [p.expert_parallel, p.expert_tensor_parallel or p.tensor_parallel]


def _write_latest(parent: Path, name: str) -> None:
    pointer = parent / (LATEST + ".tmp")
    pointer.write_text(name)
    os.replace(pointer, parent / LATEST)


def latest_checkpoint(parent: str | os.PathLike) -> Path | None:
    """The directory ``<parent>/latest`` names, or None when there is no pointer or it names nothing."""
    pointer = Path(parent) / LATEST
    if not pointer.is_file():
        return None
    p = Path(parent) / pointer.read_text().strip()
    return p if p.exists() else None


def resolve_checkpoint(path: str) -> Path | None:
    """The checkpoint directory ``path`` names (following ``<path>/latest``), or None when there is none."""
    p = Path(path)
    if (p / "actor.json").is_file():
        return p
    q = latest_checkpoint(p)
    if q is not None and (q / "actor.json").is_file():
        return q
    return None


def materialise_optimizer_state(optimizer) -> None:
    """Give a fresh torch Adam (Megatron's fallback without TE / apex) zero state with a ``step``.

    Megatron's distributed optimizer reads the step count from the inner optimizer's state while
    building the sharded state dict to load into; a never-stepped torch Adam has no state, and
    Megatron's own ``init_state_fn`` adds moments but no ``step``. The distributed optimizer's
    'dp_reshardable' format then loads straight into these tensors; the step count is restored by
    ``_restore_adam_steps``.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or len(inner.state):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                st.setdefault("step", torch.zeros((), dtype=torch.float32))
                st.setdefault("exp_avg", torch.zeros_like(p, memory_format=torch.preserve_format))
                st.setdefault("exp_avg_sq", torch.zeros_like(p, memory_format=torch.preserve_format))


def _torch_adams(optimizer) -> list:
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(getattr(o, "optimizer", None), (torch.optim.Adam, torch.optim.AdamW))]


def _adam_step(optimizer) -> float | None:
    """The step count of the torch Adam fallback (all parameters share it), or None."""
    steps = {float(st["step"]) for inner in _torch_adams(optimizer) for st in inner.state.values() if "step" in st}
    if len(steps) > 1:
        raise RuntimeError(f"optimizer parameters disagree on the Adam step count: {sorted(steps)}")
    return steps.pop() if steps else None


def _restore_adam_steps(optimizer, step: float | None) -> None:
    """Set every parameter's torch-Adam ``step`` to its own tensor holding the saved count.

    Megatron's distributed optimizer restores the fallback's step by assigning *one* tensor to every
    parameter (torch Adam increments it in place, once per parameter: wrong bias correction), and its
    'dp_reshardable' load copies the placeholder steps over it. The count saved in actor.json is
    the truth.
    """
    if step is None:
        return
    for inner in _torch_adams(optimizer):
        for st in inner.state.values():
            if "step" in st:
                st["step"] = torch.tensor(float(step), dtype=torch.float32)


EXPERT_ADAPTER_LAYOUT = "stacked"  # actor.json "expert_adapters": ExpertLoRA's parameters, one per matrix


def _has_expert_adapters(actor) -> bool:
    from megatron_m2po.actor.lora import expert_adapter_modules

    return next(expert_adapter_modules(actor.chunks), None) is not None


def load_checkpoint(actor, path: str, *, model_only: bool = False) -> dict[str, Any]:
    """Restore ``actor`` from ``path`` (a checkpoint or its parent with ``latest``); returns the extra state.

    ``model_only``: weights only (conversion / evaluation); the model tensors reshard to any layout.
    """
    from megatron.core import dist_checkpointing

    ckpt = resolve_checkpoint(path)
    if ckpt is None:
        raise ValueError(f"no complete checkpoint at {path!r} (expected actor.json there, or a '{LATEST}' file "
                         "naming one)")
    meta = json.loads((ckpt / "actor.json").read_text())
    if meta.get("format") != _FORMAT:
        raise ValueError(f"checkpoint {ckpt} has format {meta.get('format')}, this code reads {_FORMAT}")
    saved_ep = meta.get("expert_layout", [1, meta.get("tensor_parallel", 1)])
    if not model_only and saved_ep[0] != _expert_layout(actor)[0]:
        raise ValueError(
            f"checkpoint {ckpt} was saved at parallel.expert_parallel={saved_ep[0]}, this run has "
            f"parallel.expert_parallel={_expert_layout(actor)[0]}: the optimizer state resumes only at the expert "
            f"layout it was saved with: set parallel.expert_parallel={saved_ep[0]}, or start a new run from its "
            "weights (they load at any layout: `m2po convert mcore-to-hf`, then model.hf_path=<the export>)")
    if not model_only and _has_expert_adapters(actor) and meta.get("expert_adapters") != EXPERT_ADAPTER_LAYOUT:
        raise ValueError(
            f"checkpoint {ckpt} holds expert LoRA adapters as one tensor per expert (written before they were "
            "stacked per layer): its weights load, but its optimizer state (a flat buffer in the parameters' old "
            "order) would land on the wrong adapters. Resume it with the release that wrote it, or start a new run "
            "from its weights: `m2po convert mcore-to-hf` writes the merged model and <out>_adapter")
    if model_only:
        sharded = _sharded_state(actor, is_loading=True, with_optimizer=False)
    else:
        materialise_optimizer_state(actor.optimizer)
        sharded = _sharded_state(actor, is_loading=True)
    state = dist_checkpointing.load(sharded, str(ckpt / "dist"))  # optimizer entries unused when model_only
    if len(actor.chunks) == 1:
        _load_chunk(actor.chunks[0], state["model"])
    else:
        for i, c in enumerate(actor.chunks):
            _load_chunk(c, state[f"model{i}"])
    if model_only:
        return json.loads((ckpt / "extra_state.json").read_text())
    with torch.no_grad():  # copies into the (leaf) main parameters
        actor.optimizer.load_state_dict(state["optimizer"])
    _restore_adam_steps(actor.optimizer, meta.get("adam_step"))
    actor.scheduler.load_state_dict(meta["scheduler"])
    actor.version = int(meta["version"])
    actor.mask_hint = meta.get("mask_hint")
    rng_file = ckpt / "rng" / f"rank_{dist.get_rank()}.pt"
    if rng_file.is_file() and meta.get("world_size") == dist.get_world_size():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((ckpt / "extra_state.json").read_text())
