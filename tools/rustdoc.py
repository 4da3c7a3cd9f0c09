#!/usr/bin/env python3
"""Documents the library with rustdoc against the release build's dependencies.

    python3 tools/rustdoc.py            # the HTML docs, warnings denied (what `cargo doc --no-deps` checks)
    python3 tools/rustdoc.py --json     # rustdoc's JSON of the public API (tools/public_api.py reads it)

`cargo doc` documents against dependencies compiled in check mode, a second build of Burn and
wgpu (about as long as the release build itself on two cores). rustdoc reads a dependency's
metadata from an rlib as well, so this runs it on `src/lib.rs` with the `--extern` flags of
the release build that `cargo test --release` makes anyway: the same documentation and the
same warnings, in seconds. The library is documented as a user of it builds it
(`--features`, none by default; the HTML check passes the default features too).
"""

import argparse
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CRATE = "mmlora"
# The features the tests' release build compiles the library with (its dev-dependency on
# itself adds `testkit`): building the same unit again finds it fresh.
BUILT_WITH = ["testkit"]


def cargo_json(*args: str) -> list[dict]:
    out = subprocess.run(
        ["cargo", *args, "--message-format=json-render-diagnostics"],
        cwd=ROOT, capture_output=True, text=True,
    )
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        sys.exit(f"cargo {' '.join(args)} failed")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@functools.cache
def package() -> tuple[dict, Path]:
    """The library's package as cargo metadata describes it, and the target folder (read once:
    both the features and the rustdoc call need it)."""
    metadata = json.loads(subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout)
    found = next(p for p in metadata["packages"] if p["name"] == CRATE)
    return found, Path(metadata["target_directory"])


def externs() -> list[str]:
    """`--extern name=rlib` for each dependency of the library, from the release build.

    A crate can be built twice (for the build machine's proc macros and build scripts, and for
    the library, with other features): cargo's unit graph says which build the library links,
    by package, features and profile, and the build's messages where that build's rlib is.
    """
    features = ["--features", ",".join(BUILT_WITH)]
    built = {}
    for message in cargo_json("build", "--release", "--lib", *features):
        if message.get("reason") == "compiler-artifact":
            key = unit_key(message["package_id"], message["target"]["name"],
                           message["features"], message["profile"]["opt_level"])
            built[key] = message["filenames"]
    graph = json.loads(subprocess.run(
        ["cargo", "build", "--release", "--lib", *features, "-Z", "unstable-options",
         "--unit-graph"],
        cwd=ROOT, env=dict(os.environ, RUSTC_BOOTSTRAP="1"), capture_output=True, text=True,
        check=True,
    ).stdout)
    units = graph["units"]
    flags = []
    for dep in units[graph["roots"][0]]["dependencies"]:
        unit = units[dep["index"]]
        key = unit_key(unit["pkg_id"], unit["target"]["name"], unit["features"],
                       unit["profile"]["opt_level"])
        files = [f for f in built.get(key, []) if f.endswith((".rlib", ".so"))]
        if not files:
            sys.exit(f"the release build made no library for {unit['pkg_id']}")
        flags += ["--extern", f"{dep['extern_crate_name']}={files[0]}"]
    return flags


def unit_key(package: str, target: str, features: list[str], opt_level: str) -> tuple:
    return package, target, tuple(sorted(features)), str(opt_level)


def rustdoc(features: list[str], json_output: bool) -> Path:
    """Runs rustdoc on the library with `features` on; returns the folder it wrote to."""
    found, target = package()
    out = target / ("api-json" if json_output else "doc-release")
    command = [
        "rustdoc", f"--edition={found['edition']}", "--crate-type", "lib", "--crate-name", CRATE,
        str(ROOT / "src" / "lib.rs"), "-o", str(out),
        "-L", f"dependency={target / 'release' / 'deps'}", *externs(),
    ]
    for feature in features:
        command += ["--cfg", f'feature="{feature}"']
    env = dict(os.environ, CARGO_MANIFEST_DIR=str(ROOT), CARGO_PKG_NAME=CRATE,
               CARGO_CRATE_NAME=CRATE, CARGO_PKG_VERSION=found["version"])
    if json_output:
        command += ["-Z", "unstable-options", "--output-format", "json"]
        env["RUSTC_BOOTSTRAP"] = "1"
    else:
        command += ["-D", "warnings"]
    if subprocess.run(command, cwd=ROOT, env=env).returncode != 0:
        sys.exit("rustdoc failed (its warnings are denied)")
    return out


def default_features() -> list[str]:
    """The features `default` turns on, followed through the features they turn on."""
    table = package()[0]["features"]
    on, todo = set(), ["default"]
    while todo:
        feature = todo.pop()
        for entry in table.get(feature, []):
            if entry in table and entry not in on:
                on.add(entry)
                todo.append(entry)
    return sorted(on)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="rustdoc's JSON, no default features")
    args = parser.parse_args()
    if args.json:
        print(rustdoc([], json_output=True) / f"{CRATE}.json")
    else:
        out = rustdoc(default_features(), json_output=False)
        print(f"documented without warnings: {out / CRATE / 'index.html'}")


if __name__ == "__main__":
    main()
