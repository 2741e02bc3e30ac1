"""What goes into the pipeline (the request) and what it keeps of its own work (the trace)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from poimen_core.vocabulary import FUSIONS as FUSION_METHODS
from poimen_core.vocabulary import LEVELS, STRATEGIES, UNSUPPORTED

__all__ = ["FUSION_METHODS", "LEVELS", "STRATEGIES", "UNSUPPORTED", "QueryRequest", "Trace"]


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
    # A JSON object a node's metadata must contain (memory.check_filter), in every leg.
    filter: dict[str, Any] | None = None
    # The relevance floor (cosine, -1..1; None: the policy's min_cosine).
    min_cosine: float | None = None
    # Time travel: the versions the database held then (None: the current ones), and the
    # instant valid time is tested at (None: as_of, else now).
    as_of: datetime | None = None
    valid_at: datetime | None = None
    # Results in doubt (support stale, partial, none): demote, exclude or keep (None: the
    # policy's unsupported, memory.policy).
    unsupported: str | None = None


@dataclass
class Trace:
    metrics: dict[str, Any] = field(default_factory=dict)
    degraded: list[dict[str, str]] = field(default_factory=list)
    engines: dict[str, str | None] = field(default_factory=dict)
    why: list[str] = field(default_factory=list)

    def timed(self, key: str, started: float) -> None:
        self.metrics[key] = round((time.monotonic() - started) * 1000, 3)
