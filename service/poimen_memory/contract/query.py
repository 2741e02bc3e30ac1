"""A query's request: GET /memory/query's parameters, memory_query's arguments (MCP) and the
document memory._plan reads (SQL), declared once.

Each field says its public name (the alias, where the pipeline's name differs), its bounds
(poimen_core.vocabulary's REQUEST_BOUNDS, which the SQL checks read too), its words, and its
name in the SQL request document. The query string is validated against this model as
given (strings), an MCP call as its JSON arguments, the lab and the CLI build it in Python;
the OpenAPI parameters and the MCP input schema are made from it (api/openapi.py,
api/mcp_server.py), and tests/test_contract.py holds memory.answer's signature to it.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic import ValidationError as ModelError
from pydantic_core import PydanticCustomError

from poimen_core import vocabulary
from poimen_core.optimizer import QueryOptimizerError, check_reference_time, reference_time_error
from poimen_memory.errors import ValidationError
from poimen_memory.settings import Settings

__all__ = [
    "FILTER_QUERY_STRING",
    "ISO_DAY_OR_TIME",
    "QueryRequest",
    "Surface",
    "bounds",
    "filter_text",
    "parse_filter",
    "parse_query",
    "public_names",
    "query_string_parameters",
]


@dataclass(frozen=True)
class Surface:
    """What a field is beyond its type: its name in memory._plan's request document (None:
    the service's alone), and the schema the query string carries where it differs from
    the model's (a comma-separated list, a JSON object as text)."""

    sql: str | None
    query_string: Mapping[str, Any] | None = None


def _fail(kind: str, message: str, hint: str | None = None) -> PydanticCustomError:
    # The message follows the parameter's name (errors() gives its public name, the alias).
    # In the context, not the template: a message quoting the input may hold braces.
    return PydanticCustomError(kind, "{message}", {"message": message, "hint": hint})


_INTEGER = re.compile(r"[+-]?[0-9]{1,18}")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _number(value: Any, integer: bool) -> Any:
    """A number as a query string or a JSON call carries it: ASCII digits only (Python's
    int() reads Arabic-Indic ones too), no booleans, no separators, finite."""
    if isinstance(value, bool):
        raise _fail("number", f"must be a number, got {json.dumps(value)}")
    if isinstance(value, str):
        text = value.strip()
        if text.lower().lstrip("+-") in ("nan", "inf", "infinity"):
            raise _fail("number", f"must be a finite number, got {value[:40]!r}")
        if not (_INTEGER if integer else _DECIMAL).fullmatch(text):
            kind = "a whole number" if integer else "a number"
            raise _fail("number", f"must be {kind}, got {value[:40]!r}")
        value = int(text) if integer else float(text)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _fail("number", f"must be a finite number, got {value}")
        if integer:
            if not value.is_integer():
                raise _fail("number", f"must be a whole number, got {value}")
            value = int(value)
    return value


Int = Annotated[int, BeforeValidator(lambda v: _number(v, True))]
Float = Annotated[float, BeforeValidator(lambda v: _number(v, False))]


def _filter(value: Any) -> Any:
    """A metadata filter: an object, or its JSON text (the query string's form)."""
    if value is None:
        return value
    if not isinstance(value, dict | str):
        raise _fail("filter", f"must be a JSON object, got {type(value).__name__}")
    return parse_filter(filter_text(value))


def filter_text(value: dict[str, Any] | str) -> str:
    """A filter as the query string carries it: an object as its JSON text (its depth
    checked first: 1,000 levels of an MCP call's object would stop json.dumps with a
    RecursionError), a string as it is."""
    if isinstance(value, str):
        return value
    if _shape(value)[0] > vocabulary.FILTER_MAX_DEPTH:
        raise ValidationError(
            f"filter must be nested at most {vocabulary.FILTER_MAX_DEPTH} deep",
            hint='filter on a few keys, e.g. filter={"user": "alice"}',
        )
    return json.dumps(value)


