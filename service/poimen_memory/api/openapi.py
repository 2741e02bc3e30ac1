"""The OpenAPI 3.1 description of every endpoint and its error bodies."""

from __future__ import annotations

from typing import Any

from poimen_core import nodes, vocabulary
from poimen_core.nodes import MAX_ID_CHARS
from poimen_memory.api.asgi import single_header_names
from poimen_memory.contract.query import (
    FILTER_QUERY_STRING,
    ISO_DAY_OR_TIME,
    query_string_parameters,
)
from poimen_memory.settings import Settings

_ERROR = {
    "type": "object",
    "required": ["error", "detail"],
    "properties": {
        "error": {
            "type": "string",
            "examples": [
                "invalid_parameter",
                "unknown_project",
                "timeout",
                "embedding_service_unavailable",
                "database_unavailable",
            ],
        },
        "detail": {"type": "string"},
        "context": {"type": "string"},
        "hint": {"type": "string"},
    },
}


def _err(desc: str) -> dict[str, Any]:
    return {
        "description": desc,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


# Every read's answer is bounded (POIMEN_HTTP_MAX_RESPONSE_BYTES).
_TOO_LARGE = _err("response_too_large: the answer is over POIMEN_HTTP_MAX_RESPONSE_BYTES")


_OPERAND: dict[str, Any] = {
    "type": "object",
    "required": ["kind", "value"],
    "properties": {
        "kind": {"type": "string", "enum": ["phrase", "term", "tag", "mention"]},
        "value": {"type": "string", "description": "lowercased; a tag or mention without # or @"},
        "tsquery": {
            "type": "string",
            "description": "how a phrase or term is matched: on the node's tsvector (stemmed)",
        },
        "pattern": {
            "type": "string",
            "description": "how a tag, mention or stop-word phrase is matched: a whole-word "
            "regular expression over the node's title, breadcrumb and text",
        },
    },
}

# memory.parse_query's document (sql/018_grammar.sql).
_GRAMMAR: dict[str, Any] = {
    "type": "object",
    "required": ["operators", "text", "required", "exclude", "boost", "or", "notes"],
    "properties": {
        "operators": {
            "type": "boolean",
            "description": "false: plain words only, every leg as without the grammar",
        },
        "text": {"type": "string", "description": "the words BM25 scores"},
        "required": {
            "type": "array",
            "description": "groups a result satisfies, each by any of its operands (OR)",
            "items": {"type": "array", "items": _OPERAND},
        },
        "exclude": {
            "type": "array",
            "description": "operands no result contains",
            "items": _OPERAND,
        },
        "boost": {
            "type": "array",
            "description": "soft phrases (a quoted phrase in a question): never required; "
            "the candidates containing them rank first",
            "items": _OPERAND,
        },
        "routing_text": {
            "type": "string",
            "description": "with a soft phrase: the query with it unquoted, as the optimizer "
            "routes it",
        },
        "or": {"type": "integer", "description": "how many ORs joined operands"},
        "notes": {
            "type": "array",
            "items": {"type": "string"},
            "description": "malformed syntax read as plain words, operators ignored",
        },
    },
}

_PARENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        k: {"type": ["string", "null"]}
        for k in ("level", "external_id", "sha256", "source", "title", "text", "timestamp")
    }
    | {
        "parents": {"type": "array", "items": {"$ref": "#/components/schemas/Parent"}},
        # A cap (memory.provenance) left some of this node's parents out.
        "truncated": {"type": "boolean"},
        # The version the child rests on, rewritten since (only then present).
        "superseded": {"type": "boolean"},
        "revision": {"type": "integer", "minimum": 1},
        "current_revision": {"type": ["integer", "null"]},
    },
}

# A query's metrics: each stage's time and each leg's candidates, null where the stage or
# leg did not run (0 would say it ran and found nothing).
_STAGES = ("lexical", "semantic", "fusion", "provenance", "evidence_legs", "evidence", "embed",
           "rerank", "opensearch", "database", "total")  # fmt: skip
_METRICS: dict[str, Any] = {
    **{f"{stage}_time_ms": {"type": ["number", "null"], "minimum": 0} for stage in _STAGES},
    **{
        f"{leg}_candidates": {"type": ["integer", "null"], "minimum": 0}
        for leg in ("lexical", "semantic", "direct")
    },
    "final_count": {"type": "integer", "minimum": 0},
    "embedding_cache_hit": {"type": ["boolean", "null"]},
}

# What results and evidence show of a node alike.
_NODE_FIELDS: dict[str, Any] = {
    **{
        k: {"type": ["string", "null"]}
        for k in ("level", "sha256", "project", "title", "text", "source", "timestamp")
    },
    "breadcrumb": {"type": ["array", "null"], "items": {"type": "string"}},
    # As written (ingest's metadata object: at most 16 KiB as compact UTF-8 JSON).
    "metadata": {"type": "object"},
}

# A derived node's support (memory._support_at): the parent versions it rests on now,
# transitively; null for a node written without parents.
_SUPPORT: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "enum": ["full", "stale", "partial", "none"]},
        {"type": "null"},
    ]
}

# The parents that put a result in doubt (null: its support is full).
_CHANGED_PARENTS: dict[str, Any] = {
    "type": ["array", "null"],
    "items": {
        "type": "object",
        "properties": {
            "external_id": {"type": ["string", "null"]},
            "revision": {"type": "integer"},
            "current_revision": {"type": ["integer", "null"]},
            "state": {
                "type": ["string", "null"],
                "enum": [
                    "superseded",
                    "retired",
                    "erased",
                    "expired",
                    "invalid",
                    "stale",
                    "partial",
                    "none",
                    None,
                ],
            },
        },
    },
}

