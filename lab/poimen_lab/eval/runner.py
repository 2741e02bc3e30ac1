"""Runs evaluation queries through the real query path (Retriever.query, as behind
GET /memory/query) and, for depth-100 measures, through the stage SQL functions.

Which path each mode uses (top-`limit` ranking and latency; then the depth-100 ranking
behind recall@100, which the Retriever cannot give because POIMEN_MAX_LIMIT caps it at 50):

- lexical: Retriever, LexicalOnly; memory.lexical_search(k=100).
- semantic: Retriever, SemanticOnly; memory.semantic_search(k=100).
- hybrid / hybrid-convex: Retriever, Hybrid, fusion rrf / convex; lexical_search and
  semantic_search at max(candidates, 100), then memory.fuse_legs(final_k=100) at the
  database's policy (memory.policy(): RRF k, dense weight), as the service fuses.
- cascade: Retriever, LexicalFirst (fusion as the service defaults); lexical_search(k=
  cascade_candidates), then memory.search_by_ids: its first 100 (classic cascade), or all
  of them blended with the BM25 scores by memory.fuse(convex) (convex cascade).
- auto: Retriever, strategy chosen by the optimizer; the deep path of that strategy.
- hybrid-rerank: Retriever with the reranker (POIMEN_RERANK_URL); no deep path.
- exact: query embedding + memory.exact_search(k=limit); memory.exact_search(k=100).

The query-embedding cache is disabled, so every mode pays for embedding its query.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from psycopg_pool import AsyncConnectionPool

from poimen_lab.eval.data import Query
from poimen_memory.db.queries import q
from poimen_memory.embedders.base import Embedder
from poimen_memory.errors import PoimenError
from poimen_memory.retrieval.pipeline import QueryRequest, Retriever
from poimen_memory.retrieval.policy import Policy
from poimen_memory.settings import Settings


@dataclass(frozen=True)
class Mode:
    strategy: str | None
    fusion: str | None = None
    rerank: bool = False
    exact: bool = False


MODES: dict[str, Mode] = {
    "lexical": Mode("LexicalOnly"),
    "semantic": Mode("SemanticOnly"),
    "exact": Mode(None, exact=True),
    "hybrid": Mode("Hybrid", "rrf"),
    "hybrid-convex": Mode("Hybrid", "convex"),
    "cascade": Mode("LexicalFirst"),
    "auto": Mode(None),
    "hybrid-rerank": Mode("Hybrid", "rrf", rerank=True),
}
DEEP_PATHS = {
    "lexical": "memory.lexical_search(k=depth)",
    "semantic": "memory.semantic_search(k=depth)",
    "exact": "memory.exact_search(k=depth)",
    "hybrid": "lexical + semantic_search at max(candidates, depth), memory.fuse(rrf)",
    "hybrid-convex": "lexical + semantic_search at max(candidates, depth), memory.fuse(convex)",
    "cascade": "lexical_search(k=cascade_candidates), search_by_ids, as the service fuses them",
    "auto": "the deep path of the strategy the optimizer chose",
}


@dataclass(frozen=True)
class Corpus:
    """Maps between the database's ids/hashes and the input files' external ids."""

    by_sha: dict[str, str]
    by_db_id: dict[int, str]
    l2_of: dict[str, set[str]] = field(default_factory=dict)
    """For each node, the L2 syntheses above it (walking the parents edges upwards)."""


# The result counts evidence recall is measured at (one response per count).
EVIDENCE_KS = (5, 10)


@dataclass
class Outcome:
    ranked: list[str] = field(default_factory=list)
    deep: list[str] | None = None
    latency_ms: float = 0.0
    strategy: str | None = None
    fusion: str | None = None
    """The fusion_method the response reports (rrf, convex, cascade, cascade+convex, none)."""
    error: str | None = None
    stages: dict[str, float] = field(default_factory=dict)
    """The response's per-stage timings (embed/lexical/semantic/fusion/provenance, ms)."""
    evidence: list[tuple[str, frozenset[str]]] | None = None
    """Top results at levels L1,L2: (external id, L0 external ids its provenance cites)."""
    cited: dict[int, frozenset[str]] = field(default_factory=dict)
    """Per result count k: every L0 turn a k-result response cites, in its provenance
    trees and its evidence list alike."""


