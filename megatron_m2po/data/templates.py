"""Prompt templates (docs/design.md §3) and prompt tokenization.

Templates (``DataConfig.template``):

- ``"paper"``: :data:`PAPER_TEMPLATE` with the problem substituted, as plain text (the
  paper's base-model setting).
- ``"chat"``: the same text as the single user message of the tokenizer's chat template,
  ``add_generation_prompt=True`` (instruct / thinking models).
- ``"raw"``: the problem text unchanged.
- ``"synthetic"``: :data:`SYNTHETIC_TEMPLATE` = ``"{problem}="``, the exact prompt format the
  tiny CPU base model is warmed up on (``megatron_m2po.standins.tiny_base.PROMPT_TEMPLATE``);
  :func:`synthetic_response` is the matching target response (``"\\boxed{15}"``, tiny_base's
  ``RESPONSE_TEMPLATE``). Use it (or ``"raw"``) for the tiny runs: ``"chat"`` puts the
  paper's long text in the user message, far from the warm-up format.

Tokenization: chat prompts are rendered with ``tokenize=False`` and tokenized without adding
special tokens (the chat template already contains them); the other templates are tokenized
with the tokenizer's default special tokens (e.g. BOS for Llama, nothing for Qwen).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PAPER_TEMPLATE", "SYNTHETIC_TEMPLATE", "TEMPLATES", "render_prompt", "tokenize_prompts",
           "synthetic_response"]

PAPER_TEMPLATE = (
    "Please solve the following math problem: {problem}. The assistant first thinks about the "
    "reasoning process step by step and then provides the user with the answer. Return the final "
    "answer in \\boxed{} tags, for example \\boxed{1}. Let's solve this step by step."
)
SYNTHETIC_TEMPLATE = "{problem}="
TEMPLATES = ("paper", "chat", "raw", "synthetic")


def _fill(template: str, problem: str) -> str:
    # str.replace, not str.format: the template itself contains braces (\boxed{}).
    return template.replace("{problem}", problem)


def render_prompt(problem: str, template: str, tokenizer: Any = None) -> str:
    """The prompt text of ``problem`` under ``template`` (a tokenizer is needed for "chat")."""
    if template == "paper":
        return _fill(PAPER_TEMPLATE, problem)
    if template == "raw":
        return problem
    if template == "synthetic":
        return _fill(SYNTHETIC_TEMPLATE, problem)
    if template == "chat":
        if tokenizer is None:
            raise ValueError("template='chat' needs a tokenizer (its chat template renders the prompt)")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"template='chat' but the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no "
                             "chat_template; use data.template=paper (base models) or a tokenizer with one")
        messages = [{"role": "user", "content": _fill(PAPER_TEMPLATE, problem)}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not isinstance(text, str):
            raise ValueError(f"tokenizer.apply_chat_template returned {type(text).__name__}, expected str")
        return text
    raise ValueError(f"unknown prompt template {template!r}; choose one of {list(TEMPLATES)}")


def tokenize_prompts(texts: list[str], template: str, tokenizer: Any) -> list[list[int]]:
    """Token ids of rendered prompts (see module docstring for special-token handling)."""
    if not texts:
        return []
    add_special = template != "chat"
    enc = tokenizer(list(texts), add_special_tokens=add_special)
    ids = enc["input_ids"]
    return [list(map(int, x)) for x in ids]


def synthetic_response(problem: str, answer: str) -> str:
    """The canonical response of the synthetic task to ``SYNTHETIC_TEMPLATE``: ``"\\boxed{15}"``."""
    del problem  # the prompt already ends with "problem="
    return f"\\boxed{{{answer}}}"
