#!/usr/bin/env python3
"""Builds the web page into web/dist/: the wasm module (web/src, release, wasm32-unknown-unknown)
through the pinned wasm-bindgen CLI, the page (web/page/), and the bundled tiny models
(assets/tiny-*/, served beside the page and listed in models/index.json).

    python3 web/build.py
    python3 -m http.server 8000 --bind 127.0.0.1 --directory web/dist   # then open http://127.0.0.1:8000

Needs the wasm32-unknown-unknown target (`rustup target add wasm32-unknown-unknown`) and the
wasm-bindgen CLI of the version web/Cargo.toml pins (`cargo install wasm-bindgen-cli --version
<that version>`). CARGO_TARGET_DIR is honoured.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

WEB = Path(__file__).resolve().parent
ROOT = WEB.parent
TARGET = "wasm32-unknown-unknown"
# What no page reads: the tests' expected outputs.
LEFT_OUT = {"expected.safetensors"}


def pinned_wasm_bindgen() -> str:
    """The exact wasm-bindgen version web/Cargo.toml pins (`=x.y.z`)."""
    text = (WEB / "Cargo.toml").read_text()
    found = re.search(r'^wasm-bindgen = "=([0-9.]+)"', text, re.MULTILINE)
    if not found:
        sys.exit("web/Cargo.toml does not pin wasm-bindgen as `=x.y.z`")
    return found.group(1)


def check_cli(version: str) -> None:
    try:
        printed = subprocess.run(
            ["wasm-bindgen", "--version"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(
            f"the wasm-bindgen CLI is not installed ({e}): "
            f"cargo install wasm-bindgen-cli --version {version}"
        )
    if printed.split()[-1] != version:
        sys.exit(
            f"wasm-bindgen CLI {printed.strip()} does not match the crate's {version}: "
            f"cargo install wasm-bindgen-cli --version {version} --force"
        )


def copy_models(out: Path) -> None:
    """Each assets/tiny-*/ folder as models/<name>/, and models/index.json listing its files."""
    index = {}
    for folder in sorted((ROOT / "assets").glob("tiny-*")):
        files = sorted(
            p.relative_to(folder).as_posix()
            for p in folder.rglob("*")
            if p.is_file() and p.name not in LEFT_OUT
        )
        for name in files:
            target = out / "models" / folder.name / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / name, target)
        index[folder.name] = files
    (out / "models" / "index.json").write_text(json.dumps(index, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=WEB / "dist", help="where the page goes")
    args = parser.parse_args()

    version = pinned_wasm_bindgen()
    check_cli(version)
    subprocess.run(
        ["cargo", "build", "--release", "-p", "mmlora-web", "--target", TARGET],
        cwd=ROOT,
        check=True,
    )
    target_dir = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    wasm = target_dir / TARGET / "release" / "mmlora_web.wasm"

    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(WEB / "page", out)
    subprocess.run(
        ["wasm-bindgen", "--target", "web", "--no-typescript", "--out-dir", out / "pkg", wasm],
        check=True,
    )
    copy_models(out)
    size = (out / "pkg" / "mmlora_web_bg.wasm").stat().st_size
    print(f"built {out} (wasm module {size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
