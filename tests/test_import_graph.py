"""The package's layering (docs/design.md §2), checked on the source: no import cycles, and

    algo/, parallel/          at the bottom: nothing from actor/ rollout/ weights/ trainer/ store/
    actor/ (Megatron) | rollout/   side by side: neither imports the other
    weights/                  above both (the push from the actor's stages to the engines)
    rollout_service/          rank 0's rollout side, above rollout/ and weights/; not the actor
    trainer/                  on top of all of them; CLI shells and the experiment above it
    */settings.py             config sections: leaves every layer may read (they import only the
                              settings machinery, utils/settings.py, and each other)
    standins/                 the CPU stand-ins: production never imports them; it names them
                              only in utils/standin.py (the seam), and calls that seam only from
                              the modules in SEAM_CALLERS

Every module of ``megatron_m2po/`` is parsed with ``ast``; every ``import`` counts, at module
level, inside functions and under ``if TYPE_CHECKING``. ``import megatron_m2po.store`` (or
``from megatron_m2po import store``) is an edge to ``megatron_m2po/store/__init__.py``;
``from megatron_m2po.store.store import X`` an edge to ``store/store.py``. The parent packages
Python initialises on the way are not edges (every submodule would otherwise "cycle" with
its own ``__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = "megatron_m2po"
ROOT = Path(__file__).resolve().parents[1] / PKG
STANDINS = f"{PKG}.standins"
SEAM = f"{PKG}.utils.standin"  # the one production module that names the stand-ins (loads them by name)
# Where production needs a stand-in (docs/design.md §2): the CPU platform when there is no CUDA, the
# tiny base for model.hf_path=tiny and the rehearsal, the CPU worker's engine command line, the
# memory ledger colocated mode's trainer records into on CPU.
SEAM_CALLERS = {f"{PKG}.actor.actor", f"{PKG}.utils.hf_dir", f"{PKG}.rehearsal", f"{PKG}.rollout.engines",
                f"{PKG}.trainer.colocated"}



def _parse(path):
    """``ast.parse`` of a file, once more after CPython 3.11's spurious ``SystemError: AST constructor
    recursion depth mismatch`` (seen once in a CI run with three xdist workers; the same file parses)."""
    try:
        return ast.parse(path.read_text(), str(path))
    except SystemError:
        return ast.parse(path.read_text(), str(path))

def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package (a package is its own)
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{a.name}"
                out.add(sub if sub in mods else target)
    return {m for m in out if m in mods and m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle (``[a, b, ..., a]``) of the directed graph, or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def _sub(module: str) -> str:
    """Top-level subpackage (or module) of a package module: megatron_m2po.actor.actor -> actor."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _is_settings(module: str) -> bool:
    """A config section's module (``rollout/settings.py``, ``algo/loss_settings.py``): a leaf any layer reads."""
    return module.rsplit(".", 1)[-1].endswith("settings")


def _violations(graph: dict[str, set[str]], src: tuple[str, ...], banned: tuple[str, ...]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, deps in graph.items() if _sub(a) in src
                  for b in deps if _sub(b) in banned and not _is_settings(b))


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    g = _graph()
    assert f"{PKG}.trainer.loop" in g and g[f"{PKG}.trainer.loop"], "the import graph came out empty"
    return g


def test_no_import_cycle(graph):
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_actor_and_rollout_do_not_import_each_other(graph):
    assert _violations(graph, ("actor",), ("rollout",)) == []
    assert _violations(graph, ("rollout",), ("actor",)) == []


def test_algo_and_parallel_are_the_bottom_layer(graph):
    assert _violations(graph, ("algo", "parallel"),
                       ("actor", "rollout", "weights", "rollout_service", "trainer", "store")) == []


def test_weights_sit_above_actor_and_rollout(graph):
    assert f"{PKG}.weights.push" in graph, "the weights package is not where this test looks"
    assert _violations(graph, ("actor", "rollout"), ("weights",)) == []
    assert _violations(graph, ("weights",), ("rollout_service", "trainer")) == []


def test_the_rollout_service_is_rank0s_side_below_the_trainer(graph):
    assert f"{PKG}.rollout_service.service" in graph, "the rollout service is not where this test looks"
    assert _violations(graph, ("rollout_service",), ("trainer", "actor")) == []
    below = ("algo", "parallel", "actor", "rollout", "weights", "store", "data", "rewards", "utils")
    assert _violations(graph, below, ("rollout_service",)) == []


def test_external_ingestion_is_one_package_between_the_store_and_the_rollout_service(graph):
    """``ingestion/`` (producer API, HTTP service, the trainer's endpoint) uses the store and the
    rollout side's group filter; only the rollout service, the trainer and CLI shells start it. The
    old producer path ``rollout/external.py`` is the one alias into it (a deprecation shim)."""
    assert f"{PKG}.ingestion.server" in graph, "the ingestion package is not where this test looks"
    assert _violations(graph, ("ingestion",), ("actor", "weights", "rollout_service", "trainer")) == []
    below = ("algo", "parallel", "actor", "rollout", "weights", "store", "data", "rewards", "utils")
    shells = {f"{PKG}.store.cli", f"{PKG}.rollout.external"}
    assert [v for v in _violations(graph, below, ("ingestion",)) if v.split(" -> ")[0] not in shells] == []
    stray = sorted(m for m in graph if m.rsplit(".", 1)[-1] in ("server", "external", "ingestion", "endpoint")
                   and _sub(m) != "ingestion" and m != f"{PKG}.rollout.external")
    assert stray == [], f"external ingestion outside its package: {stray}"


