"""The Ray Serve deployment (examples/serve/) on a local Ray instance bound to 127.0.0.1: two
replicas, a burst of concurrent HTTP requests over four adapters and none, every reply equal
to one engine's result for its image and adapter, and steps that really mixed adapters."""

from __future__ import annotations

import faulthandler
import os
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
    images = sorted((model / "images").iterdir())
    work = load.jobs(images, [None, *folders], 300)
    not_an_image = tmp_path / "not-an-image.png"
    not_an_image.write_bytes(b"not an image")
    bad = [
        (load.Job(images[0], "nope", upload=True), 404, "nope"),
        (load.Job(not_an_image, "all-r4", upload=True), 400, "cannot decode"),
        (load.Job(not_an_image, None, upload=False), 400, "not-an-image.png"),
        (load.Job(tmp_path / "missing.png", None, upload=False), 404, "missing.png"),
    ]
    try:
        url = load.start(
            replicas=2,
            cpus_per_replica=1,
            port=load.free_port(),
            adapters={name: str(folder) for name, folder in folders.items()},
            model_dir=str(model),
        )
        figures = load.burst(url, work, concurrency=32, timeout=120)
        # Bad requests among good ones: each bad one gets its error, the good ones their
        # results, whether or not they shared a step.
        mixed = [job for job, _, _ in bad] + work[:28]
        outcomes = load.burst_outcomes(url, mixed, concurrency=32, timeout=120)
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
