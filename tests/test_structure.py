"""The package's structure rules (docs/design.md §2), checked on the source with ``ast``:

* no function or method longer than 80 lines;
* calls of the form ``self.a.b.method(...)`` (a collaborator's part, reached through the
  collaborator) stay rare (at most :data:`MAX_DEEP_CALLS` in the package: Ray's
  ``self.actor.method.remote()`` idiom) and none is in the training loop;
* no module reads a private member (``obj._name``) of a class defined in another module: what a
  collaborator needs from a class is in its public interface (the mask strategy's ``MaskHost``,
  for example), so a class can change its insides without breaking another module;
* no component is wired by mutation: no ``self.<collaborator>.<attr> = ...`` outside the CPU
  stand-ins (collaborators arrive through constructors); the one exception is Megatron-Core's
  ``TransformerConfig`` hooks, which its own API sets on the config after the model is built
  (:data:`UPSTREAM_HOOKS`);
* no module imports a private name (``from megatron_m2po.x import _name``) of another: what is
  shared is public (upstream libraries' private names, read where no public API exists, are
  outside this rule and say why at their import);
* the training loop never asks which rank it runs on: rank 0's part is one object every rank holds
  (``_Lead``), so ``if`` tests of it or of the rank number stay at :data:`MAX_RANK_TESTS` (the run
  summary, which reads rank 0's files), and rank 0's results wrapped as lambdas at
  :data:`MAX_RANK0_LAMBDAS` (the start-up checks, the resume checkpoint, the rollout state).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "megatron_m2po"
MAX_FUNCTION_LINES = 80
MAX_DEEP_CALLS = 5
LOOP = "trainer/loop.py"
MAX_RANK_TESTS = 1
MAX_RANK0_LAMBDAS = 5


def _trees() -> dict[str, ast.Module]:
    return {str(p.relative_to(PKG)): ast.parse(p.read_text(), str(p)) for p in sorted(PKG.rglob("*.py"))}


def long_functions(trees: dict[str, ast.Module]) -> list[str]:
    return sorted(f"{mod}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
                  for mod, tree in trees.items() for n in ast.walk(tree)
                  if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES)


def _is_deep_call(node: ast.AST) -> bool:
    """``self.a.b.method(...)``: the callee hangs three attributes below ``self``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    v = node.func.value
    return (isinstance(v, ast.Attribute) and isinstance(v.value, ast.Attribute)
            and isinstance(v.value.value, ast.Name) and v.value.value.id == "self")


def deep_calls(trees: dict[str, ast.Module]) -> list[str]:
    return sorted(f"{mod}:{n.lineno} {ast.unparse(n.func)}" for mod, tree in trees.items()
                  for n in ast.walk(tree) if _is_deep_call(n))


