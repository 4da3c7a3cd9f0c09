"""Compares two versions of the Ray Serve example (examples/serve/ of two checkouts) side by
side, in turns, on this machine:

    python tools/serve_compare.py e2e OLD/examples/serve NEW/examples/serve --pairs 6
    python tools/serve_compare.py replica OLD/examples/serve NEW/examples/serve --rounds 9

`e2e` runs each folder's `load.py` (Ray, Serve, 2 replicas of 1 core, 1500 requests from 32
clients) in alternation and reads the machine's busy CPU time (/proc/stat) around the measured
burst: throughput and CPU milliseconds per request, whatever else the version changed.

`replica` drives each version's `Encoder` in this process without Ray (Serve's replica context
stood in for, so that `@serve.batch` runs): 1500 uploads, 32 at a time, through `__call__`,
timing the process's CPU time per request; the tiny model's engine runs for real. It isolates
what a version's request handling costs on a replica from the noise of proxies and clients
sharing the cores.

Both print one JSON line per run and the median of the per-pair ratios (new / old). Make the
old folder with `git worktree add /tmp/old <commit>`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def busy_seconds() -> float:
    """The machine's CPU time spent busy so far (user, nice, system, irq, softirq)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields[i] for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")


def e2e_run(folder: str) -> None:
    """In a child process: `folder`'s load.py with the busy CPU time around its measured burst."""
    sys.path.insert(0, folder)
    import load

    measured = load.burst
    seconds = []

    def burst(*args, **kwargs):
        before = busy_seconds()
        figures = measured(*args, **kwargs)
        seconds.append(busy_seconds() - before)
        return figures

    load.burst = burst
    sys.argv = ["load.py", "--replicas", "2", "--requests", "1500", "--concurrency", "32"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        load.main()
    figures = json.loads(printed.getvalue().strip().splitlines()[-1])
    cpu_ms = 1e3 * seconds[-1] / figures["requests"]
    print(json.dumps({"requests_per_s": figures["requests_per_s"], "cpu_ms_per_request": cpu_ms}))


def load_app(folder: str, name: str):
    spec = importlib.util.spec_from_file_location(name, Path(folder) / "app.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


async def replica_ms(encoder, bodies: list[bytes], count: int, concurrency: int = 32) -> float:
    """CPU milliseconds per request through `encoder.__call__`."""
    from starlette.requests import Request

    def request(body: bytes) -> Request:
        given = False

        async def receive() -> dict:
            nonlocal given
            if given:
                await asyncio.Event().wait()  # no disconnect: the request stays open
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        headers = [(b"content-type", b"image/png"), (b"content-length", b"%d" % len(body))]
        return Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)

    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with slots:
            response = await encoder(request(bodies[i % len(bodies)]))
            assert response.status_code == 200, response.body

    started = time.process_time()
    await asyncio.gather(*(one(i) for i in range(count)))
    return 1e3 * (time.process_time() - started) / count


def replica(old: str, new: str, rounds: int) -> None:
    from ray import serve

    # What `@serve.batch` asks of the replica it runs in.
    context = SimpleNamespace(_deployment_config=SimpleNamespace(max_ongoing_requests=64))
    serve.get_replica_context = lambda: context
    model = ROOT / "assets" / "tiny-qwen2-vl"
    adapters = {p.name: str(p) for p in sorted((model / "adapters").iterdir())}
    bodies = [p.read_bytes() for p in sorted((model / "images").iterdir())]
    versions = {
        label: load_app(folder, f"app_{label}").Encoder.func_or_class(
            adapters=adapters, model_dir=str(model)
        )
        for label, folder in (("old", old), ("new", new))
    }

    async def turns() -> None:
        for encoder in versions.values():
            await replica_ms(encoder, bodies, 200)  # warm-up
        ratios = []
        for _ in range(rounds):
            ms = {label: await replica_ms(e, bodies, 1500) for label, e in versions.items()}
            print(json.dumps({"cpu_ms_per_request": ms}))
            ratios.append(ms["new"] / ms["old"])
        print(json.dumps({"median_ratio": statistics.median(ratios)}))

    asyncio.run(turns())


def e2e(old: str, new: str, pairs: int) -> None:
    ratios = {"requests_per_s": [], "cpu_ms_per_request": []}
    for _ in range(pairs):
        runs = {}
        for label, folder in (("old", old), ("new", new)):
            child = [sys.executable, __file__, "e2e-run", folder]
            printed = subprocess.run(child, capture_output=True, text=True, check=True).stdout
            runs[label] = json.loads(printed.strip().splitlines()[-1])
            print(json.dumps({label: runs[label]}))
        for key, values in ratios.items():
            values.append(runs["new"][key] / runs["old"][key])
    print(json.dumps({f"median_ratio_{key}": statistics.median(v) for key, v in ratios.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["e2e", "replica", "e2e-run"])
    parser.add_argument("old")
    parser.add_argument("new", nargs="?")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if args.mode == "e2e-run":
        e2e_run(args.old)
    elif args.mode == "e2e":
        e2e(args.old, args.new, args.pairs)
    else:
        replica(args.old, args.new, args.rounds)


if __name__ == "__main__":
    main()
