"""Prompt datasets: templated, tokenized prompts served in a deterministic, resumable order.

Trainer-facing API::

    ds = build_prompt_dataset(cfg.data, tokenizer, seed)      # PromptDataset
    items = ds.next_prompts(n)                                # list[PromptItem], crosses epochs
    state = ds.state_dict()                                   # {"epoch", "position", "seed", "num_items"}
    ds.load_state_dict(state)                                 # same order from there on
    sets = build_eval_sets(cfg.data, tokenizer, seed)         # {benchmark name: list[PromptItem]}

Order: epoch ``e`` visits every prompt once, in the permutation drawn from
``numpy.random.default_rng(SeedSequence([seed, e]))`` (storage order when ``shuffle=False``).
The state is the triple (epoch, position in that epoch's permutation, seed): restoring it in a
new dataset built from the same rows continues the identical sequence, including across epoch
boundaries. ``num_items`` is saved too and checked on restore, because a changed file would
silently change the order.

All prompts are rendered and tokenized at construction, so a prompt longer than
``max_prompt_tokens`` is reported at load (with its row index) rather than mid-run; with
``drop_long=True`` such rows are dropped and counted (``n_dropped``) instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from megatron_m2po.data.io import PromptRow, load_rows
from megatron_m2po.data.synthetic import synthetic_splits
from megatron_m2po.data.templates import TEMPLATES, render_prompt, tokenize_prompts

logger = logging.getLogger(__name__)

__all__ = ["PromptItem", "PromptDataset", "build_prompt_dataset", "build_eval_sets", "make_items",
           "SYNTHETIC_EVAL_NAME"]

SYNTHETIC_EVAL_NAME = "synthetic"


@dataclass(slots=True)
class PromptItem:
    """One prompt.

    Attributes:
        index: row index in its source (file row, or synthetic row); stable across runs.
        problem: the problem text.
        answer: the ground-truth answer (for the reward).
        prompt: the rendered prompt text (template applied).
        prompt_ids: token ids of ``prompt``.
    """

    index: int
    problem: str
    answer: str
    prompt: str
    prompt_ids: list[int]


def make_items(rows: list[PromptRow], tokenizer: Any, template: str, *, max_prompt_tokens: Optional[int] = None,
               drop_long: bool = False, source: str = "prompts") -> tuple[list[PromptItem], int]:
    """Render and tokenize ``rows``; returns (items, number dropped for length)."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; choose one of {list(TEMPLATES)}")
    texts = [render_prompt(r["problem"], template, tokenizer) for r in rows]
    ids = tokenize_prompts(texts, template, tokenizer)
    items: list[PromptItem] = []
    too_long: list[tuple[int, int]] = []
    for i, (r, text, tok) in enumerate(zip(rows, texts, ids)):
        if max_prompt_tokens is not None and len(tok) > max_prompt_tokens:
            too_long.append((i, len(tok)))
            continue
        items.append(PromptItem(i, r["problem"], r["answer"], text, tok))
    if too_long:
        shown = ", ".join(f"row {i} ({n} tokens)" for i, n in too_long[:5])
        more = f" and {len(too_long) - 5} more" if len(too_long) > 5 else ""
        if not drop_long:
            raise ValueError(f"{source}: {len(too_long)} prompt(s) exceed data.max_prompt_tokens={max_prompt_tokens}: "
                             f"{shown}{more}. Raise data.max_prompt_tokens, filter the file, or set "
                             "data.drop_long_prompts=true")
        logger.warning("%s: dropped %d prompt(s) longer than %d tokens: %s%s", source, len(too_long),
                       max_prompt_tokens, shown, more)
    return items, len(too_long)


def _seed_u64(seed: int) -> int:
    return int(seed) % (1 << 64)


