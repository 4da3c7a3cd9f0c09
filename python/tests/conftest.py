"""What the Python package's tests share: the committed fixtures (tiny models of each family,
their adapters and images, and what transformers + PEFT computed from them) and the error
measures the Rust tests use."""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import mmlora

ASSETS = Path(__file__).resolve().parents[2] / "assets"
FAMILIES = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"]


def model_dir(family: str) -> Path:
    return ASSETS / f"tiny-{family}"


def declared_png(width: int, height: int) -> bytes:
    """A PNG file that declares `width`×`height` RGB pixels and holds none: what a decoder must
    refuse from its header alone when the size is above its limit."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


def batch(family: str) -> dict:
    """The family's example batch, paths made absolute."""
    folder = model_dir(family)
    spec = json.loads((folder / "batch.json").read_text())
    return {
        "adapters": {name: folder / path for name, path in spec["adapters"].items()},
        "requests": [
            {"id": r["id"], "image": folder / r["image"], "adapter": r["adapter"]}
            for r in spec["requests"]
        ],
    }


def expected(family: str) -> dict[str, np.ndarray]:
    """What transformers + PEFT computed for the family's batch (`tools/make_fixtures.py`)."""
    return load_file(model_dir(family) / "expected.safetensors")


def errors(actual: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """Relative Frobenius error and largest absolute error, in float64."""
    assert actual.shape == want.shape, (actual.shape, want.shape)
    diff = actual.astype(np.float64) - want.astype(np.float64)
    return float(np.linalg.norm(diff) / np.linalg.norm(want)), float(np.abs(diff).max())


def open_engine(family: str, device: str, **options) -> mmlora.Engine:
    """An engine on the family's tiny model with the batch's adapters loaded. On `gpu`, a
    machine without a wgpu adapter skips the test, except under CI=true, where it fails."""
    try:
        engine = mmlora.Engine(model_dir(family), device=device, **options)
    except mmlora.DeviceError as error:
        if device == "gpu" and os.environ.get("CI") != "true":
            pytest.skip(f"no wgpu adapter here: {error}")
        raise
    for name, folder in batch(family)["adapters"].items():
        engine.load_adapter(name, folder)
    return engine


@pytest.fixture(scope="session")
def cpu_engine() -> mmlora.Engine:
    """One CPU engine on the Qwen2-VL tiny model with its adapters, shared by the tests that
    leave it as they found it."""
    return open_engine("qwen2-vl", "cpu")
