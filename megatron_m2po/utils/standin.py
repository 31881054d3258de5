"""The one seam between production code and the CPU stand-ins (:mod:`megatron_m2po.standins`).

Production code never imports the stand-in package (``tests/test_import_graph.py`` checks the
imports, and that the package's dotted name appears in no other production string). Where a run
without GPUs needs a stand-in, production asks for it here, by name:

* ``cpu_platform``: the actor enables the CPU emulation of CUDA when there is no CUDA
  (``actor/actor.py`` ``init_parallel``);
* ``tiny_base``: ``model.hf_path=tiny`` builds the tiny base model (``utils/hf_dir.py``), and the
  rehearsal builds one per model family (``rehearsal.py``);
* ``cpu_worker``: the engine command of ``rollout.engine=cpu_worker`` (``rollout/engines.py``) runs
  it as ``python -m <standin_module("cpu_worker")>`` in a child process;
* ``memory_ledger``: in colocated mode on a run without CUDA the trainer records its resident bytes
  where the CPU workers record theirs (``trainer/colocated.py``), so a run that would hold both on
  one GPU past its budget fails as CUDA would.

Loading by name keeps the stand-ins out of every production import: a GPU run never imports them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

STANDINS = "megatron_m2po.standins"
# The stand-ins production may reach (the seams above); anything else is a test-only helper.
SEAMS = ("cpu_platform", "tiny_base", "cpu_worker", "memory_ledger")


def standin_module(name: str) -> str:
    """The dotted module name of stand-in ``name`` (one of :data:`SEAMS`), for ``python -m`` or import."""
    if name not in SEAMS:
        raise ValueError(f"stand-in {name!r} is not one production may reach; known: {', '.join(SEAMS)}")
    return f"{STANDINS}.{name}"


def load_standin(name: str) -> ModuleType:
    """Import stand-in ``name`` (one of :data:`SEAMS`) and return the module."""
    return importlib.import_module(standin_module(name))
