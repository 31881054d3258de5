"""tools/suite_durations.py reads pytest's JUnit report as .ci/run writes it (the durations file
docs/contributing.md points to): the slowest tests first, xdist's ``@group`` suffix dropped so runs
with and without ``-n`` compare, a test missing from the later run marked as folded."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.trainer.test_e2e_tiny" name="test_a@e2e_tiny" time="40.5"/>
<testcase classname="tests.test_config" name="test_b" time="0.2"/>
<testcase classname="tests.store.test_store_api" name="test_c" time="3.0"><failure message="x"/></testcase>
</testsuite></testsuites>"""
BEFORE = REPORT.replace('time="40.5"', 'time="90.0"').replace(
    '<testcase classname="tests.test_config" name="test_b" time="0.2"/>',
    '<testcase classname="tests.test_config" name="test_b" time="0.2"/>'
    '<testcase classname="tests.trainer.test_gone" name="test_folded" time="70.0"/>')


def _tool():
    spec = importlib.util.spec_from_file_location("suite_durations", ROOT / "tools" / "suite_durations.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_slowest_first_with_outcomes_and_the_folded_tests(tmp_path, capsys):
    tool = _tool()
    (tmp_path / "after.xml").write_text(REPORT)
    (tmp_path / "before.xml").write_text(BEFORE)
    got = tool.read(tmp_path / "after.xml")
    assert got == {"tests/trainer/test_e2e_tiny.py::test_a": (40.5, "passed"),
                   "tests/test_config.py::test_b": (0.2, "passed"),
                   "tests/store/test_store_api.py::test_c": (3.0, "failure")}
    assert tool.main([str(tmp_path / "after.xml"), "--top", "2"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| `")]
    assert rows == ["| `tests/trainer/test_e2e_tiny.py::test_a` | 40.5 |", "| `tests/store/test_store_api.py::test_c` | 3.0 |"]
    assert tool.main([str(tmp_path / "after.xml"), "--before", str(tmp_path / "before.xml"), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "| `tests/trainer/test_e2e_tiny.py::test_a` | 90.0 | 40.5 |" in out
    assert "| `tests/trainer/test_gone.py::test_folded` | 70.0 | (folded) |" in out
    assert "after: 3 tests" in out and "1 failure, 2 passed" in out
    assert tool.main([str(tmp_path / "missing.xml")]) == 2


def test_costliest_files_are_scheduled_first(tmp_path):
    """tests/conftest.py orders the collection by tests/suite_costs.json under xdist (longest first,
    a file's own order kept, an unmeasured file first) and turns off xdist's reordering by scope
    size, which would undo it; the committed costs are tools/cpu_per_test.py's format."""
    import json
    import os
    import subprocess
    import sys

    costs = json.loads((ROOT / "tests" / "suite_costs.json").read_text())
    assert list(costs.values()) == sorted(costs.values(), reverse=True) and len(costs) > 50
    assert all(f.startswith("tests/") and f.endswith(".py") for f in costs)
    (tmp_path / "tests").mkdir()
    for name in ("test_dear.py", "test_new.py"):
        (tmp_path / "tests" / name).write_text("def test_1(): pass\ndef test_2(): pass\n")
    # one work unit of two tests: xdist's reordering by unit size would start it first
    (tmp_path / "tests" / "test_cheap.py").write_text(
        "import pytest\npytestmark = pytest.mark.xdist_group('g')\ndef test_1(): pass\ndef test_2(): pass\n")
    (tmp_path / "tests" / "suite_costs.json").write_text(json.dumps({"tests/test_dear.py": 9.0,
                                                                     "tests/test_cheap.py": 1.0}))
    src = (ROOT / "tests" / "conftest.py").read_text()
    src = src[src.index("_COSTS = "):]  # the ordering hooks alone (the rest needs the suite's helpers)
    (tmp_path / "tests" / "conftest.py").write_text("import json\nimport os\nfrom pathlib import Path\n\n" + src)
    out = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "--dist", "loadgroup", "-v", "-p",
                          "no:cacheprovider", "tests"],
                         cwd=tmp_path, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"})  # the outer run's options
    assert out.returncode == 0, out.stdout + out.stderr
    rows = out.stdout
    ran = [ln.split()[-1].split("@")[0] for ln in rows.splitlines() if " PASSED " in ln]
    assert ran == ["tests/test_new.py::test_1", "tests/test_new.py::test_2", "tests/test_dear.py::test_1",
                   "tests/test_dear.py::test_2", "tests/test_cheap.py::test_1", "tests/test_cheap.py::test_2"], rows
