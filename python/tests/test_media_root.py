"""`mmlora.Engine(allowed_media_root=...)`, for servers that take image paths from others: a path
is read only where it resolves (links and `..` followed) to a file inside the folder; every
other path, existing or not, raises one `ForbiddenPathError` (a `PermissionError`) with one
message, and the engine answers as before."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import mmlora
from conftest import model_dir

MODEL = model_dir("qwen2-vl")


@pytest.fixture
def media(tmp_path: Path) -> Path:
    """An allowed folder holding the fixture's square image; beside it, a copy it must not read
    and a link to that copy from inside."""
    folder = tmp_path / "media"
    folder.mkdir()
    shutil.copy(MODEL / "images" / "square.png", folder / "square.png")
    shutil.copy(MODEL / "images" / "wide.jpg", tmp_path / "secret.jpg")
    (folder / "link.jpg").symlink_to(tmp_path / "secret.jpg")
    (folder / "sub").mkdir()
    return folder


def test_paths_inside_are_read_and_give_what_the_file_gives(media: Path):
    free = mmlora.Engine(MODEL, device="cpu")
    guarded = mmlora.Engine(MODEL, device="cpu", allowed_media_root=media)
    [want] = free.encode([{"id": "a", "image": MODEL / "images" / "square.png"}])
    for spelling in [media / "square.png", media / "sub" / ".." / "square.png", str(media / "square.png")]:
        [got] = guarded.encode([{"id": "a", "image": spelling}])
        np.testing.assert_array_equal(got.embeds, want.embeds)
    # Bytes and arrays are not paths: the folder does not apply to them.
    [got] = guarded.encode([{"id": "a", "image": (media / "square.png").read_bytes()}])
    np.testing.assert_array_equal(got.embeds, want.embeds)


def test_every_path_out_and_every_missing_file_is_one_error(media: Path, tmp_path: Path):
    engine = mmlora.Engine(MODEL, device="cpu", allowed_media_root=media)
    [before] = engine.encode([{"id": "a", "image": media / "square.png"}])
    outside = [
        media / ".." / "secret.jpg",
        media / "link.jpg",
        tmp_path / "secret.jpg",
        MODEL / "images" / "square.png",
        media / "missing.png",
        tmp_path / "missing.png",
        "relative/missing.png",
        "/etc/passwd",
        str(media / "square.png") + "\0",
    ]
    messages = set()
    for path in outside:
        with pytest.raises(mmlora.ForbiddenPathError) as refused:
            engine.encode([{"id": "x", "image": media / "square.png"}, {"id": "y", "image": path}])
        assert isinstance(refused.value, PermissionError) and isinstance(refused.value, mmlora.Error)
        messages.add(str(refused.value))
    assert messages == {"request `y`: the image is not a file inside the allowed media folder"}
    [after] = engine.encode([{"id": "a", "image": media / "square.png"}])
    np.testing.assert_array_equal(after.embeds, before.embeds)


def test_the_folder_must_exist(tmp_path: Path):
    with pytest.raises(mmlora.OptionsError, match="missing"):
        mmlora.Engine(MODEL, device="cpu", allowed_media_root=tmp_path / "missing")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(mmlora.OptionsError, match="not a folder"):
        mmlora.Engine(MODEL, device="cpu", allowed_media_root=tmp_path / "file")
