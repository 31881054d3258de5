"""Update time of the exact global M2 mask: pre-pass vs correction, against the per-micro-batch cap rule.

Three ways to take M2PO's mask in one optimizer update, timed side by side on the tiny actor
(one process, ``--threads`` torch threads, CPU time of the process):

* (a) ``cap``: the released code's rule per micro-batch (``algo.m2po.rule=cap scope=microbatch``):
  no pre-pass, no correction -- the cost floor;
* (b) ``prepass``: the global mask (Algorithm 1 over the mini-batch) after a forward-only pre-pass
  (``mask_strategy=prepass``);
* (c) ``correct``: the same global mask with the previous update's cut as provisional mask and a
  forward-backward of the difference on only the changed sequences (``mask_strategy=correct``,
  ``actor/mask_correction.py``).

Data: the staleness_tiny regime (``examples/staleness_tiny.yaml``: the tiny base model, synthetic
arithmetic prompts, 16 prompts x 8 samples of at most 12 new tokens per update, packed micro-
batches of 2048 tokens, lr 2e-4, grad clip 1, tau = 0.04), replayed at staleness ``s``: one M2PO
trajectory trains update after update, and the mini-batch of update ``u`` carries the behaviour
log-probs of the weights of update ``u - s`` (the base model's for ``u < s``), as
``trainer.mode=stale_k`` hands them over. Responses are sampled once from the base model (HF
``generate``, temperature 1); rewards are 1 for the boxed right answer, GRPO advantages per prompt.
After ``s`` warm-up updates, each of ``--rounds`` rounds snapshots the actor (weights, Adam state,
LR schedule, version, the previous update's metrics), times (a), restores, times (b), restores,
times (c) and keeps (c) as the trajectory's update. Ratios are medians of the per-round ratios.

    python tools/benchmarks/global_mask.py                    # s = 0, 8, 32
    python tools/benchmarks/global_mask.py --staleness 0,4,16,32 --rounds 8
    python tools/benchmarks/global_mask.py parallel.max_tokens_per_microbatch=256   # ~6 micro-batches

The last line is ``ratio new/cap = X.XX, prepass/cap = Y.YY`` at the largest staleness.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import time

import numpy as np


def _sample_minibatches(hf_dir: str, n: int, args, seed: int):
    """``n`` mini-batches of ``Sample`` (versions 0, behaviour log-probs filled in later)."""
    import torch
    import transformers as tr

    from megatron_m2po.actor.batch import Sample
    from megatron_m2po.algo.advantages import grpo_advantages
    from megatron_m2po.data.synthetic import SyntheticTask
    from megatron_m2po.data.templates import render_prompt, tokenize_prompts

    tok = tr.AutoTokenizer.from_pretrained(hf_dir)
    model = tr.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    rows = SyntheticTask().generate(n * args.prompts, seed=seed)
    torch.manual_seed(seed)
    eos = tok.eos_token_id
    out = []
    for b in range(n):
        part = rows[b * args.prompts:(b + 1) * args.prompts]
        prompts = tokenize_prompts([render_prompt(r["problem"], "synthetic", tok) for r in part], "synthetic", tok)
        samples, rewards, groups = [], [], []
        for j, (row, ids) in enumerate(zip(part, prompts)):
            x = torch.tensor([ids] * args.per_prompt)
            with torch.no_grad():
                gen = model.generate(x, attention_mask=torch.ones_like(x), do_sample=True, temperature=1.0, top_k=0,
                                     top_p=1.0, max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                                     pad_token_id=tok.pad_token_id)
            for k in range(args.per_prompt):
                resp = gen[k, len(ids):].tolist()
                if eos in resp:
                    resp = resp[:resp.index(eos) + 1]
                text = tok.decode(resp, skip_special_tokens=True)
                rewards.append(float(f"\\boxed{{{row['answer']}}}" in text))
                groups.append(j)
                samples.append((ids, resp))
        adv = grpo_advantages(np.asarray(rewards), groups)
        out.append([Sample(uid=f"b{b}s{i}", prompt_ids=p, response_ids=r, behav_logprobs=np.zeros(len(r), np.float32),
                           advantages=np.float32(a), loss_mask=np.ones(len(r), np.uint8), versions=np.zeros(len(r)))
                    for i, ((p, r), a) in enumerate(zip(samples, adv))])
    return out


STRATEGIES = ("cap", "prepass", "correct")


def _set_strategy(actor, name: str) -> None:
    m = actor.cfg.algo.m2po  # the actor reads its settings at every update
    m.rule, m.scope = ("cap", "microbatch") if name == "cap" else ("remove", "global")
    m.mask_strategy = "prepass" if name == "cap" else name


def _bench(rank, world_size, args):
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "actor"))
    import actor_testlib as lib  # snapshot / restore of the actor's training state

    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.actor.batch import RolloutBatch
    from megatron_m2po.config import load_config
    from megatron_m2po.utils.hf_dir import resolve_model_path

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    hf_dir = resolve_model_path(cfg.model)
    levels = sorted(args.staleness)
    pool = _sample_minibatches(hf_dir, max(levels) + args.rounds, args, seed=args.seed)
    results = {}
    for s in levels:
        actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=1000))
        minis = copy.deepcopy(pool[:s + args.rounds])

        def set_behav(i):
            for smp, lp in zip(minis[i], actor.compute_logprobs(RolloutBatch(minis[i]))):
                smp.behav_logprobs = lp.astype(np.float32)

        for i in range(min(s + 1, len(minis))):  # the first s + 1 updates train on base-model rollouts
            set_behav(i)
        times = {k: [] for k in STRATEGIES}
        metrics = []
        for u in range(len(minis)):
            if u > 0 and u + s < len(minis) and s > 0:
                set_behav(u + s)  # sampled from the weights before update u, trained at update u + s
            if s == 0 and u > 0:
                set_behav(u)
            batch = RolloutBatch(minis[u])
            if u < s:  # warm-up along the exact trajectory, untimed
                _set_strategy(actor, "correct")
                actor.train_update(batch)
                continue
            snap = lib.snapshot(actor)
            for name in STRATEGIES:
                if name != STRATEGIES[0]:
                    lib.restore(actor, snap)
                _set_strategy(actor, name)
                t0 = time.process_time()  # CPU time of this process: other load moves it least
                m = actor.train_update(batch)
                times[name].append(time.process_time() - t0)
            metrics.append(m)  # the kept update is (c)'s
        tokens = float(np.mean([sum(x.length for x in mb) for mb in minis[s:]]))
        results["micro_batches"] = float(np.mean([len(actor._microbatches(mb, list(range(len(mb))))) for mb in minis]))
        actor.close()
        results[s] = (times, metrics, tokens)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/staleness_tiny.yaml")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. parallel.max_tokens_per_microbatch=256")
    ap.add_argument("--staleness", type=lambda v: [int(x) for x in v.split(",")], default=[0, 8, 32])
    ap.add_argument("--rounds", type=int, default=6, help="timed updates per staleness level")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per update (staleness_tiny: 16)")
    ap.add_argument("--per-prompt", type=int, default=8, help="samples per prompt (staleness_tiny: 8)")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    random.seed(args.seed)
    from megatron_m2po.standins.dist_testing import run_distributed

    (res,) = run_distributed(_bench, 1, args=(args,), timeout_s=7200)
    print(f"# tiny actor, {args.config} {' '.join(args.overrides)}: {args.prompts} x {args.per_prompt} "
          f"trajectories per update, {res['micro_batches']:.1f} micro-batches per update, "
          f"{args.threads} thread(s); CPU seconds per update, median of {args.rounds} interleaved rounds; "
          "ratios = median of per-round ratios to cap")
    print(f"{'s':>3}{'tokens':>8}{'mask frac':>11}{'cap s':>8}{'prepass s':>11}{'correct s':>11}"
          f"{'prepass/cap':>13}{'new/cap':>9}{'corr. mb':>10}{'corr. seq':>11}{'corr. tok':>11}")
    last = None
    for s, (times, metrics, tokens) in sorted((k, v) for k, v in res.items() if k != "micro_batches"):
        med = {k: float(np.median(v)) for k, v in times.items()}
        pre = float(np.median([b / a for a, b in zip(times["cap"], times["prepass"])]))
        new = float(np.median([c / a for a, c in zip(times["cap"], times["correct"])]))
        mean = lambda k: float(np.mean([m.get(k, 0.0) for m in metrics]))  # noqa: E731
        print(f"{s:>3}{tokens:>8.0f}{mean('m2po/mask_frac'):>10.3%}{med['cap']:>8.3f}{med['prepass']:>11.3f}"
              f"{med['correct']:>11.3f}{pre:>13.2f}{new:>9.2f}{mean('mask/corrected_microbatch_frac'):>10.1%}"
              f"{mean('mask/corrected_sequence_frac'):>11.2%}{mean('mask/correction_token_frac'):>11.2%}")
        last = (new, pre)
    print("# corr. mb: micro-batches holding a token whose keep changed; corr. seq / tok: sequences and tokens "
          "(prefixes up to the last changed token) the correction re-ran")
    print(f"ratio new/cap = {last[0]:.2f}, prepass/cap = {last[1]:.2f}")


if __name__ == "__main__":
    main()
