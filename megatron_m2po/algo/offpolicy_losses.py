"""Off-policy corrections in the loss registry: ``icepop``, ``mis``, ``areal_m2po``, ``vcpo``
(docs/design.md §3, "Off-policy corrections"). ``algo.losses`` imports this module, so they are
registered wherever the registry is used.

Conventions of ``algo/losses.py`` hold: ``obj_i`` is summed over the loss tokens and divided by
the global number of response tokens of the optimizer mini-batch (where a source averages per
sequence first, ``1/G sum_i 1/|y_i| sum_t``, this is the project's token mean instead), and
``delta = clamp(logp - behav_logp, +-c)``, ``r = exp(delta)``.

The "old" / proximal policy of the PPO-style sources is the weights of this update: the actor
takes one optimizer step per mini-batch, at the weights its forward ran with, so the PPO ratio
``rho = pi_theta / pi_old = exp(logp - sg(logp))`` is exactly 1 with gradient ``grad logp``, and a
PPO clip of ``rho`` never binds. Where a source clips ``rho`` the clip is left out (same value,
same gradient); its importance weight against the behaviour policy is ``r`` at these weights,
detached where the source treats it as a weight. Behaviour policy = ``behav_logprobs`` (the
engine's log-probs, or the trainer's recomputation with ``algo.recompute_behav_logprobs``).

* ``icepop`` [``algo.icepop``] -- IcePop (Ling team, "Small Leak Can Sink a Great Ship -- Boost RL
  Training on MoE with IcePop!", ringtech.notion.site/icepop, 2025; used for Ring-1T, arXiv
  2510.18855). Their objective::

      J = E[ 1/G sum_i 1/|y_i| sum_t M(k_it; alpha, beta) * min(rho A, clip(rho, 1-eps, 1+eps) A) ]
      M(k) = k if alpha <= k <= beta else 0,   k = pi_train(y_t; theta_old) / pi_infer(y_t; theta_old)

  Here ``k = r``: ``obj = M(r) * rho * A``, gradient ``1[alpha <= r <= beta] r A grad logp``.
  ``alpha = 0.5, beta = 5`` are our defaults (the blog states none). Metrics:
  ``icepop/mask_frac`` (and ``_low_frac`` / ``_high_frac``), token means.
* ``mis`` [``algo.mis``] -- masked importance sampling (Liu, Li et al., "When Speed Kills
  Stability", 2025, Part 2, the Seq-MIS / token-MIS estimators; verl's rollout correction,
  ``docs/algo/rollout_corr_math.md`` §3.2.2-3.4, policy-gradient loss in bypass mode)::

      token:    g = sum_t sg(r_t 1[r_t <= C]) A_t grad log pi(y_t)
      sequence: g = sg(R 1[R <= C]) sum_t A_t grad log pi(y_t),   R = prod_t r_t (whole sequence)

  ``obj = sg(w) * rho * A``. ``mis/mask_frac``: token mean of the masked tokens.
* ``areal_m2po`` [``algo.areal_m2po``] -- AReaL's M2PO as merged in inclusionAI/AReaL PR 480
  (commit c431dd6, ``areal/engine/ppo/actor.py`` ``grpo_loss_fn`` + ``get_m2po_loss_mask``,
  ``areal/utils/functional.py`` ``ppo_actor_loss_fn`` with ``use_decoupled_loss``): the M2 mask
  over *all* loss tokens of ``(log pi_prox - log pi_behav)^2`` (no trust region; remove the
  largest until the mean of the rest is below tau, keep at least one: ``m2po_mask(region="all",
  keep_one=True)``), then decoupled PPO ``w * max(-A rho, -A clip(rho))`` with the behaviour weight
  ``w = pi_prox / pi_behav`` set to 0 above ``behav_imp_weight_cap``. Here ``pi_prox`` = this
  update's weights: ``obj = keep * 1[r <= cap] * sg(r) * rho * A``. Deliberate differences:
  ``scope=global`` (default) takes the mask over the whole mini-batch on every DP x CP rank,
  exact for every layout (``scope=microbatch`` is AReaL's per-loss-call mask); AReaL divides each
  micro-batch's loss by its *kept* token count and weights micro-batches by their valid count,
  which scales a micro-batch's kept tokens by ``n_valid / n_kept`` -- here every token counts
  ``1 / N`` as for ``m2po``; its ``< tau`` stop is ``<= tau`` here (m2_mask.py).
* ``vcpo`` [``algo.vcpo``] -- VCPO (Huang et al., arXiv 2602.17616; authors' code
  mit-han-lab/vcpo: ``recipe/fully_async_policy/staleness_utils.py`` ``compute_ess_info``,
  ``verl/workers/actor/megatron_actor.py`` ``_optimizer_step_with_buffer``, recipes
  ``shell/vcpo/math/vcpo_k=*.sh``). The update's step size is scaled by the effective sample size
  of the sequence-level importance weights (README eq. 1)::

      lr_update = lr * min(1, rho_ess / base) ** (1/2),   rho_ess = ESS / B = (sum_i w_i)^2 / (B sum_i w_i^2)

  with ``w_i = prod_t r_it`` over sequence ``i``'s loss tokens (the authors' ``rollout_seq_is``;
  ``ess_clipped``: ``min(w_i, C)``), ``B`` the sequences of the mini-batch with a loss token. The
  base objective is the authors' recipe: REINFORCE with the sequence-level truncated weight
  ``obj = sg(min(w_i, C)) * rho * A`` (``rollout_is=sequence``, threshold 8; their PPO clip is set
  to ``[0, 1e9]``). The ESS is exact over DP x CP: each sequence's log-weight is summed over its
  CP parts in the loss, the per-replica log-sum-exps are gathered over DP and combined in rank
  order on every rank (``step_scale``); the actor applies the factor to the scheduler's LR of this
  update only (``LossSpec.step_scale``). Metrics: ``vcpo/ess``, ``vcpo/ess_ratio``,
  ``vcpo/lr_scale`` (global), ``vcpo/is_trunc_frac`` (token mean).
  **Not implemented: the closed-form off-policy optimal baseline (OPOB, README eq. 2,
  ``compute_opob_baseline``)**, ``b = sum_i w_i^2 ||grad log pi(tau_i)||^2 R_i / sum_i w_i^2
  ||grad log pi(tau_i)||^2`` per prompt group: it needs each trajectory's own gradient norm (the
  authors run one backward per trajectory and keep per-trajectory gradient buffers) and each
  sample's group id in the actor; neither exists here yet (docs/design.md §3).

``oapl`` (Ritter et al., arXiv 2602.19362) is not registered: the public text reachable here (the
abstract and secondary summaries: "a KL-regularized advantage regression with a squared loss, no
importance sampling") does not give its objective, value estimate or hyperparameters, and no
authors' code was found; reconstructing it would be a guess (docs/design.md §3).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_m2po.algo.loss_settings import AReaLM2POConfig, IcePopConfig, MISConfig, VCPOConfig
from megatron_m2po.algo.m2_mask import m2po_mask
from megatron_m2po.algo.metrics import Metric
from megatron_m2po.algo.registry import LossInputs, Objective, register_loss
from megatron_m2po.parallel.devices import collective_device

__all__ = ["sequence_log_ratios", "ess_lr_scale"]


def _unit_ratio(x: LossInputs) -> torch.Tensor:
    """``rho = exp(logp - sg(logp))``: 1 in value, ``grad logp`` in gradient (the module docstring)."""
    return torch.exp(x.logp - x.logp.detach())


def sequence_log_ratios(x: LossInputs, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log_w, counts, seq)``: per sequence the sum of ``delta`` over its loss tokens (float64,
    detached) and its loss-token count, summed over ``x.seq_group`` (the CP ranks holding parts of
    it; one all-reduce), and each token's sequence id. Sequence ids are ``x.seq_index``
    (``0..num_seqs-1`` when ``num_seqs`` is given, required with ``seq_group``)."""
    if x.seq_index is None:
        raise ValueError(f"loss {name!r} needs seq_index= (an integer sequence id per token)")
    if x.num_seqs is not None:
        seq, n = x.seq_index.to(torch.int64), int(x.num_seqs)
    elif x.seq_group is not None:
        raise ValueError(f"loss {name!r} with seq_group= needs num_seqs= (the same on every rank of the group)")
    else:
        _, seq = torch.unique(x.seq_index, return_inverse=True)
        n = int(seq.max()) + 1 if seq.numel() else 0
    d = torch.where(x.mask, x.delta.detach().to(torch.float64), 0.0)
    both = torch.zeros(2, n, dtype=torch.float64, device=d.device)
    both[0].index_add_(0, seq, d)
    both[1].index_add_(0, seq, x.mask.to(torch.float64))
    if x.seq_group is not None:
        dev = collective_device(x.seq_group)
        both = both.to(dev)
        dist.all_reduce(both, group=x.seq_group)
        both = both.to(d.device)
    return both[0], both[1], seq