def _levels(value: Any) -> Any:
    """Levels: a list, or the comma-separated string the query string carries."""
    if isinstance(value, str):
        levels = [x.strip() for x in value.split(",") if x.strip()]
        if not levels or any(lv not in vocabulary.LEVELS for lv in levels):
            message = f"must be a comma-separated subset of L0,L1,L2, got {value[:40]!r}"
            raise _fail("levels", message)
        value = levels
    if not isinstance(value, list | tuple) or not value:
        raise _fail("levels", "must be a non-empty list of L0, L1, L2")
    if any(lv not in vocabulary.LEVELS for lv in value):
        raise _fail("levels", f"must name levels of L0, L1, L2, got {json.dumps(value)[:60]}")
    return tuple(dict.fromkeys(value))


def _word(allowed: tuple[str, ...]) -> Any:
    def check(value: Any) -> Any:
        if value is not None and value not in allowed:
            raise _fail(
                "choice",
                f"must be one of {', '.join(allowed)}, got {str(value)[:40]!r}",
                "omit it for the policy's choice",
            )
        return value

    return BeforeValidator(check)


def _instant(value: Any) -> Any:
    """as_of / valid_at: an ISO 8601 instant, UTC unless it has an offset (as its UTC
    instant: Python accepts offsets PostgreSQL refuses); the range is the database's."""
    if value is None or isinstance(value, datetime):
        return value
    text = str(value)
    try:
        ts = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (ValueError, OverflowError):
        raise _fail(
            "instant",
            f"must be an ISO 8601 timestamp, got {text[:40]!r}",
            "for example 2024-06-01T00:00:00Z",
        ) from None
    try:
        return ts.astimezone(UTC) if ts.tzinfo is not None else ts.replace(tzinfo=UTC)
    except OverflowError:
        # 9999-12-31T23:59:59-14:00 parses, and its UTC instant is past year 9999
        raise _fail(
            "instant",
            f"is out of range once in UTC, got {text[:40]!r}",
            "an instant between 0001-01-01 and 9999-12-31 UTC",
        ) from None


def _bounded(name: str, integer: bool = True) -> Any:
    lo, hi = vocabulary.REQUEST_BOUNDS[name]
    return Field(ge=int(lo) if integer else lo, le=int(hi) if integer else hi)


# What memory.time_bound parses (sql/017_time.sql); an impossible day or hour passes the
# pattern and is answered 400 by the database.
ISO_DAY_OR_TIME = (
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}"
    r"([T ][0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]{1,6})?)?(Z|[+-][0-9]{2}(:?[0-9]{2})?)?)?$"
)


# A metadata filter as a query string carries it (GET /memory/query, GET and DELETE
# /memory/nodes): its JSON text.
FILTER_QUERY_STRING: dict[str, Any] = {
    "type": "string",
    "maxLength": vocabulary.FILTER_MAX_BYTES,
    "contentMediaType": "application/json",
    "examples": ['{"user": "alice"}'],
}


