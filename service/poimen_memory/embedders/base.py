"""The embedder interface shared by the local (ONNX) and remote (HTTP) embedders.

Everything the service needs to know about embeddings goes through `Embedder`:
vectors are float32 and L2-normalised, documents and queries may be embedded
differently (prefixes), and every failure to produce a vector surfaces as
`EmbeddingUnavailable`, which the service maps to 503
``{"error": "embedding_service_unavailable"}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import httpx

__all__ = [
    "Embedder",
    "EmbeddingConfigError",
    "EmbeddingModelError",
    "EmbeddingUnavailable",
    "Vector",
    "Vectors",
    "embedder_from_env",
    "env_float",
    "env_int",
    "env_str",
    "l2_normalise",
]

Vector = npt.NDArray[np.float32]
"""One embedding, shape ``(dim,)``."""
Vectors = npt.NDArray[np.float32]
"""A batch of embeddings, shape ``(n, dim)``."""


class EmbeddingUnavailable(Exception):
    """No vector could be produced (timeout, upstream error, bad response, model problem).

    ``reason`` is a short machine-readable tag (``timeout``, ``http_status``,
    ``transport``, ``bad_response``, ``model``) for logs and metrics, and
    ``status`` the upstream HTTP status when there was one; the message is for
    humans.
    """

    def __init__(
        self, message: str, *, reason: str = "unavailable", status: int | None = None
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


class EmbeddingModelError(EmbeddingUnavailable):
    """The local model or tokenizer file is missing or fails its sha256 check.

    A subclass of `EmbeddingUnavailable` so a request that hits it still gets a
    503 rather than a 500, but it is permanent: the service should load the
    embedder at start-up (`LocalEmbedder.load`) and refuse to start instead.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="model")


class EmbeddingConfigError(ValueError):
    """An embedding or rerank environment variable has an unusable value."""


@runtime_checkable
class Embedder(Protocol):
    """What the service calls to turn text into vectors.

    Vectors are float32 and L2-normalised so inner product equals cosine.
    """

    @property
    def model_name(self) -> str:
        """Identifies the vector space; stored with vectors and used as a cache key."""
        ...

    @property
    def dim(self) -> int: ...

    def embed_documents(self, texts: Sequence[str]) -> Vectors:
        """Embed passages for storage; shape ``(len(texts), dim)``, input order kept."""
        ...

    def embed_query(self, text: str) -> Vector:
        """Embed one search query; shape ``(dim,)``."""
        ...

    async def aembed_query(self, text: str, timeout: float) -> Vector:
        """Embed one search query within ``timeout`` seconds or raise `EmbeddingUnavailable`."""
        ...

    def close(self) -> None: ...

    async def aclose(self) -> None: ...


def l2_normalise(vectors: npt.NDArray[np.floating]) -> Vectors:
    """Row-wise L2 normalisation; all-zero rows stay zero instead of becoming NaN."""
    out = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(out, axis=-1, keepdims=True)
    return np.asarray(out / np.maximum(norms, np.float32(1e-12)), dtype=np.float32)


def env_str(env: Mapping[str, str], name: str) -> str | None:
    """The variable's value with surrounding blanks removed, or None when unset or blank."""
    value = env.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def env_int(env: Mapping[str, str], name: str, default: int, *, minimum: int = 0) -> int:
    raw = env_str(env, name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise EmbeddingConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise EmbeddingConfigError(f"{name}={value} must be >= {minimum}")
    return value


def env_float(env: Mapping[str, str], name: str, default: float, *, above: float = 0.0) -> float:
    raw = env_str(env, name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise EmbeddingConfigError(f"{name}={raw!r} is not a number") from None
    # `not (value > minimum)` also rejects NaN.
    if not value > above:
        raise EmbeddingConfigError(f"{name}={value} must be > {above}")
    return value


def embedder_from_env(
    env: Mapping[str, str],
    *,
    client: httpx.Client | None = None,
    async_client: httpx.AsyncClient | None = None,
) -> Embedder:
    """The remote embedder when ``POIMEN_EMBEDDINGS_URL`` is set, else the local ONNX one.

    ``client``/``async_client`` are shared httpx clients owned by the caller
    (the service's lifespan); the remote embedder never closes them. The local
    embedder ignores them. Nothing is loaded or contacted here.
    """
    # Imported here so a remote-only deployment never imports onnxruntime and
    # a local one never needs the remote module's settings.
    if env_str(env, "POIMEN_EMBEDDINGS_URL") is not None:
        from poimen_memory.embedders.remote import RemoteEmbedder

        return RemoteEmbedder.from_env(env, client=client, async_client=async_client)
    from poimen_memory.embedders.local import LocalEmbedder

    return LocalEmbedder.from_env(env)
