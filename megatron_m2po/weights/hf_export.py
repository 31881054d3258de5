"""The one HF exporter: HF-named weights of this rank's pipeline stage only, for weight pushes and
HF directories written by every stage.

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
MoE experts (``mlp.experts.linear_fc1.weight{i}``, :mod:`megatron_m2po.actor.experts` / TE's
``TEGroupedMLP``) are gathered as mbridge's exporter gathers them: over the expert-parallel group
(every EP rank's local experts, renumbered ``ep_rank * local + i``), then over the expert
tensor-parallel group, and named as the HF checkpoint names them
(``model.layers.{l}.mlp.experts.{e}.gate_proj / up_proj / down_proj.weight``), which is what
SGLang 0.5.23's ``Qwen3MoeForCausalLM.load_weights`` maps onto its fused experts
(``srt/models/qwen3_moe.py``, ``FusedMoE.make_expert_params_mapping``: ``experts.{e}.gate_proj.``
-> ``experts.w13_`` shard w1, ``up_proj`` -> w3, ``down_proj`` -> ``experts.w2_``). Expert-parallel
groups span data-parallel ranks, so with EP > 1 every rank iterates (the expert gathers need each
EP rank) and data-parallel rank 0's tensor-parallel rank 0 of each stage sends.

No rank ever holds the whole model (docs/design.md §1b): an HF directory (:func:`export_hf`: the
final weights, ``m2po convert mcore-to-hf``) is written the way a disk push writes it, every stage
its own shards. The functions that take the actor use its public ``chunks`` and ``bridge`` only,
so the actor does not know this package (actor/ sits below weights/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch

__all__ = ["StageLayout", "stage_layout", "iter_stage_hf_weights", "stage_hf_weights", "export_hf_stages",
           "export_hf"]


@dataclass(frozen=True, slots=True)
class StageLayout:
    """This rank's part in a weight push."""

    stage: int       # pipeline rank
    n_stages: int
    exports: bool    # iterates the stage's weights (data-parallel rank 0: the tensor-parallel gathers)
    sender: bool     # sends / writes them (and tensor-parallel rank 0)


def stage_layout() -> StageLayout:
    from megatron.core import parallel_state as ps

    first = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    exports = first or ps.get_expert_model_parallel_world_size() > 1
    return StageLayout(ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
                       exports, first and ps.get_tensor_model_parallel_rank() == 0)


def stage_hf_weights(actor) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` of ``actor``'s pipeline stage on this rank, tensor-parallel shards
    gathered within the stage (:func:`iter_stage_hf_weights`); empty on ranks that do not export
    (data-parallel replicas after the first)."""
    if not stage_layout().exports:
        return iter(())
    return iter_stage_hf_weights(actor.chunks, actor.bridge)


def export_hf(actor, out_dir: str, *, adapter_dir: Optional[str] = None) -> None:
    """HF safetensors + config + tokenizer files of ``actor``'s current weights; every pipeline stage
    writes its own shards (:func:`export_hf_stages`; collective: all ranks call it). Under LoRA the
    adapters are folded in, and written as a peft adapter directory too, ``adapter_dir`` (default:
    ``final_adapter`` next to ``out_dir``; ``PeftModel.from_pretrained(base, adapter_dir)`` loads it)."""
    from megatron_m2po.actor.lora import has_adapters

    export_hf_stages(actor.chunks, actor.bridge, out_dir)
    if has_adapters(actor.chunks):
        from pathlib import Path

        from megatron_m2po.weights.lora_export import write_peft_dir

        write_peft_dir(actor.chunks, actor.cfg.model.lora, adapter_dir or str(Path(out_dir).parent / "final_adapter"),
                       base_model_name_or_path=actor.cfg.model.hf_path)


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def iter_stage_hf_weights(chunks, bridge) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` of this stage's parameters, tensor-parallel shards gathered; under
    LoRA (``model.lora``) the policy's weights: each projection's adapters folded into it
    (``W + s B A``, :func:`~megatron_m2po.weights.lora_export.merge_adapters`, what peft's
    ``merge_and_unload`` computes), so a full-weight push and ``final_hf`` serve the trained policy.

    Collective over the stage's tensor-parallel group: its ranks iterate in step.
    """
    from megatron_m2po.actor.lora import adapter_modules, expert_adapter_modules, has_adapters

    base = _iter_base_stage_hf_weights(chunks, bridge)
    if not has_adapters(chunks):
        return base
    from megatron_m2po.weights.lora_export import merge_adapters, stage_adapter_tensors

    scaling = {m.scaling for m in [*adapter_modules(chunks), *expert_adapter_modules(chunks)]}
    assert len(scaling) == 1, scaling  # one model.lora.alpha / rank for every adapter
    return merge_adapters(base, stage_adapter_tensors(chunks), scaling.pop())


def _iter_base_stage_hf_weights(chunks, bridge) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`iter_stage_hf_weights` of the base weights alone (LoRA adapters left out)."""
    from megatron.core import parallel_state as ps

    tp_size, tp_group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    seen: set[str] = set()
    from megatron_m2po.actor.lora import base_view

    for chunk in chunks:
        model = base_view(_unwrap(chunk))  # LoRA adapters are not HF weights (weights/lora_export.py)
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
            if ".mlp.experts.linear_fc" in name:
                yield from _expert_hf_weights(bridge, name, param, seen)
                continue
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


def _expert_hf_weights(bridge, name: str, param, seen: set) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of local expert ``name`` (``...linear_fc{1,2}.weight{i}``) of every EP rank, each
    merged over the expert tensor-parallel group. Collective over the EP and expert-TP groups."""
    from megatron.core import parallel_state as ps

    ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    prefix, local_id = name.split(".weight")
    n_local = bridge.config.num_moe_experts // ep
    with torch.no_grad():
        if ep > 1:
            per_ep = [torch.empty_like(param) for _ in range(ep)]
            torch.distributed.all_gather(per_ep, param.contiguous(), group=ps.get_expert_model_parallel_group())
        else:
            per_ep = [param]
    for r, shard in enumerate(per_ep):
        global_name = f"{prefix}.weight{r * n_local + int(local_id)}"
        with torch.no_grad():
            if etp > 1:
                parts = [torch.empty_like(shard) for _ in range(etp)]
                torch.distributed.all_gather(parts, shard.contiguous(), group=ps.get_expert_tensor_parallel_group())
                full = _merge_expert_tp(global_name, parts, bridge.config.gated_linear_unit)
            else:
                full = shard
            hf_names, hf_params = bridge._weight_to_hf_format(global_name, full)
        for hf_name, t in zip(hf_names, hf_params):
            if hf_name not in seen:
                seen.add(hf_name)
                yield hf_name, t.detach()


def _merge_expert_tp(name: str, parts: list[torch.Tensor], gated: bool) -> torch.Tensor:
    """Expert-TP shards -> the whole expert weight: fc1 rows are ``[gate_r; up_r]`` per rank (as
    mbridge's ``_weight_split_across_tp`` loads them), fc2 is split along its input columns.
    (mbridge's ``_weight_merge_across_tp`` does the same but returns the first shard when the
    dense TP size is 1, which an ETP > TP layout needs.)"""
    if "linear_fc1" in name and not gated:
        return torch.cat(parts, dim=0)
    if "linear_fc1" in name:
        gates, ups = zip(*(p.chunk(2) for p in parts))
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(parts, dim=1)


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
