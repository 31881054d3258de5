import json
import os
from pathlib import Path

# Keep tests deterministic and light on the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


import pytest  # noqa: E402

from launcher import SharedRuns  # noqa: E402
from rollout_testlib import build_tiny_qwen2  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Qwen2 model built locally (tests of the engines, the stand-ins and the weight pushes)."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> SharedRuns:
    """Tiny ``m2po train`` runs shared by the tests that read them (tests/launcher.py ``SharedRuns``)."""
    return SharedRuns(tmp_path_factory.mktemp("shared_runs"))


_SHARED_SCOPES = ("module", "class", "package")


def pytest_itemcollected(item):
    """Under ``pytest -n 3 --dist loadgroup`` (pytest-xdist, the README's command) a file whose tests
    share a module- or class-scoped fixture runs on one worker, in file order (the fixture is built
    once, and files such as tests/rollout/test_fleet.py walk one fleet through its tests); tests
    that share a run say so with ``pytest.mark.xdist_group``. Every other test goes to whichever
    worker is free. (Marked as each test is collected: xdist reads the marks in its own
    ``pytest_collection_modifyitems``.)"""
    if item.get_closest_marker("xdist_group") is not None:
        return
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    if any(fd.scope in _SHARED_SCOPES for fds in defs for fd in fds):
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


_COSTS = Path(__file__).with_name("suite_costs.json")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the costliest test files first (longest-processing-time first): the files'
    CPU seconds measured on the CI machine (``tests/suite_costs.json``, written by
    ``tools/cpu_per_test.py --write-costs``; docs/contributing.md). xdist hands out tests in
    collection order, so a long rehearsal that came last would run alone at the end while the other
    workers idle. The order inside a file is kept; a file not in the list (new) goes first, as if
    costly, until it is measured. Serial runs keep pytest's order."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not _COSTS.is_file():
        return
    costs = json.loads(_COSTS.read_text())
    top = max(costs.values(), default=0.0) + 1.0
    items.sort(key=lambda it: -costs.get(it.nodeid.split("::")[0], top))


def pytest_configure(config):
    """pytest-xdist's ``loadgroup`` would reorder its work units by their number of tests (its
    ``--loadscope-reorder`` default); the costliest-first order above is kept instead."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
