"""MegatronActor: token log-probs and M2PO / baseline training steps on Megatron-Core.

Every rank constructs the actor. A training update gets one optimizer mini-batch: the same
:class:`RolloutBatch` on every rank, or (what the trainer sends) a :class:`ShardedBatch`, the
mini-batch's global :class:`BatchPlan` (sizes, loss-token counts, versions) plus the samples of
this rank's data-parallel shard only. The actor splits each mini-batch into data-parallel shards
balanced by work (``batch.balanced_shards``; contiguous with
``parallel.balance_data_parallel=false``) and each shard into micro-batches by count or token
budget (``batch.group_microbatches``), packed (THD, ``PackedSeqParams``) or right-padded
(``batch.make_microbatches``, ``MicroBatch``). None of these choices changes a result. Pipeline stages run
Megatron's own schedules (``get_forward_backward_func``); the last stage turns final hidden
states of *response rows only* into log-probs with the vocab-parallel fused kernel
(``parallel/logprobs.py``), so ``[tokens, vocab]`` logits never exist.

One optimizer update (``_update``), docs/design.md §3:

1. Pre-pass (``GlobalMask.prepass``, actor/global_mask.py), only when the loss spec says ``needs_global_mask_prepass``
   (M2PO with ``algo.m2po.scope=global``): a forward-only pass at the current weights gives
   ``logp_theta`` for every token of the mini-batch; the spec's ``token_mask`` (``m2po_mask``)
   then selects the global mask over the data x context parallel group of the last stage
   (tensor-parallel ranks hold identical values and are in different DP groups, so nothing is
   counted twice), ordered by the canonical token index (sample order in the mini-batch, then
   position). Other losses skip the pre-pass (their policy metrics come from the training
   forward, which runs at the same weights). The actor never branches on a loss name: it asks
   the registered :class:`~megatron_m2po.algo.losses.LossSpec`. With
   ``algo.m2po.mask_strategy=correct`` (or ``auto`` choosing it) there is no pre-pass: step 2 runs
   with the spec's provisional mask and step 3 corrects it.
2. forward-backward over the micro-batches with the mask fixed (``_policy_loss``; metrics in
   ``_update_metrics``), Megatron's grad finaliser held back: the actor gives the schedules no
   ``finalize_model_grads_func``, so the gradients stay as the backward passes summed them. The
   loss of a micro-batch is
   ``sum(...) / N`` with ``N`` the response-token count (``loss_mask``) of the whole mini-batch.
   Every rank holds the global plan, so ``N`` is computed locally and equals the DP x CP
   all-reduce of the per-rank counts. Megatron is told ``calculate_per_token_loss`` (no division
   by micro-batch count, gradients *summed* over data parallel ranks) and its grad finaliser is
   called without a token count, so the gradient is exactly ``d/dθ [-(1/N) Σ M r A]`` over the
   mini-batch whatever the TP / PP / DP layout and micro-batch size (tested).
   With ``algo.kl.coef > 0`` a forward-only pass of the frozen reference (``actor/reference.py``)
   over the same micro-batches comes first, and each micro-batch's loss adds the reference-KL
   term (``algo/kl.py``) with the same denominator ``N``, after the loss's mask is taken
   (``algo.kl.placement=loss``; with ``reward`` the trainer takes the penalty from the rewards
   before the advantages, through :meth:`MegatronActor.reference_logprobs`, and the loss has no term).
3. The mask's gradient correction (strategy ``correct`` only; ``GlobalMask.correct``,
   ``actor/mask_correction.py`` says why it is exact): the exact mask from step 2's log-ratios,
   and one more forward-backward of the difference on the changed sequences only, whose
   gradients add to step 2's.
4. Megatron's grad finaliser (``_finalize_grads``: data-parallel, sequence-parallel and
   tied-embedding reductions), called explicitly, once over the gradients of steps 2 and 3.
5. Megatron's optimizer step (Adam, grad clipping, optional distributed optimizer), the LR
   scheduler, ``version += 1``. A loss with a ``step_scale`` (VCPO's ESS rule) scales the
   scheduler's LR of this update only (``_set_update_lr``): the factor comes from what its
   objective stashed during step 2, reduced over the data-parallel group on the last stage and
   broadcast to the other pipeline stages, so every rank steps with the same LR.

Context parallelism (``parallel.context_parallel``, docs/design.md): every micro-batch is built
whole, padded to ``batch.cp_pad_multiple``, then cut with Megatron's load-balanced split
(``batch.cp_split``: each sequence in ``2 x CP`` chunks, rank ``r`` holding chunks ``r`` and
``2 CP - 1 - r``). Each CP rank computes log-probs, entropy, mask inputs and loss terms of the
response tokens whose predicting row it holds, each token keeping its canonical ``token_index``;
the loss denominator is the global count, metrics and the M2 mask reduce over DP x CP, and
Megatron's DDP sums gradients over DP x CP, so results equal CP=1. Attention: TE with the CP group
and ``parallel.cp_comm_type`` on GPU, ``attention.cp_causal_attention`` (TE's all-gather
algorithm over gloo) on the CPU layer spec.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from functools import partial
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_m2po.actor.batch import (BatchPlan, MicroBatch, RolloutBatch, ShardedBatch, balanced_shards, cp_pad_multiple,
                                       cp_split, dp_shard, group_microbatches, make_microbatches)
from megatron_m2po.actor.global_mask import GlobalMask, TokenRecord
from megatron_m2po.actor.settings import ModelConfig, OptimConfig, ParallelConfig
from megatron_m2po.algo.settings import AlgoConfig
from megatron_m2po.config import Config
from megatron_m2po.parallel.groups import is_last, last_rank, nontrivial, process_groups
from megatron_m2po.utils.timing import TIMER

__all__ = ["ActorConfig", "MegatronActor", "init_parallel", "destroy_parallel"]


@dataclasses.dataclass(frozen=True, slots=True)
class ActorConfig:
    """The config sections the actor reads, and nothing of the trainer, rollout or store settings.

    Attributes:
        model, parallel, optim, algo: those sections of :class:`~megatron_m2po.config.Config`.
        total_updates: optimizer updates of the whole run (the LR schedule's decay length).
        temperature: the rollout sampling temperature; log-probs are computed at it.
        seed: Megatron's model-parallel RNG seed.
    """

    model: ModelConfig
    parallel: ParallelConfig
    optim: OptimConfig
    algo: AlgoConfig
    total_updates: int
    temperature: float
    seed: int

    @classmethod
    def from_config(cls, cfg: Config, *, total_updates: int) -> "ActorConfig":
        """Pick the actor's sections of the full config tree."""
        return cls(model=cfg.model, parallel=cfg.parallel, optim=cfg.optim, algo=cfg.algo,
                   total_updates=total_updates, temperature=cfg.rollout.temperature, seed=cfg.trainer.seed)


def init_parallel(p: ParallelConfig, seed: int) -> bool:
    """torch.distributed (if needed) + Megatron parallel state. Returns True if it created the group.

    Without CUDA the CPU emulation (the ``cpu_platform`` stand-in) is enabled and gloo is used. Undo with
    :func:`destroy_parallel`.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    cuda = torch.cuda.is_available()
    if not cuda:
        from megatron_m2po.utils.standin import load_standin

        load_standin("cpu_platform").enable()
    backend = p.backend if p.backend != "auto" else ("nccl" if cuda else "gloo")
    created = False
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a single process without torchrun
            from megatron_m2po.utils.net import free_port

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                              LOCAL_RANK="0")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=p.timeout_s))
        created = True
    world = dist.get_world_size()
    mp = p.tensor_parallel * p.pipeline_parallel * p.context_parallel
    if world % mp:
        raise ValueError(f"world size {world} is not a multiple of tensor_parallel x pipeline_parallel x "
                         f"context_parallel = {p.tensor_parallel} x {p.pipeline_parallel} x {p.context_parallel}")
    etp = p.expert_tensor_parallel or p.tensor_parallel  # Megatron's default: ETP = TP
    if world % (etp * p.expert_parallel * p.pipeline_parallel):
        raise ValueError(f"world size {world} is not a multiple of expert_tensor_parallel x expert_parallel x "
                         f"pipeline_parallel = {etp} x {p.expert_parallel} x {p.pipeline_parallel}")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=p.tensor_parallel, pipeline_model_parallel_size=p.pipeline_parallel,
            virtual_pipeline_model_parallel_size=p.virtual_pipeline_parallel,
            context_parallel_size=p.context_parallel, expert_model_parallel_size=p.expert_parallel,
            expert_tensor_parallel_size=etp, distributed_timeout_minutes=max(1, int(p.timeout_s // 60)))
    elif (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
          ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()) != \
            (p.tensor_parallel, p.pipeline_parallel, p.expert_parallel, etp):
        raise ValueError("Megatron parallel state is already initialised with a different layout than "
                         f"parallel.tensor_parallel={p.tensor_parallel}, pipeline_parallel={p.pipeline_parallel}, "
                         f"expert_parallel={p.expert_parallel}, expert_tensor_parallel={etp}")
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    _make_rerun_state_machine()
    return created


def _make_rerun_state_machine() -> None:
    """Megatron-Core's rerun state machine (its re-run / fault-injection machinery, which this
    trainer does not use) made explicitly in its default mode, DISABLED, without the two WARNING
    lines its implicit creation on first use logs on every run ("Implicit initialization of Rerun
    State Machine!", "RerunStateMachine initialized in mode RerunMode.DISABLED":
    megatron/core/rerun_state_machine.py ``get_rerun_state_machine``, ``RerunStateMachine.__init__``)."""
    from megatron.core import rerun_state_machine as rsm

    if getattr(rsm, "_GLOBAL_RERUN_STATE_MACHINE", None) is not None:
        return
    quiet = logging.getLogger(rsm.__name__)
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.DISABLED)
    finally:
        quiet.setLevel(level)


def destroy_parallel(process_group: bool) -> None:
    """Undo :func:`init_parallel`: Megatron's parallel state, and the default process group too
    when ``process_group`` (the caller created it)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if process_group and dist.is_initialized():
        dist.destroy_process_group()


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


