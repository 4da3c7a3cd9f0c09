#!/usr/bin/env python3
"""Checks that the command line (what `cargo run --release` builds) and the Python module
(python/) reuse every dependency the tests compiled: run after `cargo test --release --no-run`,
it builds both and fails, naming them, if any crate the tests also use was compiled again (built
with other features, so a newcomer's two commands, or CI, would build Burn twice). The fix is a
line in the "workspace hack" of the root Cargo.toml (the `shared-build` feature).

    cargo test --release --no-run && python3 tools/shared_features.py
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cargo(*args: str) -> str:
    return subprocess.run(
        ["cargo", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def main() -> int:
    tree = cargo("tree", "-p", "mmlora", "-e", "normal,build,dev", "--prefix", "none", "-f", "{p}")
    shared = {line.split()[0] for line in tree.splitlines() if line.strip()} - {"mmlora"}
    failed = False
    for what, build in [
        ("the command line", ["--bin", "mmlora"]),
        ("the Python module", ["-p", "mmlora-python"]),
    ]:
        messages = cargo("build", "--release", *build, "--message-format", "json")
        rebuilt = set()
        for line in messages.splitlines():
            message = json.loads(line)
            if message.get("reason") == "compiler-artifact" and not message["fresh"]:
                name = message["package_id"].rsplit("#", 1)[-1].split("@")[0]
                rebuilt.add(name.rsplit("/", 1)[-1])
        again = sorted(rebuilt & shared)
        if again:
            print(f"{what} compiled these again, with other features than the tests':")
            print("  " + ", ".join(again))
            failed = True
        else:
            print(f"{what} reuses the tests' dependencies (compiled: {sorted(rebuilt)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
