"""Bad inputs from Python raise the exception Python code expects (an `mmlora.Error` that is
also a `FileNotFoundError`, `ValueError`, `KeyError` or `TypeError` where that fits), naming
the file, key or request, and leave the engine as it was."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import mmlora
from conftest import declared_png, model_dir

MODEL = model_dir("qwen2-vl")
SQUARE = MODEL / "images" / "square.png"


@pytest.fixture
def engine():
    engine = mmlora.Engine(MODEL, device="cpu")
    engine.load_adapter("all-r4", MODEL / "adapters" / "all-r4")
    return engine


def baseline(engine: mmlora.Engine) -> list[np.ndarray]:
    requests = [
        {"id": "a", "image": SQUARE, "adapter": "all-r4"},
        {"id": "b", "image": MODEL / "images" / "wide.jpg"},
    ]
    return [r.embeds for r in engine.encode(requests)]


def still_works(engine: mmlora.Engine, before: list[np.ndarray], names=("all-r4",)):
    assert engine.adapter_names() == list(names)
    for was, now in zip(before, baseline(engine)):
        np.testing.assert_array_equal(now, was)


@pytest.mark.parametrize(
    "request_, error, names",
    [
        ([], TypeError, "request 1 is a list"),
        ({"id": "x"}, TypeError, "request 1: no `image`"),
        ({"id": "x", "image": SQUARE, "adaptor": "all-r4"}, TypeError, "unknown keys ['adaptor']"),
        ({"id": 7, "image": SQUARE}, TypeError, "request 1's id is a int"),
        ({"id": "x", "image": 3}, TypeError, "request `x`: the image is a int"),
        ({"id": "x", "image": SQUARE, "adapter": 1}, TypeError, "request `x`'s adapter"),
        (
            {"id": "x", "image": np.zeros((8, 8, 3), np.float32)},
            TypeError,
            "float32; expected uint8",
        ),
        ({"id": "x", "image": np.zeros((8, 8), np.uint8)}, mmlora.ImageError, "is 8×8;"),
        ({"id": "x", "image": np.zeros((8, 8, 4), np.uint8)}, mmlora.ImageError, "8×8×4"),
        ({"id": "x", "image": np.zeros((0, 8, 3), np.uint8)}, mmlora.ImageError, "request `x`"),
        ({"id": "x", "image": MODEL / "nope.png"}, mmlora.MissingFileError, "nope.png"),
        ({"id": "x", "image": MODEL / "config.json"}, mmlora.ImageError, "config.json"),
        ({"id": "x", "image": b"not an image"}, mmlora.ImageError, "request `x`"),
        # 9000 × 8000 is above the decoder's 64 Mi pixels: refused by its header, the limit named.
        (
            {"id": "x", "image": declared_png(9000, 8000)},
            mmlora.ImageTooLargeError,
            "9000×8000, above the limit of 67108864 pixels",
        ),
        ({"id": "x", "image": SQUARE, "adapter": "nope"}, mmlora.UnknownAdapterError, "`nope`"),
    ],
)
def test_a_bad_request_raises_and_changes_nothing(engine, request_, error, names):
    before = baseline(engine)
    good = {"id": "good", "image": SQUARE, "adapter": "all-r4"}
    with pytest.raises(error) as raised:
        engine.encode([good, request_])
    assert names in str(raised.value)
    still_works(engine, before)


def test_the_exceptions_are_the_builtin_ones_python_code_catches(engine):
    with pytest.raises(FileNotFoundError):
        engine.encode([{"id": "x", "image": MODEL / "nope.png"}])
    with pytest.raises(ValueError):
        engine.encode([{"id": "x", "image": MODEL / "config.json"}])
    with pytest.raises(KeyError) as unknown:
        engine.encode([{"id": "x", "image": SQUARE, "adapter": "nope"}])
    assert str(unknown.value).startswith("request `x` names adapter `nope`")  # not quoted
    with pytest.raises(mmlora.RequestError, match="request id `x` appears more than once"):
        engine.encode([{"id": "x", "image": SQUARE}, {"id": "x", "image": SQUARE}])
    with pytest.raises(mmlora.RequestError):
        engine.encode([{"id": "x", "image": declared_png(9000, 8000)}])
    with pytest.raises(TypeError, match="wrap the one request in a list"):
        engine.encode({"id": "x", "image": SQUARE})


def test_the_rust_module_checks_what_the_wrapper_checks(engine):
    # The module behind mmlora.Engine refuses what reaches it past the wrapper, without a panic.
    before = baseline(engine)
    native = engine._native
    for image, error, names in [
        (np.zeros((8, 8, 3), np.float32), TypeError, "float32"),
        (np.zeros((8, 8), np.uint8), mmlora.ImageError, "8×8;"),
        (np.zeros((8, 8, 4), np.uint8), mmlora.ImageError, "8×8×4"),
        (3, TypeError, "the image is a int"),
    ]:
        with pytest.raises(error, match=names):
            native.encode([("x", image, None)], False)
    with pytest.raises(ValueError, match="expected tuple of length 3"):  # PyO3's own check
        native.encode([("x",)], False)
    still_works(engine, before)


def broken_copy(tmp_path: Path, edit) -> Path:
    folder = tmp_path / "adapter"
    shutil.copytree(MODEL / "adapters" / "all-r4", folder)
    edit(folder)
    return folder


def truncate(folder: Path):
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])


def bad_rank(folder: Path):
    config = folder / "adapter_config.json"
    config.write_text(config.read_text().replace('"r": 4', '"r": 5'))


@pytest.mark.parametrize(
    "make, error, names",
    [
        (lambda tmp: tmp / "missing", mmlora.MissingFileError, "missing"),
        (lambda tmp: broken_copy(tmp, truncate), mmlora.AdapterError, "adapter_model.safetensors"),
        (lambda tmp: broken_copy(tmp, bad_rank), mmlora.AdapterError, "adapter_model.safetensors"),
        # Qwen3-VL's deepstack adapter targets layers Qwen2-VL has not.
        (
            lambda tmp: model_dir("qwen3-vl") / "adapters" / "deepstack-r4",
            mmlora.AdapterError,
            "deepstack",
        ),
    ],
)
def test_a_bad_adapter_raises_and_changes_nothing(engine, tmp_path, make, error, names):
    before = baseline(engine)
    folder = make(tmp_path)
    with pytest.raises(error) as raised:
        engine.load_adapter("all-r4", folder)  # would replace the loaded one
    assert names in str(raised.value)
    with pytest.raises(error):
        engine.load_adapter("other", folder)
    still_works(engine, before)


def test_unloading_an_unknown_name_raises_key_error(engine):
    before = baseline(engine)
    with pytest.raises(KeyError, match="no adapter named `nope` is loaded"):
        engine.unload_adapter("nope")
    with pytest.raises(TypeError):
        engine.load_adapter(3, MODEL / "adapters" / "all-r4")
    still_works(engine, before)


def test_bad_engines_raise(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        mmlora.Engine(tmp_path / "nope", device="cpu")
    shutil.copytree(MODEL, tmp_path / "model")
    (tmp_path / "model" / "config.json").unlink()
    with pytest.raises(mmlora.MissingFileError, match="config.json"):
        mmlora.Engine(tmp_path / "model", device="cpu")
    with pytest.raises(ValueError, match="device `tpu`: expected one of auto, cpu, gpu"):
        mmlora.Engine(device="tpu")
    with pytest.raises(ValueError, match="precision `f64`"):
        mmlora.Engine(precision="f64")
    with pytest.raises(ValueError, match="image_backend `cv2`"):
        mmlora.Engine(image_backend="cv2")
    with pytest.raises(mmlora.OptionsError):
        mmlora.Engine(device="cpu", max_loras=0)
    with pytest.raises(mmlora.OptionsError, match="f16"):
        mmlora.Engine(device="cpu", precision="f16")
