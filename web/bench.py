#!/usr/bin/env python3
"""The engine in headless Chromium on SwiftShader (the built page, web/dist/) against the native
engine on this machine's wgpu adapter (lavapipe here), one after the other in one run:

- the bundled Qwen2-VL example batch (7 requests, 4 adapters and none, one step), the engine
  call timed in the page (`Session.timeRows`) and natively through the Python package;
- a released tower's shape with random weights (`--preset`, Qwen2-VL-2B's by default) on
  `--images` random images of `--side` pixels, timed in the page (`Session.timeRandom`) and by
  `mmlora bench` (its base configuration with the kernels the browser runs).

Each side makes one call first (shaders compile there), then `--repeats` timed calls, each
ending with the outputs read back; the medians and their ratio are printed, as JSON with
--json.

    python3 web/build.py && cargo build --release
    python3 web/bench.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WEB = Path(__file__).resolve().parent
ROOT = WEB.parent
sys.path.insert(0, str(WEB))
from browser import SITE, chromium, serve  # noqa: E402

import mmlora  # noqa: E402

BUNDLED = ROOT / "assets" / "tiny-qwen2-vl"


def browser_times(args) -> dict[str, list[float]]:
    with serve(SITE) as url, chromium(script_timeout_s=3600) as driver:
        driver.get(f"{url}?model=tiny-qwen2-vl")
        driver.execute_async_script(
            """const done = arguments[0];
            const wait = () => document.body.dataset.state === 'ready' ? done() : setTimeout(wait, 100);
            wait();"""
        )
        errors = driver.execute_script("return window.mmlora.errors")
        if errors:
            sys.exit(f"the page failed: {errors}")
        device = driver.execute_script("return window.mmlora.gpu.name")
        batch = driver.execute_async_script(
            """const [repeats, done] = arguments;
            const rows = window.mmlora.exampleBatch;
            window.mmlora.session.timeRows(JSON.stringify(rows), repeats).then(done, (e) => done(String(e)));""",
            args.repeats,
        )
        preset = driver.execute_async_script(
            """const [preset, images, side, repeats, done] = arguments;
            import('./pkg/mmlora_web.js').then(async ({ Session }) => {
              const session = Session.openPreset(window.mmlora.gpu, preset);
              try { done(await session.timeRandom(images, side, repeats)); }
              finally { session.free(); }
            }).catch((e) => done(String(e)));""",
            args.preset,
            args.images,
            args.side,
            args.repeats,
        )
    for times in (batch, preset):
        if isinstance(times, str):
            sys.exit(f"the page failed: {times}")
    return {"device": device, "batch": batch, "preset": preset}


def native_times(args) -> dict[str, list[float]]:
    spec = json.loads((BUNDLED / "batch.json").read_text())
    engine = mmlora.Engine(BUNDLED, device="gpu")
    for name, path in spec["adapters"].items():
        engine.load_adapter(name, BUNDLED / path)
    requests = [
        mmlora._native_request(i, {"id": r["id"], "image": BUNDLED / r["image"], "adapter": r["adapter"]})
        for i, r in enumerate(spec["requests"])
    ]
    # The Rust engine's own timing of its encode call (the package's measurement hook).
    batch = engine._native._time_encode(requests, False, args.repeats + 1)[1:]
    out = subprocess.run(
        [args.mmlora, "bench", "--device", "gpu", "--preset", args.preset, "--images",
         str(args.images), "--side", str(args.side), "--adapters", "1", "--no-op",
         "--repeats", str(args.repeats), "--json"],
        capture_output=True, text=True, check=True,
    ).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    # The base model with the kernels a software GPU runs by default, as the browser does.
    base = next(
        r for r in records
        if r["adapters"] == 0 and r["linear_kernel"] == "wgsl" and r["attention_kernel"] == "burn"
    )
    return {
        "device": engine.device_info["description"],
        "batch": batch,
        "preset": [ms / 1e3 for ms in base["round_ms"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--preset", default="qwen2-vl-2b")
    parser.add_argument("--images", type=int, default=1)
    parser.add_argument("--side", type=int, default=112)
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    parser.add_argument("--mmlora", default=str(target / "release" / "mmlora"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    browser = browser_times(args)
    native = native_times(args)
    result = {
        "repeats": args.repeats,
        "browser_device": browser["device"],
        "native_device": str(native["device"]),
    }
    for what, label in (
        ("batch", "bundled batch (7 requests)"),
        ("preset", f"{args.preset}, {args.images} × {args.side}²"),
    ):
        b, n = statistics.median(browser[what]), statistics.median(native[what])
        result[what] = {
            "label": label, "browser_ms": b * 1e3, "native_ms": n * 1e3, "ratio": b / n,
            "browser_runs_ms": [t * 1e3 for t in browser[what]],
            "native_runs_ms": [t * 1e3 for t in native[what]],
        }
    if args.json:
        print(json.dumps(result))
        return
    print(f"browser: {result['browser_device']}\nnative:  {result['native_device']}")
    for what in ("batch", "preset"):
        r = result[what]
        print(f"{r['label']}: browser {r['browser_ms']:.1f} ms, native {r['native_ms']:.1f} ms "
              f"(medians of {args.repeats}), browser / native {r['ratio']:.2f}×")


if __name__ == "__main__":
    main()
