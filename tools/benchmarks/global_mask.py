"""Update time of the exact global M2 mask: pre-pass vs correction, against the per-micro-batch cap rule.

Three ways to take M2PO's mask in one optimizer update, timed side by side on the tiny actor
(one process, ``--threads`` torch threads, CPU time of the process):

* (a) ``cap``: the released code's rule per micro-batch (``algo.m2po.rule=cap scope=microbatch``):
  no pre-pass, no correction -- the cost floor;
* (b) ``prepass``: the global mask (Algorithm 1 over the mini-batch) after a forward-only pre-pass
  (``mask_strategy=prepass``);
* (c) ``correct``: the same global mask with a running estimate as provisional mask and a
  forward-backward of the difference on only the changed sequences (``mask_strategy=correct``,
  ``actor/mask_correction.py``; what ``auto`` takes while it is the cheaper).

Data: mini-batches of the staleness experiment, replayed. ``--record`` runs the M2PO arm of
``m2po experiment staleness`` (``examples/staleness_tiny.yaml``: the tiny base model, synthetic
arithmetic prompts on the CPU engine behind the router, 16 prompts x 8 samples per update,
``trainer.mode=stale_k``) at each staleness ``s`` in-process, and saves the first ``--rounds``
mini-batches the actor trains after its ``s`` warm-up updates -- as the trainer hands them over
(global plan and samples with their behaviour log-probs from the weights of ``s`` updates
before), each with the actor's weights at that update -- to ``--fixture`` (``s<S>_r<R>.pt``).
Without ``--record`` the levels missing from the fixture are recorded first (one subprocess
each). The replay loads each update's weights, then times (a), (b) and (c) from the same state
(weights, fresh Adam, LR schedule) in interleaved order; ratios are medians of the per-update
ratios to (a). Config overrides apply to the replay only (the mini-batches are the experiment's).

    python tools/benchmarks/global_mask.py                    # s = 0, 8, 32
    python tools/benchmarks/global_mask.py --staleness 0,4,16,32 --rounds 8
    python tools/benchmarks/global_mask.py parallel.max_tokens_per_microbatch=256   # ~6 micro-batches

The last line is ``ratio new/cap = X.XX, prepass/cap = Y.YY`` at the largest staleness.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _fixture_path(args, s: int) -> str:
    return os.path.join(os.path.expanduser(args.fixture), f"s{s}_r{args.rounds}.pt")


def _record(args, s: int) -> None:
    """Run the staleness experiment's M2PO arm at staleness ``s`` just long enough and save the
    mini-batches of updates ``s .. s + rounds - 1`` with the weights each was trained from."""
    import torch

    from megatron_m2po.config import load_config
    from megatron_m2po.trainer.loop import Trainer

    base = load_config(args.config)
    per_step = base.trainer.num_updates_per_step
    steps = -(-(s + args.rounds) // per_step)
    with tempfile.TemporaryDirectory() as run_dir:
        # the overrides m2po experiment staleness gives its M2PO arm (experiment/runner.py), and a short run
        cfg = load_config(args.config, [
            "trainer.mode=stale_k", f"trainer.stale_k={s}", "algo.loss=m2po",
            f"store.max_staleness={max(base.store.max_staleness, s + per_step - 1)}", f"trainer.run_dir={run_dir}",
            "logging.progress=false", f"trainer.num_steps={steps}", "trainer.eval_every_steps=0",
            "checkpoint.save_every_steps=0", "checkpoint.export_hf_at_end=false"])
        trainer = Trainer(cfg)
        actor, out = trainer.actor, []
        train_update = actor.train_update

        def recording(mini):
            if actor.version >= s and len(out) < args.rounds:
                out.append((copy.deepcopy(mini), [p.detach().clone() for m in actor.model for p in m.parameters()]))
            return train_update(mini)

        actor.train_update = recording
        trainer.run()
    if len(out) < args.rounds:
        raise RuntimeError(f"staleness {s}: recorded {len(out)} of {args.rounds} updates")
    path = _fixture_path(args, s)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"config": args.config, "staleness": s, "updates": out}, path + ".tmp")
    os.replace(path + ".tmp", path)


STRATEGIES = ("cap", "prepass", "correct")


def _set_strategy(actor, name: str) -> None:
    m = actor.cfg.algo.m2po  # the actor reads its settings at every update
    m.rule, m.scope = ("cap", "microbatch") if name == "cap" else ("remove", "global")
    m.mask_strategy = "prepass" if name == "cap" else name


def _bench(rank, world_size, args):
    import torch

    sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "actor"))
    import actor_testlib as lib  # snapshot / restore of the actor's training state

    from megatron_m2po.actor.actor import ActorConfig, MegatronActor
    from megatron_m2po.config import load_config

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    results = {}
    for s in sorted(args.staleness):
        fixture = torch.load(_fixture_path(args, s), weights_only=False)
        actor = MegatronActor.from_config(ActorConfig.from_config(cfg, total_updates=1000))
        times = {k: [] for k in STRATEGIES}
        metrics, tokens, n_mb = [], [], []
        for mini, weights in fixture["updates"]:
            with torch.no_grad():
                for p, w in zip((p for m in actor.model for p in m.parameters()), weights):
                    p.copy_(w)
            snap = lib.snapshot(actor)
            for name in STRATEGIES:
                lib.restore(actor, snap)
                _set_strategy(actor, name)
                t0 = time.process_time()  # CPU time of this process: other load moves it least
                m = actor.train_update(mini)
                times[name].append(time.process_time() - t0)
                if name == "correct":
                    metrics.append(m)
            tokens.append(float(mini.plan.lengths.sum()))
            n_mb.append(len(actor._microbatches(mini.samples, actor.shards(mini.plan)[0], mini.plan)))
        actor.close()
        results[s] = (times, metrics, float(np.mean(tokens)), float(np.mean(n_mb)))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/staleness_tiny.yaml")
    ap.add_argument("overrides", nargs="*", help="config overrides of the replay, e.g. "
                    "parallel.max_tokens_per_microbatch=256")
    ap.add_argument("--staleness", type=lambda v: [int(x) for x in v.split(",")], default=[0, 8, 32])
    ap.add_argument("--rounds", type=int, default=6, help="recorded (and timed) updates per staleness level")
    ap.add_argument("--fixture", default="~/.cache/megatron_m2po/global_mask_fixture",
                    help="directory of the recorded mini-batches")
    ap.add_argument("--record", type=int, default=None, metavar="S", help="only record staleness S, then exit")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.record is not None:
        _record(args, args.record)
        return
    for s in args.staleness:
        if not os.path.isfile(_fixture_path(args, s)):
            print(f"# recording staleness {s} (the experiment's M2PO arm, {args.config}) ...", flush=True)
            subprocess.run([sys.executable, os.path.abspath(__file__), "--config", args.config, "--rounds",
                            str(args.rounds), "--fixture", args.fixture, "--record", str(s)], check=True)
    from megatron_m2po.standins.dist_testing import run_distributed

    (res,) = run_distributed(_bench, 1, args=(args,), timeout_s=7200)
    print(f"# tiny actor, {args.config} {' '.join(args.overrides)}: mini-batches of the staleness experiment's "
          f"M2PO arm, {args.threads} thread(s); CPU seconds per update, median of {args.rounds} updates, each timed "
          "(a), (b), (c) from the same state; ratios = median of per-update ratios to cap")
    print(f"{'s':>3}{'tokens':>8}{'mb/upd':>8}{'mask frac':>11}{'cap s':>8}{'prepass s':>11}{'correct s':>11}"
          f"{'prepass/cap':>13}{'new/cap':>9}{'corr. mb':>10}{'corr. seq':>11}{'corr. tok':>11}")
    last = None
    for s, (times, metrics, tokens, n_mb) in sorted(res.items()):
        med = {k: float(np.median(v)) for k, v in times.items()}
        pre = float(np.median([b / a for a, b in zip(times["cap"], times["prepass"])]))
        new = float(np.median([c / a for a, c in zip(times["cap"], times["correct"])]))
        mean = lambda k: float(np.mean([m.get(k, 0.0) for m in metrics]))  # noqa: E731
        print(f"{s:>3}{tokens:>8.0f}{n_mb:>8.1f}{mean('m2po/mask_frac'):>10.3%}{med['cap']:>8.3f}"
              f"{med['prepass']:>11.3f}{med['correct']:>11.3f}{pre:>13.2f}{new:>9.2f}"
              f"{mean('mask/corrected_microbatch_frac'):>10.1%}{mean('mask/corrected_sequence_frac'):>11.2%}"
              f"{mean('mask/correction_token_frac'):>11.2%}")
        last = (new, pre)
    print("# corr. mb: micro-batches holding a token whose keep changed; corr. seq / tok: sequences and tokens "
          "(prefixes up to the last changed token) the correction re-ran")
    print(f"ratio new/cap = {last[0]:.2f}, prepass/cap = {last[1]:.2f}")


if __name__ == "__main__":
    main()
