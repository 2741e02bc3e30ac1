"""The one function that wires the retriever and its clients, for the HTTP app, the CLI and
the lab alike: a pool (and one per read replica, with their monitor), the embedder, the
reranker, OpenSearch and the query cache, built from `Settings` and closed in reverse order."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
from psycopg_pool import AsyncConnectionPool

from poimen_memory.db import tenant
from poimen_memory.db.connect import Lender, connect, database_url, open_pool
from poimen_memory.db.queries import q
from poimen_memory.db.replicas import Replica, ReplicaSet
from poimen_memory.embedders.base import Embedder
from poimen_memory.embedders.cache import QueryEmbeddingCache
from poimen_memory.embedders.factory import build_embedder
from poimen_memory.ingest.outbox import enable_outbox, sync_outbox
from poimen_memory.retrieval.pipeline import Retriever
from poimen_memory.settings import Settings
from poimen_memory.upstreams.opensearch import OpenSearchEngine, engine_from_settings
from poimen_memory.upstreams.rerank import RerankClient, build_reranker

log = logging.getLogger(__name__)


@dataclass
class Services:
    settings: Settings
    url: str
    pool: AsyncConnectionPool[Any]
    lender: Lender
    """The pools' connections within a request's deadline (the retriever's, the API's)."""
    embedder: Embedder | None
    cache: QueryEmbeddingCache
    reranker: RerankClient | None
    opensearch: OpenSearchEngine | None
    retriever: Retriever
    replicas: ReplicaSet | None
    """Read replicas (POIMEN_READ_URLS) and their last check; None without any."""
    ingest_pool: ThreadPoolExecutor
    """Ingest runs here, never in the default pool the query path embeds in."""
    ingest_slots: asyncio.Semaphore
    """Running plus waiting ingests; when none is free a request is refused (503 busy)."""
    warnings: list[str]
    """Start-up findings an operator must see (/healthz ``warnings``): a pool whose role
    row-level security does not apply to."""


async def drain_outbox(url: str, engine: OpenSearchEngine, settings: Settings) -> None:
    """Keep OpenSearch in step with Postgres: drain the outbox (filled by triggers) every
    few seconds, backing off while OpenSearch is down. The lag shows in /healthz."""
    s = settings.opensearch
    pause = s.drain_interval_s

    def once() -> bool:
        with connect(url, autocommit=True) as conn:
            tenant.assert_for_session(conn, tenant.ALL_PROJECTS)  # the drain serves them all
            report = sync_outbox(
                conn,
                engine,
                batch_size=s.sync_batch,
                max_attempts=1,  # this loop is the retry, with its own backoff
                backoff_base_s=s.backoff_s,
                progress=False,
            )
        return report.stopped is None

    def enable() -> None:
        with connect(url, autocommit=True) as conn:
            enable_outbox(conn)

    enabled = False
    while True:
        try:
            if not enabled:
                await asyncio.to_thread(enable)
                enabled = True
            ok = await asyncio.to_thread(once)
        except Exception:  # the loop must outlive any one failure; it retries with backoff
            log.exception("outbox drain failed")
            ok = False
        pause = s.drain_interval_s if ok else min(pause * 2, 60.0)
        await asyncio.sleep(pause)


async def warn_if_rls_bypassed(
    pool: AsyncConnectionPool[Any], where: str, warnings: list[str]
) -> None:
    """Once per pool at start-up: a superuser, BYPASSRLS or owner login skips every policy
    in sql/085_tenants.sql, so an API key's projects are then enforced by the Python layer
    only. Not refused: tests and single-user set-ups connect as the owner on purpose."""
    try:
        async with pool.connection() as conn:
            row = await (await conn.execute(q("role_bypasses_rls"))).fetchone()
    except Exception as exc:  # a server that is down is reported by /healthz, not here
        log.debug("row-level security check of %s skipped: %s", where, exc)
        return
    if row is None or row[1] is None:
        return
    msg = (
        f"{where} connects as role {row[0]!r} ({row[1]}): row-level security does not apply, "
        "so tenant isolation is not enforced by Postgres for it; connect as a member of "
        "the database's service role instead (memory.roles(), docs/security.md)"
    )
    log.warning("%s", msg)
    warnings.append(msg)


def _pool_options(settings: Settings) -> dict[str, Any]:
    return {
        "min_size": settings.pool_min,
        "max_size": settings.pool_max,
        # The longest a request may ask for, and a second for the last statement's reply.
        "statement_timeout_s": settings.max_timeout_s + 1.0,
        "check_idle_s": settings.pool_check_idle_s,
    }


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@contextlib.asynccontextmanager
async def open_services(
    settings: Settings,
    *,
    url: str | None = None,
    embedder: Embedder | None = None,
    rerank: bool = True,
    wait: bool = False,
    check_rls: bool = False,
) -> AsyncIterator[Services]:
    """Everything a query needs. ``embedder`` replaces the configured one (tests, the lab's
    shared model); ``rerank=False`` leaves the reranker out even when configured; ``wait``
    blocks until the pool has its first connections (the CLI wants errors at once, the
    server wants to start even while the database is still coming up); ``check_rls`` (the
    server) warns about each pool whose role row-level security does not apply to."""
    url = url or database_url(settings)
    pool = open_pool(url, **_pool_options(settings))
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
            drainer = asyncio.create_task(drain_outbox(url, opensearch, settings))
            stack.push_async_callback(_stop, drainer)
        replicas = await _open_replicas(settings, pool, stack)
        warnings: list[str] = []
        if check_rls:
            pools = [("the primary pool", pool)]
            for r in replicas.replicas if replicas else []:
                pools.append((f"read replica {r.name}", r.pool))
            for where, checked in pools:
                # In the background: a replica that is down must not hold up the start.
                check = asyncio.create_task(warn_if_rls_bypassed(checked, where, warnings))
                stack.push_async_callback(_stop, check)
        cache = QueryEmbeddingCache(settings.embedding.cache_size)
        lender = Lender(pool, settings.pool_timeout_s)
        retriever = Retriever(
            lender,
            emb,
            cache,
            settings,
            reranker=reranker,
            opensearch=opensearch,
            replicas=replicas,
        )
        ingest_pool = ThreadPoolExecutor(settings.ingest_workers, thread_name_prefix="ingest")
        stack.callback(ingest_pool.shutdown, wait=False, cancel_futures=True)
        slots = asyncio.Semaphore(settings.ingest_workers + settings.ingest_queue)
        yield Services(
            settings,
            url,
            pool,
            lender,
            emb,
            cache,
            reranker,
            opensearch,
            retriever,
            replicas,
            ingest_pool,
            slots,
            warnings,
        )


async def _open_replicas(
    settings: Settings,
    primary: AsyncConnectionPool[Any],
    stack: contextlib.AsyncExitStack,
) -> ReplicaSet | None:
    """A pool per read URL, checked once before the first query and then by the monitor."""
    if not settings.read_urls:
        return None
    replicas = []
    for read_url in settings.read_urls:
        rpool = open_pool(read_url, **_pool_options(settings))
        await rpool.open(wait=False)  # a replica that is down must not stop the service
        stack.push_async_callback(rpool.close)
        replicas.append(Replica(read_url, rpool))
    rs = ReplicaSet(
        primary,
        replicas,
        max_lag_s=settings.max_replica_lag_s,
        check_s=settings.replica_check_s,
    )
    await rs.refresh()
    monitor = asyncio.create_task(rs.run())
    stack.push_async_callback(_stop, monitor)
    return rs
