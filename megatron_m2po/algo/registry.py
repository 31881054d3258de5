"""The policy-loss registry: :class:`LossSpec`, :func:`register_loss`, lookup and plugins
(docs/design.md §3). The built-in losses register themselves in ``algo/losses.py`` and
``algo/offpolicy_losses.py``; ``algo.losses`` re-exports everything here, so plugins import
``register_loss`` / ``LossInputs`` from either module. Importing this module registers nothing.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megatron_m2po.algo.metrics import Metric

__all__ = ["LOSSES", "LossFn", "LossInputs", "LossSpec", "MaskFn", "Objective", "get_loss", "load_plugins",
           "loss_settings", "register_loss", "resolve_loss"]

Objective = tuple[torch.Tensor, dict[str, Metric]]


@dataclass
class LossInputs:
    """Validated, sanitised inputs shared by every loss (1-D, one entry per token)."""

    logp: torch.Tensor  # with grad; 0 on non-loss tokens
    behav_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor  # bool loss mask
    delta: torch.Tensor  # clamped log-ratio (with grad)
    ratio: torch.Tensor
    n_tokens: int
    keep: Optional[torch.Tensor]
    seq_index: Optional[torch.Tensor]
    seq_group: Any = None  # process group over which a sequence's tokens are split (CP), or None
    num_seqs: Optional[int] = None  # sequences of the call, ids 0..num_seqs-1 (required with seq_group)
    stash: Optional[list] = None  # per-update accumulator the actor hands a spec with step_scale

    def token_mean(self, x: torch.Tensor) -> Metric:
        x = x.detach().to(torch.float64)
        val = torch.where(self.mask, x, 0.0).sum() / max(self.n_tokens, 1)
        return Metric(val, "mean", weight=float(self.n_tokens))

    def frac(self, cond: torch.Tensor) -> Metric:
        return self.token_mean(cond.to(torch.float64))


LossFn = Callable[[LossInputs, Any], Objective]
# (delta, advantages, loss_mask, *, order_key, group, settings) -> (keep, metrics); see LossSpec.token_mask
MaskFn = Callable[..., tuple[torch.Tensor, dict[str, Metric]]]


@dataclass(frozen=True)
class LossSpec:
    """A registered policy loss and what it needs from the trainer.

    * ``objective(inputs, settings) -> (obj, metrics)``: the per-token objective (module docstring).
    * ``settings``: the loss's own settings dataclass, or None. A built-in loss reads the config
      section of its name (``algo.m2po``, ``algo.grpo``, ...); a plugin loss gets
      ``algo.loss_options`` parsed into this class (unknown keys, types, ``ge``/``gt`` field
      metadata and a ``check()`` method are enforced as for the rest of the config).
    * ``token_mask``: an optional per-token keep mask computed from the log-ratio *before* the
      loss, ``fn(delta, advantages, loss_mask, *, order_key, group, settings) -> (keep, metrics)``
      (M2PO's second-moment mask). ``group`` is the data x context parallel group the selection
      is global over (None: this tensor only); ``order_key`` the canonical token order for ties.
    * ``mask_scope(settings)``: ``"global"`` -- the mask is taken over the whole optimizer
      mini-batch on every DP x CP rank, which needs a forward-only pre-pass at the current weights
      before the first backward -- or ``"microbatch"`` (per micro-batch, per rank).
    * ``needs_seq_index``: the objective needs each token's sequence id (GSPO; under context parallelism
      the actor also passes the CP group its per-sequence sums are reduced over).
    * ``step_scale``: optional ``fn(stash, settings, *, group) -> (scale, metrics)``: the factor on
      the scheduled learning rate of *this* update (VCPO's ESS rule). The objective appends what
      it needs to ``LossInputs.stash`` on every micro-batch; after the update's forward-backward
      the actor calls this on the last pipeline stage with ``group`` = the data-parallel group
      (every context-parallel rank of a replica holds the same per-sequence values; None: one
      replica), sends the scale to the other stages and sets each parameter group's LR to the
      scheduler's value times it for the optimizer step only. ``scale`` must be the same on every
      rank (computed from reduced values); its metrics are global (reduce "max").
    * ``provisional_keep``: optional ``fn(delta, advantages, loss_mask, *, order_key, seen, settings)
      -> keep``, a guess of the global mask for one micro-batch from its log-ratios and ``seen``,
      the ``(delta, advantages, loss_mask, order_key)`` of this rank's earlier micro-batches. A
      spec that has it declares its objective *linear in
      keep* (``obj_i = keep_i * f_i``, ``f_i`` independent of the mask), which is what makes the
      actor's ``algo.m2po.mask_strategy=correct`` exact: forward-backward with the guess, then the
      exact global mask, then a forward-backward of ``keep_exact - keep_guess`` (+1 / -1 per token)
      on the sequences where they differ. The guess only decides how much is recomputed.
    """

    name: str
    objective: LossFn
    settings: Optional[type] = None
    token_mask: Optional[MaskFn] = None
    mask_scope: Callable[[Any], str] = lambda settings: "global"
    needs_seq_index: bool = False
    provisional_keep: Optional[Callable[..., torch.Tensor]] = None
    step_scale: Optional[Callable[..., tuple[float, dict[str, Metric]]]] = None

    def needs_global_mask_prepass(self, settings: Any) -> bool:
        """Whether the trainer must run the forward-only pre-pass and call ``token_mask`` over the
        whole mini-batch (across DP x CP) before forward-backward."""
        return self.token_mask is not None and self.mask_scope(settings) == "global"

    def needs_microbatch_mask(self, settings: Any) -> bool:
        """Whether ``token_mask`` is applied per micro-batch inside the loss (no pre-pass)."""
        return self.token_mask is not None and self.mask_scope(settings) == "microbatch"


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, *, settings: Optional[type] = None, token_mask: Optional[MaskFn] = None,
                  mask_scope: Optional[Callable[[Any], str]] = None, needs_seq_index: bool = False,
                  provisional_keep: Optional[Callable[..., torch.Tensor]] = None,
                  step_scale: Optional[Callable[..., tuple[float, dict[str, Metric]]]] = None
                  ) -> Callable[[LossFn], LossFn]:
    """Decorator adding ``fn(inputs: LossInputs, settings) -> (obj, metrics)`` to the registry.

    A plugin module (listed in ``algo.plugins``) calls it at import time::

        @dataclass
        class MySettings:
            scale: float = 1.0

        @register_loss("my_loss", settings=MySettings)
        def my_loss(x: LossInputs, s: MySettings):
            return s.scale * x.ratio * x.advantages, {}

    and is then selected with ``algo.loss=my_loss algo.loss_options.scale=2``. Registering a
    different function under a taken name raises ValueError (re-importing the same one is fine).
    """
    if settings is not None and not dataclasses.is_dataclass(settings):
        raise TypeError(f"register_loss({name!r}): settings must be a dataclass type, got {settings!r}")

    def deco(fn: LossFn) -> LossFn:
        prev = LOSSES.get(name)
        if prev is not None and _ident(prev.objective) != _ident(fn):
            raise ValueError(f"register_loss: {name!r} is already registered (by {prev.objective.__module__}."
                             f"{prev.objective.__qualname__})")
        LOSSES[name] = LossSpec(name, fn, settings, token_mask, mask_scope or (lambda s: "global"), needs_seq_index,
                                provisional_keep, step_scale)
        return fn

    return deco


def _ident(fn) -> tuple:
    code = getattr(fn, "__code__", None)
    return (fn.__qualname__, code.co_filename if code else fn.__module__)


def get_loss(name: str) -> LossSpec:
    """The registered :class:`LossSpec` called ``name``; ValueError with a did-you-mean otherwise."""
    try:
        return LOSSES[name]
    except KeyError:
        near = difflib.get_close_matches(name, LOSSES, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"unknown policy loss {name!r}; available: {sorted(LOSSES)}{hint} (a loss from a plugin "
                         "module needs that module in algo.plugins)") from None


def load_plugins(modules: list[str]) -> None:
    """Import the ``algo.plugins`` modules (dotted paths) so that their ``register_loss`` calls run."""
    for mod in modules:
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 - any import-time failure is the user's plugin
            raise ValueError(f"algo.plugins: cannot import {mod!r} ({type(e).__name__}: {e}); list importable "
                             "module paths such as my_pkg.losses (the package must be on PYTHONPATH or "
                             "installed)") from e


def resolve_loss(algo_cfg) -> LossSpec:
    """The spec ``algo_cfg.loss`` names, after importing ``algo_cfg.plugins``."""
    load_plugins(algo_cfg.plugins)
    return get_loss(algo_cfg.loss)


def loss_settings(spec: LossSpec, algo_cfg) -> Any:
    """The settings object ``spec`` reads: the config section ``algo.<name>`` for a built-in loss,
    ``algo.loss_options`` parsed into ``spec.settings`` for a plugin loss, None without settings."""
    if spec.settings is None:
        return None
    section = getattr(algo_cfg, spec.name, None)
    if isinstance(section, spec.settings):
        return section
    try:  # validated (did-you-mean, types, ranges, check()) when the config was loaded
        return spec.settings(**algo_cfg.loss_options)
    except TypeError as e:
        raise ValueError(f"algo.loss_options={algo_cfg.loss_options!r} do not fit the settings of loss "
                         f"{spec.name!r} ({spec.settings.__name__}): {e}") from None
