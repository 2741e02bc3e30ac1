"""QueryEmbeddingCache: LRU bookkeeping, and no upstream call for a repeated query."""

from __future__ import annotations

import numpy as np
import pytest

from doubles.embedding_server import run_embedding_server
from poimen_memory.embedders.cache import QueryEmbeddingCache
from poimen_memory.embedders.remote import RemoteEmbedder
from poimen_memory.errors import ConfigError, EmbeddingUnavailable
from poimen_memory.settings import Settings

NOMIC = "nomic-ai/nomic-embed-text-v2-moe"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def vec(value: float) -> np.ndarray[tuple[int], np.dtype[np.float32]]:
    return np.full(4, value, dtype=np.float32)


@pytest.mark.anyio
async def test_second_identical_query_makes_no_upstream_call() -> None:
    cache = QueryEmbeddingCache(max_entries=8)
    with run_embedding_server() as server:
        embedder = RemoteEmbedder(server.url, NOMIC)
        try:
            first, first_hit = await cache.get_or_embed(embedder, "where is the cat", 5)
            second, second_hit = await cache.get_or_embed(embedder, "where is the cat", 5)
            _, other_hit = await cache.get_or_embed(embedder, "where is the dog", 5)
        finally:
            await embedder.aclose()
    assert (first_hit, second_hit, other_hit) == (False, True, False)
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(first, server.vector_for("where is the cat"), atol=1e-6)
    assert [r.body["input"] for r in server.requests] == [
        ["search_query: where is the cat"],
        ["search_query: where is the dog"],
    ]
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["size"]) == (1, 2, 2)
    assert stats["hit_rate"] == pytest.approx(1 / 3)


@pytest.mark.anyio
async def test_failures_are_not_cached() -> None:
    cache = QueryEmbeddingCache()
    with run_embedding_server(fail_status=503, fail_count=1) as server:
        embedder = RemoteEmbedder(server.url, NOMIC)
        try:
            with pytest.raises(EmbeddingUnavailable):
                await cache.get_or_embed(embedder, "q", 5)
            _, hit = await cache.get_or_embed(embedder, "q", 5)
        finally:
            await embedder.aclose()
    assert hit is False
    assert len(server.requests) == 2
    assert cache.stats()["misses"] == 2


def test_lru_eviction_keeps_recently_used_entries() -> None:
    cache = QueryEmbeddingCache(max_entries=2)
    cache.put("m", "a", vec(1))
    cache.put("m", "b", vec(2))
    assert cache.get("m", "a") is not None  # "a" is now the most recently used
    cache.put("m", "c", vec(3))
    assert cache.get("m", "b") is None
    assert cache.get("m", "a") is not None
    assert cache.get("m", "c") is not None
    assert cache.stats() == {
        "size": 2,
        "max_entries": 2,
        "hits": 3,
        "misses": 1,
        "evictions": 1,
        "hit_rate": 0.75,
    }


def test_key_includes_the_model() -> None:
    cache = QueryEmbeddingCache()
    cache.put("model-a", "same text", vec(1))
    assert cache.get("model-b", "same text") is None
    hit = cache.get("model-a", "same text")
    assert hit is not None
    np.testing.assert_array_equal(hit, vec(1))


def test_cached_vectors_are_read_only_copies() -> None:
    cache = QueryEmbeddingCache()
    original = vec(1)
    stored = cache.put("m", "q", original)
    original[0] = 99
    hit = cache.get("m", "q")
    assert hit is not None
    assert hit[0] == 1
    with pytest.raises(ValueError):
        stored[0] = 5


def test_size_zero_disables_storage() -> None:
    cache = QueryEmbeddingCache(max_entries=0)
    cache.put("m", "q", vec(1))
    assert cache.get("m", "q") is None
    assert cache.stats()["size"] == 0
    assert cache.stats()["misses"] == 1


def test_clear_and_len() -> None:
    cache = QueryEmbeddingCache()
    cache.put("m", "q", vec(1))
    assert len(cache) == 1
    cache.clear()
    assert len(cache) == 0


def test_from_env() -> None:
    assert QueryEmbeddingCache(Settings.from_env({}).embedding.cache_size).max_entries == 1024
    assert (
        QueryEmbeddingCache(
            Settings.from_env({"POIMEN_EMBED_CACHE_SIZE": "7"}).embedding.cache_size
        ).max_entries
        == 7
    )
    with pytest.raises(ConfigError):
        QueryEmbeddingCache(
            Settings.from_env({"POIMEN_EMBED_CACHE_SIZE": "-1"}).embedding.cache_size
        )
