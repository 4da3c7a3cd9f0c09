# The Rust extension behind mmlora (python/src/). Private: use mmlora.Engine, which turns
# requests and results into these plain tuples and back.

from pathlib import Path
from typing import Any

import numpy as np

_EncodedTuple = tuple[
    str,  # id
    str | None,  # adapter
    tuple[int, int, int],  # grid_thw
    np.ndarray,  # embeds, float32 [tokens, hidden]
    np.ndarray | None,  # tower
    np.ndarray | None,  # deepstack
    int,  # step
    float,  # step seconds
]

class Engine:
    def __init__(
        self,
        model_dir: str | None,
        device: str,
        precision: str,
        max_loras: int,
        max_rank: int,
        max_cpu_adapters: int | None,
        image_backend: str,
    ) -> None: ...
    @property
    def model_dir(self) -> Path | None: ...
    @property
    def bundled_dir(self) -> Path | None: ...
    @property
    def device_info(self) -> dict[str, Any]: ...
    def load_adapter(self, name: str, path: str) -> None: ...
    def unload_adapter(self, name: str) -> None: ...
    def adapter_names(self) -> list[str]: ...
    def encode(
        self, requests: list[tuple[str, str | bytes | np.ndarray, str | None]], with_tower: bool
    ) -> list[_EncodedTuple]: ...
    def _time_encode(
        self,
        requests: list[tuple[str, str | bytes | np.ndarray, str | None]],
        with_tower: bool,
        repeats: int,
    ) -> list[float]: ...
