"""The query pipeline behind GET /memory/query: optimize, embed, run the routed strategy
(legs in parallel on separate pooled connections), fuse in SQL, rerank, walk provenance.

Each SQL statement runs in its own short transaction under SET LOCAL statement_timeout with
the time the request has left, so a deadline really cancels work inside PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import psycopg
from psycopg_pool import AsyncConnectionPool

from poimen_core.optimizer import QueryContext, QueryOptimizerError, optimize_query
from poimen_memory.db.connect import translate
from poimen_memory.db.queries import q
from poimen_memory.embedders.base import Embedder, EmbeddingUnavailable
from poimen_memory.embedders.cache import QueryEmbeddingCache
from poimen_memory.errors import (
    DatabaseUnavailable,
    DeadlineExceeded,
    PoimenError,
    UnknownProject,
    ValidationError,
)
from poimen_memory.retrieval.deadline import Deadline
from poimen_memory.settings import Settings
from poimen_memory.upstreams.rerank import RerankClient, RerankUnavailable

T = TypeVar("T")
LEVELS = ("L0", "L1", "L2")
FUSION_METHODS = ("rrf", "convex")


class EmbeddingServiceUnavailable(PoimenError):
    code = "embedding_service_unavailable"
    http_status = 503


@dataclass(frozen=True)
class QueryRequest:
    query: str
    project: str | None = None
    levels: tuple[str, ...] = ("L1", "L2")
    limit: int = 5
    timeout_s: float = 5.0
    fusion: str | None = None
    strategy: str | None = None


@dataclass
class Leg:
    ids: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    engine: str | None = None


@dataclass
class Trace:
    metrics: dict[str, Any] = field(default_factory=dict)
    degraded: list[dict[str, str]] = field(default_factory=list)
    engines: dict[str, str | None] = field(default_factory=dict)
    why: list[str] = field(default_factory=list)

    def timed(self, key: str, started: float) -> None:
        self.metrics[key] = round((time.monotonic() - started) * 1000, 3)


class Retriever:
    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        embedder: Embedder | None,
        cache: QueryEmbeddingCache,
        settings: Settings,
        *,
        reranker: RerankClient | None = None,
        opensearch: Any | None = None,
    ) -> None:
        self.pool, self.embedder, self.cache, self.settings = pool, embedder, cache, settings
        self.reranker, self.opensearch = reranker, opensearch

    @property
    def has_lexical(self) -> bool:
        return self.settings.pg_lexical or self.opensearch is not None

    # -- SQL helpers ---------------------------------------------------------------------

    async def _sql(
        self, deadline: Deadline, stage: str, name: str, params: dict[str, Any]
    ) -> list[tuple[Any, ...]]:
        deadline.check(stage)
        try:
            async with (
                self.pool.connection(timeout=max(deadline.remaining(), 0.001)) as conn,
                conn.transaction(),
            ):
                await conn.execute(q("set_statement_timeout"), {"ms": str(deadline.remaining_ms())})
                cur = await conn.execute(q(name), params)
                rows: list[tuple[Any, ...]] = await cur.fetchall()
                return rows
        except psycopg.errors.QueryCanceled as exc:
            raise DeadlineExceeded(
                f"deadline passed during {stage}; the query was cancelled"
            ) from exc
        except psycopg.OperationalError as exc:
            if exc.sqlstate is None:  # no connection: refused, lost, or none from the pool
                raise DatabaseUnavailable("database unavailable", detail=str(exc)) from exc
            raise translate(exc) from exc
        except psycopg.Error as exc:
            raise translate(exc) from exc

    # -- pipeline ------------------------------------------------------------------------

    async def query(self, req: QueryRequest) -> dict[str, Any]:
        deadline = Deadline(req.timeout_s)
        trace = Trace()
        try:
            async with asyncio.timeout(req.timeout_s + 0.05):
                return await self._query(req, deadline, trace)
        except TimeoutError as exc:
            raise DeadlineExceeded(
                f"no result within timeout_seconds={req.timeout_s:g}",
                hint="raise timeout_seconds (clamped to POIMEN_MAX_TIMEOUT_S)",
            ) from exc

    async def _query(self, req: QueryRequest, deadline: Deadline, trace: Trace) -> dict[str, Any]:
        try:
            ctx = optimize_query(req.query)
        except QueryOptimizerError as exc:
            raise ValidationError(str(exc)) from exc
        if req.project is not None:
            rows = await self._sql(deadline, "validate", "project_exists", {"name": req.project})
            if not rows[0][0]:
                raise UnknownProject(
                    f"unknown project {req.project!r}",
                    hint="GET /healthz lists nothing per project; ingest into it first",
                )
        strategy = self._route(req, ctx, trace)
        fusion = (
            req.fusion
            or self.settings.fusion_by_type.get(ctx.question_type.value)
            or self.settings.default_fusion
        )
        levels = list(req.levels)
        rerank_k = req.limit * self.settings.rerank_depth_factor if self.reranker else req.limit

        # The lexical leg needs no embedding, so it starts while the query is embedded.
        lex_task: asyncio.Task[Leg] | None = None
        embedding: np.ndarray[Any, Any] | None = None
        try:
            if strategy in ("Hybrid", "LexicalFirst", "LexicalOnly"):
                depth = {
                    "Hybrid": self.settings.candidates,
                    "LexicalFirst": self.settings.cascade_candidates,
                }.get(strategy, rerank_k)
                lex_task = asyncio.create_task(self._lexical(req, levels, depth, deadline, trace))
            try:
                if strategy != "LexicalOnly":
                    embedding = await self._embed(req.query, deadline, trace)
            except EmbeddingUnavailable as exc:
                trace.degraded.append({"stage": "embed", "reason": exc.reason})
                if not self.has_lexical:
                    raise EmbeddingServiceUnavailable(
                        f"embedder unavailable ({exc.reason}) "
                        "and no lexical engine to fall back to",
                        detail=str(exc),
                    ) from exc
                deadline.check("embed")
                trace.why.append(f"embedder unavailable ({exc.reason}): fell back to LexicalOnly")
                strategy = "LexicalOnly"
                if lex_task is None:
                    lex_task = asyncio.create_task(
                        self._lexical(req, levels, rerank_k, deadline, trace)
                    )
            sem, lex = await self._legs(
                strategy, req, levels, embedding, lex_task, rerank_k, fusion, deadline, trace
            )
        finally:
            # Also on an embedding failure or timeout: an orphaned leg would keep its pooled
            # connection busy and die later with an exception nobody retrieves.
            if lex_task is not None and not lex_task.done():
                lex_task.cancel()

        t0 = time.monotonic()
        fused = await self._sql(
            deadline,
            "fusion",
            "fuse_legs",
            {
                "semantic": json.dumps({"ids": sem.ids, "scores": sem.scores}),
                "lexical": json.dumps({"ids": lex.ids, "scores": lex.scores}),
                "strategy": strategy,
                "fusion": fusion,
                "dense_weight": self.settings.dense_weight,
                "k": self.settings.rrf_k,
                "final_k": rerank_k,
            },
        )
        trace.timed("fusion_time_ms", t0)

        order = [f[0] for f in fused]
        rerank_scores = await self._rerank(req, order, deadline, trace)
        if rerank_scores is not None:
            # Candidates the reranker left unscored (it may return fewer than asked) go last,
            # in fused order.
            order = sorted(
                order,
                key=lambda i: (i not in rerank_scores, -rerank_scores.get(i, 0.0), order.index(i)),
            )
        order = order[: req.limit]

        t0 = time.monotonic()
        hydrated = await self._sql(
            deadline, "provenance", "hydrate", {"ids": order, "embedding": embedding}
        )
        trace.timed("provenance_time_ms", t0)
        by_fused = {f[0]: f for f in fused}
        results = []
        for row in hydrated:
            nid, level, sha, project, title, text, source, breadcrumb, ts, qscore, prov = row
            f = by_fused[nid]
            results.append(
                {
                    "level": level,
                    "sha256": sha,
                    "project": project,
                    "title": title,
                    "text": text,
                    "source": source,
                    "breadcrumb": breadcrumb,
                    "timestamp": ts.isoformat() if ts else None,
                    "query_score": _clip01(qscore),
                    "lexical_score": f[2][1],
                    "final_score": f[3],
                    "rerank_score": rerank_scores.get(nid) if rerank_scores is not None else None,
                    "semantic_rank": f[1][0],
                    "lexical_rank": f[1][1],
                    "fusion_method": f[4],
                    "parents": prov,
                }
            )
        trace.metrics.update(
            {
                "semantic_candidates": len(sem.ids),
                "lexical_candidates": len(lex.ids),
                "final_count": len(results),
                "total_time_ms": round(deadline.elapsed_ms(), 3),
            }
        )
        for key in ("embed_time_ms", "semantic_time_ms", "lexical_time_ms", "rerank_time_ms"):
            trace.metrics.setdefault(key, 0.0)
        trace.metrics.setdefault("embedding_cache_hit", False)
        return {
            "query": req.query,
            "project": req.project,
            "level_filter": levels,
            "search_strategy": strategy,
            "plan": {
                "question_type": ctx.question_type.value,
                "confidence": ctx.confidence,
                "reasons": list(ctx.reasons),
                "optimizer_strategy": ctx.search_strategy.value,
                "engines": trace.engines,
                "why": trace.why,
            },
            "results": results,
            "metrics": trace.metrics,
            "latency_ms": round(deadline.elapsed_ms(), 3),
            "notes": _notes(results, trace, rerank_scores is not None, len(fused)),
            "degraded": trace.degraded,
        }

    def _route(self, req: QueryRequest, ctx: QueryContext, trace: Trace) -> str:
        strategy = req.strategy or ctx.search_strategy.value
        if req.strategy:
            trace.why.append(f"strategy {req.strategy} forced by the request")
        if not self.has_lexical and strategy != "SemanticOnly":
            trace.why.append(f"no lexical engine: {strategy} became SemanticOnly")
            trace.degraded.append({"stage": "lexical", "reason": "no_lexical_engine"})
            strategy = "SemanticOnly"
        if self.embedder is None and strategy != "LexicalOnly":
            if not self.has_lexical:
                raise EmbeddingServiceUnavailable("no embedder and no lexical engine configured")
            trace.why.append("no embedder configured: LexicalOnly")
            strategy = "LexicalOnly"
        return strategy

    async def _embed(self, text: str, deadline: Deadline, trace: Trace) -> np.ndarray[Any, Any]:
        assert self.embedder is not None
        t0 = time.monotonic()
        try:
            vec, hit = await self.cache.get_or_embed(self.embedder, text, deadline.remaining())
        finally:
            trace.timed("embed_time_ms", t0)
        trace.metrics["embedding_cache_hit"] = hit
        return vec

    async def _timed(self, key: str, trace: Trace, aw: Awaitable[T]) -> T:
        t0 = time.monotonic()
        try:
            return await aw
        finally:
            trace.timed(key, t0)

    async def _lexical(
        self, req: QueryRequest, levels: list[str], k: int, deadline: Deadline, trace: Trace
    ) -> Leg:
        t0 = time.monotonic()
        try:
            if self.opensearch is not None:
                try:
                    hits = await self.opensearch.asearch(
                        req.query,
                        req.project,
                        levels,
                        k,
                        min(deadline.remaining(), self.settings.opensearch_timeout_s),
                    )
                    rows = await self._sql(
                        deadline,
                        "lexical",
                        "ids_for_sha256",
                        {"shas": [bytes.fromhex(h.sha256) for h in hits]},
                    )
                    ids = dict(rows)
                    leg = Leg(engine="opensearch")
                    for h in hits:
                        if h.sha256 in ids:
                            leg.ids.append(ids[h.sha256])
                            leg.scores.append(h.score)
                    trace.engines["lexical"] = "opensearch"
                    return leg
                except (
                    Exception
                ) as exc:  # any OpenSearch failure falls back, never fails the request
                    if isinstance(exc, DeadlineExceeded | asyncio.CancelledError):
                        raise
                    reason = getattr(exc, "kind", None) or type(exc).__name__
                    trace.degraded.append({"stage": "lexical", "reason": f"opensearch_{reason}"})
                    trace.why.append("OpenSearch unavailable, used Postgres lexical")
                    if not self.settings.pg_lexical:
                        return Leg()
            rows = await self._sql(
                deadline,
                "lexical",
                "lexical_search",
                {"query": req.query, "project": req.project, "levels": levels, "k": k},
            )
            trace.engines["lexical"] = "postgres-bm25"
            return Leg([r[0] for r in rows], [r[2] for r in rows], "postgres-bm25")
        finally:
            trace.timed("lexical_time_ms", t0)

    async def _semantic(
        self,
        req: QueryRequest,
        levels: list[str],
        embedding: Any,
        k: int,
        deadline: Deadline,
        trace: Trace,
    ) -> Leg:
        rows = await self._timed(
            "semantic_time_ms",
            trace,
            self._sql(
                deadline,
                "semantic",
                "semantic_search",
                {
                    "embedding": embedding,
                    "project": req.project,
                    "levels": levels,
                    "k": k,
                    "ef_search": None,
                },
            ),
        )
        trace.engines["semantic"] = "hnsw"
        return Leg([r[0] for r in rows], [r[2] for r in rows], "hnsw")

    async def _legs(
        self,
        strategy: str,
        req: QueryRequest,
        levels: list[str],
        embedding: Any,
        lex_task: asyncio.Task[Leg] | None,
        rerank_k: int,
        fusion: str,
        deadline: Deadline,
        trace: Trace,
    ) -> tuple[Leg, Leg]:
        if strategy == "LexicalOnly":
            assert lex_task is not None
            return Leg(), await lex_task
        if strategy == "SemanticOnly":
            return await self._semantic(
                req, levels, embedding, max(rerank_k, req.limit), deadline, trace
            ), Leg()
        assert lex_task is not None
        if strategy == "Hybrid":
            sem_task = asyncio.create_task(
                self._semantic(req, levels, embedding, self.settings.candidates, deadline, trace)
            )
            try:
                return await sem_task, await lex_task
            finally:
                # If one leg failed, the other must not keep its pooled connection busy.
                for t in (sem_task, lex_task):
                    if not t.done():
                        t.cancel()
        lex = await lex_task  # LexicalFirst: rank exactly the lexical ids by cosine
        # A convex cascade blends cosine with BM25 over all lexical ids, so it needs them all.
        by_ids_k = max(len(lex.ids), 1) if fusion == "convex" else rerank_k
        rows = await self._timed(
            "semantic_time_ms",
            trace,
            self._sql(
                deadline,
                "semantic",
                "search_by_ids",
                {
                    "embedding": embedding,
                    "ids": lex.ids,
                    "project": req.project,
                    "levels": levels,
                    "k": by_ids_k,
                },
            ),
        )
        trace.engines["semantic"] = "by-ids"
        return Leg([r[0] for r in rows], [r[2] for r in rows], "by-ids"), lex

    async def _rerank(
        self, req: QueryRequest, ids: list[int], deadline: Deadline, trace: Trace
    ) -> dict[int, float] | None:
        if self.reranker is None:
            trace.engines["rerank"] = None
            trace.degraded.append({"stage": "rerank", "reason": "not_configured"})
            return None
        if not ids:
            return None
        if deadline.remaining() < self.settings.rerank_min_remaining_s:
            trace.degraded.append({"stage": "rerank", "reason": "insufficient_time"})
            return None
        t0 = time.monotonic()
        try:
            texts = dict(await self._sql(deadline, "rerank", "node_texts", {"ids": ids}))
            # The configured rerank timeout applies, and rerank_min_remaining_s of the
            # deadline stays for hydrating the results, so a slow reranker degrades to the
            # fused order instead of timing the whole request out.
            budget = min(
                self.reranker.timeout_s,
                deadline.remaining() - self.settings.rerank_min_remaining_s,
            )
            if budget <= 0:
                trace.degraded.append({"stage": "rerank", "reason": "insufficient_time"})
                return None
            results = await self.reranker.arerank(
                req.query, [texts[i] for i in ids], top_n=len(ids), timeout=budget
            )
        except RerankUnavailable as exc:
            trace.degraded.append({"stage": "rerank", "reason": exc.reason})
            trace.why.append(f"reranker failed ({exc.reason}): kept the fused order")
            return None
        finally:
            trace.timed("rerank_time_ms", t0)
        trace.engines["rerank"] = self.reranker.model or "remote"
        return {ids[r.index]: r.score for r in results}


def _clip01(x: float | None) -> float | None:
    # Cosine similarity of unit vectors can leave [0, 1] by rounding or for opposed vectors.
    return None if x is None else min(1.0, max(0.0, float(x)))


def _notes(results: list[dict[str, Any]], trace: Trace, reranked: bool, candidates: int) -> str:
    parts = [f"{len(results)} result{'' if len(results) == 1 else 's'}"]
    if reranked:
        parts.append(f"reranker reduced {candidates} candidates to {len(results)}")
    parts.extend(trace.why)
    return "; ".join(parts)
