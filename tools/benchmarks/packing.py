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

Part 2 (``--actor``): the tiny actor on CPU (one process, one thread by default): tokens per CPU
second of ``compute_logprobs`` (forward) and ``train_update`` (forward + backward + optimizer),
padded at micro-batch size 4 against packed token budgets (``--tiny-budgets``), on 128 samples of
the same distribution with every length scaled down to the tiny model's context
(``--tiny-median``; the padding fraction of mbs=4 is printed), with the log-probs of every layout
compared. The layouts take turns within each round (``--repeat`` rounds), so load from other
processes hits them alike; CPU time of the process is what is measured, which that load moves
least. A padded micro-batch of 4 needs activations for up to 4 x the longest sequence (~930 tokens
here): budget 1024 is the same memory, 2048 twice it. On CPU both layouts run the same fused
causal attention kernel (``actor/attention.py``); packing saves the padding rows of every layer
and most of the per-micro-batch overhead.

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


def tiny_lengths(rng, args) -> list[tuple[int, int]]:
    """Part 2's samples: 16 prompts x 8 samples from the same distribution with every length
    (prompt range, median response, cap) scaled by ``tiny_median / median``, so that the shape,
    and with it the padding fraction, is the stated one at the tiny model's context."""
    scale = args.tiny_median / args.median
    out = []
    for p, r in lengths_of_update(rng, 16, 8, args.tiny_median, max(16, round(args.max_len * scale))):
        out.append((max(1, round(p * scale)), r))
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

    torch.set_num_threads(args.threads)
    d = lib.make_tiny_hf("qwen3", os.path.join(root, "m"), seed=0)
    rng = np.random.default_rng(args.seed)
    pr = tiny_lengths(rng, args)
    samples = [Sample(uid=f"s{i}", prompt_ids=rng.integers(0, 128, p), response_ids=rng.integers(0, 128, r),
                      behav_logprobs=np.zeros(r, np.float32), advantages=np.float32(rng.normal()),
                      loss_mask=np.ones(r, np.uint8), versions=np.zeros(r, np.int64)) for i, (p, r) in enumerate(pr)]
    tokens = sum(s.length for s in samples)
    lengths = [s.length for s in samples]
    padded_rows = sum(4 * max(lengths[k:k + 4]) for k in range(0, len(lengths), 4))
    layouts = [("padded mbs=4", False, None)] + [(f"packed {b} tokens", True, b) for b in args.tiny_budgets]
    actors = {}
    for name, packing, budget in layouts:
        cfg = lib.actor_config(d, mbs=4, loss="grpo", lr=0.0)
        cfg.parallel.packing, cfg.parallel.max_tokens_per_microbatch = packing, budget
        actors[name] = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=1))
        actors[name].compute_logprobs(RolloutBatch(samples[:8]))  # warm-up
    cpu = {(n, w): [] for n, *_ in layouts for w in ("logprobs", "train")}
    lps = {}
    # rounds interleave the layouts, so a change of machine load hits all of them alike;
    # time is this process's CPU time (one thread), which other processes' load moves least
    for _ in range(args.repeat):
        for name, *_ in layouts:
            t0 = time.process_time()
            with torch.no_grad():
                lps[name] = actors[name].compute_logprobs(RolloutBatch(samples))
            t1 = time.process_time()
            actors[name].train_update(RolloutBatch(samples))
            t2 = time.process_time()
            cpu[(name, "logprobs")].append(t1 - t0)
            cpu[(name, "train")].append(t2 - t1)
    for a in actors.values():
        a.close()
    return tokens, 1 - tokens / padded_rows, [n for n, *_ in layouts], cpu, lps


def actor_table(args) -> None:
    from megatron_m2po.standins.dist_testing import run_distributed

    with tempfile.TemporaryDirectory() as root:
        (tokens, waste, names, cpu, lps), = run_distributed(_actor_bench, 1, args=(root, args), timeout_s=1800)
    base = names[0]
    print(f"\n# tiny actor on CPU (Qwen3-shaped, 2 layers, hidden 64), {tokens} tokens per pass: 128 sequences "
          f"of the distribution above scaled by {args.tiny_median / args.median:.4f} (padded mbs=4 rows: "
          f"{waste:.1%} padding); {args.threads} thread(s)")
    print(f"# tokens per CPU second, median of {args.repeat} interleaved rounds; speed-up = median of the "
          f"per-round ratios to {base}")
    print(f"{'layout':<22}{'log-probs tok/s':>17}{'speed-up':>10}{'train tok/s':>14}{'speed-up':>10}"
          f"{'max |dlogp|':>13}")
    for n in names:
        row = f"{n:<22}"
        for w in ("logprobs", "train"):
            tps = tokens / float(np.median(cpu[(n, w)]))
            ratio = float(np.median([b / a for a, b in zip(cpu[(n, w)], cpu[(base, w)])]))
            row += f"{tps:>17,.0f}{ratio:>9.2f}x" if w == "logprobs" else f"{tps:>14,.0f}{ratio:>9.2f}x"
        err = max(float(np.abs(a - b).max()) for a, b in zip(lps[n], lps[base]))
        print(row + f"{err:>13.1e}")


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
    ap.add_argument("--tiny-median", type=float, default=50.0,
                    help="median typical response of part 2 (tokens; the tiny model holds 256 positions)")
    ap.add_argument("--tiny-budgets", type=lambda v: [int(x) for x in v.split(",")], default=[1024, 2048],
                    help="packed token budgets to time against padded mbs=4 (comma-separated)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the timed process")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    plan_table(args)
    if args.actor:
        actor_table(args)


if __name__ == "__main__":
    main()
