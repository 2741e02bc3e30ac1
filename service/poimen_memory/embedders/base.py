"""The embedder interface shared by the local (ONNX) and remote (HTTP) embedders.

This module knows no implementation (local.py and remote.py import it, never the other
way round; factory.py picks one). Everything the service needs goes through `Embedder`:
vectors are float32 and L2-normalised, documents and queries may be embedded
differently (prefixes), and every failure to produce a vector surfaces as
`EmbeddingUnavailable`, which the service maps to 503
``{"error": "embedding_service_unavailable"}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from poimen_core.minilm import l2_normalise
from poimen_memory.errors import EmbeddingModelError, EmbeddingUnavailable

# When (time.monotonic()) the documents of the write being served must be embedded by; None:
# only each call's own timeouts. Set around an HTTP write (api/operations.py) and read by an
# embedder that retries (remote.py): a hung server then holds an ingest slot this long at
# most, not attempts x timeout (42.5 s before).
WRITE_DEADLINE: ContextVar[float | None] = ContextVar("write_deadline", default=None)

__all__ = [
    "Embedder",
    "EmbeddingModelError",
    "EmbeddingUnavailable",
    "Vector",
    "Vectors",
    "l2_normalise",
]

Vector = npt.NDArray[np.float32]
"""One embedding, shape ``(dim,)``."""
Vectors = npt.NDArray[np.float32]
"""A batch of embeddings, shape ``(n, dim)``."""


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
