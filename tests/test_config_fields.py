"""Every field of the config tree is read by the package, or it should not exist.

How: walk the dataclass tree of ``megatron_m2po.config.Config`` (sections and nested sections
such as ``algo.m2po``) and scan every module of the package except ``config.py`` and the
``settings.py`` modules that define the sections (their definitions, ``validate()`` checks and
dumps are not uses) with ``ast``. A field ``f`` of section ``S``
counts as read when some *load* ``<expr>.f`` has an ``<expr>`` that denotes ``S``:

* an attribute named like ``S``'s leaf: ``cfg.store.max_staleness``, ``self.cfg.algo.tis``,
  ``algo_cfg.m2po.threshold``;
* a name or attribute bound to such an expression in the same module: ``s = self.cfg.store``
  then ``s.order``; ``t, a = cfg.trainer, cfg.algo``; ``self.cfg = cfg.rollout``;
* a parameter (or attribute assigned from one) annotated with ``S``'s class:
  ``def __init__(self, cfg: RolloutConfig)`` + ``self.cfg = cfg`` + ``self.cfg.engine_tp``,
  or named after it by the package's convention: ``data_cfg``, ``reward_cfg`` (``<leaf>_cfg``);
* a call of a function of the same module whose return annotation is ``S``'s class.

Reading ``max_staleness`` on ``rollout`` does not count for ``store.max_staleness``; writes and
``dataclasses.asdict`` dumps do not count either. ``test_the_check_can_fail`` shows that a field
nothing reads (a dummy) and a field read only under another section are reported.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import megatron_m2po
from megatron_m2po.config import Config

PKG = Path(megatron_m2po.__file__).parent


def config_fields(cls: type = Config, prefix: str = "") -> tuple[dict[str, str], list[tuple[str, str]]]:
    """({section class name: dotted section path}, [(section path, field name)]) of the tree."""
    classes: dict[str, str] = {}
    fields: list[tuple[str, str]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            path = f"{prefix}{f.name}"
            classes[tp.__name__] = path
            sub_classes, sub_fields = config_fields(tp, path + ".")
            classes.update(sub_classes)
            sub_hints = typing.get_type_hints(tp)
            fields += [(path, g.name) for g in dataclasses.fields(tp) if not dataclasses.is_dataclass(sub_hints[g.name])]
            fields += sub_fields
    return classes, fields


def _annotation_name(ann: ast.expr | None) -> str | None:
    if isinstance(ann, ast.Name):
        return ann.id
    if isinstance(ann, ast.Attribute):
        return ann.attr
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        return ann.value.rsplit(".", 1)[-1]
    if isinstance(ann, ast.BinOp):  # X | None
        return _annotation_name(ann.left) or _annotation_name(ann.right)
    if isinstance(ann, ast.Subscript):  # Optional[X]
        return _annotation_name(ann.slice)
    return None


def _label(node: ast.expr) -> str | None:
    """The name an expression is known by: ``x`` for ``x`` and for ``<anything>.x``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


class _Module:
    def __init__(self, tree: ast.AST, classes: dict[str, str], section_paths: set[str]):
        self.tree = tree
        self.by_leaf: dict[str, set[str]] = {}
        for p in section_paths:
            self.by_leaf.setdefault(p.rsplit(".", 1)[-1], set()).add(p)
        self.aliases: dict[str, set[str]] = {f"{leaf}_cfg": set(p) for leaf, p in self.by_leaf.items()}
        self.returns: dict[str, str] = {}  # functions of this module returning a section
        for node in ast.walk(tree):  # annotated parameters, attributes and returns
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _annotation_name(node.returns) in classes:
                self.returns[node.name] = classes[_annotation_name(node.returns)]
            if isinstance(node, ast.arg) and _annotation_name(node.annotation) in classes:
                self.aliases.setdefault(node.arg, set()).add(classes[_annotation_name(node.annotation)])
            if isinstance(node, ast.AnnAssign) and _annotation_name(node.annotation) in classes:
                label = _label(node.target)
                if label:
                    self.aliases.setdefault(label, set()).add(classes[_annotation_name(node.annotation)])
        for _ in range(3):  # assignments, to a fixed point (aliases of aliases)
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        self._bind(target, node.value)
                elif isinstance(node, ast.AnnAssign) and node.value is not None:
                    self._bind(node.target, node.value)

    def _bind(self, target: ast.expr, value: ast.expr) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                self._bind(t, v)
            return
        label = _label(target)
        secs = self.sections_of(value)
        if label and secs:
            self.aliases.setdefault(label, set()).update(secs)

    def sections_of(self, node: ast.expr) -> set[str]:
        """Section paths an expression may denote."""
        out: set[str] = set()
        if isinstance(node, ast.Call):
            fn = _label(node.func)
            return {self.returns[fn]} if fn in self.returns else out
        label = _label(node)
        if label is None:
            return out
        out |= self.aliases.get(label, set())
        if isinstance(node, ast.Attribute) and node.attr in self.by_leaf:
            parents = self.by_leaf[node.attr]
            nested = {p for p in parents if "." in p}
            # algo.m2po: the value must itself denote algo (or anything, if it is a plain name chain)
            base = self.sections_of(node.value)
            out |= {p for p in nested if p.rsplit(".", 1)[0] in base or not base} | (parents - nested)
        return out

    def reads(self) -> set[tuple[str, str]]:
        found = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                for sec in self.sections_of(node.value):
                    found.add((sec, node.attr))
        return found


def unread_fields(fields: list[tuple[str, str]], classes: dict[str, str]) -> list[str]:
    sections = {s for s, _ in fields}
    read: set[tuple[str, str]] = set()
    for path in sorted(PKG.rglob("*.py")):
        if path == PKG / "config.py" or path.name == "settings.py":  # definitions and checks, not uses
            continue
        read |= _Module(ast.parse(path.read_text(), str(path)), classes, sections).reads()
    return [f"{s}.{f}" for s, f in fields if (s, f) not in read]


def test_every_config_field_is_read():
    classes, fields = config_fields()
    assert len(fields) > 100 and ("algo.m2po", "threshold") in fields  # the walk reaches nested sections
    unread = unread_fields(fields, classes)
    assert not unread, (f"config fields nothing in megatron_m2po/ reads (outside config.py and */settings.py): {unread}; "
                        "use them or remove them")


def test_the_check_can_fail():
    classes, fields = config_fields()
    fake = [("store", "dummy_knob_nobody_reads"), ("rollout", "max_staleness"), ("algo.grpo", "threshold")]
    assert unread_fields(fields + fake, classes) == [f"{s}.{f}" for s, f in fake]
