"""The one function that wires the retriever and its clients, for the HTTP app, the CLI and
the lab alike: a pool, the embedder, the reranker, OpenSearch and the query cache, built
from `Settings` and closed in reverse order."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
from psycopg_pool import AsyncConnectionPool

from poimen_memory.db.connect import database_url, open_pool
from poimen_memory.embedders.base import Embedder
from poimen_memory.embedders.cache import QueryEmbeddingCache
from poimen_memory.embedders.factory import build_embedder
from poimen_memory.retrieval.pipeline import Retriever
from poimen_memory.settings import Settings
from poimen_memory.upstreams.opensearch import OpenSearchEngine, engine_from_settings
from poimen_memory.upstreams.rerank import RerankClient, build_reranker


@dataclass
class Services:
    settings: Settings
    url: str
    pool: AsyncConnectionPool[Any]
    embedder: Embedder | None
    cache: QueryEmbeddingCache
    reranker: RerankClient | None
    opensearch: OpenSearchEngine | None
    retriever: Retriever
    ingest_pool: ThreadPoolExecutor
    """Ingest runs here, never in the default pool the query path embeds in."""
    ingest_slots: asyncio.Semaphore
    """Running plus waiting ingests; when none is free a request is refused (503 busy)."""


@contextlib.asynccontextmanager
async def open_services(
    settings: Settings,
    *,
    url: str | None = None,
    embedder: Embedder | None = None,
    rerank: bool = True,
    wait: bool = False,
) -> AsyncIterator[Services]:
    """Everything a query needs. ``embedder`` replaces the configured one (tests, the lab's
    shared model); ``rerank=False`` leaves the reranker out even when configured; ``wait``
    blocks until the pool has its first connections (the CLI wants errors at once, the
    server wants to start even while the database is still coming up)."""
    url = url or database_url(settings)
    pool = open_pool(url, min_size=settings.pool_min, max_size=settings.pool_max)
    async with contextlib.AsyncExitStack() as stack:
        await pool.open(wait=wait)
        stack.push_async_callback(pool.close)
        http = await stack.enter_async_context(httpx.AsyncClient())
        http_sync = stack.enter_context(httpx.Client())
        emb = embedder or build_embedder(settings.embedding, client=http_sync, async_client=http)
        load = getattr(emb, "load", None)
        if callable(load):
            await asyncio.to_thread(load)  # fail at start-up, not on the first request
        reranker = build_reranker(settings.rerank, client=http) if rerank else None
        opensearch = engine_from_settings(settings.opensearch)
        if opensearch is not None:
            stack.callback(opensearch.close)
        cache = QueryEmbeddingCache(settings.embedding.cache_size)
        retriever = Retriever(pool, emb, cache, settings, reranker=reranker, opensearch=opensearch)
        ingest_pool = ThreadPoolExecutor(settings.ingest_workers, thread_name_prefix="ingest")
        stack.callback(ingest_pool.shutdown, wait=False, cancel_futures=True)
        slots = asyncio.Semaphore(settings.ingest_workers + settings.ingest_queue)
        yield Services(
            settings, url, pool, emb, cache, reranker, opensearch, retriever, ingest_pool, slots
        )
