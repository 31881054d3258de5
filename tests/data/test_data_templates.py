"""Prompt templates: exact text (docs/design.md §3), chat rendering, tokenization."""

import pytest

from megatron_m2po.data import PAPER_TEMPLATE, render_prompt, synthetic_response, tokenize_prompts
from megatron_m2po.rewards import grade_math

# Copied by hand from docs/design.md §3 / the paper (appendix B), not from the code.
PAPER_TEXT = (
    "Please solve the following math problem: What is $1+1$?. The assistant first thinks about the reasoning "
    "process step by step and then provides the user with the answer. Return the final answer in \\boxed{} tags, "
    "for example \\boxed{1}. Let's solve this step by step."
)


def test_paper_template_exact_text():
    assert render_prompt("What is $1+1$?", "paper") == PAPER_TEXT
    assert PAPER_TEMPLATE.count("{problem}") == 1


def test_problem_braces_are_not_format_fields():
    p = r"Compute \frac{1}{2} + {x}"
    assert render_prompt(p, "paper") == PAPER_TEXT.replace("What is $1+1$?", p)
    assert render_prompt(p, "raw") == p


def test_chat_template_wraps_the_paper_text(char_tokenizer):
    text = render_prompt("What is $1+1$?", "chat", char_tokenizer)
    assert text == f"<|im_start|>user\n{PAPER_TEXT}<|im_end|>\n<|im_start|>assistant\n"
    # Chat prompts are tokenized without adding special tokens again.
    ids = tokenize_prompts([text], "chat", char_tokenizer)[0]
    assert ids[0] == char_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(char_tokenizer.convert_tokens_to_ids("<|im_start|>")) == 2
    assert char_tokenizer.decode(ids) == text


def test_chat_template_errors():
    with pytest.raises(ValueError, match="needs a tokenizer"):
        render_prompt("x", "chat")
    from m2po_char_tokenizer import build_char_tokenizer

    with pytest.raises(ValueError, match="no chat_template"):
        render_prompt("x", "chat", build_char_tokenizer(chat_template=None))
    with pytest.raises(ValueError, match="unknown prompt template 'fancy'"):
        render_prompt("x", "fancy")


def test_synthetic_template_and_response_are_graded_correct(char_tokenizer):
    # The tiny base model's warm-up format (megatron_m2po/standins/tiny_base.py): "12+7=" -> "\\boxed{19}".
    assert render_prompt("3+14-2", "synthetic") == "3+14-2="
    resp = synthetic_response("3+14-2", "15")
    assert resp == "\\boxed{15}"
    assert grade_math("3+14-2=" + resp, "15") == "correct"
    ids = tokenize_prompts(["3+14-2="], "synthetic", char_tokenizer)[0]
    assert len(ids) == len("3+14-2=")  # one id per character
