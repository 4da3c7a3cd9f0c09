"""The Ray Serve deployment (examples/serve/) on a local Ray instance bound to 127.0.0.1: two
replicas, a burst of concurrent HTTP requests over four adapters and none, every reply equal
to one engine's result for its image and adapter, and steps that really mixed adapters; local
files served only inside the allowed folder, and none by default; oversized bodies refused
without being read, a token when one is set, deadlines, backpressure, and a replica killed in
the middle of a burst."""

from __future__ import annotations

import asyncio
import faulthandler
import http.client
import json
import os
import select
import shutil
import socket
import sys
import time
import urllib.parse
from collections import Counter
from pathlib import Path

import pytest

from conftest import declared_png, model_dir

SERVE = Path(__file__).resolve().parents[2] / "examples" / "serve"
sys.path.insert(0, str(SERVE))

try:
    import ray  # noqa: F401

    import app
    import load
except ImportError as missing:
    if os.environ.get("CI") == "true":
        raise
    pytest.skip(f"Ray Serve is not installed: {missing}", allow_module_level=True)

#: The whole module, Ray's start and stop included, ends within this or the process is stopped.
TIME_BOUND_S = 900

MODEL = model_dir("qwen2-vl")
FOLDERS = {p.name: p for p in sorted((MODEL / "adapters").iterdir())}
ADAPTERS = {name: str(folder) for name, folder in FOLDERS.items()}
IMAGES = sorted((MODEL / "images").iterdir())
#: 1e-6 relative: the same rows through the same kernels, only the other rows of each step's
#: matmuls differ (the bound the engine's own alone-versus-batch test holds).
SAME = 1e-6


@pytest.fixture(scope="module")
def url():
    """Ray and Serve, started once for the module; each test deploys the application it needs."""
    faulthandler.dump_traceback_later(TIME_BOUND_S, exit=True)
    try:
        yield load.start_serve(load.free_port(), cpus=2)
    finally:
        load.stop()
        faulthandler.cancel_dump_traceback_later()


def uploads(count: int, adapters: list[str | None]) -> list[load.Job]:
    return load.jobs(IMAGES, adapters, 2 * count)[::2]


def test_two_replicas_serve_a_burst_of_mixed_adapters_and_refuse_bad_requests(url, tmp_path):
    assert len(FOLDERS) >= 4
    # The allowed folder: the fixture's images and a file that is no image. Beside it, a real
    # image the deployment must not serve, and a link to it from inside.
    media = tmp_path / "media"
    media.mkdir()
    for image in IMAGES:
        shutil.copy(image, media / image.name)
    images = sorted(media.iterdir())
    secret = tmp_path / "secret.png"
    shutil.copy(images[0], secret)
    (media / "link.png").symlink_to(secret)
    not_an_image = media / "not-an-image.png"
    not_an_image.write_bytes(b"not an image")
    work = load.jobs(images, [None, *FOLDERS], 300)
    bad = [
        (load.Job(images[0], "nope", upload=True), 404, "nope"),
        (load.Job(not_an_image, "all-r4", upload=True), 400, "cannot decode"),
        (load.Job(not_an_image, None, upload=False), 400, "not-an-image.png"),
    ]
    # Every way out of the folder, and a file that does not exist in it or beside it: one reply.
    outside = [
        f"file://{media}/../secret.png",
        f"file://{media}/%2e%2e/secret.png",
        f"file://{media}/%2E%2E%2Fsecret.png",
        (media / "link.png").as_uri(),
        secret.as_uri(),
        (MODEL / "config.json").as_uri(),
        (media / "missing.png").as_uri(),
        (tmp_path / "missing.png").as_uri(),
        "file:///etc/passwd",
    ]
    load.redeploy(2, 1, adapters=ADAPTERS, model_dir=str(MODEL), allowed_media_root=str(media))
    figures = load.burst(url, work, concurrency=32, timeout=120)
    # Bad requests among good ones: each bad one gets its error, the good ones their results,
    # whether or not they shared a step.
    mixed = [job for job, _, _ in bad] + work[:28]
    outcomes = load.send_all(url, mixed, concurrency=32, timeout=120)
    refused = [load.send_url(url, file_url) for file_url in outside]

    replies = figures["replies"]
    assert [r["adapter"] for r in replies] == [job.adapter for job in work]
    want = load.expected(work, MODEL, FOLDERS)
    worst = load.worst_error(replies, want)
    assert worst <= SAME, f"a reply is {worst:e} from its single-engine result"
    print({k: v for k, v in figures.items() if k != "replies"})
    assert figures["replicas"] == 2, "both replicas served"
    assert figures["max_step_requests"] > 1, "requests shared engine steps"
    assert figures["max_step_adapters"] > 1, "a step mixed adapters"

    for (job, status, names), outcome in zip(bad, outcomes):
        assert outcome.status == status and names in outcome.body["error"], (job, outcome)
    good = outcomes[len(bad) :]
    assert all(outcome.status == 200 for outcome in good)
    assert load.worst_error([outcome.body for outcome in good], want[:28]) <= SAME

    for file_url, outcome in zip(outside, refused):
        assert (outcome.status, outcome.body) == (403, {"error": app.OUTSIDE_MEDIA_ROOT}), file_url


