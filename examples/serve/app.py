"""mmlora behind Ray Serve: replicas that each hold an `mmlora.Engine`, concurrent HTTP requests
with different adapters gathered into one engine step.

    POST /encode                      body: an image file (PNG, JPEG, WebP) as uploaded bytes,
                                      or JSON {"url": "file:///path/to/image.png"} for a file
                                      inside the deployment's allowed_media_root
    header serve_multiplexed_model_id: the adapter's name (leave it out for the base model)
    header Authorization: Bearer <MMLORA_SERVE_TOKEN>, where the deployment has a token

`file://` URLs are refused (403) unless the deployment names `allowed_media_root`, and then
served only for files that resolve inside it: every other path gets the same 403 reply,
whether or not it exists, so that the endpoint tells a client nothing about the server's files.
A body above `max_body_bytes` is refused (413) before it is read whole (in Serve's proxy too,
with :class:`ProxyGuard`), a request not answered within `request_timeout_s` gets 504 (and its
image never reaches a later engine step), and requests beyond what the replicas and Serve's
queue hold get 503 with `Retry-After`.

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
import hmac
import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from ray import serve
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse

import mmlora

#: The adapters of `mmlora.Engine()`'s bundled model; a deployment on a model folder names its own.
BUNDLED_ADAPTERS = ["all-r4", "patterns", "rslora-r8", "tower-r2"]

#: The environment variable holding the bearer token requests must carry; unset: none needed.
TOKEN_VARIABLE = "MMLORA_SERVE_TOKEN"

#: The reply to a `file://` URL when the deployment serves no local files.
NO_LOCAL_FILES = (
    "file:// URLs are refused: this deployment serves no local files. Upload the image as the "
    "request's body, or deploy with allowed_media_root=<folder> to serve the files inside it"
)
#: The reply to a `file://` URL outside the allowed folder, or naming no file: one text for both.
OUTSIDE_MEDIA_ROOT = (
    "file:// URLs are served only for files inside the deployment's allowed_media_root"
)
#: The reply to a request without the deployment's token, or with another: one text for both.
UNAUTHORIZED = f"this deployment needs the header `Authorization: Bearer <{TOKEN_VARIABLE}>`"

#: The environment variable of each Ray node that sets :class:`ProxyGuard`'s limit in bytes.
PROXY_LIMIT_VARIABLE = "MMLORA_SERVE_MAX_BODY_BYTES"
#: The limit on bodies, in Serve's proxy (:class:`ProxyGuard`) and in each replica.
DEFAULT_MAX_BODY_BYTES = 32 << 20


def too_large(limit: int, setting: str) -> str:
    return f"the body is larger than {limit} bytes, this deployment's limit ({setting})"


#: The reply to a request whose replica failed before replying (it died, or raised).
REPLICA_FAILED = (
    "the replica serving this request failed before replying (it died, or raised an error); "
    "nothing was served for it: send it again"
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
        max_body_bytes: the largest request body read; a larger one gets 413.
        request_timeout_s: how long a request may take on the replica, from its arrival to its
            reply (loading its adapter, waiting for a step, the step); past it, 504.

    The bearer token is the replica's environment variable ``MMLORA_SERVE_TOKEN`` (see
    :func:`deployment`): when it is set, a request without ``Authorization: Bearer <token>``
    gets 401.
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
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        request_timeout_s: float = 30.0,
    ):
        self.local_files = allowed_media_root is not None
        self.max_body_bytes = max_body_bytes
        self.request_timeout_s = request_timeout_s
        token = os.environ.get(TOKEN_VARIABLE)
        self.token = token.encode() if token else None
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
            self._authorize(http)
            # A timer on this task rather than `asyncio.wait_for`, which costs a task of its own.
            async with asyncio.timeout(self.request_timeout_s):
                result = await self._encode(http)
        except TimeoutError:
            message = (
                f"not served within the deployment's request_timeout_s ({self.request_timeout_s} s)"
            )
            return JSONResponse({"error": message}, status_code=504)
        except BadRequest as error:
            headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
            return JSONResponse({"error": str(error)}, status_code=error.status, headers=headers)
        except mmlora.ForbiddenPathError:
            return JSONResponse({"error": OUTSIDE_MEDIA_ROOT}, status_code=403)
        except mmlora.MissingFileError as error:
            return JSONResponse({"error": str(error)}, status_code=404)
        except mmlora.ImageTooLargeError as error:
            return JSONResponse({"error": str(error)}, status_code=413)
        except mmlora.Error as error:
            return JSONResponse({"error": str(error)}, status_code=400)
        return JSONResponse(result)

    def _authorize(self, http: Request) -> None:
        if self.token is None:
            return
        scheme, _, given = http.headers.get("authorization", "").partition(" ")
        # Constant time: how much of a guess matched must not show in how long the reply takes.
        if not (scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), self.token)):
            raise BadRequest(401, UNAUTHORIZED)

    async def _encode(self, http: Request) -> dict:
        """The request's reply. Cancelled at its deadline, which takes the request out of the
        step gathering it (Serve's batcher leaves cancelled requests out of a batch). An adapter
        being read when that happens is read to the end in its thread, and read again by the
        next request that names it."""
        adapter = serve.get_multiplexed_model_id() or None
        image = await read_image(http, self.local_files, self.max_body_bytes)
        if adapter is not None:
            await self.adapter(adapter)
        # Serve's batcher splits a batch by the requests' multiplexed model ids, one model per
        # batch; the engine mixes adapters in one step. So the request joins the batch from an
        # empty context, where it carries no model id (its adapter goes with it).
        batched = contextvars.Context().run(
            asyncio.ensure_future, self.encode_batch((image, adapter))
        )
        result = await batched
        if isinstance(result, Exception):
            raise result
        return result


async def read_body(http: Request, limit: int) -> bytes:
    """The request's body, refused (413) above `limit` bytes: by its declared length before a
    byte is read, else once the bytes read pass the limit. (Serve's replica fetches the body
    from the proxy while this runs, so without :class:`ProxyGuard` in the proxy a replica may
    still hold tens of MiB of a refused body for a moment.)"""
    refused = BadRequest(413, too_large(limit, "max_body_bytes"))
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise refused
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise refused
        chunks.append(chunk)
    return b"".join(chunks)


async def read_image(http: Request, local_files: bool, limit: int) -> bytes | str:
    """The request's image: the uploaded bytes, or the path of a `file://` URL (percent-encoding
    decoded; the engine then checks that it resolves inside the allowed folder)."""
    body = await read_body(http, limit)
    if not http.headers.get("content-type", "").startswith("application/json"):
        if not body:
            raise BadRequest(400, "the body holds no image")
        return body
    try:
        url = json.loads(body)["url"]
    except (ValueError, KeyError, TypeError):
        raise BadRequest(400, 'a JSON body is {"url": "file:///path/to/image"}') from None
    parsed = urlparse(str(url))
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise BadRequest(400, f"`{url}`: only file:// URLs of this machine are fetched")
    if not local_files:
        raise BadRequest(403, NO_LOCAL_FILES)
    return unquote(parsed.path)


class ProxyGuard:
    """ASGI middleware for Serve's HTTP proxy: what it does before and after a replica.

    - A body above `limit` bytes gets 413 there, before any of it reaches a replica, so that
      neither the proxy nor a replica holds more than the limit of it: a declared length
      above the limit is refused before a byte is read, a body without one (chunked) once
      the bytes read pass it. A body within the limit is gathered whole (Serve's proxy
      gathers it anyway), to be sent again if need be.
    - A request whose replica died with it (Serve's proxy then returns without a reply) is
      sent once more, to whichever replica Serve picks; encoding an image twice changes
      nothing, so that is safe. If that fails too, or the replica raised (a bare ``500
      Internal Server Error``), the reply is a 500 that says so in JSON, as every other reply
      is: :data:`REPLICA_FAILED`.

    Serve starts its proxies with the middlewares that :func:`proxy_middlewares` returns when
    each node's Ray is started with ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` set to
    ``app:proxy_middlewares`` (see README.md).
    """

    def __init__(self, app: Any, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and not (declared.isdigit() and int(declared) <= self.limit):
            return await self._answer(too_large(self.limit, PROXY_LIMIT_VARIABLE), 413, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._answer(too_large(self.limit, PROXY_LIMIT_VARIABLE), 413, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        # A replica that died with the request leaves Serve's proxy without a reply: once more.
        for _ in range(2):
            if await self._pass_on(scope, body, receive, send):
                return
        await self._answer(REPLICA_FAILED, 500, send)

    async def _pass_on(self, scope: dict, body: bytes, receive: Any, send: Any) -> bool:
        """Serve's proxy on the request; whether it replied. A bare 500 (the replica raised) is
        replaced by :data:`REPLICA_FAILED`."""
        whole = [{"type": "http.request", "body": body, "more_body": False}]
        started = replaced = False

        async def replay() -> dict:
            return whole.pop() if whole else await receive()

        async def reply(message: dict) -> None:
            nonlocal started, replaced
            if message["type"] == "http.response.start" and message["status"] == 500:
                replaced = True
                await self._answer(REPLICA_FAILED, 500, send)
            elif not replaced:
                await send(message)
            started = True

        # Serve's proxy rewrites the scope it is given (its route prefix): each try gets a copy.
        await self.app({**scope, "headers": list(scope["headers"])}, replay, reply)
        return started

    @staticmethod
    async def _answer(message: str, status: int, send: Any) -> None:
        body = json.dumps({"error": message}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def proxy_middlewares() -> list[Middleware]:
    """What Serve's HTTP proxy applies to every request, given by the import path
    ``app:proxy_middlewares`` in ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``: the body limit
    of ``MMLORA_SERVE_MAX_BODY_BYTES`` bytes (32 MiB where unset), a request whose replica
    died sent once more, and a failure answered in JSON (:class:`ProxyGuard`)."""
    limit = int(os.environ.get(PROXY_LIMIT_VARIABLE, DEFAULT_MAX_BODY_BYTES))
    return [Middleware(ProxyGuard, limit=limit)]


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
    replicas: int = 1,
    cpus_per_replica: int = 1,
    max_queued_requests: int = 256,
    retry_after_s: float = 1.0,
    **options: Any,
) -> serve.Application:
    """The application with `replicas` CPU replicas of `cpus_per_replica` cores each (the
    engine's threads limited to them); `options` go to :class:`Encoder`.

    Each replica takes twice `max_batch_size` requests at a time (one step running, the next
    gathering); Serve's proxy on each node queues up to `max_queued_requests` more, and answers
    any beyond that with 503 and `Retry-After: retry_after_s`. The replicas get this process's
    `MMLORA_SERVE_TOKEN`, where it is set (see README.md for where else to set it).
    """
    env = {"RAYON_NUM_THREADS": str(cpus_per_replica)}
    if os.environ.get(TOKEN_VARIABLE):
        env[TOKEN_VARIABLE] = os.environ[TOKEN_VARIABLE]
    return Encoder.options(
        num_replicas=replicas,
        # Serve's default of 5 requests at a time per replica would cap each step at 5.
        max_ongoing_requests=2 * options.get("max_batch_size", 32),
        max_queued_requests=max_queued_requests,
        backpressure_config={"status_code": 503, "retry_after_s": retry_after_s},
        ray_actor_options={"num_cpus": cpus_per_replica, "runtime_env": {"env_vars": env}},
    ).bind(**options)


#: `serve run app:app`: one replica on the bundled model.
app = deployment()
