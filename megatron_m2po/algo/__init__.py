"""Pure tensor math of the algorithm (no Megatron import): M2PO mask, losses, advantages, metrics.

The names below load their module (and torch) on first use, so that ``megatron_m2po.config``
(which needs only ``algo.loss_settings``) and the torch-free CLI commands (``m2po store``,
``m2po plan``) start without importing torch."""

from __future__ import annotations

from megatron_m2po.utils.lazy import lazy_exports

_WHERE = {
    "grpo_advantages": "advantages",
    **{n: "losses" for n in ("LOSSES", "LossInputs", "LossSpec", "compute_policy_loss", "get_loss", "loss_settings",
                             "register_loss", "resolve_loss", "tis_weights")},
    "M2Stats": "m2_mask", "m2po_mask": "m2_mask",
    "Metric": "metrics", "merge_metrics": "metrics", "reduce_metrics": "metrics",
}
__all__ = list(_WHERE)
__getattr__ = lazy_exports(__name__, _WHERE)