def _private_members(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Private member name -> the modules whose classes define it (a ``def _x``, a class-level
    ``_x = ...`` or a ``self._x = ...`` in one of its methods)."""
    owners: dict[str, set[str]] = defaultdict(set)
    for mod, tree in trees.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for n in ast.walk(cls):
                names = []
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names = [n.name]
                elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                    targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                    names = [t.id if isinstance(t, ast.Name) else t.attr for t in targets
                             if isinstance(t, ast.Name) or (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                                            and t.value.id == "self")]
                owners.update({m: owners[m] | {mod} for m in names if m.startswith("_") and not m.startswith("__")})
    return owners


def foreign_private_reads(trees: dict[str, ast.Module]) -> list[str]:
    owners = _private_members(trees)
    out = []
    for mod, tree in trees.items():
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and n.attr in owners and mod not in owners[n.attr]):
                continue
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                continue  # its own member (a subclass reading its base's is the class's own business)
            out.append(f"{mod}:{n.lineno} {ast.unparse(n)} (private to {', '.join(sorted(owners[n.attr]))})")
    return sorted(out)


def private_imports(trees: dict[str, ast.Module]) -> list[str]:
    """``from megatron_m2po.<module> import _name`` (a private name of another package module)."""
    return sorted(f"{mod}:{n.lineno} from {n.module} import {a.name}" for mod, tree in trees.items()
                  for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                  and (n.level > 0 or (n.module or "").split(".")[0] == "megatron_m2po")
                  for a in n.names if a.name.startswith("_") and not a.name.startswith("__"))


# Megatron-Core's TransformerConfig fields that its training code sets after the model and the
# optimizer exist (megatron/training/training.py: config.grad_scale_func, no_sync_func, ...).
UPSTREAM_HOOKS = {"actor/actor.py": {"self._tconfig.finalize_model_grads_func", "self._tconfig.no_sync_func",
                                     "self._tconfig.grad_scale_func"}}


def collaborator_mutations(trees: dict[str, ast.Module]) -> list[str]:
    """``self.a.b = ...``: an attribute of a collaborator assigned from outside it (stand-ins excepted)."""
    out = []
    for mod, tree in trees.items():
        if mod.startswith("standins/"):
            continue
        for n in ast.walk(tree):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                n, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute)
                        and isinstance(t.value.value, ast.Name) and t.value.value.id == "self"
                        and ast.unparse(t) not in UPSTREAM_HOOKS.get(mod, ())):
                    out.append(f"{mod}:{n.lineno} {ast.unparse(t)}")
    return sorted(out)


def test_no_function_over_80_lines():
    assert long_functions(_trees()) == []


def test_calls_do_not_reach_through_collaborators():
    calls = deep_calls(_trees())
    assert not [c for c in calls if c.startswith(LOOP)], f"the training loop reaches through a collaborator: {calls}"
    assert len(calls) <= MAX_DEEP_CALLS, f"{len(calls)} calls of the form self.a.b.method(...): {calls}"


def test_no_module_reads_another_class_private_members():
    assert foreign_private_reads(_trees()) == []


def test_no_module_imports_another_modules_private_names():
    assert private_imports(_trees()) == []


def test_no_component_is_wired_after_construction():
    assert collaborator_mutations(_trees()) == []


def rank_tests(tree: ast.Module) -> tuple[list[int], list[int]]:
    """Lines of the loop's ``Trainer`` whose ``if`` tests ``self.lead`` or ``self.rank``, and those
    that hand a lambda to ``self.lead.call`` (rank 0's results)."""
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    asks = re.compile(r"\bself\.rank\b|\bself\.lead(\.here|\.service)?\b(?!\s*[.(])")  # not a _Lead method's result
    tests, lambdas = [], []
    for n in ast.walk(trainer):
        if isinstance(n, (ast.If, ast.IfExp)) and asks.search(ast.unparse(n.test)):
            tests.append(n.lineno)
        if (isinstance(n, ast.Call) and ast.unparse(n.func) == "self.lead.call" and n.args
                and isinstance(n.args[0], ast.Lambda)):
            lambdas.append(n.lineno)
    return tests, lambdas


def test_the_loop_does_not_ask_which_rank_it_is_on():
    tests, lambdas = rank_tests(_trees()[LOOP])
    assert len(tests) <= MAX_RANK_TESTS, f"{LOOP}: rank tests at lines {tests}: give rank 0's part to _Lead"
    assert len(lambdas) <= MAX_RANK0_LAMBDAS, f"{LOOP}: rank 0's results as lambdas at lines {lambdas}: a _Lead method"


def test_every_package_says_what_it_owns():
    """Each package's ``__init__`` opens with a docstring saying what the package is for."""
    bare = [mod for mod, tree in _trees().items() if mod.endswith("__init__.py")
            and len((ast.get_docstring(tree) or "").split()) < 12]
    assert bare == [], f"packages whose __init__ does not say what they own: {bare}"


def test_the_checks_see_what_they_should():
    """The checkers themselves, on a small source: each rule finds its violation."""
    src = ast.parse("class A:\n    def __init__(self):\n        self._hint = 1\n"
                    "    def f(self):\n        return self.b.c.d()\n"
                    "def g(a):\n    return a._hint\n" + "def h():\n" + "    x = 1\n" * 81)
    other = ast.parse("def k(a):\n    return a._hint\n")
    assert deep_calls({"m.py": src}) == ["m.py:5 self.b.c.d"]
    assert long_functions({"m.py": src}) == ["m.py:8 h (82 lines)"]
    # Read in its own module: allowed; from another module: reported.
    assert foreign_private_reads({"m.py": src, "n.py": other}) == ["n.py:2 a._hint (private to m.py)"]
    wired = ast.parse("class B:\n    def f(self, w):\n        self.weights.drain = w\n        self.n = 1\n")
    assert collaborator_mutations({"m.py": wired, "standins/x.py": wired}) == ["m.py:3 self.weights.drain"]
    imports = ast.parse("from megatron_m2po.rollout.client import RETRY, _hidden\nfrom torch.x import _y\n"
                        "from .m import _z\n")
    assert private_imports({"n.py": imports}) == ["n.py:1 from megatron_m2po.rollout.client import _hidden",
                                                  "n.py:3 from m import _z"]
