"""GET /memory/query parameters: parsed and validated once, clamped where documented."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TypeVar

from poimen_core.optimizer import QueryOptimizerError, check_reference_time, reference_time_error
from poimen_memory.errors import ValidationError
from poimen_memory.ingest.nodes import PROJECT_NAME
from poimen_memory.retrieval.models import FUSION_METHODS, LEVELS, STRATEGIES, QueryRequest
from poimen_memory.settings import Settings

N = TypeVar("N", int, float)


def _number(
    params: Mapping[str, str], name: str, default: N, lo: N, hi: N, cast: Callable[[str], N]
) -> N:
    raw = params.get(name)
    if raw is None:
        return default
    try:
        value = cast(raw)
    except ValueError as exc:
        raise ValidationError(f"{name} must be a number, got {raw!r}") from exc
    if not math.isfinite(value):
        raise ValidationError(f"{name} must be a finite number, got {raw!r}")
    return min(max(value, lo), hi)  # clamped, as documented


def parse_query(params: Mapping[str, str], s: Settings) -> QueryRequest:
    for name, value in params.items():
        if "\x00" in value:  # PostgreSQL text cannot hold NUL
            raise ValidationError(f"{name} contains a NUL character")
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
    fusion = params.get("fusion")  # None: the database's policy decides
    if fusion is not None and fusion not in FUSION_METHODS:
        raise ValidationError(f"fusion must be rrf or convex, got {fusion!r}")
    strategy = params.get("strategy")
    if strategy is not None and strategy not in STRATEGIES:
        raise ValidationError(f"unknown strategy {strategy!r}")
    project = params.get("project")
    if project is not None and not PROJECT_NAME.fullmatch(project):
        raise ValidationError(
            f"project {project!r} is not a project name",
            hint="letters, digits, _ . : -; at most 128; starts alphanumeric; omit it for all",
        )
    # since/until are parsed by the database (memory.time_range), as memory.query parses
    # them, so both reject and accept exactly the same values.
    since, until = params.get("since"), params.get("until")
    return QueryRequest(
        since=since,
        until=until,
        reference_time=_reference_time(params.get("reference_time")),
        query=query,
        project=project,
        levels=tuple(dict.fromkeys(levels)),
        limit=_number(params, "limit", s.default_limit, 1, s.max_limit, int),
        timeout_s=_number(
            params, "timeout_seconds", s.default_timeout_s, 1.0, s.max_timeout_s, float
        ),
        fusion=fusion,
        strategy=strategy,
        # None: the database's policy (evidence_budget) decides
        evidence=None
        if params.get("evidence") is None
        else _number(params, "evidence", 0, 0, 100, int),
    )


def _reference_time(raw: str | None) -> datetime | None:
    if raw is None:
        return None
    try:
        # The optimizer's bounds, the same for SQL users (memory.optimize_query).
        return check_reference_time(datetime.fromisoformat(raw))
    except QueryOptimizerError as exc:
        raise ValidationError(str(exc), hint=exc.hint) from exc
    except ValueError as exc:
        error = reference_time_error(repr(raw))
        raise ValidationError(str(error), hint=error.hint) from exc
