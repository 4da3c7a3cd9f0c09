"""mmlora behind Ray Serve: replicas that each hold an `mmlora.Engine`, concurrent HTTP requests
with different adapters gathered into one engine step.

    POST /encode                      body: an image file (PNG, JPEG, WebP) as uploaded bytes,
                                      or JSON {"url": "file:///path/to/image.png"} for a file
                                      inside the deployment's allowed_media_root
    header serve_multiplexed_model_id: the adapter's name (leave it out for the base model)

`file://` URLs are refused (403) unless the deployment names `allowed_media_root`, and then
served only for files that resolve inside it: every other path gets the same 403 reply,
whether or not it exists, so that the endpoint tells a client nothing about the server's files.

The reply is JSON: the embeddings as base64 of little-endian float32 (exact bits, and a plain
HTTP client reads it without a safetensors parser), their shape, and how many requests (and
adapters) shared the engine step the request ran in.

Adapters are loaded by name on demand through Ray Serve's model multiplexing, which sends a
request to a replica that already has its adapter where one does. Run it with
`serve run app:app` from this folder, or build it with :func:`deployment` (see README.md).
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import os
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

import mmlora

#: The adapters of `mmlora.Engine()`'s bundled model; a deployment on a model folder names its own.
BUNDLED_ADAPTERS = ["all-r4", "patterns", "rslora-r8", "tower-r2"]

#: The reply to a `file://` URL when the deployment serves no local files.
NO_LOCAL_FILES = (
    "file:// URLs are refused: this deployment serves no local files. Upload the image as the "
    "request's body, or deploy with allowed_media_root=<folder> to serve the files inside it"
)
#: The reply to a `file://` URL outside the allowed folder, or naming no file: one text for both.
OUTSIDE_MEDIA_ROOT = (
    "file:// URLs are served only for files inside the deployment's allowed_media_root"
)


class BadRequest(Exception):
    """The HTTP request cannot be served: replied with this status and message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@serve.deployment(max_ongoing_requests=64)
class Encoder:
    """One replica: an engine and the adapters it can load.

    Args:
        adapters: adapter name → PEFT folder. The folders must be readable on every node a
            replica may run on (the same path, or a shared file system). ``None``: the bundled
            model's adapters (``model_dir`` must then be ``None`` too).
        model_dir: the model folder, on every node; ``None`` for the bundled model.
        device: ``"cpu"``, ``"gpu"`` or ``"auto"``; give each replica a GPU of its own
            (``ray_actor_options={"num_gpus": 1}``) or its own CPU cores (``num_cpus`` and
            ``RAYON_NUM_THREADS`` in its ``runtime_env``).
        max_batch_size, batch_wait_timeout_s: how many requests one step may gather, and how
            long the first waits for others.
        allowed_media_root: the folder whose files `file://` URLs may name (on every node a
            replica may run on); ``None`` (the default) refuses every `file://` URL.
    """

    def __init__(
        self,
        adapters: dict[str, str] | None = None,
        model_dir: str | None = None,
        device: str = "cpu",
        max_loras: int = 8,
        max_batch_size: int = 32,
        batch_wait_timeout_s: float = 0.01,
        allowed_media_root: str | None = None,
    ):
        self.local_files = allowed_media_root is not None
        self.engine = mmlora.Engine(
            model_dir, device=device, max_loras=max_loras, allowed_media_root=allowed_media_root
        )
        if adapters is None:
            if self.engine.bundled_dir is None:
                raise ValueError("name the adapters of a model folder")
            folder = self.engine.bundled_dir / "adapters"
            adapters = {name: str(folder / name) for name in BUNDLED_ADAPTERS}
        self.folders = {name: Path(path) for name, path in adapters.items()}
        self.encode_batch.set_max_batch_size(max_batch_size)
        self.encode_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)

    # Serve keeps at most this many adapters "loaded" per replica for routing; the engine keeps
    # every adapter it has seen registered (the weights of the least recently used leave host
    # memory beyond its max_cpu_adapters and are read back when needed), so an adapter Serve
    # forgets is never unloaded under a request already waiting for a step.
    @serve.multiplexed(max_num_models_per_replica=32)
    async def adapter(self, name: str) -> str:
        folder = self.folders.get(name)
        if folder is None:
            raise BadRequest(404, f"no adapter named `{name}` (known: {sorted(self.folders)})")
        await asyncio.get_running_loop().run_in_executor(
            None, self.engine.load_adapter, name, folder
        )
        return name

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def encode_batch(self, items: list[tuple[Any, str | None]]) -> list[dict | Exception]:
        requests = [
            {"id": str(i), "image": image, "adapter": adapter}
            for i, (image, adapter) in enumerate(items)
        ]
        try:
            results = await self.engine.encode_async(requests)
        except mmlora.Error:
            # One bad image refuses the whole call: serve each request alone, so that only
            # the bad ones fail.
            return [await self._alone(request) for request in requests]
        steps: dict[int, list[str | None]] = {}
        for result in results:
            steps.setdefault(result.step, []).append(result.adapter)
        return [reply(result, steps[result.step]) for result in results]

    async def _alone(self, request: dict) -> dict | Exception:
        try:
            [result] = await self.engine.encode_async([request])
        except mmlora.Error as error:
            return error
        return reply(result, [result.adapter])

    async def __call__(self, http: Request) -> JSONResponse:
        try:
            adapter = serve.get_multiplexed_model_id() or None
            if adapter is not None:
                await self.adapter(adapter)
            image = await read_image(http, self.local_files)
            # Serve's batcher splits a batch by the requests' multiplexed model ids, one model
            # per batch; the engine mixes adapters in one step. So the request joins the batch
            # from an empty context, where it carries no model id (its adapter goes with it).
            batched = contextvars.Context().run(
                asyncio.ensure_future, self.encode_batch((image, adapter))
            )
            result = await batched
            if isinstance(result, Exception):
                raise result
        except BadRequest as error:
            return JSONResponse({"error": str(error)}, status_code=error.status)
        except mmlora.ForbiddenPathError:
            return JSONResponse({"error": OUTSIDE_MEDIA_ROOT}, status_code=403)
        except mmlora.MissingFileError as error:
            return JSONResponse({"error": str(error)}, status_code=404)
        except mmlora.Error as error:
            return JSONResponse({"error": str(error)}, status_code=400)
        return JSONResponse(result)


