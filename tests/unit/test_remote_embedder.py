"""RemoteEmbedder against a real HTTP double (tests/doubles/embedding_server.py)."""

from __future__ import annotations

import socket
import time

import httpx
import numpy as np
import pytest

from doubles.embedding_server import run_embedding_server
from poimen_core.openai_embed import shown_url
from poimen_memory.embedders.base import (
    Embedder,
    EmbeddingUnavailable,
)
from poimen_memory.embedders.factory import build_embedder
from poimen_memory.embedders.remote import (
    RemoteEmbedder,
    known_dim,
    prefixes_for_model,
)
from poimen_memory.errors import ConfigError
from poimen_memory.settings import Settings
from poimen_memory.upstreams.clients import endpoint_candidates

NOMIC = "nomic-ai/nomic-embed-text-v2-moe"
TEXTS = ["alpha beta", "gamma delta", "epsilon zeta eta", "theta", "iota kappa lambda mu"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_documents_are_mapped_back_by_index_when_server_shuffles() -> None:
    with run_embedding_server(shuffle=True) as server:
        embedder = RemoteEmbedder(server.url, NOMIC)
        try:
            vectors = embedder.embed_documents(TEXTS)
        finally:
            embedder.close()
    assert server.requests[0].body["input"] == ["search_document: " + t for t in TEXTS]
    assert vectors.shape == (len(TEXTS), 768)
    assert vectors.dtype == np.float32
    for text, vector in zip(TEXTS, vectors, strict=True):
        np.testing.assert_allclose(vector, server.vector_for(text), atol=1e-6)


def test_base64_responses_are_decoded() -> None:
    with run_embedding_server(force_base64=True, dim=64) as server:
        embedder = RemoteEmbedder(server.url, "custom-model", dim=64)
        try:
            vectors = embedder.embed_documents(TEXTS[:3])
            query = embedder.embed_query("alpha")
        finally:
            embedder.close()
    for text, vector in zip(TEXTS[:3], vectors, strict=True):
        np.testing.assert_allclose(vector, server.vector_for(text), atol=1e-6)
    np.testing.assert_allclose(query, server.vector_for("alpha"), atol=1e-6)


def test_base64_can_be_requested() -> None:
    with run_embedding_server(shuffle=True) as server:
        embedder = RemoteEmbedder(server.url, NOMIC, encoding_format="base64")
        try:
            vectors = embedder.embed_documents(TEXTS)
        finally:
            embedder.close()
    assert server.requests[0].body["encoding_format"] == "base64"
    np.testing.assert_allclose(vectors[2], server.vector_for(TEXTS[2]), atol=1e-6)


@pytest.mark.anyio
async def test_nomic_prefixes_and_request_shape() -> None:
    with run_embedding_server() as server:
        embedder = RemoteEmbedder(server.url + "/v1/embeddings", NOMIC)
        try:
            embedder.embed_documents(["a doc"])
            embedder.embed_query("a sync query")
            await embedder.aembed_query("an async query", timeout=5)
        finally:
            await embedder.aclose()
    bodies = [r.body for r in server.requests]
    assert [r.path for r in server.requests] == ["/v1/embeddings"] * 3
    assert bodies[0] == {"model": NOMIC, "input": ["search_document: a doc"]}
    assert bodies[1]["input"] == ["search_query: a sync query"]
    assert bodies[2]["input"] == ["search_query: an async query"]
    assert "authorization" not in server.requests[0].headers


def test_prefix_table_and_env_overrides() -> None:
    assert prefixes_for_model(NOMIC).query == "search_query: "
    assert prefixes_for_model("nomic-embed-text:latest").document == "search_document: "
    assert prefixes_for_model("intfloat/e5-base-v2").document == "passage: "
    assert prefixes_for_model("intfloat/multilingual-e5-large-instruct").query == ""
    assert prefixes_for_model("BAAI/bge-small-en-v1.5").document == ""
    assert prefixes_for_model("BAAI/bge-small-en-v1.5").query.startswith("Represent")
    assert prefixes_for_model("text-embedding-3-small").query == ""
    env = {
        "POIMEN_EMBEDDINGS_URL": "http://127.0.0.1:9",
        "POIMEN_EMBEDDINGS_QUERY_PREFIX": "",
        "POIMEN_EMBEDDINGS_DOCUMENT_PREFIX": "doc: ",
    }
    embedder = RemoteEmbedder.from_settings(Settings.from_env(env).embedding)
    assert embedder.model_name == NOMIC
    assert (embedder.query_prefix, embedder.document_prefix) == ("", "doc: ")


def test_api_key_is_sent_as_bearer() -> None:
    with run_embedding_server(api_key="s3cret") as server:
        good = RemoteEmbedder(server.url, NOMIC, api_key="s3cret")
        bad = RemoteEmbedder(server.url, NOMIC, max_retries=3, backoff_s=0.01)
        try:
            good.embed_documents(["x"])
            with pytest.raises(EmbeddingUnavailable) as info:
                bad.embed_documents(["x"])
        finally:
            good.close()
            bad.close()
    assert server.requests[0].headers["authorization"] == "Bearer s3cret"
    assert (info.value.reason, info.value.status) == ("http_status", 401)
    assert len(server.requests) == 2  # a 401 is not worth retrying


@pytest.mark.anyio
async def test_query_timeout_fails_fast_without_retry() -> None:
    with run_embedding_server(delay_s=5) as server:
        embedder = RemoteEmbedder(server.url, NOMIC, max_retries=3)
        started = time.monotonic()
        try:
            with pytest.raises(EmbeddingUnavailable) as info:
                await embedder.aembed_query("slow", timeout=0.2)
        finally:
            await embedder.aclose()
        elapsed = time.monotonic() - started
    assert info.value.reason == "timeout"
    assert elapsed < 3.0  # the 0.2 s timeout, not the 5 s delay
    assert len(server.requests) == 1


def test_sync_timeout_is_explicit() -> None:
    with run_embedding_server(delay_s=5) as server:
        embedder = RemoteEmbedder(server.url, NOMIC, timeout_s=0.2, max_retries=1, backoff_s=0.01)
        started = time.monotonic()
        try:
            with pytest.raises(EmbeddingUnavailable) as info:
                embedder.embed_documents(["slow"])
        finally:
            embedder.close()
        elapsed = time.monotonic() - started
    assert info.value.reason == "timeout"
    assert len(server.requests) == 2  # one retry for an ingest batch
    assert elapsed < 4.0  # two 0.2 s attempts, not two 5 s waits


def test_server_errors_are_retried_then_raise() -> None:
    with run_embedding_server(fail_status=500) as server:
        embedder = RemoteEmbedder(server.url, NOMIC, max_retries=2, backoff_s=0.01)
        try:
            with pytest.raises(EmbeddingUnavailable) as info:
                embedder.embed_documents(TEXTS)
        finally:
            embedder.close()
    assert (info.value.reason, info.value.status) == ("http_status", 500)
    assert len(server.requests) == 3


def test_transient_errors_recover_within_retry_budget() -> None:
    with run_embedding_server(fail_status=503, fail_count=2) as server:
        embedder = RemoteEmbedder(server.url, NOMIC, max_retries=3, backoff_s=0.01)
        try:
            vectors = embedder.embed_documents(TEXTS[:2])
        finally:
            embedder.close()
    assert len(server.requests) == 3
    np.testing.assert_allclose(vectors[1], server.vector_for(TEXTS[1]), atol=1e-6)


@pytest.mark.anyio
async def test_query_errors_are_not_retried() -> None:
    with run_embedding_server(fail_status=500) as server:
        embedder = RemoteEmbedder(server.url, NOMIC, max_retries=3, backoff_s=0.01)
        try:
            with pytest.raises(EmbeddingUnavailable):
                await embedder.aembed_query("q", timeout=5)
            with pytest.raises(EmbeddingUnavailable):
                embedder.embed_query("q")
        finally:
            await embedder.aclose()
    assert len(server.requests) == 2


def test_large_ingests_are_split_into_batches() -> None:
    with run_embedding_server(shuffle=True) as server:
        embedder = RemoteEmbedder(server.url, NOMIC, batch_size=2)
        try:
            vectors = embedder.embed_documents(TEXTS)
        finally:
            embedder.close()
    assert [len(r.body["input"]) for r in server.requests] == [2, 2, 1]
    for text, vector in zip(TEXTS, vectors, strict=True):
        np.testing.assert_allclose(vector, server.vector_for(text), atol=1e-6)


@pytest.mark.parametrize(
    ("knobs", "reason"),
    [({"dim": 16}, "bad_response"), ({"malformed": True}, "bad_response")],
)
def test_bad_responses(knobs: dict[str, object], reason: str) -> None:
    with run_embedding_server(**knobs) as server:
        embedder = RemoteEmbedder(server.url, NOMIC, max_retries=0)
        try:
            with pytest.raises(EmbeddingUnavailable) as info:
                embedder.embed_documents(["x"])
        finally:
            embedder.close()
    assert info.value.reason == reason


@pytest.mark.anyio
async def test_unreachable_server() -> None:
    embedder = RemoteEmbedder(f"http://127.0.0.1:{unused_port()}", NOMIC, max_retries=0)
    try:
        with pytest.raises(EmbeddingUnavailable) as info:
            await embedder.aembed_query("q", timeout=2)
        assert info.value.reason == "transport"
        with pytest.raises(EmbeddingUnavailable):
            embedder.embed_documents(["x"])
    finally:
        await embedder.aclose()


@pytest.mark.anyio
async def test_injected_clients_are_used_and_left_open() -> None:
    with run_embedding_server() as server:
        async with httpx.AsyncClient() as shared_async:
            with httpx.Client() as shared_sync:
                embedder = build_embedder(
                    Settings.from_env({"POIMEN_EMBEDDINGS_URL": server.url + "/v1"}).embedding,
                    client=shared_sync,
                    async_client=shared_async,
                )
                assert isinstance(embedder, Embedder)
                await embedder.aembed_query("q", timeout=5)
                embedder.embed_documents(["d"])
                await embedder.aclose()
                assert not shared_async.is_closed
                assert not shared_sync.is_closed
                await embedder.aembed_query("still usable", timeout=5)
    assert len(server.requests) == 3


@pytest.mark.parametrize(
    ("given", "endpoints"),
    [
        ("http://h:8080", ["http://h:8080/v1/embeddings", "http://h:8080/embeddings"]),
        ("http://h:8080/", ["http://h:8080/v1/embeddings", "http://h:8080/embeddings"]),
        ("http://h:8080/v1", ["http://h:8080/v1/embeddings"]),
        ("http://h:8080/v1/embeddings", ["http://h:8080/v1/embeddings"]),
        ("https://h/api/v1/embeddings/", ["https://h/api/v1/embeddings"]),
    ],
)
def test_endpoint_accepts_url_with_or_without_suffix(given: str, endpoints: list[str]) -> None:
    assert endpoint_candidates(given, "embeddings") == endpoints


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://h:8080/v1/embeddings", "http://h:8080/v1/embeddings"),
        ("http://u:p%40ss@h:8080/v1/embeddings", "http://h:8080/v1/embeddings"),
        ("https://token@h/v1/embeddings?key=k#x", "https://h/v1/embeddings"),
    ],
)
def test_a_url_is_shown_without_its_credentials(url: str, shown: str) -> None:
    assert shown_url(url) == shown


