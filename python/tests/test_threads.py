"""One engine, many Python threads: mixed batches from 8 threads at once give each request the
result it gives alone, and the threads run while the engine works."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import mmlora
from conftest import errors, model_dir

IMAGES = ["square.png", "wide.jpg", "lossless.webp", "rgba.png", "gray.png"]
ADAPTERS = [None, "all-r4", "rslora-r8", "tower-r2", "patterns"]


def image(name: str):
    return model_dir("qwen2-vl") / "images" / name


def alone(engine: mmlora.Engine) -> dict:
    """Each (image, adapter) pair encoded by itself."""
    return {
        (name, adapter): engine.encode([{"id": "alone", "image": image(name), "adapter": adapter}])[
            0
        ].embeds
        for name in IMAGES
        for adapter in ADAPTERS
    }


def test_eight_threads_of_mixed_batches_each_get_their_alone_results(cpu_engine):
    expected = alone(cpu_engine)
    threads, rounds = 8, 3

    def work(thread: int) -> list[tuple[tuple, np.ndarray]]:
        seen = []
        for round in range(rounds):
            # Each thread's batches mix every adapter, in an order of its own.
            pairs = [
                (IMAGES[(thread + i) % len(IMAGES)], ADAPTERS[(thread * 3 + round + i) % 5])
                for i in range(5)
            ]
            results = cpu_engine.encode(
                [{"id": f"t{thread}r{round}i{i}", "image": image(n), "adapter": a}
                 for i, (n, a) in enumerate(pairs)]
            )
            seen += [(pair, result.embeds) for pair, result in zip(pairs, results)]
        return seen

    with ThreadPoolExecutor(threads) as pool:
        outcomes = list(pool.map(work, range(threads)))
    assert sum(map(len, outcomes)) == threads * rounds * 5
    for seen in outcomes:
        for pair, embeds in seen:
            rel, _ = errors(embeds, expected[pair])
            # 1e-6 relative: the same rows through the same kernels; only the other rows of the
            # step's matmuls differ (as the Rust engine's test of the same property).
            assert rel <= 1e-6, f"{pair}: rel {rel:e}"


def test_python_threads_run_while_the_engine_works(cpu_engine):
    requests = [
        {"id": f"r{i}", "image": image(IMAGES[i % 5]), "adapter": ADAPTERS[i % 5]}
        for i in range(60)
    ]
    window = {}

    def encode():
        # The native call alone, without the wrapper's Python-side request checks.
        native = [(r["id"], str(r["image"]), r["adapter"]) for r in requests]
        window["start"] = time.perf_counter()
        cpu_engine._native.encode(native, False)
        window["end"] = time.perf_counter()

    worker = threading.Thread(target=encode)
    ticks = []
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    inside = [t for t in ticks if window["start"] <= t <= window["end"]]
    duration = window["end"] - window["start"]
    # Holding the GIL, the call would stop this loop for all of its duration; letting go, the
    # loop ticks through it (gaps of a scheduler slice on a busy machine).
    gaps = np.diff([window["start"], *inside, window["end"]])
    assert gaps.max() < duration / 2, f"longest pause {gaps.max():.3f} s of a {duration:.3f} s call"


def test_encode_async_awaits_the_same_results(cpu_engine):
    requests = [{"id": "a", "image": image("square.png"), "adapter": "patterns"}]

    async def both():
        return await asyncio.gather(
            cpu_engine.encode_async(requests), cpu_engine.encode_async(requests, with_tower=True)
        )

    plain, with_tower = asyncio.run(both())
    [direct] = cpu_engine.encode(requests)
    np.testing.assert_array_equal(plain[0].embeds, direct.embeds)
    assert plain[0].tower is None and with_tower[0].tower is not None
