#!/usr/bin/env python3
"""Prints how long each test binary of the last `cargo nextest run` took and its ten slowest
tests, from the JUnit report nextest writes (`.config/nextest.toml`). CI (`.ci/run`) prints it
after the tests, passed or failed, so a slow test is seen the day it lands.

    cargo nextest run --release; python3 tools/test_times.py

nextest runs the binaries' tests side by side, so a binary's wall time is the span from its
first test's start to its last test's end; the tests' own times are listed beside it.
"""

import sys
import xml.etree.ElementTree as ElementTree
from datetime import datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLOWEST = 10


def report_path() -> Path:
    """The JUnit report of nextest's default profile. nextest keeps its store under the
    workspace's own `target/` folder whatever CARGO_TARGET_DIR says (its `store.dir`)."""
    return ROOT / "target" / "nextest" / "default" / "junit.xml"


def seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 60 else f"{int(value // 60)} min {value % 60:.0f} s"


def main() -> int:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else report_path()
    if not path.exists():
        print(f"no test report at {path}: did `cargo nextest run` run?")
        return 1
    tests = []
    for suite in ElementTree.parse(path).getroot().iter("testsuite"):
        for case in suite.iter("testcase"):
            took = float(case.get("time", 0))
            start = datetime.fromisoformat(case.get("timestamp"))
            outcome = "failed" if case.find("failure") is not None else "passed"
            if case.find("skipped") is not None:
                continue
            tests.append((suite.get("name"), case.get("name"), start, took, outcome))
    if not tests:
        print(f"{path} lists no test that ran")
        return 1
    print(f"\ntest binaries (from {path}):")
    print(f"  {'wall':>10}  {'tests':>10}  binary")
    binaries = sorted({test[0] for test in tests})
    rows = []
    for binary in binaries:
        own = [test for test in tests if test[0] == binary]
        first = min(test[2] for test in own)
        last = max(test[2] + timedelta(seconds=test[3]) for test in own)
        rows.append(((last - first).total_seconds(), sum(test[3] for test in own), len(own), binary))
    for wall, total, count, binary in sorted(rows, reverse=True):
        print(f"  {seconds(wall):>10}  {seconds(total):>10}  {binary} ({count} tests)")
    first = min(test[2] for test in tests)
    last = max(test[2] + timedelta(seconds=test[3]) for test in tests)
    print(f"  {seconds((last - first).total_seconds()):>10}  {'':>10}  all of them")
    print(f"the {SLOWEST} slowest tests:")
    for binary, name, _, took, outcome in sorted(tests, key=lambda t: t[3], reverse=True)[:SLOWEST]:
        failed = " (failed)" if outcome == "failed" else ""
        print(f"  {seconds(took):>10}  {binary} {name}{failed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
