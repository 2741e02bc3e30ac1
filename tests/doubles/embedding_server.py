"""A real OpenAI-compatible embedding server for tests, run by uvicorn in a thread.

Vectors are hashed bags of words (each lower-cased word adds ±1 to one of
``dim`` buckets, then L2 normalisation), so they are deterministic and texts
sharing words are closer than texts that share none: good enough for
retrieval tests without a model. Knobs on `EmbeddingServerKnobs` inject
delay, failures, shuffled output, base64 output and an API-key check; they can
be changed while the server runs. Every request is logged.

    with run_embedding_server(dim=768, shuffle=True) as server:
        embedder = RemoteEmbedder(server.url, dim=768)
        ...
        assert server.requests[0].body["input"] == [...]

`ThreadedApp` is the reusable part (also used by the rerank double).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import random
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

__all__ = [
    "EmbeddingServer",
    "EmbeddingServerKnobs",
    "LoggedRequest",
    "ThreadedApp",
    "hashed_bow_vector",
    "interruptible_sleep",
    "log_request",
    "run_embedding_server",
]

NOMIC_PREFIXES = ("search_query: ", "search_document: ")


@dataclass
class LoggedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    """Parsed JSON, or the raw text when the body was not JSON."""
    received_at: float


class ThreadedApp:
    """Runs an ASGI app with uvicorn on 127.0.0.1 (free port) in a daemon thread."""

    def __init__(self, app: ASGIApp, closing: threading.Event) -> None:
        self.closing = closing
        """Set on stop so handlers that are delaying (`interruptible_sleep`) give up at once."""
        # Binding here, before the thread starts, gives a known port with no race.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            loop="asyncio",
            http="h11",
            ws="none",
            lifespan="off",
            log_config=None,  # leave the test process's logging alone
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self, timeout: float = 10.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("test HTTP server thread died during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError("test HTTP server did not start in time")
            time.sleep(0.01)

    def stop(self) -> None:
        self.closing.set()
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


async def interruptible_sleep(seconds: float, closing: threading.Event) -> None:
    """Sleep up to ``seconds``, cut short when the server is stopping.

    A plain sleep would hold uvicorn's graceful shutdown for the whole delay
    after a client has already timed out and left.
    """
    deadline = time.monotonic() + seconds
    while not closing.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        await asyncio.sleep(min(remaining, 0.02))


async def log_request(request: Request, log: list[LoggedRequest]) -> Any:
    raw = await request.body()
    body: Any
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = raw.decode("utf-8", "replace")
    log.append(
        LoggedRequest(
            method=request.method,
            path=request.url.path,
            headers={k.lower(): v for k, v in request.headers.items()},
            body=body,
            received_at=time.monotonic(),
        )
    )
    return body


def hashed_bow_vector(text: str, dim: int) -> npt.NDArray[np.float32]:
    """The double's embedding of ``text``: hashed bag of words, L2-normalised."""
    vector = np.zeros(dim, dtype=np.float32)
    for word in re.findall(r"\w+", text.lower()):
        digest = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
        vector[digest % dim] += 1.0 if (digest >> 63) & 1 else -1.0
    norm = float(np.linalg.norm(vector))
    if norm == 0.0:
        vector[0] = 1.0  # empty text still gets a valid unit vector
        return vector
    return vector / np.float32(norm)


@dataclass
class EmbeddingServerKnobs:
    dim: int = 768
    delay_s: float = 0.0
    """Wait this long before answering (each request)."""
    fail_status: int | None = None
    """Answer with this HTTP status instead of embeddings..."""
    fail_count: int | None = None
    """...for this many requests, then recover (None: every request)."""
    malformed: bool = False
    """Answer 200 with a body that is not an embeddings response."""
    shuffle: bool = False
    """Return ``data`` in a random order (``index`` stays correct)."""
    force_base64: bool = False
    """Answer base64 float32 even when the request did not ask for it."""
    api_key: str | None = None
    """When set, requests without ``Authorization: Bearer <api_key>`` get 401."""
    strip_prefixes: tuple[str, ...] = NOMIC_PREFIXES
    """Instruction prefixes ignored when computing vectors, so query and document
    vectors of the same words agree (the log still shows the raw input)."""
    seed: int = 0
    root_only: bool = False
    """Serve only ``/embeddings`` at the root, as Infinity does (``/v1/embeddings`` 404s)."""


