"""The query pipeline behind GET /memory/query: optimize, embed, run the routed strategy
(legs in parallel on separate pooled connections), fuse in SQL, rerank, walk provenance.

Only I/O orchestration lives here. The policy (depths, fusion, RRF k, dense weight) comes
from the database (memory.policy()), fusion is memory.fuse_legs, provenance memory.hydrate:
the same functions memory.query composes, so SQL and HTTP rank alike. Each statement runs
in its own short transaction under SET LOCAL statement_timeout with the time the request
has left, so a deadline really cancels work inside PostgreSQL.

With read replicas configured (POIMEN_READ_URLS) a query runs on a standby that passed its
last check (db/replicas.py), and again on the primary if it fails there; everything else
that uses `Retriever.connection` (API keys) stays on the primary.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Iterable
from contextvars import ContextVar
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, TypeVar

import numpy as np
import psycopg
from psycopg.rows import class_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from poimen_core.optimizer import QueryContext, QueryOptimizerError, optimize_query
from poimen_memory.db import tenant
from poimen_memory.db.queries import q
from poimen_memory.db.replicas import ReplicaSet
from poimen_memory.db.wrap import wrap_exceptions
from poimen_memory.embedders.base import Embedder
from poimen_memory.embedders.cache import QueryEmbeddingCache
from poimen_memory.errors import (
    DatabaseError,
    DatabaseUnavailable,
    DeadlineExceeded,
    EmbeddingUnavailable,
    RerankUnavailable,
    UnknownProject,
    ValidationError,
)
from poimen_memory.retrieval.deadline import Deadline
from poimen_memory.retrieval.evidence import Evidence
from poimen_memory.retrieval.models import (
    LEVELS,
    FusedRow,
    HydratedRow,
    IdRow,
    Leg,
    PolicyRow,
    QueryRequest,
    RankedRow,
    Trace,
)
from poimen_memory.settings import Settings
from poimen_memory.upstreams.rerank import RerankClient

__all__ = ["LEVELS", "QueryRequest", "Retriever"]

T = TypeVar("T")
R = TypeVar("R")

# The pool this request reads from: a replica's, or unset for the primary. A context variable
# so the legs' tasks, which copy the context when created, read from the same server.
_READ_POOL: ContextVar[AsyncConnectionPool[Any] | None] = ContextVar("read_pool", default=None)


async def _settle(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel what still runs and retrieve every outcome, so no task outlives the request
    with a pooled connection or dies later with an exception nobody retrieves."""
    pending = [t for t in tasks if t is not None]
    for t in pending:
        if not t.done():
            t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