class MegatronActor:
    """The policy on Megatron-Core: log-probs, training updates, checkpoints, HF export.

    Collective: every rank of the job calls every method with the same arguments.

    Example:
        >>> actor = MegatronActor.from_config(cfg)
        >>> logps = actor.compute_logprobs(batch)             # list of float32 [R_i]
        >>> metrics = actor.train_step(batch, num_minibatches=4)  # one dict per update
        >>> actor.version
        4
    """

    # Opt-in observer of training updates (:meth:`observe_tokens`): called with one
    # ``actor.global_mask.TokenRecord`` per training micro-batch (last stage) when set; the record
    # holds the mask the loss finally used.
    token_hook: Optional[Callable[[TokenRecord], None]] = None

    def observe_tokens(self, hook: Optional[Callable[[TokenRecord], None]]) -> None:
        """Call ``hook`` with every training micro-batch's :class:`TokenRecord` from now on (None: stop)."""
        self.token_hook = hook

    def __init__(self, cfg: ActorConfig, chunks: list, bridge, ddp_chunks: list, optimizer, scheduler,
                 *, pg=None, owns_parallel: bool = False, owns_process_group: bool = False, reference=None,
                 teacher=None) -> None:
        from megatron_m2po.actor.mask_correction import check_dropout
        from megatron_m2po.actor.model import is_moe
        self.cfg = cfg
        self.chunks = chunks            # unwrapped GPTModel chunks of this pipeline rank
        self.bridge = bridge
        self.model = ddp_chunks         # DDP-wrapped chunks (what the schedules run)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.version = 0
        # The layout: Megatron-Core's ProcessGroupCollection (parallel/groups.py; None: the groups
        # of parallel_state). Ranks and sizes are read from its groups, never copied. Samples are
        # sharded over data-parallel replicas (dp); the CP ranks of a replica split each sequence;
        # token-level reductions (loss metrics, the global mask) run over dp_cp.
        self.pg = pg if pg is not None else process_groups()
        # The frozen reference policy of algo.kl (actor/reference.py); None with algo.kl.coef = 0.
        self.reference = reference
        # The frozen teacher of algo.distill (actor/teacher.py); None with algo.distill.coef = 0.
        self.teacher = teacher
        # The previous update's reduced metrics (the same on every rank): the measured correction
        # cost that mask_strategy=auto decides on (actor/mask_correction.py); checkpoints keep it.
        self.mask_hint: Optional[dict[str, float]] = None
        # the global-mask steps (actor/global_mask.py), through this actor's MaskHost interface
        self.global_mask = GlobalMask(self, moe=is_moe(bridge.hf_config))
        self._owns_parallel = owns_parallel  # from_config initialised Megatron's parallel state
        self._owns_pg = owns_process_group
        self._tconfig = chunks[0].config
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        self.vocab_size = int(bridge.hf_config.vocab_size)
        self.temperature = float(cfg.temperature)
        # Megatron hooks: exact loss scaling (see module doc) and DDP grad sync control. No
        # finalize_model_grads_func: the schedules then leave the gradients as the backward
        # passes summed them (megatron-core 0.16.1 pipeline_parallel/schedules.py calls it only
        # when set), and the update finalises them itself, once (``_finalize_grads``, step 4).
        self._tconfig.finalize_model_grads_func = None
        self._tconfig.no_sync_func = [m.no_sync for m in ddp_chunks] if len(ddp_chunks) > 1 else ddp_chunks[0].no_sync
        self._tconfig.grad_scale_func = optimizer.scale_loss
        check_dropout(cfg.algo.m2po.mask_strategy, cfg.model.attention_dropout, cfg.model.hidden_dropout,
                      cfg.model.lora.dropout)
        self.replay = None  # routing replay (actor/routing_replay.py) with algo.routing_replay=rollout
        if cfg.algo.routing_replay == "rollout":
            from megatron_m2po.actor.routing_replay import RoutingReplay

            self.replay = RoutingReplay(chunks, num_layers=int(bridge.hf_config.num_hidden_layers),
                                        tp_size=dist.get_world_size(self.pg.tp), tp_rank=self.tp_rank,
                                        sequence_parallel=bool(self._tconfig.sequence_parallel))

    # ------------------------------------------------------------------------------- layout

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica: which shard of a mini-batch it trains on (:meth:`shards`)."""
        return dist.get_rank(self.pg.dp)

    @property
    def tp_rank(self) -> int:
        """This rank's tensor-parallel rank (its slice of the vocabulary and of each layer)."""
        return dist.get_rank(self.pg.tp)

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last pipeline stage: the one that computes log-probs and losses."""
        return is_last(self.pg.pp)

    @property
    def schedule_multiple(self) -> int:
        """What a training pass's micro-batch count must be a multiple of: the pipeline size under
        Megatron's interleaved schedule (more than one chunk per rank), else 1
        (``mask_correction.pad_for_schedule`` says why)."""
        return dist.get_world_size(self.pg.pp) if len(self.model) > 1 else 1

    # ---------------------------------------------------------------------------------- build

    @classmethod
    def from_config(cls, cfg: ActorConfig) -> "MegatronActor":
        """Build the model from ``cfg.model.hf_path`` and the optimizer.

        Uses the distributed / Megatron parallel state the caller set up (:func:`init_parallel`,
        as the trainer does); when there is none yet, sets it up and tears it down in
        :meth:`close`. ``cfg`` is not modified ('tiny' is resolved into a copy).
        """
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from megatron_m2po.actor.model import build_model

        from megatron.core import parallel_state as ps

        from megatron_m2po.utils.hf_dir import resolve_model_path

        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=resolve_model_path(cfg.model)))
        owns_parallel = not ps.model_parallel_is_initialized()
        created = init_parallel(cfg.parallel, cfg.seed) if owns_parallel else False
        from megatron_m2po.actor.reference import make_reference

        # Built first and moved to host memory at once: the device never holds it next to the
        # actor's weights, gradients and optimizer state outside its forwards.
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        reference = make_reference(cfg, device)
        from megatron_m2po.actor.teacher import make_teacher

        teacher = make_teacher(cfg, device)  # host-resident like the reference
        chunks, bridge = build_model(cfg)
        if cfg.model.lora.rank:  # the base frozen before DDP and the optimizer see it (actor/lora.py)
            from megatron_m2po.actor.lora import add_adapters

            add_adapters(chunks, cfg.model.lora, bridge.hf_config, cfg.seed)
        p, o, dtype = cfg.parallel, cfg.optim, cfg.model.dtype
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
            use_distributed_optimizer=p.use_distributed_optimizer, check_for_nan_in_grad=True, bucket_size=None)
        ddp_chunks = [DistributedDataParallel(config=c.config, ddp_config=ddp_cfg, module=c, disable_bucketing=i > 0)
                      for i, c in enumerate(chunks)]
        for m in ddp_chunks:
            m.broadcast_params()
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.grad_clip, bf16=dtype == "bfloat16",
            fp16=dtype == "float16", params_dtype=chunks[0].config.params_dtype,
            use_distributed_optimizer=p.use_distributed_optimizer)
        optimizer = get_megatron_optimizer(opt_cfg, ddp_chunks)
        total = max(1, cfg.total_updates)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if o.warmup_updates else o.lr, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.warmup_updates, lr_decay_steps=max(total, o.warmup_updates + 1),
            lr_decay_style=o.lr_schedule, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=total, wd_incr_style="constant")
        return cls(cfg, chunks, bridge, ddp_chunks, optimizer, scheduler, pg=process_groups(),
                   owns_parallel=owns_parallel, owns_process_group=created, reference=reference, teacher=teacher)

    # ------------------------------------------------------------------------------ schedules

    def shards(self, plan: BatchPlan, uids: Optional[list[str]] = None) -> list[list[int]]:
        """Mini-batch indices per data-parallel rank: balanced by work
        (``parallel.balance_data_parallel``, :func:`~megatron_m2po.actor.batch.balanced_shards`) or
        contiguous. A pure function of the plan, the same on every rank (and what the trainer uses
        to send each rank its shard); no loss quantity depends on it (module docstring)."""
        limit = int(self.bridge.hf_config.max_position_embeddings)
        over = np.flatnonzero(plan.lengths > limit)
        if over.size:
            i = int(over[0])
            name = repr(uids[i]) if uids else f"{i} of the mini-batch"
            raise ValueError(f"sample {name} has {int(plan.lengths[i])} tokens (response "
                             f"{int(plan.response_lengths[i])}), more than the model's max_position_embeddings={limit}; "
                             "lower rollout.max_new_tokens or the prompt length")
        dp = dist.get_world_size(self.pg.dp)
        if self.cfg.parallel.balance_data_parallel:
            return balanced_shards(plan.lengths.tolist(), dp, int(self.bridge.hf_config.hidden_size))
        return [list(dp_shard(len(plan), dp, r)) for r in range(dp)]

    def _shards(self, samples: list) -> list[list[int]]:
        """:meth:`shards` of a list of samples (an over-long sample is named by its uid)."""
        return self.shards(BatchPlan.of(samples), uids=[s.uid for s in samples])

    def _microbatches(self, samples, indices: list[int], plan: Optional[BatchPlan] = None) -> list[MicroBatch]:
        """This rank's micro-batches of ``samples[i] for i in indices`` (packed or padded; by count
        or by token budget, ``parallel.max_tokens_per_microbatch``)."""
        p = self.cfg.parallel
        pad, seq_pad = self.pad_multiples()
        lengths = plan.lengths.tolist() if plan is not None else [s.length for s in samples]
        groups = group_microbatches(lengths, indices, micro_batch_size=p.micro_batch_size,
                                    max_tokens=p.max_tokens_per_microbatch, packing=p.packing, pad_multiple=pad,
                                    seq_multiple=seq_pad)
        if p.expert_parallel > 1:  # MoE all-to-alls: the same micro-batch count on every data-parallel rank
            from megatron_m2po.actor.moe_plan import same_microbatch_count

            groups = same_microbatch_count(groups, lengths, len(indices), self.pg.dp, self.device)
        if self.replay is not None:
            for i in indices:
                if samples[i].routed_experts is None:
                    raise ValueError(f"sample {samples[i].uid!r} has no routed experts but algo.routing_replay=rollout "
                                     "replays them for every token (rollout.return_routed_experts=true)")
        if dist.get_world_size(self.pg.pp) > 1:
            # Every stage of a replica computes the same plan from the same data; the schedule
            # deadlocks if they ever disagree, so check it (one tiny collective per pass).
            n = torch.tensor([len(groups), -len(groups)], dtype=torch.int64, device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.pg.pp)
            assert int(n[0]) == -int(n[1]) == len(groups), "pipeline stages disagree on the micro-batch count"
        return self.make_microbatches(samples, groups, None if plan is None else plan.response_lengths)

    def pad_multiples(self) -> tuple[int, int]:
        """``(pad_multiple, seq_multiple)`` for ``batch.make_microbatches``.

        Sequence parallelism scatters the sequence dimension over TP ranks (Megatron asserts it
        divides evenly): rows are padded to a multiple of TP. Context parallelism cuts every
        sequence into ``2 CP`` chunks (``batch.cp_pad_multiple``): a padded row, or each packed
        sequence, is padded to a multiple of ``2 CP`` (``x TP`` with SP). Padding sits right of
        every sequence (packed without CP: one pseudo-sequence at the end) and is never a
        predicting row, so it reaches no log-prob, mask, loss or token count."""
        p = self.cfg.parallel
        tp = p.tensor_parallel if p.sequence_parallel else 1
        cp_size = dist.get_world_size(self.pg.cp)
        cp = cp_pad_multiple(cp_size, p.tensor_parallel, p.sequence_parallel)
        if p.packing:
            return tp, cp
        return (cp if cp_size > 1 else tp), 1

    def make_microbatches(self, samples, groups: list[list[int]], response_lengths=None) -> list[MicroBatch]:
        """``batch.make_microbatches`` with this layout's padding, cut to this CP rank's part
        (``batch.cp_split``), on the device."""
        pad, seq_pad = self.pad_multiples()
        mbs = make_microbatches(samples, groups, pad_multiple=pad, packing=self.cfg.parallel.packing,
                                response_lengths=response_lengths, seq_multiple=seq_pad)
        cp = self.pg.cp
        return self._to_device([cp_split(mb, dist.get_world_size(cp), dist.get_rank(cp)) for mb in mbs])

    def _to_device(self, mbs: list[MicroBatch]) -> list[MicroBatch]:
        for mb in mbs:
            for name in ("tokens", "position_ids", "row_pos", "row_seq", "targets", "behav_logprobs",
                         "advantages", "loss_mask", "engine_logprobs", "seq_index", "token_index", "cu_seqlens",
                         "routed_experts", "teacher_logprobs"):
                t = getattr(mb, name)
                if t is not None:
                    setattr(mb, name, t.to(self.device))
        return mbs

    # The passes below are the actor's part of the mask strategy's and the reference's seam
    # (``global_mask.MaskHost``): they run Megatron's schedule over micro-batches and turn the
    # last stage's hidden states into log-probs.

    def token_logprobs(self, mb: MicroBatch, model, hidden: torch.Tensor, with_entropy: bool):
        """``(logp, entropy)`` float [T] of the response tokens of ``mb`` from last-stage hidden
        states [S, B, H] of ``model`` (entropy None without ``with_entropy``), at the rollout
        temperature, vocab-parallel over the tensor-parallel group (``parallel/logprobs.py``).
        Differentiable: a training loss function calls it on the hidden states it is given."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        from megatron_m2po.actor.model import output_weight
        from megatron_m2po.parallel.logprobs import fused_logprobs_entropy

        if self._tconfig.sequence_parallel:
            # The fused kernel returns the full hidden gradient on every TP rank: split, don't reduce.
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        rows = hidden[mb.row_pos, mb.row_seq]
        weight = output_weight(_unwrap(model))
        return fused_logprobs_entropy(
            rows, weight, mb.targets, tp_group=nontrivial(self.pg.tp), vocab_start=self.tp_rank * weight.shape[0],
            chunk_rows=self.cfg.parallel.logprob_chunk_rows, temperature=self.temperature, compute_entropy=with_entropy, vocab_size=self.vocab_size,
            tf32=self.cfg.parallel.logprob_tf32)

    def run_schedule(self, mbs: list[MicroBatch], loss_fn, *, forward_only: bool,
                     models: Optional[list] = None) -> list[Any]:
        """Megatron's schedule over ``mbs``; ``loss_fn(mb, model, hidden) -> (loss, n_tokens, payload)``.

        ``models``: the chunks to run instead of the policy's (the frozen reference's, forward
        only; routing replay applies to the policy's routers only). Returns the payloads (last
        pipeline stage; empty elsewhere). With ``forward_only=False`` the gradients are summed
        into the DDP buffers and left unfinalised (no ``finalize_model_grads_func``): the update
        finalises them once after all of its passes (``_finalize_grads``). Collective over the
        actor's groups.
        """
        chunks = self.model if models is None else models
        replay = self.replay if models is None else None
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron.core.packed_seq_params import PackedSeqParams

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            packed = None
            if mb.cu_seqlens is not None:  # THD: TE attention on GPU, actor/attention.py on CPU
                packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=mb.cu_seqlens, cu_seqlens_kv=mb.cu_seqlens,
                                         max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen)
            if replay is not None:  # this micro-batch's experts for this chunk's routers, just before its forward
                replay.set(mb.routed_experts, next(i for i, m in enumerate(chunks) if m is model))
            out = model(mb.tokens, mb.position_ids, None, packed_seq_params=packed)
            return out, partial(loss_fn, mb, model)

        iters: Any = iter(mbs) if len(chunks) == 1 else [iter(mbs) for _ in chunks]
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iters,
                model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(mbs),
                # the whole sequence length: Megatron divides it by CP (schedules.get_tensor_shapes)
                seq_length=max(mb.tokens.shape[1] for mb in mbs) * dist.get_world_size(self.pg.cp),
                micro_batch_size=max(mb.tokens.shape[0] for mb in mbs), forward_only=forward_only)
        finally:
            if replay is not None:
                replay.clear()

    def forward_logprobs(self, mbs: list[MicroBatch], with_entropy: bool) -> list[dict]:
        """Forward-only log-probs of ``mbs`` at the current weights: one ``{"logp", "entropy"}``
        (detached float [T]; entropy None without ``with_entropy``) per micro-batch on the last
        pipeline stage, ``[]`` elsewhere. Collective over the actor's groups."""

        def loss_fn(mb, model, hidden):
            logp, ent = self.token_logprobs(mb, model, hidden, with_entropy)
            return (torch.zeros((), device=self.device), torch.tensor(mb.num_tokens, dtype=torch.int),
                    {"logp": logp.detach(), "entropy": None if ent is None else ent.detach()})

        with torch.no_grad():
            return self.run_schedule(mbs, loss_fn, forward_only=True)

    def _gather_to_all(self, total: int, shard_values: list[torch.Tensor], mbs: list[MicroBatch]) -> torch.Tensor:
        """Flat per-token values of all ``total`` response tokens of the batch on every rank: one SUM
        all-reduce over the world.

        ``shard_values`` are this rank's micro-batch outputs for the tokens of ``mbs`` (with
        context parallelism, the tokens this CP rank predicts), placed by their canonical
        ``token_index``. Exactly one rank (last stage, TP rank 0, the token's DP and CP rank)
        writes each value; all other entries are 0.
        """
        buf = torch.zeros(total, dtype=torch.float32, device=self.device)
        if self.is_last_stage and self.tp_rank == 0 and mbs:
            buf[torch.cat([mb.token_index for mb in mbs])] = torch.cat(shard_values).float()
        dist.all_reduce(buf)
        return buf

    # --------------------------------------------------------------------------------- public

    def compute_logprobs(self, batch: RolloutBatch, with_entropy: bool = False):
        """Per-sample float32 log-probs of the response tokens (every rank gets all of them).

        With ``with_entropy`` returns ``(logprobs, entropies)``, two lists of float32 [R_i].
        Uses the current weights, forward only, at the rollout temperature.
        """
        samples = batch.samples
        if not samples:
            return ([], []) if with_entropy else []
        mbs = self._microbatches(samples, self._shards(samples)[self.dp_rank])
        outs = self.forward_logprobs(mbs, with_entropy) if mbs else []
        total = int(sum(s.response_ids.shape[0] for s in samples))
        lp = self._gather_to_all(total, [o["logp"] for o in outs], mbs)
        ent = self._gather_to_all(total, [o["entropy"] for o in outs], mbs) if with_entropy else None
        lengths = np.cumsum([0] + [s.response_ids.shape[0] for s in samples])
        split = lambda t: [t[lengths[i]:lengths[i + 1]].cpu().numpy() for i in range(len(samples))]  # noqa: E731
        return (split(lp), split(ent)) if with_entropy else split(lp)

    def reference_logprobs(self, mini: RolloutBatch | ShardedBatch) -> list[np.ndarray]:
        """The frozen reference's float32 log-probs of the response tokens of every sample of the
        mini-batch, on every rank (``algo.kl.placement=reward``: trainer/kl_reward.py). ``mini`` as
        for :meth:`train_update`: each data-parallel rank runs its shard, in the micro-batches an
        update of it would use, and one all-reduce gathers the tokens. Forward only; collective."""
        if self.reference is None:
            raise ValueError("reference_logprobs needs the frozen reference: set algo.kl.coef > 0")
        return self._frozen_logprobs(self.reference, mini, "reference")

    def teacher_logprobs(self, mini: RolloutBatch | ShardedBatch) -> list[np.ndarray]:
        """The distillation teacher's float32 log-probs of the response tokens of every sample of the
        mini-batch, on every rank (``algo.distill.placement=advantage``: trainer/distill.py); as
        :meth:`reference_logprobs`. Forward only; collective."""
        if self.teacher is None:
            raise ValueError("teacher_logprobs needs the teacher: set algo.distill.teacher and algo.distill.coef > 0")
        return self._frozen_logprobs(self.teacher, mini, "teacher")

    def _frozen_logprobs(self, frozen, mini: RolloutBatch | ShardedBatch, phase: str) -> list[np.ndarray]:
        plan, samples = (mini.plan, mini.samples) if isinstance(mini, ShardedBatch) \
            else (BatchPlan.of(mini.samples), mini.samples)
        mbs = self._microbatches(samples, self._own_shard(plan, samples), plan)
        with TIMER.phase(phase):
            outs = frozen.logprobs(self, mbs)
        lp = self._gather_to_all(int(plan.response_lengths.sum()), outs, mbs).cpu().numpy()
        return np.split(lp, np.cumsum(plan.response_lengths)[:-1])

    def train_step(self, batch: RolloutBatch, num_minibatches: int = 1) -> list[dict[str, float]]:
        """``num_minibatches`` optimizer updates over consecutive equal parts of ``batch``.

        Returns one metrics dict per update, reduced across ranks as each metric declares.
        """
        return [self.train_update(mini) for mini in batch.split(num_minibatches)]

    def train_update(self, mini: RolloutBatch | ShardedBatch) -> dict[str, float]:
        """One optimizer update over one mini-batch: the whole of it (every rank the same
        ``RolloutBatch``), or, as a :class:`ShardedBatch`, its global plan plus the samples of
        this rank's data-parallel shard (``shards(plan)[dp_rank]``; the results are the same)."""
        for model in self.model:
            model.train()
        if isinstance(mini, ShardedBatch):
            return self._update(mini.plan, mini.samples)
        return self._update(BatchPlan.of(mini.samples), mini.samples)

    def _update(self, plan: BatchPlan, samples) -> dict[str, float]:
        """One optimizer update over the mini-batch of ``plan`` (module docstring, steps 1-5);
        ``samples[i]`` holds at least this rank's shard."""
        from megatron_m2po.algo.losses import loss_settings, resolve_loss

        spec = resolve_loss(self.cfg.algo)
        settings = loss_settings(spec, self.cfg.algo)
        mine = self._own_shard(plan, samples)
        denom = float(plan.num_response_tokens)  # global N (identical on all ranks: from the global plan)
        mbs = self._microbatches(samples, mine, plan)
        strategy = self.global_mask.choose(spec, settings)
        records: list[dict] = []
        # the frozen reference's log-probs of these micro-batches (algo.kl; actor/reference.py)
        refs: list = [None] * len(mbs)
        if self.reference is not None and self.cfg.algo.kl.placement == "loss":  # "reward": in the advantages
            with TIMER.phase("reference"):
                refs = self.reference.logprobs(self, mbs)
        teachers: list = [None] * len(mbs)  # algo.distill.placement=loss ("advantage": in the advantages)
        d = self.cfg.algo.distill
        if d.coef > 0 and d.placement == "loss":
            if self.teacher is not None:  # mode=megatron: the frozen teacher's pass
                with TIMER.phase("teacher"):
                    teachers = self.teacher.logprobs(self, mbs)
            else:  # mode=sglang: the scores stored with the trajectories, laid out as the policy's log-probs
                teachers = [mb.teacher_logprobs if self.is_last_stage else None for mb in mbs]
                if self.is_last_stage and any(t is None for t in teachers):
                    raise ValueError("algo.distill.mode=sglang with placement=loss: samples without stored teacher "
                                     "log-probs reached the update (the rollout service scores them at lease)")

        # 1. what the loss needs before the first backward (M2PO: the global mask, from a pre-pass;
        #    with strategy "correct" a provisional mask now and the exact one in step 3)
        keeps, mask_metrics = [None] * len(mbs), {}
        if strategy == "prepass":
            with TIMER.phase("mask"):
                keeps, mask_metrics = self.global_mask.prepass(
                    mbs, spec, settings, plan, records, measure=getattr(settings, "mask_strategy", None) == "auto")
        provisional: Optional[list[dict]] = [] if strategy == "correct" else None
        stash: Optional[list] = [] if spec.step_scale is not None else None

        # 2. forward-backward with the mask fixed (or provisional); the gradients stay unfinalised
        it, ref_it, teacher_it = iter(keeps), iter(refs), iter(teachers)
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        # Timed on the host without added syncs (utils/timing.py says what that means on a GPU).
        with TIMER.phase("forward_backward"):
            self.run_schedule(mbs, lambda mb, model, hidden: self._policy_loss(
                mb, model, hidden, next(it), spec=spec, settings=settings, denom=denom, records=records,
                strategy=strategy, provisional=provisional, stash=stash, ref_logp=next(ref_it),
                teacher_logp=next(teacher_it)),
                forward_only=False)

        # 3. the mask's gradient correction (strategy "correct"): the exact mask, and the gradient
        #    of (exact - provisional) added to the unfinalised gradients (actor/mask_correction.py)
        if provisional is not None:
            with TIMER.phase("mask"):
                mask_metrics = self.global_mask.correct(mbs, provisional, plan, samples, mine, spec, settings,
                                                        denom, records)

        # 4. Megatron's grad finaliser, once over the gradients of every pass
        with TIMER.phase("forward_backward"):
            self._finalize_grads()

        # 5. optimizer step
        scale, scale_metrics = self._step_scale(spec, settings, stash)
        self._set_update_lr(scale)
        with TIMER.phase("optimizer"):
            ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("the optimizer step was skipped (non-finite gradients)")
        self.version += 1
        out = self._update_metrics(plan, records, {**mask_metrics, **scale_metrics}, grad_norm)
        self.mask_hint = out
        return out

    def _own_shard(self, plan: BatchPlan, samples) -> list[int]:
        """This rank's mini-batch indices (``shards(plan)[dp_rank]``), after checking that the
        mini-batch can be split and trained on and that ``samples`` holds them."""
        dp = dist.get_world_size(self.pg.dp)
        if len(plan) < dp:
            raise ValueError(f"an optimizer mini-batch of {len(plan)} samples cannot be split over "
                             f"{dp} data-parallel ranks; use at least {dp} samples per update")
        if plan.num_response_tokens == 0:
            raise ValueError("the optimizer mini-batch has no response tokens with loss_mask=1")
        mine = self.shards(plan)[self.dp_rank]
        missing = [i for i in mine if i not in samples] if isinstance(samples, dict) else []
        if missing:
            raise ValueError(f"data-parallel rank {self.dp_rank} was sent a shard without mini-batch samples "
                             f"{missing[:5]}: send each rank actor.shards(plan)[its dp rank]")
        return mine

    def _finalize_grads(self) -> None:
        """Megatron's gradient finaliser over the gradients every pass of this update summed into
        the DDP buffers: the data-parallel all-reduce (or reduce-scatter for the distributed
        optimizer), the tensor-parallel all-reduce of the sequence-parallel and other non-TP
        parameters, the tied-embedding all-reduce across pipeline stages (megatron-core 0.16.1
        ``distributed/finalize_model_grads.py``). It is what the schedules call after their last
        backward when ``config.finalize_model_grads_func`` is set (``pipeline_parallel/schedules.py``,
        with the same process groups); the actor leaves it unset so that the correction pass of
        step 3 can add to the gradients first. No token count: the loss is already divided by
        the global ``N`` (module docstring), so nothing is rescaled."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(self.model, None, pg_collection=self.pg)

    def _step_scale(self, spec, settings, stash: Optional[list]) -> tuple[float, dict[str, float]]:
        """The factor on this update's scheduled LR (``LossSpec.step_scale``; 1.0 without one) and
        its metrics (global values). Computed on the last stage over the data-parallel group --
        the CP ranks of a replica hold the same per-sequence values -- and broadcast over the
        pipeline group, so that every rank of every stage gets the same float."""
        if spec.step_scale is None:
            return 1.0, {}
        scale, metrics = 1.0, {}
        if self.is_last_stage:
            scale, m = spec.step_scale(stash or [], settings, group=nontrivial(self.pg.dp))
            metrics = {k: float(v.value) for k, v in m.items()}
        scale, metrics = self._from_last_stage((scale, metrics))
        return float(scale), metrics

    def _from_last_stage(self, obj: Any) -> Any:
        """The last pipeline stage's ``obj`` on every stage (a picklable object; one broadcast over
        the pipeline group, none without pipelining)."""
        pp = self.pg.pp
        if dist.get_world_size(pp) == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=last_rank(pp), group=pp)
        return box[0]

    def _set_update_lr(self, scale: float) -> None:
        """Step the LR scheduler (update u runs at the LR of step u + 1, so warm-up starts above 0)
        and scale this update's LR by ``scale``: each parameter group gets ``scheduler.get_lr(group)
        * scale``, what Megatron's ``OptimizerParamScheduler.step`` sets times the factor. The next
        update's ``step`` sets the scheduled value again, and the scheduler's state (its step
        count, what checkpoints hold) never sees the factor."""
        self.scheduler.step(increment=1)
        if scale != 1.0:
            for group in self.optimizer.param_groups:
                group["lr"] = self.scheduler.get_lr(group) * scale

    def _policy_loss(self, mb: MicroBatch, model, hidden: torch.Tensor, keep: Optional[torch.Tensor], *, spec,
                     settings, denom: float, records: list[dict], strategy: Optional[str],
                     provisional: Optional[list[dict]] = None, stash: Optional[list] = None,
                     ref_logp: Optional[torch.Tensor] = None, teacher_logp: Optional[torch.Tensor] = None):
        """Megatron loss function of one micro-batch: ``(loss, n_tokens, None)``; its metric records
        (each declaring its reduction) go to ``records``. With ``provisional`` (a list), the keep
        mask is the spec's guess (``provisional_keep``) and the micro-batch's log-ratios, guess,
        log-probs and entropy are appended to it; its :class:`TokenRecord` then waits for the exact
        mask (``GlobalMask.correct``). With ``ref_logp`` (the frozen reference's log-probs of the
        micro-batch) the reference-KL term (``algo/kl.py``) is added to the loss, with ``teacher_logp``
        the distillation term (``algo/distill.py``); neither depends on the keep mask, so a mask
        correction pass never recomputes them."""
        from megatron_m2po.algo.losses import compute_policy_loss, tis_weights
        from megatron_m2po.algo.metrics import Metric

        a = self.cfg.algo
        logp, ent = self.token_logprobs(mb, model, hidden, with_entropy=True)
        behav, adv = mb.behav_logprobs.to(logp.dtype), mb.advantages.to(logp.dtype)
        metrics: dict = {}
        if keep is None and spec.needs_microbatch_mask(settings):  # this micro-batch on this rank only
            delta = (logp.detach() - behav).clamp(-a.logratio_clamp, a.logratio_clamp)
            keep, mask_metrics = spec.token_mask(delta, adv, mb.loss_mask, order_key=mb.token_index, group=None,
                                                 settings=settings)
            metrics.update(mask_metrics)
        if provisional is not None:
            delta = (logp.detach() - behav).clamp(-a.logratio_clamp, a.logratio_clamp)
            keep = self.global_mask.guess(spec, settings, mb, delta, provisional)
            provisional.append({"mb": mb, "delta": delta, "guess": keep, "logp": logp.detach(),
                                "entropy": ent.detach()})
        elif self.token_hook is not None:  # optional per-token record (trainer/token_dump.py)
            self.token_hook(TokenRecord(self.version, strategy, mb, logp.detach(), ent.detach(), keep))
        tis = None
        if a.tis and mb.engine_logprobs is not None:
            tis = tis_weights(behav, mb.engine_logprobs.to(logp.dtype), a.tis_cap)
        loss, lm = compute_policy_loss(spec.name, logp, behav, adv, mb.loss_mask, denominator=denom, algo_cfg=a,
                                       keep=keep, seq_index=mb.seq_index, tis_weight=tis,
                                       seq_group=nontrivial(self.pg.cp),
                                       num_seqs=len(mb.sample_index), stash=stash)
        metrics.update(lm)
        mask = mb.loss_mask.to(logp.dtype)
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * (ent * mask).sum() / denom
        if ref_logp is not None:  # after the loss's mask: M2PO's keep comes from logp - behav only
            from megatron_m2po.algo.kl import reference_kl

            kl_term, kl_metrics = reference_kl(logp, ref_logp, mb.loss_mask, denominator=denom, settings=a.kl)
            loss = loss + kl_term
            metrics.update(kl_metrics)
        if teacher_logp is not None:  # likewise after the mask: M2PO's mask stays on the policy ratio
            from megatron_m2po.algo.distill import distill_loss_term

            d = a.distill
            term, d_metrics = distill_loss_term(logp, teacher_logp, mb.loss_mask, denominator=denom, coef=d.coef,
                                                estimator=d.estimator)
            loss = loss + term
            metrics.update(d_metrics)
        n = float(mask.sum())
        metrics["policy/entropy"] = Metric(float((ent.detach() * mask).sum() / max(n, 1.0)), "mean", n)
        if mb.engine_logprobs is not None:  # KL(engine || trainer-behaviour), k1 on engine samples
            mis = mb.engine_logprobs.to(logp.dtype) - behav
            metrics["mismatch/train_vs_engine_kl"] = Metric(float((mis * mask).sum() / max(n, 1.0)), "mean", n)
        metrics["loss/total"] = Metric(float(loss.detach()), "sum")
        records.append(metrics)
        return loss, torch.tensor(mb.num_tokens, dtype=torch.int), None

    def _update_metrics(self, plan: BatchPlan, records: list[dict], prepass_metrics: dict,
                        grad_norm) -> dict[str, float]:
        """Metrics of one update: reduced on the last stage's DP x CP group as each record declares,
        then shared with the other pipeline stages."""
        from megatron_m2po.algo.diagnostics import finish_drift_metrics
        from megatron_m2po.algo.metrics import reduce_metrics
        out: dict[str, float] = {}
        if self.is_last_stage:
            out = finish_drift_metrics(reduce_metrics(records, group=nontrivial(self.pg.dp_cp)))
            out.update(prepass_metrics)
            if "loss/kl" in out:
                from megatron_m2po.algo.kl import penalty_share

                out["ref/penalty_share"] = penalty_share(out)
        out = dict(self._from_last_stage(out))
        if grad_norm is not None:
            out["optim/grad_norm"] = float(grad_norm)
        out["optim/lr"] = float(self.optimizer.param_groups[0]["lr"])
        out.update(self._staleness(plan, self.version - 1))
        return out

    @staticmethod
    def _staleness(plan: BatchPlan, update: int) -> dict[str, float]:
        counts = plan.version_counts
        if counts.sum() == 0:
            return {}
        versions = plan.version_base + np.arange(counts.shape[0])
        present = versions[counts > 0]
        mean_version = float((versions * counts).sum()) / float(counts.sum())
        return {"staleness/mean": float(update - mean_version), "staleness/max": float(update - present.min()),
                "staleness/min": float(update - present.max())}

    # ------------------------------------------------------------------- weights / checkpoints

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` with TP / PP shards gathered (collective: all ranks iterate)."""
        from megatron_m2po.actor.model import iter_hf_weights

        return iter_hf_weights(self.chunks, self.bridge)

    def save_checkpoint(self, path: str, extra_state: Optional[dict] = None) -> None:
        """Atomic checkpoint (weights, optimizer, RNG, version, ``extra_state``); updates ``<parent>/latest``."""
        from megatron_m2po.actor.checkpoint import save_checkpoint

        save_checkpoint(self, path, extra_state or {})

    def load_checkpoint(self, path: str, *, model_only: bool = False) -> dict:
        """Restore from ``path`` (a checkpoint, or its parent holding ``latest``); returns the extra state."""
        from megatron_m2po.actor.checkpoint import load_checkpoint

        return load_checkpoint(self, path, model_only=model_only)

    # ------------------------------------------------------------------- colocated: offload

    @property
    def offloaded(self) -> bool:
        """Whether :meth:`offload` took the training state off the device (until :meth:`reload`)."""
        off = getattr(self, "_offload", None)
        return off is not None and off.offloaded

    def _offloader(self):
        from megatron_m2po.actor.offload import TrainerOffload

        if getattr(self, "_offload", None) is None:
            self._offload = TrainerOffload(self.model, self.optimizer, self.device)
        return self._offload

    def offload_states(self):
        """Gradients and optimizer states off the device, the weights kept (readable: the
        colocated push runs between this and :meth:`offload`); returns the
        :class:`~megatron_m2po.actor.offload.OffloadRecord`. Rank-local; no update until :meth:`reload`."""
        with TIMER.phase("offload"):
            return self._offloader().offload_states()

    def offload(self):
        """Parameters, gradients and optimizer states off the device while colocated engines
        generate (``actor/offload.py``: Megatron's buffer offload plus the storages it misses), or
        what :meth:`offload_states` left. Returns the :class:`~megatron_m2po.actor.offload.OffloadRecord`
        (bytes released per kind, what stayed resident). Rank-local; nothing may read the weights
        until :meth:`reload`."""
        with TIMER.phase("offload"):
            return self._offloader().offload()

    def reload(self):
        """The state :meth:`offload` took, back on the device bit for bit (gradient buffers zeroed);
        returns its :class:`~megatron_m2po.actor.offload.OffloadRecord`."""
        off = getattr(self, "_offload", None)
        if off is None or not off.offloaded:
            raise RuntimeError("actor.reload() without a preceding actor.offload()")
        with TIMER.phase("reload"):
            return off.reload()

    def close(self) -> None:
        """Tear down the parallel state :meth:`from_config` set up (none when the caller did)."""
        if self.replay is not None:
            self.replay.close()
        if self.reference is not None:
            self.reference.close()
        if self.teacher is not None:
            self.teacher.close()
        if self._owns_parallel:
            destroy_parallel(self._owns_pg)
