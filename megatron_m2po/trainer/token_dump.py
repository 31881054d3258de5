"""Token-level dumps of chosen training steps (``logging.dump_tokens_every``), for the paper's
Fig. 4b analysis (``m2po experiment entropy RUN_DIR``).

For every response token of a dumped step the file holds what the update saw: the policy's
entropy and log-prob at the weights of the update that trained the token, the behaviour log-prob,
the advantage, the token's staleness, and both trust-region decisions on the *same* data:

* ``grpo_clipped`` — the PPO clip with ``algo.grpo.eps_low / eps_high`` takes the token's gradient
  away: ``min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` picks the clipped branch strictly
  (``clipped < unclipped``, the same test as ``loss/clip_frac`` in ``algo/losses.py``);
* ``m2po_masked`` — ``algo.m2_mask.m2po_mask`` with ``algo.m2po.threshold`` / ``rule`` over the
  update's whole mini-batch (Algorithm 1, the global scope), recomputed here from the recorded
  log-ratios whatever loss the run trains with;
* ``keep`` — the mask the loss itself used (1 kept, 0 masked), -1 when the loss took none.

The values come from :attr:`MegatronActor.token_hook`, which the actor calls with a
:class:`~megatron_m2po.actor.global_mask.TokenRecord` per training micro-batch: its detached
log-probs, entropies and the mask the loss finally used. Only ranks of the last pipeline stage with
tensor-parallel rank 0 record (the other TP ranks hold the same values); each records its
data-parallel shard, and :meth:`TokenDump.write` gathers the shards on global rank 0 by canonical
token index. A dump keeps at most ``logging.dump_tokens_max`` tokens (a uniform subset seeded by
the run seed and the step), so its size is bounded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_m2po.actor.batch import RolloutBatch
from megatron_m2po.actor.global_mask import TokenRecord
from megatron_m2po.config import Config

__all__ = ["TokenDump", "grpo_clipped", "m2po_masked", "read_token_dump"]

FIELDS = ("update", "sample", "pos", "token", "staleness", "logp", "behav_logp", "logratio", "entropy",
          "advantage", "grpo_clipped", "m2po_masked", "keep")


def grpo_clipped(logratio: np.ndarray, adv: np.ndarray, eps_low: float, eps_high: float) -> np.ndarray:
    """Tokens whose PPO-clip objective takes the clipped branch (their gradient is removed)."""
    r = np.exp(logratio.astype(np.float64))
    a = adv.astype(np.float64)
    return np.clip(r, 1.0 - eps_low, 1.0 + eps_high) * a < r * a


def m2po_masked(logratio: np.ndarray, adv: np.ndarray, valid: np.ndarray, threshold: float, rule: str) -> np.ndarray:
    """Valid tokens that M2PO's mask over these tokens (one mini-batch, canonical order) removes."""
    from megatron_m2po.algo.m2_mask import m2po_mask

    keep, _ = m2po_mask(torch.from_numpy(logratio.astype(np.float64)), torch.from_numpy(adv.astype(np.float64)),
                        torch.from_numpy(valid.astype(bool)), threshold=threshold, rule=rule,
                        order_key=torch.arange(len(logratio), dtype=torch.int64))
    return valid.astype(bool) & ~keep.numpy()


