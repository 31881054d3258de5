"""A package's public names, each loaded from its module on first use (PEP 562).

A package whose ``__init__`` imported its modules eagerly made every import of one of its
modules pay for all of them: reading a config section (``store/settings.py``) imported the store,
numpy and SQLite. The packages name where each public name lives instead::

    __getattr__ = lazy_exports(__name__, {"RolloutStore": "store", "Group": "types"})
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """The module-level ``__getattr__`` of ``package``: ``name`` from ``package.<where[name]>``."""
    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)
    return __getattr__