async def read_image(http: Request, local_files: bool) -> bytes | str:
    """The request's image: the uploaded bytes, or the path of a `file://` URL (percent-encoding
    decoded; the engine then checks that it resolves inside the allowed folder)."""
    body = await http.body()
    if not http.headers.get("content-type", "").startswith("application/json"):
        if not body:
            raise BadRequest(400, "the body holds no image")
        return body
    try:
        url = (await http.json())["url"]
    except (ValueError, KeyError, TypeError):
        raise BadRequest(400, 'a JSON body is {"url": "file:///path/to/image"}') from None
    parsed = urlparse(str(url))
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise BadRequest(400, f"`{url}`: only file:// URLs of this machine are fetched")
    if not local_files:
        raise BadRequest(403, NO_LOCAL_FILES)
    return unquote(parsed.path)


def reply(result: mmlora.Encoded, step_adapters: list[str | None]) -> dict:
    return {
        "adapter": result.adapter,
        "grid_thw": list(result.grid_thw),
        "shape": list(result.embeds.shape),
        "dtype": "float32",
        # Already little-endian float32 on every machine mmlora builds for: no copy.
        "embeds": base64.b64encode(result.embeds.astype("<f4", copy=False).data).decode("ascii"),
        "step_requests": len(step_adapters),
        "step_adapters": len(set(step_adapters)),
        "replica": os.getpid(),
    }


def deployment(
    replicas: int = 1, cpus_per_replica: int = 1, **options: Any
) -> serve.Application:
    """The application with `replicas` CPU replicas of `cpus_per_replica` cores each (the
    engine's threads limited to them); `options` go to :class:`Encoder`."""
    return Encoder.options(
        num_replicas=replicas,
        # Serve's default of 5 requests at a time per replica would cap each step at 5.
        max_ongoing_requests=2 * options.get("max_batch_size", 32),
        ray_actor_options={
            "num_cpus": cpus_per_replica,
            "runtime_env": {"env_vars": {"RAYON_NUM_THREADS": str(cpus_per_replica)}},
        },
    ).bind(**options)


#: `serve run app:app`: one replica on the bundled model.
app = deployment()
