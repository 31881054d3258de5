"""Effective staleness, measured independently of any method (docs/measurements/drift_ladder).

``m2po experiment drift RUN_DIR --ks 8,32,128`` reads the checkpoints of an on-policy run and
computes, for every ``k`` and every version ``v`` (a multiple of ``--every`` with ``v - k`` also
checkpointed), ``KL(pi_{v-k} || pi_v)`` on a fixed prompt set: responses sampled from
``pi_{v-k}`` (temperature 1, ``--samples`` per prompt, a fixed seed), the KL per response token
estimated as the mean of ``log pi_{v-k}(y_t) - log pi_v(y_t)`` over those tokens (unbiased for
sampled tokens). D(k) is its mean over ``v``: how far the policy moves in ``k`` updates, the
x-axis of the staleness figures. It depends on the on-policy run only, so every method at a given
``k`` sits at the same D(k).

Checkpoints are read with the actor (any layout they were written with) and exported to HF once
each (``<out>/hf/v<version>``, reused), then sampled and scored with transformers: one process,
one actor.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["checkpoint_versions", "export_versions", "response_kl", "run_drift"]


def checkpoint_versions(ckpt_dir: Path) -> dict[int, Path]:
    """``{version: checkpoint directory}`` of the complete checkpoints under ``ckpt_dir``."""
    out: dict[int, Path] = {}
    for d in sorted(Path(ckpt_dir).glob("step_*")):
        meta = d / "actor.json"
        if d.is_dir() and not d.name.endswith(".tmp") and meta.is_file():
            out[int(json.loads(meta.read_text())["version"])] = d
    return out


def export_versions(ckpts: dict[int, Path], versions: Sequence[int], out_dir: Path) -> dict[int, Path]:
    """Each of ``versions`` as an HF directory under ``out_dir`` (written once; one actor loads them all)."""
    todo = [v for v in sorted(set(versions)) if not (out_dir / f"v{v}" / "config.json").is_file()]
    if todo:
        from megatron_m2po.actor.actor import MegatronActor
        from megatron_m2po.weights.convert import actor_config
        from megatron_m2po.weights.hf_export import export_hf

        meta = json.loads((ckpts[todo[0]] / "actor.json").read_text())
        actor = MegatronActor.from_config(actor_config(meta["hf_path"], 1, 1, "float32", meta.get("lora")))
        try:
            for v in todo:
                actor.load_checkpoint(str(ckpts[v]), model_only=True)
                export_hf(actor, str(out_dir / f"v{v}"))
        finally:
            actor.close()
    return {v: out_dir / f"v{v}" for v in versions}


def response_kl(old_dir: Path, new_dir: Path, prompts: Sequence[Sequence[int]], *, samples: int, seed: int,
                max_new_tokens: int, batch: int = 64) -> tuple[float, int]:
    """``(mean over sampled response tokens of log pi_old - log pi_new, number of tokens)``: responses
    sampled from ``old_dir``'s model at temperature 1 (no top-k / top-p), ``samples`` per prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(str(old_dir), dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(str(new_dir), dtype=torch.float32).eval()
    eos = old.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) - {None}
    pad = 0
    gen = torch.Generator().manual_seed(seed)
    total, count = 0.0, 0
    rows = [list(p) for p in prompts for _ in range(samples)]
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            chunk = rows[i:i + batch]
            seqs = [list(r) for r in chunk]
            resp: list[list[float]] = [[] for _ in chunk]
            done = [False] * len(chunk)
            for _ in range(max_new_tokens):  # plain ancestral sampling: temperature 1, nothing truncated
                width = max(map(len, seqs))
                ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
                att = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
                pos = (att.cumsum(-1) - 1).clamp(min=0)
                lp_old = torch.log_softmax(old(ids, attention_mask=att, position_ids=pos).logits[:, -1].float(), -1)
                tok = torch.multinomial(lp_old.exp(), 1, generator=gen).squeeze(-1)
                lp_new = torch.log_softmax(new(ids, attention_mask=att, position_ids=pos).logits[:, -1].float(), -1)
                for j, t in enumerate(tok.tolist()):
                    if done[j]:
                        continue
                    seqs[j].append(t)
                    resp[j].append(float(lp_old[j, t] - lp_new[j, t]))
                    done[j] = t in eos
                if all(done):
                    break
            for r in resp:
                total += sum(r)
                count += len(r)
    return (total / count if count else math.nan), count


