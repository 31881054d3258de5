"""The M2PO token mask (arXiv 2510.01161): paper Algorithm 1 and the released code's cap rule.

Mapping to the paper (docs/design.md §3):

* ``delta_i = logp_theta_i - logp_behav_i`` is upcast to float64 and clamped to [-20, 20]
  (squares of float32 numbers are exact in float64, so v = delta^2 introduces no rounding and no
  artificial ties).
* Trust-region tokens ``T = {valid and ((A > 0 and delta > 0) or (A < 0 and delta < 0))}``:
  the tokens whose update would move the ratio further in the direction the advantage pushes.
  Tokens outside T are never masked. ``v_i = delta_i^2`` on T.
* ``rule="remove"`` (default, Algorithm 1): remove the largest v one at a time until the mean of
  the *remaining* v is <= tau. Equivalently: sort ascending and keep the longest prefix whose mean
  is <= tau (prefix means of an ascending sequence never decrease, so this prefix is unique).
  An empty T masks nothing; if even the smallest v exceeds tau every T token is masked; tau = 0
  masks every T token (T tokens have v > 0).
* Ties at the boundary: when the cut falls inside a run of equal v, the copies with the
  **lowest** ``order_key`` are kept (the highest keys are removed first). ``order_key`` is a
  global canonical int64 per token (e.g. sample index * max_len + position); by default the token
  order of the concatenation of ranks 0, 1, ... (local index within a rank). Keys of the tied
  tokens must be distinct, else ValueError.
* ``rule="cap"`` (the released code, ``kpo_clip_harmful_tokens`` + ``compute_m2po_policy_loss``
  in Infini-AI-Lab/M2PO): the cap ``c`` is the largest v of T with
  ``mean_T(min(v, c)) <= tau``; the loss then PPO-clips at ``exp(+-sqrt(c))``, which zeroes the
  gradient exactly of the T tokens with ``v > c`` -- those are the masked tokens here. If no v of
  T satisfies the budget, c = 0 and every T token is masked (the released code clips them all).
  Where ours differs from the released code: (1) we decide with exact fixed-point sums and ``<=``
  where it uses float sums with 1e-12 slacks, so a token whose v equals c is kept here (there its
  fate depends on fp32 rounding of ``exp(sqrt(c - 1e-12))``); (2) its optional ``miniclip``
  widening (off in its published scripts) is not applied; (3) it takes the sign of the advantage
  from the first response token, we take it per token (identical for GRPO); (4) with ``group``
  the cap is global, whereas the released code computes it per micro-batch per rank -- pass
  ``group=None`` per micro-batch to reproduce that scope (``algo.m2po.scope=microbatch``).
  Its logged "M2_after" is the capped mean ``mean_T(min(v, c))``; our ``m2_after`` is the mean
  over the kept T tokens for both rules.

Distributed (``group`` spans the data x context parallel ranks -- never tensor-parallel copies of
the same tokens): the result equals the single-process mask on the concatenation of every rank's
tokens, bit for bit, using ``parallel.selection`` (exact fixed-point int64 sums, radix search over
the float64 bit pattern). Collectives per call: 1 all-reduce of 5 int64 (totals), then only if
the total mean exceeds tau 7 all-reduces of 16 KiB (radix rounds), then only if the cut falls
inside a run of ties either 1 all-gather of one int per rank (default keys) or 8 all-reduces of
2 KiB (``order_key`` radix select), and finally 1 all-reduce (max) of one float64 -- independent
of the number of tokens. Every rank must call with the same arguments except the tensors.

AReaL's variant (``algo.loss=areal_m2po``, AReaL PR 480 ``get_m2po_loss_mask``) is
``region="all", keep_one=True``: the candidates are all valid tokens (no trust region), and when
even the smallest ``v`` exceeds tau the single smallest one is kept (lowest ``order_key`` among
ties) instead of masking them all. AReaL stops at the first suffix mean ``< tau``; here ``<= tau``
(they differ only when a mean equals tau exactly).

Exactness: "mean <= tau" is decided on fixed-point sums (2**-84 resolution, values rounded up,
tau rounded down; see ``parallel/selection.py``), which can differ from exact real arithmetic
only when a mean lies within 2**-84 below tau.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_m2po.algo.metrics import Metric
from megatron_m2po.parallel import selection as sel

DELTA_CLAMP = 20.0
RULES = ("remove", "cap")


@dataclass(frozen=True)
class M2Stats:
    """Global (with ``group``) statistics of one mask computation."""

    m2_before: float  # mean v over T (0 when T is empty)
    m2_after: float  # mean v over the kept T tokens (0 when none kept)
    mask_frac: float  # masked tokens / valid tokens
    threshold_value: float  # largest kept v (0 when none kept); for rule="cap" this is the cap c
    n_trust: int  # |T|
    n_masked: int
    n_valid: int
    rule: str = "remove"

    def as_metrics(self, prefix: str = "m2po/", global_scope: bool = True) -> dict[str, Metric]:
        """Metric records: global stats are equal on every rank (reduce "max" is idempotent);
        per-rank stats (``global_scope=False``) reduce as token-weighted means / sums."""
        if global_scope:
            vals = dict(mask_frac=self.mask_frac, m2_before=self.m2_before, m2_after=self.m2_after,
                        threshold_value=self.threshold_value, n_trust=self.n_trust, n_masked=self.n_masked)
            return {prefix + k: Metric(float(v), "max") for k, v in vals.items()}
        return {
            prefix + "mask_frac": Metric(self.mask_frac, "mean", weight=self.n_valid),
            prefix + "m2_before": Metric(self.m2_before, "mean", weight=self.n_trust),
            prefix + "m2_after": Metric(self.m2_after, "mean", weight=self.n_trust - self.n_masked),
            prefix + "threshold_value": Metric(self.threshold_value, "max"),
            prefix + "n_trust": Metric(float(self.n_trust), "sum"),
            prefix + "n_masked": Metric(float(self.n_masked), "sum"),
        }


def trust_region(delta: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """T = valid & ((A > 0 & delta > 0) | (A < 0 & delta < 0))."""
    return valid & (((advantages > 0) & (delta > 0)) | ((advantages < 0) & (delta < 0)))


def _validate(delta, advantages, valid, threshold, rule, order_key):
    if rule not in RULES:
        raise ValueError(f"m2po_mask: rule={rule!r}; use one of {RULES}")
    if not (isinstance(threshold, (int, float)) and threshold >= 0 and threshold == threshold
            and threshold != float("inf")):
        raise ValueError(f"m2po_mask: threshold={threshold!r}; it must be a finite number >= 0 (paper: 0.04)")
    shapes = {"delta": tuple(delta.shape), "advantages": tuple(advantages.shape), "valid": tuple(valid.shape)}
    if order_key is not None:
        shapes["order_key"] = tuple(order_key.shape)
    if delta.dim() != 1 or len(set(shapes.values())) != 1:
        raise ValueError(f"m2po_mask: expects 1-D tensors of equal length, got shapes {shapes}")
    if order_key is not None and (order_key.dtype.is_floating_point or order_key.dtype == torch.bool):
        raise ValueError(f"m2po_mask: order_key must be an integer tensor, got {order_key.dtype}")
    if order_key is not None and order_key.numel() and int(order_key.min()) < 0:
        raise ValueError(f"m2po_mask: order_key must be >= 0, got min {int(order_key.min())}")
    bad = valid & ~torch.isfinite(delta)
    if bool(bad.any()):
        idx = bad.nonzero().flatten()
        raise ValueError(f"m2po_mask: delta has {idx.numel()} non-finite values on valid tokens, at indices "
                         f"{idx[:10].tolist()} (values {delta[idx[:10]].tolist()}); check logp / behaviour log-probs")
    bad = valid & ~torch.isfinite(advantages)
    if bool(bad.any()):
        idx = bad.nonzero().flatten()
        raise ValueError(f"m2po_mask: advantages have {idx.numel()} non-finite values on valid tokens, at "
                         f"indices {idx[:10].tolist()}")


@torch.no_grad()
def m2po_mask(delta: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor, *, threshold: float = 0.04,
              rule: str = "remove", group=None, order_key: Optional[torch.Tensor] = None,
              region: str = "trust", keep_one: bool = False) -> tuple[torch.Tensor, M2Stats]:
    """M2PO mask over 1-D token tensors; returns ``(keep, stats)``.

    ``delta`` = logp_theta - logp_behav (any float dtype), ``advantages`` per token, ``valid`` =
    response-token mask (bool or 0/1). ``keep`` (bool, same shape and device) is True for valid
    tokens that contribute to the loss and False for masked and invalid tokens. ``group``: process
    group over which the selection is global (see the module docstring); None = this tensor only.
    ``order_key``: non-negative int64 global token order for ties (lowest key kept first).
    ``region``: the candidate tokens, ``"trust"`` (the paper's T) or ``"all"`` valid tokens;
    ``keep_one`` (rule ``"remove"``): keep the smallest candidate when none fits the budget
    (AReaL's variant; the module docstring). ``stats.n_trust`` counts the candidates.
    """
    valid = valid.to(torch.bool)
    _validate(delta, advantages, valid, threshold, rule, order_key)
    if region not in ("trust", "all"):
        raise ValueError(f"m2po_mask: region={region!r}; use 'trust' or 'all'")
    if keep_one and rule != "remove":
        raise ValueError(f"m2po_mask: keep_one=True goes with rule='remove', got rule={rule!r}")
    d = torch.where(valid, delta.to(torch.float64), 0.0).clamp(-DELTA_CLAMP, DELTA_CLAMP)
    tr = trust_region(d, advantages, valid) if region == "trust" else valid
    idx_t = tr.nonzero().flatten()
    v = d[idx_t].square()

    # Distributed: the totals (plus the valid count) in one all-reduce. Single process: the local
    # search computes them itself (no second pass over the values).
    totals = None
    n_valid = int(valid.sum())
    if group is not None:
        local = torch.cat([torch.tensor([n_valid, v.numel()], dtype=torch.int64, device=v.device),
                           sel.to_fixed_limbs(v).sum(1)])
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        tot = local.tolist()
        n_valid, totals = tot[0], (tot[1], sel.limbs_value(tot[2:]))

    masked_t = None
    if rule == "remove":
        res = sel.prefix_mean_search(v, threshold, group=group, totals=totals)
        if keep_one and res.n_total and res.n_kept == 0:
            # Nothing fits: the boundary is the smallest value; keep one copy of it (lowest order key).
            y = float(res.boundary)
            res = dataclasses.replace(res, n_keep_equal=1, sum_kept=y, max_kept=y)
        if res.boundary is not None:
            y = res.boundary
            if res.n_keep_equal == 0:
                masked_t = v >= y
            elif res.n_keep_equal == res.n_equal:  # keep_one with a single smallest value: keep it
                masked_t = v > y
            else:  # the cut falls inside a run of ties: keep the copies with the lowest order keys
                masked_t = v > y
                tied = (v == y).nonzero().flatten()
                keep_tied = _select_ties(tied, idx_t, res.n_keep_equal, res.n_equal, group, order_key)
                masked_t[tied[~keep_tied]] = True
    else:
        res = sel.capped_mean_search(v, threshold, group=group, totals=totals)
        if res.cap_bound != float("inf"):
            masked_t = v > res.cap_bound

    keep = valid.clone()
    if masked_t is not None:
        keep[idx_t[masked_t]] = False
    n_t, n_kept = res.n_total, res.n_kept
    n_masked = n_t - n_kept
    stats = M2Stats(
        m2_before=res.sum_total / n_t if n_t else 0.0,
        m2_after=res.sum_kept / n_kept if n_kept else 0.0,
        mask_frac=n_masked / n_valid if n_valid else 0.0,
        threshold_value=res.max_kept,
        n_trust=n_t, n_masked=n_masked, n_valid=n_valid, rule=rule)
    return keep, stats


def _select_ties(tied: torch.Tensor, idx_t: torch.Tensor, j: int, n_equal: int, group, order_key):
    """Bool over the local tied tokens: which of them are among the ``j`` globally kept copies."""
    if j == 0:
        return torch.zeros(tied.numel(), dtype=torch.bool, device=tied.device)
    if order_key is None:
        # Default order: rank-major concatenation, local index within a rank.
        offset = 0
        if group is not None:
            counts = [torch.zeros(1, dtype=torch.int64, device=tied.device) for _ in range(dist.get_world_size(group))]
            dist.all_gather(counts, torch.tensor([tied.numel()], dtype=torch.int64, device=tied.device), group=group)
            offset = sum(int(c) for c in counts[:dist.get_rank(group)])
        take = min(max(j - offset, 0), tied.numel())
        out = torch.zeros(tied.numel(), dtype=torch.bool, device=tied.device)
        out[:take] = True  # nonzero() returns ascending local indices
        return out
    keys = order_key.to(torch.int64)[idx_t[tied]]
    if group is None:
        srt = torch.sort(keys).values
        if int(srt[j - 1]) == int(srt[j]):
            raise _duplicate_keys(int(srt[j]))
        return keys < srt[j]
    # The (j+1)-th smallest key: the largest K with #(keys < K) <= j.
    res = sel.radix_search(keys, lambda _s, below: below[0] <= j, group=group, lo=0, bits=63, bits_per_round=8)
    if res.below[0] != j:
        raise _duplicate_keys(res.key)
    return keys < res.key


def _duplicate_keys(key: int) -> ValueError:
    return ValueError(f"m2po_mask: order_key {key} is shared by several tokens tied at the mask boundary; "
                      "order_key must be unique per token (e.g. sample_index * max_len + position)")
