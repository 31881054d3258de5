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
:func:`synthetic_response` (prompt ``"3+14-2="``, response ``"\boxed{15}"``).

The names below load their module on first use, so importing a section of the config
(``data/settings.py``) does not import the whole package."""

from __future__ import annotations

from megatron_m2po.utils.lazy import lazy_exports

_WHERE = {
    **{n: "dataset" for n in ('PromptItem', 'PromptDataset', 'build_prompt_dataset', 'build_eval_sets', 'make_items', 'SYNTHETIC_EVAL_NAME')},
    **{n: "io" for n in ('PromptRow', 'load_rows', 'validate_rows', 'write_jsonl')},
    **{n: "synthetic" for n in ('SyntheticTask', 'evaluate_expression', 'synthetic_splits')},
    **{n: "templates" for n in ('PAPER_TEMPLATE', 'SYNTHETIC_TEMPLATE', 'TEMPLATES', 'render_prompt', 'synthetic_response', 'tokenize_prompts')},
}
__all__ = list(_WHERE)
__getattr__ = lazy_exports(__name__, _WHERE)
