"""The Ray Serve deployment (examples/serve/) on a local Ray instance bound to 127.0.0.1: two
replicas, a burst of concurrent HTTP requests over four adapters and none, every reply equal
to one engine's result for its image and adapter, and steps that really mixed adapters; local
files served only inside the allowed folder, and none by default."""

from __future__ import annotations

import faulthandler
import os
import shutil
import sys
from pathlib import Path

import pytest

from conftest import model_dir

SERVE = Path(__file__).resolve().parents[2] / "examples" / "serve"
sys.path.insert(0, str(SERVE))

try:
    import ray  # noqa: F401

    import load
except ImportError as missing:
    if os.environ.get("CI") == "true":
        raise
    pytest.skip(f"Ray Serve is not installed: {missing}", allow_module_level=True)

#: The whole test, Ray's start and stop included, ends within this or the process is stopped.
TIME_BOUND_S = 600


def test_two_replicas_serve_a_burst_of_mixed_adapters_and_refuse_bad_requests(tmp_path):
    faulthandler.dump_traceback_later(TIME_BOUND_S, exit=True)
    model = model_dir("qwen2-vl")
    folders = {p.name: p for p in sorted((model / "adapters").iterdir())}
    assert len(folders) >= 4
    # The allowed folder: the fixture's images and a file that is no image. Beside it, a real
    # image the deployment must not serve, and a link to it from inside.
    media = tmp_path / "media"
    media.mkdir()
    for image in sorted((model / "images").iterdir()):
        shutil.copy(image, media / image.name)
    images = sorted(media.iterdir())
    secret = tmp_path / "secret.png"
    shutil.copy(images[0], secret)
    (media / "link.png").symlink_to(secret)
    not_an_image = media / "not-an-image.png"
    not_an_image.write_bytes(b"not an image")
    work = load.jobs(images, [None, *folders], 300)
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
        (model / "config.json").as_uri(),
        (media / "missing.png").as_uri(),
        (tmp_path / "missing.png").as_uri(),
        "file:///etc/passwd",
    ]
    try:
        url = load.start(
            replicas=2,
            cpus_per_replica=1,
            port=load.free_port(),
            adapters={name: str(folder) for name, folder in folders.items()},
            model_dir=str(model),
            allowed_media_root=str(media),
        )
        figures = load.burst(url, work, concurrency=32, timeout=120)
        # Bad requests among good ones: each bad one gets its error, the good ones their
        # results, whether or not they shared a step.
        mixed = [job for job, _, _ in bad] + work[:28]
        outcomes = load.burst_outcomes(url, mixed, concurrency=32, timeout=120)
        refused = [load.send_url(url, file_url)[:2] for file_url in outside]
        # Deployed again without a folder (the default): no file:// URL is served, uploads are.
        load.redeploy(
            adapters={name: str(folder) for name, folder in folders.items()},
            model_dir=str(model),
        )
        default_url = load.send_url(url, images[0].as_uri())[:2]
        default_upload = load.send(url, load.Job(images[0], None, upload=True), timeout=60)[:2]
    finally:
        load.stop()
        faulthandler.cancel_dump_traceback_later()

    replies = figures["replies"]
    assert [r["adapter"] for r in replies] == [job.adapter for job in work]
    # 1e-6 relative: the same rows through the same kernels, only the other rows of each step's
    # matmuls differ (the bound the engine's own alone-versus-batch test holds).
    want = load.expected(work, model, folders)
    worst = load.worst_error(replies, want)
    assert worst <= 1e-6, f"a reply is {worst:e} from its single-engine result"
    print({k: v for k, v in figures.items() if k != "replies"})
    assert figures["replicas"] == 2, "both replicas served"
    assert figures["max_step_requests"] > 1, "requests shared engine steps"
    assert figures["max_step_adapters"] > 1, "a step mixed adapters"

    for (job, status, names), (code, reply) in zip(bad, outcomes):
        assert code == status and names in reply["error"], (job, code, reply)
    good = [reply for code, reply in outcomes[len(bad) :]]
    assert all(code == 200 for code, _ in outcomes[len(bad) :])
    assert load.worst_error(good, want[:28]) <= 1e-6

    import app

    for file_url, (code, reply) in zip(outside, refused):
        assert (code, reply) == (403, {"error": app.OUTSIDE_MEDIA_ROOT}), (file_url, code, reply)
    assert default_url == (403, {"error": app.NO_LOCAL_FILES}), default_url
    assert "allowed_media_root" in app.NO_LOCAL_FILES
    code, reply = default_upload
    assert code == 200 and load.worst_error([reply], load.expected(work[:1], model, folders)) <= 1e-6
