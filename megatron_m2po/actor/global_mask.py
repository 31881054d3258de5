"""The actor's global-mask steps and the per-micro-batch record of what an update's loss used.

:class:`TokenRecord` is the observer API of a training update: when ``MegatronActor.token_hook``
is set, the actor calls it with one record per training micro-batch (last pipeline stage, every
tensor-parallel rank, this rank's data-parallel shard), carrying the mask the loss *finally* used
-- with ``mask_strategy=correct`` the exact global mask, after the correction, never the
provisional one. The token dump (``trainer/token_dump.py``) and the tests read updates through it.

:class:`GlobalMask` runs the steps of docs/design.md §3 that take M2PO's global mask for one
update (``algo.m2po.mask_strategy``): which strategy (``choose``), the forward-only pre-pass
(``prepass``), or the provisional guess per micro-batch (``guess``) followed by the exact
selection and the correction forward-backward (``correct``, ``actor/mask_correction.py`` says why it
is exact). The layout-free parts live in ``actor/mask_correction.py``.

:class:`MaskHost` is everything :class:`GlobalMask` uses of the actor: its config and process
groups, the previous update's metrics, the observer hook, its micro-batching, and three passes
(run Megatron's schedule over micro-batches, log-probs from the last stage's hidden states, a
forward-only log-prob pass). ``MegatronActor`` implements it with public members; the frozen reference
(``actor/reference.py``) uses the same passes. A strategy built on this interface (for
example a LoRA or colocated actor's) needs nothing else from the actor.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch
import torch.distributed as dist

from megatron_m2po.actor.batch import BatchPlan, MicroBatch, group_microbatches
from megatron_m2po.parallel.groups import last_rank, nontrivial

__all__ = ["TokenRecord", "MaskHost", "GlobalMask"]


@dataclasses.dataclass(frozen=True, slots=True)
class TokenRecord:
    """One training micro-batch of an update, as its loss used it (detached tensors on the actor's device).

    Attributes:
        update: the actor's weight version the update trained from (``actor.version`` before it).
        strategy: how the update took its global mask: ``"prepass"``, ``"correct"``
            (``algo.m2po.mask_strategy``; ``auto`` records the one it chose), or None when the loss
            takes no global mask (another loss, or M2PO with ``scope=microbatch``).
        mb: the micro-batch; its ``token_index`` (canonical index of each response token in the
            mini-batch), ``behav_logprobs``, ``advantages`` and ``loss_mask`` align with the tensors below.
        logp, entropy: float [T] log-probs and entropies at the update's weights.
        keep: bool [T] the mask the loss used (exact; per micro-batch for ``scope=microbatch``), or
            None when the loss takes none.
    """

    update: int
    strategy: Optional[str]
    mb: MicroBatch
    logp: torch.Tensor
    entropy: torch.Tensor
    keep: Optional[torch.Tensor]


class MaskHost(Protocol):
    """What the global-mask steps need from the actor (``MegatronActor`` is one).

    Attributes:
        cfg: the actor's config sections (``ActorConfig``: ``algo``, ``model``, ``parallel``).
        pg: Megatron-Core's ``ProcessGroupCollection`` of the layout (``parallel/groups.py``);
            the steps reduce over ``dp_cp`` (the mask), ``cp`` (the differences of a sequence),
            ``pp`` (the cuts, to every stage) and ``dp`` (the correction count under EP).
        device: where micro-batches and their tensors live.
        version: the weight version the update trains from.
        mask_hint: the previous update's reduced metrics (None before the first), which
            ``mask_strategy=auto`` decides on.
        token_hook: the observer of training updates (:class:`TokenRecord`), or None.
        is_last_stage: whether this rank holds the last pipeline stage (the one with losses).
        schedule_multiple: what a training pass's micro-batch count must be a multiple of.
    """

    cfg: Any
    pg: Any
    device: Any
    version: int
    mask_hint: Optional[dict[str, float]]
    token_hook: Optional[Callable[[TokenRecord], None]]

    @property
    def is_last_stage(self) -> bool: ...

    @property
    def schedule_multiple(self) -> int: ...

    def pad_multiples(self) -> tuple[int, int]:
        """``(pad_multiple, seq_multiple)`` of this layout's micro-batches."""

    def make_microbatches(self, samples, groups: list[list[int]], response_lengths=None) -> list[MicroBatch]:
        """Micro-batches of ``samples`` grouped as ``groups``, padded and cut for this rank, on the device."""

    def run_schedule(self, mbs: list[MicroBatch], loss_fn, *, forward_only: bool,
                     models: Optional[list] = None) -> list[Any]:
        """Megatron's schedule over ``mbs`` with ``loss_fn(mb, model, hidden)``; gradients of a
        training pass stay unfinalised (the update finalises them once)."""

    def token_logprobs(self, mb: MicroBatch, model, hidden: torch.Tensor, with_entropy: bool):
        """``(logp, entropy)`` of the response tokens of ``mb`` from last-stage hidden states."""

    def forward_logprobs(self, mbs: list[MicroBatch], with_entropy: bool) -> list[dict]:
        """Forward-only ``{"logp", "entropy"}`` per micro-batch (last stage; ``[]`` elsewhere)."""


class GlobalMask:
    """The global-mask steps of one actor's updates. Collective where the actor's passes are:
    every rank of the job calls the same methods in the same order.

    Args:
        actor: the :class:`MaskHost` whose updates take the mask.
        moe: whether the model is a mixture of experts (its router's auxiliary losses rule the
            correction out, :meth:`choose`).
    """

    def __init__(self, actor: MaskHost, *, moe: bool = False) -> None:
        self.actor = actor
        self.moe = moe

    def choose(self, spec, settings) -> Optional[str]:
        """How this update takes the global mask: None (the loss takes none), "prepass" or
        "correct" (``algo.m2po.mask_strategy``; ``mask_correction.choose_strategy``). The same on
        every rank (a function of config and the previous update's reduced metrics)."""
        from megatron_m2po.actor.mask_correction import choose_strategy

        if not spec.needs_global_mask_prepass(settings):
            return None
        configured = getattr(settings, "mask_strategy", "prepass")
        if spec.provisional_keep is None:
            if configured == "correct":
                raise ValueError(f"mask_strategy='correct' needs a loss whose objective is linear in the mask "
                                 f"(a LossSpec with provisional_keep); loss {spec.name!r} has none: use prepass")
            return "prepass"
        a = self.actor
        m = a.cfg.model
        moe = m.moe
        if (moe.aux_loss_coeff > 0 or moe.z_loss_coeff > 0) and self.moe:
            # the router's auxiliary losses add their gradient in every forward-backward: a
            # correction pass would add it again for the sequences it re-runs
            if configured == "correct":
                raise ValueError(f"mask_strategy='correct' with model.moe.aux_loss_coeff={moe.aux_loss_coeff}, "
                                 f"z_loss_coeff={moe.z_loss_coeff}: the correction pass would add the router's "
                                 "auxiliary loss gradient a second time; use prepass or set both to 0")
            return "prepass"
        return choose_strategy(configured, a.mask_hint, recompute=a.cfg.parallel.recompute,
                               dropout=m.attention_dropout > 0 or m.hidden_dropout > 0 or m.lora.dropout > 0)

    def prepass(self, mbs: list[MicroBatch], spec, settings, plan: BatchPlan, records: list[dict], *,
                measure: bool = False) -> tuple[list[Optional[torch.Tensor]], dict]:
        """Forward-only pre-pass at the current weights and the loss's global token mask.

        Runs on the last stage's DP x CP group (it spans last-stage ranks only). Returns one keep
        tensor per micro-batch and the mask's metrics, which are already global (not reduced
        again). With ``measure`` (``mask_strategy=auto``), also records what the correction
        strategy would have recomputed (``mask/*``, from the same log-ratios), which ``auto`` reads.
        """
        a = self.actor
        outs = a.forward_logprobs(mbs, with_entropy=False)
        if not a.is_last_stage:
            return [None] * len(mbs), {}
        c = a.cfg.algo.logratio_clamp
        deltas = [(o["logp"] - mb.behav_logprobs.to(o["logp"].dtype)).clamp(-c, c) for o, mb in zip(outs, mbs)]
        keeps, metrics = self.select(mbs, deltas, spec, settings)
        if measure and spec.provisional_keep is not None:
            seen: list[dict] = []
            for d, mb in zip(deltas, mbs):
                seen.append({"mb": mb, "delta": d, "guess": self.guess(spec, settings, mb, d, seen)})
            self.stats(mbs, [p["guess"] for p in seen], keeps, plan, records, strategy="prepass")
        return keeps, metrics

    def guess(self, spec, settings, mb: MicroBatch, delta: torch.Tensor, earlier: list[dict]) -> torch.Tensor:
        """The provisional keep mask of ``mb`` (the spec's ``provisional_keep``) from its clamped
        log-ratios and those of this rank's ``earlier`` micro-batches of the update."""
        seen = [(p["delta"], p["mb"].advantages, p["mb"].loss_mask, p["mb"].token_index) for p in earlier]
        return spec.provisional_keep(delta, mb.advantages, mb.loss_mask, order_key=mb.token_index, seen=seen,
                                     settings=settings)

    def select(self, mbs: list[MicroBatch], deltas: list[torch.Tensor], spec, settings
               ) -> tuple[list[torch.Tensor], dict]:
        """The spec's ``token_mask`` over the whole mini-batch from the clamped log-ratios of this
        rank's micro-batches (last stage; global over its DP x CP group, canonical token order)."""
        a = self.actor
        order = torch.cat([mb.token_index for mb in mbs])
        keep, metrics = spec.token_mask(
            torch.cat(deltas), torch.cat([mb.advantages for mb in mbs]), torch.cat([mb.loss_mask for mb in mbs]),
            order_key=order, group=nontrivial(a.pg.dp_cp), settings=settings)
        return list(torch.split(keep, [mb.num_tokens for mb in mbs])), {k: float(m.value) for k, m in metrics.items()}

    def stats(self, mbs: list[MicroBatch], guess: list[torch.Tensor], keeps: list[torch.Tensor], plan: BatchPlan,
              records: list[dict], *, strategy: str) -> dict[int, torch.Tensor]:
        """Per-sample differences ``keep - guess`` and their cost as metric records (this rank's
        share, reduced with the others): ``mask/correction_token_frac`` (tokens a correction re-runs /
        tokens of the update, what ``auto`` compares with a pre-pass), ``mask/corrected_sequence_frac``,
        ``mask/corrected_microbatch_frac`` (micro-batches holding a changed token), ``mask/correct``
        (1 when this update used the correction strategy, 0 for a measuring pre-pass)."""
        from megatron_m2po.actor.mask_correction import changed_lengths
        from megatron_m2po.algo.metrics import Metric

        diffs = self.diffs(mbs, guess, keeps, plan)
        cut = changed_lengths(diffs)
        tokens = float(sum(int(plan.lengths[i]) for mb in mbs for i in mb.sample_index))
        n_seq = float(sum(len(mb.sample_index) for mb in mbs))
        redo = float(sum(int(plan.lengths[i]) - int(plan.response_lengths[i]) + r for i, r in cut.items()))
        hit = float(sum(any(i in diffs for i in mb.sample_index) for mb in mbs))
        records.append({"mask/correction_token_frac": Metric(redo / max(tokens, 1.0), "mean", tokens),
                        "mask/corrected_sequence_frac": Metric(len(cut) / max(n_seq, 1.0), "mean", n_seq),
                        "mask/corrected_microbatch_frac": Metric(hit / max(len(mbs), 1), "mean", float(len(mbs))),
                        "mask/correct": Metric(float(strategy == "correct"), "max")})
        return diffs

    def diffs(self, mbs: list[MicroBatch], guess: list[torch.Tensor], keeps: list[torch.Tensor], plan: BatchPlan
              ) -> dict[int, torch.Tensor]:
        """``{mini-batch index: int8 [R_i] keep - guess}`` in response order for the samples of ``mbs``
        holding a changed token (``mask_correction.diff_by_sample``). Under context parallelism a rank
        holds only part of each sequence's tokens: each puts its differences at their response
        positions (``token_index`` minus the sample's offset) and the CP group sums them (every token
        is on one CP rank), so every CP rank has whole sequences and cuts them alike."""
        from megatron_m2po.actor.mask_correction import diff_by_sample
        from megatron_m2po.parallel.devices import collective_device

        cp = self.actor.pg.cp
        if dist.get_world_size(cp) == 1:
            return diff_by_sample(mbs, guess, keeps)
        offsets = np.concatenate([[0], np.cumsum(np.asarray(plan.response_lengths, np.int64))])
        order = [i for mb in mbs for i in mb.sample_index]  # the same on every CP rank of a replica
        rlen = np.asarray([int(plan.response_lengths[i]) for i in order], np.int64)
        base = dict(zip(order, np.concatenate([[0], np.cumsum(rlen)])[:-1].tolist()))
        flat = torch.zeros(int(rlen.sum()), dtype=torch.int8)
        for mb, g, k in zip(mbs, guess, keeps):
            shift = torch.tensor([base[i] - int(offsets[i]) for i in mb.sample_index], dtype=torch.int64)
            flat[mb.token_index.cpu() + shift[mb.seq_index.cpu()]] = (k.to(torch.int8) - g.to(torch.int8)).cpu()
        total = flat.to(collective_device(cp))
        dist.all_reduce(total, group=cp)
        parts = torch.split(total.cpu(), rlen.tolist())
        return {i: d for i, d in zip(order, parts) if bool(d.any())}

    def correct(self, mbs: list[MicroBatch], provisional: list[dict], plan: BatchPlan, samples, mine: list[int],
                spec, settings, denom: float, records: list[dict]) -> dict:
        """Steps 2-3 of actor/mask_correction.py after the provisional forward-backward: the exact
        global mask from the recorded log-ratios (last stage), the deferred token records with it,
        and one forward-backward of ``keep - guess`` over the changed sequences, cut after their
        last changed token. Every stage of the replica learns those cuts by one broadcast over the
        pipeline group. Returns the mask's (global) metrics."""
        from megatron_m2po.actor.mask_correction import (changed_lengths, pad_for_schedule, schedule_count,
                                                         truncate)
        from megatron_m2po.parallel.devices import collective_device

        a = self.actor
        metrics: dict = {}
        diffs: dict[int, torch.Tensor] = {}
        if a.is_last_stage:
            keeps, metrics = self.select(mbs, [p["delta"] for p in provisional], spec, settings)
            diffs = self.stats(mbs, [p["guess"] for p in provisional], keeps, plan, records, strategy="correct")
            if a.token_hook is not None:  # deferred from the provisional pass: the record holds the exact mask
                for mb, p, k in zip(mbs, provisional, keeps):
                    a.token_hook(TokenRecord(a.version, "correct", mb, p["logp"], p["entropy"], k))
        cut = changed_lengths(diffs)
        pp = a.pg.pp
        if dist.get_world_size(pp) > 1:  # the cuts of this replica's shard, to every stage (0 = unchanged)
            t = torch.tensor([cut.get(i, 0) for i in mine], dtype=torch.int64, device=collective_device(pp))
            dist.broadcast(t, src=last_rank(pp), group=pp)
            cut = {i: int(r) for i, r in zip(mine, t.tolist()) if r > 0}
        expert = a.cfg.parallel.expert_parallel > 1
        if not cut and not expert:
            return metrics
        p = a.cfg.parallel
        pad, seq_pad = a.pad_multiples()
        lengths = plan.lengths.tolist()
        for i, r in cut.items():
            lengths[i] = int(plan.lengths[i]) - int(plan.response_lengths[i]) + r
        groups = group_microbatches(lengths, [i for i in mine if i in cut], micro_batch_size=p.micro_batch_size,
                                    max_tokens=p.max_tokens_per_microbatch, packing=p.packing, pad_multiple=pad,
                                    seq_multiple=seq_pad) if cut else []
        # (diffs: last stage only; other stages never compute a loss)
        weights = [torch.cat([diffs[i][:cut[i]] for i in g]) if a.is_last_stage else None for g in groups]
        target = schedule_count(len(groups), a.schedule_multiple)
        if expert:
            target = self.expert_count(target)
            if not target:
                return metrics
        spare = min(mine, key=lambda i: (lengths[i], i)) if mine else None
        groups, weights, cut = pad_for_schedule(groups, weights, target, lengths, cut, spare,
                                                last=a.is_last_stage)
        short = {i: truncate(samples[i], r) for i, r in cut.items()}
        for i, sm in short.items():
            lengths[i] = sm.length
        fix = a.make_microbatches(short, groups, plan.response_lengths)
        if dist.get_world_size(a.pg.cp) > 1 and diffs:  # each CP rank weighs the tokens it holds of the cut sequences
            offsets = np.concatenate([[0], np.cumsum(np.asarray(plan.response_lengths, np.int64))])
            weights = [_held(w, g, mb, offsets, cut) for w, g, mb in zip(weights, groups, fix)]
        it = iter([None if w is None else w.to(a.device) for w in weights])
        a.run_schedule(fix, lambda mb, model, hidden: self.correction_loss(
            mb, model, hidden, next(it), spec=spec, denom=denom, records=records), forward_only=False)
        return metrics

    def expert_count(self, n: int) -> int:
        """The number of correction micro-batches every rank runs under expert parallelism: the
        largest ``n`` (this rank's, already filled for the schedule) of the data-parallel group. Collective.

        Each MoE layer's token dispatch and combine are collectives over the expert tensor-and-model
        parallel group (megatron-core 0.16.1 ``transformer/moe/token_dispatcher.py``: the all-to-all
        over ``pg_collection.ep``, the gathers over ``expt_tp`` and ``tp_ep``, groups from
        ``parallel_state``'s expert rank generator, order ``tp-cp-ep-dp-pp`` with cp=1), whose
        ranks hold different data-parallel shards (EP x ETP subdivides the stage's TP x DP ranks); a rank that skips a
        forward the others run leaves them waiting in the all-to-all. Tensor-parallel ranks of a
        replica run the same correction, so agreeing over the data-parallel group (as
        ``actor/moe_plan.py`` does for the passes) agrees over every expert group of the stage; and
        every stage of a replica already has the same cuts (broadcast over the pipeline), so every
        stage takes the same maximum. A rank with nothing to correct joins with zero-weight fillers."""
        from megatron_m2po.parallel.devices import collective_device

        dp = self.actor.pg.dp
        if dist.get_world_size(dp) == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=collective_device(dp))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp)
        return int(t[0])

    def correction_loss(self, mb: MicroBatch, model, hidden: torch.Tensor, weight: Optional[torch.Tensor], *,
                        spec, denom: float, records: list[dict]):
        """Megatron loss function of a correction micro-batch: the loss of ``keep - guess``, i.e. the
        loss with the tokens the exact mask adds minus the loss with those it removes (the objective
        is linear in keep; entropy and every other term do not depend on the mask and are already in
        the provisional pass). Its value goes to ``loss/policy`` and ``loss/total`` (sums). A
        zero ``weight`` (a filler micro-batch) adds exactly 0 to every gradient."""
        from megatron_m2po.algo.losses import compute_policy_loss, tis_weights
        from megatron_m2po.algo.metrics import Metric

        a = self.actor
        algo = a.cfg.algo
        logp, _ = a.token_logprobs(mb, model, hidden, with_entropy=False)
        behav, adv = mb.behav_logprobs.to(logp.dtype), mb.advantages.to(logp.dtype)
        tis = None
        if algo.tis and mb.engine_logprobs is not None:
            tis = tis_weights(behav, mb.engine_logprobs.to(logp.dtype), algo.tis_cap)
        loss = None
        for sign, keep in ((1.0, weight > 0), (-1.0, weight < 0)):
            part, _ = compute_policy_loss(spec.name, logp, behav, adv, mb.loss_mask, denominator=denom, algo_cfg=algo,
                                          keep=keep, seq_index=mb.seq_index, tis_weight=tis)
            loss = sign * part if loss is None else loss + sign * part
        value = float(loss.detach())
        records.append({"loss/policy": Metric(value, "sum"), "loss/total": Metric(value, "sum")})
        return loss, torch.tensor(mb.num_tokens, dtype=torch.int), None



def _held(weight: torch.Tensor, group: list[int], mb: MicroBatch, offsets: np.ndarray, cut: dict[int, int]
          ) -> torch.Tensor:
    """The entries of ``weight`` (the group's samples' cut responses, concatenated) for the tokens
    this CP rank's part ``mb`` holds: sample ``group[seq_index]``, response position ``token_index``
    minus the sample's offset."""
    per = dict(zip(group, torch.split(weight, [cut[i] for i in group])))
    out = torch.zeros(mb.num_tokens, dtype=weight.dtype)
    seq, tok = mb.seq_index.cpu(), mb.token_index.cpu()
    for b, i in enumerate(group):
        sel = seq == b
        out[sel] = per[i][tok[sel] - int(offsets[i])]
    return out
