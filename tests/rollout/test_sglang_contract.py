"""The client against SGLang's own source (the pinned wheel, read with zipfile and ast, never
imported; tests/sglang_source.py).

Fails when a route or request field the client sends, or a response/meta_info field it reads, is
absent from SGLang ``SUPPORTED_SGLANG`` (the CPU worker's side: tests/standins/
test_cpu_worker_sglang_contract.py). The wheel comes from ``scripts/setup.sh``
(``.cache/sglang-wheel``); without it the test skips, except under CI, where it fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megatron_m2po.rollout.sglang_version import SUPPORTED_SGLANG
from sglang_source import class_fields, const, sglang_routes, sources

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "megatron_m2po" / "rollout"

# Response / meta_info keys the client reads (client.py GenerateOutput.from_json, weight_version,
# loads) and the SGLang file that must produce each.
READ_KEYS = {
    "sglang/srt/entrypoints/http_server.py": ["weight_version", "is_generation", "version"],
    "sglang/srt/utils/weight_versions.py": ["weight_versions", "weight_version", "version", "start", "end"],
    "sglang/srt/managers/tokenizer_manager.py": ["output_token_logprobs", "input_token_logprobs",
                                                 "finish_reason", "prompt_tokens", "id", "routed_experts"],
    "sglang/srt/entrypoints/v1_loads.py": ["loads"],
    "sglang/srt/managers/load_snapshot.py": ["num_running_reqs", "num_waiting_reqs", "num_used_tokens"],
}


@pytest.fixture(scope="module")
def sgl():
    return sources()


def _client_calls() -> dict[str, set[str]]:
    """route -> keys of the dict literals in the client method that sends it."""
    tree = ast.parse((PKG / "client.py").read_text())
    sent: dict[str, set[str]] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name in ("request", "_checked"):
            continue
        routes = [const(n) for n in ast.walk(fn) if const(n) and const(n).startswith("/")
                  and isinstance(n, ast.Constant)]
        routes = [r for r in routes if r not in ("/",)]
        keys = {const(k) for n in ast.walk(fn) if isinstance(n, ast.Dict) for k in n.keys if k is not None
                and const(k)}
        keys |= {kw.arg for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr == "update" for kw in n.keywords if kw.arg}  # body.update(field=...)
        if fn.name == "generate_payload":  # builds the body; the client and the dispatcher post it to /generate
            routes.append("/generate")
        for r in routes:
            sent.setdefault(r, set()).update(keys)
    return sent


# Fields the client nests rather than sends at the top level of a body.
NESTED = {"/generate": {"sampling_params": "SamplingParams"}}


def test_client_routes_and_request_fields_exist_in_sglang(sgl):
    routes, fields = sglang_routes(sgl), class_fields(sgl)
    sent = _client_calls()
    assert {"/generate", "/begin_weight_update", "/end_weight_update", "/model_info"} <= set(sent)
    assert {"input_ids", "sampling_params", "return_logprob", "rid"} <= sent["/generate"]
    missing = sorted(r for r in sent if r not in routes and not r.startswith("/workers"))
    assert missing == [], f"client routes absent from SGLang {SUPPORTED_SGLANG}: {missing}"
    bad = {}
    for r, keys in sent.items():
        body = routes.get(r)
        if body is None:
            continue
        absent = keys - fields[body]
        if absent:
            bad[r] = (body, sorted(absent))
    assert bad == {}, f"request fields absent from SGLang {SUPPORTED_SGLANG}'s body classes: {bad}"
    assert "get_weight_version" not in (PKG / "client.py").read_text().replace("``/get_weight_version``", "")


def test_sampling_params_the_producer_sends_exist(sgl):
    fields = class_fields(sgl)["SamplingParams"]
    for k in ("temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids", "ignore_eos",
              "sampling_seed", "n"):
        assert k in fields, k


def test_response_fields_the_client_reads_exist(sgl):
    for name, keys in READ_KEYS.items():
        tree = ast.parse(sgl[name])
        consts = {const(n) for n in ast.walk(tree)} | {  # string keys and dataclass field names
            n.target.id for n in ast.walk(tree) if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        absent = [k for k in keys if k not in consts]
        assert absent == [], f"{name} of SGLang {SUPPORTED_SGLANG} never names {absent}"