class PromptDataset:
    """Prompts in a deterministic per-epoch shuffled order with a resumable cursor.

    Example:
        >>> ds = PromptDataset(rows, tokenizer, template="paper", seed=1)   # doctest: +SKIP
        >>> first = ds.next_prompts(3); s = ds.state_dict()                 # doctest: +SKIP
        >>> ds2 = PromptDataset(rows, tokenizer, template="paper", seed=1)  # doctest: +SKIP
        >>> ds2.load_state_dict(s); ds2.next_prompts(3) == ds.next_prompts(3)  # doctest: +SKIP
        True
    """

    def __init__(self, rows: list[PromptRow], tokenizer: Any, *, template: str, seed: int, shuffle: bool = True,
                 max_prompt_tokens: Optional[int] = None, drop_long: bool = False, name: str = "train"):
        self.name = name
        self.template = template
        self.shuffle = bool(shuffle)
        self.items, self.n_dropped = make_items(rows, tokenizer, template, max_prompt_tokens=max_prompt_tokens,
                                                drop_long=drop_long, source=name)
        if not self.items:
            raise ValueError(f"{name}: no prompts left (all {len(rows)} rows were dropped or the source is empty)")
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._order: Optional[np.ndarray] = None
        self._order_epoch = -1

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Positions into ``items`` in the order epoch ``epoch`` visits them."""
        n = len(self.items)
        if not self.shuffle:
            return np.arange(n)
        rng = np.random.default_rng(np.random.SeedSequence([_seed_u64(self.seed), int(epoch)]))
        return rng.permutation(n)

    def _current_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order = self.epoch_order(self.epoch)
            self._order_epoch = self.epoch
        assert self._order is not None
        return self._order

    def next_prompts(self, n: int) -> list[PromptItem]:
        """The next ``n`` prompts, moving into the next epoch (new permutation) when one ends."""
        if n < 0:
            raise ValueError(f"next_prompts(n={n}): n must be >= 0")
        out: list[PromptItem] = []
        while len(out) < n:
            if self.position >= len(self.items):
                self.epoch += 1
                self.position = 0
            order = self._current_order()
            take = min(n - len(out), len(order) - self.position)
            out.extend(self.items[j] for j in order[self.position:self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict[str, int]:
        """The cursor, JSON-serialisable: ``{"epoch", "position", "seed", "num_items"}``."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_items": len(self.items)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved cursor (its seed wins over the constructor's)."""
        missing = [k for k in ("epoch", "position", "seed") if k not in state]
        if missing:
            raise ValueError(f"dataset state {state!r} lacks {missing}; expected PromptDataset.state_dict() output")
        n_saved = state.get("num_items")
        if n_saved is not None and int(n_saved) != len(self.items):
            raise ValueError(f"{self.name}: the saved data cursor was taken over {n_saved} prompts but the dataset now "
                             f"has {len(self.items)}; the order cannot be resumed (same file, template and "
                             "max_prompt_tokens are needed)")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.items):
            raise ValueError(f"{self.name}: invalid data cursor epoch={epoch} position={position} "
                             f"for {len(self.items)} prompts")
        self.seed = int(state["seed"])
        self.epoch, self.position = epoch, position
        self._order_epoch = -1


def build_prompt_dataset(data_cfg, tokenizer: Any, seed: int) -> PromptDataset:
    """The training prompts of ``data_cfg`` (a :class:`~megatron_m2po.config.DataConfig`).

    ``data_cfg.train == "synthetic"`` builds the arithmetic task (its held-out problems are
    excluded, see :func:`build_eval_sets`); otherwise it is a .jsonl/.json/.parquet path.
    """
    if data_cfg.train == "synthetic":
        rows, _ = synthetic_splits(data_cfg, seed)
        name = "synthetic"
    else:
        rows = load_rows(data_cfg.train)
        name = str(data_cfg.train)
    return PromptDataset(rows, tokenizer, template=data_cfg.template, seed=seed, shuffle=data_cfg.shuffle,
                         max_prompt_tokens=data_cfg.max_prompt_tokens, drop_long=data_cfg.drop_long_prompts,
                         name=name)


def build_eval_sets(data_cfg, tokenizer: Any, seed: int) -> dict[str, list[PromptItem]]:
    """Held-out prompt sets by name, in file order.

    - ``"synthetic"``: the held-out synthetic problems, when ``data.train == "synthetic"`` and
      ``data.synthetic_eval_size > 0`` (disjoint from the training problems).
    - one set per file of ``data.eval``, named by the file stem (``aime24.jsonl`` -> ``aime24``).
    """
    sets: dict[str, list[PromptItem]] = {}
    kw = dict(max_prompt_tokens=data_cfg.max_prompt_tokens, drop_long=data_cfg.drop_long_prompts)
    if data_cfg.train == "synthetic" and data_cfg.synthetic_eval_size > 0:
        _, eval_rows = synthetic_splits(data_cfg, seed)
        sets[SYNTHETIC_EVAL_NAME], _ = make_items(eval_rows, tokenizer, data_cfg.template,
                                                  source="synthetic held-out", **kw)
    for path in data_cfg.eval:
        name = Path(path).stem
        if name in sets:
            raise ValueError(f"two evaluation sets are named {name!r} (data.eval={data_cfg.eval}); benchmark names "
                             "are file stems and must be unique")
        sets[name], _ = make_items(load_rows(path), tokenizer, data_cfg.template, source=str(path), **kw)
    return sets
