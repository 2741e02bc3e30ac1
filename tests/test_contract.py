"""The query request is declared once (poimen_memory.contract): the OpenAPI parameters, the
MCP tool's input schema and the SQL request (memory.answer's arguments, memory._plan's
document) all come from, or equal, that one declaration."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from poimen_core import vocabulary
from poimen_core.nodes import NODE_FIELDS, NodeRecord, parse_line
from poimen_memory.api.mcp_server import QUERY, tools
from poimen_memory.api.openapi import openapi_spec
from poimen_memory.contract.query import (
    QueryRequest,
    bounds,
    parse_query,
    public_names,
    query_string_parameters,
    surfaces,
)
from poimen_memory.errors import ValidationError
from poimen_memory.settings import Settings

Conn = psycopg.Connection[Any]


def _sql_arguments(conn: Conn, function: str) -> list[str]:
    (names,) = conn.execute(
        "SELECT proargnames FROM pg_proc WHERE oid = %s::regproc", (f"memory.{function}",)
    ).fetchone()
    return list(names)


def test_openapi_and_mcp_take_the_declared_parameters() -> None:
    declared = list(public_names().values())
    spec = openapi_spec()["paths"]["/memory/query"]["get"]["parameters"]
    assert [p["name"] for p in spec] == declared
    (query_tool,) = (t for t in tools(Settings()) if t.name == QUERY)
    properties = query_tool.input_schema["properties"]
    # MCP adds levels (level's plural, a list) and compact (its small answer).
    assert set(properties) == set(declared) | {"levels", "compact"}
    for name, required, schema, _ in query_string_parameters(Settings()):
        assert (name in query_tool.input_schema["required"]) == required
        if "enum" in schema:
            assert properties[name]["enum"] == schema["enum"]


def test_sql_takes_the_declared_parameters(conn: Conn) -> None:
    """memory.answer's arguments are the declaration's SQL names (and the query vector,
    which the service embeds); memory.query's the same without evidence (it cites none)."""
    sql = [s.sql for s in surfaces().values() if s.sql is not None]
    answer = _sql_arguments(conn, "answer")
    assert set(answer) == set(sql) | {"query_embedding"}
    assert set(_sql_arguments(conn, "query")) == set(answer) - {"evidence"}
    # The service's document is memory._plan's: the same keys memory.answer sends it.
    plan = conn.execute(
        "SELECT memory.plan_query('kong', k => 3, levels => ARRAY['L0'])"
    ).fetchone()
    assert plan is not None and plan[0]["k"] == 3
    document = parse_query({"query": "kong"}, Settings()).document()
    assert set(document) == set(sql) | {"routing"}


def test_the_bounds_are_the_vocabularys() -> None:
    """Each bounded field states the vocabulary's range (SQL's), or the deployment's cap."""
    s = Settings()
    params = {name: schema for name, _, schema, _ in query_string_parameters(s)}
    for python, field in QueryRequest.model_fields.items():
        name, sql = public_names()[python], surfaces()[public_names()[python]].sql
        if python in bounds(s):
            assert (params[name]["minimum"], params[name]["maximum"]) == bounds(s)[python]
        elif sql in vocabulary.REQUEST_BOUNDS:
            lo, hi = vocabulary.REQUEST_BOUNDS[sql]
            assert (params[name]["minimum"], params[name]["maximum"]) == (lo, hi), name
        else:
            assert "minimum" not in params[name], (name, field)


def test_a_deployment_cap_is_stated_and_enforced() -> None:
    s = Settings(max_limit=7, max_timeout_s=12.0, max_query_chars=300)
    params = {name: schema for name, _, schema, _ in query_string_parameters(s)}
    assert params["limit"]["maximum"] == 7 and params["timeout_seconds"]["maximum"] == 12
    assert params["query"]["maxLength"] == 300
    assert parse_query({"query": "kong", "limit": "7"}, s).limit == 7
    with pytest.raises(ValidationError, match=r"limit must be within 1\.\.7, got 8"):
        parse_query({"query": "kong", "limit": "8"}, s)


@pytest.mark.parametrize(
    ("params", "detail"),
    [
        ({"query": "kong", "dense_weight": "5"}, "dense_weight must be within 0..1, got 5"),
        ({"query": "kong", "colour": "red"}, "unknown parameter 'colour'"),
        ({"query": "kong", "level": "L0,L9"}, "level must be a comma-separated subset"),
        ({"query": "kong", "level": ["L0", "L9"]}, "level must name levels of L0, L1, L2"),
        ({"query": "kong", "filter": "[1]"}, "filter must be a JSON object, got list"),
        ({"query": "kong", "filter": {"k": "v\x00"}}, "filter contains a NUL character"),
        # Deeper than the vocabulary's 8, far deeper than Python's recursion limit.
        (
            {"query": "kong", "filter": '{"a":' * 1500 + "1" + "}" * 1500},
            "filter must be at most 4096 bytes",
        ),
        (
            {"query": "kong", "filter": '{"a":' * 9 + "1" + "}" * 9},
            "filter must be nested at most 8 deep",
        ),
        ({"query": "kong", "as_of": ""}, "as_of must be an ISO 8601 timestamp, got ''"),
        # parsed, but past year 9999 (or before year 1) in UTC: a 500 before
        (
            {"query": "kong", "as_of": "9999-12-31T23:59:59-14:00"},
            "as_of is out of range once in UTC, got '9999-12-31T23:59:59-14:00'",
        ),
        ({"query": "kong", "valid_at": "0001-01-01T00:00:00+14:00"}, "valid_at is out of range"),
        ({"query": "kong", "limit": "\u0663"}, "limit must be a whole number"),
        ({"query": "kong", "min_cosine": "inf"}, "min_cosine must be a finite number"),
        ({"query": "kong", "limit": True}, "limit must be a number, got true"),
        ({"query": "kong", "evidence": 2.5}, "evidence must be a whole number, got 2.5"),
    ],
)
def test_a_bad_value_is_refused_by_name(params: dict[str, Any], detail: str) -> None:
    with pytest.raises(ValidationError) as raised:
        parse_query(params, Settings())
    assert raised.value.message.startswith(detail), raised.value.message


