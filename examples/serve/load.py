"""A burst of concurrent HTTP requests against the deployment in app.py, on a local Ray instance
bound to 127.0.0.1: throughput, latency, and how many requests shared an engine step.

    python load.py --replicas 2 --requests 300 --concurrency 32

starts Ray and Serve, deploys app.py on the bundled model, sends the fixture images of the
bundled model with its four adapters and none, checks every reply against one engine in this
process, prints one JSON line of figures, and shuts everything down. The Python package's tests
run the same burst (python/tests/test_serve.py).
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import os
import signal
import socket
import statistics
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
#: The Serve application's name.
APP = "mmlora"


@dataclass(frozen=True)
class Job:
    """One HTTP request: an image file (uploaded, or sent as a file:// URL) and an adapter."""

    image: Path
    adapter: str | None
    upload: bool


def jobs(images: list[Path], adapters: list[str | None], count: int) -> list[Job]:
    """`count` requests cycling through every image × adapter × (upload or URL)."""
    kinds = itertools.product(images, adapters, (True, False))
    return [
        Job(image, adapter, upload)
        for (image, adapter, upload), _ in zip(itertools.cycle(kinds), range(count))
    ]


@dataclass(frozen=True)
class Reply:
    """One HTTP reply: its status, its JSON body (a non-JSON body as ``{"error": text}``), its
    `Retry-After` header, and the request's latency in seconds."""

    status: int
    body: dict
    seconds: float
    retry_after: str | None = None


def send(url: str, job: Job, timeout: float, token: str | None = None) -> Reply:
    if job.upload:
        return post(
            url, job.image.read_bytes(), "application/octet-stream", job.adapter, timeout, token
        )
    return send_url(url, job.image.as_uri(), job.adapter, timeout, token)


def send_url(
    url: str,
    file_url: str,
    adapter: str | None = None,
    timeout: float = 60.0,
    token: str | None = None,
) -> Reply:
    """:func:`send` for a `file://` URL spelled as given (`..`, percent-encoding and all)."""
    return post(
        url, json.dumps({"url": file_url}).encode(), "application/json", adapter, timeout, token
    )


def post(
    url: str,
    body: bytes,
    kind: str,
    adapter: str | None,
    timeout: float,
    token: str | None = None,
) -> Reply:
    headers = {"content-type": kind}
    if adapter is not None:
        headers["serve_multiplexed_model_id"] = adapter
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    started = time.perf_counter()
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, text, retry_after = response.status, response.read(), None
    except urllib.error.HTTPError as error:
        status, text, retry_after = error.code, error.read(), error.headers.get("retry-after")
    seconds = time.perf_counter() - started
    try:
        reply = json.loads(text)
    except ValueError:
        reply = {"error": text.decode(errors="replace")}
    return Reply(status, reply, seconds, retry_after)


def embeds(reply: dict) -> np.ndarray:
    values = np.frombuffer(base64.b64decode(reply["embeds"]), dtype="<f4")
    return values.reshape(reply["shape"])


def send_all(url: str, work: list[Job], concurrency: int, timeout: float) -> list[Reply]:
    """Sends `work` from `concurrency` threads at once; the replies in order."""
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda job: send(url, job, timeout), work))


def burst(url: str, work: list[Job], concurrency: int, timeout: float = 120.0) -> dict:
    """Sends `work` from `concurrency` threads at once, all to be served; the replies in order,
    and figures."""
    started = time.perf_counter()
    outcomes = send_all(url, work, concurrency, timeout)
    seconds = time.perf_counter() - started
    for job, outcome in zip(work, outcomes):
        if outcome.status != 200:
            raise RuntimeError(f"{job}: HTTP {outcome.status}: {outcome.body}")
    replies = [outcome.body for outcome in outcomes]
    latencies = sorted(outcome.seconds for outcome in outcomes)
    return {
        "replies": replies,
        "requests": len(work),
        "seconds": seconds,
        "requests_per_s": len(work) / seconds,
        "p50_ms": 1e3 * statistics.median(latencies),
        "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        # Each request's step size, averaged over requests: what a request shared its step with.
        "mean_step_requests": statistics.fmean(r["step_requests"] for r in replies),
        "max_step_requests": max(r["step_requests"] for r in replies),
        "max_step_adapters": max(r["step_adapters"] for r in replies),
        "replicas": len({r["replica"] for r in replies}),
    }


