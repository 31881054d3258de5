"""Benchmark the actor's data layout: padded vs packed micro-batches, contiguous vs balanced shards.

Part 1 (no model): the micro-batch plans of ``megatron_m2po.actor.batch`` on a stated length
distribution, one optimizer update of the 32B recipe's shape: 64 prompts x 8 samples over 8
data-parallel ranks (``--dp``); prompt lengths uniform in [100, 1000]; per prompt a log-normal
typical response length (median ``--median`` tokens, sigma 0.6) and per sample a log-normal
factor (sigma 0.3) around it, capped at ``--max-len`` tokens of response. Work is
``batch.sequence_work`` (dense projections + causal attention, hidden size ``--hidden``). For
padded micro-batch sizes 1/2/4/8 and packed token budgets it prints: the fraction of work spent
on padding rows, micro-batches per rank and update, and data-parallel imbalance (max / mean work
per rank) with contiguous and with balanced shards.

Part 2 (``--actor``): the tiny actor on CPU (one process): tokens/s of ``compute_logprobs``,
packed vs padded at micro-batch size 4, on samples drawn from the same distribution scaled down
to the tiny model's context (``--tiny-median``), with the log-probs of both paths compared.
The CPU packed attention is dense over the pack (a block-diagonal mask, ``actor/attention.py``),
so on CPU packing saves the padding of the dense projections but not attention FLOPs; the THD
kernels on GPU skip the masked blocks.

    python tools/benchmarks/packing.py
    python tools/benchmarks/packing.py --actor
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

from megatron_m2po.actor.batch import balanced_shards, dp_shard, group_microbatches, sequence_work


def lengths_of_update(rng, prompts: int, per_prompt: int, median: float, max_len: int) -> list[tuple[int, int]]:
    """(prompt, response) lengths, samples of a prompt adjacent (as the trainer orders them)."""
    out = []
    for _ in range(prompts):
        p = int(rng.integers(100, 1001))
        typical = rng.lognormal(np.log(median), 0.6)
        for _ in range(per_prompt):
            r = int(min(max_len, max(16, typical * rng.lognormal(0.0, 0.3))))
            out.append((p, r))
    return out


def plan_table(args) -> None:
    rng = np.random.default_rng(args.seed)
    pr = lengths_of_update(rng, args.prompts, args.per_prompt, args.median, args.max_len)
    lengths = [p + r for p, r in pr]
    h, dp = args.hidden, args.dp
    print(f"# one update: {len(lengths)} sequences, mean {np.mean(lengths):.0f} tokens, p50 "
          f"{np.median(lengths):.0f}, max {max(lengths)}; DP={dp}, hidden={h}")

    def imbalance(shards):
        work = [sum(sequence_work(lengths[i], h) for i in s) for s in shards]
        return max(work) / (sum(work) / len(work))

    contiguous = [list(dp_shard(len(lengths), dp, r)) for r in range(dp)]
    balanced = balanced_shards(lengths, dp, h)
    real = sum(sequence_work(n, h) for n in lengths)
    print(f"{'layout':<24}{'padding work':>14}{'micro-batches/rank':>20}{'imbalance contiguous':>22}"
          f"{'imbalance balanced':>20}")
    configs = [(f"padded mbs={b}", dict(micro_batch_size=b, max_tokens=None, packing=False)) for b in (1, 2, 4, 8)]
    configs += [(f"packed {t // 1024}k tokens", dict(micro_batch_size=1, max_tokens=t, packing=True))
                for t in (8192, 16384, 32768)]
    for name, kw in configs:
        rows = []
        for shards in (contiguous, balanced):
            total, counts, per_rank = 0.0, [], []
            for s in shards:
                plan = group_microbatches(lengths, s, **kw)
                counts.append(len(plan))
                w = 0.0
                for g in plan:
                    if kw["packing"]:
                        w += sum(sequence_work(lengths[i], h) for i in g)
                    else:
                        w += len(g) * sequence_work(max(lengths[i] for i in g), h)
                per_rank.append(w)
                total += w
            rows.append((1 - real / total, float(np.mean(counts)), max(per_rank) / np.mean(per_rank)))
        (waste, n_mb, imb_c), (_, _, imb_b) = rows
        print(f"{name:<24}{waste:>13.1%}{n_mb:>20.1f}{imb_c:>22.3f}{imb_b:>20.3f}")


def _actor_bench(rank, world_size, root, args):
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "actor"))
    import actor_testlib as lib

    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch, Sample

    d = lib.make_tiny_hf("qwen3", os.path.join(root, "m"), seed=0)
    rng = np.random.default_rng(args.seed)
    pr = lengths_of_update(rng, 16, 8, args.tiny_median, 200)
    samples = [Sample(uid=f"s{i}", prompt_ids=rng.integers(0, 128, max(1, p // 20)), response_ids=rng.integers(0, 128, r),
                      behav_logprobs=np.zeros(r, np.float32), advantages=np.float32(0.0), loss_mask=np.ones(r, np.uint8),
                      versions=np.zeros(r, np.int64)) for i, (p, r) in enumerate(pr)]
    tokens = sum(s.length for s in samples)
    out = {}
    for name, packing, budget in (("padded mbs=4", False, None), ("packed", True, args.tiny_budget)):
        cfg = lib.actor_config(d, mbs=4)
        cfg.parallel.packing, cfg.parallel.max_tokens_per_microbatch = packing, budget
        actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=1))
        actor.compute_logprobs(RolloutBatch(samples[:8]))  # warm-up
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            with torch.no_grad():
                lp = actor.compute_logprobs(RolloutBatch(samples))
            times.append(time.perf_counter() - t0)
        actor.close()
        out[name] = (tokens / float(np.median(times)), lp)
    return tokens, out


def actor_table(args) -> None:
    from megatron_m2po.utils.dist_testing import run_distributed

    with tempfile.TemporaryDirectory() as root:
        (tokens, out), = run_distributed(_actor_bench, 1, args=(root, args), timeout_s=1200)
    (pad_tps, pad_lp), (pk_tps, pk_lp) = out["padded mbs=4"], out["packed"]
    err = max(float(np.abs(a - b).max()) for a, b in zip(pad_lp, pk_lp))
    print(f"# tiny actor on CPU, {tokens} tokens per pass, median of {args.repeat}")
    print(f"padded mbs=4: {pad_tps:,.0f} tokens/s; packed (budget {args.tiny_budget}): {pk_tps:,.0f} tokens/s "
          f"({pk_tps / pad_tps:.2f}x); max |log-prob difference| {err:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--per-prompt", type=int, default=8)
    ap.add_argument("--median", type=float, default=3500.0, help="median typical response length (tokens)")
    ap.add_argument("--max-len", type=int, default=15360, help="response length cap (tokens)")
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--actor", action="store_true", help="also time the tiny actor on CPU (part 2)")
    ap.add_argument("--tiny-median", type=float, default=60.0)
    ap.add_argument("--tiny-budget", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    plan_table(args)
    if args.actor:
        actor_table(args)


if __name__ == "__main__":
    main()