_RESULT: dict[str, Any] = {
    "type": "object",
    "properties": {
        **_NODE_FIELDS,
        # The node's own id (unique per project), as ingested; and its place in the answer.
        "external_id": {"type": ["string", "null"]},
        "rank": {"type": "integer", "minimum": 1},
        "fusion_method": {"type": ["string", "null"]},
        **{
            k: {"type": ["number", "null"]}
            for k in ("query_score", "lexical_score", "final_score", "rerank_score")
        },
        **{k: {"type": ["integer", "null"]} for k in ("semantic_rank", "lexical_rank")},
        "parents": {"type": "array", "items": {"$ref": "#/components/schemas/Parent"}},
        # Parents per node and nodes per tree are capped (docs/sql-api.md, provenance).
        "provenance_truncated": {"type": "boolean"},
        # L0 turns of the tree left out because the response's evidence does not cite them.
        "provenance_l0_omitted": {"type": "integer", "minimum": 0},
        "support": _SUPPORT,
        "changed_parents": _CHANGED_PARENTS,
        # Why an L1/L2 result cites no L0 turn (null: it cites one, or is L0 itself).
        "uncited_reason": {
            "anyOf": [
                {
                    "type": "string",
                    "enum": [
                        "evidence_budget",
                        "provenance_cap",
                        "evidence_missing",
                        "no_l0_evidence",
                    ],
                },
                {"type": "null"},
            ]
        },
    },
}

_LINK: dict[str, Any] = {
    "type": "object",
    "required": ["node_id", "external_id", "level"],
    "properties": {
        "node_id": {"type": "integer"},
        "external_id": {"type": ["string", "null"]},
        "level": {"type": "string", "enum": ["L0", "L1", "L2"]},
        "precedence": {"type": "integer"},
        # Parents only: each parent once, the version the node rests on (the newest of the
        # id it has an edge to), and the parent's current revision (null: none current).
        "revision": {"type": "integer", "minimum": 1},
        "current_revision": {"type": ["integer", "null"], "minimum": 1},
    },
}

_NODE_DETAIL: dict[str, Any] = {
    "type": "object",
    "required": ["node_id", "external_id", "project", "level", "revision", "parents", "children"],
    "properties": {
        **_NODE_FIELDS,
        "node_id": {"type": "integer"},
        "external_id": {"type": ["string", "null"]},
        # The current version's: what an update names as "revision" to be refused if stale.
        "revision": {"type": "integer", "minimum": 1},
        "created_at": {"type": "string"},
        # At most 100 of each are listed; the totals count them all.
        "parents": {"type": "array", "items": {"$ref": "#/components/schemas/Link"}},
        "parents_total": {"type": "integer", "minimum": 0},
        "children": {"type": "array", "items": {"$ref": "#/components/schemas/Link"}},
        "children_total": {"type": "integer", "minimum": 0},
        "parents_declared": {"type": "integer", "minimum": 0},
        "support": _SUPPORT,
        # null: GET /memory/nodes/{id}/history lists the versions (this is the current one).
        "versions": {"type": ["array", "null"], "items": {"type": "object"}},
    },
}

_NODE_ROW: dict[str, Any] = {
    "type": "object",
    "required": ["node_id", "external_id", "project", "level", "revision"],
    "properties": {
        **_NODE_FIELDS,
        "node_id": {"type": "integer"},
        "external_id": {"type": ["string", "null"]},
        "revision": {"type": "integer", "minimum": 1},
        "created_at": {"type": "string"},
        "support": _SUPPORT,
        # When it leaves answers (its own expiry, or its project's retention); null: never.
        "expires_at": {"type": ["string", "null"]},
    },
}

_EVIDENCE: dict[str, Any] = {
    "type": "object",
    "properties": {
        **_NODE_FIELDS,
        "external_id": {"type": ["string", "null"]},
        "rank": {"type": "integer", "minimum": 1},
        "score": {"type": "number"},
        "neighbour_score": {"type": "number"},
        "direct_rank": {"type": ["integer", "null"]},
        "cited_by": {"type": "array", "items": {"type": "integer"}},
        # The cited version; superseded: a result rests on it, rewritten since.
        "revision": {"type": "integer", "minimum": 1},
        "superseded": {"type": "boolean"},
    },
}

_PROJECT_PARAM_DESC = (
    "The project; needed where the id is in several of the caller's projects (409 "
    "ambiguous_node otherwise). A project the key does not cover: 403."
)


_PROJECT: dict[str, Any] = {"type": "string", "pattern": f"^{vocabulary.PROJECT_NAME}$"}

_INSTANT_OR_NONE: dict[str, Any] = {
    # ISO 8601; an empty string counts as none.
    "anyOf": [
        {"type": "string", "format": "date-time"},
        {"type": "string", "maxLength": 0},
        {"type": "null"},
    ]
}

