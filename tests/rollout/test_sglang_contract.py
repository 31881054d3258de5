"""The client and the CPU worker against SGLang's own source (the pinned wheel, read with zipfile
and ast, never imported).

Fails when a route or request field the client sends, or a response/meta_info field it reads, is
absent from SGLang ``SUPPORTED_SGLANG``, or when the CPU worker exposes a route SGLang lacks. The
wheel comes from ``scripts/setup.sh`` (``.cache/sglang-wheel``); without it the test skips, except
under CI, where it fails.
"""

from __future__ import annotations

import ast
import os
import zipfile
from pathlib import Path

import pytest

from megatron_m2po.rollout.sglang_version import SUPPORTED_SGLANG

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "megatron_m2po" / "rollout"
STANDINS = ROOT / "megatron_m2po" / "standins"
WHEEL_DIR = ROOT / ".cache" / "sglang-wheel"

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


def _wheel() -> zipfile.ZipFile:
    found = sorted(WHEEL_DIR.glob(f"sglang-{SUPPORTED_SGLANG}-*.whl"))
    if not found:
        msg = (f"no sglang-{SUPPORTED_SGLANG} wheel in {WHEEL_DIR}: run scripts/setup.sh (it runs "
               f"`pip download --no-deps sglang=={SUPPORTED_SGLANG} -d .cache/sglang-wheel`)")
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return zipfile.ZipFile(found[0])


@pytest.fixture(scope="module")
def sgl():
    with _wheel() as z:
        yield {n: z.read(n).decode() for n in z.namelist()
               if n.startswith(("sglang/srt/", "sglang/api/")) and n.endswith(".py")}


def _const(node):
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _sglang_routes(sgl) -> dict[str, str | None]:
    """route -> name of its body class (None when it takes no body model)."""
    routes: dict[str, str | None] = {}
    for name in ("sglang/srt/entrypoints/http_server.py", "sglang/srt/entrypoints/v1_loads.py"):
        for fn in ast.walk(ast.parse(sgl[name])):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for d in fn.decorator_list:
                if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and \
                        d.func.attr in ("get", "post", "put", "api_route") and d.args and _const(d.args[0]):
                    body = None
                    for a in fn.args.args:
                        ann = a.annotation
                        if isinstance(ann, ast.Subscript) and isinstance(ann.slice, ast.Tuple):
                            ann = ann.slice.elts[0]  # Annotated[X, Body()]
                        if isinstance(ann, ast.Name) and ann.id.endswith(("ReqInput", "Req")):
                            body = ann.id
                    routes[_const(d.args[0])] = body
    return routes


