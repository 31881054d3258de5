"""``m2po convert``: HF safetensors <-> Megatron distributed checkpoints.

    m2po convert hf-to-mcore --hf /models/Qwen2.5-1.5B --out ckpts/init [--tp 2 --pp 1]
    m2po convert mcore-to-hf --ckpt runs/x/checkpoints --out exported/ [--hf /models/Qwen2.5-1.5B]

``hf-to-mcore`` writes an actor checkpoint at version 0 (weights, a zero optimizer state, RNG) that
``checkpoint.load_checkpoint`` / training resume reads. ``mcore-to-hf`` reads the model part of an
actor checkpoint (any TP / PP it was written with: model tensors reshard) and writes HF safetensors +
config + tokenizer files; the architecture comes from ``--hf`` or the ``hf_path`` recorded in the
checkpoint. Both run in one process on CPU (gloo) or under torchrun with the given layout.

It lives in weights/ because ``mcore-to-hf`` writes through the package's one HF exporter
(:func:`megatron_m2po.weights.hf_export.export_hf`: every pipeline stage writes its own shards).
"""

from __future__ import annotations

import argparse
import json

from megatron_m2po.config import Config


def actor_config(hf: str, tp: int, pp: int, dtype: str, lora: dict | None = None):
    from megatron_m2po.actor.actor import ActorConfig
    from megatron_m2po.actor.settings import LoRAConfig

    cfg = Config()
    cfg.model.hf_path = hf
    cfg.model.dtype = dtype
    if lora:  # a LoRA checkpoint holds adapters on hf's base: the export folds them in (final_hf + adapter)
        cfg.model.lora = LoRAConfig(**lora)
    cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel = tp, pp
    # No training happens here; the LR schedule length only has to be valid.
    return ActorConfig.from_config(cfg, total_updates=cfg.trainer.num_steps * cfg.trainer.num_updates_per_step)


def hf_to_mcore(hf: str, out: str, *, tp: int = 1, pp: int = 1, dtype: str = "float32") -> None:
    from megatron_m2po.actor.actor import MegatronActor
    from megatron_m2po.actor.checkpoint import materialise_optimizer_state

    actor = MegatronActor.from_config(actor_config(hf, tp, pp, dtype))
    try:
        materialise_optimizer_state(actor.optimizer)  # a never-stepped Adam has no state to shard
        actor.save_checkpoint(out, {"converted_from": hf})
    finally:
        actor.close()


def mcore_to_hf(ckpt: str, out: str, *, hf: str | None = None, tp: int = 1, pp: int = 1,
                dtype: str = "float32") -> None:
    from megatron_m2po.actor.actor import MegatronActor
    from megatron_m2po.actor.checkpoint import resolve_checkpoint
    from megatron_m2po.weights.hf_export import export_hf

    path = resolve_checkpoint(ckpt)
    if path is None:
        raise ValueError(f"no complete checkpoint at {ckpt!r}")
    meta = json.loads((path / "actor.json").read_text())
    hf = hf or meta.get("hf_path")
    if not hf:
        raise ValueError("the checkpoint does not record its HF model directory: pass --hf")
    actor = MegatronActor.from_config(actor_config(hf, tp, pp, dtype, meta.get("lora")))
    try:
        actor.load_checkpoint(str(path), model_only=True)
        export_hf(actor, out, adapter_dir=str(out).rstrip("/") + "_adapter")  # under LoRA: <out>_adapter too
    finally:
        actor.close()


def run(args: argparse.Namespace) -> int:
    if args.direction == "hf-to-mcore":
        hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype)
    else:
        mcore_to_hf(args.ckpt, args.out, hf=args.hf, tp=args.tp, pp=args.pp, dtype=args.dtype)
    print(f"m2po convert: wrote {args.out}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="Convert HF safetensors <-> Megatron distributed checkpoints.")
    p.add_argument("direction", choices=["hf-to-mcore", "mcore-to-hf"])
    p.add_argument("--hf", help="HF model directory (source of hf-to-mcore; architecture for mcore-to-hf).")
    p.add_argument("--ckpt", help="Actor checkpoint directory or its parent with 'latest' (mcore-to-hf).")
    p.add_argument("--out", required=True, help="Output directory.")
    p.add_argument("--tp", type=int, default=1, help="Tensor parallel size of this process group.")
    p.add_argument("--pp", type=int, default=1, help="Pipeline parallel size of this process group.")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(func=_checked_run)


def _checked_run(args: argparse.Namespace) -> int:
    if args.direction == "hf-to-mcore" and not args.hf:
        raise ValueError("m2po convert hf-to-mcore needs --hf")
    if args.direction == "mcore-to-hf" and not args.ckpt:
        raise ValueError("m2po convert mcore-to-hf needs --ckpt")
    return run(args)
