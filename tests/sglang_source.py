"""SGLang's own source, read from the pinned wheel with ``zipfile`` and ``ast`` (never imported):
what the contract tests of the client (tests/rollout/test_sglang_contract.py), the CPU worker
(tests/standins/test_cpu_worker_sglang_contract.py) and the weight-update groups check against.

The wheel comes from ``scripts/setup.sh`` (``.cache/sglang-wheel``); without it :func:`wheel` skips
the test, except under CI, where it fails.
"""

from __future__ import annotations

import ast
import os
import zipfile
from pathlib import Path

import pytest

from megatron_m2po.rollout.sglang_version import SUPPORTED_SGLANG

ROOT = Path(__file__).resolve().parents[1]
WHEEL_DIR = ROOT / ".cache" / "sglang-wheel"


def wheel() -> zipfile.ZipFile:
    found = sorted(WHEEL_DIR.glob(f"sglang-{SUPPORTED_SGLANG}-*.whl"))
    if not found:
        msg = (f"no sglang-{SUPPORTED_SGLANG} wheel in {WHEEL_DIR}: run scripts/setup.sh (it runs "
               f"`pip download --no-deps sglang=={SUPPORTED_SGLANG} -d .cache/sglang-wheel`)")
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return zipfile.ZipFile(found[0])


def sources() -> dict[str, str]:
    """Path in the wheel -> text of SGLang's server and API modules (``sglang/srt``, ``sglang/api``)."""
    with wheel() as z:
        return {n: z.read(n).decode() for n in z.namelist()
                if n.startswith(("sglang/srt/", "sglang/api/")) and n.endswith(".py")}


def const(node):
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def sglang_routes(sgl) -> dict[str, str | None]:
    """route -> name of its body class (None when it takes no body model)."""
    routes: dict[str, str | None] = {}
    for name in ("sglang/srt/entrypoints/http_server.py", "sglang/srt/entrypoints/v1_loads.py"):
        for fn in ast.walk(ast.parse(sgl[name])):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for d in fn.decorator_list:
                if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and \
                        d.func.attr in ("get", "post", "put", "api_route") and d.args and const(d.args[0]):
                    body = None
                    for a in fn.args.args:
                        ann = a.annotation
                        if isinstance(ann, ast.Subscript) and isinstance(ann.slice, ast.Tuple):
                            ann = ann.slice.elts[0]  # Annotated[X, Body()]
                        if isinstance(ann, ast.Name) and ann.id.endswith(("ReqInput", "Req")):
                            body = ann.id
                    routes[const(d.args[0])] = body
    return routes


def class_fields(sgl) -> dict[str, set[str]]:
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


def tuple_const(sgl, path: str, name: str) -> tuple:
    for n in ast.walk(ast.parse(sgl[path])):
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
            return tuple(ast.literal_eval(n.value))
    raise AssertionError(f"{name} not in {path}")