@pytest.mark.anyio
async def test_an_unreachable_server_is_named_without_its_password() -> None:
    port = unused_port()
    embedder = RemoteEmbedder(f"http://u:EmbS3cret@127.0.0.1:{port}/", NOMIC, max_retries=0)
    try:
        with pytest.raises(EmbeddingUnavailable) as exc:
            await embedder.aembed_query("x", timeout=2)
    finally:
        await embedder.aclose()
    said = str(exc.value)
    assert "EmbS3cret" not in said and f"127.0.0.1:{port}/v1/embeddings" in said, said


def test_from_env_settings() -> None:
    env = {
        "POIMEN_EMBEDDINGS_URL": "http://127.0.0.1:9/v1/embeddings",
        "POIMEN_EMBEDDINGS_MODEL": "my-model",
        "POIMEN_EMBEDDINGS_DIM": "256",
        "POIMEN_EMBEDDINGS_API_KEY": "k",
        "POIMEN_EMBEDDINGS_TIMEOUT_S": "2.5",
        "POIMEN_EMBEDDINGS_RETRIES": "0",
    }
    embedder = RemoteEmbedder.from_settings(Settings.from_env(env).embedding)
    assert (embedder.model_name, embedder.dim, embedder.timeout_s) == ("my-model", 256, 2.5)
    assert embedder.max_retries == 0
    assert embedder.endpoint == "http://127.0.0.1:9/v1/embeddings"
    assert known_dim(NOMIC) == 768
    with pytest.raises(ConfigError, match="POIMEN_EMBEDDINGS_DIM"):
        RemoteEmbedder.from_settings(
            Settings.from_env(
                {"POIMEN_EMBEDDINGS_URL": "http://h", "POIMEN_EMBEDDINGS_MODEL": "x"}
            ).embedding
        )
    with pytest.raises(ConfigError, match="TIMEOUT"):
        RemoteEmbedder.from_settings(
            Settings.from_env({**env, "POIMEN_EMBEDDINGS_TIMEOUT_S": "0"}).embedding
        )
    with pytest.raises(ConfigError, match="http"):
        RemoteEmbedder.from_settings(
            Settings.from_env({**env, "POIMEN_EMBEDDINGS_URL": "h:8080"}).embedding
        )


