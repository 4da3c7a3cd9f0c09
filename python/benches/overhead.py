"""The Python API's overhead against the Rust engine on the same batch, CPU backend.

    python python/benches/overhead.py [--copies 8] [--inputs path|bytes|array|pil] [--rounds 30]

One engine on the bundled model with its adapters; the bundled batch (7 requests, 4 adapters
and none; `--copies` times over). Each round times `engine.encode(requests)` (the Python API:
the requests' dicts checked and converted, the call, the results wrapped) and the same requests
through the Rust engine's `encode` timed in Rust, in alternating order; prints one JSON line
with the medians and the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import PIL.Image

import mmlora


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=1)
    parser.add_argument("--inputs", choices=["path", "bytes", "array", "pil"], default="path")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()

    engine = mmlora.Engine(device="cpu")
    folder = engine.bundled_dir
    batch = json.loads((folder / "batch.json").read_text())
    for name, path in batch["adapters"].items():
        engine.load_adapter(name, folder / path)

    def image(path):
        if args.inputs == "bytes":
            return path.read_bytes()
        if args.inputs in ("array", "pil"):
            opened = PIL.Image.open(path)
            return np.asarray(opened.convert("RGB")) if args.inputs == "array" else opened
        return path

    requests = [
        {"id": f"{r['id']}#{copy}", "image": image(folder / r["image"]), "adapter": r["adapter"]}
        for copy in range(args.copies)
        for r in batch["requests"]
    ]
    native = [mmlora._native_request(i, r) for i, r in enumerate(requests)]

    def python_api() -> float:
        started = time.perf_counter()
        engine.encode(requests)
        return time.perf_counter() - started

    def rust_engine() -> float:
        return engine._native._time_encode(native, False, 1)[0]

    python_api(), rust_engine()  # warm-up
    python_s, rust_s, ratios = [], [], []
    for turn in range(args.rounds):
        if turn % 2:
            rust, python = rust_engine(), python_api()
        else:
            python, rust = python_api(), rust_engine()
        python_s.append(python)
        rust_s.append(rust)
        ratios.append(python / rust)
    python_ms, rust_ms = 1e3 * statistics.median(python_s), 1e3 * statistics.median(rust_s)
    print(
        json.dumps(
            {
                "requests": len(requests),
                "inputs": args.inputs,
                "rounds": args.rounds,
                "python_api_ms": round(python_ms, 3),
                "rust_engine_ms": round(rust_ms, 3),
                "ratio": round(statistics.median(ratios), 4),
                "overhead_us_per_request": round(1e3 * (python_ms - rust_ms) / len(requests), 1),
                "device": engine.device_info["description"],
            }
        )
    )


if __name__ == "__main__":
    main()