def replica_peak_bytes(pid: int) -> int:
    """The most resident memory the process has held (Linux's VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def upload_zeros(url: str, size: int, say_length: bool) -> load.Reply:
    """Posts `size` zero bytes, with their length in the request or in chunks without it, and
    stops sending once a reply comes (as curl does): a server refusing the body early closes
    the connection, and a client that kept writing would meet a reset instead of the reply."""
    host, port = urllib.parse.urlsplit(url).netloc.split(":")
    path = urllib.parse.urlsplit(url).path
    framing = f"Content-Length: {size}" if say_length else "Transfer-Encoding: chunked"
    chunk = bytes(1 << 20)
    started = time.perf_counter()
    with socket.create_connection((host, int(port))) as connection:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: image/png\r\n{framing}\r\n\r\n"
        )
        connection.sendall(head.encode())
        for _ in range(size // len(chunk)):
            if select.select([connection], [], [], 0)[0]:
                break  # the reply came
            connection.sendall(chunk if say_length else b"%x\r\n%s\r\n" % (len(chunk), chunk))
        else:
            if not say_length:
                connection.sendall(b"0\r\n\r\n")
        response = http.client.HTTPResponse(connection)
        response.begin()
        return load.Reply(
            response.status, json.loads(response.read()), time.perf_counter() - started
        )


def test_the_defaults_refuse_local_files_and_bodies_over_the_limit_without_reading_them(url):
    load.redeploy(adapters=ADAPTERS, model_dir=str(MODEL))
    upload = load.Job(IMAGES[0], "all-r4", upload=True)
    served = load.send(url, upload, timeout=60)
    assert served.status == 200
    assert load.worst_error([served.body], load.expected([upload], MODEL, FOLDERS)) <= SAME
    no_files = load.send_url(url, IMAGES[0].as_uri())
    assert (no_files.status, no_files.body) == (403, {"error": app.NO_LOCAL_FILES})
    assert "allowed_media_root" in app.NO_LOCAL_FILES

    # 256 MiB against the default limit of 32 MiB, its length said and unsaid: refused by the
    # proxy, and the replica's peak memory grows by nothing like the body.
    size = 256 << 20
    replica = served.body["replica"]
    before = replica_peak_bytes(replica)
    refused = [upload_zeros(url, size, say_length=True), upload_zeros(url, size, say_length=False)]
    growth = replica_peak_bytes(replica) - before
    print(f"replica peak memory grew by {growth >> 10} KiB over two {size >> 20} MiB bodies")
    for outcome in refused:
        assert (outcome.status, outcome.body) == (
            413,
            {"error": app.too_large(32 << 20, app.PROXY_LIMIT_VARIABLE)},
        )
    assert growth < size // 64
    # An image under the byte limit but above the decoder's pixel limit: 413, the limit named.
    huge = load.post(url, declared_png(9000, 8000), "image/png", None, timeout=60)
    assert huge.status == 413 and "above the limit of 67108864 pixels" in huge.body["error"], huge

    # A deployment's own limit, below the proxy's: the replica refuses a body the proxy passed.
    load.redeploy(adapters=ADAPTERS, model_dir=str(MODEL), max_body_bytes=1 << 20)
    for say_length in (True, False):
        outcome = upload_zeros(url, 8 << 20, say_length)
        assert (outcome.status, outcome.body) == (
            413,
            {"error": app.too_large(1 << 20, "max_body_bytes")},
        )

    # The same measure sees a body that is read whole: with limits above it, the replica's
    # peak grows by at least the body (the image then fails to decode).
    size = 24 << 20
    load.redeploy(adapters=ADAPTERS, model_dir=str(MODEL), max_body_bytes=2 * size)
    replica = load.send(url, upload, timeout=60).body["replica"]
    before = replica_peak_bytes(replica)
    read = upload_zeros(url, size, say_length=False)
    growth = replica_peak_bytes(replica) - before
    print(f"replica peak memory grew by {growth >> 10} KiB over one {size >> 20} MiB body read")
    assert read.status == 400, read
    assert growth >= size


def test_the_proxy_guard_refuses_bodies_over_its_limit_and_answers_a_failed_replica_in_json():
    """`app.ProxyGuard` alone, around stand-ins for Serve's proxy: what it passes on, what it
    refuses before reading, and the replies to a failed replica replaced."""

    def call(guard_of, headers: list, chunks: list[bytes]) -> tuple[int, bytes, int]:
        """The status and body the guard answers, and how many chunks it read."""
        read, sent = 0, []

        async def receive() -> dict:
            nonlocal read
            read += 1
            if read > len(chunks):
                return {"type": "http.disconnect"}
            return {
                "type": "http.request",
                "body": chunks[read - 1],
                "more_body": read < len(chunks),
            }

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "path": "/encode", "headers": headers}
        asyncio.run(guard_of(scope, receive, send))
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return sent[0]["status"], body, read

    async def echo(scope, receive, send) -> None:
        """A replica answering with the length of the body it read."""
        body = b""
        while True:
            message = await receive()
            body += message["body"]
            if not message["more_body"]:
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"%d" % len(body)})

    async def died(scope, receive, send) -> None:
        """Serve's proxy when the replica died with the request: no reply at all."""

    async def raised(scope, receive, send) -> None:
        """Serve's proxy when the replica raised: a bare 500."""
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": b"Internal Server Error"})

    tries = []

    async def died_once(scope, receive, send) -> None:
        """A replica that died with the request's first try; the second reaches another."""
        tries.append(scope["path"])
        scope["path"] = "/rewritten by the proxy"
        if len(tries) > 1:
            await echo(scope, receive, send)

    limit = 10
    too_large = json.dumps({"error": app.too_large(limit, app.PROXY_LIMIT_VARIABLE)}).encode()
    guard = app.ProxyGuard(echo, limit)
    length = [(b"content-length", b"%d" % limit)]
    assert call(guard, length, [b"12345", b"67890"]) == (200, b"10", 2)
    assert call(guard, [], [b"12345", b"67890"]) == (200, b"10", 2)  # chunked, gathered
    # Over the limit: by the declared length before a chunk is read; chunked, at the limit.
    assert call(guard, [(b"content-length", b"11")], [b"x" * 11]) == (413, too_large, 0)
    assert call(guard, [(b"content-length", b"-1")], [b""]) == (413, too_large, 0)
    assert call(guard, [], [b"123456", b"789012", b"never read"]) == (413, too_large, 2)
    # A replica that died: tried once more, with the whole body and the scope as it came.
    retried = app.ProxyGuard(died_once, limit)
    assert call(retried, length, [b"12345", b"67890"]) == (200, b"10", 2)
    assert tries == ["/encode", "/encode"]
    failed = json.dumps({"error": app.REPLICA_FAILED}).encode()
    for replica in (died, raised):
        assert call(app.ProxyGuard(replica, limit), length, [b"x" * limit]) == (500, failed, 1)