def _class_fields(sgl) -> dict[str, set[str]]:
    fields: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for name in ("sglang/srt/managers/io_struct.py", "sglang/srt/sampling/sampling_params.py"):
        for c in ast.walk(ast.parse(sgl[name])):
            if isinstance(c, ast.ClassDef):
                fields[c.name] = {s.target.id for s in c.body
                                  if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
                bases[c.name] = [b.id for b in c.bases if isinstance(b, ast.Name)]

    def full(n: str) -> set[str]:
        return fields.get(n, set()).union(*(full(b) for b in bases.get(n, []) if b in fields))
    return {n: full(n) for n in fields}


def _client_calls() -> dict[str, set[str]]:
    """route -> keys of the dict literals in the client method that sends it."""
    tree = ast.parse((PKG / "client.py").read_text())
    sent: dict[str, set[str]] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name in ("request", "_checked"):
            continue
        routes = [_const(n) for n in ast.walk(fn) if _const(n) and _const(n).startswith("/")
                  and isinstance(n, ast.Constant)]
        routes = [r for r in routes if r not in ("/",)]
        keys = {_const(k) for n in ast.walk(fn) if isinstance(n, ast.Dict) for k in n.keys if k is not None
                and _const(k)}
        keys |= {kw.arg for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr == "update" for kw in n.keywords if kw.arg}  # body.update(field=...)
        if fn.name == "generate_payload":  # builds the body; the client and the dispatcher post it to /generate
            routes.append("/generate")
        for r in routes:
            sent.setdefault(r, set()).update(keys)
    return sent


def _worker_routes() -> set[str]:
    tree = ast.parse((STANDINS / "cpu_worker_http.py").read_text())
    routes = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                n.func.attr in ("add_get", "add_post", "add_route"):
            for a in n.args[:2]:
                if _const(a) and _const(a).startswith("/"):
                    routes.add(_const(a))
        if isinstance(n, ast.For) and isinstance(n.iter, ast.Tuple):
            routes |= {_const(e) for e in n.iter.elts if _const(e) and _const(e).startswith("/")}
    return routes


# Fields the client nests rather than sends at the top level of a body.
NESTED = {"/generate": {"sampling_params": "SamplingParams"}}


def test_client_routes_and_request_fields_exist_in_sglang(sgl):
    routes, fields = _sglang_routes(sgl), _class_fields(sgl)
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
    fields = _class_fields(sgl)["SamplingParams"]
    for k in ("temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids", "ignore_eos",
              "sampling_seed", "n"):
        assert k in fields, k


def test_response_fields_the_client_reads_exist(sgl):
    for name, keys in READ_KEYS.items():
        tree = ast.parse(sgl[name])
        consts = {_const(n) for n in ast.walk(tree)} | {  # string keys and dataclass field names
            n.target.id for n in ast.walk(tree) if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        absent = [k for k in keys if k not in consts]
        assert absent == [], f"{name} of SGLang {SUPPORTED_SGLANG} never names {absent}"


def test_cpu_worker_exposes_only_sglang_routes(sgl):
    routes = _sglang_routes(sgl)
    worker = _worker_routes()
    assert {"/generate", "/begin_weight_update", "/end_weight_update", "/v1/loads", "/slow_down", "/ready",
            "/health", "/health_generate", "/abort_request"} <= worker
    extra = sorted(worker - set(routes))
    assert extra == [], f"the CPU worker serves routes SGLang {SUPPORTED_SGLANG} lacks: {extra}"
    assert "/get_weight_version" not in routes and "/get_weight_version" not in worker
    assert "/get_load" not in routes and "/get_load" not in worker  # 0.5.23 reports loads at /v1/loads


def _tuple_const(sgl, path: str, name: str) -> tuple:
    for n in ast.walk(ast.parse(sgl[path])):
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
            return tuple(ast.literal_eval(n.value))
    raise AssertionError(f"{name} not in {path}")


def test_worker_sampling_fields_are_sglangs(sgl):
    """The CPU worker's sampling-parameter contract is 0.5.23's: the JSON contract's field list
    (api/v1/api_types.py, unknown keys rejected) and the scheduler's SamplingParams."""
    from megatron_m2po.standins import sglang_sampling
    api = _tuple_const(sgl, "sglang/api/v1/api_types.py", "_FIELDS_SamplingParams")
    assert sglang_sampling.API_FIELDS == api
    srt = _class_fields(sgl)["SamplingParams"]
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
    read = {_const(n.args[0]) for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "req" and n.args and _const(n.args[0])}
    for fn in ast.walk(tree):  # the per-request keys read through a loop over a tuple of names
        if isinstance(fn, ast.For) and isinstance(fn.iter, ast.Tuple):
            read |= {_const(e.elts[0]) for e in fn.iter.elts if isinstance(e, ast.Tuple) and _const(e.elts[0])}
    classes = _class_fields(sgl)
    fields = classes["GenerateReqInput"]
    weights_by_name = {"name", "truncate_size"}  # /get_weights_by_name's request
    assert weights_by_name <= classes["GetWeightsByNameReqInput"]
    generate_read = read - weights_by_name - {"mode", "model_path", "weight_version", "abort_all_requests",
                                              "flush_cache", "group_name", "forward_sleep_time", "new_version",
                                              "abort_all"}
    assert {"input_ids", "text", "sampling_params", "rid", "stream", "return_logprob", "logprob_start_len",
            "custom_logit_processor", "return_text_in_logprobs"} <= generate_read
    assert generate_read - fields == set(), sorted(generate_read - fields)
