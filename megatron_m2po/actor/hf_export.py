"""HF-named weights of this rank's pipeline stage only, for weight pushes from every stage.

``model.iter_hf_weights`` (mbridge's ``export_weights``) walks the whole model on every rank:
each stage's tensors are broadcast over the pipeline group so that rank 0 ends up with all of
them. A weight push does not need that: each stage sends its own layers. :func:`iter_stage_hf_weights`
walks the local model chunks only, gathers tensor-parallel shards within the stage (the same
all-gather + ``_weight_merge_across_tp`` + ``_weight_to_hf_format`` steps as mbridge's exporter,
per tensor) and never touches the pipeline group. Ranks of data-parallel replicas other than the
first need not iterate (they hold the same weights); :func:`stage_layout` says who exports and
who sends.

A tied output weight lives on the first stage (``model.embed_tokens.weight``); the last stage's
copy of it (``output_layer.weight`` when ``share_embeddings_and_output_weights``) is not exported.
Expert parallelism (EP > 1) is not supported here: expert shards span data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch

__all__ = ["StageLayout", "stage_layout", "iter_stage_hf_weights", "export_hf_stages"]


@dataclass(frozen=True, slots=True)
class StageLayout:
    """This rank's part in a weight push."""

    stage: int       # pipeline rank
    n_stages: int
    exports: bool    # iterates the stage's weights (data-parallel rank 0: the tensor-parallel gathers)
    sender: bool     # sends / writes them (and tensor-parallel rank 0)


def stage_layout() -> StageLayout:
    from megatron.core import parallel_state as ps

    if ps.get_expert_model_parallel_world_size() > 1:
        raise NotImplementedError("weight push from every stage with expert parallelism > 1")
    exports = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    return StageLayout(ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
                       exports, exports and ps.get_tensor_model_parallel_rank() == 0)


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def iter_stage_hf_weights(chunks, bridge) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` of this stage's parameters, tensor-parallel shards gathered.

    Collective over the stage's tensor-parallel group: its ranks iterate in step.
    """
    from megatron.core import parallel_state as ps

    tp_size, tp_group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    seen: set[str] = set()
    for chunk in chunks:
        model = _unwrap(chunk)
        local_to_global = bridge._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
        tied_copy = getattr(model, "share_embeddings_and_output_weights", False) and not getattr(
            model, "pre_process", True)
        params = list(model.named_parameters())
        names = {n for n, _ in params}
        params += [(n, t) for n, t in model.state_dict().items()  # mbridge: unregistered expert biases
                   if "_extra_state" not in n and "expert_bias" in n and n not in names]
        for local, param in params:
            if tied_copy and local == "output_layer.weight":
                continue  # the first stage exports the tied embedding
            name = local_to_global[local]
            # Grad mode is thread-global: switched off around each step, never across a yield.
            with torch.no_grad():
                if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
                    parts = [torch.empty_like(param) for _ in range(tp_size)]
                    torch.distributed.all_gather(parts, param.contiguous(), group=tp_group)
                    full = bridge._weight_merge_across_tp(name, parts, param)
                else:
                    full = param
                hf_names, hf_params = bridge._weight_to_hf_format(name, full)
            for hf_name, t in zip(hf_names, hf_params):
                if hf_name in seen:
                    continue
                seen.add(hf_name)
                yield hf_name, t.detach()


def export_hf_stages(chunks, bridge, out_dir: str, *, tokenizer_src: Optional[str] = None,
                     shard_mb: float = 4096.0) -> None:
    """HF safetensors + config (+ tokenizer files) with every stage writing its own shards.

    Collective (every rank calls it). Each stage's sender writes its layers into ``<out>.tmp`` (at
    most ``shard_mb`` of host memory at a time); global rank 0 names the files
    ``model-0000k-of-0000n.safetensors``, writes ``model.safetensors.index.json``, the config and
    tokenizer files, and renames the directory to ``out_dir``: it is complete once it exists.
    """
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    from megatron_m2po.actor.model import publish_hf_dir
    from megatron_m2po.utils.hf_dir import assemble_shards, write_stage_shards

    layout = stage_layout()
    rank = dist.get_rank()
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    files, error = [], ""
    if layout.exports:
        it = iter_stage_hf_weights(chunks, bridge)
        try:
            if layout.sender:
                files = write_stage_shards(it, tmp, layout.stage, int(shard_mb * 2**20))
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            error = f"stage {layout.stage}: {type(e).__name__}: {e}"
        finally:
            for _ in it:  # the stage's other tensor-parallel ranks gather with the sender
                pass
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (layout.stage, layout.sender, files, error))
    errors = [g[3] for g in gathered if g[3]]
    if errors:
        raise RuntimeError(f"HF export to {out_dir} failed: " + "; ".join(errors))
    if rank == 0:
        stage_files = [f for _, _, fs, _ in sorted((g for g in gathered if g[1]), key=lambda g: g[0]) for f in fs]
        assemble_shards(tmp, stage_files, always_index=True)
        publish_hf_dir(tmp, out, bridge, tokenizer_src)
    dist.barrier()
