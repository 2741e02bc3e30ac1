"""GET /memory/query parameters: parsed and validated once, clamped where documented."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

from poimen_core.optimizer import QueryOptimizerError, check_reference_time, reference_time_error
from poimen_core.vocabulary import FILTER_MAX_BYTES, FILTER_MAX_DEPTH
from poimen_memory.errors import ValidationError
from poimen_memory.ingest.nodes import PROJECT_NAME
from poimen_memory.retrieval.models import (
    FUSION_METHODS,
    LEVELS,
    STRATEGIES,
    UNSUPPORTED,
    QueryRequest,
)
from poimen_memory.settings import Settings

N = TypeVar("N", int, float)

# The largest metadata filter, as JSON text, and its deepest nesting (the object itself is
# 1): the vocabulary's, which memory.check_filter holds too.
MAX_FILTER_BYTES = FILTER_MAX_BYTES
MAX_FILTER_DEPTH = FILTER_MAX_DEPTH


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _parsed(name: str, raw: str, cast: Callable[[str], N]) -> N:
    try:
        return cast(raw)
    except ValueError as exc:
        raise ValidationError(f"{name} must be a number, got {raw!r}") from exc


def _number(
    params: Mapping[str, str], name: str, default: N, lo: N, hi: N, cast: Callable[[str], N]
) -> N:
    raw = params.get(name)
    if raw is None:
        return default
    value = _parsed(name, raw, cast)
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
        filter=parse_filter(params.get("filter")),
        min_cosine=_min_cosine(params.get("min_cosine")),
        as_of=_instant(params.get("as_of"), "as_of"),
        valid_at=_instant(params.get("valid_at"), "valid_at"),
        unsupported=_choice(params, "unsupported", UNSUPPORTED),
    )


def _choice(params: Mapping[str, str], name: str, allowed: tuple[str, ...]) -> str | None:
    """A parameter that takes one of a few words (None: the database's policy decides)."""
    raw = params.get(name)
    if raw is None:
        return None
    if raw not in allowed:
        raise ValidationError(
            f"{name} must be one of {', '.join(allowed)}, got {raw!r}",
            hint=f"omit {name} for the policy's choice",
        )
    return raw


def _instant(raw: str | None, name: str) -> datetime | None:
    """as_of / valid_at: an ISO 8601 instant (UTC unless it has an offset); its range is
    the database's to check (memory.check_instant), as for SQL users."""
    if raw is None or raw == "":
        return None
    try:
        ts = datetime.fromisoformat(raw.replace("Z", "+00:00"))
        # As its UTC instant: Python accepts offsets PostgreSQL's input refuses (beyond
        # +-15:59), which would reach the database as 22009.
        return ts.astimezone(UTC) if ts.tzinfo is not None else ts.replace(tzinfo=UTC)
    except (ValueError, OverflowError) as exc:
        raise ValidationError(
            f"{name} must be an ISO 8601 timestamp, got {raw!r}",
            hint=f"for example {name}=2024-06-01T00:00:00Z",
        ) from exc


def _min_cosine(raw: str | None) -> float | None:
    """The relevance floor: a cosine similarity in [-1, 1] (not clamped: a floor out of
    range is a mistake, not a preference)."""
    if raw is None:
        return None
    value = _parsed("min_cosine", raw, float)
    if not -1 <= value <= 1:
        raise ValidationError(
            f"min_cosine must be within -1..1, got {raw!r}",
            hint="a cosine similarity, e.g. min_cosine=0.25; omit it for the policy's floor",
        )
    return value


def parse_filter(raw: str | None) -> dict[str, Any] | None:
    """The metadata filter: a JSON object (containment); None or {} for none. The one
    parser of GET /memory/query's, GET /memory/nodes' and DELETE /memory/nodes' filter."""
    if raw is None:
        return None
    if len(raw.encode()) > MAX_FILTER_BYTES:
        raise ValidationError(
            f"filter must be at most {MAX_FILTER_BYTES} bytes of JSON",
            hint='filter on a few keys, e.g. filter={"user": "alice"}',
        )
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ValidationError(
            f"filter is not valid JSON: {raw[:200]!r}",
            hint='filter is a JSON object, e.g. filter={"user": "alice"}',
        ) from exc
    if not isinstance(value, dict):
        raise ValidationError(
            f"filter must be a JSON object, got {type(value).__name__}",
            hint='e.g. filter={"user": "alice"}: nodes whose metadata contains it',
        )
    if _depth(value) > MAX_FILTER_DEPTH:
        raise ValidationError(
            f"filter must be nested at most {MAX_FILTER_DEPTH} deep",
            hint='filter on a few keys, e.g. filter={"user": "alice"}',
        )
    return value or None


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