# ------------------------------------------------------------------------------------- IcePop


@register_loss("icepop", settings=IcePopConfig)
def _icepop(x: LossInputs, cfg: IcePopConfig) -> Objective:
    k = x.ratio.detach()
    low, high = k < cfg.low, k > cfg.high
    weight = torch.where(low | high, 0.0, k)  # M(k)
    return weight * _unit_ratio(x) * x.advantages, {
        "icepop/mask_frac": x.frac(low | high), "icepop/mask_low_frac": x.frac(low),
        "icepop/mask_high_frac": x.frac(high)}


# -------------------------------------------------------------------- masked importance sampling


@register_loss("mis", settings=MISConfig, needs_seq_index=True)
def _mis(x: LossInputs, cfg: MISConfig) -> Objective:
    log_c = math.log(cfg.threshold)
    if cfg.level == "token":
        log_w = x.delta.detach()
    else:
        log_w_seq, _, seq = sequence_log_ratios(x, "mis")
        log_w = log_w_seq[seq].to(x.delta.dtype)
    masked = log_w > log_c
    # exp only of kept values: a masked sequence ratio may overflow, and 0 * inf is NaN
    weight = torch.where(masked, 0.0, torch.exp(torch.minimum(log_w, torch.full_like(log_w, log_c))))
    return weight * _unit_ratio(x) * x.advantages, {"mis/mask_frac": x.frac(masked)}


