"""The HTTP layer: validation, JSON errors, and the shared clients built in the lifespan.
Everything retrieval-related happens in retrieval.py and in SQL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import psycopg
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from poimen_memory.api.openapi import openapi_spec
from poimen_memory.db.connect import configure_async, connect, database_url, translate
from poimen_memory.db.queries import q
from poimen_memory.embedders.base import Embedder, embedder_from_env
from poimen_memory.embedders.cache import QueryEmbeddingCache
from poimen_memory.errors import DatabaseUnavailable, PoimenError, ValidationError
from poimen_memory.ingest.nodes import parse_lines
from poimen_memory.ingest.writer import ingest
from poimen_memory.retrieval.pipeline import LEVELS, QueryRequest, Retriever
from poimen_memory.settings import Settings
from poimen_memory.upstreams.rerank import RerankClient, reranker_from_env

log = logging.getLogger("poimen_memory")


@dataclass
class State:
    settings: Settings
    url: str
    pool: AsyncConnectionPool[Any]
    embedder: Embedder | None
    cache: QueryEmbeddingCache
    reranker: RerankClient | None
    opensearch: Any | None
    retriever: Retriever


def _error(err: PoimenError) -> JSONResponse:
    return JSONResponse(err.to_json(), status_code=err.http_status)


# Routes raise; these turn typed and database errors into the one JSON error shape. Starlette
# picks the handler by the exception's MRO, so OperationalError wins over psycopg.Error.
async def _poimen_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, PoimenError)
    return _error(exc)


async def _db_unavailable(request: Request, exc: Exception) -> JSONResponse:
    return _error(DatabaseUnavailable("database unavailable", detail=str(exc)))


async def _db_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, psycopg.Error)
    return _error(translate(exc))


def _parse_query(params: Mapping[str, str], s: Settings) -> QueryRequest:
    query = params.get("query", "")
    if not query.strip():
        raise ValidationError("query is required and must not be empty")
    if len(query) > s.max_query_chars:
        raise ValidationError(
            f"query is longer than {s.max_query_chars} characters",
            hint="POIMEN_MAX_QUERY_CHARS sets the cap",
        )
    levels = tuple(x.strip() for x in params.get("level", "L1,L2").split(",") if x.strip())
    if not levels or any(lv not in LEVELS for lv in levels):
        raise ValidationError(
            f"level must be a comma-separated subset of L0,L1,L2, got {params.get('level')!r}"
        )

    def number(name: str, default: float, lo: float, hi: float, cast: type) -> Any:
        raw = params.get(name)
        if raw is None or raw == "":
            return cast(default)
        try:
            value = cast(raw)
        except ValueError as exc:
            raise ValidationError(f"{name} must be a number, got {raw!r}") from exc
        if not math.isfinite(value):
            raise ValidationError(f"{name} must be a finite number, got {raw!r}")
        return cast(min(max(value, lo), hi))  # clamped, as documented

    fusion = params.get("fusion") or None  # None: per question type, then POIMEN_FUSION
    if fusion not in (None, "rrf", "convex"):
        raise ValidationError(f"fusion must be rrf or convex, got {fusion!r}")
    strategy = params.get("strategy") or None
    if strategy not in (None, "LexicalOnly", "LexicalFirst", "Hybrid", "SemanticOnly"):
        raise ValidationError(f"unknown strategy {strategy!r}")
    return QueryRequest(
        query=query,
        project=params.get("project") or None,
        levels=tuple(dict.fromkeys(levels)),
        limit=number("limit", s.default_limit, 1, s.max_limit, int),
        timeout_s=number("timeout_seconds", s.default_timeout_s, 1, s.max_timeout_s, float),
        fusion=fusion,
        strategy=strategy,
    )


async def memory_query(request: Request) -> JSONResponse:
    state: State = request.app.state.poimen
    req = _parse_query(request.query_params, state.settings)
    return JSONResponse(await state.retriever.query(req))


async def post_nodes(request: Request) -> JSONResponse:
    """Ingest JSON nodes (an array, or NDJSON) through the same code as the CLI."""
    state: State = request.app.state.poimen
    body = (await request.body()).decode("utf-8", errors="replace")
    stripped = body.lstrip()
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except json.JSONDecodeError as exc:
            return _error(ValidationError(f"body is not valid JSON: {exc.msg}"))
        lines = [json.dumps(i) for i in items] if isinstance(items, list) else []
    else:
        lines = body.splitlines()
    records, invalid = parse_lines(lines, request.query_params.get("project"))
    if not records and not invalid:
        return _error(ValidationError("no nodes in the request body"))
    if state.embedder is None:
        return _error(ValidationError("no embedder configured; cannot ingest"))
    embedder = state.embedder

    def run() -> dict[str, Any]:
        # autocommit: each ingest batch is its own transaction, as documented.
        with connect(state.url, autocommit=True) as conn:
            report = ingest(
                conn,
                records,
                embedder,
                invalid=invalid,
                skip_invalid=request.query_params.get("skip_invalid") == "true",
                batch_size=state.settings.ingest_batch,
                outbox=state.opensearch is not None,
                progress=False,
            )
            return report.to_json()

    return JSONResponse(await asyncio.to_thread(run), status_code=201)


async def healthz(request: Request) -> JSONResponse:
    state: State = request.app.state.poimen
    checks: dict[str, Any] = {}
    try:
        async with state.pool.connection(timeout=2) as conn:
            cur = await conn.execute(q("health"))
            row = await cur.fetchone()
            checks["database"] = {
                "ok": True,
                "nodes": row[0] if row else None,
                "embedding_model": row[1] if row else None,
            }
    except Exception as exc:
        checks["database"] = {"ok": False, "error": type(exc).__name__}
    checks["embedder"] = (
        {"ok": True, "model": state.embedder.model_name, "dim": state.embedder.dim}
        if state.embedder
        else {"ok": False, "error": "not_configured"}
    )
    stored_model = checks["database"].get("embedding_model")
    if state.embedder and stored_model and stored_model != state.embedder.model_name:
        # Same dimension but another model would give meaningless cosine scores.
        checks["embedder"].update(ok=False, error="model_mismatch", database_model=stored_model)
    checks["reranker"] = (
        {"ok": True, "endpoint": state.reranker.endpoint}
        if state.reranker
        else {"ok": None, "status": "not_configured"}
    )
    if state.opensearch is not None:
        healthy = await asyncio.to_thread(state.opensearch.healthy, 1.0)
        checks["opensearch"] = {"ok": healthy}
    else:
        checks["opensearch"] = {"ok": None, "status": "not_configured"}
    checks["embedding_cache"] = state.cache.stats()
    engines = {
        "lexical": "opensearch"
        if checks["opensearch"].get("ok")
        else ("postgres-bm25" if state.settings.pg_lexical else None),
        "semantic": "hnsw" if state.embedder else None,
        "rerank": "remote" if state.reranker else None,
    }
    ok = bool(checks["database"]["ok"])
    return JSONResponse(
        {"status": "ok" if ok else "degraded", "checks": checks, "engines": engines},
        status_code=200 if ok else 503,
    )


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Unknown routes and wrong methods answer in the same JSON shape as every other error."""
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return JSONResponse({"error": code, "detail": str(exc.detail)}, status_code=exc.status_code,
                        headers=exc.headers)  # fmt: skip


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse({"error": "internal_error", "detail": type(exc).__name__}, status_code=500)