def run_drift(run_dir: Path, ks: Sequence[int], *, every: int, prompts: Sequence[Sequence[int]], samples: int,
              seed: int, max_new_tokens: int, out_dir: Path) -> dict:
    """Per ``k``: every ``(v, KL)`` and their mean D(k) (module docstring); also written to
    ``<out_dir>/drift.json``."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    ckpts = checkpoint_versions(run_dir / "checkpoints")
    if not ckpts:
        raise ValueError(f"{run_dir} has no complete checkpoints under checkpoints/: run the on-policy arm with "
                         "checkpoint.save_every_steps small enough and checkpoint.keep_last large enough to keep them")
    pairs = {k: [(v, v - k) for v in sorted(ckpts) if v > 0 and v % every == 0 and (v - k) in ckpts]
             for k in ks}
    missing = [k for k, p in pairs.items() if not p]
    if missing:
        raise ValueError(f"no version pair v, v - k is checkpointed for k in {missing} (checkpointed versions: "
                         f"{sorted(ckpts)[:6]}...): save checkpoints every gcd of the k values")
    hf = export_versions(ckpts, sorted({v for p in pairs.values() for pair in p for v in pair}), out_dir / "hf")
    result: dict = {"run_dir": str(run_dir), "every": every, "samples": samples, "seed": seed, "k": {}}
    for k, ps in pairs.items():
        rows = []
        for v, u in ps:
            kl, n = response_kl(hf[u], hf[v], prompts, samples=samples, seed=seed + v, max_new_tokens=max_new_tokens)
            rows.append({"v": v, "kl": kl, "tokens": n})
        result["k"][str(k)] = {"pairs": rows, "mean_kl": sum(r["kl"] for r in rows) / len(rows)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "drift.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _held_out_prompts(run_dir: Path, limit: Optional[int]) -> tuple[list[list[int]], int]:
    """The run's held-out prompts (its config's evaluation set) as token ids, and its max_new_tokens."""
    from transformers import AutoTokenizer

    from megatron_m2po.config import load_config
    from megatron_m2po.data.dataset import build_eval_sets

    cfg = load_config(str(Path(run_dir) / "config.yaml"))
    meta = json.loads(next(iter(checkpoint_versions(Path(run_dir) / "checkpoints").values())).joinpath(
        "actor.json").read_text())
    tok = AutoTokenizer.from_pretrained(meta["hf_path"])
    sets = build_eval_sets(cfg.data, tok, cfg.trainer.seed)
    if not sets:
        raise ValueError(f"{run_dir}'s config has no held-out prompt set (data.synthetic_eval_size or data.eval)")
    items = next(iter(sets.values()))
    items = items[:limit] if limit else items
    return [list(i.prompt_ids) for i in items], int(cfg.rollout.max_new_tokens)


def register(esub: argparse._SubParsersAction) -> None:
    d = esub.add_parser("drift", help="KL(pi_{v-k} || pi_v) of an on-policy run from its checkpoints: the "
                                      "effective staleness of k updates (docs/measurements/drift_ladder).")
    d.add_argument("run_dir", help="an on-policy run directory (with checkpoints/ and config.yaml)")
    d.add_argument("--ks", required=True, help="staleness values, e.g. 8,32,128")
    d.add_argument("--every", type=int, default=32, help="versions v that are multiples of this (default 32)")
    d.add_argument("--samples", type=int, default=2, help="responses per prompt (default 2)")
    d.add_argument("--prompts", type=int, default=None, help="the first N held-out prompts (default all)")
    d.add_argument("--seed", type=int, default=0, help="sampling seed (default 0; version v uses seed + v)")
    d.add_argument("--out", default=None, help="output directory (default <run_dir>/drift)")
    d.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from megatron_m2po.utils.settings import ConfigError

    run_dir = Path(args.run_dir)
    try:
        ks = [int(x) for x in str(args.ks).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--ks={args.ks!r}: comma-separated integers, e.g. 8,32,128") from None
    prompts, max_new = _held_out_prompts(run_dir, args.prompts)
    out = Path(args.out) if args.out else run_dir / "drift"
    res = run_drift(run_dir, ks, every=args.every, prompts=prompts, samples=args.samples, seed=args.seed,
                    max_new_tokens=max_new, out_dir=out)
    for k, r in res["k"].items():
        print(f"k={k}: D(k) = {r['mean_kl']:.3e} over {len(r['pairs'])} version pairs")
    print(f"written: {out / 'drift.json'}")
    return 0
