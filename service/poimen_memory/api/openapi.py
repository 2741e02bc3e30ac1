"""The OpenAPI 3.1 description of every endpoint and its error bodies."""

from __future__ import annotations

from typing import Any

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


_PARENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        k: {"type": ["string", "null"]}
        for k in ("level", "sha256", "source", "title", "text", "timestamp")
    }
    | {"parents": {"type": "array", "items": {"$ref": "#/components/schemas/Parent"}}},
}

_RESULT: dict[str, Any] = {
    "type": "object",
    "properties": {
        **{
            k: {"type": ["string", "null"]}
            for k in (
                "level",
                "sha256",
                "project",
                "title",
                "text",
                "source",
                "timestamp",
                "fusion_method",
            )
        },
        "breadcrumb": {"type": "array", "items": {"type": "string"}},
        **{
            k: {"type": ["number", "null"]}
            for k in ("query_score", "lexical_score", "final_score", "rerank_score")
        },
        **{k: {"type": ["integer", "null"]} for k in ("semantic_rank", "lexical_rank")},
        "parents": {"type": "array", "items": {"$ref": "#/components/schemas/Parent"}},
    },
}


def openapi_spec() -> dict[str, Any]:
    q = [
        ("query", True, {"type": "string", "maxLength": 2000}, "Text to search for."),
        ("project", False, {"type": "string"}, "Restrict to one project; unknown → 404."),
        ("level", False, {"type": "string", "default": "L1,L2"}, "Subset of L0,L1,L2."),
        (
            "limit",
            False,
            {"type": "integer", "default": 5, "minimum": 1, "maximum": 50},
            "Clamped to [1, 50].",
        ),
        (
            "timeout_seconds",
            False,
            {"type": "number", "default": 5, "minimum": 1, "maximum": 30},
            "One deadline for the whole request; clamped to [1, 30].",
        ),
        ("fusion", False, {"type": "string", "enum": ["rrf", "convex"]}, "Fusion for Hybrid."),
        (
            "strategy",
            False,
            {"type": "string", "enum": ["LexicalOnly", "LexicalFirst", "Hybrid", "SemanticOnly"]},
            "Override the optimizer's routing.",
        ),
    ]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "poimen-memory",
            "version": "0.1.0",
            "description": "Three-level memory retrieval with provenance to L0 evidence.",
        },
        "paths": {
            "/memory/query": {
                "get": {
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
                            "invalid_parameter: missing/empty query, bad level, bad number"
                        ),
                        "404": _err("unknown_project"),
                        "409": _err("embedding_model_mismatch: query vector dimension differs"),
                        "412": _err("embedding_not_configured: nothing ingested yet"),
                        "503": _err(
                            "timeout, embedding_service_unavailable or database_unavailable"
                        ),
                    },
                }
            },
            "/memory/nodes": {
                "post": {
                    "summary": "Ingest nodes (JSON array or NDJSON, the nodes.jsonl format)",
                    "parameters": [
                        {"name": "project", "in": "query", "schema": {"type": "string"}},
                        {"name": "skip_invalid", "in": "query", "schema": {"type": "boolean"}},
                    ],
                    "responses": {
                        "201": {"description": "Ingest report (inserted, duplicates, edges, ...)"},
                        "400": _err("invalid_node: a line failed validation; nothing written"),
                        "409": _err("embedding_model_mismatch"),
                        "503": _err("database_unavailable or embedding_service_unavailable"),
                    },
                }
            },
            "/healthz": {
                "get": {
                    "summary": "Each dependency and the active engines",
                    "responses": {
                        "200": {"description": "healthy"},
                        "503": {"description": "database down"},
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document",
                    "responses": {"200": {"description": "OpenAPI 3.1"}},
                }
            },
            "/metrics": {
                "get": {
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
        "components": {
            "schemas": {
                "Error": _ERROR,
                "Parent": _PARENT,
                "Result": _RESULT,
                "QueryResponse": {
                    "type": "object",
                    "properties": {
                        "query": {"type": "string"},
                        "project": {"type": ["string", "null"]},
                        "level_filter": {"type": "array", "items": {"type": "string"}},
                        "search_strategy": {"type": "string"},
                        "plan": {"type": "object"},
                        "results": {
                            "type": "array",
                            "items": {"$ref": "#/components/schemas/Result"},
                        },
                        "metrics": {
                            "type": "object",
                            "description": "Stage timings in ms, candidate counts, "
                            "embedding_cache_hit, and served_by: primary or replica "
                            "(POIMEN_READ_URLS)",
                            "properties": {
                                "served_by": {"type": "string", "enum": ["primary", "replica"]}
                            },
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
            }
        },
    }
