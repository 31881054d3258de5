"""pytest plugin: the CPU seconds of every test, its processes included, and a table of the costliest.

    PYTHONPATH=tools .venv/bin/python -m pytest -q -n 3 --dist loadgroup -p cpu_per_test
    python tools/cpu_per_test.py .ci/reports/cpu          # the 30 costliest tests and files, totals
    python tools/cpu_per_test.py .ci/reports/cpu --write-costs tests/suite_costs.json   # the scheduling order

A test's time in the JUnit report is its wall time while other workers run beside it, so on CI's
two cores it measures the machine's load as much as the test. What the suite's budget is spent on
is CPU: each pytest-xdist worker is put in a cgroup (v1 ``cpuacct``, Linux, root) of its own; every
process a test starts (a trainer, its engines, router, reward workers, a rank pool) inherits it,
so the group's ``cpuacct.usage`` across a test is the CPU that test cost, whatever ran beside it.
One JSON line a test (``[test id, cpu seconds, wall seconds]``) is appended to
``$CPU_PER_TEST_OUT/<worker>.jsonl`` (default ``.ci/reports/cpu``) as the test ends, so a run
that is killed keeps what it measured. Without a writable cpuacct hierarchy the plugin says so
once and measures nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

CGROUP = Path("/sys/fs/cgroup/cpuacct")
_group: Path | None = None


def _out_dir() -> Path:
    return Path(os.environ.get("CPU_PER_TEST_OUT", ".ci/reports/cpu"))


def _usage() -> float:
    return int((_group / "cpuacct.usage").read_text()) / 1e9


def pytest_configure(config) -> None:
    global _group
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None and getattr(config.option, "numprocesses", None):
        return  # the xdist controller runs no test
    group = CGROUP / f"m2po-tests-{worker or 'main'}-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        print(f"cpu_per_test: no per-test CPU ({group}: {e.strerror}; needs cgroup v1 cpuacct and root)",
              file=sys.stderr)
        return
    _group = group
    _out_dir().mkdir(parents=True, exist_ok=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _group is None:
        yield
        return
    c0, t0 = _usage(), time.monotonic()
    yield
    with open(_out_dir() / f"{_group.name}.jsonl", "a") as f:
        f.write(json.dumps([item.nodeid, round(_usage() - c0, 2), round(time.monotonic() - t0, 2)]) + "\n")


def read(directory: Path) -> list[tuple[str, float, float]]:
    rows = []
    for p in sorted(Path(directory).glob("*.jsonl")):
        for line in p.read_text().splitlines():
            try:
                name, cpu, wall = json.loads(line)
            except ValueError:
                continue
            rows.append((name.split("@")[0], float(cpu), float(wall)))
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", nargs="?", default=".ci/reports/cpu")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--write-costs", metavar="JSON",
                    help="also write each test file's CPU seconds (largest first) here: tests/suite_costs.json, "
                         "from which tests/conftest.py starts the costliest files first under pytest-xdist")
    a = ap.parse_args(argv)
    rows = read(Path(a.directory))
    if not rows:
        print(f"no measurements in {a.directory}", file=sys.stderr)
        return 1
    if a.write_costs:
        costs: dict[str, float] = {}
        for name, cpu, _ in rows:
            f = name.split("::")[0]
            costs[f] = costs.get(f, 0.0) + cpu
        ordered = {f: round(c, 1) for f, c in sorted(costs.items(), key=lambda kv: (-kv[1], kv[0]))}
        Path(a.write_costs).write_text(json.dumps(ordered, indent=0) + "\n")
    total = sum(r[1] for r in rows)
    print(f"{len(rows)} tests, {total:.0f} CPU s ({total / 60 / 2:.1f} min of 2 cores), "
          f"{sum(r[2] for r in rows):.0f} s of test wall time summed")
    print("\n| test | CPU s | wall s |\n| --- | ---: | ---: |")
    for name, cpu, wall in sorted(rows, key=lambda r: -r[1])[:a.top]:
        print(f"| `{name}` | {cpu:.1f} | {wall:.1f} |")
    files: dict[str, list[float]] = {}
    for name, cpu, _ in rows:
        files.setdefault(name.split("::")[0], []).append(cpu)
    print("\n| file | tests | CPU s |\n| --- | ---: | ---: |")
    for f, cpus in sorted(files.items(), key=lambda kv: -sum(kv[1]))[:a.top]:
        print(f"| `{f}` | {len(cpus)} | {sum(cpus):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
