"""The local int8 ONNX embedder against sentence-transformers' fp32 reference vectors.

data/minilm_reference.json was produced once, outside the project venv, by
sentence-transformers running the original all-MiniLM-L6-v2 weights (its
``provenance`` says exactly how); int8 weights move vectors slightly, hence
cosine >= 0.99 rather than equality.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from poimen_memory.embedders.base import (
    Embedder,
    EmbeddingModelError,
    EmbeddingUnavailable,
)
from poimen_memory.embedders.factory import build_embedder
from poimen_memory.embedders.local import (
    LOCAL_DIM,
    LOCAL_MODEL_NAME,
    TOKENIZER_SHA256,
    LocalEmbedder,
    default_tokenizer_path,
    sha256_file,
)
from poimen_memory.embedders.remote import RemoteEmbedder
from poimen_memory.errors import ConfigError
from poimen_memory.settings import Settings

REFERENCE: dict[str, Any] = json.loads(
    (Path(__file__).parent / "data" / "minilm_reference.json").read_text()
)
TEXTS: dict[str, str] = REFERENCE["texts"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def embedder() -> Iterator[LocalEmbedder]:
    embedder = LocalEmbedder()
    embedder.load()
    yield embedder
    embedder.close()


def reference(key: str) -> np.ndarray[Any, np.dtype[np.float64]]:
    vector = np.asarray(REFERENCE["vectors"][key], dtype=np.float64)
    return vector / np.linalg.norm(vector)


def cosine(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_is_an_embedder(embedder: LocalEmbedder) -> None:
    assert isinstance(embedder, Embedder)
    assert embedder.model_name == LOCAL_MODEL_NAME
    assert embedder.dim == LOCAL_DIM == 384


@pytest.mark.parametrize("key", sorted(TEXTS))
def test_agrees_with_sentence_transformers_reference(embedder: LocalEmbedder, key: str) -> None:
    vector = embedder.embed_query(TEXTS[key])
    assert vector.dtype == np.float32
    assert vector.shape == (384,)
    assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
    assert cosine(vector, reference(key)) >= 0.99


def test_batch_agrees_with_reference_and_keeps_input_order(embedder: LocalEmbedder) -> None:
    keys = sorted(TEXTS)
    vectors = embedder.embed_documents([TEXTS[k] for k in keys])
    assert vectors.shape == (len(keys), 384)
    assert vectors.dtype == np.float32
    for key, vector in zip(keys, vectors, strict=True):
        assert cosine(vector, reference(key)) >= 0.99


def test_truncates_at_256_tokens_like_the_reference(embedder: LocalEmbedder) -> None:
    # The long text changes topic after ~130 tokens, so where it is cut shows.
    assert REFERENCE["token_counts_untruncated"]["long_truncated"] > 256
    assert REFERENCE["provenance"]["max_seq_length"] == 256
    text = TEXTS["long_truncated"]
    assert cosine(embedder.embed_query(text), reference("long_truncated")) >= 0.99
    cut_at_128 = LocalEmbedder(max_tokens=128)
    try:
        assert cosine(cut_at_128.embed_query(text), reference("long_truncated")) < 0.98
    finally:
        cut_at_128.close()


def test_paraphrase_scores_above_unrelated_sentence(embedder: LocalEmbedder) -> None:
    cat, paraphrase, unrelated = embedder.embed_documents(
        [TEXTS["cat"], TEXTS["cat_paraphrase"], TEXTS["unrelated"]]
    )
    assert float(cat @ paraphrase) > 0.6
    assert float(cat @ paraphrase) > float(cat @ unrelated) + 0.4


def test_chunked_batches_match_single_runs(embedder: LocalEmbedder) -> None:
    texts = [TEXTS[k] for k in sorted(TEXTS)] + ["short", "", "a slightly longer sentence here"]
    small_chunks = LocalEmbedder(batch_size=2)
    try:
        batched = small_chunks.embed_documents(texts)
    finally:
        small_chunks.close()
    singles = np.stack([embedder.embed_query(t) for t in texts])
    np.testing.assert_allclose(batched, singles, atol=1e-5)


def test_empty_batch_and_str_misuse(embedder: LocalEmbedder) -> None:
    assert embedder.embed_documents([]).shape == (0, 384)
    with pytest.raises(TypeError):
        embedder.embed_documents("not a list")


def test_session_threading_is_set_deliberately() -> None:
    embedder = LocalEmbedder(threads=1)
    embedder.load()
    try:
        assert embedder._model is not None
        options = embedder._model.session.get_session_options()
        assert options.intra_op_num_threads == 1
        assert options.inter_op_num_threads == 1
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
        assert embedder.load_seconds is not None and embedder.load_seconds > 0
    finally:
        embedder.close()


def test_shipped_tokenizer_matches_pinned_sha256() -> None:
    assert sha256_file(default_tokenizer_path()) == TOKENIZER_SHA256


def test_tampered_tokenizer_is_refused(tmp_path: Path) -> None:
    tampered = tmp_path / "tokenizer.json"
    shutil.copy(default_tokenizer_path(), tampered)
    with tampered.open("ab") as fh:
        fh.write(b" ")
    embedder = LocalEmbedder(tokenizer_path=tampered)
    with pytest.raises(EmbeddingModelError, match="sha256"):
        embedder.load()
    assert not embedder.loaded


def test_missing_model_file_is_a_clear_error(tmp_path: Path) -> None:
    embedder = LocalEmbedder(model_path=tmp_path / "nope.onnx")
    with pytest.raises(EmbeddingModelError, match="not found") as info:
        embedder.embed_query("x")
    # Still an EmbeddingUnavailable, so a request that hits it maps to 503.
    assert isinstance(info.value, EmbeddingUnavailable)


@pytest.mark.anyio
async def test_aembed_query_matches_sync(embedder: LocalEmbedder) -> None:
    vector = await embedder.aembed_query(TEXTS["question"], timeout=10)
    np.testing.assert_allclose(vector, embedder.embed_query(TEXTS["question"]), atol=1e-6)


@pytest.mark.anyio
async def test_aembed_query_deadline(embedder: LocalEmbedder) -> None:
    with pytest.raises(EmbeddingUnavailable) as info:
        await embedder.aembed_query(TEXTS["long_truncated"], timeout=1e-9)
    assert info.value.reason == "timeout"


def test_from_env_and_factory() -> None:
    local = build_embedder(
        Settings.from_env({"POIMEN_EMBED_THREADS": "1", "POIMEN_EMBED_BATCH_SIZE": "8"}).embedding
    )
    assert isinstance(local, LocalEmbedder)
    assert (local.threads, local.batch_size, local.loaded) == (1, 8, False)
    remote = build_embedder(
        Settings.from_env({"POIMEN_EMBEDDINGS_URL": "http://127.0.0.1:9"}).embedding
    )
    assert isinstance(remote, RemoteEmbedder)
    with pytest.raises(ConfigError, match="POIMEN_EMBED_THREADS"):
        build_embedder(Settings.from_env({"POIMEN_EMBED_THREADS": "many"}).embedding)
    with pytest.raises(ConfigError, match="POIMEN_EMBED_BATCH_SIZE"):
        build_embedder(Settings.from_env({"POIMEN_EMBED_BATCH_SIZE": "0"}).embedding)


def test_a_short_run_takes_one_thread_and_the_same_vector() -> None:
    """A run of fewer tokens than POIMEN_EMBED_PARALLEL_MIN_TOKENS (texts x padded length)
    goes to a one-thread session: for a question the second thread cost 1.5x the CPU for
    3% of the time (poimen_core.minilm). Both sessions hold the same weights, so the vector
    does not depend on which one ran it."""
    settings = Settings.from_env(
        {"POIMEN_EMBED_THREADS": "2", "POIMEN_EMBED_PARALLEL_MIN_TOKENS": "12"}
    ).embedding
    assert settings.parallel_min_tokens == 12
    embedder = build_embedder(settings)
    assert isinstance(embedder, LocalEmbedder)
    try:
        embedder.load()
        model = embedder._loaded()

        def threads(session: Any) -> int:
            return int(session.get_session_options().intra_op_num_threads)

        assert (threads(model._single), threads(model._session)) == (1, 2)
        # which session each run went to: the real ones, counted
        ran: list[int] = []
        for session in (model._single, model._session):
            original = session.run

            def counted(*args: Any, _o: Any = original, _s: Any = session) -> Any:
                ran.append(threads(_s))
                return _o(*args)

            session.run = counted
        short = "What did Caroline research?"
        assert len(model.encode([short])[0]) < 12
        one = embedder.embed_query(short)
        embedder.embed_documents([short, short])  # two texts: past 12 tokens in all
        embedder.embed_query(TEXTS["long_truncated"])
        assert ran == [1, 2, 2]
        # the same weights: the parallel session gives the short text the same vector
        two = model.run(model.encode([short]) * 2)[0]
        assert float(np.dot(one, two)) > 0.99999
    finally:
        embedder.close()
    # 0: every run shares the threads, one session; one thread: one session anyway
    for env in ({"POIMEN_EMBED_PARALLEL_MIN_TOKENS": "0"}, {"POIMEN_EMBED_THREADS": "1"}):
        other = build_embedder(Settings.from_env({"POIMEN_EMBED_THREADS": "2", **env}).embedding)
        assert isinstance(other, LocalEmbedder)
        other.load()
        m = other._loaded()
        assert m.session_for(1) is m.session_for(10_000)
        other.close()
    with pytest.raises(ConfigError, match="POIMEN_EMBED_PARALLEL_MIN_TOKENS"):
        Settings.from_env({"POIMEN_EMBED_PARALLEL_MIN_TOKENS": "-1"})
    with pytest.raises(ValueError, match="parallel_min_tokens"):
        LocalEmbedder(parallel_min_tokens=-1)
