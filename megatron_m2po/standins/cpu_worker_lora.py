r"""LoRA serving in the CPU worker, as SGLang 0.5.23 serves it (``srt/lora/``).

The adapters' state and their application to the HF model; the routes are
``cpu_worker_lora_routes.py``. What it follows (file + function of the 0.5.23 wheel):

- Flags (``arg_groups/fields/lora.py``, checked by ``arg_groups/lora_hook.py``
  ``check_lora_server_args``): ``--enable-lora`` (implied by ``--lora-paths``), ``--max-lora-rank``,
  ``--lora-target-modules`` (``utils/common.py`` ``SUPPORTED_LORA_TARGET_MODULES`` or ``all``, which
  must stand alone), ``--lora-paths`` (``NAME=PATH``, ``PATH`` or JSON ``{lora_name, lora_path,
  pinned}``; ``argparse_actions.py`` ``LoRAPathAction``), ``--max-loras-per-batch`` (8, base model
  included), ``--max-loaded-loras``, ``--lora-backend`` (accepted; one CPU kernel). Without
  ``--lora-paths`` both ``--max-lora-rank`` and ``--lora-target-modules`` are needed; otherwise the
  missing ones come from the adapters (``lora_manager.py`` ``init_lora_shapes``: the union of their
  targets, the largest rank; with the flag given, an initial adapter outside it is an error).
- Target names are normalised as ``lora/utils.py`` ``get_normalized_target_modules`` does
  (q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj), so ``--lora-target-modules q_proj``
  admits an adapter on ``v_proj``, as SGLang's stacked qkv buffer does.
- A new adapter (``lora_manager.py`` ``validate_new_adapter`` + ``mem_pool.py`` ``can_support``):
  refused when it adds tokens, is DoRA, has a name already loaded, has ``r > --max-lora-rank`` or a
  target outside ``--lora-target-modules`` (an adapter whose ``target_modules`` is the string
  ``all-linear`` / ``all`` passes), or is pinned while ``max_loras_per_batch - 1`` are pinned.
- Scaling is ``lora_alpha / r`` (``lora.py`` ``LoRAAdapter.__init__``: ``use_rslora`` and
  ``rank_pattern`` are not read); each target module adds ``scaling * (x A^T) B^T`` to its output,
  per row of the batch, nothing for rows without an adapter.
- Weight names: ``layers.<i>.`` gives the layer (``layers/utils/common.py`` ``get_layer_id``), the
  module path after it and ``lora_A`` / ``lora_B`` the slot; names outside the server's targets are
  dropped, as SGLang's memory pool never reads them.
- Batching (``scheduler.py`` ``can_schedule_lora_req`` -> ``lora_manager.py``
  ``validate_lora_batch``): a waiting request joins the running batch when its adapter already
  runs there or the batch's distinct adapters (the base model counts as one) stay within
  ``--max-loras-per-batch`` (pinned adapters hold their own slots); otherwise it is skipped and
  waits.

- MoE experts (transformers' fused ``mlp.experts``, SGLang's ``FusedMoE``): served only when both
  ``gate_up_proj`` and ``down_proj`` are targets (``lora_manager.py`` wraps a ``FusedMoE`` only
  then; ``all`` adds both, ``utils.py`` ``auto_detect_lora_target_modules``), else their weights
  are ignored. Per-expert keys ``experts.{e}.{gate_proj|up_proj|gate_up_proj|down_proj}``
  (``mem_pool.py``: ``experts\.(\d+)\.``); ``lora.py`` ``normalize_gate_up_proj``: gate and up
  stack (a missing up is zeros; an up without its gate matches no target: the load fails), a fused
  ``gate_up_proj`` A serves both halves; experts absent from the adapter add nothing. Each token
  adds ``s B_e A_e`` to its experts' gate / up (before the activation) and down (then the routing
  weight), ``lora_moe_runners.py``.

Departures (clear errors, never silent): LoRA on ``embed_tokens`` / ``lm_head`` is refused (the
CPU worker hooks the linear projections and the experts only), as is SGLang's own 3-D expert
layout (``experts.gate_up_proj.lora_A.weight [E, r, in]``; per-expert keys are what trainers
send); adapters are read from a local directory only (SGLang would try the Hugging Face Hub).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch

# utils/common.py SUPPORTED_LORA_TARGET_MODULES and LORA_TARGET_ALL_MODULES
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj",
                     "kv_b_proj", "wq_b", "wk", "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                     "gate_up_proj", "embed_tokens", "lm_head", "qkvr", "wo_ud")
ALL = "all"
# lora/utils.py get_normalized_target_modules params_mapping (the leaves an HF decoder has)
_NORMAL = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
           "up_proj": "gate_up_proj", "vocab_emb": "embed_tokens", "embeddings": "embed_tokens",
           "word_embeddings": "embed_tokens", "output": "lm_head", "unembed_tokens": "lm_head",
           "q_a_proj": "fused_qkv_a_proj_with_mqa", "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa"}
_EMBEDDINGS = frozenset({"embed_tokens", "lm_head"})  # lora/utils.py EMBEDDING_NAMES
TENSOR_PATH = "__tensor__"  # io_struct.py LoadLoRAAdapterFromTensorsReqInput.to_ref: the lora_path
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."  # tokenizer_control_mixin.py
_NEEDS_SHAPE = ("When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
                "--lora-target-modules for LoRA initialization.")  # lora_hook.py check_lora_server_args
_WEIGHT = re.compile(r"layers\.(\d+)\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")
_EXPERT = re.compile(r"^(?P<mod>.*experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|gate_up_proj|down_proj)$")
_EXPERT_TARGETS = {"gate_up_proj", "down_proj"}  # both, or the experts are not wrapped


class LoRAStartError(RuntimeError):
    """The initial adapters cannot be served: SGLang's launch fails (``lora_manager.py`` ``init_state``)."""


