"""mmlora: the vision tower and connector of a vision-language model (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL) with many LoRA adapters in one batch, on any GPU wgpu reaches and on the CPU.

>>> import mmlora
>>> engine = mmlora.Engine()  # the bundled tiny model
>>> engine.load_adapter("all-r4", engine.bundled_dir / "adapters/all-r4")
>>> [result] = engine.encode([{"id": "a", "image": "cat.png", "adapter": "all-r4"}])
>>> result.embeds.shape  # (image tokens, language-model hidden size), float32

One :class:`Engine` serves many threads: calls let go of the GIL while they read files and run
the device, and requests from concurrent calls each get the result they get alone.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

import numpy as np

from . import _native, errors
from .errors import *  # noqa: F403 (the exceptions, listed in errors.__all__)

if TYPE_CHECKING:
    import PIL.Image

__all__ = ["Engine", "Request", "Encoded", "Image", *errors.__all__]

Image = Union[str, "os.PathLike[str]", bytes, "PIL.Image.Image", np.ndarray]
"""A request's image: a file path (PNG, JPEG, WebP), the bytes of such a file (an upload,
say; decoded as the file is), a PIL image, or an ``HxWx3`` ``uint8`` array of RGB pixels."""


@dataclass(frozen=True)
class Request:
    """One image to encode, with the adapter it runs with (``None``: the base model).

    A ``dict`` with the keys ``id``, ``image`` and (optionally) ``adapter`` does as well.
    """

    id: str
    image: Image
    adapter: str | None = None


@dataclass(frozen=True, repr=False)
class Encoded:
    """One request's result. The arrays are ``float32``, own their memory (the engine's
    buffers, not copied) and convert to torch without a copy (``torch.from_numpy``)."""

    id: str
    adapter: str | None
    grid_thw: tuple[int, int, int]
    """The image's patch grid: frames, rows, columns."""
    embeds: np.ndarray
    """The connector's output, ``[image tokens, hidden size]``: what the language model gets."""
    tower: np.ndarray | None
    """The tower's output ``[patches, embed dim]``, when ``with_tower=True``."""
    deepstack: np.ndarray | None
    """Qwen3-VL's deepstack mergers' outputs side by side, ``[image tokens, k · hidden size]``."""
    step: int
    """The scheduler step (0-based) the request ran in: requests of one step ran as one batch."""
    step_seconds: float
    """How long that step took on the device."""

    def __repr__(self) -> str:
        arrays = ", ".join(
            f"{name}=float32{list(array.shape)}"
            for name in ("embeds", "tower", "deepstack")
            if (array := getattr(self, name)) is not None
        )
        return (
            f"Encoded(id={self.id!r}, adapter={self.adapter!r}, grid_thw={self.grid_thw}, "
            f"{arrays}, step={self.step}, step_seconds={self.step_seconds:.4f})"
        )


