"""One typed configuration tree for the whole product.

A run is described by a YAML file whose top-level keys are the sections below (``model``,
``parallel``, ``algo``, ``optim``, ``rollout``, ``store``, ``data``, ``reward``, ``trainer``,
``checkpoint``, ``logging``), plus dotted command-line overrides::

    m2po train examples/tiny_cpu.yaml algo.m2po.threshold=0.02 trainer.mode=stale_k

Each section is a dataclass next to the code that reads it (``actor/settings.py``: model,
parallel, optim; ``algo/settings.py``; ``rollout/settings.py``; ``store/settings.py``;
``data/settings.py``; ``rewards/settings.py``; ``trainer/settings.py``: trainer, checkpoint,
logging), built on the machinery of ``utils/settings.py``. Every field carries its documentation
(``help``) and, where it has one, its allowed range or choices in the dataclass field metadata;
each section's ``validate()`` checks its own fields. This module composes the sections into
:class:`Config`, keeps the rules that span sections, and loads, overrides, migrates (renamed keys),
dumps and describes the tree. A violation raises :class:`ConfigError` (a ``ValueError``) naming
the dotted key, the value and what is allowed. Nothing in the library reads global arguments:
components receive the section they need.

Example:
    >>> cfg = load_config(None, ["algo.m2po.threshold=0.02", "trainer.mode=sync"])
    >>> cfg.algo.m2po.threshold
    0.02
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# The machinery first: importing a section's package runs its __init__, and rewards/__init__ reaches
# rewards/registry.py, which imports ConfigError from this (then half-initialised) module.
from megatron_m2po.utils.settings import (ConfigError, is_optional, section_from_dict, settings_from_dict,
                                          unknown_key)
from megatron_m2po.actor.settings import ModelConfig, MoEConfig, OptimConfig, ParallelConfig
from megatron_m2po.algo.loss_settings import (AReaLM2POConfig, CISPOConfig, GRPOConfig, GSPOConfig, IcePopConfig,
                                             KLConfig, M2POConfig, MISConfig, VCPOConfig)
from megatron_m2po.algo.settings import AlgoConfig
from megatron_m2po.data.settings import DataConfig
from megatron_m2po.rewards.settings import RewardConfig
from megatron_m2po.rollout.settings import AgenticConfig, RolloutConfig
from megatron_m2po.store.settings import StoreConfig
from megatron_m2po.trainer.settings import CheckpointConfig, LoggingConfig, TrainerConfig

__all__ = [
    "ConfigError",
    "ModelConfig",
    "MoEConfig",
    "ParallelConfig",
    "AlgoConfig",
    "OptimConfig",
    "AgenticConfig",
    "RolloutConfig",
    "StoreConfig",
    "DataConfig",
    "RewardConfig",
    "TrainerConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "M2POConfig",
    "GRPOConfig",
    "GSPOConfig",
    "CISPOConfig",
    "IcePopConfig",
    "MISConfig",
    "AReaLM2POConfig",
    "VCPOConfig",
    "KLConfig",
    "Config",
    "load_config",
    "config_from_dict",
    "config_to_dict",
    "apply_overrides",
    "dump_config",
    "settings_from_dict",
]


@dataclass
class Config:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> "Config":
        """Each section's own checks, then the rules that span sections; raises ConfigError naming the values."""
        for sect in dataclasses.fields(self):
            getattr(self, sect.name).validate()
        t, a = self.trainer, self.algo
        if self.store.max_staleness < t.stale_k + t.num_updates_per_step - 1 and t.mode == "stale_k":
            raise ConfigError(
                f"store.max_staleness={self.store.max_staleness} is below the largest staleness stale_k produces "
                f"(trainer.stale_k + updates per step - 1 = {t.stale_k + t.num_updates_per_step - 1}); raise it")
        if self.rollout.source == "external" and t.mode != "async":
            raise ConfigError(f"rollout.source=external needs trainer.mode=async (got {t.mode!r}): external "
                              "producers push whenever they like, so the store serves under store.max_staleness")
        if t.mode == "async" and self.rollout.colocate:
            raise ConfigError("rollout.colocate=true with trainer.mode=async: colocated engines release their memory "
                              "while the trainer trains, so they cannot generate continuously; use disaggregated "
                              "engines (rollout.colocate=false, engines on GPUs of their own) for async, or "
                              "trainer.mode=sync / stale_k with colocate")
        if t.mode == "async" and a.recompute_behav_logprobs:
            raise ConfigError("algo.recompute_behav_logprobs=true needs trainer.mode=sync or stale_k: in async mode the "
                              "trainer's weights are not the ones that generated the data")
        if self.rollout.n_samples_per_prompt == 1 and a.advantage.startswith("grpo"):
            raise ConfigError("rollout.n_samples_per_prompt=1 gives GRPO groups of one sample (all advantages 0); use >= 2")
        d = a.distill
        if d.coef > 0 and d.mode == "sglang" and self.rollout.temperature != 1.0:
            raise ConfigError(f"algo.distill.mode=sglang with rollout.temperature={self.rollout.temperature}: SGLang "
                              "scores input tokens from the raw logits (temperature 1), while the student's log-probs "
                              "are at the sampling temperature; use rollout.temperature=1 or algo.distill.mode=megatron")
        _check_routing_replay(self)
        _check_lora_push(self)
        return self

    # Convenience paths derived from run_dir.
    def resolved_path(self, value: str, default_name: str) -> Path:
        return Path(os.path.expanduser(value)) if value else Path(self.trainer.run_dir) / default_name