def normalized_targets(targets: Any) -> set[str]:
    """``lora/utils.py`` ``get_normalized_target_modules``: leaf names -> SGLang's module names;
    the string ``all`` / ``all-linear`` -> ``{"all"}``."""
    if isinstance(targets, str):
        if targets not in ("all", "all-linear"):
            raise ValueError("Only 'all' or 'all-linear' can be used as the string for target module")
        return {ALL}
    return {_NORMAL.get(t.split(".")[-1], t.split(".")[-1]) for t in targets}


def initial_lora_id(name: str, path: str) -> str:
    """``lora_registry.py`` ``LoRARef.deterministic_id``: the id of a ``--lora-paths`` adapter."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{name}\0{path}").hex


@dataclass
class LoRASettings:
    """The resolved LoRA flags (``check_lora_server_args``)."""

    max_lora_rank: Optional[int]
    target_modules: Optional[set[str]]  # as given (normalised later), None: from the adapters
    max_loras_per_batch: int = 8
    max_loaded_loras: Optional[int] = None
    lora_paths: list[tuple[str, str, bool]] = field(default_factory=list)  # (name, path, pinned)


def add_args(p: argparse.ArgumentParser) -> None:
    """SGLang's LoRA flags (``arg_groups/fields/lora.py``)."""
    p.add_argument("--enable-lora", action="store_true", default=None,
                   help="SGLang's flag: serve LoRA adapters (implied by --lora-paths).")
    p.add_argument("--max-lora-rank", type=int, default=None)
    p.add_argument("--lora-target-modules", nargs="*", default=None, choices=list(SUPPORTED_TARGETS) + [ALL])
    p.add_argument("--lora-paths", nargs="*", default=None,
                   help="NAME=PATH | PATH | JSON {lora_name, lora_path, pinned}, loaded at start.")
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--max-loaded-loras", type=int, default=None)
    p.add_argument("--lora-backend", default="csgmv", choices=["triton", "csgmv", "ascend", "torch_native", "triton_v2"],
                   help="Accepted for SGLang's command lines; the CPU worker has one kernel.")


