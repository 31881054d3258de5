"""The slowest tests of a suite run, from the JUnit report ``.ci/run`` writes (``.ci/reports/junit.xml``).

    python tools/suite_durations.py .ci/reports/junit.xml                 # the 20 slowest tests
    python tools/suite_durations.py after.xml --before before.xml --top 20   # side by side, as a table

Prints a Markdown table (test, seconds; with ``--before``, both runs' seconds) and the totals: the
sum of the test times and the number of tests per outcome. Names lose pytest-xdist's ``@group``
suffix so runs with and without ``-n`` compare.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def read(path: Path) -> dict[str, tuple[float, str]]:
    """``{test id: (seconds, outcome)}`` of a JUnit XML report (pytest's ``--junitxml``)."""
    out: dict[str, tuple[float, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "").split("@")[0]
        cls = case.get("classname", "")
        key = f"{cls.replace('.', '/')}.py::{name}" if cls else name
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = tag
        out[key] = (float(case.get("time", 0.0)), outcome)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path, help="a JUnit XML report")
    ap.add_argument("--before", type=Path, help="an earlier run's report, shown beside it")
    ap.add_argument("--top", type=int, default=20, help="how many tests (default 20)")
    a = ap.parse_args(argv)
    for p in (a.report, a.before):
        if p is not None and not p.is_file():
            print(f"suite_durations: {p} does not exist (.ci/run writes .ci/reports/junit.xml)", file=sys.stderr)
            return 2
    after = read(a.report)
    before = read(a.before) if a.before else None
    ranked = sorted(after.items(), key=lambda kv: -kv[1][0])[:a.top]
    if before is not None:
        # the slowest of either run: a test that got fast (or was folded away) is listed too
        gone = sorted(((k, v) for k, v in before.items() if k not in dict(ranked)), key=lambda kv: -kv[1][0])
        names = [k for k, _ in ranked] + [k for k, v in gone[:a.top] if v[0] > (ranked[-1][1][0] if ranked else 0)]
        print("| test | before (s) | after (s) |\n| --- | ---: | ---: |")
        for k in names:
            b = f"{before[k][0]:.1f}" if k in before else "-"
            t = f"{after[k][0]:.1f}" if k in after else "(folded)"
            print(f"| `{k}` | {b} | {t} |")
    else:
        print("| test | seconds |\n| --- | ---: |")
        for k, (t, _) in ranked:
            print(f"| `{k}` | {t:.1f} |")
    for label, rep in (("before", before), ("after" if before else "run", after)):
        if rep is None:
            continue
        counts: dict[str, int] = {}
        for _, outcome in rep.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        total = sum(t for t, _ in rep.values())
        print(f"\n{label}: {len(rep)} tests, {total / 60:.1f} min of test time, "
              + ", ".join(f"{n} {o}" for o, n in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
