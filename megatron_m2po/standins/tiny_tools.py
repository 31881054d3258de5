"""The tiny tool-using base (``model.tiny_family=qwen2_tools``): the qwen2 tiny base fine-tuned to
decide when to call a calculator.

Task: the synthetic arithmetic task with ``+-*`` (operands 0..20, two of them). The tiny base adds
and subtracts at ~30% accuracy and cannot multiply (products up to 400); the warm-up teaches it,
on traces rendered by its own chat template with tools, to answer sums and differences directly
and to call the calculator on products and copy the tool's result into its answer. The model
decides from the problem text alone; the tool matters because without it the products are out of
reach (``m2po_tiny.json`` holds the accuracy with the tool, with its result withheld, and the
fraction of episodes that call it, measured on a fixed set of problems).

Chat template (``TOOL_CHAT_TEMPLATE``; HF ``apply_chat_template(messages, tools=...)``)::

    tools header  "calculator;"                  (each tool's name and ';', when tools are given)
    user          "{content}="
    assistant     "{content}</s>"  or  "{name}({expression})</s>" for a tool call
    tool          "[{content}]="
    generation prompt: nothing (every message before an assistant turn ends with '=')

so an episode reads ``calculator;12*7=calculator(12*7)</s>[84]=\\boxed{84}</s>`` and a direct
answer ``calculator;12+7=\\boxed{19}</s>``. Every message renders the same whatever follows it,
which is what the episode loop's turn-by-turn rendering needs (rollout/episodes.py ``_Renderer``).
The environment that goes with it is ``examples/agentic_tool_env.py`` (same tool schema, same
call syntax).

The build (``tiny_base.ensure_tiny_base`` with ``family="qwen2_tools"``) is deterministic (fixed
seeds, one CPU thread) and cached beside the base it derives from, as the base is (lock, temporary
directory, marker file last). This module does not import ``tiny_base`` (it is given the sampler).
"""

from __future__ import annotations

import logging
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megatron_m2po.data.synthetic import SyntheticTask, evaluate_expression
from megatron_m2po.rewards.extract import extract_last_boxed
from megatron_m2po.standins.sft import sft_step

__all__ = ["TOOL_CHAT_TEMPLATE", "CALCULATOR_TOOLS", "ToolWarmupSpec", "parse_tool_call", "render_trace", "finetune",
           "tool_episode_accuracy"]

TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}{% for t in tools %}{{ (t.function if t.function is defined else t).name }};{% endfor %}"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{ m.content }}="
    "{%- elif m.role == 'assistant' %}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}{% set f = c.function if c.function is defined else c %}"
    "{{ f.name }}({{ f.arguments.expression if f.arguments is mapping else f.arguments }}){% endfor %}"
    "{%- else %}{{ m.content }}{% endif %}</s>"
    "{%- elif m.role == 'tool' %}[{{ m.content }}]="
    "{%- else %}{{ m.content }}"
    "{%- endif %}{% endfor %}")

# The calculator of examples/agentic_tool_env.py (its CalculatorEnv.tools; a test checks they agree).
CALCULATOR_TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]

log = logging.getLogger(__name__)

RESPONSE = "\\boxed{{{answer}}}"  # the tiny base's answer format (tiny_base.RESPONSE_TEMPLATE; a test checks)
_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\((.*)\)\s*$", re.S)


def parse_tool_call(text: str) -> Optional[tuple[str, str]]:
    """``(name, expression)`` when a turn is a call ``name(expression)``, else None (an answer)."""
    m = _CALL.match(text)
    return (m.group(1), m.group(2)) if m else None


@dataclass(frozen=True)
class ToolWarmupSpec:
    """The fine-tune from the qwen2 tiny base and its measurement."""

    task: SyntheticTask = field(default_factory=lambda: SyntheticTask(ops="+-*"))
    tool_ops: str = "*"             # problems with one of these call the tool in the traces
    batch_size: int = 64
    lr: float = 2e-3
    max_steps: int = 1500
    eval_every: int = 250
    eval_problems: int = 128
    target_tool_acc: float = 0.8    # stop once products are answered this well with the tool ...
    target_call_agreement: float = 0.95  # ... and the call decision follows the traces this often
    final_eval_problems: int = 512
    max_new_tokens: int = 24
    seed: int = 0


