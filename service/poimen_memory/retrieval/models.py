"""What goes into and comes out of the pipeline: the request, the policy the database
hands out, and one typed row class per statement (psycopg ``class_row``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from poimen_memory.retrieval.policy import Policy

LEVELS = ("L0", "L1", "L2")
FUSION_METHODS = ("rrf", "convex")
STRATEGIES = ("LexicalOnly", "LexicalFirst", "Hybrid", "SemanticOnly")


@dataclass(frozen=True)
class QueryRequest:
    query: str
    project: str | None = None
    levels: tuple[str, ...] = ("L1", "L2")
    limit: int = 5
    timeout_s: float = 5.0
    strategy: str | None = None
    # None: memory.policy() decides (the same policy memory.query applies).
    fusion: str | None = None
    rrf_k: int | None = None
    dense_weight: float | None = None
    candidates: int | None = None
    # The time filter as given (inclusive ISO dates or timestamps; memory.time_range parses
    # them), and the time relative dates in the query are resolved against (None: now).
    since: str | None = None
    until: str | None = None
    reference_time: datetime | None = None
    # The most L0 turns the response cites (0: evidence off, full provenance trees; None:
    # the policy's evidence_budget).
    evidence: int | None = None
    # The filter in force, resolved by the pipeline from the above and the policy:
    # since_ts <= timestamp < before_ts (either None: unbounded). Not read from the request.
    since_ts: datetime | None = None
    before_ts: datetime | None = None


@dataclass(frozen=True)
class PolicyRow(Policy):
    """memory.policy(), plus whether the requested project exists (one round trip)."""

    project_exists: bool
    embedding_model: str | None
    """The model the stored vectors were made with (None before the first ingest)."""
    since_ts: datetime | None
    before_ts: datetime | None
    """The request's since/until as memory.time_range parsed them (before is exclusive)."""
    extracted_since_ts: datetime | None
    extracted_before_ts: datetime | None
    """The same for the range the optimizer extracted from the query's text."""


@dataclass(frozen=True)
class RankedRow:
    node_id: int
    rank: int
    score: float


@dataclass(frozen=True)
class FusedRow:
    node_id: int
    ranks: list[int | None]
    """[semantic rank, lexical rank]; None where the node was not in that leg."""
    scores: list[float | None]
    fused_score: float
    fusion_method: str


@dataclass(frozen=True)
class NodeRow:
    """What an answer shows of a node, in results and evidence alike."""

    node_id: int
    sha256: str
    project: str
    title: str | None
    text: str
    source: str | None
    breadcrumb: list[str] | None
    timestamp: datetime | None


@dataclass(frozen=True)
class HydratedRow(NodeRow):
    level: str
    query_score: float | None
    provenance: list[dict[str, Any]]
    provenance_truncated: bool


@dataclass(frozen=True)
class EvidenceRow(NodeRow):
    """memory.select_evidence: one cited L0 turn."""

    rank: int
    external_id: str | None
    score: float
    direct_rank: int | None
    cited_by: list[int]
    neighbour_score: float


@dataclass(frozen=True)
class IdRow:
    node_id: int
    key: str


@dataclass
class Leg:
    ids: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    engine: str | None = None

    @classmethod
    def of(cls, rows: list[RankedRow], engine: str) -> Leg:
        return cls([r.node_id for r in rows], [r.score for r in rows], engine)

    def as_json(self) -> dict[str, list[Any]]:
        return {"ids": self.ids, "scores": self.scores}


@dataclass
class Trace:
    metrics: dict[str, Any] = field(default_factory=dict)
    degraded: list[dict[str, str]] = field(default_factory=list)
    engines: dict[str, str | None] = field(default_factory=dict)
    why: list[str] = field(default_factory=list)

    def timed(self, key: str, started: float) -> None:
        self.metrics[key] = round((time.monotonic() - started) * 1000, 3)