def _check_lora_push(cfg: "Config") -> None:
    """``model.lora.push=adapter`` needs engines that load adapters next to a base they keep; LoRA
    dropout cannot run under full recomputation. ``auto`` is resolved here, the one place its rule
    is written: ``adapter`` except for colocated engines (their in-node transfer carries full
    weights) and external producers (they load the published ``v<version>`` model directories),
    where the adapters are folded into the base (``merged``)."""
    lora, r = cfg.model.lora, cfg.rollout
    if lora.rank > 0 and lora.dropout > 0 and cfg.parallel.recompute == "full":
        # the adapters drop out in forwards that build gradients (actor/lora.py); a fully recomputed
        # layer runs its first forward without them, so the loss and the gradient would see
        # different functions
        raise ConfigError(f"model.lora.dropout={lora.dropout} with parallel.recompute=full: the recomputed "
                          "forward would drop out where the first one did not; set model.lora.dropout=0 or "
                          "parallel.recompute=selective / none")
    if lora.rank <= 0:
        return
    if lora.push == "auto":  # resolved here, once: every reader sees adapter or merged
        lora.push = "merged" if r.colocate or r.source == "external" else "adapter"
        if lora.push == "merged":
            return
    if lora.push == "merged":
        return
    if r.colocate:
        raise ConfigError("model.lora.push=adapter with rollout.colocate=true: colocated engines get full weights "
                          "through the in-node transfer; use model.lora.push=merged (or auto)")
    if r.source == "external":
        raise ConfigError("model.lora.push=adapter with rollout.source=external: external producers load the "
                          "published v<version> model directories; use model.lora.push=merged (or auto)")
    if lora.adapter_transport == "memory" and r.launcher != "local":
        raise ConfigError(f"model.lora.adapter_transport=memory with rollout.launcher={r.launcher}: shared-memory "
                          "handles reach engines on rank 0's node only; use rollout.launcher=local or "
                          "model.lora.adapter_transport=disk")


# --------------------------------------------------------------------------------------------
# Loading, overrides, migrations
# --------------------------------------------------------------------------------------------

# Keys that moved or went away: an old YAML file or override gets told what to write instead.
_MOVED = {
    "algo.m2_threshold": "algo.m2po.threshold", "algo.m2_rule": "algo.m2po.rule", "algo.m2_scope": "algo.m2po.scope",
    "algo.eps_low": "algo.grpo.eps_low", "algo.eps_high": "algo.grpo.eps_high", "algo.dual_clip_c": "algo.grpo.dual_clip",
    "algo.gspo_eps_low": "algo.gspo.eps_low", "algo.gspo_eps_high": "algo.gspo.eps_high",
    "algo.cispo_eps_high": "algo.cispo.eps_high",
}
_REMOVED = {
    "store.policy": "the trainer mode picks the consumption policy (sync / stale_k: exact stale-k; async: bounded "
                    "by store.max_staleness, store.order, store.retire_overage); delete the key",
    "logging.log_every_updates": "every optimizer update writes one metrics record; delete the key",
}


