"""The ``data`` config section: training and evaluation prompt sets and their template.

Read by ``data/dataset.py`` (``build_prompt_dataset``, ``build_eval_sets``); it imports only the
settings machinery.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_m2po.utils.settings import check_ranges
from megatron_m2po.utils.settings import setting as _f

__all__ = ["DataConfig"]

@dataclass
class DataConfig:
    """Prompt datasets."""

    train: str = _f("synthetic", help="'synthetic' (arithmetic task) or a local .jsonl / .parquet file in the DeepScaleR schema.")
    eval: list[str] = _f(factory=list, help="Benchmark files (same schema) for `m2po eval` and held-out accuracy.")
    template: Literal["paper", "chat", "raw", "synthetic"] = _f(
        "paper", help="Prompt template: the paper's, the paper's text inside the tokenizer's chat template, the problem "
        "as is, or '{problem}=' (the tiny base model's warm-up format; megatron_m2po/data/templates.py).")
    max_prompt_tokens: int = _f(1024, ge=1, help="Longer prompts are rejected at load with their index.")
    drop_long_prompts: bool = _f(False, help="Drop (and count) prompts longer than max_prompt_tokens instead of raising.")
    synthetic_num_problems: int = _f(20000, ge=1, help="Size of the synthetic training set.")
    synthetic_min_operand: int = _f(0, ge=0, help="Synthetic task: smallest operand.")
    synthetic_max_operand: int = _f(20, ge=1, help="Synthetic task: largest operand.")
    synthetic_num_operands: int = _f(2, ge=2, help="Synthetic task: operands per problem.")
    synthetic_ops: str = _f("+-", help="Synthetic task: operators drawn from these characters (+-*).")
    synthetic_eval_size: int = _f(256, ge=0, help="Held-out synthetic problems for evaluation.")
    shuffle: bool = _f(True, help="Shuffle deterministically per epoch.")

    def validate(self) -> None:
        check_ranges(self, "data")