class Engine:
    """A model on a device, with the PEFT adapters loaded for it.

    Args:
        model_dir: a Hugging Face model folder (``config.json`` and safetensors, sharded or
            not) of Qwen2-VL, Qwen2.5-VL or Qwen3-VL; ``None`` opens the bundled tiny model.
        device: ``"auto"`` (a hardware GPU when wgpu finds one, else the CPU), ``"cpu"`` or
            ``"gpu"`` (wgpu, also on a software rasterizer).
        precision: ``"f32"``, or ``"f16"`` on a GPU with shader f16.
        max_loras: how many distinct adapters one step mixes; calls with more run in more steps.
        max_rank: the largest adapter rank accepted.
        max_cpu_adapters: how many adapters' weights stay in memory (default: 32, at least
            ``max_loras``); the others are read back from their folders when needed.
        image_backend: whose image processor to reproduce bit for bit: ``"torchvision"``
            (transformers 5's default) or ``"pil"``.
        allowed_media_root: for a server that takes image paths from others: a folder that
            every request's image path must resolve into (symbolic links and ``..`` followed),
            else the request raises :class:`ForbiddenPathError`, the same for a path outside
            and a path that does not exist. ``None`` (the default) reads any path the process
            can, as a local user's own script should.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str] | None = None,
        *,
        device: Literal["auto", "cpu", "gpu"] = "auto",
        precision: Literal["f32", "f16"] = "f32",
        max_loras: int = 8,
        max_rank: int = 64,
        max_cpu_adapters: int | None = None,
        image_backend: Literal["torchvision", "pil"] = "torchvision",
        allowed_media_root: str | os.PathLike[str] | None = None,
    ) -> None:
        self._media_root = None if allowed_media_root is None else _media_root(allowed_media_root)
        self._native = _native.Engine(
            None if model_dir is None else os.fspath(model_dir),
            device,
            precision,
            max_loras,
            max_rank,
            max_cpu_adapters,
            image_backend,
        )

    def __repr__(self) -> str:
        model = self.model_dir or "the bundled model"
        return f"mmlora.Engine({model}, {self.device_info['description']})"

    @property
    def model_dir(self) -> Path | None:
        """The model folder; ``None`` for the bundled model."""
        return self._native.model_dir

    @property
    def bundled_dir(self) -> Path | None:
        """Where the bundled model is unpacked (deleted with the engine): its ``adapters/``
        (``all-r4``, ``patterns``, ``rslora-r8``, ``tower-r2``) and ``images/`` to try. ``None``
        for an engine on a model folder."""
        return self._native.bundled_dir

    @property
    def device_info(self) -> dict[str, Any]:
        """What the engine runs on: ``description`` (adapter, graphics API, driver), ``kind``
        (``"cpu"`` or ``"gpu"``), ``hardware_gpu``, ``graphics_api`` (``None`` on the CPU)."""
        return self._native.device_info

    def load_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        """Loads the PEFT folder ``path`` (``adapter_config.json`` and
        ``adapter_model.safetensors``) as ``name``, replacing an adapter of that name. The
        folder is checked against the model first: on an error nothing changes."""
        self._native.load_adapter(_text("adapter name", name), os.fspath(path))

    def unload_adapter(self, name: str) -> None:
        """Forgets the adapter ``name``; calls already running finish with it."""
        self._native.unload_adapter(_text("adapter name", name))

    def adapter_names(self) -> list[str]:
        """The loaded adapters' names, sorted."""
        return self._native.adapter_names()

    def encode(
        self, requests: Sequence[Request | Mapping[str, Any]], with_tower: bool = False
    ) -> list[Encoded]:
        """Encodes every request's image with its adapter, as few scheduler steps as the
        engine's slots allow, and returns the results in the requests' order.

        Raises an :class:`Error` (naming the request, file or key) for any bad request, and
        then encodes none of them.
        """
        if isinstance(requests, (Mapping, Request)):
            raise TypeError("encode takes a list of requests; wrap the one request in a list")
        native = [
            _native_request(index, request, self._media_root)
            for index, request in enumerate(requests)
        ]
        return [Encoded(*result) for result in self._native.encode(native, bool(with_tower))]

    async def encode_async(
        self, requests: Sequence[Request | Mapping[str, Any]], with_tower: bool = False
    ) -> list[Encoded]:
        """:meth:`encode` on the event loop's default executor, so that the loop runs on while
        the device works (the call lets go of the GIL)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            None, functools.partial(self.encode, requests, with_tower)
        )


def _native_request(
    index: int, request: Request | Mapping[str, Any], media_root: Path | None
) -> tuple:
    """``(id, image, adapter)`` with the image a path string (inside ``media_root`` where there
    is one), bytes or an ``HxWx3`` ``uint8`` array."""
    if isinstance(request, Request):
        id, image, adapter = request.id, request.image, request.adapter
    elif isinstance(request, Mapping):
        unknown = set(request) - {"id", "image", "adapter"}
        if unknown:
            raise TypeError(
                f"request {index}: unknown keys {sorted(map(str, unknown))}; "
                "a request has id, image and adapter"
            )
        for key in ("id", "image"):
            if key not in request:
                raise TypeError(f"request {index}: no `{key}`")
        id, image, adapter = request["id"], request["image"], request.get("adapter")
    else:
        raise TypeError(
            f"request {index} is a {type(request).__name__}; expected a dict or mmlora.Request"
        )
    id = _text(f"request {index}'s id", id)
    if adapter is not None:
        adapter = _text(f"request `{id}`'s adapter", adapter)
    return id, _native_image(id, image, media_root), adapter


def _native_image(id: str, image: Any, media_root: Path | None) -> str | bytes | np.ndarray:
    if isinstance(image, (str, os.PathLike)):
        return os.fspath(image) if media_root is None else _inside(id, image, media_root)
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise TypeError(
                f"request `{id}`: the image array is {image.dtype}; expected uint8 (HxWx3 RGB)"
            )
        if image.ndim != 3 or image.shape[2] != 3:
            shape = "×".join(map(str, image.shape))
            raise ImageError(f"request `{id}`: the image array is {shape}; expected HxWx3 (RGB)")
        return image
    pil = sys.modules.get("PIL.Image")
    if pil is not None and isinstance(image, pil.Image):
        return np.asarray(_rgb(pil, image))
    raise TypeError(
        f"request `{id}`: the image is a {type(image).__name__}; "
        "expected a path, an image file's bytes, a PIL image or an HxWx3 uint8 numpy array"
    )


def _media_root(folder: str | os.PathLike[str]) -> Path:
    """The folder image paths must resolve into, itself resolved (links followed)."""
    try:
        root = Path(os.path.realpath(os.fspath(folder), strict=True))
    except OSError as error:
        raise OptionsError(f"allowed_media_root `{os.fspath(folder)}`: {error.strerror}") from None
    if not root.is_dir():
        raise OptionsError(f"allowed_media_root `{root}` is not a folder")
    return root


def _inside(id: str, image: str | os.PathLike[str], root: Path) -> str:
    """The resolved path of ``image`` where it exists inside ``root``: every symbolic link and
    ``..`` followed first, so that no spelling of a path leads out. What the engine then opens is
    that resolved path, not the one given."""
    try:
        path = Path(os.path.realpath(os.fspath(image), strict=True))
    except (OSError, ValueError):
        path = None
    if path is None or not path.is_relative_to(root):
        raise ForbiddenPathError(
            f"request `{id}`: the image is not a file inside the allowed media folder"
        )
    return str(path)


def _rgb(pil: Any, image: PIL.Image.Image) -> PIL.Image.Image:
    """The image in RGB as transformers' image processors make it: any transparency composited
    over white, so that a PIL image gives the pixels its file gives."""
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    white = pil.new("RGBA", rgba.size, (255, 255, 255))
    return pil.alpha_composite(white, rgba).convert("RGB")


def _text(what: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} is a {type(value).__name__}; expected a str")
    return value