class QueryRequest(BaseModel):
    """One query. Field order is the parameters' order in /openapi.json."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", validate_by_name=True, validate_by_alias=True
    )

    query: Annotated[
        str,
        Surface("query"),
        Field(
            min_length=1,
            # Not blank: at least one character Python does not count as white space.
            pattern=r"[^\s\u0085\u001c-\u001f]",
            description="Text to search for (not blank), at most {max_query_chars} characters "
            "(POIMEN_MAX_QUERY_CHARS), in the query grammar: plain words are scored; "
            '"quoted phrases" must match in order and adjacent; -word and -"phrase" exclude '
            "(no result contains them); #tag and @mention must match that exact token, "
            "unstemmed; OR between phrases, tags or mentions lets either satisfy. Malformed "
            "syntax (an unclosed quote) is read as plain words, never an error. plan.grammar "
            "says how the query was read.",
        ),
    ]
    project: Annotated[
        str | None,
        Surface("project"),
        Field(
            pattern=f"^{vocabulary.PROJECT_NAME}$",
            description="Restrict to one project; unknown → 404.",
        ),
    ] = None
    levels: Annotated[
        tuple[str, ...],
        BeforeValidator(_levels),
        Surface(
            "levels",
            {"type": "string", "default": "L1,L2", "pattern": r"^L[012](,L[012]){0,2}$"},
        ),
        Field(
            alias="level",
            json_schema_extra={"items": {"type": "string", "enum": list(vocabulary.LEVELS)}},
            description="The levels to search, a subset of L0, L1, L2 (comma-separated in "
            "the query string).",
        ),
    ] = ("L1", "L2")
    limit: Annotated[
        Int,
        Surface("k"),
        _bounded("k"),
        Field(description="How many results, 1..{max_limit} (POIMEN_MAX_LIMIT)."),
    ] = 5
    timeout_s: Annotated[
        Float,
        Surface(None),
        Field(
            alias="timeout_seconds",
            description="One deadline for the whole request, in seconds, 1..{max_timeout_s} "
            "(POIMEN_MAX_TIMEOUT_S).",
        ),
    ] = 5.0
    since: Annotated[
        str | None,
        Surface("since"),
        Field(
            # The database parses it (memory.time_range), for SQL users and this alike.
            json_schema_extra={"pattern": ISO_DAY_OR_TIME, "examples": ["2023-05-08"]},
            description="Only nodes whose timestamp is at or after this ISO date (a whole UTC "
            "day) or timestamp (UTC unless it has an offset), applied in every leg before its "
            "top k; nodes without a timestamp are left out. Bad value, or after until → 400.",
        ),
    ] = None
    until: Annotated[
        str | None,
        Surface("until"),
        Field(
            json_schema_extra={"pattern": ISO_DAY_OR_TIME, "examples": ["2023-05-31"]},
            description="Only nodes whose timestamp is at or before this ISO date (the whole "
            "day) or timestamp (the whole minute for hh:mm, second for hh:mm:ss, or last digit "
            "given).",
        ),
    ] = None
    reference_time: Annotated[
        datetime | None,
        Surface("reference_time"),
        Field(
            description="The time relative dates in the query ('last week', 'yesterday') count "
            "from; default now. The plan's time_filter reports them; they filter only under "
            "the policy extracted_dates = filter.",
        ),
    ] = None
    filter: Annotated[
        dict[str, Any] | None,
        BeforeValidator(_filter),
        Surface("filter", FILTER_QUERY_STRING),
        Field(
            description="Metadata filter: a JSON object (at most "
            f"{vocabulary.FILTER_MAX_BYTES} bytes, nested at most "
            f"{vocabulary.FILTER_MAX_DEPTH} deep) that a node's metadata must contain (JSON "
            "containment, @>), applied in every leg before its top k; {} is no filter. The "
            "lexical leg then runs on Postgres BM25 (OpenSearch documents carry no metadata).",
        ),
    ] = None
    min_cosine: Annotated[
        Float | None,
        Surface("min_cosine"),
        _bounded("min_cosine", integer=False),
        Field(
            examples=[0.25],
            description="Relevance floor: fused candidates whose cosine similarity to the query "
            "is below it are held back (counted in `withheld`) unless the query's words vouch "
            "for them (one of a keyword query's terms, half of a longer query's, a quoted "
            "phrase; a query with a strict phrase, #tag or @mention is not floored); the "
            "answer may then be empty, "
            "and an empty answer cites no evidence. Default: the policy's min_cosine, else the "
            f"database model's ({vocabulary.model_floors_prose()}); -1: no floor.",
        ),
    ] = None
    unsupported: Annotated[
        str | None,
        _word(vocabulary.UNSUPPORTED),
        Surface("unsupported"),
        Field(
            json_schema_extra={"enum": list(vocabulary.UNSUPPORTED)},
            description="Results in doubt (support stale, partial or none: their evidence was "
            "rewritten, retired or erased since they were derived): demote ranks them below "
            "the supported ones (counted in `demoted`), exclude leaves them out (`excluded`), "
            "keep keeps the fused order. Default: the policy's unsupported (demote).",
        ),
    ] = None
    as_of: Annotated[
        datetime | None,
        BeforeValidator(_instant),
        Surface("as_of"),
        Field(
            examples=["2024-06-01T00:00:00Z"],
            description="Time travel: answer from the versions the database held at this "
            "instant (a superseded or retired version that was current then comes back; one "
            "written later does not), BM25 scored with the statistics of the corpus as it "
            "stood then. Default: the current versions.",
        ),
    ] = None
    valid_at: Annotated[
        datetime | None,
        BeforeValidator(_instant),
        Surface("valid_at"),
        Field(
            examples=["2023-01-01T00:00:00Z"],
            description="Valid time: keep only nodes whose valid_from <= valid_at < valid_to "
            "(open bounds hold always). Default: as_of, else now.",
        ),
    ] = None
    fusion: Annotated[
        str | None,
        _word(vocabulary.FUSIONS),
        Surface("fusion"),
        Field(
            json_schema_extra={"enum": list(vocabulary.FUSIONS)},
            description="Fusion for Hybrid; default the policy's.",
        ),
    ] = None
    evidence: Annotated[
        Int | None,
        Surface("evidence"),
        _bounded("evidence"),
        Field(
            examples=[20],
            description="The most L0 turns the response cites (`evidence`); default the "
            "policy's evidence_budget (20). The results' provenance trees keep only the cited "
            "turns. 0: no evidence list, full trees.",
        ),
    ] = None
    strategy: Annotated[
        str | None,
        _word(vocabulary.STRATEGIES),
        Surface("strategy"),
        Field(
            json_schema_extra={"enum": list(vocabulary.STRATEGIES)},
            description="Override the optimizer's routing.",
        ),
    ] = None
    rrf_k: Annotated[
        Int | None,
        Surface("rrf_k"),
        _bounded("rrf_k"),
        Field(description="RRF's k; default the policy's."),
    ] = None
    candidates: Annotated[
        Int | None,
        Surface("candidates"),
        _bounded("candidates"),
        Field(description="How many candidates each leg reads; default the policy's."),
    ] = None
    dense_weight: Annotated[
        Float | None,
        Surface("dense_weight"),
        _bounded("dense_weight", integer=False),
        Field(description="The semantic leg's weight in convex fusion; default the policy's."),
    ] = None

    @field_validator("reference_time", mode="before")
    @classmethod
    def _reference_time(cls, value: Any) -> Any:
        if value is None:
            return None
        try:
            ts = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
            # The optimizer's bounds, the same for SQL users (memory.optimize_query).
            return check_reference_time(ts)
        except QueryOptimizerError as exc:
            message = str(exc).removeprefix("reference_time ")
            raise _fail("reference_time", message, exc.hint) from None
        except ValueError:
            error = reference_time_error(repr(value))
            raise _fail(
                "reference_time", str(error).removeprefix("reference_time "), error.hint
            ) from None

    @model_validator(mode="after")
    def _deployment(self, info: ValidationInfo) -> QueryRequest:
        """This service's caps (POIMEN_MAX_QUERY_CHARS, POIMEN_MAX_LIMIT,
        POIMEN_MAX_TIMEOUT_S), when it validates a request it was sent."""
        s = (info.context or {}).get("settings")
        if isinstance(s, Settings):
            for name, value in (("limit", self.limit), ("timeout_s", self.timeout_s)):
                lo, hi = bounds(s)[name]
                if not lo <= value <= hi:
                    raise _out_of_range(name, f"{value:g}", s)
            if len(self.query) > s.max_query_chars:
                raise ValidationError(
                    f"query is longer than {s.max_query_chars} characters",
                    hint=_DEPLOYMENT_HINTS["query"],
                )
        return self

    def document(self, routing: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The request document memory._plan reads: every field by its SQL name."""
        out: dict[str, Any] = {}
        for name, field in type(self).model_fields.items():
            surface = _surface(field.metadata)
            if surface.sql is None:
                continue
            value = getattr(self, name)
            if isinstance(value, datetime):
                value = value.isoformat()
            elif isinstance(value, tuple):
                value = list(value)
            out[surface.sql] = value
        return out | {"routing": dict(routing) if routing is not None else None}


