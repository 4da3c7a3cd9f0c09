"""The exceptions mmlora raises.

Every one is an :class:`Error`, and also the built-in exception Python code expects for that
kind of failure, so ``except FileNotFoundError`` or ``except ValueError`` catches it too. The
message names the file, key or request at fault. A failed call leaves the engine as it was.
"""

from __future__ import annotations

__all__ = [
    "Error",
    "MissingFileError",
    "OptionsError",
    "ModelError",
    "AdapterError",
    "UnknownAdapterError",
    "RequestError",
    "ImageError",
    "ImageTooLargeError",
    "NumericError",
    "DeviceError",
    "ForbiddenPathError",
]


class Error(Exception):
    """Anything the engine refused or failed at."""


class MissingFileError(Error, FileNotFoundError):
    """A file or folder the call reads (model, adapter or image) does not exist."""


class OptionsError(Error, ValueError):
    """The engine's options cannot work (a limit out of range, a kernel pin that cannot run)."""


class ModelError(Error, ValueError):
    """The model folder cannot be loaded: a malformed config, a missing or mis-shaped weight."""


class AdapterError(Error, ValueError):
    """A PEFT adapter folder is malformed or does not fit the model."""


class UnknownAdapterError(Error, KeyError):
    """A request or ``unload_adapter`` names an adapter that is not loaded."""

    def __str__(self) -> str:
        # KeyError would quote the message.
        return str(self.args[0]) if self.args else ""


class RequestError(Error, ValueError):
    """A request was refused: a repeated id, an image too large for one step."""


class ImageError(RequestError):
    """A request's image cannot be read, decoded or processed."""


class ImageTooLargeError(ImageError):
    """A request's image is above a size limit: more pixels than the decoder accepts, or more
    patches than one step can hold on the device. The message names the limit."""


class NumericError(Error, ArithmeticError):
    """The model overflowed the float type it computes in (outputs that are not finite)."""


class DeviceError(Error, RuntimeError):
    """The device is missing, failed a step, or was lost."""


class ForbiddenPathError(Error, PermissionError):
    """A request's image path is not inside the engine's ``allowed_media_root``, or does not
    exist: the message is the same either way, so that it tells nothing about files outside."""