async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(openapi_spec())


def create_app(
    settings: Settings | None = None,
    env: Mapping[str, str] | None = None,
    *,
    embedder: Embedder | None = None,
) -> Starlette:
    environ = os.environ if env is None else env
    cfg = settings or Settings.from_env(environ)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        url = database_url(cfg)
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            url,
            min_size=cfg.pool_min,
            max_size=cfg.pool_max,
            configure=configure_async,
            open=False,
            kwargs={"autocommit": True},
        )
        await pool.open(wait=False)
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(pool.close)
            http = await stack.enter_async_context(httpx.AsyncClient())
            http_sync = stack.enter_context(httpx.Client())
            emb = embedder or embedder_from_env(environ, client=http_sync, async_client=http)
            load = getattr(emb, "load", None)
            if callable(load):
                await asyncio.to_thread(load)  # fail at start-up, not on the first request
            reranker = reranker_from_env(environ, client=http)
            opensearch = None
            if cfg.opensearch_url:
                from poimen_memory.upstreams.opensearch import engine_from_settings

                opensearch = engine_from_settings(cfg)
                if opensearch is not None:
                    stack.callback(opensearch.close)
            cache = QueryEmbeddingCache.from_env(environ)
            retriever = Retriever(pool, emb, cache, cfg, reranker=reranker, opensearch=opensearch)
            app.state.poimen = State(cfg, url, pool, emb, cache, reranker, opensearch, retriever)
            yield

    return Starlette(
        exception_handlers={
            PoimenError: _poimen_error,
            psycopg.OperationalError: _db_unavailable,
            psycopg.Error: _db_error,
            HTTPException: _http_error,
            Exception: _unexpected,
        },
        routes=[
            Route("/memory/query", memory_query, methods=["GET"]),
            Route("/memory/nodes", post_nodes, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