_DEPLOYMENT_HINTS = {
    "limit": "POIMEN_MAX_LIMIT sets the most results a request may ask for",
    "timeout_s": "POIMEN_MAX_TIMEOUT_S sets the longest deadline a request may ask for",
    "query": "POIMEN_MAX_QUERY_CHARS sets the cap",
}


def _surface(metadata: list[Any]) -> Surface:
    (surface,) = (m for m in metadata if isinstance(m, Surface))
    return surface


@functools.cache
def surfaces() -> dict[str, Surface]:
    """Each field's Surface, by its public name."""
    return {
        field.alias or name: _surface(field.metadata)
        for name, field in QueryRequest.model_fields.items()
    }


@functools.cache
def public_names() -> dict[str, str]:
    """Each field's public name (its alias, where it has one), by its name in Python."""
    return {name: field.alias or name for name, field in QueryRequest.model_fields.items()}


def bounds(s: Settings) -> dict[str, tuple[float, float]]:
    """The deployment's bounds of the fields the settings cap, by Python name: what the
    model checks (_deployment) and what the schemas state (api/openapi.py)."""
    lo, hi = vocabulary.REQUEST_BOUNDS["k"]
    return {"limit": (lo, min(hi, s.max_limit)), "timeout_s": (1, s.max_timeout_s)}