# One memory node (docs/ingest.md), with the parser's bounds (poimen_core.nodes, which
# tests/test_contract.py holds to NODE_FIELDS, the keys the parser reads); the validation
# the server applies beyond this schema (ids reused for other content, provenance one level
# down, NUL, range of timestamps) is reported as 400 invalid_node.
_NODE: dict[str, Any] = {
    "type": "object",
    "required": ["level", "text", "project"],
    "properties": {
        # A string (or null: the database makes one); a JSON number is refused, since 12345
        # and 12345.0 would not name one node (poimen_core.nodes._id_problem).
        "id": {"type": ["string", "null"], "maxLength": nodes.MAX_ID_CHARS},
        "level": {"type": "string", "enum": list(vocabulary.LEVELS)},
        "project": _PROJECT,
        # UTF-8 text without NUL: PostgreSQL text cannot hold NUL or lone surrogates.
        "text": {
            "type": "string",
            "minLength": 1,
            "maxLength": nodes.MAX_TEXT_CHARS,
            # No NUL, and not blank (a character Python does not count as white space).
            "pattern": "^[^\u0000]*[^\\s\u0085\u001c-\u001f\u0000][^\u0000]*$",
        },
        "title": {"type": ["string", "null"], "maxLength": nodes.MAX_TITLE_CHARS},
        "source": {"type": ["string", "null"], "maxLength": nodes.MAX_SOURCE_CHARS},
        "timestamp": _INSTANT_OR_NONE,
        # null is read as empty, as in nodes.jsonl
        "parents": {
            "type": ["array", "null"],
            "items": {"type": "string", "maxLength": nodes.MAX_ID_CHARS},
            "maxItems": nodes.MAX_PARENTS,
        },
        "breadcrumb": {
            "type": ["array", "null"],
            "items": {"type": "string", "maxLength": nodes.MAX_TITLE_CHARS},
            "maxItems": nodes.MAX_BREADCRUMB,
        },
        "metadata": {"type": ["object", "null"]},
        # Optimistic concurrency (docs/lifecycle.md): the revision the writer read; new
        # content under a stale one is refused with 409 stale_revision. 0: create only.
        "revision": {"type": ["integer", "null"], "minimum": 0, "maximum": 2147483647},
        # Valid time (docs/lifecycle.md): when the fact held in the world; content.
        "valid_from": _INSTANT_OR_NONE,
        "valid_to": _INSTANT_OR_NONE,
        # When the node leaves answers (docs/lifecycle.md, expiry); not content.
        "expires_at": _INSTANT_OR_NONE,
    },
}

# A metadata filter, as GET /memory/query takes it (the contract's parse_filter).
_FILTER_PARAMETER: dict[str, Any] = {
    "name": "filter",
    "in": "query",
    "required": False,
    "schema": FILTER_QUERY_STRING,
    "description": 'Only nodes whose metadata contains this JSON object, e.g. {"user": "42"} '
    f"(at most {vocabulary.FILTER_MAX_BYTES} bytes, nested at most "
    f"{vocabulary.FILTER_MAX_DEPTH} deep).",
}

_AUTH_ERRORS = {
    "401": _err("unauthorized: API keys exist and the request has no valid one"),
    "403": _err("forbidden: the key does not cover the project, or is read-only"),
}


_ID_PARAMETER: dict[str, Any] = {
    "name": "id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "minLength": 1},
    "description": "The node's external id (unique per project).",
}
_PROJECT_PARAMETER: dict[str, Any] = {
    "name": "project",
    "in": "query",
    "required": False,
    "schema": _PROJECT,
    "description": "The node's project; may be left out when the API key covers one project.",
}
_FORGET_PARAMETERS: list[dict[str, Any]] = [
    {
        "name": "erase",
        "in": "query",
        "required": False,
        "schema": {"type": "string", "enum": ["true", "false"]},
        "description": "true: erase (every version's text, vector, metadata, postings and "
        "OpenSearch document go; a tombstone stays). Default false: retire.",
    },
    {
        "name": "reason",
        "in": "query",
        "required": False,
        "schema": {"type": "string"},
        "description": "Why, recorded as the versions' end_note.",
    },
]
_FORGET_RESPONSE: dict[str, Any] = {
    "description": "What was forgotten",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ForgetReport"}}},
}
_TS_OR_NULL: dict[str, Any] = {"type": ["string", "null"], "format": "date-time"}
_VERSION: dict[str, Any] = {
    "type": "object",
    "required": ["revision", "node_id", "current", "level", "created_at", "end_reason"],
    "properties": {
        "revision": {"type": "integer", "minimum": 1},
        "node_id": {"type": "integer"},
        "current": {"type": "boolean"},
        "level": {"type": "string", "enum": ["L0", "L1", "L2"]},
        "sha256": {"type": ["string", "null"], "description": "null once erased"},
        "title": {"type": ["string", "null"]},
        "text": {"type": ["string", "null"], "description": "null once erased"},
        "source": {"type": ["string", "null"]},
        "timestamp": _TS_OR_NULL,
        "metadata": {"type": ["object", "null"]},
        "created_at": {"type": "string", "format": "date-time"},
        "expired_at": _TS_OR_NULL,
        "end_reason": {
            "type": ["string", "null"],
            "enum": ["superseded", "retired", "erased", None],
        },
        "written_by": {"type": ["string", "null"], "description": "api_key:<id> or role:<name>"},
        "ended_by": {"type": ["string", "null"]},
        "end_note": {"type": ["string", "null"]},
        "erased_at": _TS_OR_NULL,
    },
}


def query_parameters(
    settings: Settings | None = None,
) -> list[tuple[str, bool, dict[str, Any], str]]:
    """GET /memory/query's parameters with this deployment's bounds: the contract's
    (poimen_memory.contract), which memory_query (MCP) takes too."""
    return query_string_parameters(settings or Settings())