def _parse_path(item: str) -> tuple[str, str, bool]:
    """``LoRAPathAction`` + ``check_lora_server_args``: one ``--lora-paths`` entry."""
    item = item.strip()
    if item.startswith("{") and item.endswith("}"):
        obj = json.loads(item)
        if "lora_path" not in obj or "lora_name" not in obj:
            raise ValueError(f"{item!r} looks like a JSON str, but it does not contain 'lora_name' and 'lora_path' keys.")
        return str(obj["lora_name"]), str(obj["lora_path"]), bool(obj.get("pinned", False))
    if "=" in item:
        name, path = item.split("=", 1)
        return name, path, False
    return item, item, False


def settings_from_args(args: argparse.Namespace) -> Optional[LoRASettings]:
    """``arg_groups/lora_hook.py`` ``check_lora_server_args``; None when LoRA is off. ``ValueError``
    with SGLang's message where its launch fails."""
    if args.max_loras_per_batch <= 0:
        raise ValueError("max_loras_per_batch must be positive")
    if not (args.enable_lora or args.lora_paths):
        return None
    paths = [_parse_path(p) for p in (args.lora_paths or [])]
    targets = set(args.lora_target_modules) if args.lora_target_modules else None
    if targets and ALL in targets and len(targets) != 1:
        raise ValueError("If 'all' is specified in --lora-target-modules, it should be the only module specified.")
    if not paths and not (args.max_lora_rank and targets):
        raise ValueError(_NEEDS_SHAPE)
    if args.max_loaded_loras is not None:
        if args.max_loaded_loras < args.max_loras_per_batch:
            raise ValueError("max_loaded_loras should be greater than or equal to max_loras_per_batch. "
                             f"max_loaded_loras={args.max_loaded_loras}, max_loras_per_batch={args.max_loras_per_batch}")
        if len(paths) > args.max_loaded_loras:
            raise ValueError("The number of LoRA paths should not exceed max_loaded_loras. "
                             f"max_loaded_loras={args.max_loaded_loras}, lora_paths={len(paths)}")
    if targets and targets & _EMBEDDINGS:
        raise ValueError(f"--lora-target-modules {sorted(targets & _EMBEDDINGS)}: the CPU worker serves LoRA on the "
                         "linear projections only (no embed_tokens / lm_head adapters); drop them from the flag")
    return LoRASettings(args.max_lora_rank, targets, args.max_loras_per_batch, args.max_loaded_loras, paths)


@dataclass
class Adapter:
    """One loaded adapter (``LoRARef`` + its weights): ``weights`` maps an HF module name to
    ``(A [r, in], B [out, r])``."""

    lora_id: str
    name: str
    path: str
    pinned: bool
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    # experts module name -> expert -> {"gate" / "up" / "down": (A, B)}
    experts: dict[str, dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]] = field(default_factory=dict)
    # What every TP rank loaded from /load_lora_adapter_from_tensors, kept until the adapter is
    # unloaded (lora.py _process_weight keeps loaded_weight.cpu(): for a CPU tensor its storage).
    sources: Any = None


class RankTensors(dict):
    """Rank 0's adapter tensors (name -> tensor), holding what every rank read (``ranks``)."""

    def __init__(self, tensors, *, ranks: list) -> None:
        super().__init__(tensors)
        self.ranks = ranks


def read_adapter_dir(path: str) -> tuple[dict, dict[str, torch.Tensor], Optional[dict]]:
    """A PEFT directory: ``(adapter_config.json, tensors, added_tokens.json or None)`` (``lora_config.py``
    ``LoRAConfig`` and the loader's ``_get_weights_iterator``: safetensors, else ``.bin`` / ``.pt``)."""
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is not a directory (the CPU worker reads local PEFT "
                         "directories only; SGLang would try the Hugging Face Hub)")
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    added = None
    if os.path.exists(os.path.join(path, "added_tokens.json")):
        with open(os.path.join(path, "added_tokens.json")) as f:
            added = json.load(f)
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors.torch import load_file
        for fn in files:
            tensors.update(load_file(fn))
    else:
        for fn in sorted(glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))):
            tensors.update(torch.load(fn, map_location="cpu", weights_only=True))
    if not tensors:
        raise ValueError(f"Cannot find any model weights with `{path}`")
    return config, tensors, added