def _strip_null(schema: dict[str, Any]) -> dict[str, Any]:
    """A parameter's schema without the null an optional field's JSON Schema allows: a
    query parameter is absent, never null."""
    options = [o for o in schema.pop("anyOf", []) if o.get("type") != "null"]
    if len(options) == 1:
        schema |= options[0]
    elif options:
        schema["anyOf"] = options
    return schema


def query_string_parameters(s: Settings) -> list[tuple[str, bool, dict[str, Any], str]]:
    """(name, required, schema, description) of each field, as the query string carries
    it and with this deployment's bounds: GET /memory/query's parameters in /openapi.json
    and memory_query's arguments (MCP)."""
    model = QueryRequest.model_json_schema(by_alias=True)
    python = {v: k for k, v in public_names().items()}
    caps = bounds(s)
    words = {
        "max_query_chars": s.max_query_chars,
        "max_limit": f"{caps['limit'][1]:g}",
        "max_timeout_s": f"{caps['timeout_s'][1]:g}",
    }
    out = []
    for name, field in model["properties"].items():
        query_string = surfaces()[name].query_string
        schema = dict(query_string) if query_string else _strip_null(dict(field))
        for key in ("title", "description"):
            schema.pop(key, None)
        # A bound on a type with a before-validator (Int, Float) comes out by pydantic's
        # names; JSON Schema's are minimum and maximum.
        for ours, theirs in (("ge", "minimum"), ("le", "maximum")):
            if ours in schema:
                schema[theirs] = schema.pop(ours)
        if "default" in schema and schema["default"] is None:
            del schema["default"]
        if python[name] in caps:
            schema["minimum"], schema["maximum"] = caps[python[name]]
        if name == "query":
            schema["maxLength"] = s.max_query_chars
        description = str(field.get("description", ""))
        for word, value in words.items():  # not str.format: descriptions show JSON's braces
            description = description.replace("{" + word + "}", str(value))
        out.append((name, name in model.get("required", ()), schema, description))
    return out


def parse_query(params: Mapping[str, Any], s: Settings) -> QueryRequest:
    """A request as a front received it (the query string's strings, or an MCP call's JSON
    arguments), checked against the contract and this service's caps. The first problem is
    a typed invalid_parameter naming the parameter by its public name."""
    for name, value in params.items():
        if isinstance(value, str) and "\x00" in value:  # PostgreSQL text holds no NUL
            raise ValidationError(f"{name} contains a NUL character")
    data = {"limit": s.default_limit, "timeout_seconds": s.default_timeout_s, **params}
    try:
        return QueryRequest.model_validate(
            data, by_alias=True, by_name=False, context={"settings": s}
        )
    except ModelError as exc:
        raise _typed(exc, s) from None


