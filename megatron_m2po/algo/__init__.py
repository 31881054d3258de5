"""Pure tensor math of the algorithm (no Megatron import): M2PO mask, losses, advantages, metrics."""

from megatron_m2po.algo.advantages import grpo_advantages
from megatron_m2po.algo.losses import (LOSSES, LossInputs, LossSpec, compute_policy_loss, get_loss, loss_settings,
                                       register_loss, resolve_loss, tis_weights)
from megatron_m2po.algo.m2_mask import M2Stats, m2po_mask
from megatron_m2po.algo.metrics import Metric, merge_metrics, reduce_metrics

__all__ = ["grpo_advantages", "LOSSES", "LossInputs", "LossSpec", "compute_policy_loss", "get_loss", "loss_settings",
           "register_loss", "resolve_loss", "tis_weights",
           "M2Stats", "m2po_mask", "Metric", "merge_metrics", "reduce_metrics"]
