"""Prompt data: DeepScaleR-schema files (jsonl / json / parquet), prompt templates, a
deterministic resumable prompt stream, and the synthetic arithmetic task.

Trainer-facing API (contracts in :mod:`megatron_m2po.data.dataset`)::

    from megatron_m2po.data import build_prompt_dataset, build_eval_sets
    ds = build_prompt_dataset(cfg.data, tokenizer, seed)     # PromptDataset
    ds.next_prompts(n) -> list[PromptItem(index, problem, answer, prompt, prompt_ids)]
    ds.state_dict() / ds.load_state_dict(state)              # saved with checkpoints
    build_eval_sets(cfg.data, tokenizer, seed) -> {name: list[PromptItem]}

Templates: :data:`PAPER_TEMPLATE` (docs/design.md §3), "chat", "raw", "synthetic"
(:mod:`megatron_m2po.data.templates`); the synthetic task's canonical response format is
:func:`synthetic_response` (prompt ``"3+14-2="``, response ``"\\boxed{15}"``).
"""

from megatron_m2po.data.dataset import (
    SYNTHETIC_EVAL_NAME,
    PromptDataset,
    PromptItem,
    build_eval_sets,
    build_prompt_dataset,
    make_items,
)
from megatron_m2po.data.io import PromptRow, load_rows, validate_rows, write_jsonl
from megatron_m2po.data.synthetic import SyntheticTask, evaluate_expression, synthetic_splits
from megatron_m2po.data.templates import (
    PAPER_TEMPLATE,
    SYNTHETIC_TEMPLATE,
    TEMPLATES,
    render_prompt,
    synthetic_response,
    tokenize_prompts,
)

__all__ = [
    "PromptItem",
    "PromptDataset",
    "build_prompt_dataset",
    "build_eval_sets",
    "make_items",
    "SYNTHETIC_EVAL_NAME",
    "PromptRow",
    "load_rows",
    "validate_rows",
    "write_jsonl",
    "SyntheticTask",
    "evaluate_expression",
    "synthetic_splits",
    "PAPER_TEMPLATE",
    "SYNTHETIC_TEMPLATE",
    "TEMPLATES",
    "render_prompt",
    "synthetic_response",
    "tokenize_prompts",
]
