"""An embedder that calls an OpenAI-compatible ``POST /v1/embeddings`` server.

Works with OpenAI, vLLM, TEI, llama.cpp, Infinity, LocalAI and the like:
request ``{"model", "input": [...]}``, response ``{"data": [{"index",
"embedding"}]}`` where ``embedding`` is a float list or, with
``encoding_format: base64``, little-endian float32 bytes in base64.

Ingest batches (`embed_documents`) are retried with exponential backoff on
timeouts, transport errors, 408, 429 and 5xx; query embeddings are not, because
the caller's deadline is shorter than any useful retry.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import random
import time
from collections.abc import Sequence
from typing import Any, Literal

import httpx
import numpy as np

# The prefixes are poimen_core's so that memory.embed adds the same ones inside PostgreSQL.
from poimen_core.openai_embed import (
    MODEL_PREFIXES,
    ModelPrefixes,
    decode_embedding,
    prefixes_for_model,
    shown_url,
)
from poimen_memory.embedders.base import (
    WRITE_DEADLINE,
    EmbeddingUnavailable,
    Vector,
    Vectors,
    l2_normalise,
)
from poimen_memory.errors import ConfigError
from poimen_memory.settings import EmbeddingSettings
from poimen_memory.upstreams.clients import (
    UpstreamClients,
    endpoint_candidates,
    fallback_endpoint,
    raise_for_status,
)

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_REMOTE_MODEL",
    "KNOWN_MODEL_DIMS",
    "MODEL_PREFIXES",
    "ModelPrefixes",
    "RemoteEmbedder",
    "known_dim",
    "prefixes_for_model",
]

DEFAULT_REMOTE_MODEL = "nomic-ai/nomic-embed-text-v2-moe"

_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


KNOWN_MODEL_DIMS: tuple[tuple[str, int], ...] = (
    ("*nomic-embed-text*", 768),
    ("*all-minilm-l6-v2*", 384),
    ("*bge-small-*", 384),
    ("*bge-base-*", 768),
    ("*bge-large-*", 1024),
    ("*bge-m3*", 1024),
    ("*e5-small*", 384),
    ("*e5-base*", 768),
    ("*e5-large*", 1024),
    ("*mxbai-embed-large*", 1024),
    ("text-embedding-3-small", 1536),
    ("text-embedding-3-large", 3072),
    ("text-embedding-ada-002", 1536),
)
"""Output sizes of common models, so ``POIMEN_EMBEDDINGS_DIM`` is only needed for others."""


def known_dim(model: str) -> int | None:
    name = model.lower()
    for pattern, dim in KNOWN_MODEL_DIMS:
        if fnmatch.fnmatchcase(name, pattern):
            return dim
    return None


class RemoteEmbedder:
    """Embeddings from an OpenAI-compatible HTTP server.

    ``client``/``async_client`` may be shared clients owned by the caller; they
    are then never closed here. Otherwise clients are created on first use
    and closed by `close`/`aclose`.
    """

    def __init__(
        self,
        url: str,
        model: str = DEFAULT_REMOTE_MODEL,
        *,
        api_key: str | None = None,
        dim: int | None = None,
        query_prefix: str | None = None,
        document_prefix: str | None = None,
        timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        batch_size: int = 64,
        encoding_format: Literal["float", "base64"] | None = None,
        client: httpx.Client | None = None,
        async_client: httpx.AsyncClient | None = None,
    ) -> None:
        self._endpoints = endpoint_candidates(url, "embeddings")
        self.endpoint = self._endpoints[0]
        self.model_name = model
        resolved_dim = dim if dim is not None else known_dim(model)
        if resolved_dim is None:
            raise ConfigError(
                f"unknown output size for embedding model {model!r}: set POIMEN_EMBEDDINGS_DIM"
            )
        if resolved_dim < 1:
            raise ConfigError("embedding dim must be >= 1")
        self.dim = resolved_dim
        defaults = prefixes_for_model(model)
        self.query_prefix = defaults.query if query_prefix is None else query_prefix
        self.document_prefix = defaults.document if document_prefix is None else document_prefix
        if timeout_s <= 0 or batch_size < 1 or max_retries < 0 or backoff_s < 0:
            raise ValueError("timeout_s > 0, batch_size >= 1, max_retries >= 0, backoff_s >= 0")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.batch_size = batch_size
        self.encoding_format = encoding_format
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._clients = UpstreamClients(client, async_client)

    @classmethod
    def from_settings(
        cls,
        settings: EmbeddingSettings,
        *,
        client: httpx.Client | None = None,
        async_client: httpx.AsyncClient | None = None,
    ) -> RemoteEmbedder:
        if settings.url is None:
            raise ConfigError("POIMEN_EMBEDDINGS_URL is not set")
        encoding: Literal["float", "base64"] | None = (
            "base64" if settings.encoding == "base64" else "float" if settings.encoding else None
        )
        return cls(
            settings.url,
            settings.model or DEFAULT_REMOTE_MODEL,
            api_key=settings.api_key,
            dim=settings.dim,
            query_prefix=settings.query_prefix,
            document_prefix=settings.document_prefix,
            timeout_s=settings.timeout_s,
            max_retries=settings.retries,
            batch_size=settings.remote_batch_size,
            encoding_format=encoding,
            client=client,
            async_client=async_client,
        )

    # -- public API -------------------------------------------------------

    def embed_documents(self, texts: Sequence[str]) -> Vectors:
        if isinstance(texts, str):
            raise TypeError("embed_documents takes a sequence of texts, not one str")
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for start in range(0, len(texts), self.batch_size):
            batch = [self.document_prefix + t for t in texts[start : start + self.batch_size]]
            out[start : start + len(batch)] = self._post_with_retries(batch)
        return out

    def embed_query(self, text: str) -> Vector:
        vectors = self._post_once(self._clients.sync(), [self.query_prefix + text], self.timeout_s)
        first: Vector = vectors[0]
        return first

    async def aembed_query(self, text: str, timeout: float) -> Vector:
        payload = self._payload([self.query_prefix + text])
        client = self._clients.async_()
        try:
            # httpx timeouts bound each phase; the outer one bounds the whole call,
            # so a server that trickles bytes cannot overrun the deadline.
            async with asyncio.timeout(timeout):
                response = await client.post(
                    self.endpoint, json=payload, headers=self._headers, timeout=timeout
                )
                if self._next_endpoint(response):
                    response = await client.post(
                        self.endpoint, json=payload, headers=self._headers, timeout=timeout
                    )
        except (TimeoutError, httpx.HTTPError) as exc:
            raise self._transport_error(exc, timeout) from exc
        first: Vector = self._parse(response, 1)[0]
        return first

    def close(self) -> None:
        self._clients.close()

    async def aclose(self) -> None:
        await self._clients.aclose()

    # -- internals --------------------------------------------------------

    def _payload(self, inputs: list[str]) -> dict[str, Any]:
        payload: dict[str, Any] = {"model": self.model_name, "input": inputs}
        if self.encoding_format is not None:
            payload["encoding_format"] = self.encoding_format
        return payload

    def _post_once(self, client: httpx.Client, inputs: list[str], timeout: float) -> Vectors:
        try:
            response = client.post(
                self.endpoint, json=self._payload(inputs), headers=self._headers, timeout=timeout
            )
            if self._next_endpoint(response):
                response = client.post(
                    self.endpoint, json=self._payload(inputs), headers=self._headers,
                    timeout=timeout,
                )  # fmt: skip
        except httpx.HTTPError as exc:
            raise self._transport_error(exc, timeout) from exc
        return self._parse(response, len(inputs))

    def _next_endpoint(self, response: httpx.Response) -> bool:
        """On a 404 from a guessed path, move to the next candidate (and keep it)."""
        following = fallback_endpoint(self._endpoints, self.endpoint, response, "embedding server")
        if following is None:
            return False
        self.endpoint = following
        return True

    def _transport_error(self, exc: Exception, timeout: float) -> EmbeddingUnavailable:
        """No HTTP answer at all: a timeout, or a refused/reset/unresolvable connection."""
        if isinstance(exc, TimeoutError | httpx.TimeoutException):
            return EmbeddingUnavailable(
                f"embedding server {shown_url(self.endpoint)} did not answer within {timeout:.3g}s",
                reason="timeout",
            )
        return EmbeddingUnavailable(
            f"embedding server {shown_url(self.endpoint)} unreachable: {exc!r}", reason="transport"
        )

    def _post_with_retries(self, inputs: list[str]) -> Vectors:
        client = self._clients.sync()
        attempt = 0
        deadline = WRITE_DEADLINE.get()
        while True:
            timeout = self.timeout_s
            if deadline is not None:
                timeout = min(timeout, deadline - time.monotonic())
                if timeout <= 0:
                    raise EmbeddingUnavailable(
                        f"embedding server {shown_url(self.endpoint)}: the write's time "
                        "(POIMEN_INGEST_TIMEOUT_S) ran out",
                        reason="timeout",
                    )
            try:
                return self._post_once(client, inputs, timeout)
            except EmbeddingUnavailable as exc:
                retryable = exc.reason in ("timeout", "transport") or (
                    exc.reason == "http_status" and exc.status in _RETRYABLE_STATUS
                )
                if not retryable or attempt >= self.max_retries:
                    raise
                reason = exc.tag
                # Full jitter keeps several ingest workers from retrying in lockstep.
                pause = random.uniform(0, self.backoff_s * (2**attempt))
                if deadline is not None and time.monotonic() + pause >= deadline:
                    raise  # no time left for another attempt
            log.warning(
                "embedding request failed (%s), retry %d of %d in %.2fs",
                reason, attempt + 1, self.max_retries, pause,
            )  # fmt: skip
            time.sleep(pause)
            attempt += 1

    def _parse(self, response: httpx.Response, expected: int) -> Vectors:
        raise_for_status(EmbeddingUnavailable, "embedding server", self.endpoint, response)
        try:
            body = response.json()
            items = body["data"]
            if not isinstance(items, list) or len(items) != expected:
                raise ValueError(f"expected {expected} embeddings, got {len(items)}")
            out = np.empty((expected, self.dim), dtype=np.float32)
            seen: set[int] = set()
            for position, item in enumerate(items):
                # Servers may answer out of order; `index` says which input a row is.
                index = item.get("index", position)
                if not isinstance(index, int) or not 0 <= index < expected or index in seen:
                    raise ValueError(f"bad or duplicate index {index!r}")
                seen.add(index)
                out[index] = self._decode(item["embedding"])
        except EmbeddingUnavailable:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise EmbeddingUnavailable(
                f"malformed embedding response: {exc}", reason="bad_response"
            ) from exc
        return l2_normalise(out)

    def _decode(self, embedding: object) -> Vector:
        vector = np.asarray(decode_embedding(embedding), dtype=np.float32)
        if vector.shape != (self.dim,):
            raise EmbeddingUnavailable(
                f"embedding server returned {vector.shape[0] if vector.ndim else 0} dims, "
                f"expected {self.dim} (check POIMEN_EMBEDDINGS_DIM / POIMEN_EMBEDDINGS_MODEL)",
                reason="bad_response",
            )
        if not np.all(np.isfinite(vector)):
            raise ValueError("embedding contains NaN or infinity")
        return vector