def _out_of_range(python: str, got: Any, s: Settings) -> ValidationError:
    """A bounded field's value out of its range: the deployment's (POIMEN_MAX_LIMIT, ...)
    where the settings cap it, else the vocabulary's, which the SQL checks read too."""
    name = public_names()[python]
    if python in bounds(s):
        (lo, hi), hint = bounds(s)[python], _DEPLOYMENT_HINTS[python]
    else:
        sql = _surface(QueryRequest.model_fields[python].metadata).sql
        (lo, hi), hint = vocabulary.REQUEST_BOUNDS[sql or name], None
    return ValidationError(f"{name} must be within {lo:g}..{hi:g}, got {got}", hint=hint)


def _typed(exc: ModelError, s: Settings) -> ValidationError:
    """pydantic's first error as this API's: the parameter named, in the SQL checks' words
    where both say the same (memory.check_within's "must be within lo..hi, got v")."""
    error = exc.errors(include_url=False)[0]
    name = str(error["loc"][0]) if error["loc"] else "request"
    kind, ctx, got = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "extra_forbidden":
        return ValidationError(
            f"unknown parameter {name!r}",
            hint=f"one of {', '.join(sorted(public_names().values()))} (/openapi.json says each)",
        )
    if kind == "missing" or (name == "query" and kind.startswith("string_")):
        return ValidationError(f"{name} is required and must not be empty")
    if kind in ("greater_than_equal", "less_than_equal"):
        python = {v: k for k, v in public_names().items()}[name]
        return _out_of_range(python, got, s)
    if kind == "string_pattern_mismatch" and name == "project":
        return ValidationError(
            f"project {got!r} is not a project name",
            hint="letters, digits, _ . : -; at most 128; starts alphanumeric; omit it for all",
        )
    hint = ctx.get("hint")
    message = error["msg"] if kind in _OURS else f"is not valid: {error['msg']}"
    return ValidationError(f"{name} {message}", hint=hint if isinstance(hint, str) else None)


_OURS = frozenset({"number", "filter", "levels", "choice", "instant", "reference_time"})


def _shape(value: Any) -> tuple[int, bool]:
    """How deep JSON nests (a scalar 0, {} 1) and whether a key or string holds NUL, without
    recursion: the text is bounded, its depth is not (4 KiB of brackets nest 2,000 deep)."""
    deepest, nul, stack = 0, False, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            nul = nul or any("\x00" in k for k in item)
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item)
        elif isinstance(item, str):
            nul = nul or "\x00" in item
    return deepest, nul


def parse_filter(raw: str | None) -> dict[str, Any] | None:
    """The metadata filter's JSON text: a JSON object (containment); None or {} for none.
    The one parser of GET /memory/query's, GET /memory/nodes' and DELETE /memory/nodes'
    filter, with memory.check_filter's bounds (poimen_core.vocabulary)."""
    if raw is None:
        return None
    hint = 'filter on a few keys, e.g. filter={"user": "alice"}'
    if len(raw.encode()) > vocabulary.FILTER_MAX_BYTES:
        raise ValidationError(
            f"filter must be at most {vocabulary.FILTER_MAX_BYTES} bytes of JSON", hint=hint
        )
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValidationError(
            f"filter is not valid JSON: {raw[:200]!r}",
            hint='filter is a JSON object, e.g. filter={"user": "alice"}',
        ) from exc
    if not isinstance(value, dict):
        raise ValidationError(
            f"filter must be a JSON object, got {type(value).__name__}",
            hint='e.g. filter={"user": "alice"}: nodes whose metadata contains it',
        )
    depth, nul = _shape(value)
    if nul:  # PostgreSQL's jsonb holds no NUL
        raise ValidationError("filter contains a NUL character", hint=hint)
    if depth > vocabulary.FILTER_MAX_DEPTH:
        raise ValidationError(
            f"filter must be nested at most {vocabulary.FILTER_MAX_DEPTH} deep", hint=hint
        )
    return value or None