def test_a_token_set_in_the_environment_is_required(url, monkeypatch):
    monkeypatch.setenv(app.TOKEN_VARIABLE, "s3cret-token")
    load.redeploy(adapters=ADAPTERS, model_dir=str(MODEL))
    job = load.Job(IMAGES[1], "patterns", upload=True)
    refused = [
        load.send(url, job, timeout=60),
        load.send(url, job, timeout=60, token="s3cret-tokeN"),
        load.send(url, job, timeout=60, token=""),
        load.send_url(url, IMAGES[1].as_uri(), token="wrong"),  # before the file check
    ]
    for outcome in refused:
        assert (outcome.status, outcome.body) == (401, {"error": app.UNAUTHORIZED}), outcome
    served = load.send(url, job, timeout=60, token="s3cret-token")
    assert served.status == 200
    assert load.worst_error([served.body], load.expected([job], MODEL, FOLDERS)) <= SAME


def test_a_request_past_its_deadline_gets_504_and_its_image_leaves_the_step(url):
    # A step waits up to 3 s for company; a request may take 2 s. The first request times out
    # waiting; the second, sent just after, joins the same gathering step (it is served within
    # its own 2 s, before a step of its own could start) and shares it with nobody.
    load.redeploy(
        adapters=ADAPTERS, model_dir=str(MODEL), batch_wait_timeout_s=3.0, request_timeout_s=2.0
    )
    load.send(url, load.Job(IMAGES[0], "all-r4", upload=True), timeout=60)  # adapter loaded
    time.sleep(3.5)  # that step is over
    late = load.send(url, load.Job(IMAGES[0], "all-r4", upload=True), timeout=60)
    joined = load.Job(IMAGES[1], "tower-r2", upload=True)
    served = load.send(url, joined, timeout=60)
    assert late.status == 504 and "request_timeout_s (2.0 s)" in late.body["error"], late
    assert 2.0 <= late.seconds < 2.5, late.seconds
    assert served.status == 200 and served.seconds < 2.0, served
    assert served.body["step_requests"] == 1, "the late request's image stayed out of the step"
    assert load.worst_error([served.body], load.expected([joined], MODEL, FOLDERS)) <= SAME


