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