@dataclass
class Retriever:
    """Runs one query; built once per process by services.open_services."""

    pool: AsyncConnectionPool[Any]
    embedder: Embedder | None
    cache: QueryEmbeddingCache
    settings: Settings
    _: KW_ONLY
    reranker: RerankClient | None = None
    opensearch: Any | None = None
    replicas: ReplicaSet | None = None
    # Whether a pool's server answers, per pool, shared for a second (_database_answers).
    _probe_lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)
    _probes: dict[int, tuple[float, bool]] = field(default_factory=dict, init=False, repr=False)

    @property
    def has_lexical(self) -> bool:
        return self.settings.pg_lexical or self.opensearch is not None

    # -- SQL ---------------------------------------------------------------------------

    async def _sql(
        self,
        deadline: Deadline,
        stage: str,
        name: str,
        params: dict[str, Any],
        row: type[R],
    ) -> list[R]:
        deadline.check(stage)
        with deadline.stage(stage), wrap_exceptions(stage):
            async with self.connection(deadline, stage) as conn, conn.transaction():
                await conn.execute(
                    q("begin_request"),
                    {"ms": str(deadline.remaining_ms()), **tenant.current().params()},
                )
                async with conn.cursor(row_factory=class_row(row)) as cur:
                    await cur.execute(q(name), params)
                    rows: list[R] = await cur.fetchall()
                    return rows

    @contextlib.asynccontextmanager
    async def connection(
        self, deadline: Deadline, stage: str
    ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A pooled connection within the deadline. A pool that has no connection at all
        after POIMEN_POOL_TIMEOUT_S means the database is down (503 at once, not at the
        deadline); a pool whose connections are all busy is only slow, so the request
        waits for the rest of its deadline and then reports a timeout."""
        pool = _READ_POOL.get() or self.pool
        # Decide before the deadline does, so the answer is "unavailable", not "timeout".
        first = min(deadline.remaining() * 0.8, self.settings.pool_timeout_s)
        async with contextlib.AsyncExitStack() as stack:
            try:
                conn = await stack.enter_async_context(pool.connection(timeout=max(first, 0.001)))
            except PoolTimeout as exc:
                if not await self._database_answers(pool):
                    raise DatabaseUnavailable(
                        "database unavailable: no connection could be made",
                        detail=str(exc),
                        hint="check that PostgreSQL is running; the service reconnects by itself",
                    ) from exc
                try:
                    conn = await stack.enter_async_context(
                        pool.connection(timeout=max(deadline.remaining(), 0.001))
                    )
                except PoolTimeout as late:
                    raise DeadlineExceeded(
                        f"no free database connection before the deadline ({stage})",
                        hint="raise POIMEN_POOL_MAX, or timeout_seconds",
                    ) from late
            yield conn

    async def _database_answers(self, pool: AsyncConnectionPool[Any]) -> bool:
        """Is the server up (the pool is merely busy) or down? One direct connection tells;
        the answer is shared for a second so a crowd of waiting requests probes once."""
        async with self._probe_lock:
            at, up = self._probes.get(id(pool), (-1e9, True))
            if time.monotonic() - at < 1.0:
                return up
            info = pool.conninfo
            if not isinstance(info, str):  # a conninfo callable: judge by the pool alone
                return bool(pool.get_stats().get("pool_size", 0))
            try:
                async with asyncio.timeout(0.5):
                    probe = await psycopg.AsyncConnection.connect(info)
                await probe.close()
                up = True
            except psycopg.Error as exc:
                # The server answered (e.g. 53300, too many connections): it is up, busy.
                up = exc.sqlstate is not None
            except TimeoutError:
                up = False
            self._probes[id(pool)] = (time.monotonic(), up)
            return up

    # -- pipeline ------------------------------------------------------------------------

    async def query(self, req: QueryRequest) -> dict[str, Any]:
        deadline = Deadline(req.timeout_s)
        try:
            async with asyncio.timeout(req.timeout_s + 0.05):
                return await self._routed(req, deadline)
        except TimeoutError as exc:
            waiting = deadline.waiting_for()
            raise DeadlineExceeded(
                f"no result within timeout_seconds={req.timeout_s:g}"
                + (f" (still running: {waiting})" if waiting else ""),
                hint="raise timeout_seconds (clamped to POIMEN_MAX_TIMEOUT_S)",
            ) from exc

    async def _routed(self, req: QueryRequest, deadline: Deadline) -> dict[str, Any]:
        """On a replica fit to serve, else on the primary (``metrics.served_by`` says which).
        A query the replica cannot answer (it went down, or recovery cancelled the statement)
        runs again on the primary in the time left, and the replica rests until its next
        check; either way the fallback is a ``degraded`` entry, never an error. A project
        the replica does not know yet (created a moment ago) is asked of the primary."""
        replica, reason = self.replicas.choose() if self.replicas else (None, None)
        if replica is not None:
            assert self.replicas is not None
            trace = Trace(metrics={"served_by": "replica"})
            token = _READ_POOL.set(replica.pool)
            try:
                return await self._query(req, deadline, trace)
            except UnknownProject:
                reason = "project_not_replayed"  # the primary says whether it exists
            except (DatabaseUnavailable, DatabaseError) as exc:
                if isinstance(exc, DatabaseError) and exc.sqlstate != "40001":
                    raise  # 40001 on a standby: cancelled by a conflict with recovery
                self.replicas.mark_failed(replica)
                reason = "failed"
            finally:
                _READ_POOL.reset(token)
        trace = Trace(metrics={"served_by": "primary"})
        if reason is not None:
            trace.degraded.append({"stage": "replica", "reason": reason})
            trace.why.append(f"no replica fit to serve ({reason}): read from the primary")
        return await self._query(req, deadline, trace)

    async def _query(self, req: QueryRequest, deadline: Deadline, trace: Trace) -> dict[str, Any]:
        try:
            ctx = optimize_query(req.query, req.reference_time)
        except QueryOptimizerError as exc:
            raise ValidationError(str(exc)) from exc
        extracted = ctx.time_filter or {}
        (policy,) = await self._sql(
            deadline,
            "validate",
            "query_context",
            {
                "project": req.project,
                "since": req.since,
                "until": req.until,
                "extracted_since": extracted.get("since"),
                "extracted_until": extracted.get("until"),
            },
            PolicyRow,
        )
        if not policy.project_exists:
            raise UnknownProject(
                f"unknown project {req.project!r}",
                hint="SELECT name FROM memory.projects lists them; ingest into it first",
            )
        req, time_plan = _time_filter(req, ctx, policy)
        strategy = self._route(req, ctx, trace)
        if (
            strategy != "LexicalOnly"
            and self.embedder is not None
            and policy.embedding_model not in (None, self.embedder.model_name)
            and self.has_lexical
        ):
            # Another model's vectors would give meaningless cosine scores.
            trace.degraded.append({"stage": "embed", "reason": "model_mismatch"})
            trace.why.append(
                f"the database holds {policy.embedding_model} vectors, the service embeds "
                f"with {self.embedder.model_name}: LexicalOnly"
            )
            strategy = "LexicalOnly"
        fusion = req.fusion or policy.fusion_by_type.get(ctx.question_type.value) or policy.fusion
        candidates = req.candidates or policy.candidates
        levels = list(req.levels)
        rerank_k = req.limit * self.settings.rerank_depth_factor if self.reranker else req.limit

        # The lexical leg needs no embedding, so it starts while the query is embedded.
        lex_task: asyncio.Task[Leg] | None = None
        sem_task: asyncio.Task[Leg] | None = None
        # The evidence's direct L0 legs run beside the answer's own (retrieval/evidence.py).
        evidence = Evidence(
            self._sql,
            req,
            policy,
            self.settings.fallback_reserve_s,
            reuses_legs=levels == ["L0"]
            and strategy == "Hybrid"
            and candidates == policy.evidence_candidates
            and self.opensearch is None,
        )
        embedding: np.ndarray[Any, Any] | None = None
        try:
            if self.settings.pg_lexical and strategy != "SemanticOnly":
                evidence.start_lexical(deadline)
            if strategy in ("Hybrid", "LexicalFirst", "LexicalOnly"):
                depth = {"Hybrid": candidates, "LexicalFirst": policy.cascade_candidates}.get(
                    strategy, rerank_k
                )
                lex_task = asyncio.create_task(self._lexical(req, levels, depth, deadline, trace))
            try:
                if strategy != "LexicalOnly":
                    embedding = await self._embed(req.query, deadline, trace)
            except EmbeddingUnavailable as exc:
                trace.degraded.append({"stage": "embed", "reason": exc.tag})
                if not self.has_lexical:
                    raise EmbeddingUnavailable(
                        f"embedder unavailable ({exc.tag}) and no lexical engine to fall back to",
                        reason=exc.reason,
                        status=exc.status,
                        detail=str(exc),
                    ) from exc
                deadline.check("embed")
                trace.why.append(f"embedder unavailable ({exc.tag}): fell back to LexicalOnly")
                strategy = "LexicalOnly"
                if lex_task is None:
                    lex_task = asyncio.create_task(
                        self._lexical(req, levels, rerank_k, deadline, trace)
                    )
            evidence.start_semantic(embedding, deadline)
            if strategy == "Hybrid":
                sem_task = asyncio.create_task(
                    self._semantic(req, levels, embedding, candidates, deadline, trace)
                )
                sem, lex = await sem_task, await _required(lex_task)
            elif strategy == "SemanticOnly":
                k = max(rerank_k, req.limit)
                sem, lex = await self._semantic(req, levels, embedding, k, deadline, trace), Leg()
            elif strategy == "LexicalFirst":
                lex = await _required(lex_task)
                sem = await self._by_ids(
                    req, levels, embedding, lex, rerank_k, fusion, deadline, trace
                )
            else:
                sem, lex = Leg(), await _required(lex_task)
            await evidence.collect(lex, sem, deadline, trace)
        finally:
            # On every path, failures and timeouts included.
            await _settle(t for t in (lex_task, sem_task, *evidence.tasks) if t is not None)

        t0 = time.monotonic()
        fused = await self._sql(
            deadline,
            "fusion",
            "fuse_legs",
            {
                "semantic": json.dumps(sem.as_json()),
                "lexical": json.dumps(lex.as_json()),
                "strategy": strategy,
                "fusion": fusion,
                "dense_weight": req.dense_weight
                if req.dense_weight is not None
                else policy.dense_weight,
                "k": req.rrf_k if req.rrf_k is not None else policy.rrf_k,
                "final_k": rerank_k,
            },
            FusedRow,
        )
        trace.timed("fusion_time_ms", t0)

        order = [f.node_id for f in fused]
        rerank_scores = await self._rerank(req, order, deadline, trace)
        if rerank_scores is not None:
            # Candidates the reranker left unscored (it may return fewer than asked) go last,
            # in fused order.
            order = sorted(
                order,
                key=lambda i: (i not in rerank_scores, -rerank_scores.get(i, 0.0), order.index(i)),
            )
        order = order[: req.limit]

        # The evidence is chosen while the results' trees are built.
        hyd_task = asyncio.create_task(self._hydrate(req, order, embedding, deadline, trace))
        try:
            await evidence.select(order, fusion, deadline, trace)
            hydrated = await hyd_task
        finally:
            await _settle([hyd_task])
        by_fused = {f.node_id: f for f in fused}
        results = [
            _result(h, by_fused[h.node_id], rerank_scores.get(h.node_id) if rerank_scores else None)
            for h in hydrated
        ]
        evidence.trim(results)
        trace.metrics.update(
            {
                "semantic_candidates": len(sem.ids),
                "lexical_candidates": len(lex.ids),
                "final_count": len(results),
                "total_time_ms": round(deadline.elapsed_ms(), 3),
            }
        )
        for key in (
            "embed_time_ms",
            "semantic_time_ms",
            "lexical_time_ms",
            "rerank_time_ms",
            "evidence_time_ms",
        ):
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
                "time_filter": time_plan,
                "evidence": evidence.plan(),
                "engines": trace.engines,
                "why": trace.why,
            },
            "results": results,
            "evidence": evidence.as_json(),
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
                raise EmbeddingUnavailable(
                    "no embedder and no lexical engine configured", reason="not_configured"
                )
            trace.why.append("no embedder configured: LexicalOnly")
            strategy = "LexicalOnly"
        return strategy

    async def _embed(self, text: str, deadline: Deadline, trace: Trace) -> np.ndarray[Any, Any]:
        assert self.embedder is not None
        t0 = time.monotonic()
        try:
            budget = deadline.budget(deadline.remaining(), self.settings.fallback_reserve_s)
            with deadline.stage("embed"):
                vec, hit = await self.cache.get_or_embed(self.embedder, text, budget)
        finally:
            trace.timed("embed_time_ms", t0)
        trace.metrics["embedding_cache_hit"] = hit
        return vec

    async def _lexical(
        self, req: QueryRequest, levels: list[str], k: int, deadline: Deadline, trace: Trace
    ) -> Leg:
        t0 = time.monotonic()
        try:
            timed = req.since_ts is not None or req.before_ts is not None
            if self.opensearch is not None and timed:
                # Its documents carry no timestamp, so it cannot filter before its top k.
                trace.why.append("time filter: lexical leg on Postgres BM25, not OpenSearch")
                if not self.settings.pg_lexical:
                    trace.degraded.append({"stage": "lexical", "reason": "time_filter"})
                    return Leg()
            elif self.opensearch is not None:
                try:
                    return await self._opensearch(req, levels, k, deadline, trace)
                except Exception as exc:  # any OpenSearch failure falls back, never fails
                    if isinstance(exc, DeadlineExceeded | asyncio.CancelledError):
                        raise
                    reason = getattr(exc, "tag", None) or type(exc).__name__
                    trace.degraded.append({"stage": "lexical", "reason": f"opensearch_{reason}"})
                    trace.why.append("OpenSearch unavailable, used Postgres lexical")
                    if not self.settings.pg_lexical:
                        return Leg()
            params = {
                "query": req.query,
                "project": req.project,
                "levels": levels,
                "k": k,
                "since": req.since_ts,
                "before": req.before_ts,
            }
            rows = await self._sql(deadline, "lexical", "lexical_search", params, RankedRow)
            trace.engines["lexical"] = "postgres-bm25"
            return Leg.of(rows, "postgres-bm25")
        finally:
            trace.timed("lexical_time_ms", t0)

    async def _opensearch(
        self, req: QueryRequest, levels: list[str], k: int, deadline: Deadline, trace: Trace
    ) -> Leg:
        assert self.opensearch is not None
        with deadline.stage("opensearch"):
            hits = await self.opensearch.asearch(
                req.query,
                req.project,
                levels,
                k,
                deadline.budget(
                    self.settings.opensearch.timeout_s, self.settings.fallback_reserve_s
                ),
            )
        shas = [bytes.fromhex(h.sha256) for h in hits]
        rows = await self._sql(deadline, "lexical", "ids_for_sha256", {"shas": shas}, IdRow)
        ids = {r.key: r.node_id for r in rows}
        leg = Leg(engine="opensearch")
        for h in hits:
            if h.sha256 in ids:
                leg.ids.append(ids[h.sha256])
                leg.scores.append(h.score)
        trace.engines["lexical"] = "opensearch"
        return leg

    async def _semantic(
        self,
        req: QueryRequest,
        levels: list[str],
        embedding: Any,
        k: int,
        deadline: Deadline,
        trace: Trace,
    ) -> Leg:
        params = {
            "embedding": embedding,
            "project": req.project,
            "levels": levels,
            "k": k,
            "ef_search": None,
            "since": req.since_ts,
            "before": req.before_ts,
        }
        return await self._vector_leg("semantic_search", "hnsw", params, deadline, trace)

    async def _by_ids(
        self,
        req: QueryRequest,
        levels: list[str],
        embedding: Any,
        lex: Leg,
        rerank_k: int,
        fusion: str,
        deadline: Deadline,
        trace: Trace,
    ) -> Leg:
        """LexicalFirst: rank exactly the lexical ids by cosine. A convex cascade blends
        cosine with BM25 over all lexical ids, so it needs them all."""
        params = {
            "embedding": embedding,
            "ids": lex.ids,
            "project": req.project,
            "levels": levels,
            "k": max(len(lex.ids), 1) if fusion == "convex" else rerank_k,
            "since": req.since_ts,
            "before": req.before_ts,
        }
        return await self._vector_leg("search_by_ids", "by-ids", params, deadline, trace)

    async def _vector_leg(
        self, name: str, engine: str, params: dict[str, Any], deadline: Deadline, trace: Trace
    ) -> Leg:
        t0 = time.monotonic()
        try:
            rows = await self._sql(deadline, "semantic", name, params, RankedRow)
        finally:
            trace.timed("semantic_time_ms", t0)
        trace.engines["semantic"] = engine
        return Leg.of(rows, engine)

    async def _hydrate(
        self,
        req: QueryRequest,
        order: list[int],
        embedding: np.ndarray[Any, Any] | None,
        deadline: Deadline,
        trace: Trace,
    ) -> list[HydratedRow]:
        t0 = time.monotonic()
        try:
            return await self._sql(
                deadline,
                "provenance",
                "hydrate",
                {"ids": order, "embedding": embedding, "project": req.project},
                HydratedRow,
            )
        finally:
            trace.timed("provenance_time_ms", t0)

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
            rows = await self._sql(deadline, "rerank", "node_texts", {"ids": ids}, IdRow)
            texts = {r.node_id: r.key for r in rows}
            ids = [i for i in ids if i in texts]  # a node deleted since fusion drops out
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
            with deadline.stage("rerank"):
                results = await self.reranker.arerank(
                    req.query, [texts[i] for i in ids], top_n=len(ids), timeout=budget
                )
        except RerankUnavailable as exc:
            trace.degraded.append({"stage": "rerank", "reason": exc.tag})
            trace.why.append(f"reranker failed ({exc.tag}): kept the fused order")
            return None
        finally:
            trace.timed("rerank_time_ms", t0)
        trace.engines["rerank"] = self.reranker.model or "remote"
        return {ids[r.index]: r.score for r in results}


def _time_filter(
    req: QueryRequest, ctx: QueryContext, policy: PolicyRow
) -> tuple[QueryRequest, dict[str, Any]]:
    """The time filter in force and the plan's account of it. The caller's since/until
    always win; a range the optimizer extracted filters only under the policy
    extracted_dates = filter (memory.run_query decides the same way)."""
    plan: dict[str, Any] = {"dates": [d.to_dict() for d in ctx.dates]}
    if req.since is not None or req.until is not None:
        since, before = policy.since_ts, policy.before_ts
        plan.update(since=req.since, until=req.until, source="argument", applied=True)
    elif ctx.time_filter and policy.extracted_dates == "filter":
        since, before = policy.extracted_since_ts, policy.extracted_before_ts
        plan.update(ctx.time_filter, source="extracted", applied=True)
    else:
        plan.update(since=None, until=None, source=None, applied=False, why=None)
        if ctx.time_filter:
            plan["why"] = "the query names a date; policy extracted_dates = annotate: not applied"
        return req, plan
    lo = since.isoformat() if since else "-infinity"
    hi = before.isoformat() if before else "infinity"
    plan["why"] = f"{plan['source']}: only nodes with {lo} <= timestamp < {hi}"
    return dataclasses.replace(req, since_ts=since, before_ts=before), plan


async def _required(task: asyncio.Task[Leg] | None) -> Leg:
    assert task is not None, "the routed strategy needs the lexical leg"
    return await task


def _result(h: HydratedRow, f: FusedRow, rerank_score: float | None) -> dict[str, Any]:
    return {
        "level": h.level,
        "sha256": h.sha256,
        "project": h.project,
        "title": h.title,
        "text": h.text,
        "source": h.source,
        "breadcrumb": h.breadcrumb,
        "timestamp": h.timestamp.isoformat() if h.timestamp else None,
        "query_score": _clip01(h.query_score),
        "lexical_score": f.scores[1],
        "final_score": f.fused_score,
        "rerank_score": rerank_score,
        "semantic_rank": f.ranks[0],
        "lexical_rank": f.ranks[1],
        "fusion_method": f.fusion_method,
        "parents": h.provenance,
        "provenance_truncated": h.provenance_truncated,
    }


def _clip01(x: float | None) -> float | None:
    # Cosine similarity of unit vectors can leave [0, 1] by rounding or for opposed vectors.
    return None if x is None else min(1.0, max(0.0, float(x)))


def _notes(results: list[dict[str, Any]], trace: Trace, reranked: bool, candidates: int) -> str:
    parts = [f"{len(results)} result{'' if len(results) == 1 else 's'}"]
    if reranked:
        parts.append(f"reranker reduced {candidates} candidates to {len(results)}")
    parts.extend(trace.why)
    return "; ".join(parts)