class TokenDump:
    """Records the per-token values of the updates of a dumped step and writes them.

    Collective: every rank calls :meth:`begin`, :meth:`end_update` and :meth:`write` in the same
    order (the gathers in :meth:`write` span the whole job).
    """

    def __init__(self, cfg: Config, actor, run_dir: Path) -> None:
        self.cfg = cfg
        self.every = cfg.logging.dump_tokens_every
        self.max_tokens = cfg.logging.dump_tokens_max
        self.actor = actor
        self.dir = Path(run_dir) / "tokens"
        self.records = actor.is_last_stage and actor.tp_rank == 0
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, Optional[np.ndarray]]] = []
        self._updates: list[dict[str, np.ndarray]] = []
        self._step: Optional[int] = None

    def wants(self, step: int) -> bool:
        return self.every > 0 and (step + 1) % self.every == 0

    def begin(self, step: int) -> None:
        """Start recording the updates of ``step``."""
        self._step, self._updates = step, []
        if self.records:
            self.actor.observe_tokens(self._hook)

    def _hook(self, rec: TokenRecord) -> None:
        self._parts.append((rec.mb.token_index.cpu().numpy(), rec.logp.float().cpu().numpy(),
                            rec.entropy.float().cpu().numpy(), None if rec.keep is None else rec.keep.cpu().numpy()))

    def end_update(self, mini: RolloutBatch, update: int, first_sample: int) -> None:
        """The update ``update`` (its weight version before the step) over ``mini`` has run."""
        parts, self._parts = self._parts, []
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            gathered: list = [None] * world if dist.get_rank() == 0 else None
            dist.gather_object(parts, gathered, dst=0)
            parts = [p for ps in (gathered or []) for p in ps]
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        self._updates.append(self._assemble(mini, update, first_sample, parts))

    def _assemble(self, mini: RolloutBatch, update: int, first_sample: int, parts: list) -> dict[str, np.ndarray]:
        s = mini.samples
        n = sum(x.response_ids.shape[0] for x in s)
        logp = np.full(n, np.nan, np.float32)
        ent = np.full(n, np.nan, np.float32)
        keep = np.full(n, -1, np.int8)
        for idx, lp, e, k in parts:
            logp[idx], ent[idx] = lp, e
            if k is not None:
                keep[idx] = k.astype(np.int8)
        if np.isnan(logp).any():
            raise RuntimeError(f"token dump: {int(np.isnan(logp).sum())} of {n} tokens of update {update} were "
                               "not recorded by any rank")
        cat = lambda name: np.concatenate([getattr(x, name) for x in s])  # noqa: E731
        behav, adv, valid = cat("behav_logprobs").astype(np.float32), cat("advantages").astype(np.float32), \
            cat("loss_mask").astype(bool)
        a = self.cfg.algo
        logratio = np.clip(logp - behav, -a.logratio_clamp, a.logratio_clamp)
        clipped = grpo_clipped(logratio, adv, a.grpo.eps_low, a.grpo.eps_high) & valid
        masked = m2po_masked(logratio, adv, valid, a.m2po.threshold, a.m2po.rule)
        return {
            "update": np.full(n, update, np.int32),
            "sample": np.concatenate([np.full(x.response_ids.shape[0], first_sample + i, np.int32)
                                      for i, x in enumerate(s)]),
            "pos": np.concatenate([np.arange(x.response_ids.shape[0], dtype=np.int32) for x in s]),
            "token": cat("response_ids").astype(np.int32),
            "staleness": (update - cat("versions")).astype(np.int32),
            "logp": logp, "behav_logp": behav, "logratio": logratio.astype(np.float32), "entropy": ent,
            "advantage": adv, "grpo_clipped": clipped, "m2po_masked": masked, "keep": keep, "valid": valid}

    def write(self) -> Optional[Path]:
        """Rank 0: the step's response tokens with ``loss_mask`` (at most ``dump_tokens_max``) as one ``.npz``."""
        self.actor.observe_tokens(None)
        step, updates, self._updates = self._step, self._updates, []
        if not updates:
            return None
        data = {k: np.concatenate([u[k] for u in updates]) for k in updates[0]}
        valid = data.pop("valid")
        data = {k: v[valid] for k, v in data.items()}
        n = len(data["update"])
        if n > self.max_tokens:
            rng = np.random.default_rng([self.cfg.trainer.seed, step])
            pick = np.sort(rng.choice(n, self.max_tokens, replace=False))
            data = {k: v[pick] for k, v in data.items()}
        a = self.cfg.algo
        meta = {"step": step, "loss": a.loss, "eps_low": a.grpo.eps_low, "eps_high": a.grpo.eps_high,
                "m2po_threshold": a.m2po.threshold, "m2po_rule": a.m2po.rule, "tokens_total": n,
                "stale_k": self.cfg.trainer.stale_k if self.cfg.trainer.mode == "stale_k" else 0}
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"step_{step:06d}.npz"
        tmp = path.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, **data, **{f"meta_{k}": np.asarray(v) for k, v in meta.items()})
        tmp.replace(path)
        return path


def read_token_dump(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """(per-token arrays, metadata) of one dump file."""
    with np.load(path) as z:
        data = {k: z[k] for k in z.files if not k.startswith("meta_")}
        meta = {k[5:]: z[k].item() for k in z.files if k.startswith("meta_")}
    return data, meta