def _l0_citations(parents: Sequence[dict[str, Any]], by_sha: dict[str, str]) -> set[str]:
    out: set[str] = set()
    stack = list(parents)
    while stack:
        node = stack.pop()
        if node.get("level") == "L0" and node.get("sha256") in by_sha:
            out.add(by_sha[node["sha256"]])
        stack.extend(node.get("parents") or [])
    return out


class Runner:
    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        embedder: Embedder,
        settings: Settings,
        corpus: Corpus,
        *,
        levels: tuple[str, ...],
        limit: int,
        depth: int,
        retriever: Retriever,
        policy: Policy,
        rerank_retriever: Retriever | None = None,
    ) -> None:
        self.pool, self.embedder, self.settings, self.corpus = pool, embedder, settings, corpus
        self.policy = policy
        self.levels, self.limit, self.depth = levels, limit, depth
        self.retriever, self.rerank_retriever = retriever, rerank_retriever
        self._vectors: dict[str, np.ndarray[Any, Any]] = {}

    async def _rows(self, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(q(name), params)
            rows: list[tuple[Any, ...]] = await cur.fetchall()
            return rows

    async def vector(self, query: Query) -> np.ndarray[Any, Any]:
        """The query embedding for the untimed depth-100 path (computed once per query)."""
        if query.id not in self._vectors:
            self._vectors[query.id] = await asyncio.to_thread(self.embedder.embed_query, query.text)
        return self._vectors[query.id]

    def _ext(self, ids: Sequence[int]) -> list[str]:
        return [self.corpus.by_db_id[i] for i in ids if i in self.corpus.by_db_id]

    async def run(self, mode_name: str, query: Query, *, evidence_k: int = 0) -> Outcome:
        mode = MODES[mode_name]
        out = Outcome()
        try:
            if mode.exact:
                t0 = time.perf_counter()
                vec = await asyncio.to_thread(self.embedder.embed_query, query.text)
                rows = await self._rows(
                    "exact_search",
                    {
                        "embedding": vec,
                        "project": query.project,
                        "levels": list(self.levels),
                        "k": self.limit,
                        "since": None,
                        "before": None,
                    },
                )
                out.latency_ms = (time.perf_counter() - t0) * 1000
                out.ranked = self._ext([r[0] for r in rows])
                out.strategy = "exact"
            else:
                t0 = time.perf_counter()
                resp = await self._query(mode, query, self.levels, self.limit)
                out.latency_ms = (time.perf_counter() - t0) * 1000
                out.strategy = resp["search_strategy"]
                if resp["results"]:
                    out.fusion = resp["results"][0]["fusion_method"]
                out.stages = {
                    k.removesuffix("_time_ms"): float(v)
                    for k, v in resp["metrics"].items()
                    if k.endswith("_time_ms") and isinstance(v, int | float)
                }
                out.ranked = [
                    self.corpus.by_sha[r["sha256"]]
                    for r in resp["results"]
                    if r["sha256"] in self.corpus.by_sha
                ]
            if not mode.rerank:
                out.deep = await self.deep(mode_name, out.strategy or "", out.fusion, query)
            if evidence_k and not mode.exact:
                for k in EVIDENCE_KS:
                    if k <= evidence_k:
                        out.evidence, out.cited[k] = await self._evidence(mode, query, k)
        except PoimenError as err:
            out.error = f"{err.code}: {err.message}"
        return out

    async def _query(
        self, mode: Mode, query: Query, levels: tuple[str, ...], limit: int
    ) -> dict[str, Any]:
        retriever = self.rerank_retriever if mode.rerank else self.retriever
        assert retriever is not None
        req = QueryRequest(
            query=query.text,
            project=query.project,
            levels=levels,
            limit=limit,
            timeout_s=self.settings.max_timeout_s,
            fusion=mode.fusion,
            strategy=mode.strategy,
        )
        return await retriever.query(req)

    async def _evidence(
        self, mode: Mode, query: Query, k: int
    ) -> tuple[list[tuple[str, frozenset[str]]], frozenset[str]]:
        resp = await self._query(mode, query, ("L1", "L2"), k)
        by_sha = self.corpus.by_sha
        trees = [
            (by_sha[r["sha256"]], frozenset(_l0_citations(r["parents"] or [], by_sha)))
            for r in resp["results"]
            if r["sha256"] in by_sha
        ]
        listed = {by_sha[e["sha256"]] for e in resp.get("evidence") or [] if e["sha256"] in by_sha}
        return trees, frozenset(listed.union(*(cites for _, cites in trees)))

    async def deep(
        self, mode_name: str, strategy: str, fusion: str | None, query: Query
    ) -> list[str]:
        """The depth-``depth`` ranking of a mode through the stage SQL functions, fused the
        way the response says the service fused it (``fusion``): the candidates before the
        relevance floor holds any back (recall@100 measures the legs, not the floor)."""
        d, s = self.depth, self.policy
        base = {
            "project": query.project,
            "levels": list(self.levels),
            "since": None,
            "before": None,
        }
        if mode_name == "exact" or strategy == "SemanticOnly":
            name = "exact_search" if mode_name == "exact" else "semantic_search"
            vec = await self.vector(query)
            rows = await self._rows(name, {**base, "embedding": vec, "k": d, "ef_search": None})
            return self._ext([r[0] for r in rows])
        if strategy == "LexicalOnly":
            rows = await self._rows("lexical_search", {**base, "query": query.text, "k": d})
            return self._ext([r[0] for r in rows])
        vec = await self.vector(query)
        mode = MODES[mode_name]
        if fusion not in ("rrf", "convex", "cascade", "cascade+convex"):
            fusion = mode.fusion or s.fusion  # no results to read it from
        if strategy == "LexicalFirst":
            lex = await self._rows(
                "lexical_search", {**base, "query": query.text, "k": s.cascade_candidates}
            )
            ids = [r[0] for r in lex]
            convex = fusion in ("convex", "cascade+convex")
            sem = await self._rows(
                "search_by_ids",
                {**base, "embedding": vec, "ids": ids, "k": max(len(ids), 1) if convex else d},
            )
            if not convex:
                return self._ext([r[0] for r in sem])
            rows = await self._fuse(sem, lex, "LexicalFirst", "convex", d)
            return self._ext([r[0] for r in rows])
        depth = max(s.candidates, d)
        lex = await self._rows("lexical_search", {**base, "query": query.text, "k": depth})
        sem = await self._rows(
            "semantic_search", {**base, "embedding": vec, "k": depth, "ef_search": None}
        )
        rows = await self._fuse(sem, lex, "Hybrid", "convex" if fusion == "convex" else "rrf", d)
        return self._ext([r[0] for r in rows])

    async def _fuse(
        self,
        sem: Sequence[tuple[Any, ...]],
        lex: Sequence[tuple[Any, ...]],
        strategy: str,
        fusion: str,
        final_k: int,
    ) -> list[tuple[Any, ...]]:
        """memory.fuse_legs, the function the service fuses with, at the policy's weights."""
        params = {
            "semantic": json.dumps({"ids": [r[0] for r in sem], "scores": [r[2] for r in sem]}),
            "lexical": json.dumps({"ids": [r[0] for r in lex], "scores": [r[2] for r in lex]}),
            "strategy": strategy,
            "fusion": fusion,
            "dense_weight": self.policy.dense_weight,
            "k": self.policy.rrf_k,
            "final_k": final_k,
        }
        return await self._rows("fuse_legs", params)