# Each operation's operationId (what generated clients name the call) and tag.
TAGS = [
    {"name": "memory", "description": "Search memory and write nodes"},
    {"name": "operations", "description": "Health, metrics and this document"},
    {"name": "mcp", "description": "The MCP server for agents (docs/mcp.md)"},
    {"name": "explorer", "description": "The query explorer page"},
]


# Every route answers a Host not listed in POIMEN_HTTP_ALLOWED_HOSTS (for /mcp,
# POIMEN_MCP_ALLOWED_HOSTS) before it runs (api/asgi.py HostCheck).
_HOST_REFUSED = _err(
    "misdirected_request: the request's Host is not one POIMEN_HTTP_ALLOWED_HOSTS lists "
    "(loopback names by default; POIMEN_MCP_ALLOWED_HOSTS for /mcp)"
)

# And a request head over POIMEN_HTTP_MAX_HEADER_BYTES (api/asgi.py HeadLimit), or one that
# gives a header twice that names one value (asgi.SINGLE_HEADERS): 400 beside a route's own.
_HEAD_REFUSED = _err(
    "request_header_fields_too_large: the request's head (its target and headers) is over "
    "POIMEN_HTTP_MAX_HEADER_BYTES"
)
_DUPLICATE_HEADER = f"duplicate_header: the request gives {single_header_names('or')} twice"
# Every route that reads a body reads it through api/body.read_body, which decodes none.
_ENCODED = "unsupported_media_type: a body in a Content-Encoding (gzip, br, ...): none is decoded"


# The review queue (issue 40, api/review.py): one item as memory.review_list and
# memory.review_claim return it.
_REVIEW_ITEM: dict[str, Any] = {
    "type": "object",
    "required": ["item_id", "project", "node_id", "level", "reason", "changes", "parents"],
    "properties": {
        "item_id": {"type": "integer"},
        "project": {"type": "string"},
        "node_id": {"type": "integer"},
        "external_id": {"type": ["string", "null"]},
        "level": {"type": "string", "enum": ["L1", "L2"]},
        "reason": {
            "type": "string",
            "enum": ["evidence_changed", "evidence_gone", "evidence_stale"],
        },
        "changes": {"type": "array", "items": {"type": "object"}},
        "enqueued_at": {"type": "string"},
        # claimable from then on (a claim moves it into the future)
        "vt": {"type": "string"},
        "claims": {"type": "integer", "minimum": 0},
        "claimed_by": {"type": ["string", "null"]},
        "text": {"type": ["string", "null"]},
        # each parent the node rests on: its state, the text then and (rewritten) now
        "parents": {"type": "array", "items": {"type": "object"}},
    },
}
_REVIEW_PAGE: dict[str, Any] = {
    "type": "object",
    "required": ["items"],
    "properties": {
        "project": {"type": ["string", "null"]},
        "items": {"type": "array", "items": {"$ref": "#/components/schemas/ReviewItem"}},
        "next_after": {"type": ["integer", "null"]},
    },
}
_REVIEW_DONE: dict[str, Any] = {
    "type": "object",
    "required": ["item_id", "node_id", "outcome", "support", "resolved"],
    "properties": {
        "item_id": {"type": "integer"},
        "node_id": {"type": "integer"},
        "external_id": {"type": ["string", "null"]},
        "outcome": {"type": "string", "enum": ["confirmed"]},
        "relinked": {"type": "integer", "minimum": 0},
        "support": _SUPPORT,
        "resolved": {"type": "array", "items": {"type": "integer"}},
    },
}


def _json_body(properties: dict[str, Any]) -> dict[str, Any]:
    """A POST's parameters as a JSON object (application/json only: api/app.py)."""
    return {
        "required": False,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": properties,
                }
            }
        },
    }


def _review_paths() -> dict[str, Any]:
    page = {"application/json": {"schema": {"$ref": "#/components/schemas/ReviewPage"}}}
    return {
        "/memory/review": {
            "get": {
                "operationId": "listReviewItems",
                "tags": ["memory"],
                "summary": "The open review items: derived nodes whose evidence changed",
                "parameters": [
                    {"name": "project", "in": "query", "required": False, "schema": _PROJECT},
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 1, "maximum": 100},
                    },
                    {
                        "name": "after",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 0, "maximum": 2**62},
                    },
                ],
                "responses": {
                    "200": {"description": "A page of open items", "content": page},
                    "400": _err("invalid_parameter"),
                    **_AUTH_ERRORS,
                    "404": _err("unknown_project"),
                    "413": _TOO_LARGE,
                    "503": _err("database_unavailable"),
                },
            }
        },
        "/memory/review/claim": {
            "post": {
                "operationId": "claimReviewItems",
                "tags": ["memory"],
                "summary": "Claim ready review items for a visibility timeout",
                "requestBody": _json_body(
                    {
                        "project": _PROJECT,
                        "limit": {"type": "integer", "minimum": 1, "maximum": 100},
                        "visibility_timeout": {"type": "integer", "minimum": 1, "maximum": 86400},
                    }
                ),
                "responses": {
                    "200": {"description": "The items claimed (none: empty)", "content": page},
                    "400": _err("invalid_parameter"),
                    **_AUTH_ERRORS,
                    "404": _err("unknown_project"),
                    "413": _err("payload_too_large (a body over 32 KiB) or response_too_large"),
                    "503": _err("database_unavailable"),
                },
            }
        },
        "/memory/review/{item}/confirm": {
            "post": {
                "operationId": "confirmReviewItem",
                "tags": ["memory"],
                "summary": "Confirm a node's claim against its current parents",
                "parameters": [
                    {
                        "name": "item",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "integer", "minimum": 1, "maximum": 2**62 - 1},
                    },
                ],
                "requestBody": _json_body({"note": {"type": "string", "maxLength": 2000}}),
                "responses": {
                    "200": {
                        "description": "The item is done; what else it resolved",
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/ReviewDone"}
                            }
                        },
                    },
                    "400": _err("invalid_parameter"),
                    **_AUTH_ERRORS,
                    "404": _err("unknown_review_item: no open item of this id"),
                    "413": _err("payload_too_large: a body over 32 KiB"),
                    "409": _err("review_conflict: a parent is itself in doubt, or none is left"),
                    "503": _err("database_unavailable"),
                },
            }
        },
    }


