#!/usr/bin/env python
"""Build (or find) the tiny CPU base model: tokenizer + Qwen2-shaped model warmed up on the
synthetic arithmetic task. ``m2po train`` does the same on first use of ``model.hf_path=tiny``.

    python tools/make_tiny_base.py [--cache-dir DIR] [--seed N] [--family F] [--force]

``--family qwen2_tools`` builds the tiny tool base (standins/tiny_tools.py) and prints its
measurements: accuracy with the calculator working vs. its result withheld, and the fraction of
episodes that call it.

Prints the model directory on stdout (last line) and a summary on stderr.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the package importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_m2po.config import ModelConfig  # noqa: E402
from megatron_m2po.utils.logging import setup_logging  # noqa: E402
from megatron_m2po.standins.tiny_base import (FAMILIES, TinyBaseSpec, TinyModelSpec,  # noqa: E402
                                              ensure_tiny_base, load_tiny_meta, tiny_base_path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", default=ModelConfig().tiny_cache_dir,
                    help="Cache directory (default: %(default)s, as model.tiny_cache_dir)")
    ap.add_argument("--seed", type=int, default=0, help="Build seed (default: 0)")
    ap.add_argument("--family", default="qwen2", choices=FAMILIES, help="As model.tiny_family (default: %(default)s)")
    ap.add_argument("--force", action="store_true", help="Rebuild even if a complete model exists")
    ap.add_argument("--no-progress", action="store_true", help="No progress bar")
    args = ap.parse_args(argv)
    setup_logging(0)

    cache = Path(args.cache_dir).expanduser()
    spec = TinyBaseSpec(seed=args.seed, model=TinyModelSpec(family=args.family))
    if args.force:
        target = tiny_base_path(cache, spec)
        if target.exists():
            shutil.rmtree(target)
    try:
        path = ensure_tiny_base(cache, spec=spec, progress=not args.no_progress)
    except ValueError as e:
        print(f"make_tiny_base: {e}", file=sys.stderr)
        return 2
    meta = load_tiny_meta(path)
    if "eval_with_tool" in meta:
        _print_tool_base(meta)
    else:
        print(f"tiny base model: {meta['num_parameters']:,} parameters, vocab {meta['vocab_size']}, "
              f"base accuracy {meta['base_accuracy_t1']:.3f} at temperature 1 "
              f"({meta['base_accuracy_eval_problems']} problems), warm-up {meta['steps']} steps "
              f"in {meta['warmup_seconds']} s\n"
              f"format: prompt {meta['example']['prompt']!r} -> response "
              f"{meta['example']['response']!r} + </s> (use data.template={meta['data_template']})",
              file=sys.stderr)
    print(path)
    return 0


def _print_tool_base(meta: dict) -> None:
    w, h = meta["eval_with_tool"], meta["eval_tool_withheld"]
    print(f"tiny tool base: fine-tuned {meta['steps']} steps in {meta['finetune_seconds']} s from {meta['derived_from']}\n"
          f"on {w['problems']} problems ({w['hard_problems']} products), two-turn episodes at T=1:\n"
          f"  tool working : accuracy {w['accuracy']:.3f} (products {w['accuracy_hard']:.3f}, + - "
          f"{w['accuracy_easy']:.3f}), episodes calling the tool {w['call_fraction']:.3f}, decision as trained "
          f"{w['call_agreement']:.3f}\n"
          f"  tool withheld: accuracy {h['accuracy']:.3f} (products {h['accuracy_hard']:.3f}, + - "
          f"{h['accuracy_easy']:.3f})\n"
          f"format: {meta['example']['call']!r} / {meta['example']['direct']!r}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
