"""A request's image given as a file, as the file's bytes, as the PIL image opened from that
file, or as its pixels in a numpy array gives one result; results are numpy arrays torch can
share."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest

import mmlora
from conftest import model_dir

IMAGES = sorted(p.name for p in (model_dir("qwen2-vl") / "images").iterdir())


@pytest.mark.parametrize("image", IMAGES)
def test_its_bytes_and_its_pil_image_give_what_its_file_gives(cpu_engine: mmlora.Engine, image: str):
    path = model_dir("qwen2-vl") / "images" / image
    with PIL.Image.open(path) as opened:
        opened.load()
        mode = opened.mode
        forms = {"file": path, "bytes": path.read_bytes(), "pil": opened.copy()}
        if mode == "RGB":
            forms["array"] = np.asarray(opened)

    def alone(form):
        # Each form in a call of its own, so each runs in the same step layout: equal pixels
        # then give equal results to the bit (in one step, rows at other positions may be
        # summed in another order by the matmuls' edge tiles).
        [result] = cpu_engine.encode([{"id": form, "image": forms[form], "adapter": "all-r4"}], True)
        return result

    file = alone("file")
    for form in forms.keys() - {"file"}:
        other = alone(form)
        assert other.grid_thw == file.grid_thw
        np.testing.assert_array_equal(other.tower, file.tower, err_msg=f"{image} ({mode}) {form}")
        np.testing.assert_array_equal(other.embeds, file.embeds, err_msg=f"{image} ({mode}) {form}")


def test_images_in_other_modes_match_their_files_too():
    # The fixtures hold RGB, RGBA, grayscale and palette-free images; the loop above covers the
    # modes they have. This guards that they cover transparency and grayscale at all.
    modes = set()
    for image in IMAGES:
        with PIL.Image.open(model_dir("qwen2-vl") / "images" / image) as opened:
            modes.add(opened.mode)
    assert {"RGB", "RGBA", "L"} <= modes, modes


def test_arrays_with_any_strides_give_the_same_result(cpu_engine: mmlora.Engine):
    with PIL.Image.open(model_dir("qwen2-vl") / "images" / "square.png") as opened:
        pixels = np.asarray(opened.convert("RGB"))
    flipped_twice = pixels[::-1][::-1]  # a view with negative strides, read in order
    padded = np.zeros((pixels.shape[0], pixels.shape[1], 4), np.uint8)
    padded[..., :3] = pixels
    strided = padded[..., :3]  # not contiguous
    forms = {
        "contiguous": pixels,
        "flipped": flipped_twice,
        "strided": strided,
        "fortran": np.asfortranarray(pixels),
    }
    results = {
        form: cpu_engine.encode([{"id": form, "image": array}])[0].embeds
        for form, array in forms.items()
    }
    for form, embeds in results.items():
        np.testing.assert_array_equal(embeds, results["contiguous"], err_msg=form)


def test_results_are_float32_arrays_torch_can_share(cpu_engine: mmlora.Engine):
    [result] = cpu_engine.encode(
        [mmlora.Request("a", model_dir("qwen2-vl") / "images" / "wide.jpg", "tower-r2")],
        with_tower=True,
    )
    for array in (result.embeds, result.tower):
        assert array.dtype == np.float32
        assert array.ndim == 2
        # What torch.from_numpy needs to share the memory: aligned, writeable, C order,
        # native byte order.
        assert array.flags.c_contiguous and array.flags.writeable and array.flags.aligned
        assert array.dtype.isnative
        # The engine's buffer itself: the array is not a copy made from another array.
        assert not isinstance(array.base, np.ndarray)
    tokens = int(np.prod(result.grid_thw)) // 4  # the merger joins 2 × 2 patches
    assert result.embeds.shape == (tokens, 48)  # × the tiny language model's width
    assert result.deepstack is None  # Qwen2-VL has no deepstack mergers
