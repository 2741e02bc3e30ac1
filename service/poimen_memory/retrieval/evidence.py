"""The evidence an answer cites (memory.select_evidence, sql/072_evidence.sql): the direct L0
legs, started beside the answer's own; the selection, run beside hydrate; and the results'
trees trimmed to the cited turns. The ranking is the database's, as for SQL users of
memory.evidence. A failure here degrades (``degraded`` names the stage ``evidence``, and the
answer keeps its whole trees): the results are ready by then and must not be lost to it."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Protocol, TypeVar

from poimen_memory.errors import PoimenError
from poimen_memory.retrieval.deadline import Deadline
from poimen_memory.retrieval.models import (
    EvidenceRow,
    Leg,
    PolicyRow,
    QueryRequest,
    RankedRow,
    Trace,
)

R = TypeVar("R")


class RunSql(Protocol):
    async def __call__(
        self, deadline: Deadline, stage: str, name: str, params: dict[str, Any], row: type[R]
    ) -> list[R]: ...


class Evidence:
    """One answer's evidence: construct, start the legs, then ``collect`` and ``select``."""

    def __init__(
        self,
        sql: RunSql,
        req: QueryRequest,
        policy: PolicyRow,
        reserve_s: float,
        *,
        reuses_legs: bool,
    ) -> None:
        self.sql, self.req, self.policy, self.reserve_s = sql, req, policy, reserve_s
        self.budget = policy.evidence_budget if req.evidence is None else req.evidence
        # A Hybrid query of L0 alone at the evidence depth (on Postgres BM25) has run the
        # direct legs already; the caller says so.
        self.reuses_legs = bool(self.budget) and reuses_legs
        self.tasks: list[asyncio.Task[Leg]] = []
        self.lexical = self.semantic = Leg()
        self.rows: list[EvidenceRow] | None = None
        self.failed: str | None = None
        self._started = time.monotonic()

    @property
    def runs_legs(self) -> bool:
        return bool(self.budget) and not self.reuses_legs

    def _params(self) -> dict[str, Any]:
        return {
            "project": self.req.project,
            "levels": ["L0"],
            "k": self.policy.evidence_candidates,
            "since": self.req.since_ts,
            "before": self.req.before_ts,
        }

    def start_lexical(self, deadline: Deadline) -> None:
        if self.runs_legs:
            params = {**self._params(), "query": self.req.query}
            self.tasks.append(asyncio.create_task(self._leg("lexical_search", params, deadline)))

    def start_semantic(self, embedding: Any, deadline: Deadline) -> None:
        if self.runs_legs and embedding is not None:
            params = {**self._params(), "embedding": embedding, "ef_search": None}
            self.tasks.append(asyncio.create_task(self._leg("semantic_search", params, deadline)))

    async def _leg(self, name: str, params: dict[str, Any], deadline: Deadline) -> Leg:
        rows = await self.sql(deadline, "evidence", name, params, RankedRow)
        return Leg.of(rows, name)

    async def collect(self, lexical: Leg, semantic: Leg, deadline: Deadline, trace: Trace) -> None:
        """Wait for the direct legs, within the deadline less the fallback reserve (kept for
        hydrating the results); or take the answer's own legs when it ran the same ones."""
        trace.metrics["evidence_legs"] = len(self.tasks)
        if self.reuses_legs:
            self.lexical, self.semantic = lexical, semantic
            return
        if not self.tasks:
            return
        try:
            async with asyncio.timeout(deadline.budget(deadline.remaining(), self.reserve_s)):
                legs = await asyncio.gather(*self.tasks)
        except (PoimenError, TimeoutError) as exc:
            self._degrade(exc, trace)
            return
        finally:
            await self.settle()
            trace.metrics["evidence_legs_time_ms"] = round(
                (time.monotonic() - self._started) * 1000, 3
            )
        self.lexical = next((x for x in legs if x.engine == "lexical_search"), Leg())
        self.semantic = next((x for x in legs if x.engine == "semantic_search"), Leg())

    async def select(
        self, order: list[int], fusion: str, deadline: Deadline, trace: Trace
    ) -> list[EvidenceRow] | None:
        """The cited turns, or None (off, or degraded: the trees stay whole)."""
        if not self.budget or self.failed:
            return None
        t0 = time.monotonic()
        try:
            self.rows = await self.sql(
                deadline,
                "evidence",
                "select_evidence",
                {
                    "result_ids": order,
                    "semantic": json.dumps(self.semantic.as_json()),
                    "lexical": json.dumps(self.lexical.as_json()),
                    "fusion": fusion,
                    "budget": self.budget,
                    "project": self.req.project,
                    "since": self.req.since_ts,
                    "before": self.req.before_ts,
                    "dense_weight": self.req.dense_weight,
                    "rrf_k": self.req.rrf_k,
                },
                EvidenceRow,
            )
        except PoimenError as exc:
            self._degrade(exc, trace)
            return None
        finally:
            trace.timed("evidence_time_ms", t0)
        return self.rows

    def _degrade(self, exc: BaseException, trace: Trace) -> None:
        self.failed = exc.code if isinstance(exc, PoimenError) else "timeout"
        trace.degraded.append({"stage": "evidence", "reason": self.failed})
        trace.why.append(f"evidence failed ({self.failed}): the results keep their whole trees")

    async def settle(self) -> None:
        """Cancel what still runs and retrieve every outcome (no task outlives the request)."""
        for t in self.tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def trim(self, results: list[dict[str, Any]]) -> None:
        """Each result's tree without the L0 turns the evidence does not cite. A sha256 is
        unique only within a project, and a tree stays within its result's project."""
        if self.rows is None:
            return
        cited = {(e.project, e.sha256) for e in self.rows}
        for r in results:
            keep = {sha for project, sha in cited if project == r["project"]}
            r["parents"], r["provenance_l0_omitted"] = cited_only(r["parents"], keep)

    def plan(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "budget": self.budget,
            "source": "policy" if self.req.evidence is None else "argument",
            "direct_candidates": len(self.lexical.ids) + len(self.semantic.ids),
        }
        if self.failed:
            out["degraded"] = self.failed
        return out

    def as_json(self) -> list[dict[str, Any]]:
        return [_row(e) for e in self.rows or []]


def _row(e: EvidenceRow) -> dict[str, Any]:
    return {
        "rank": e.rank,
        "level": "L0",
        "sha256": e.sha256,
        "external_id": e.external_id,
        "project": e.project,
        "title": e.title,
        "text": e.text,
        "source": e.source,
        "breadcrumb": e.breadcrumb,
        "timestamp": e.timestamp.isoformat() if e.timestamp else None,
        "score": e.score,
        "direct_rank": e.direct_rank,
        "cited_by": e.cited_by,
        "neighbour_score": e.neighbour_score,
    }


def cited_only(parents: list[dict[str, Any]], cited: set[str]) -> tuple[list[dict[str, Any]], int]:
    """The tree without the L0 turns not in ``cited`` (sha256), and how many it left out."""
    kept, omitted = [], 0
    for node in parents:
        if node.get("level") == "L0" and node.get("sha256") not in cited:
            omitted += 1
            continue
        below, n = cited_only(node.get("parents") or [], cited)
        kept.append({**node, "parents": below})
        omitted += n
    return kept, omitted
