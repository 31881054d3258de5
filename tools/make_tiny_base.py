#!/usr/bin/env python
"""Build (or find) the tiny CPU base model: tokenizer + Qwen2-shaped model warmed up on the
synthetic arithmetic task. ``m2po train`` does the same on first use of ``model.hf_path=tiny``.

    python tools/make_tiny_base.py [--cache-dir DIR] [--seed N] [--force]

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
from megatron_m2po.standins.tiny_base import (TinyBaseSpec, ensure_tiny_base, load_tiny_meta,  # noqa: E402
                                           tiny_base_path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", default=ModelConfig().tiny_cache_dir,
                    help="Cache directory (default: %(default)s, as model.tiny_cache_dir)")
    ap.add_argument("--seed", type=int, default=0, help="Build seed (default: 0)")
    ap.add_argument("--force", action="store_true", help="Rebuild even if a complete model exists")
    ap.add_argument("--no-progress", action="store_true", help="No progress bar")
    args = ap.parse_args(argv)
    setup_logging(0)

    cache = Path(args.cache_dir).expanduser()
    if args.force:
        target = tiny_base_path(cache, TinyBaseSpec(seed=args.seed))
        if target.exists():
            shutil.rmtree(target)
    try:
        path = ensure_tiny_base(cache, seed=args.seed, progress=not args.no_progress)
    except ValueError as e:
        print(f"make_tiny_base: {e}", file=sys.stderr)
        return 2
    meta = load_tiny_meta(path)
    print(f"tiny base model: {meta['num_parameters']:,} parameters, vocab {meta['vocab_size']}, "
          f"base accuracy {meta['base_accuracy_t1']:.3f} at temperature 1 "
          f"({meta['base_accuracy_eval_problems']} problems), warm-up {meta['steps']} steps "
          f"in {meta['warmup_seconds']} s\n"
          f"format: prompt {meta['example']['prompt']!r} -> response "
          f"{meta['example']['response']!r} + </s> (use data.template={meta['data_template']})",
          file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