def test_a_burst_beyond_the_queue_gets_503_with_retry_after_and_nobody_waits_past_the_deadline(url):
    # One replica taking 4 requests at a time (steps of 2), 4 more queued: 96 at once overflow.
    load.redeploy(
        adapters=ADAPTERS,
        model_dir=str(MODEL),
        max_batch_size=2,
        max_queued_requests=4,
        retry_after_s=2,
        request_timeout_s=10.0,
    )
    work = uploads(96, [None, *FOLDERS])
    outcomes = load.send_all(url, work, concurrency=96, timeout=60)
    counts = dict(Counter(o.status for o in outcomes))
    print(f"statuses of 96 requests at once: {counts}")
    assert set(counts) <= {200, 503} and counts.get(503, 0) > 0 and counts.get(200, 0) > 0
    assert all(o.retry_after == "2" for o in outcomes if o.status == 503)
    assert max(o.seconds for o in outcomes) < 10.0 + 2.0
    served = [(job, o.body) for job, o in zip(work, outcomes) if o.status == 200]
    want = load.expected([job for job, _ in served], MODEL, FOLDERS)
    assert load.worst_error([body for _, body in served], want) <= SAME


def test_a_replica_killed_mid_burst_is_replaced_and_every_reply_is_its_own_or_an_error(url):
    load.redeploy(2, 1, adapters=ADAPTERS, model_dir=str(MODEL))
    work = uploads(500, list(FOLDERS))
    load.send_all(url, work[:64], concurrency=32, timeout=60)  # adapters loaded on both
    outcomes, killed = load.burst_killing_a_replica(url, work, concurrency=32, kill_after=100)
    counts = dict(Counter(o.status for o in outcomes))
    print(f"statuses of 500 requests, replica {killed} killed after 100: {counts}")
    failed = [(o.status, o.body) for o in outcomes if o.status != 200]
    assert all(reply == (500, {"error": app.REPLICA_FAILED}) for reply in failed), failed
    served = [(job, o.body) for job, o in zip(work, outcomes) if o.status == 200]
    assert all(body["adapter"] == job.adapter for job, body in served)
    want = load.expected([job for job, _ in served], MODEL, FOLDERS)
    assert load.worst_error([body for _, body in served], want) <= SAME
    assert sum(body["replica"] != killed for _, body in served) > 0, "the survivor served"

    # Ray starts a replica in its place; multiplexing sends adapters' requests to the replica
    # that has them loaded, so the new one is looked for with the base model's.
    survivors = {body["replica"] for _, body in served} - {killed}
    base = load.Job(IMAGES[0], None, upload=True)
    print(f"replaced in {load.wait_for_new_replica(url, base, survivors | {killed}):.1f} s")
    after = uploads(64, [None, *FOLDERS])
    figures = load.burst(url, after, concurrency=32, timeout=60)
    assert killed not in {r["replica"] for r in figures["replies"]}
    assert load.worst_error(figures["replies"], load.expected(after, MODEL, FOLDERS)) <= SAME
