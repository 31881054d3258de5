"""SGLang 0.5.23's per-request sampling rules, row by row on CPU, for the CPU worker.

Each rule names the SGLang 0.5.23 source it follows (paths under ``python/sglang/``):

- request checks: ``api/v1/api_types.py`` ``decode_SamplingParams`` (the JSON contract: unknown
  keys and wrong types are HTTP 400 ``{"error": "<text>"}``), then ``srt/sampling/sampling_params.py``
  ``SamplingParams.__post_init__`` (None -> default; temperature < 1e-6 -> greedy = top_k 1),
  ``verify`` and ``normalize`` (stop strings; tokenizer-only features) -- ValueErrors, answered
  400 ``{"error": {"message"}}`` by ``http_server.py`` ``_create_error_response``.
- penalties: ``srt/sampling/penaltylib/{frequency,presence,repetition}_penalty.py`` and
  ``min_new_tokens.py``, over the *output* tokens only. Under the overlap scheduler (the default)
  ``sampling_batch_info.py`` ``_apply_pre_grammar_logits_transforms`` adds the additive penalties
  first, then applies the scaling one (repetition: ``apply_scaling_penalties``).
- sampling: ``srt/layers/sampler.py`` ``Sampler.forward`` (greedy -- temperature 0 or top_k 1;
  SGLang takes this path when the whole batch is greedy -- argmax, log-prob ``log_softmax(logits)``; otherwise ``logits / T``, softmax, and the returned log-prob is
  ``log(probs)`` *before* truncation) and ``top_k_top_p_min_p_sampling_from_probs_torch``
  (top-k, then top-p on the sorted cumulative sum, then min-p relative to the top probability).
- stopping: ``srt/managers/schedule_batch.py`` ``Req.update_finish_state``: stop strings first
  (``_check_str_based_finish`` on the decoded tail of ``stop_str_max_len + 1`` tokens), then stop
  tokens (``_check_token_based_finish``: ``stop_token_ids``, the model's EOS ids and the
  tokenizer's, all skipped with ``ignore_eos``), then ``max_new_tokens``.
- trimming: ``srt/managers/detokenizer_manager.py`` ``trim_matched_stop``: the text ends before a
  matched stop string (at its end with ``no_stop_trim``) and drops a matched stop token unless
  ``no_stop_trim``; ``output_ids`` keep the stop (``output_ids_through_stop``).

``sampling_seed`` makes a request reproducible, as SGLang's deterministic inference mode does
(``sampler.py`` ``multinomial_with_seed``: the draw depends on seed and position only, so ``n``
samples of one prompt with one seed are identical). SGLang refuses min-p together with a seed
there (an assertion in ``top_k_top_p_min_p_sampling_from_probs_torch``); we answer 400.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

_SAMPLING_EPS = 1e-6
TOP_K_ALL = 1 << 30
MAX_STOP_COUNT = 32
REASONING_END_KEY = "__sglang_reasoning_end_token_ids"

# api/v1/api_types.py _FIELDS_SamplingParams (the order of serde's "expected one of" text).
API_FIELDS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
              "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
              "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
              "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
              "sampling_seed", "custom_params", "beam_width", "watermark", "choice")
_INT = {"max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval", "sampling_seed", "beam_width"}
_FLOAT = {"temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"}
_BOOL = {"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
# Accepted by SGLang but needing machinery the CPU worker lacks (grammars, beam search, watermarks,
# logit bias): refused with a 400 naming the field when set to anything but its neutral value.
UNSUPPORTED = ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "logit_bias", "beam_width",
               "watermark", "choice")


class ContractError(ValueError):
    """The body violates SGLang's JSON contract: HTTP 400 ``{"error": "<text>"}``."""


class ParamError(ValueError):
    """SGLang's ValueError for a request it parsed: HTTP 400 ``{"error": {"message": "<text>"}}``."""


def _unexpected(v: Any) -> str:  # api_types.py _unexpected (serde's wording)
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__


def check_contract(params: Any) -> None:
    """``decode_SamplingParams``: unknown keys and wrong JSON types are contract errors."""
    if not isinstance(params, dict):
        raise ContractError(f"invalid type: {_unexpected(params)}, expected struct SamplingParams")
    for k, v in params.items():
        if k not in API_FIELDS:
            listed = ", ".join(f"`{f}`" for f in API_FIELDS)
            raise ContractError(f"unknown field `{k}`, expected one of {listed}")
        if v is None:
            continue
        if k in _INT and (not isinstance(v, int) or isinstance(v, bool)):
            raise ContractError(f"invalid type: {_unexpected(v)}, expected i64")
        if k in _FLOAT and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            raise ContractError(f"invalid type: {_unexpected(v)}, expected f64")
        if k in _BOOL and not isinstance(v, bool):
            raise ContractError(f"invalid type: {_unexpected(v)}, expected a boolean")
        if k == "stop" and not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))):
            raise ContractError(f"invalid type: {_unexpected(v)}, expected a value or an array of values "
                                "for StringOrList")
        if k == "stop_token_ids" and not (isinstance(v, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in v)):
            raise ContractError(f"invalid type: {_unexpected(v)}, expected a sequence of i64")


