"""GET /memory/query: what a database should not do, around the one plan the database makes.

The service routes the text with poimen_core.optimizer (the module PL/Python runs), then
asks the database for the plan (memory._serve_start, sql/071_execute.sql, over the planner
of sql/066_plan.sql: route, fusion, each leg's engine and depth, time range, evidence
budget) and its Postgres lexical legs while it embeds the query, calls OpenSearch when the
plan wants it (meanwhile the database runs the semantic leg: memory._serve through
'semantic'), and has the database run the rest of the plan in one statement
(memory._serve): the semantic leg unless it ran already, fusion, provenance and the
evidence list. With a reranker, the fused candidates come back first and a third statement
(memory._serve_finish) finishes the answer in the reranker's order. memory.query and
memory.answer run the same plan through the same executor, so SQL and HTTP answer alike.

Each statement is one round trip: autocommit (no BEGIN/COMMIT for a read), the tenant's
projects inside the statement's arguments, and the deadline held here. When it passes, the
task is cancelled and psycopg cancels the statement on the server; the pool's connections
carry POIMEN_MAX_TIMEOUT_S as their statement_timeout, a bound for any statement whose
client went away.

With read replicas configured (POIMEN_READ_URLS) a query runs on a standby that passed its
last check (db/replicas.py), and again on the primary if it fails there; everything else
that uses `Retriever.connection` (API keys) stays on the primary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from contextvars import ContextVar
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np
import psycopg
from psycopg_pool import AsyncConnectionPool

from poimen_core.optimizer import QueryOptimizerError, optimize_query
from poimen_core.vocabulary import LEVELS
from poimen_memory.db import tenant
from poimen_memory.db.connect import Lender
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
from poimen_memory.retrieval.models import QueryRequest, Trace
from poimen_memory.retrieval.response import response
from poimen_memory.settings import Settings
from poimen_memory.upstreams.rerank import RerankClient

__all__ = ["LEVELS", "QueryRequest", "Retriever"]

# The pool this request reads from: a replica's, or unset for the primary.
_READ_POOL: ContextVar[AsyncConnectionPool[Any] | None] = ContextVar("read_pool", default=None)


@dataclass
class Retriever:
    """Runs one query; built once per process by services.open_services."""

    lender: Lender
    embedder: Embedder | None
    cache: QueryEmbeddingCache
    settings: Settings
    _: KW_ONLY
    reranker: RerankClient | None = None
    opensearch: Any | None = None
    replicas: ReplicaSet | None = None
    # The model of the database's vectors at the last plan (None: none seen yet).
    _db_model: str | None = field(default=None, init=False, repr=False)

    @property
    def lexical_engines(self) -> list[str]:
        engines = ["postgres"] if self.settings.pg_lexical else []
        return engines + (["opensearch"] if self.opensearch is not None else [])

    # -- database ------------------------------------------------------------------------

    async def _row(
        self, deadline: Deadline, stage: str, name: str, params: dict[str, Any]
    ) -> tuple[Any, ...]:
        """One statement returning one row: one round trip, no transaction."""
        deadline.check(stage)
        with deadline.stage(stage), wrap_exceptions(stage):
            async with self.connection(deadline, stage) as conn:
                cur = await conn.execute(q(name), params)
                row: tuple[Any, ...] | None = await cur.fetchone()
        assert row is not None
        return row

    async def _call(
        self, deadline: Deadline, stage: str, name: str, params: dict[str, Any]
    ) -> dict[str, Any]:
        """One statement returning one jsonb document."""
        doc: dict[str, Any] = (await self._row(deadline, stage, name, params))[0]
        return doc

    def connection(
        self, deadline: Deadline, stage: str
    ) -> contextlib.AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]:
        """A pooled connection within the deadline (db/connect.py, Lender), from the read
        replica this request was routed to, if any."""
        return self.lender.connection(deadline, stage, _READ_POOL.get())

    # -- one query -----------------------------------------------------------------------

    async def query(self, req: QueryRequest, *, started: float | None = None) -> dict[str, Any]:
        """The answer to ``req`` within its timeout, counted from ``started`` (a
        time.monotonic(); default now): a request that waited in the admission queue has
        that much less time."""
        deadline = Deadline(req.timeout_s, time.monotonic() if started is None else started)
        try:
            async with asyncio.timeout(deadline.remaining() + 0.05):
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

    def _request(self, req: QueryRequest) -> dict[str, Any]:
        """The request document memory._plan reads (the routing is poimen_core's)."""
        try:
            routing = optimize_query(req.query, req.reference_time).to_dict()
        except QueryOptimizerError as exc:
            raise ValidationError(str(exc)) from exc
        return req.document(routing)

    def _caps(self) -> dict[str, Any]:
        """What this service brings to the plan, and the caller's projects."""
        if self.embedder is None and not self.lexical_engines:
            raise EmbeddingUnavailable(
                "no embedder and no lexical engine configured", reason="not_configured"
            )
        projects = tenant.current().params()
        return {
            "vector": self.embedder is not None,
            "embed_model": self.embedder.model_name if self.embedder else None,
            "lexical": self.lexical_engines,
            "rerank_depth": None,
            "read_projects": projects["read"],
            "write_projects": projects["write"],
        }

    async def _query(self, req: QueryRequest, deadline: Deadline, trace: Trace) -> dict[str, Any]:
        body = self._request(req)
        # Encoded once: every statement of the query takes the same request document.
        req_json = json.dumps(body)
        caps = self._caps()
        if self.reranker is not None:
            caps["rerank_depth"] = req.limit * self.settings.rerank_depth_factor
        tasks: dict[str, asyncio.Task[Any]] = {}
        # The embedding starts beside the first statement (the plan and the lexical legs)
        # when the route will want it: the strategy forced, or the one poimen_core's
        # optimizer chose (the routing the plan is made from), unless the database's vectors
        # were another model's at its last plan. The plan decides; a vector it does not
        # want is dropped.
        if (
            self.embedder is not None
            and self._db_model in (None, self.embedder.model_name)
            and (req.strategy or body["routing"]["search_strategy"]) != "LexicalOnly"
        ):
            tasks["embed"] = asyncio.create_task(self._embed(req.query, deadline, trace))
        try:
            plan, prefetched = await self._start(req_json, caps, deadline)
            self._db_model = plan["embedding_model"]
            if plan["needs_embedding"] and "embed" not in tasks:
                tasks["embed"] = asyncio.create_task(self._embed(req.query, deadline, trace))
            elif not plan["needs_embedding"] and "embed" in tasks:
                dropped = tasks.pop("embed")
                dropped.cancel()
                await asyncio.gather(dropped, return_exceptions=True)
                trace.metrics.pop("embed_time_ms", None)
                trace.metrics.pop("embedding_cache_hit", None)
            if plan["lexical"]["engine"] == "opensearch":
                tasks["opensearch"] = asyncio.create_task(
                    self._opensearch(req, plan, deadline, trace)
                )
                if plan["semantic"]["engine"] == "hnsw" and "embed" in tasks:
                    # The semantic leg does not wait for OpenSearch: a statement of its own
                    # runs it once the vector is there, and memory._serve takes it back.
                    tasks["semantic"] = asyncio.create_task(
                        self._semantic(req_json, caps, prefetched, tasks["embed"], deadline)
                    )
            embedding, hits = await self._upstreams(tasks, caps, deadline)
            if "embed_failed" in caps and self.opensearch is not None and hits is None:
                tasks.pop("embed", None)  # done, and failed
                # The embedder failed: the plan changes (LexicalOnly), and its lexical leg
                # may now be OpenSearch's, which the first plan did not ask for.
                plan, prefetched = await self._start(req_json, caps, deadline)
                if plan["lexical"]["engine"] == "opensearch":
                    tasks["opensearch"] = asyncio.create_task(
                        self._opensearch(req, plan, deadline, trace)
                    )
                    _, hits = await self._upstreams(tasks, caps, deadline)
            if "semantic" in tasks:
                # OpenSearch's plans only: the semantic leg joins the first statement's.
                prefetched = json.dumps(json.loads(prefetched) | await tasks["semantic"])
        finally:
            for t in tasks.values():
                t.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)

        params = {
            "req": req_json,
            "caps": json.dumps(caps),
            "embedding": embedding,
            "hits": json.dumps(hits) if hits is not None else None,
            "prefetched": prefetched,
        }
        t0 = time.monotonic()
        stage = _running(plan)
        if self.reranker is None:
            doc = await self._call(deadline, stage, "serve", {**params, "through": "answer"})
            trace.engines["rerank"] = None
            trace.degraded.append({"stage": "rerank", "reason": "not_configured"})
            reranked: dict[int, float] | None = None
        else:
            fused = await self._call(deadline, stage, "serve", {**params, "through": "candidates"})
            order, reranked = await self._rerank(req, fused, deadline, trace)
            doc = await self._call(
                deadline,
                "provenance, evidence (in one statement)",
                "serve_finish",
                {
                    "req": params["req"],
                    "caps": params["caps"],
                    "state": json.dumps(fused["state"]),
                    "embedding": embedding,
                    "order": order,
                    "rerank": json.dumps(
                        {str(k): v for k, v in reranked.items()} if reranked else None
                    ),
                },
            )
        trace.metrics["database_time_ms"] = round((time.monotonic() - t0) * 1000, 3)
        return response(req, doc, trace, reranked is not None, deadline.elapsed_ms())

    async def _start(
        self, req_json: str, caps: dict[str, Any], deadline: Deadline
    ) -> tuple[dict[str, Any], str]:
        """The first statement: the plan, and the Postgres lexical legs it names, as the
        JSON text memory._serve takes back (prefetched). That text is handed back unread:
        it holds the legs' hits, the plan and the request it was made for (4.7 kB on
        LoCoMo), whose parsing and encoding again cost each query about 0.14 ms of CPU."""
        plan, prefetched = await self._row(
            deadline,
            "plan, lexical (in one statement)",
            "serve_start",
            {"req": req_json, "caps": json.dumps(caps)},
        )
        return plan, prefetched

    async def _upstreams(
        self, tasks: dict[str, asyncio.Task[Any]], caps: dict[str, Any], deadline: Deadline
    ) -> tuple[np.ndarray[Any, Any] | None, list[dict[str, Any]] | None]:
        """The query's vector and OpenSearch's hits. A failure of either degrades: it is
        told to the plan through ``caps`` (embed_failed, opensearch_failed), which then
        routes without it, unless nothing is left to answer with."""
        embedding: np.ndarray[Any, Any] | None = None
        hits: list[dict[str, Any]] | None = None
        if "opensearch" in tasks:
            try:
                hits = await tasks["opensearch"]
            except Exception as exc:  # any OpenSearch failure falls back, never fails
                if isinstance(exc, DeadlineExceeded | asyncio.CancelledError):
                    raise
                caps["opensearch_failed"] = getattr(exc, "tag", None) or type(exc).__name__
        if "embed" in tasks:
            try:
                embedding = await tasks["embed"]
            except EmbeddingUnavailable as exc:
                if not self.lexical_engines:
                    raise EmbeddingUnavailable(
                        f"embedder unavailable ({exc.tag}) and no lexical engine to fall back to",
                        reason=exc.reason,
                        status=exc.status,
                        detail=str(exc),
                    ) from exc
                deadline.check("embed")
                caps["vector"], caps["embed_failed"] = False, exc.tag
        return embedding, hits

    async def _semantic(
        self,
        req_json: str,
        caps: dict[str, Any],
        prefetched: str,
        embedded: asyncio.Task[np.ndarray[Any, Any]],
        deadline: Deadline,
    ) -> dict[str, Any]:
        """The plan's semantic leg, run while OpenSearch answers (memory._serve through
        'semantic', given the first statement's prefetched so that it takes back that plan):
        what memory._serve takes back as prefetched when its plan is the same (it is not
        when OpenSearch failed meanwhile). Nothing without a vector (_upstreams degrades the
        plan then)."""
        try:
            embedding = await embedded
        except EmbeddingUnavailable:
            return {}
        return await self._call(
            deadline,
            "semantic (in one statement)",
            "serve_semantic",
            {
                "req": req_json,
                "caps": json.dumps(caps),
                "embedding": embedding,
                "prefetched": prefetched,
            },
        )

    async def _embed(self, text: str, deadline: Deadline, trace: Trace) -> np.ndarray[Any, Any]:
        assert self.embedder is not None
        t0 = time.monotonic()
        try:
            budget = deadline.budget(deadline.remaining(), self.settings.fallback_reserve_s)
            with deadline.stage("embed"):
                # per API key: a tenant learns nothing of another's questions from a hit
                vec, hit = await self.cache.get_or_embed(
                    self.embedder, text, budget, tenant.current().params()["key"]
                )
        finally:
            trace.timed("embed_time_ms", t0)
        trace.metrics["embedding_cache_hit"] = hit
        return vec

    async def _opensearch(
        self, req: QueryRequest, plan: dict[str, Any], deadline: Deadline, trace: Trace
    ) -> list[dict[str, Any]]:
        """OpenSearch's hits for the plan's lexical leg, with the query grammar as the
        planner parsed it (memory.parse_query)."""
        assert self.opensearch is not None
        k = plan["lexical"]["depth"]
        t0 = time.monotonic()
        try:
            with deadline.stage("opensearch"):
                found = await self.opensearch.asearch(
                    req.query,
                    req.project,
                    list(req.levels),
                    k,
                    deadline.budget(
                        self.settings.opensearch.timeout_s, self.settings.fallback_reserve_s
                    ),
                    plan.get("grammar"),
                )
        finally:
            trace.timed("opensearch_time_ms", t0)
        return [{"sha256": h.sha256, "score": h.score} for h in found]

    async def _rerank(
        self, req: QueryRequest, fused: dict[str, Any], deadline: Deadline, trace: Trace
    ) -> tuple[list[int], dict[int, float] | None]:
        """The results' order: the reranker's over the fused candidates, or the fused top k
        when it fails or the deadline leaves it no time (a ``degraded`` entry says which)."""
        assert self.reranker is not None
        texts = {int(k): v for k, v in fused["texts"].items()}
        # A node deleted since fusion drops out.
        ids = [int(f["node_id"]) for f in fused["state"]["fused"] if int(f["node_id"]) in texts]
        if not ids:
            return [], None
        t0 = time.monotonic()
        # The configured rerank timeout applies, and rerank_min_remaining_s of the deadline
        # stays for the answer, so a slow reranker degrades to the fused order instead of
        # timing the whole request out.
        budget = min(
            self.reranker.timeout_s, deadline.remaining() - self.settings.rerank_min_remaining_s
        )
        try:
            if budget <= 0:
                trace.degraded.append({"stage": "rerank", "reason": "insufficient_time"})
                return ids[: req.limit], None
            with deadline.stage("rerank"):
                results = await self.reranker.arerank(
                    req.query, [texts[i] for i in ids], top_n=len(ids), timeout=budget
                )
        except RerankUnavailable as exc:
            trace.degraded.append({"stage": "rerank", "reason": exc.tag})
            trace.why.append(f"reranker failed ({exc.tag}): kept the fused order")
            return ids[: req.limit], None
        finally:
            trace.timed("rerank_time_ms", t0)
        trace.engines["rerank"] = self.reranker.model or "remote"
        scores = {ids[r.index]: r.score for r in results}
        # Candidates the reranker left unscored (it may return fewer than asked) go last,
        # in fused order.
        order = sorted(ids, key=lambda i: (i not in scores, -scores.get(i, 0.0), ids.index(i)))
        return order[: req.limit], scores


def _running(plan: dict[str, Any]) -> str:
    """What the query statement runs, for a deadline's account of what it waited for."""
    parts = [leg for leg in ("lexical", "semantic") if plan[leg]["engine"]]
    parts += ["fusion", "provenance"]
    if plan["evidence"]["budget"]:
        parts.append("evidence")
    return ", ".join(parts) + " (in one statement)"