def _is_hard(problem: str, tool_ops: str) -> bool:
    return any(op in problem for op in tool_ops)


def _chat_ids(tok: Any, messages: list[dict], gen: bool) -> list[int]:
    text = tok.apply_chat_template(messages, tools=CALCULATOR_TOOLS, tokenize=False, add_generation_prompt=gen)
    return list(tok.encode(text, add_special_tokens=False))


def render_trace(tok: Any, problem: str, answer: str, use_tool: bool) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one trace through the chat template with tools: each assistant message's
    tokens are what the template adds for it (mask 1), everything else is context (mask 0), the
    split the episode loop makes."""
    msgs: list[dict] = [{"role": "user", "content": problem}]
    if use_tool:
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": problem}}}
        msgs += [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": answer}]
    msgs.append({"role": "assistant", "content": RESPONSE.format(answer=answer)})
    ids: list[int] = []
    mask: list[int] = []
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        ctx = _chat_ids(tok, msgs[:k], True)
        full = _chat_ids(tok, msgs[:k + 1], False)
        assert full[:len(ctx)] == ctx and ctx[:len(ids)] == ids, "the template is not prefix-stable"
        mask += [0] * (len(ctx) - len(ids)) + [1] * (len(full) - len(ctx))
        ids = full
    return ids, mask


def tool_episode_accuracy(model: Any, tok: Any, rows: list[dict], sample_ids: Callable, *,
                          tools: tuple[str, ...] = ("working",), seed: int, max_new_tokens: int = 24,
                          tool_ops: str = "*") -> dict[str, dict]:
    """Two-turn episodes as the episode loop runs them (sampled at T=1), the tool in-process.

    ``tools``: the tool's behaviours to measure, ``"working"`` (the exact value) and/or
    ``"withheld"`` (the observation carries no result); the first turns are sampled once and shared
    (the same episodes, up to the observation). Returns, per behaviour, accuracy overall and on
    the problems with / without ``tool_ops``, the fraction of episodes that call the tool, and how
    often the call decision matches the traces' rule. ``sample_ids``: the tiny base's sampler
    (``tiny_base.sample_ids``)."""
    eos = tok.eos_token_id
    prompts = [_chat_ids(tok, [{"role": "user", "content": r["problem"]}], True) for r in rows]
    first = sample_ids(model, tok, prompts, max_new_tokens=max_new_tokens, seed=seed)
    # The observation tokens, rendered as the episode loop renders them (rollout/episodes.py _Renderer).
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    before = _chat_ids(tok, base, False)
    hard = [_is_hard(r["problem"], tool_ops) for r in rows]

    def frac(xs: list[bool]) -> float:
        return round(sum(xs) / max(len(xs), 1), 4)

    out: dict[str, dict] = {}
    for tool in tools:
        answers: list[Optional[str]] = [None] * len(rows)
        called = [False] * len(rows)
        follow, follow_idx = [], []
        for i, turn in enumerate(first):
            text = tok.decode([t for t in turn if t != eos], skip_special_tokens=True)
            call = parse_tool_call(text)
            if call is None or not turn or turn[-1] != eos:
                answers[i] = extract_last_boxed(text)
                continue
            called[i] = True
            value = _calculate(call[1]) if tool == "working" else ""
            obs = _chat_ids(tok, base + [{"role": "tool", "content": value}], True)[len(before):]
            follow.append(prompts[i] + turn + obs)
            follow_idx.append(i)
        if follow:
            second = sample_ids(model, tok, follow, max_new_tokens=max_new_tokens, seed=seed + 1)
            for i, turn in zip(follow_idx, second):
                answers[i] = extract_last_boxed(tok.decode([t for t in turn if t != eos], skip_special_tokens=True))
        ok = [a is not None and a.strip() == r["answer"] for a, r in zip(answers, rows)]
        out[tool] = {"accuracy": frac(ok), "accuracy_hard": frac([o for o, h in zip(ok, hard) if h]),
                     "accuracy_easy": frac([o for o, h in zip(ok, hard) if not h]), "call_fraction": frac(called),
                     "call_agreement": frac([c == h for c, h in zip(called, hard)]), "problems": len(rows),
                     "hard_problems": sum(hard)}
    return out


def _calculate(expr: str) -> str:
    """The calculator on the task's expressions (integers, + - *); 'error' otherwise."""
    toks = re.findall(r"\d+|[+\-*]", expr.replace(" ", ""))
    if "".join(toks) != expr.replace(" ", "") or len(toks) % 2 == 0 or not toks[0].isdigit():
        return "error: only arithmetic"
    try:
        return str(evaluate_expression([int(t) for t in toks[0::2]], toks[1::2]))
    except ValueError:
        return "error: only arithmetic"