@dataclass
class Sampling:
    """One request's normalised sampling parameters (``SamplingParams`` after ``__post_init__``)."""

    max_new_tokens: Optional[int] = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: Optional[int] = None
    sampling_seed: Optional[int] = None
    custom_params: Any = None
    stop_strs: tuple = ()
    stop_str_max_len: int = 0
    stop_token_ids: frozenset = frozenset()

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    @property
    def penalised(self) -> bool:
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)


def parse(params: Optional[dict], tokenizer: Any, vocab_size: int) -> Sampling:
    """``check_contract`` + ``__post_init__`` + ``verify`` + ``normalize``; raises ContractError /
    ParamError with SGLang's texts."""
    params = dict(params or {})
    check_contract(params)
    for k in UNSUPPORTED:
        v = params.get(k)
        if v not in (None, {}, [], ""):
            raise ParamError(f"sampling_params.{k} is not supported by the CPU worker (it emulates SGLang "
                             f"without grammars, beam search, watermarks or logit bias); remove it")
    s = Sampling()
    defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
                "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1,
                "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
                "no_stop_trim": False}
    for k, d in defaults.items():
        v = params.get(k)
        setattr(s, k, d if v is None else (float(v) if k in _FLOAT else v))
    s.max_new_tokens = params.get("max_new_tokens", 128)
    s.stream_interval, s.sampling_seed = params.get("stream_interval"), params.get("sampling_seed")
    s.custom_params = params.get("custom_params")
    s.stop_token_ids = frozenset(int(t) for t in (params.get("stop_token_ids") or []))
    if 0 <= s.temperature < _SAMPLING_EPS:  # __post_init__: greedy
        s.temperature, s.top_k = 1.0, 1
    if s.top_k == -1:
        s.top_k = TOP_K_ALL
    _verify(s, vocab_size)
    stop = params.get("stop")
    stop_strs = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stop_strs) > MAX_STOP_COUNT:
        raise ParamError(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(stop_strs)}")
    if tokenizer is None:  # raise_if_tokenizer_required
        if stop_strs:
            raise ParamError(f"stop={stop_strs!r} is unavailable when skip_tokenizer_init=True "
                             "(requires tokenizer to decode tokens to text for matching).")
        if s.min_new_tokens > 0:
            raise ParamError(f"min_new_tokens={s.min_new_tokens} is unavailable when skip_tokenizer_init=True "
                             "(requires tokenizer for eos_token_id).")
    s.stop_strs = tuple(stop_strs)
    s.stop_str_max_len = max((len(tokenizer.encode(t, add_special_tokens=False)) for t in stop_strs), default=0)
    if s.min_p > 0 and s.sampling_seed is not None:
        raise ParamError("min_p with sampling_seed is not supported: SGLang's seeded sampler asserts "
                         "'With sampling seed, multinomial_with_seed will provide wrong results' "
                         "(layers/sampler.py); drop one of them")
    return s


def _verify(s: Sampling, vocab_size: int) -> None:
    """``SamplingParams.verify`` (messages verbatim)."""
    if not math.isfinite(s.temperature) or s.temperature < 0.0:
        raise ParamError(f"temperature must be a non-negative finite number, got {s.temperature}.")
    if not 0.0 < s.top_p <= 1.0:
        raise ParamError(f"top_p must be in (0, 1], got {s.top_p}.")
    if not 0.0 <= s.min_p <= 1.0:
        raise ParamError(f"min_p must be in [0, 1], got {s.min_p}.")
    if s.top_k < 1 or s.top_k == -1:
        raise ParamError(f"top_k must be -1 (disable) or at least 1, got {s.top_k}.")
    if not -2.0 <= s.frequency_penalty <= 2.0:
        raise ParamError(f"frequency_penalty must be in [-2, 2], got {s.frequency_penalty}.")
    if not -2.0 <= s.presence_penalty <= 2.0:
        raise ParamError(f"presence_penalty must be in [-2, 2], got {s.presence_penalty}.")
    if not 0.0 < s.repetition_penalty <= 2.0:
        raise ParamError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {s.repetition_penalty}.")
    if not 0 <= s.min_new_tokens:
        raise ParamError(f"min_new_tokens must be in [0, max_new_tokens], got {s.min_new_tokens}.")
    if s.max_new_tokens is not None:
        if s.max_new_tokens < 0:
            raise ParamError(f"max_new_tokens must be at least 0, got {s.max_new_tokens}.")
        if not s.min_new_tokens <= s.max_new_tokens:
            raise ParamError(f"min_new_tokens must be in [0, max_new_tokens({s.max_new_tokens})], got "
                             f"{s.min_new_tokens}.")
    if s.sampling_seed is not None and not -(2**63) <= s.sampling_seed <= 2**63 - 1:
        raise ParamError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {s.sampling_seed}.")
    cp = s.custom_params
    if isinstance(cp, dict) and REASONING_END_KEY in cp:  # get_request_reasoning_end_token_ids(strict=True)
        ids = cp[REASONING_END_KEY]
        if (not isinstance(ids, list) or not ids or len(ids) > 32
                or any(type(t) is not int or t < 0 or t >= vocab_size for t in ids)):
            raise ParamError("request reasoning end token IDs must be a non-empty, vocabulary-bounded list "
                             "of at most 32 integers")


