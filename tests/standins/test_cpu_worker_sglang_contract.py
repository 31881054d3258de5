"""The CPU worker against SGLang's own source (the pinned wheel, read with zipfile and ast, never
imported; tests/sglang_source.py).

Fails when the CPU worker exposes a route SGLang ``SUPPORTED_SGLANG`` lacks, reads a ``/generate``
field that is not a ``GenerateReqInput`` field, or honours sampling parameters other than SGLang's
(the client's side: tests/rollout/test_sglang_contract.py). The wheel comes from
``scripts/setup.sh`` (``.cache/sglang-wheel``); without it the test skips, except under CI, where
it fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megatron_m2po.rollout.sglang_version import SUPPORTED_SGLANG
from sglang_source import class_fields, const, sglang_routes, sources, tuple_const

ROOT = Path(__file__).resolve().parents[2]
STANDINS = ROOT / "megatron_m2po" / "standins"


@pytest.fixture(scope="module")
def sgl():
    return sources()


def _worker_routes() -> set[str]:
    tree = ast.parse((STANDINS / "cpu_worker_http.py").read_text())
    routes = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                n.func.attr in ("add_get", "add_post", "add_route"):
            for a in n.args[:2]:
                if const(a) and const(a).startswith("/"):
                    routes.add(const(a))
        if isinstance(n, ast.For) and isinstance(n.iter, ast.Tuple):
            routes |= {const(e) for e in n.iter.elts if const(e) and const(e).startswith("/")}
    return routes


def test_cpu_worker_exposes_only_sglang_routes(sgl):
    routes = sglang_routes(sgl)
    worker = _worker_routes()
    assert {"/generate", "/begin_weight_update", "/end_weight_update", "/v1/loads", "/slow_down", "/ready",
            "/health", "/health_generate", "/abort_request"} <= worker
    extra = sorted(worker - set(routes))
    assert extra == [], f"the CPU worker serves routes SGLang {SUPPORTED_SGLANG} lacks: {extra}"
    assert "/get_weight_version" not in routes and "/get_weight_version" not in worker
    assert "/get_load" not in routes and "/get_load" not in worker  # 0.5.23 reports loads at /v1/loads


def test_worker_sampling_fields_are_sglangs(sgl):
    """The CPU worker's sampling-parameter contract is 0.5.23's: the JSON contract's field list
    (api/v1/api_types.py, unknown keys rejected) and the scheduler's SamplingParams."""
    from megatron_m2po.standins import sglang_sampling
    api = tuple_const(sgl, "sglang/api/v1/api_types.py", "_FIELDS_SamplingParams")
    assert sglang_sampling.API_FIELDS == api
    srt = class_fields(sgl)["SamplingParams"]
    implemented = set(API_FIELDS_IMPLEMENTED)
    assert implemented <= set(api) and implemented <= srt, sorted(implemented - srt)
    assert set(sglang_sampling.UNSUPPORTED) == set(api) - implemented


# Sampling parameters the CPU worker honours (the others are a 400 naming the field).
API_FIELDS_IMPLEMENTED = ("max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
                          "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
                          "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
                          "stream_interval", "sampling_seed", "custom_params")


def test_worker_generate_fields_exist_in_sglang(sgl):
    """Every top-level /generate field the CPU worker reads is a GenerateReqInput field."""
    tree = ast.parse((STANDINS / "cpu_worker_http.py").read_text())
    read = {const(n.args[0]) for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "req" and n.args and const(n.args[0])}
    for fn in ast.walk(tree):  # the per-request keys read through a loop over a tuple of names
        if isinstance(fn, ast.For) and isinstance(fn.iter, ast.Tuple):
            read |= {const(e.elts[0]) for e in fn.iter.elts if isinstance(e, ast.Tuple) and const(e.elts[0])}
    classes = class_fields(sgl)
    fields = classes["GenerateReqInput"]
    weights_by_name = {"name", "truncate_size"}  # /get_weights_by_name's request
    assert weights_by_name <= classes["GetWeightsByNameReqInput"]
    generate_read = read - weights_by_name - {"mode", "model_path", "weight_version", "abort_all_requests",
                                              "flush_cache", "group_name", "forward_sleep_time", "new_version",
                                              "abort_all"}
    assert {"input_ids", "text", "sampling_params", "rid", "stream", "return_logprob", "logprob_start_len",
            "custom_logit_processor", "return_text_in_logprobs"} <= generate_read
    assert generate_read - fields == set(), sorted(generate_read - fields)
