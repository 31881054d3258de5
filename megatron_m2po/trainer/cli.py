"""``m2po train CONFIG [dotted overrides]`` — single process or under torchrun."""

from __future__ import annotations

import argparse
import logging
import os
import warnings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="Train a policy (sync, stale_k or async mode).",
                       description="Train with the config file plus dotted overrides, e.g. "
                                   "`m2po train examples/tiny_cpu.yaml trainer.stale_k=8 algo.loss=grpo`. "
                                   "Under torchrun every rank runs this command.")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.add_argument("--dry-run", action="store_true", help="Validate and print the resolved config, then exit.")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_m2po.config import dump_config, load_config
    cfg = load_config(args.config, args.overrides)
    if args.dry_run:
        print(dump_config(cfg), end="")
        return 0
    rank = int(os.environ.get("RANK", "0"))
    from megatron_m2po.utils.logging import setup_logging
    setup_logging(rank, access_log=cfg.logging.access_log)
    run_lock = None
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # A single process locks its run directory and checks what a user can get wrong at run
        # time before Megatron-Core is imported and the process group is made (an answer in
        # seconds); under torchrun rank 0 does it in the trainer, where its refusal reaches every rank.
        from megatron_m2po.trainer.preflight import claim_checked_run_dir
        run_lock = claim_checked_run_dir(cfg)
    # Megatron-Core logs its whole optimizer config and every parameter bucket at INFO: keep
    # the console to our progress lines unless asked (M2PO_MEGATRON_LOG=INFO).
    logging.getLogger("megatron").setLevel(os.environ.get("M2PO_MEGATRON_LOG", "WARNING"))
    import torch
    if not torch.cuda.is_available():
        # Expected on CPU: Megatron falls back to torch kernels without TE / apex.
        for msg in (".*Apex is not installed.*", ".*Transformer Engine and Apex are not installed.*",
                    ".*full scope is deprecated.*"):
            warnings.filterwarnings("ignore", message=msg)
    from megatron_m2po.trainer.loop import train
    return train(cfg, run_lock=run_lock)