def penalise(s: Sampling, logits: torch.Tensor, output: list[int], stop_ids: frozenset) -> torch.Tensor:
    """The penaltylib transforms on one row of raw logits (returns a new tensor)."""
    need_min = s.min_new_tokens > 0 and len(output) < s.min_new_tokens
    if not (s.penalised and output) and not need_min:
        return logits
    logits = logits.clone()
    if output and s.penalised:
        counts = torch.bincount(torch.tensor(output), minlength=logits.numel()).to(logits.dtype)
        seen = counts > 0
        # additive: frequency (count * p) and presence (p once seen), both subtracted
        logits -= s.frequency_penalty * counts + s.presence_penalty * seen.to(logits.dtype)
        if s.repetition_penalty != 1.0:  # apply_scaling_penalties on the seen tokens
            r = s.repetition_penalty
            logits = torch.where(seen, torch.where(logits < 0, logits * r, logits / r), logits)
    if need_min:  # BatchedMinNewTokensPenalizer: stop tokens impossible before min_new_tokens
        ids = [t for t in stop_ids if 0 <= t < logits.numel()]
        if ids:
            logits[torch.tensor(ids)] = float("-inf")
    return logits


def sample(s: Sampling, logits: torch.Tensor, generator: torch.Generator) -> tuple[int, float]:
    """(token, returned log-prob) from one row of penalised logits (``Sampler.forward``)."""
    if s.greedy:  # top_k == 1: a batch of such rows is ``is_all_greedy``: no temperature in the log-prob
        tok = int(torch.argmax(logits))
        return tok, float(torch.log_softmax(logits, -1)[tok])
    logp = torch.log_softmax(logits / s.temperature, -1)
    probs = logp.exp()
    if s.top_p < 1.0 or s.top_k < logits.numel() or s.min_p > 0.0:
        p_sort, p_idx = probs.sort(descending=True)
        csum = p_sort.cumsum(0)
        p_sort = p_sort.clone()
        p_sort[s.top_k:] = 0.0
        p_sort[(csum - p_sort) > s.top_p] = 0.0
        if s.min_p > 0.0:
            p_sort[p_sort < p_sort[0] * s.min_p] = 0.0
        tok = int(p_idx[torch.multinomial(p_sort, 1, generator=generator)])
    else:
        tok = int(torch.multinomial(probs, 1, generator=generator))
    return tok, float(logp[tok])


def stop_reason(s: Sampling, output: list[int], stop_ids: frozenset, tokenizer: Any) -> Optional[dict]:
    """``Req.update_finish_state`` after one new token (abort and length are the caller's)."""
    if s.stop_strs:
        tail_len = min(s.stop_str_max_len + 1, len(output))
        tail = tokenizer.decode(output[-tail_len:])
        for stop in s.stop_strs:
            if stop in tail:
                return {"type": "stop", "matched": stop}
    if not s.ignore_eos and output[-1] in stop_ids:
        return {"type": "stop", "matched": output[-1]}
    return None


def holds_stop_prefix(s: Sampling, output: list[int], tokenizer: Any) -> bool:
    """``Req.check_match_stop_str_prefix``: a streamed chunk is held back while the tail could
    still become a stop string."""
    if not s.stop_strs or not output:
        return False
    tail = tokenizer.decode(output[-min(s.stop_str_max_len + 1, len(output)):])
    if not tail:
        return False
    for stop in s.stop_strs:
        if not stop:
            continue
        if stop in tail:
            return True
        for i in range(1, min(len(tail), len(stop)) + 1):
            if tail[-i:] == stop[:i]:
                return True
    return False


def output_text(s: Sampling, output: list[int], finish: Optional[dict], tokenizer: Any) -> str:
    """The response text (``trim_matched_stop`` on ids for a stop token, on text for a stop string)."""
    if tokenizer is None:
        return ""
    ids = list(output)
    matched = (finish or {}).get("matched")
    if isinstance(matched, int) and not isinstance(matched, bool) and ids and not s.no_stop_trim:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=s.skip_special_tokens,
                            spaces_between_special_tokens=s.spaces_between_special_tokens)
    if isinstance(matched, str):
        pos = text.find(matched)
        if pos != -1:
            text = text[:pos + len(matched)] if s.no_stop_trim else text[:pos]
    return text