def test_the_lab_and_the_cli_build_a_request_by_its_python_names() -> None:
    req = QueryRequest(query="kong", levels=("L0",), limit=3, timeout_s=2)
    assert req.document()["levels"] == ["L0"] and req.document()["k"] == 3
    # The fronts name it publicly only: level, not levels; timeout_seconds, not timeout_s.
    with pytest.raises(ValidationError, match="unknown parameter 'levels'"):
        parse_query({"query": "kong", "levels": "L0"}, Settings())


def test_the_node_schema_declares_what_the_parser_reads() -> None:
    """POST /memory/nodes' Node schema (and memory_add's) names the keys the parser reads,
    and a node that sets every one of them is read whole."""
    schema = openapi_spec()["components"]["schemas"]["Node"]
    assert tuple(schema["properties"]) == NODE_FIELDS
    node = {
        "id": "n1", "level": "L1", "project": "p", "text": "t", "title": "T", "source": "s",
        "timestamp": "2024-01-01T00:00:00Z", "parents": ["a"], "breadcrumb": ["b"],
        "metadata": {"k": "v"}, "revision": 0, "valid_from": "2024-01-01T00:00:00Z",
        "valid_to": "2025-01-01T00:00:00Z", "expires_at": "2030-01-01T00:00:00Z",
    }  # fmt: skip
    assert set(node) == set(NODE_FIELDS)
    record = parse_line(json.dumps(node), 1, None)
    assert isinstance(record, NodeRecord), record
    default = NodeRecord(line_no=1, project="", level="", text="")
    renamed = {"id": "external_id"}
    for key in NODE_FIELDS:
        attribute = renamed.get(key, key)
        assert getattr(record, attribute) != getattr(default, attribute), key


def test_the_node_schema_and_the_parser_agree_on_an_ids_type() -> None:
    """The schema said an id could be a JSON number, which the parser refuses (12345 and
    12345.0 would not name one node): a client generated from it sent what the service
    answers 400. Both take a string or null now, and neither a number."""
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(openapi_spec()["components"]["schemas"]["Node"])
    base = {"level": "L0", "project": "p", "text": "t"}
    for value, ok in (("n1", True), (None, True), (5, False), (5.0, False)):
        node = {**base, "id": value}
        assert validator.is_valid(node) is ok, value
        assert isinstance(parse_line(json.dumps(node), 1, None), NodeRecord) is ok, value


def test_an_object_filter_deeper_than_recursion_is_a_typed_error() -> None:
    """An MCP call's filter arrives as an object: 1,500 levels of it are measured without
    recursion (json.dumps of it was a RecursionError, a JSON-RPC error with code 0)."""
    value: dict[str, Any] = {"a": 1}
    for _ in range(1500):
        value = {"a": value}
    with pytest.raises(ValidationError, match="filter must be nested at most 8 deep"):
        parse_query({"query": "kong", "filter": value}, Settings())


def test_an_answers_result_is_the_sql_row(conn: Conn) -> None:
    """A query's result is declared twice only in form: memory.query_row (SQL's declared
    type) and the OpenAPI Result schema name the same fields, but for what each front adds
    to its own (the HTTP result's evidence accounting)."""
    attributes = {
        name
        for (name,) in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'memory.query_row'::regclass"
            " AND attnum > 0 AND NOT attisdropped"
        ).fetchall()
    }
    result = set(openapi_spec()["components"]["schemas"]["Result"]["properties"])
    assert sorted(result - attributes) == sorted(HTTP_ONLY), sorted(result - attributes)
    assert sorted(attributes - result) == sorted(SQL_ONLY), sorted(attributes - result)


# What the HTTP result adds: its provenance tree (SQL's rows carry it as `provenance`),
# the evidence list's accounting, and the reranker's score (the service reranks).
HTTP_ONLY = {"parents", "provenance_l0_omitted", "rerank_score"}
# What a SQL row adds: the node's row id, its provenance tree as one jsonb, and the
# strategy on every row (the HTTP answer says it once, as search_strategy).
SQL_ONLY = {"node_id", "provenance", "search_strategy"}