@dataclass
class EmbeddingServer:
    knobs: EmbeddingServerKnobs
    url: str = ""
    """Base URL, e.g. ``http://127.0.0.1:43123``."""
    requests: list[LoggedRequest] = field(default_factory=list)
    failures_served: int = 0
    closing: threading.Event = field(default_factory=threading.Event)
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self.rng.seed(self.knobs.seed)

    def reset(self, **knobs: Any) -> None:
        """Replace all knobs (unnamed ones back to defaults) and forget the request log.

        Lets a module-scoped server serve many tests; requests in flight keep
        the knobs they started with.
        """
        self.knobs = EmbeddingServerKnobs(**knobs)
        self.requests.clear()
        self.failures_served = 0
        self.rng.seed(self.knobs.seed)

    @property
    def endpoint(self) -> str:
        return self.url + "/v1/embeddings"

    @property
    def embedding_requests(self) -> list[LoggedRequest]:
        return [r for r in self.requests if r.path.endswith("/embeddings")]

    def vector_for(self, text: str) -> npt.NDArray[np.float32]:
        """What this server returns for ``text`` (after stripping known prefixes)."""
        for prefix in self.knobs.strip_prefixes:
            if text.startswith(prefix):
                text = text[len(prefix) :]
                break
        return hashed_bow_vector(text, self.knobs.dim)


def _build_app(state: EmbeddingServer) -> Starlette:
    async def embeddings(request: Request) -> Response:
        body = await log_request(request, state.requests)
        knobs = state.knobs
        if knobs.root_only and request.url.path.startswith("/v1/"):
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        if knobs.delay_s > 0:
            await interruptible_sleep(knobs.delay_s, state.closing)
        if knobs.api_key is not None and (
            request.headers.get("authorization") != f"Bearer {knobs.api_key}"
        ):
            return JSONResponse({"error": {"message": "invalid api key"}}, status_code=401)
        if knobs.fail_status is not None and (
            knobs.fail_count is None or state.failures_served < knobs.fail_count
        ):
            state.failures_served += 1
            return JSONResponse(
                {"error": {"message": "injected failure"}}, status_code=knobs.fail_status
            )
        if knobs.malformed:
            return PlainTextResponse("<html>not json</html>")
        if not isinstance(body, dict) or "input" not in body:
            return JSONResponse({"error": {"message": "missing input"}}, status_code=400)
        inputs = body["input"]
        if isinstance(inputs, str):
            inputs = [inputs]
        as_base64 = knobs.force_base64 or body.get("encoding_format") == "base64"
        data: list[dict[str, Any]] = []
        for index, text in enumerate(inputs):
            vector = state.vector_for(str(text))
            embedding: Any = (
                base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
                if as_base64
                else [float(x) for x in vector]
            )
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        if knobs.shuffle:
            state.rng.shuffle(data)
            if len(data) > 1 and [d["index"] for d in data] == list(range(len(data))):
                data.reverse()  # a shuffle test must never get the identity order
        tokens = sum(len(str(t).split()) for t in inputs)
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": body.get("model"),
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def not_found(request: Request) -> Response:
        await log_request(request, state.requests)
        return JSONResponse({"error": "not found"}, status_code=404)

    return Starlette(
        routes=[
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/embeddings", embeddings, methods=["POST"]),
            Route("/{path:path}", not_found, methods=["GET", "POST"]),
        ]
    )


@contextmanager
def run_embedding_server(**knobs: Any) -> Iterator[EmbeddingServer]:
    """Start the double with `EmbeddingServerKnobs` fields as keyword arguments."""
    state = EmbeddingServer(knobs=EmbeddingServerKnobs(**knobs))
    server = ThreadedApp(_build_app(state), state.closing)
    server.start()
    state.url = server.url
    try:
        yield state
    finally:
        server.stop()