@pytest.mark.anyio
async def test_spent_deadline_fails_without_waiting() -> None:
    with run_embedding_server() as server:
        embedder = RemoteEmbedder(server.url, NOMIC)
        try:
            with pytest.raises(EmbeddingUnavailable) as info:
                await embedder.aembed_query("q", timeout=0)
        finally:
            await embedder.aclose()
    assert info.value.reason == "timeout"


@pytest.mark.anyio
async def test_a_base_url_finds_embeddings_served_at_the_root() -> None:
    """Infinity serves /embeddings at its root: the base URL's /v1 guess 404s once, then
    the root path is kept for every later call."""
    with run_embedding_server(root_only=True) as server:
        embedder = RemoteEmbedder(server.url, NOMIC)
        try:
            embedder.embed_documents(["a doc"])
            await embedder.aembed_query("a query", timeout=5)
            embedder.embed_query("another")
        finally:
            await embedder.aclose()
    paths = [r.path for r in server.requests]
    assert paths == ["/v1/embeddings", "/embeddings", "/embeddings", "/embeddings"]
    assert embedder.endpoint == server.url + "/embeddings"


def test_a_full_endpoint_is_used_as_given_and_errors_name_it() -> None:
    with run_embedding_server(root_only=True) as server:
        embedder = RemoteEmbedder(server.url + "/v1/embeddings", NOMIC, max_retries=0)
        try:
            with pytest.raises(EmbeddingUnavailable) as info:
                embedder.embed_documents(["a doc"])
        finally:
            embedder.close()
    assert info.value.status == 404
    assert f"{server.url}/v1/embeddings answered 404" in str(info.value)