def burst_killing_a_replica(
    url: str, work: list[Job], concurrency: int, kill_after: int, timeout: float = 120.0
) -> tuple[list[Reply], int]:
    """Sends `work` from `concurrency` threads at once and, once `kill_after` requests have been
    served, kills (SIGKILL) the replica that served the last of them; the replies in order,
    and the killed replica's process id. Ray must be running on this machine."""
    killed = None
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(send, url, job, timeout) for job in work]
        served = 0
        for future in as_completed(futures):
            outcome = future.result()
            served += outcome.status == 200
            if killed is None and served >= kill_after:
                killed = outcome.body["replica"]
                os.kill(killed, signal.SIGKILL)
        if killed is None:
            raise RuntimeError(f"fewer than {kill_after} requests were served")
        return [future.result() for future in futures], killed


def wait_for_new_replica(url: str, job: Job, known: set[int], timeout: float = 120.0) -> float:
    """Sends `job` again and again until a replica not in `known` (process ids) serves it; the
    seconds that took. Errors while the deployment recovers are part of the wait."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        outcome = send(url, job, timeout)
        if outcome.status == 200 and outcome.body["replica"] not in known:
            return time.perf_counter() - started
        time.sleep(0.1)
    raise TimeoutError(f"no replica beyond {sorted(known)} served within {timeout} s")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(replicas: int, cpus_per_replica: int, port: int, **options) -> str:
    """Ray and Serve (:func:`start_serve`) and app.py deployed; the URL to post to."""
    url = start_serve(port, replicas * cpus_per_replica)
    deploy(replicas, cpus_per_replica, **options)
    return url


def start_serve(port: int, cpus: int = 1) -> str:
    """Ray on this machine only (127.0.0.1, no dashboard) with at least `cpus` cores, and
    Serve's HTTP proxy on `port` with app.py's `ProxyGuard`; the URL app.py will answer at
    once deployed."""
    import ray
    from ray import serve

    # Ray's workers import app.py by name, as this process does; the proxies apply its
    # ProxyGuard.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(HERE), os.environ.get("PYTHONPATH")])
    )
    os.environ["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] = "app:proxy_middlewares"
    sys.path.insert(0, str(HERE))

    ray.init(
        num_cpus=max(os.cpu_count() or 1, cpus),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=256 << 20,
        configure_logging=False,
        log_to_driver=False,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}/encode"


def deploy(replicas: int, cpus_per_replica: int, **options) -> None:
    """app.py's application, at the URL :func:`start_serve` returns."""
    from ray import serve

    import app

    serve.run(
        app.deployment(replicas, cpus_per_replica, **options), name=APP, route_prefix="/encode"
    )


def redeploy(replicas: int = 1, cpus_per_replica: int = 1, **options) -> None:
    """The application deleted, where there is one, and deployed again with `options`, at the
    same URL (deleted first: the new replicas need the cores the old ones hold)."""
    from ray import serve

    serve.delete(APP)
    deploy(replicas, cpus_per_replica, **options)


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def expected(work: list[Job], model_dir: Path, folders: dict[str, Path]) -> list[np.ndarray]:
    """Each job's embeddings from one engine in this process, request by request."""
    import mmlora

    engine = mmlora.Engine(model_dir, device="cpu")
    for name, folder in folders.items():
        engine.load_adapter(name, folder)
    cache: dict[tuple[Path, str | None], np.ndarray] = {}
    for job in work:
        key = (job.image, job.adapter)
        if key not in cache:
            [result] = engine.encode([{"id": "alone", "image": job.image, "adapter": job.adapter}])
            cache[key] = result.embeds
    return [cache[(job.image, job.adapter)] for job in work]


def worst_error(replies: list[dict], want: list[np.ndarray]) -> float:
    """The largest relative Frobenius error of a reply against its single-engine result."""
    worst = 0.0
    for reply, values in zip(replies, want):
        got = embeds(reply).astype(np.float64)
        worst = max(worst, float(np.linalg.norm(got - values) / np.linalg.norm(values)))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--cpus-per-replica", type=int, default=1)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=32)
    args = parser.parse_args()

    model = HERE.parents[1] / "assets" / "tiny-qwen2-vl"
    folders = {p.name: p for p in sorted((model / "adapters").iterdir())}
    images = sorted((model / "images").iterdir())
    work = jobs(images, [None, *folders], args.requests)
    url = start(
        args.replicas,
        args.cpus_per_replica,
        free_port(),
        adapters={name: str(folder) for name, folder in folders.items()},
        model_dir=str(model),
        max_batch_size=args.max_batch_size,
        # Half the requests name their image by a file:// URL: the images' folder is allowed.
        allowed_media_root=str(model / "images"),
    )
    try:
        burst(url, work[: 2 * args.concurrency], args.concurrency)  # warm-up: adapters loaded
        figures = burst(url, work, args.concurrency)
    finally:
        stop()
    replies = figures.pop("replies")
    figures["worst_rel_error"] = worst_error(replies, expected(work, model, folders))
    figures.update(vars(args))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