# ------------------------------------------------------------------------- AReaL's M2PO (PR 480)


def _areal_mask(delta: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor, *, order_key, group,
                settings: AReaLM2POConfig) -> tuple[torch.Tensor, dict[str, Metric]]:
    keep, st = m2po_mask(delta, advantages, loss_mask, threshold=settings.threshold, rule="remove", group=group,
                         order_key=order_key, region="all", keep_one=True)
    return keep, {
        "areal_m2po/mask_frac": Metric(st.mask_frac, "mean", st.n_valid),
        "areal_m2po/m2_before": Metric(st.m2_before, "mean", st.n_trust),
        "areal_m2po/m2_after": Metric(st.m2_after, "mean", st.n_trust - st.n_masked),
        "areal_m2po/n_masked": Metric(st.n_masked, "sum")}


def _areal_scope(settings: AReaLM2POConfig) -> str:
    return settings.scope


@register_loss("areal_m2po", settings=AReaLM2POConfig, token_mask=_areal_mask, mask_scope=_areal_scope)
def _areal_m2po(x: LossInputs, cfg: AReaLM2POConfig) -> Objective:
    if x.keep is None:
        raise ValueError("loss 'areal_m2po' needs keep= (its M2 mask over the mini-batch, algo.m2_mask.m2po_mask "
                         "with region='all', keep_one=True)")
    w = x.ratio.detach()  # pi_prox / pi_behav
    metrics: dict[str, Metric] = {}
    if cfg.behav_imp_weight_cap is not None:
        over = w > cfg.behav_imp_weight_cap
        w = torch.where(over, 0.0, w)
        metrics["areal_m2po/behav_cap_frac"] = x.frac(over & x.keep)
    return x.keep.to(w.dtype) * w * _unit_ratio(x) * x.advantages, metrics


# ------------------------------------------------------------------------------------- VCPO


def ess_lr_scale(stash: list, settings: VCPOConfig, *, group=None) -> tuple[float, dict[str, Metric]]:
    """VCPO's step-size factor ``min(1, rho_ess / base) ** p`` (p = 1/2 for ``ess_rule=sqrt``) from
    the log-weights the objective stashed (one float64 tensor per micro-batch), over ``group``
    (the data-parallel group; None: this rank only). In log space, so that huge sequence ratios
    do not overflow: ``ESS = exp(2 LSE(log w) - LSE(2 log w))``. Each rank's two log-sum-exps and
    count are all-gathered and combined in rank order, so every rank gets the same bits. An
    update without sequences (all loss masks empty) keeps the LR (factor 1)."""
    lw = torch.cat([t.reshape(-1).to("cpu", torch.float64) for t in stash]) if stash else \
        torch.zeros(0, dtype=torch.float64)
    local = torch.tensor([float(torch.logsumexp(lw, 0)) if lw.numel() else -math.inf,
                          float(torch.logsumexp(2.0 * lw, 0)) if lw.numel() else -math.inf,
                          float(lw.numel())], dtype=torch.float64)
    rows = local[None]
    if group is not None:
        dev = collective_device(group)
        parts = [torch.empty(3, dtype=torch.float64, device=dev) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.to(dev), group=group)
        rows = torch.stack([p.cpu() for p in parts])
    n = float(rows[:, 2].sum())
    if n == 0:
        ess = ratio = 0.0
        scale = 1.0
    else:
        ess = math.exp(2.0 * float(torch.logsumexp(rows[:, 0], 0)) - float(torch.logsumexp(rows[:, 1], 0)))
        ratio = ess / n
        frac = min(1.0, ratio / settings.base_ess_ratio)
        scale = math.sqrt(frac) if settings.ess_rule == "sqrt" else frac
    return scale, {"vcpo/ess": Metric(ess, "max"), "vcpo/ess_ratio": Metric(ratio, "max"),
                   "vcpo/lr_scale": Metric(scale, "max")}


@register_loss("vcpo", settings=VCPOConfig, needs_seq_index=True, step_scale=ess_lr_scale)
def _vcpo(x: LossInputs, cfg: VCPOConfig) -> Objective:
    log_c = math.log(cfg.is_threshold)
    log_w, counts, seq = sequence_log_ratios(x, "vcpo")
    if x.stash is not None:  # the ESS of this update (ess_lr_scale), sequences with a loss token only
        ess_w = torch.clamp(log_w, max=log_c) if cfg.ess_clipped else log_w
        x.stash.append(ess_w[counts > 0].detach().cpu())
    truncated = log_w > log_c
    weight = torch.exp(torch.clamp(log_w, max=log_c)).to(x.delta.dtype)[seq]
    return weight * _unit_ratio(x) * x.advantages, {"vcpo/is_trunc_frac": x.frac(truncated[seq])}