def finetune(model: Any, tok: Any, spec: ToolWarmupSpec, sample_ids: Callable, progress: bool) -> dict:
    """Supervised fine-tune of ``model`` on the traces until the stopping rule; returns the stats."""
    import torch

    torch.manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.0)
    rng = random.Random(f"tiny-tools:train:{spec.seed}")
    check = [dict(r) for r in spec.task.generate(spec.eval_problems, f"tiny-tools:check:{spec.seed}")]
    history, step, stats = [], 0, {}
    rendered: dict[str, tuple[list[int], list[int]]] = {}
    t0 = time.monotonic()
    for step in range(1, spec.max_steps + 1):
        model.train()
        rows = [spec.task.sample(rng) for _ in range(spec.batch_size)]
        traces = []
        for r in rows:  # the task has ~1300 distinct problems: each is rendered once
            key = r["problem"]
            if key not in rendered:
                rendered[key] = render_trace(tok, r["problem"], r["answer"], _is_hard(r["problem"], spec.tool_ops))
            traces.append(rendered[key])
        T = max(len(t[0]) for t in traces)
        ids = torch.full((len(traces), T), tok.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(traces), T), dtype=torch.long)
        lmask = torch.zeros((len(traces), T), dtype=torch.float32)
        for i, (s, m) in enumerate(traces):
            ids[i, :len(s)], attn[i, :len(s)] = torch.tensor(s), 1
            lmask[i, :len(m)] = torch.tensor(m, dtype=torch.float32)
        loss = sft_step(model, opt, ids, attn, lmask)
        if step % spec.eval_every == 0:
            model.eval()
            stats = tool_episode_accuracy(model, tok, check, sample_ids, seed=spec.seed + step,
                                          max_new_tokens=spec.max_new_tokens, tool_ops=spec.tool_ops)["working"]
            history.append((step, round(loss.item(), 4), stats["accuracy_hard"], stats["call_agreement"]))
            if progress:
                print(f"tiny tool base: step {step} loss {loss.item():.3f} {stats}", flush=True)
            if stats["accuracy_hard"] >= spec.target_tool_acc and stats["call_agreement"] >= spec.target_call_agreement:
                # Said, so that progress lines ending before max_steps do not read as a crash.
                log.info("tiny tool base: stopped at step %d of at most %d: products answered right %.3f with the "
                         "tool (target %.2f), call decisions as trained %.3f (target %.2f)", step, spec.max_steps,
                         stats["accuracy_hard"], spec.target_tool_acc, stats["call_agreement"],
                         spec.target_call_agreement)
                break
    model.eval()
    reached = bool(stats) and stats["accuracy_hard"] >= spec.target_tool_acc
    return {"steps": step, "history": history, "finetune_seconds": round(time.monotonic() - t0, 1),
            "reached_target": reached}