def test_settings_modules_are_leaves(graph):
    """A config section imports only the settings machinery and other sections (at module level or
    not, except the loss registry, which the algo section asks by name when it validates)."""
    allowed = {f"{PKG}.utils.settings", f"{PKG}.algo.losses", f"{PKG}.algo.registry"}
    bad = sorted(f"{a} -> {b}" for a, deps in graph.items() if _is_settings(a)
                 for b in deps if not _is_settings(b) and b not in allowed)
    assert [a for a in graph if _is_settings(a)], "no settings modules found"
    assert bad == []


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    """The checker itself: function-level and relative imports, and cycles, are found."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _find_cycle(g) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    mods = {f"{PKG}.x": Path("x.py"), f"{PKG}.x.y": Path("y.py"), f"{PKG}.z": Path("z.py")}
    src = tmp_path / "w.py"
    src.write_text("def f():\n    from megatron_m2po.x import y\n    from . import z\n")
    assert _imports(f"{PKG}.w", src, mods) == {f"{PKG}.x.y", f"{PKG}.z"}


def _is_standin(module: str) -> bool:
    return module == STANDINS or module.startswith(STANDINS + ".")


def _standin_imports(graph: dict[str, set[str]]) -> list[str]:
    """Import edges from production modules (outside the stand-in package) into it."""
    return sorted(f"{a} -> {b}" for a, deps in graph.items() if not _is_standin(a) for b in deps if _is_standin(b))


def _names_standins(path: Path) -> list[str]:
    """Lines of ``path`` whose string literals (docstrings aside: they load nothing) name the stand-in
    package, as a dotted module name (importlib, ``python -m``) or a path (runpy)."""
    tree = _parse(path)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    needles = (STANDINS, STANDINS.replace(".", "/"))
    where = path.relative_to(ROOT.parent) if path.is_relative_to(ROOT.parent) else path
    return [f"{where}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
            and any(x in n.value for x in needles)]


def test_production_never_imports_the_standins(graph):
    assert f"{STANDINS}.cpu_worker" in graph, "the stand-in package is not where this test looks"
    assert _standin_imports(graph) == [], "production code imports a CPU stand-in; load it through " \
        f"{SEAM}.load_standin (by name) at one of the seams, or move the code out of the stand-ins"


def test_standins_are_named_only_in_the_seam():
    hits = [h for name, path in _modules().items() if not _is_standin(name) and name != SEAM
            for h in _names_standins(path)]
    assert hits == [], f"production names the stand-in package outside the seam {SEAM}: {hits}"
    assert _names_standins(_modules()[SEAM]), f"the seam {SEAM} no longer names the stand-in package"


def test_the_seam_reaches_real_standins_from_the_known_places(graph):
    from megatron_m2po.utils import standin

    assert standin.STANDINS == STANDINS
    assert {standin.standin_module(n) for n in standin.SEAMS} <= set(graph)
    with pytest.raises(ValueError, match="'dist_testing' is not one production may reach"):
        standin.load_standin("dist_testing")  # a test helper: no seam reaches it
    callers = {a for a, deps in graph.items() if SEAM in deps and not _is_standin(a)}
    assert callers == SEAM_CALLERS, ("a new place in production reaches the stand-ins (or an old one no longer "
                                     f"does): {sorted(callers ^ SEAM_CALLERS)}; update SEAM_CALLERS and "
                                     "docs/design.md §2 if that is intended")


def test_launch_scripts_name_the_seams_standins():
    """The shell launchers start the CPU worker by module name too: the name they use is the seam's."""
    import re

    from megatron_m2po.utils import standin

    scripts = sorted((ROOT.parent / "scripts").glob("*.sh"))
    named = {(s.name, m) for s in scripts for m in re.findall(r"megatron_m2po\.standins\.\w+", s.read_text())}
    assert ("launch_sglang_fleet.sh", standin.standin_module("cpu_worker")) in named, named
    assert {m for _, m in named} <= {standin.standin_module(n) for n in standin.SEAMS}, named


def test_the_standin_rules_see_imports_and_names(tmp_path):
    """The checker itself: a direct import, a function-level import and a dotted name in a string are
    caught; a docstring is not a load."""
    mods = {f"{PKG}.a": Path("a.py"), STANDINS: Path("__init__.py"), f"{STANDINS}.w": Path("w.py")}
    src = tmp_path / "a.py"
    src.write_text(f'"""Mentions {STANDINS}.w in a docstring."""\n'
                   f"def f():\n    from {STANDINS} import w\n")
    g = {f"{PKG}.a": _imports(f"{PKG}.a", src, mods), STANDINS: set(), f"{STANDINS}.w": {f"{PKG}.a"}}
    assert _standin_imports(g) == [f"{PKG}.a -> {STANDINS}.w"]
    assert _names_standins(src) == []
    src.write_text(f"import importlib\nm = importlib.import_module(f'{STANDINS}.{{x}}')\n")
    assert len(_names_standins(src)) == 1