def _unknown_key(key: str, names, full: str | None = None) -> str:
    """The error text for an unknown dotted ``key`` (``full``: the whole override key): where a renamed
    key went, why a removed one went, else a did-you-mean."""
    full = full or key
    if key in _MOVED:
        return f"config key {full} was renamed to {_MOVED[key]}{full[len(key):]}"
    if key in _REMOVED:
        return f"config key {full} was removed: {_REMOVED[key]}"
    return unknown_key(key, names, full, _MOVED)


def _check_routing_replay(c: "Config") -> None:
    """``algo.routing_replay=rollout`` needs the engines' routed experts, an MoE model (checked when the model
    is built: ``actor/model.py``). Full recompute replays the backward FIFO (``actor/routing_replay.py``).
    Asking the engines for routed experts through sglang-router is refused by ``RolloutConfig.validate``."""
    a, m = c.algo, c.model
    if a.routing_replay == "none":
        return
    if not c.rollout.return_routed_experts:
        raise ConfigError("algo.routing_replay=rollout replays the experts the engines picked: it needs "
                          "rollout.return_routed_experts=true")
    if m.hf_path == "tiny" and m.tiny_family != "qwen3_moe":
        raise ConfigError(f"algo.routing_replay=rollout needs an MoE model; model.hf_path=tiny with "
                          f"model.tiny_family={m.tiny_family!r} is dense (use model.tiny_family=qwen3_moe)")


def config_from_dict(data: dict | None) -> Config:
    """Build and validate a Config from a nested dict (YAML content)."""
    return section_from_dict(Config, data or {}, "", _unknown_key).validate()


def config_to_dict(cfg: Any) -> dict:
    """Nested plain dict of a config (for YAML dumps and checkpoints)."""
    return dataclasses.asdict(cfg)


def _set_dotted(data: dict, dotted: str, raw: str) -> None:
    parts = dotted.split(".")
    node: Any = data
    cls: Any = Config
    for i, p in enumerate(parts):
        names = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if p not in names:
            raise ConfigError(_unknown_key(".".join(parts[:i + 1]), names, dotted))
        tp = typing.get_type_hints(cls)[p]
        if typing.get_origin(tp) is dict and i < len(parts) - 1:  # a free mapping: a.b.<key>[.<key>]=value
            for q in parts[i:-1]:
                if not isinstance(node.get(q), dict):
                    node[q] = {}
                node = node[q]
            node[parts[-1]] = yaml.safe_load(raw) if raw != "" else None
            return
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(tp):
                raise ConfigError(f"{dotted} is a section; override one of its fields, e.g. {dotted}.<field>=...")
            optional, inner = is_optional(tp)
            if inner is str:  # keep strings verbatim ("007" stays "007")
                node[p] = None if optional and raw.lower() in ("null", "none", "~") else raw
            else:
                node[p] = yaml.safe_load(raw) if raw != "" else None
        else:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
            cls = tp


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b=value`` overrides to a nested dict; values parse as YAML scalars."""
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} must look like section.key=value (e.g. algo.m2po.threshold=0.02)")
        key, raw = ov.split("=", 1)
        _set_dotted(data, key.strip(), raw.strip())
    return data


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config file (or the defaults when path is None) and apply dotted overrides."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections, got {type(data).__name__}")
    apply_overrides(data, list(overrides or []))
    return config_from_dict(data)


def dump_config(cfg: Config) -> str:
    """YAML text of a resolved config."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every field, for `m2po config --help`-style listings."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows += describe(hints[f.name], key + ".")
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            rows.append((key, repr(default), f.metadata.get("help", "")))
    return rows