class LoRAServing:
    """The adapters of one engine: the backend's loaded set (``lora_manager.py``), the tokenizer
    manager's registry (``lora_registry.py``: names in LRU order, in-flight counts per ``lora_id``),
    and forward hooks that add each row's adapter to the target modules.

    Threads: :meth:`load_backend`, :meth:`unload_backend` and the forwards run on the model thread;
    the registry methods on the event loop (``cpu_worker_lora_routes.py``)."""

    def __init__(self, model: torch.nn.Module, settings: LoRASettings) -> None:
        self.settings = settings
        self.max_loras_per_batch = settings.max_loras_per_batch
        self.max_loaded_loras = settings.max_loaded_loras
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        # (layer, path inside the layer) -> (HF module name, module) of every Linear in a decoder layer
        self._linears: dict[tuple[int, str], tuple[str, torch.nn.Linear]] = {}
        for name, mod in model.named_modules():
            m = re.search(r"layers\.(\d+)\.(.+)$", name)
            if m and isinstance(mod, torch.nn.Linear):
                self._linears[(int(m.group(1)), m.group(2))] = (name, mod)
        self._names = {id(mod): name for name, mod in self._linears.values()}
        self._modules = {name: mod for name, mod in self._linears.values()}
        # (layer, path inside the layer) -> (name, module) of every fused experts module (3-D gate_up_proj)
        self._experts: dict[tuple[int, str], tuple[str, torch.nn.Module]] = {}
        for name, mod in model.named_modules():
            m = re.search(r"layers\.(\d+)\.(.+)$", name)
            gu = getattr(mod, "gate_up_proj", None)
            if m and isinstance(gu, torch.nn.Parameter) and gu.dim() == 3:
                self._experts[(int(m.group(1)), m.group(2))] = (name, mod)
        self._expert_names = {id(mod): name for name, mod in self._experts.values()}
        self._expert_modules = {name: mod for name, mod in self._experts.values()}
        self.loaded: dict[str, Adapter] = {}  # lora_id -> adapter (the backend's lora_refs + weights)
        self.num_pinned = 0
        self._rows: Optional[list[Optional[Adapter]]] = None  # the running forward's adapter per row
        # the registry: name -> lora_id (LRU order), the path and pinned flag of every name ever loaded
        self.registry: OrderedDict[str, str] = OrderedDict()
        self.ref_cache: dict[str, tuple[str, bool]] = {}
        self.inflight: dict[str, int] = {}
        configs = self._load_initial(settings.lora_paths)
        self.target_modules = self._resolve_targets(settings.target_modules, configs)
        self.max_lora_rank = settings.max_lora_rank if settings.max_lora_rank is not None else max(
            [int(c["r"]) for c in configs.values()], default=0)
        self._hooked = {name for (_, sub), (name, _) in self._linears.items() if self._targeted(sub)}
        for (_, sub), (_, mod) in self._linears.items():
            if self._targeted(sub):
                mod.register_forward_hook(self._hook)
        self.experts_served = ALL in self.target_modules or _EXPERT_TARGETS <= self.target_modules
        if self.experts_served:
            for _, mod in self._experts.values():
                mod.register_forward_hook(self._experts_hook)
        for a in self.loaded.values():  # weights of the initial adapters outside the final targets
            a.weights = {n: w for n, w in a.weights.items() if n in self._hooked}
            if not self.experts_served:
                a.experts = {}

    # ---------------------------------------------------------------- start-up
    def _load_initial(self, paths: list[tuple[str, str, bool]]) -> dict[str, dict]:
        """``lora_manager.py`` ``init_lora_adapters``: each ``--lora-paths`` adapter, before the
        pool exists (no rank / target check yet); ids are ``LoRARef.deterministic_id``."""
        configs = {}
        for name, path, pinned in paths:
            lora_id = initial_lora_id(name, path)
            try:
                config, tensors, added = read_adapter_dir(path)
                self._check_new(name, config, added, pinned, with_pool=False)
                self._add(self._build(lora_id, name, path, pinned, config, tensors, targets=None))
            except (OSError, ValueError) as e:
                raise LoRAStartError(f"Failed to load LoRA adapter {name}: {e}") from None
            configs[name] = config
            self.registry[name] = lora_id
            self.ref_cache[name] = (path, pinned)
            self.inflight[lora_id] = 0
        return configs

    def _resolve_targets(self, given: Optional[set[str]], configs: dict[str, dict]) -> set[str]:
        """``lora_manager.py`` ``init_lora_shapes``: the pool's normalised targets."""
        linear = {_NORMAL.get(sub.split(".")[-1], sub.split(".")[-1]) for _, sub in self._linears}
        if self._experts:  # auto_detect_lora_target_modules: a FusedMoE adds gate_up_proj and down_proj
            linear |= _EXPERT_TARGETS
        if given == {ALL}:
            targets = set(linear)  # auto_detect_lora_target_modules (embeddings: see the docstring)
        else:
            targets = normalized_targets(given) if given else set()
        for name, c in configs.items():
            tm = c.get("target_modules")
            if isinstance(tm, str):
                if tm not in ("all-linear", "all"):
                    raise LoRAStartError(f"SGLang does not recognize target_modules='{tm}'. Please use a list of module "
                                       "name suffixes in the adapter's PEFT config, or explicitly specify "
                                       "--lora-target-modules during server startup.")
                if given is None:
                    targets |= linear
                continue
            adapter = normalized_targets(tm or [])
            if given is not None and not adapter <= targets:
                raise LoRAStartError(
                    f"LoRA adapter '{name}' contains target modules {sorted(adapter - targets)} that are not included "
                    f"in the specified --lora-target-modules {sorted(targets)}. Please update --lora-target-modules "
                    f"to include all required modules: {sorted(targets | adapter)}, or use 'all' to enable all "
                    "supported modules.")
            if given is None:
                targets |= adapter
        if targets & _EMBEDDINGS:
            raise LoRAStartError(f"LoRA on {sorted(targets & _EMBEDDINGS)}: the CPU worker serves LoRA on the linear "
                               "projections only (no embed_tokens / lm_head adapters)")
        return targets

    def _targeted(self, sub: str) -> bool:
        leaf = sub.split(".")[-1]
        return _NORMAL.get(leaf, leaf) in self.target_modules

    # ---------------------------------------------------------------- the backend (model thread)
    def loaded_adapters(self) -> dict[str, str]:
        """``lora_manager.py`` ``create_lora_update_result``: ``{name: path}`` of the loaded adapters."""
        return {a.name: a.path for a in self.loaded.values()}

    def _check_new(self, name: str, config: dict, added: Optional[dict], pinned: bool, with_pool: bool = True) -> None:
        """``lora_manager.py`` ``validate_new_adapter`` (+ ``LoRAAdapter.__init__``'s peft_type check)."""
        if str(config.get("peft_type", "LORA")).lower() != "lora":
            raise ValueError(f"Failed to load {name}: peft_type={config.get('peft_type')!r}; SGLang serves LoRA "
                             "adapters only (lora.py asserts peft_type == 'lora')")
        for key in ("r", "lora_alpha", "target_modules"):
            if key not in config:
                raise ValueError(f"Failed to load {name}: adapter_config has no {key!r} (a PEFT LoRA config has it)")
        if added and any(int(i) >= self.vocab_size for i in added.values()):
            raise ValueError(f"Failed to load {name} because LoRA serving currently doesn't support adapters that "
                             "add tokens to the vocabulary")
        if config.get("use_dora", False):
            raise ValueError(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
        if any(a.name == name for a in self.loaded.values()):
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
        if with_pool and not self._can_support(config):
            raise ValueError(
                f"LoRA adapter {name} with rank {config['r']} is incompatible with the current LoRA memory pool "
                "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
        if pinned and self.num_pinned >= self.max_loras_per_batch - 1:
            raise ValueError(
                f"Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to pin all slots in the "
                "LoRA memory pool to avoid starvation for unpinned adapters and base models. Please increase your "
                "`--max-loras-per-batch` or load it as unpinned LoRA adapters.")

    def _can_support(self, config: dict) -> bool:
        """``mem_pool.py`` ``LoRAMemoryPool.can_support``."""
        if int(config["r"]) > self.max_lora_rank:
            return False
        targets = normalized_targets(config["target_modules"])
        return ALL in targets or targets <= self.target_modules

    def _build(self, lora_id: str, name: str, path: str, pinned: bool, config: dict,
               tensors: dict[str, torch.Tensor], targets: Optional[set[str]]) -> Adapter:
        """The adapter's (A, B) per HF module, fp32; with ``targets`` (the pool's, known once the
        initial adapters are read) the weights outside them are dropped."""
        parts: dict[str, dict[str, torch.Tensor]] = {}
        expert_parts: dict[str, dict[int, dict[str, dict[str, torch.Tensor]]]] = {}
        for wname, t in tensors.items():
            m = _WEIGHT.search(wname)
            if m is None:
                if any(e in wname for e in _EMBEDDINGS) and "lora" in wname:
                    raise ValueError(f"{wname}: the CPU worker serves LoRA on the linear projections only "
                                     "(no embed_tokens / lm_head adapters)")
                continue  # lora.py _process_weight: names without a layer are not loaded
            layer, sub = int(m.group(1)), m.group(2)
            em = _EXPERT.match(sub)
            if em is not None or (layer, sub.rsplit(".", 1)[0]) in self._experts:
                self._expert_weight(wname, t, layer, sub, em, m.group(3), targets, expert_parts)
                continue
            if targets is not None and not self._targeted(m.group(2)):
                continue  # outside the pool's targets: SGLang's memory pool never reads it
            hit = self._linears.get((int(m.group(1)), m.group(2)))
            if hit is None:
                raise ValueError(f"{wname}: no nn.Linear 'layers.{m.group(1)}.{m.group(2)}' in the model (the CPU "
                                 "worker hooks the decoder layers' linear projections; fused MoE experts are not)")
            parts.setdefault(hit[0], {})[m.group(3)] = t.detach().to(torch.float32).clone()
        weights = {}
        for mod_name, ab in parts.items():
            mod = self._modules[mod_name]
            a, b = ab.get("A"), ab.get("B")
            if a is None or b is None:
                raise ValueError(f"{mod_name}: the adapter has lora_{'A' if a is None else 'B'} missing")
            if a.shape[1] != mod.in_features or b.shape[0] != mod.out_features or a.shape[0] != b.shape[1]:
                raise ValueError(f"{mod_name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the "
                                 f"module ({mod.in_features} -> {mod.out_features})")
            weights[mod_name] = (a, b)
        r = int(config["r"])
        experts = self._expert_pairs(expert_parts, r)
        return Adapter(lora_id, name, path, pinned, r, float(config["lora_alpha"]) / r, weights, experts)

    def _expert_weight(self, wname: str, t: torch.Tensor, layer: int, sub: str, em, which: str,
                       targets: Optional[set[str]], out: dict) -> None:
        """Collect one expert adapter tensor (module docstring); SGLang's own 3-D layout and peft's
        ``target_parameters`` keys are refused by name."""
        if em is None:
            raise ValueError(f"{wname}: expert adapters without an expert index (SGLang's 3-D layout, or peft's "
                             "target_parameters keys such as mlp.experts.base_layer.lora_A, which SGLang 0.5.23 does "
                             "not read) are not served by the CPU worker; send per-expert keys "
                             "...mlp.experts.<e>.gate_up_proj / down_proj.lora_A / lora_B.weight")
        mod_key = (layer, em["mod"])
        if mod_key not in self._experts:
            raise ValueError(f"{wname}: no experts module 'layers.{layer}.{em['mod']}' in the model")
        if targets is not None and not self.experts_served:
            return  # the experts are not wrapped (lora_manager.py): their weights are never read
        name = self._experts[mod_key][0]
        out.setdefault(name, {}).setdefault(int(em["e"]), {}).setdefault(em["proj"], {})[which] = \
            t.detach().to(torch.float32).clone()

    def _expert_pairs(self, parts: dict, r: int) -> dict:
        """``normalize_gate_up_proj`` per expert, shapes checked against the experts module:
        ``{module: {expert: {"gate" / "up" / "down": (A [r, in], B [out, r])}}}``."""
        out: dict = {}
        for mod_name, experts in parts.items():
            mod = self._expert_modules[mod_name]
            n, hidden, inter = mod.gate_up_proj.shape[0], mod.gate_up_proj.shape[2], mod.down_proj.shape[2]
            for e, projs in experts.items():
                if e >= n:
                    raise ValueError(f"{mod_name}.{e}: the model has {n} experts")
                for proj, ab in projs.items():
                    if set(ab) != {"A", "B"}:
                        raise ValueError(f"{mod_name}.{e}.{proj}: the adapter has lora_{'B' if 'A' in ab else 'A'} missing")
                pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
                if "gate_up_proj" in projs:  # fused: A serves both halves, B is [gate; up]
                    a, b = projs["gate_up_proj"]["A"], projs["gate_up_proj"]["B"]
                    if b.shape[0] != 2 * inter:
                        raise ValueError(f"{mod_name}.{e}.gate_up_proj: lora_B {tuple(b.shape)} is not [2 x {inter}, r]")
                    pairs["gate"], pairs["up"] = (a, b[:inter]), (a, b[inter:])
                elif "gate_proj" in projs:
                    g = projs["gate_proj"]
                    u = projs.get("up_proj") or {"A": torch.zeros_like(g["A"]), "B": torch.zeros_like(g["B"])}
                    pairs["gate"], pairs["up"] = (g["A"], g["B"]), (u["A"], u["B"])
                elif "up_proj" in projs:
                    raise ValueError(f"Cannot find target module name for {mod_name}.{e}.up_proj (an up_proj without "
                                     "its gate_proj is not stacked: lora.py normalize_gate_up_proj; send gate_proj too)")
                if "down_proj" in projs:
                    pairs["down"] = (projs["down_proj"]["A"], projs["down_proj"]["B"])
                for proj, (a, b) in pairs.items():
                    fin, fout = (inter, hidden) if proj == "down" else (hidden, inter)
                    if a.shape != (r, fin) or b.shape != (fout, r):
                        raise ValueError(f"{mod_name}.{e}.{proj}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do "
                                         f"not fit the expert ({fin} -> {fout}) at rank {r}")
                out.setdefault(mod_name, {})[e] = pairs
        return out


    def _add(self, adapter: Adapter) -> None:
        self.loaded[adapter.lora_id] = adapter
        self.num_pinned += int(adapter.pinned)

    def load_backend(self, lora_id: str, name: str, path: str, pinned: bool,
                     source: Optional[tuple[dict, dict, Optional[dict]]] = None) -> dict:
        """``lora_manager.py`` ``_load_lora_adapter`` / ``_load_lora_adapter_from_tensors``: a
        ``LoRAUpdateOutput`` dict; ``source`` = (config, tensors, added tokens) from tensors, else
        read from ``path``."""
        try:
            config, tensors, added = source if source is not None else read_adapter_dir(path)
            self._check_new(name, config, added, pinned)
            adapter = self._build(lora_id, name, path, pinned, config, tensors, self.target_modules)
            adapter.sources = getattr(tensors, "ranks", None)
            self._add(adapter)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # lora_manager.py: any Exception
            return self.result(False, str(e))
        return self.result(True)

    def unload_backend(self, lora_id: str) -> dict:
        """``lora_manager.py`` ``_unload_lora_adapter``."""
        adapter = self.loaded.pop(lora_id, None)
        if adapter is not None:
            self.num_pinned -= int(adapter.pinned)
        return self.result(True)

    def result(self, success: bool, error_message: str = "") -> dict:
        return {"success": success, "error_message": error_message, "loaded_adapters": self.loaded_adapters()}

    # ---------------------------------------------------------------- scheduling and forwards (model thread)
    def fits(self, lora_ids: set) -> bool:
        """``lora_manager.py`` ``validate_lora_batch``: these adapters (None = base) in one batch."""
        if len(lora_ids) > self.max_loras_per_batch:
            return False
        if self.num_pinned == 0:
            return True
        pinned = sum(int(self.loaded[i].pinned) for i in lora_ids if i is not None and i in self.loaded)
        return len(lora_ids) - pinned <= self.max_loras_per_batch - self.num_pinned

    def admit(self, waiting: list, room: int, running: Iterable[Optional[str]]) -> tuple[list, list]:
        """``scheduler.py`` ``get_new_batch_prefill`` + ``can_schedule_lora_req``: up to ``room``
        waiting requests (in order) whose adapter fits beside ``running``; the rest keep waiting."""
        ids, new, rest = set(running), [], []
        for s in waiting:
            if len(new) < room and (s.lora_id in ids or self.fits(ids | {s.lora_id})):
                ids.add(s.lora_id)
                new.append(s)
            else:
                rest.append(s)
        return new, rest

    @contextlib.contextmanager
    def rows(self, lora_ids: list[Optional[str]]):
        """Within: the forward's row ``i`` runs under adapter ``lora_ids[i]`` (None: the base)."""
        rows = [self.loaded.get(i) if i is not None else None for i in lora_ids]
        self._rows = rows if any(a is not None for a in rows) else None
        try:
            yield
        finally:
            self._rows = None

    def _hook(self, module: torch.nn.Linear, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        rows = self._rows
        if rows is None:
            return output
        x, name = inputs[0], self._names[id(module)]
        groups: dict[int, tuple[Adapter, list[int]]] = {}
        for i, a in enumerate(rows):
            if a is not None and name in a.weights:
                groups.setdefault(id(a), (a, []))[1].append(i)
        for a, idx in groups.values():
            A, B = a.weights[name]
            sel = torch.tensor(idx, dtype=torch.long)
            delta = (x.index_select(0, sel) @ A.t()) @ B.t()
            output.index_add_(0, sel, delta * a.scaling)
        return output

    def _experts_hook(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        """Rows with an adapter on these experts: their tokens' outputs recomputed with each routed
        expert's gate / up / down adapters (``lora_moe_runners.py``: ``s B A x`` added to gate and up
        before the activation, to down before the routing weight)."""
        rows = self._rows
        if rows is None:
            return output
        name = self._expert_names[id(module)]
        hidden, top_idx, top_w = inputs[0], inputs[1], inputs[2]
        per_row = hidden.shape[0] // len(rows)  # the block flattens [rows, positions, hidden]
        groups: dict[int, tuple[Adapter, list[int]]] = {}
        for i, a in enumerate(rows):
            if a is not None and name in a.experts:
                groups.setdefault(id(a), (a, []))[1].extend(range(i * per_row, (i + 1) * per_row))
        if not groups:
            return output
        output = output.clone()
        for a, toks in groups.values():
            tok = torch.tensor(toks, dtype=torch.long)
            x, idx, w = hidden[tok], top_idx[tok], top_w[tok]
            y = torch.zeros_like(x)
            for e in torch.unique(idx).tolist():
                if e >= module.gate_up_proj.shape[0]:
                    continue
                j, k = torch.where(idx == e)
                xe = x[j]
                gate, up = torch.nn.functional.linear(xe, module.gate_up_proj[e]).chunk(2, dim=-1)
                pairs = a.experts[name].get(e, {})
                s = a.scaling
                if "gate" in pairs:
                    (ga, gb), (ua, ub) = pairs["gate"], pairs["up"]
                    gate = gate + (s * (xe.float() @ ga.t()) @ gb.t()).to(gate.dtype)
                    up = up + (s * (xe.float() @ ua.t()) @ ub.t()).to(up.dtype)
                h = module.act_fn(gate) * up
                out = torch.nn.functional.linear(h, module.down_proj[e])
                if "down" in pairs:
                    da, db = pairs["down"]
                    out = out + (s * (h.float() @ da.t()) @ db.t()).to(out.dtype)
                y.index_add_(0, j, (out * w[j, k, None]).to(y.dtype))
            output[tok] = y.to(output.dtype)
        return output