def openapi_spec(settings: Settings | None = None) -> dict[str, Any]:
    """The OpenAPI document, with this deployment's bounds (default settings: None)."""
    spec = _spec(settings)
    for item in spec["paths"].values():
        for operation in item.values():
            operation["responses"].setdefault("421", _HOST_REFUSED)
            operation["responses"].setdefault("431", _HEAD_REFUSED)
            _also(operation, "400", _DUPLICATE_HEADER)
            if "requestBody" in operation:
                _also(operation, "415", _ENCODED)
    return spec


def _also(operation: dict[str, Any], status: str, description: str) -> None:
    """``description`` added to the operation's answer of ``status``, or that answer made."""
    own = operation["responses"].get(status)
    operation["responses"][status] = (
        _err(description)
        if own is None
        else {**own, "description": f"{own['description']}; {description}"}
    )


def _spec(settings: Settings | None) -> dict[str, Any]:
    q = query_parameters(settings)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "poimen-memory",
            "version": "0.1.0",
            "description": "Three-level memory retrieval with provenance to L0 evidence.",
        },
        "tags": TAGS,
        "paths": {
            "/memory/query": {
                "get": {
                    "operationId": "queryMemory",
                    "tags": ["memory"],
                    "summary": "Best L1/L2 memories with their L0 evidence",
                    "parameters": [
                        {"name": n, "in": "query", "required": r, "schema": s, "description": d}
                        for n, r, s, d in q
                    ],
                    "responses": {
                        "200": {
                            "description": "Results, plan, metrics, degraded stages",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/QueryResponse"}
                                }
                            },
                        },
                        "400": _err(
                            "invalid_parameter: missing/empty query, bad level, bad number, "
                            "bad since/until/reference_time, since after until"
                        ),
                        **_AUTH_ERRORS,
                        "404": _err("unknown_project"),
                        "409": _err("embedding_model_mismatch: query vector dimension differs"),
                        "412": _err("embedding_not_configured: nothing ingested yet"),
                        "413": _TOO_LARGE,
                        "503": _err(
                            "timeout, embedding_service_unavailable or database_unavailable"
                        ),
                    },
                }
            },
            "/memory/nodes": {
                "post": {
                    "operationId": "addNodes",
                    "tags": ["memory"],
                    "summary": "Ingest nodes (JSON array or NDJSON, the nodes.jsonl format)",
                    "requestBody": {
                        "required": True,
                        "description": "A JSON array of nodes (NDJSON, one node per line, is "
                        "accepted too, as `poimen-memory ingest` reads). "
                        "One request is one transaction: every node is written, or none. "
                        "Two query parameters relax this contract, as the CLI's flags do: "
                        "`project` names the project of nodes that name none, and "
                        "`skip_invalid=true` loads the valid nodes and lists the invalid "
                        "ones in the report (400 when none is valid).",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "array",
                                    "minItems": 1,
                                    "items": {"$ref": "#/components/schemas/Node"},
                                }
                            },
                        },
                    },
                    "responses": {
                        "201": {
                            "description": "Ingest report",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/IngestReport"}
                                }
                            },
                        },
                        "400": _err("invalid_node: a line failed validation; nothing written"),
                        **_AUTH_ERRORS,
                        "409": _err("embedding_model_mismatch, or conflict with stored data"),
                        "408": _err("request_timeout: body slower than POIMEN_HTTP_BODY_TIMEOUT_S"),
                        "413": _err("payload_too_large: body over POIMEN_MAX_BODY_BYTES"),
                        "415": _err("unsupported_media_type: text/plain or a form's type"),
                        "503": _err("busy, database_unavailable or embedding_service_unavailable"),
                    },
                },
                "get": {
                    "operationId": "listNodes",
                    "tags": ["memory"],
                    "summary": "A page of nodes in write order, keyset paged",
                    "description": "memory.list_nodes. Pass next_cursor as after for the "
                    "next page; null means this page is the last.",
                    "parameters": [
                        {
                            "name": "project",
                            "in": "query",
                            "required": False,
                            "schema": _PROJECT,
                            "description": "Only this project (unknown: 404); default every "
                            "project the key covers.",
                        },
                        {
                            "name": "level",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "string", "enum": ["L0", "L1", "L2"]},
                            "description": "Only this level.",
                        },
                        {
                            "name": "source",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "string"},
                            "description": "Only nodes with this source (equal).",
                        },
                        {
                            "name": "since",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "string", "pattern": ISO_DAY_OR_TIME},
                            "description": "Only nodes whose timestamp is at or after this "
                            "(as GET /memory/query's since).",
                        },
                        {
                            "name": "until",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "string", "pattern": ISO_DAY_OR_TIME},
                            "description": "Only nodes whose timestamp is at or before this "
                            "(as GET /memory/query's until).",
                        },
                        _FILTER_PARAMETER,
                        {
                            "name": "after",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "string"},
                            "description": "The previous page's next_cursor (opaque); "
                            "anything else is 400.",
                        },
                        {
                            "name": "newest_first",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "string", "enum": ["true", "false"]},
                            "description": "true: the latest writes first (the cursor then "
                            "pages backwards in write order).",
                        },
                        {
                            "name": "count",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "string", "enum": ["true", "false"]},
                            "description": "true: the answer also has count, how many "
                            "nodes all the pages hold together (memory.count_nodes).",
                        },
                        {
                            "name": "limit",
                            "in": "query",
                            "required": False,
                            "schema": {
                                "type": "integer",
                                "default": 50,
                                "minimum": 1,
                                "maximum": 100,
                            },
                            "description": "How many nodes a page holds, 1..100 (400 beyond).",
                        },
                    ],
                    "responses": {
                        "200": {
                            "description": "A page of nodes",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/NodePage"}
                                }
                            },
                        },
                        "400": _err("invalid_parameter: bad level, limit, cursor or since/until"),
                        **_AUTH_ERRORS,
                        "404": _err("unknown_project"),
                        "413": _TOO_LARGE,
                        "503": _err("timeout or database_unavailable"),
                    },
                },
                "delete": {
                    "operationId": "forgetNodes",
                    "tags": ["memory"],
                    "summary": "Retire (or erase) a project's nodes by ids or by filter: "
                    "metadata (filter), source, level, and since/until on the node's "
                    "timestamp (memory.forget). At least one of id, filter, source, level, "
                    "since, until is required (400 otherwise). dry_run=true answers what "
                    "it would forget and writes nothing; more than max_nodes nodes is 422.",
                    "parameters": [
                        _PROJECT_PARAMETER,
                        {
                            "name": "id",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "string", "minLength": 1},
                            "description": "External ids, comma-separated.",
                        },
                        {
                            "name": "source",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "string", "minLength": 1},
                            "description": "Only nodes with this source.",
                        },
                        {
                            "name": "since",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "string", "pattern": ISO_DAY_OR_TIME},
                            "description": "First day or instant of the nodes' timestamps.",
                        },
                        {
                            "name": "until",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "string", "pattern": ISO_DAY_OR_TIME},
                            "description": "Last day or instant (inclusive).",
                        },
                        _FILTER_PARAMETER,
                        {
                            "name": "level",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "string", "enum": ["L0", "L1", "L2"]},
                            "description": "Only nodes of this level.",
                        },
                        {
                            "name": "dry_run",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "string", "enum": ["true", "false"]},
                            "description": "true: answer what would be forgotten (matched, "
                            "nodes) and write nothing.",
                        },
                        {
                            "name": "max_nodes",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "integer", "minimum": 1},
                            "description": "Refuse (422 too_many_nodes, nothing forgotten) "
                            "when more nodes match; default POIMEN_FORGET_MAX_NODES (1000).",
                        },
                        *_FORGET_PARAMETERS,
                    ],
                    "responses": {
                        "200": _FORGET_RESPONSE,
                        "400": _err("invalid_parameter: no ids or filter, or a bad value"),
                        **_AUTH_ERRORS,
                        "404": _err("unknown_project"),
                        "422": _err("too_many_nodes: more nodes match than max_nodes"),
                        "503": _err("database_unavailable"),
                    },
                },
            },
            "/memory/nodes/{id}/history": {
                "get": {
                    "operationId": "getNodeHistory",
                    "tags": ["memory"],
                    "summary": "Every version of a node, oldest first (memory.history)",
                    "parameters": [_ID_PARAMETER, _PROJECT_PARAMETER],
                    "responses": {
                        "200": {
                            "description": "The node's versions",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/History"}
                                }
                            },
                        },
                        "400": _err("invalid_parameter: no project named, or a bad one"),
                        **_AUTH_ERRORS,
                        "404": _err("unknown_node or unknown_project"),
                        "413": _TOO_LARGE,
                        "503": _err("database_unavailable"),
                    },
                }
            },
            "/memory/nodes/{id}": {
                "get": {
                    "operationId": "getNode",
                    "tags": ["memory"],
                    "summary": "One node by its id, with its parents, children and support",
                    "description": "memory.get_node: the node's id is the id given at "
                    "ingest (external_id), unique per project; percent-encode it in the path "
                    "(# is %23). A node of a project the key does not cover is not found.",
                    "parameters": [
                        {
                            **_ID_PARAMETER,
                            "schema": {
                                "type": "string",
                                "minLength": 1,
                                "maxLength": MAX_ID_CHARS,
                            },
                        },
                        {
                            "name": "project",
                            "in": "query",
                            "required": False,
                            "schema": _PROJECT,
                            "description": _PROJECT_PARAM_DESC,
                        },
                    ],
                    "responses": {
                        "200": {
                            "description": "The node",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/NodeDetail"}
                                }
                            },
                        },
                        "400": _err("invalid_parameter: bad project name, id too long"),
                        **_AUTH_ERRORS,
                        "404": _err("unknown_node (or one the key may not read), unknown_project"),
                        "409": _err("ambiguous_node: the id is in several projects; name one"),
                        "413": _TOO_LARGE,
                        "503": _err("timeout or database_unavailable"),
                    },
                },
                "delete": {
                    "operationId": "forgetNode",
                    "tags": ["memory"],
                    "summary": "Retire a node (gone from answers, kept in history) or, with "
                    "erase=true, erase every version's content (memory.forget)",
                    "parameters": [_ID_PARAMETER, _PROJECT_PARAMETER, *_FORGET_PARAMETERS],
                    "responses": {
                        "200": _FORGET_RESPONSE,
                        "400": _err("invalid_parameter"),
                        **_AUTH_ERRORS,
                        "404": _err("unknown_node (no current version) or unknown_project"),
                        "503": _err("database_unavailable"),
                    },
                },
            },
            **_review_paths(),
            "/healthz": {
                "get": {
                    "operationId": "getHealth",
                    "tags": ["operations"],
                    "summary": "Each dependency and the active engines",
                    "responses": {
                        "200": {"description": "healthy"},
                        "503": {"description": "database down"},
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "operationId": "getOpenApi",
                    "tags": ["operations"],
                    "summary": "This document",
                    "responses": {"200": {"description": "OpenAPI 3.1"}},
                }
            },
            "/mcp": {
                "post": {
                    "operationId": "mcp",
                    "tags": ["mcp"],
                    "summary": "The MCP server for agents: streamable HTTP, stateless, JSON "
                    "responses (docs/mcp.md); its tools are memory_query and memory_add",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {"type": "object", "description": "JSON-RPC 2.0"}
                            }
                        },
                    },
                    "responses": {
                        "200": {
                            "description": "The JSON-RPC response; a tool's typed error is a "
                            "result with isError true and the error body",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        },
                        "202": {"description": "A notification, accepted"},
                        # no schema: two bodies, a JSON-RPC error object or, from the
                        # middleware, the Error object (duplicate_header)
                        "400": {
                            "description": "a request JSON-RPC cannot take (JSON-RPC's invalid "
                            "request, -32600: a JSON-RPC error object)",
                        },
                        "401": _AUTH_ERRORS["401"],
                        "413": {"description": "body over POIMEN_MAX_BODY_BYTES"},
                        "415": _err("unsupported_media_type: the body is not application/json"),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "operationId": "getMetrics",
                    "tags": ["operations"],
                    "summary": "Prometheus metrics (docs/observability.md)",
                    "responses": {
                        "200": {
                            "description": "Prometheus text exposition format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/ui": {
                "get": {
                    "operationId": "getExplorer",
                    "tags": ["explorer"],
                    "summary": "The query explorer page; reads query, project, level, limit, "
                    "strategy and fusion from its own URL",
                    "responses": {
                        "200": {
                            "description": "HTML page (assets under /ui/static/)",
                            "content": {"text/html": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
        },
        # Anonymous until the first key is made (docs/security.md), then a key on every
        # request: either requirement, so a generated client offers both (Client, and
        # AuthenticatedClient with the key as its token).
        "security": [{}, {"apiKey": []}],
        "components": {
            "securitySchemes": {
                "apiKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "An API key (`poimen-memory keys create`), sent as "
                    "`Authorization: Bearer <key>`; none while the database has no keys.",
                }
            },
            "schemas": {
                "Error": _ERROR,
                "Node": _NODE,
                "IngestReport": {
                    "type": "object",
                    "required": [
                        "nodes",
                        "inserted",
                        "duplicates",
                        "edges",
                        "invalid",
                        "unresolved",
                    ],
                    "properties": {
                        "nodes": {
                            "type": "array",
                            "items": {"$ref": "#/components/schemas/WrittenNode"},
                            "description": "One per node written, in the request's order "
                            "(with skip_invalid the invalid ones are left out: see invalid)",
                        },
                        "inserted": {"type": "integer"},
                        "duplicates": {"type": "integer"},
                        "updated": {
                            "type": "integer",
                            "description": "of the inserted, new versions of stored ids "
                            "(their previous versions ended: superseded)",
                        },
                        "edges": {"type": "integer"},
                        "invalid": {"type": "array", "items": {"type": "string"}},
                        "unresolved": {"type": "array", "items": {"type": "string"}},
                        "seconds": {"type": "number"},
                    },
                },
                "WrittenNode": {
                    "type": "object",
                    "required": ["project", "id", "node_id", "revision", "status"],
                    "properties": {
                        "project": {"type": "string"},
                        "id": {
                            "type": "string",
                            "description": "the node's id: the one given, or a generated "
                            "one ('n:' and a random UUID) for a node written without one",
                        },
                        "node_id": {"type": "integer"},
                        "revision": {"type": "integer", "minimum": 1},
                        "status": {
                            "type": "string",
                            "enum": ["created", "new_version", "unchanged"],
                            "description": "created: the id had no current version; "
                            "new_version: it replaced the current version (new content, "
                            "or the same content with other metadata or timestamp); "
                            "unchanged: equal to the current version, nothing written",
                        },
                    },
                },
                "Parent": _PARENT,
                "Grammar": _GRAMMAR,
                "Link": _LINK,
                "NodeDetail": _NODE_DETAIL,
                "NodePage": {
                    "type": "object",
                    "required": ["nodes", "next_cursor"],
                    "properties": {
                        "nodes": {
                            "type": "array",
                            "items": {"$ref": "#/components/schemas/NodeRow"},
                        },
                        "next_cursor": {"type": ["string", "null"]},
                        "count": {
                            "type": "integer",
                            "description": "with count=true: the nodes of every page",
                        },
                    },
                },
                "NodeRow": _NODE_ROW,
                "ForgetReport": {
                    "type": "object",
                    "required": ["project", "retired", "erased", "nodes"],
                    "properties": {
                        "project": {"type": "string"},
                        "retired": {"type": "integer", "description": "versions retired"},
                        "erased": {
                            "type": "integer",
                            "description": "versions erased (every version of each node)",
                        },
                        "nodes": {"type": "array", "items": {"type": "string"}},
                        "derived_policy": {"type": "string", "enum": ["flag", "cascade"]},
                        "derived_ended": {
                            "type": "integer",
                            "description": "derived nodes ended by the cascade policy",
                        },
                        "derived_unsupported": {
                            "type": "integer",
                            "description": "current derived nodes left with partial or no "
                            "support (memory.support)",
                        },
                        "dry_run": {
                            "type": "boolean",
                            "description": "present (true) on a dry run: nothing was written",
                        },
                        "matched": {
                            "type": "integer",
                            "description": "on a dry run: how many nodes the call would forget",
                        },
                    },
                },
                "History": {
                    "type": "object",
                    "required": ["project", "id", "versions"],
                    "properties": {
                        "project": {"type": "string"},
                        "id": {"type": "string"},
                        "versions": {"type": "array", "items": _VERSION},
                    },
                },
                "Result": _RESULT,
                "Evidence": _EVIDENCE,
                "ReviewItem": _REVIEW_ITEM,
                "ReviewPage": _REVIEW_PAGE,
                "ReviewDone": _REVIEW_DONE,
                "QueryResponse": {
                    "type": "object",
                    "properties": {
                        "query": {"type": "string"},
                        "project": {"type": ["string", "null"]},
                        "level_filter": {"type": "array", "items": {"type": "string"}},
                        "search_strategy": {"type": "string"},
                        "plan": {
                            "type": "object",
                            "description": "The optimizer's routing, and time_filter: the "
                            "dates the query names, the since/until applied, their source "
                            "(argument, extracted or null) and why; grammar: how the query "
                            "grammar read the query (memory.parse_query); filter: the "
                            "metadata filter applied (null: none)",
                            "properties": {
                                "grammar": {"$ref": "#/components/schemas/Grammar"},
                                "filter": {"type": ["object", "null"]},
                                "as_of": {"type": ["string", "null"], "format": "date-time"},
                                "valid_at": {
                                    "type": ["string", "null"],
                                    "format": "date-time",
                                },
                                "floor": {
                                    "type": "object",
                                    "description": "the relevance floor: min_cosine (the "
                                    "policy's, else the database model's: "
                                    f"{vocabulary.model_floors_prose()}; -1: off), "
                                    "source (argument, "
                                    "policy, model or null), applied, terms (the query's), "
                                    "keep_with_terms (how many of them a candidate below "
                                    "min_cosine must hold to be kept: 1 for a keyword query, "
                                    "floor_term_share of a longer one; null: none can), why (not "
                                    "applied: why)",
                                },
                                "recency": {
                                    "type": "object",
                                    "description": "recency as a ranking signal (the policy's "
                                    "recency_half_life_days and recency_weight; off unless "
                                    "set): half_life_days, weight, origin (the time ages count "
                                    "from: reference_time; null: now), applied",
                                    "properties": {
                                        "half_life_days": {"type": ["number", "null"]},
                                        "weight": {"type": "number"},
                                        "origin": {
                                            "type": ["string", "null"],
                                            "format": "date-time",
                                        },
                                        "applied": {"type": "boolean"},
                                    },
                                },
                            },
                        },
                        "results": {
                            "type": "array",
                            "items": {"$ref": "#/components/schemas/Result"},
                        },
                        "evidence": {
                            "type": "array",
                            "description": "The L0 turns the response cites, best first "
                            "(memory.select_evidence): those the results derive from and "
                            "those the query matches directly. cited_by: the ranks of the "
                            "results whose provenance reaches the turn; direct_rank: its rank "
                            "among direct matches (null: cited only)",
                            "items": {"$ref": "#/components/schemas/Evidence"},
                        },
                        "metrics": {
                            "type": "object",
                            "description": "Stage timings in ms, candidate counts, "
                            "embedding_cache_hit, and served_by: primary or replica "
                            "(POIMEN_READ_URLS)",
                            "properties": {
                                "served_by": {"type": "string", "enum": ["primary", "replica"]},
                                **_METRICS,
                            },
                        },
                        "withheld": {
                            "type": "integer",
                            "minimum": 0,
                            "description": "fused candidates the relevance floor held back",
                        },
                        "demoted": {
                            "type": "integer",
                            "minimum": 0,
                            "description": "results in doubt ranked below the supported ones",
                        },
                        "excluded": {
                            "type": "integer",
                            "minimum": 0,
                            "description": "results in doubt left out (unsupported=exclude)",
                        },
                        "latency_ms": {"type": "number"},
                        "notes": {"type": "string"},
                        "degraded": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "stage": {"type": "string"},
                                    "reason": {"type": "string"},
                                },
                            },
                        },
                    },
                },
            },
        },
    }
