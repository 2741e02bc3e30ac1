"""The MCP server driven by the official SDK's own client, against the real service (its own
uvicorn process on 127.0.0.1, POST /mcp) and over stdio (`poimen-memory mcp`), on a real
database: the tools and their schemas, a search whose answer is the HTTP answer field by
field, a write then a read, typed errors as tool errors, and the API keys."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import httpx2
import psycopg
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult
from psycopg import sql as pgsql

from poimen_core.nodes import MAX_ID_CHARS
from poimen_lab.live_server import live_server
from poimen_memory.api import mcp_route
from poimen_memory.api.app import create_app
from poimen_memory.api.mcp_server import PROJECT_URI, TOOLS
from poimen_memory.api.openapi import openapi_spec, query_parameters
from poimen_memory.cli.main import build_parser
from poimen_memory.contract.query import surfaces
from poimen_memory.db.cluster import Cluster
from poimen_memory.db.connect import connect, ensure_service_login
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.errors import ConfigError
from poimen_memory.settings import Settings
from service_client import KONG, make_key, query, serve

DOCS = Path(__file__).parent.parent / "docs" / "mcp.md"


@contextmanager
def _serving(url: str, log: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    env = {"POIMEN_DATABASE_URL": url, "POIMEN_AUTH_CACHE_S": "0", **(env or {})}
    with live_server(env, log) as base:
        yield base
    assert "Traceback" not in log.read_text(), log.read_text()[-4000:]


@pytest.fixture(scope="module")
def reader(
    cluster: Cluster,
    admin: psycopg.Connection[Any],
    template_db: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """One server for the tests that write nothing and make no key, on its own copy of the
    fixture database (anonymous mode throughout)."""
    name = f"mcp_{uuid.uuid4().hex[:12]}"
    admin.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    try:
        with _serving(cluster.url(name), tmp_path_factory.mktemp("mcp") / "server.log") as base:
            yield base
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def server(fixture_url: str, tmp_path: Path) -> Iterator[str]:
    """A server of its own, for a test that writes or makes keys."""
    with _serving(fixture_url, tmp_path / "server.log") as base:
        yield base


def _headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _leaf(exc: BaseException) -> BaseException:
    """The one error inside the task groups' wrapping."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def over_http(
    base: str,
    key: str | None,
    work: Callable[[Client], Awaitable[Any]],
    mode: str = "auto",
    statuses: list[int] | None = None,
) -> Any:
    """Run ``work`` with an SDK client connected to the service's /mcp with this key;
    ``statuses`` collects the HTTP statuses the SDK's transport saw."""

    async def record(response: httpx2.Response) -> None:
        if statuses is not None:
            statuses.append(response.status_code)

    async def run() -> Any:
        http = httpx2.AsyncClient(
            headers=_headers(key), timeout=60, event_hooks={"response": [record]}
        )
        transport = streamable_http_client(f"{base}/mcp", http_client=http)
        async with http, Client(transport, mode=mode) as client:  # type: ignore[arg-type]
            return await work(client)

    try:
        return asyncio.run(run())
    except BaseExceptionGroup as group:
        raise _leaf(group) from group


def _call(name: str, args: dict[str, Any]) -> Callable[[Client], Awaitable[CallToolResult]]:
    async def work(client: Client) -> CallToolResult:
        return await client.call_tool(name, args)

    return work


def _tool_error(result: CallToolResult) -> dict[str, Any]:
    assert result.is_error, result
    body: dict[str, Any] = result.structured_content
    assert result.content[0].text.startswith(f"{body['error']}: {body['detail']}")  # type: ignore[union-attr]
    return body


# What differs between two runs of the same query: how long it took, and the cache.
TIMING = re.compile(r"_ms$|^embedding_cache_hit$")


def _same_answer(mcp: dict[str, Any], http: dict[str, Any]) -> None:
    assert set(mcp) == set(http)
    for field in http:
        if field == "latency_ms":
            continue
        if field == "metrics":
            left = {k: v for k, v in mcp[field].items() if not TIMING.search(k)}
            right = {k: v for k, v in http[field].items() if not TIMING.search(k)}
            assert left == right
            continue
        assert mcp[field] == http[field], field


@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_tools_and_their_schemas(reader: str, mode: str) -> None:
    async def work(client: Client) -> Any:
        return (await client.list_tools()).tools

    tools = {t.name: t for t in over_http(reader, None, work, mode)}
    assert set(tools) == set(TOOLS) == {
        "memory_query", "memory_add", "memory_get", "memory_forget", "memory_history",
        "memory_review_list", "memory_review_claim", "memory_review_confirm",
        "memory_list",
    }  # fmt: skip
    # The review tools take the HTTP routes' parameters; only a claim or confirm writes.
    claim = tools["memory_review_claim"]
    assert set(claim.input_schema["properties"]) == {"project", "limit", "visibility_timeout"}
    assert claim.input_schema["properties"]["visibility_timeout"]["maximum"] == 86400
    assert tools["memory_review_confirm"].input_schema["required"] == ["item"]
    assert tools["memory_review_list"].annotations.read_only_hint  # type: ignore[union-attr]
    assert not claim.annotations.read_only_hint  # type: ignore[union-attr]
    query = tools["memory_query"]
    # The HTTP route's parameters, with the same schemas, but what a model sends: filter an
    # object (or its JSON text), the levels a list (or the comma string), and compact.
    assert set(query.input_schema["properties"]) == {n for n, *_ in query_parameters()} | {
        "levels", "compact",
    }  # fmt: skip
    qprops = query.input_schema["properties"]
    assert [a["type"] for a in qprops["filter"]["anyOf"]] == ["object", "string"]
    assert [a["type"] for a in qprops["level"]["anyOf"]] == ["string", "array"]
    assert qprops["levels"]["items"]["enum"] == ["L0", "L1", "L2"]
    assert query.input_schema["required"] == ["query"]
    assert query.input_schema["properties"]["strategy"]["enum"] == [
        "LexicalOnly", "LexicalFirst", "Hybrid", "SemanticOnly",
    ]  # fmt: skip
    assert query.annotations is not None and query.annotations.read_only_hint
    assert query.output_schema is not None
    assert {"Result", "Evidence", "Parent"} <= set(query.output_schema["$defs"])
    add = tools["memory_add"]
    assert add.input_schema["required"] == ["nodes"]
    assert add.input_schema["properties"]["nodes"]["items"]["properties"]["level"]["enum"] == [
        "L0", "L1", "L2",
    ]  # fmt: skip
    assert add.output_schema is not None and "inserted" in add.output_schema["properties"]
    # Fetch by id and history: GET /memory/nodes/{id}'s id and project, read-only.
    for name, output in (("memory_get", "NodeDetail"), ("memory_history", "History")):
        tool = tools[name]
        assert tool.input_schema["required"] == ["id"]
        assert set(tool.input_schema["properties"]) == {"id", "project"}
        id_schema = tool.input_schema["properties"]["id"]
        assert (id_schema["minLength"], id_schema["maxLength"]) == (1, MAX_ID_CHARS)
        assert tool.annotations is not None and tool.annotations.read_only_hint
        assert tool.output_schema is not None
        assert tool.output_schema["required"] == _openapi_schema(output)["required"]
    assert "parents" in tools["memory_get"].output_schema["properties"]  # type: ignore[index]
    forget = tools["memory_forget"]
    assert "required" not in forget.input_schema  # ids, or a filter
    props = forget.input_schema["properties"]
    assert set(props) == {
        "ids", "project", "erase", "reason", "filter", "source", "level", "since", "until",
        "dry_run", "max_nodes",
    }  # fmt: skip
    assert props["dry_run"]["type"] == "boolean"
    browse = tools["memory_list"]
    assert browse.annotations is not None and browse.annotations.read_only_hint
    assert {"filter", "newest_first", "count", "cursor", "limit"} <= set(
        browse.input_schema["properties"]
    )
    assert props["ids"]["minItems"] == 1 and props["ids"]["items"]["maxLength"] == MAX_ID_CHARS
    assert props["erase"] == {**props["erase"], "type": "boolean", "default": False}
    assert forget.annotations is not None and forget.annotations.destructive_hint
    assert not forget.annotations.read_only_hint
    assert forget.output_schema is not None
    assert forget.output_schema["required"] == ["project", "retired", "erased", "nodes"]


def test_agent_arguments_compact_answers_browse_and_forget_by_filter(
    server: str, fixture_url: str
) -> None:
    """What a model's tool call sends: filter an object, levels a list (the string forms
    still work, to the same answer); a compact answer; memory_list by filter, newest first,
    counted and paged; memory_forget by filter, its dry run's count what it then forgets."""
    word = f"scope{uuid.uuid4().hex[:10]}"
    mine, theirs = {"user": f"{word}-42"}, {"user": f"{word}-7"}
    nodes = [
        {"id": f"{word}-t1", "level": "L0", "text": f"{word}: Mara takes her tea green",
         "metadata": mine},
        {"id": f"{word}-t2", "level": "L0", "text": f"{word}: Mara walks to work",
         "metadata": mine},
        {"id": f"{word}-m1", "level": "L1", "text": f"{word} Mara likes green tea",
         "parents": [f"{word}-t1"], "metadata": mine},
        {"id": f"{word}-o1", "level": "L1", "text": f"{word} Tom likes green tea",
         "metadata": theirs},
    ]  # fmt: skip

    async def work(client: Client) -> dict[str, Any]:
        out: dict[str, Any] = {}
        add = await client.call_tool("memory_add", {"nodes": nodes, "project": "poimen"})
        assert not add.is_error, add.content
        base = {"query": f"{word} green tea", "project": "poimen", "strategy": "LexicalOnly"}
        for name, args in {
            "objects": {**base, "filter": mine, "level": ["L0", "L1"]},
            "plural": {**base, "filter": mine, "levels": ["L0", "L1"]},
            "strings": {**base, "filter": json.dumps(mine), "level": "L0,L1"},
            "compact": {**base, "filter": mine, "levels": ["L1"], "compact": True},
            "full": {**base, "filter": mine, "levels": ["L1"]},
            "all": {**base, "levels": ["L1"]},
        }.items():
            result = await client.call_tool("memory_query", args)
            assert not result.is_error, result.content
            out[name] = result.structured_content
        out["both"] = await client.call_tool("memory_query", {**base, "level": ["L1"],
                                                               "levels": ["L1"]})  # fmt: skip
        for name, args in {
            "list": {
                "project": "poimen",
                "filter": mine,
                "count": True,
                "limit": 2,
                "newest_first": True,
            },
            "dry": {"project": "poimen", "filter": mine, "dry_run": True},
            "forget": {"project": "poimen", "filter": mine, "reason": "user asked"},
            "after": {"project": "poimen", "filter": mine, "count": True},
            "other": {"project": "poimen", "filter": theirs, "count": True},
        }.items():
            tool = "memory_list" if name in ("list", "after", "other") else "memory_forget"
            result = await client.call_tool(tool, args)
            assert not result.is_error, result.content
            out[name] = result.structured_content
            if name == "list":  # the next page, before anything is forgotten
                page2 = await client.call_tool("memory_list", {
                    **args, "count": False, "cursor": out["list"]["next_cursor"]})  # fmt: skip
                out["page2"] = page2.structured_content
        out["nothing"] = await client.call_tool("memory_forget", {"project": "poimen"})
        return out

    out = over_http(server, None, work)
    ids = [r["external_id"] for r in out["objects"]["results"]]
    assert set(ids) == {f"{word}-t1", f"{word}-t2", f"{word}-m1"}
    for name in ("plural", "strings"):
        assert [r["external_id"] for r in out[name]["results"]] == ids, name
    assert f"{word}-o1" in [r["external_id"] for r in out["all"]["results"]]
    assert _tool_error(out["both"])["error"] == "invalid_parameter"
    compact = out["compact"]
    assert compact["compact"] is True and [r["id"] for r in compact["results"]] == [
        r["external_id"] for r in out["full"]["results"]
    ] == [f"{word}-m1"]
    (mem,) = compact["results"]
    assert set(mem) == {"id", "level", "text", "support", "cites"}
    assert mem["support"] == "full" and mem["cites"] == [f"{word}-t1"]
    assert compact["evidence"][0] == {"id": f"{word}-t1", "text": nodes[0]["text"]}
    assert all(set(e) == {"id", "text"} for e in compact["evidence"])
    assert len(json.dumps(compact)) < len(json.dumps(out["full"])) / 2
    assert out["list"]["count"] == 3
    assert [n["external_id"] for n in out["list"]["nodes"]] == [f"{word}-m1", f"{word}-t2"]
    assert [n["external_id"] for n in out["page2"]["nodes"]] == [f"{word}-t1"]
    assert out["dry"]["dry_run"] is True and out["dry"]["matched"] == 3
    assert out["forget"]["retired"] == out["dry"]["matched"]
    assert sorted(out["forget"]["nodes"]) == sorted(out["dry"]["nodes"])
    assert out["after"]["count"] == 0 and out["other"]["count"] == 1
    assert "a filter" in _tool_error(out["nothing"])["detail"]


def test_the_compact_answer_is_smaller(reader: str) -> None:
    """docs/mcp.md's numbers: a 5-result answer of the demo corpus, as the tool's text."""
    sizes = {}
    for compact in (False, True):
        args = {"query": KONG, "limit": 5, "level": ["L1", "L2"], "compact": compact}
        result = over_http(reader, None, _call("memory_query", args))
        assert not result.is_error, result.content
        sizes[compact] = len(result.content[0].text)  # type: ignore[union-attr]
    print(f"memory_query, 5 results: {sizes[False]} characters, compact {sizes[True]}")
    assert sizes[True] * 3 < sizes[False]


def _openapi_schema(name: str) -> dict[str, Any]:
    schema: dict[str, Any] = openapi_spec()["components"]["schemas"][name]
    return schema


def _scrape(base: str) -> str:
    return httpx.get(f"{base}/metrics", timeout=30).text


def _counter(scrape: str, line: str) -> float:
    found = re.search(rf"^{re.escape(line)} (\S+)$", scrape, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize(
    "params",
    [
        {"query": KONG},
        {"query": KONG, "project": "poimen", "limit": 3, "level": "L0,L1,L2", "evidence": 4},
        {"query": "kong", "strategy": "LexicalOnly", "fusion": "rrf", "timeout_seconds": 10},
        {"query": "uploads", "since": "2020-01-01", "until": "2030-12-31", "limit": 50},
        # a soft phrase raises, a strict one filters: the grammar in the database, for both
        {"query": 'what did alice raise in "kong.conf"', "project": "poimen", "level": "L0"},
        {"query": 'what did alice raise +"kong.conf"', "project": "poimen", "level": "L0"},
    ],
)
def test_a_query_answers_as_http_does(reader: str, params: dict[str, Any]) -> None:
    before = _scrape(reader)
    # The client checks the answer against the tool's output schema (the OpenAPI one).
    result = over_http(reader, None, _call("memory_query", params))
    assert not result.is_error, result.content
    # Counted as any request is, and its strategy as a query's is.
    after = _scrape(reader)
    mcp = 'poimen_http_requests_total{method="POST",route="/mcp",status="200"}'
    assert _counter(after, mcp) > _counter(before, mcp)
    ran = result.structured_content["search_strategy"]
    strategy = f'poimen_query_strategy_total{{strategy="{ran}"}}'
    assert _counter(after, strategy) == _counter(before, strategy) + 1
    http = httpx.get(f"{reader}/memory/query", params=params, timeout=30)
    assert http.status_code == 200, http.text
    _same_answer(result.structured_content, http.json())
    assert json.loads(result.content[0].text) == result.structured_content
    assert result.structured_content["results"], "the comparison must compare results"


def test_a_write_then_a_read(server: str, fixture_url: str) -> None:
    word = f"zyx{uuid.uuid4().hex[:10]}"
    nodes = [
        {"id": f"{word}-turn", "level": "L0", "text": f"the {word} deploy failed on Tuesday"},
        {"id": f"{word}-mem", "level": "L1", "text": f"{word} deploys fail on Tuesdays",
         "parents": [f"{word}-turn"], "metadata": {"team": "ops"}},
    ]  # fmt: skip
    add = _call("memory_add", {"nodes": nodes, "project": "poimen"})
    report = over_http(server, None, add)
    assert not report.is_error, report.content
    assert report.structured_content["inserted"] == 2 and report.structured_content["edges"] == 1
    again = over_http(server, None, add).structured_content  # idempotent
    assert again["inserted"] == 0 and again["duplicates"] == 2
    found = over_http(
        server, None, _call("memory_query", {"query": word, "project": "poimen", "level": "L1"})
    ).structured_content
    top = found["results"][0]
    assert top["external_id"] == f"{word}-mem"
    # Identity in results (issue 24): the id, the metadata, the support, the parents' ids.
    assert top["metadata"] == {"team": "ops"} and top["support"] == "full"
    assert [p["external_id"] for p in top["parents"]] == [f"{word}-turn"]
    assert [p["text"] for p in top["parents"]] == [nodes[0]["text"]]
    assert any(e["external_id"] == f"{word}-turn" for e in found["evidence"])


def test_a_write_answers_with_identity_over_mcp_and_http(server: str, fixture_url: str) -> None:
    """memory_add and POST /memory/nodes answer each node with its id (generated for a node
    written without one), revision and status; memory_get shows the revision, and the
    generated id is one memory_add, memory_get and memory_forget accept."""
    word = f"ids{uuid.uuid4().hex[:10]}"
    named = {"id": f"{word}-a", "level": "L0", "text": f"{word} named", "metadata": {"v": 1}}
    idless = {"level": "L0", "text": f"{word} without an id"}
    first, again, meta, got = _session(
        "http", server, fixture_url, None,
        [("memory_add", {"nodes": [named, idless], "project": "poimen"}),
         ("memory_add", {"nodes": [named, idless], "project": "poimen"}),
         ("memory_add", {"nodes": [{**named, "metadata": {"v": 2}}], "project": "poimen"}),
         ("memory_get", {"id": named["id"], "project": "poimen"})],
    )  # fmt: skip
    made = _ok(first)["nodes"]
    assert [(n["project"], n["revision"], n["status"]) for n in made] == [
        ("poimen", 1, "created"), ("poimen", 1, "created")
    ]  # fmt: skip
    generated = made[1]["id"]
    assert made[0]["id"] == named["id"] and generated.startswith("n:")
    assert [n["status"] for n in _ok(again)["nodes"]] == ["unchanged", "unchanged"]
    assert [n["id"] for n in _ok(again)["nodes"]] == [named["id"], generated]
    assert [(n["revision"], n["status"]) for n in _ok(meta)["nodes"]] == [(2, "new_version")]
    assert _ok(got)["revision"] == 2 and _ok(got)["metadata"] == {"v": 2}
    # The same over HTTP: a timestamp-only change is the next version too.
    r = httpx.post(f"{server}/memory/nodes", params={"project": "poimen"}, timeout=60,
                   json=[{**named, "metadata": {"v": 2}, "timestamp": "2025-01-02T00:00:00Z"},
                         idless])  # fmt: skip
    assert r.status_code == 201, r.text
    assert [(n["id"], n["revision"], n["status"]) for n in r.json()["nodes"]] == [
        (named["id"], 3, "new_version"), (generated, 1, "unchanged")
    ]  # fmt: skip
    fetched, forgot = _session(
        "http", server, fixture_url, None,
        [("memory_get", {"id": generated, "project": "poimen"}),
         ("memory_forget", {"ids": [generated], "project": "poimen"})],
    )  # fmt: skip
    assert _ok(fetched)["text"] == idless["text"] and _ok(fetched)["revision"] == 1
    assert _ok(forgot)["nodes"] == [generated] and _current(fixture_url, "poimen", generated) == 0


def test_a_write_is_one_transaction_unless_skip_invalid(server: str, fixture_url: str) -> None:
    good = {"id": "mcp-good", "level": "L1", "text": "a valid memory", "project": "poimen"}
    bad = {"id": "mcp-bad", "level": "L1", "text": "   ", "project": "poimen"}
    refused = over_http(server, None, _call("memory_add", {"nodes": [good, bad]}))
    assert _tool_error(refused)["error"] == "invalid_node"
    # The tool's argument, not the CLI's flag or the HTTP route's query parameter.
    assert _tool_error(refused)["hint"] == (
        "fix the lines, or skip them (the `skip_invalid` argument set to true)"
    )
    with connect(fixture_url) as conn:
        assert conn.execute(
            "SELECT count(*) FROM memory.nodes WHERE external_id = 'mcp-good'"
        ).fetchone() == (0,)
    skipped = over_http(
        server, None, _call("memory_add", {"nodes": [good, bad], "skip_invalid": True})
    ).structured_content
    assert skipped["inserted"] == 1 and len(skipped["invalid"]) == 1


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"a": 1}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    ("args", "code", "status", "sqlstate"),
    [
        ({"query": KONG, "project": "nope"}, "unknown_project", 404, "PM404"),
        ({"query": "   "}, "invalid_parameter", 400, None),
        ({"query": KONG, "since": "2023-02-30"}, "invalid_parameter", 400, "22023"),
        ({"query": KONG, "limit": "many"}, "invalid_parameter", 400, None),
        ({"query": KONG, "colour": "red"}, "invalid_parameter", 400, None),
        ({"query": "x" * 2001}, "invalid_parameter", 400, None),
        # An object nested deep (1,000 was a RecursionError, JSON-RPC code 0: deeper than
        # the SDK's client sends, so test_contract.py has it), a NUL in a key (was the
        # database's 22P05 message, which HTTP hid).
        ({"query": KONG, "filter": _nested(60)}, "invalid_parameter", 400, None),
        ({"query": KONG, "filter": {"k\u0000": "v"}}, "invalid_parameter", 400, None),
        # memory_query's own argument, checked by the tool (the contract checks the rest).
        ({"query": KONG, "compact": "yes"}, "invalid_parameter", 400, None),
    ],
)
def test_typed_errors_are_tool_errors(
    reader: str, args: dict[str, Any], code: str, status: int, sqlstate: str | None
) -> None:
    body = _tool_error(over_http(reader, None, _call("memory_query", args)))
    assert (body["error"], body["status"], body.get("sqlstate")) == (code, status, sqlstate)
    params = {k: json.dumps(v) if isinstance(v, dict) else v for k, v in args.items()}
    http = httpx.get(f"{reader}/memory/query", params=params, timeout=30)
    assert http.status_code == status and http.json()["error"] == code
    if "compact" in args:  # the tool's own argument; HTTP refuses it as unknown
        assert body["detail"] == 'compact must be true or false, got "yes"'
    elif "filter" not in args:  # HTTP's filter is text: over 4096 bytes before too deep
        assert http.json()["detail"] == body["detail"]


# (argument, value): one out-of-range value. memory_query (MCP) and GET /memory/query take
# it by its public name, memory.answer by its SQL name (the contract's Surface.sql).
OUT_OF_RANGE = [
    ("limit", 0),
    ("limit", 51),
    ("evidence", 101),
    ("evidence", -1),
    ("min_cosine", 2),
    ("candidates", 0),
    ("rrf_k", -1),
    ("dense_weight", 1.5),
    ("unsupported", "hide"),
    ("strategy", "Magic"),
    ("fusion", "borda"),
]


@pytest.mark.parametrize(("name", "value"), OUT_OF_RANGE)
def test_out_of_range_is_one_typed_error_in_http_mcp_and_sql(
    reader: str, conn: psycopg.Connection[Any], name: str, value: Any
) -> None:
    """The contract's bounds are the vocabulary's, which the SQL checks read: the same
    value is refused alike, in the same words, each naming the parameter as it is called
    there (HTTP and MCP limit, SQL k)."""
    mcp = _tool_error(over_http(reader, None, _call("memory_query", {"query": KONG, name: value})))
    http = httpx.get(f"{reader}/memory/query", params={"query": KONG, name: value}, timeout=30)
    assert http.status_code == 400 and mcp["status"] == 400
    assert http.json()["error"] == mcp["error"] == "invalid_parameter"
    assert http.json()["detail"] == mcp["detail"]
    assert mcp["detail"].startswith(f"{name} must be ")
    sql = surfaces()[name].sql
    assert sql is not None
    with pytest.raises(psycopg.errors.InvalidParameterValue) as raised:
        conn.execute(
            pgsql.SQL("SELECT memory.answer(%s, {} => %s)").format(pgsql.Identifier(sql)),
            (KONG, value),
        )
    assert raised.value.diag.message_primary == mcp["detail"].replace(name, sql, 1)


# Issue 43: the attack's query (290 distinct exclusions, 1,928 characters, under the
# service's 2,000) and a text over the cap.
COSTLY = "Caroline " + " ".join(f"-w{i}x" for i in range(290))


@pytest.mark.parametrize(
    ("query", "detail"),
    [
        (COSTLY, "query has 290 operands, at most 16 are allowed"),
        ("kong " * 400 + "x", "query is longer than 2000 characters"),
    ],
    ids=["operands", "length"],
)
def test_a_costly_query_is_one_typed_error_in_http_mcp_and_sql(
    reader: str, conn: psycopg.Connection[Any], query: str, detail: str
) -> None:
    """The bounds of a query's cost hold in SQL, and HTTP and MCP run the same plan: the
    same 400, in the same words, before anything runs."""
    mcp = _tool_error(over_http(reader, None, _call("memory_query", {"query": query})))
    http = httpx.get(f"{reader}/memory/query", params={"query": query}, timeout=30)
    assert http.status_code == 400 and mcp["status"] == 400
    assert http.json()["error"] == mcp["error"] == "invalid_parameter"
    assert http.json()["detail"] == mcp["detail"] == detail
    with pytest.raises(psycopg.errors.InvalidParameterValue) as raised:
        conn.execute("SELECT memory.answer(%s)", (query,))
    assert raised.value.diag.message_primary == detail


def test_over_the_work_budget_is_query_too_costly_in_http_mcp_and_sql(
    server: str, conn: psycopg.Connection[Any]
) -> None:
    """The budget memory._plan checks (policy query_max_postings), on the server's own
    database: PM400 in SQL, 400 query_too_costly naming the limit over HTTP and MCP."""
    conn.execute("SELECT memory.set_policy('query_max_postings', '3')")
    with pytest.raises(psycopg.Error) as raised:
        conn.execute("SELECT memory.answer(%s)", (KONG,))
    assert raised.value.sqlstate == "PM400"
    mcp = _tool_error(over_http(server, None, _call("memory_query", {"query": KONG})))
    http = httpx.get(f"{server}/memory/query", params={"query": KONG}, timeout=30)
    assert http.status_code == 400 and mcp["status"] == 400
    assert http.json()["error"] == mcp["error"] == "query_too_costly"
    assert http.json()["detail"] == mcp["detail"]
    assert mcp["detail"].endswith("postings, at most 3 are read")
    assert "query_max_postings" in http.json()["hint"]
    conn.execute("SELECT memory.reset_policy('query_max_postings')")
    again = httpx.get(f"{server}/memory/query", params={"query": KONG}, timeout=30)
    assert again.status_code == 200


def test_an_unknown_tool_is_a_protocol_error(reader: str) -> None:
    with pytest.raises(MCPError, match="unknown tool"):
        over_http(reader, None, _call("memory_forget_everything", {}))


def test_an_invalid_argument_is_quoted_within_bounds(reader: str) -> None:
    """jsonschema's message quotes the value whole: a 100 kB id made a 200 kB answer."""
    body = _tool_error(over_http(reader, None, _call("memory_get", {"id": "x" * 100_000})))
    assert body["error"] == "invalid_parameter"
    assert body["detail"].startswith("id: 'xxx") and len(body["detail"]) < 400, body["detail"]
    assert body["detail"].endswith(" characters)")


def test_a_key_named_twice_in_one_object_is_an_invalid_request(reader: str) -> None:
    """The SDK keeps a repeated key's last value: "name" twice ran the second tool (a write)
    while whatever read the first (a gateway, a log) saw a read (a helper's attack)."""
    call = (
        '{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "memory_query",'
        ' "arguments": {"query": "kong"}, "name": "memory_add", "arguments": {"nodes": []}}}'
    )
    headers = {"content-type": "application/json", "accept": "application/json, text/event-stream"}
    r = httpx.post(f"{reader}/mcp", content=call, headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "code": -32600,
        "message": "Invalid request: key 'name' is given more than once in an object",
    }
    once = call.replace(', "name": "memory_add", "arguments": {"nodes": []}', "")
    assert httpx.post(f"{reader}/mcp", content=once, headers=headers, timeout=30).status_code == 200


def test_a_request_whose_id_is_no_string_or_integer_is_an_invalid_request(reader: str) -> None:
    """MCP's request ids are strings or integers, never null. The SDK took a request with
    another id for a notification: 202, no answer and no tool run, so the client waited out
    its timeout (a helper's attack). Now JSON-RPC's invalid request; a notification (no id)
    and the ids MCP allows are answered as before."""
    headers = {"content-type": "application/json", "accept": "application/json, text/event-stream"}
    for ident, shown in ((1.5, "1.5"), (True, "true"), (None, "null"), ({"x": 1}, '{"x": 1}'),
                         ([1], "[1]")):  # fmt: skip
        call = json.dumps({"jsonrpc": "2.0", "id": ident, "method": "ping"})
        r = httpx.post(f"{reader}/mcp", content=call, headers=headers, timeout=30)
        assert r.status_code == 400, (ident, r.text)
        assert r.json() == {"jsonrpc": "2.0", "id": None, "error": {
            "code": -32600,
            "message": f"Invalid request: a request's id is a string or an integer, not {shown}",
        }}  # fmt: skip
    for ident in (7, "seven", -1, 10**20):
        call = json.dumps({"jsonrpc": "2.0", "id": ident, "method": "ping"})
        r = httpx.post(f"{reader}/mcp", content=call, headers=headers, timeout=30)
        assert r.status_code == 200 and r.json()["id"] == ident, r.text
    note = json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"})
    assert httpx.post(f"{reader}/mcp", content=note, headers=headers, timeout=30).status_code == 202
    # a client's response (an id and no method) is no request: its id is not checked
    answer = json.dumps({"jsonrpc": "2.0", "id": None, "error": {"code": -1, "message": "x"}})
    r = httpx.post(f"{reader}/mcp", content=answer, headers=headers, timeout=30)
    assert r.status_code == 202, r.text


def test_a_body_that_is_not_json_is_415_with_the_error_body(reader: str) -> None:
    """The SDK answered a body of another type with a 400 in bare text (no Content-Type);
    the service refuses it as its node writes do: 415 and the JSON error body.
    application/json with parameters is JSON."""
    ping = '{"jsonrpc": "2.0", "id": 1, "method": "ping"}'
    accept = "application/json, text/event-stream"
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None):
        headers = {"accept": accept} | ({"content-type": kind} if kind else {})
        r = httpx.post(f"{reader}/mcp", content=ping, headers=headers, timeout=30)
        assert r.status_code == 415, (kind, r.text)
        assert r.headers["content-type"] == "application/json"
        body = r.json()
        assert body["error"] == "unsupported_media_type"
        assert body["detail"] == (
            f"an MCP request's body must be application/json, got {kind or 'no content type'!r}"
        )
        assert "Content-Type: application/json" in body["hint"]
    # a media type in any case, with parameters (the SDK itself compared it as written)
    for kind in ("application/json; charset=utf-8", "Application/JSON", "APPLICATION/json ;x=y"):
        json_type = {"accept": accept, "content-type": kind}
        r = httpx.post(f"{reader}/mcp", content=ping, headers=json_type, timeout=30)
        assert r.status_code == 200 and r.json()["result"] == {}, (kind, r.text)


def test_api_keys_are_enforced(server: str, fixture_url: str) -> None:
    assert not over_http(server, None, _call("memory_query", {"query": KONG})).is_error
    reader = make_key(fixture_url, ["poimen"])
    # Without a key the endpoint refuses before MCP: the HTTP API's 401 body.
    raw = httpx.post(f"{server}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
    assert raw.status_code == 401 and raw.json()["error"] == "unauthorized"
    for key in (None, "pmk_not-a-key"):
        statuses: list[int] = []
        with pytest.raises(MCPError):
            over_http(server, key, _call("memory_query", {"query": KONG}), statuses=statuses)
        assert set(statuses) == {401}
    # A key reads its own project only, and writes nothing when read-only.
    mine = over_http(server, reader, _call("memory_query", {"query": KONG})).structured_content
    assert {r["project"] for r in mine["results"]} == {"poimen"}
    other = over_http(server, reader, _call("memory_query", {"query": KONG, "project": "atlas"}))
    assert _tool_error(other)["error"] == "forbidden"
    node = {"id": "mcp-key", "level": "L1", "text": "written with a key", "project": "poimen"}
    ro = over_http(server, reader, _call("memory_add", {"nodes": [node]}))
    assert (_tool_error(ro)["error"], _tool_error(ro)["status"]) == ("forbidden", 403)
    writer = make_key(fixture_url, ["poimen"], write=True)
    elsewhere = over_http(
        server, writer, _call("memory_add", {"nodes": [{**node, "project": "atlas"}]})
    )
    assert _tool_error(elsewhere)["error"] == "forbidden"
    ok = over_http(server, writer, _call("memory_add", {"nodes": [node]}))
    assert not ok.is_error and ok.structured_content["inserted"] == 1


def _summaries(url: str) -> dict[str, dict[str, Any]]:
    """What each project's resource must say, read from the database as its owner."""
    with connect(url) as conn:
        rows = conn.execute(
            "SELECT p.name, n.level, count(*) FILTER (WHERE n.expired_at IS NULL),"
            " count(*) FILTER (WHERE n.expired_at IS NOT NULL),"
            " max(greatest(n.created_at, n.expired_at))"
            " FROM memory.projects p JOIN memory.nodes n ON n.project_id = p.id"
            " GROUP BY p.name, n.level"
        ).fetchall()
    out: dict[str, dict[str, Any]] = {}
    for name, level, current, ended, latest in rows:
        empty = {"L0": 0, "L1": 0, "L2": 0}
        s = out.setdefault(name, {"project": name, "nodes": empty, "total": 0,
                                  "ended_versions": 0, "latest_write": None})  # fmt: skip
        s["nodes"][level] = current
        s["total"] += current
        s["ended_versions"] += ended
        s["latest_write"] = max(filter(None, [s["latest_write"], latest.isoformat()]))
    return out


def _resources(uris: list[str]) -> Callable[[Client], Awaitable[dict[str, Any]]]:
    """List the resources and the templates, then read each of uris (an error as its data)."""

    async def work(client: Client) -> dict[str, Any]:
        listed = (await client.list_resources()).resources
        templates = (await client.list_resource_templates()).resource_templates
        read: dict[str, Any] = {}
        for uri in uris:
            try:
                result = await client.read_resource(uri)
            except MCPError as err:
                read[uri] = ("error", err.code, err.data)
            else:
                (content,) = result.contents
                assert content.mime_type == "application/json" and content.uri == uri
                read[uri] = json.loads(content.text)  # type: ignore[union-attr]
        return {"listed": listed, "templates": templates, "read": read}

    return work


def test_projects_are_resources(reader: str, template_db: str, cluster: Cluster) -> None:
    expected = _summaries(cluster.url(template_db))
    assert set(expected) == {"atlas", "poimen"}
    uris = ["poimen://projects/poimen", "poimen://projects/atlas", "poimen://projects/nope",
            "file:///etc/passwd"]  # fmt: skip
    got = over_http(reader, None, _resources(uris))
    assert [(r.uri, r.name, r.mime_type) for r in got["listed"]] == [
        ("poimen://projects/atlas", "atlas", "application/json"),
        ("poimen://projects/poimen", "poimen", "application/json"),
    ]
    (template,) = got["templates"]
    assert template.uri_template == "poimen://projects/{name}"
    read = got["read"]
    assert read["poimen://projects/poimen"] == expected["poimen"]
    assert read["poimen://projects/atlas"] == expected["atlas"]
    assert read["poimen://projects/poimen"]["nodes"]["L0"] > 0
    code, status, data = read["poimen://projects/nope"]
    assert (code, status) == ("error", -32602)
    assert (data["error"], data["status"], data["sqlstate"]) == ("unknown_project", 404, "PM404")
    _, _, bad = read["file:///etc/passwd"]
    assert (bad["error"], bad["status"]) == ("invalid_parameter", 400)


def test_a_key_sees_only_its_projects_as_resources(fixture_url: str, tmp_path: Path) -> None:
    """As deployed: the service's own role, under row-level security (the stdio test below
    runs as the superuser, where only the key's filter stands between the projects)."""
    with connect(fixture_url, autocommit=True) as conn:
        ensure_service_login(conn, "poimen_service")
    service_url = fixture_url.replace("postgresql://postgres@", "postgresql://poimen_service@")
    key = make_key(fixture_url, ["poimen"])
    uris = ["poimen://projects/poimen", "poimen://projects/atlas"]
    with _serving(service_url, tmp_path / "server.log") as server:
        got = over_http(server, key, _resources(uris))
        # Without a key, once keys exist, the endpoint refuses before MCP.
        with pytest.raises(MCPError):
            over_http(server, None, _resources([]))
    assert [r.uri for r in got["listed"]] == ["poimen://projects/poimen"]
    assert got["read"]["poimen://projects/poimen"] == _summaries(fixture_url)["poimen"]
    code, status, data = got["read"]["poimen://projects/atlas"]
    assert (code, status) == ("error", -32602)
    # Refused with the typed error, and nothing of the project's in it.
    assert (data["error"], data["status"]) == ("forbidden", 403)
    assert data["detail"] == "this key does not cover project 'atlas'"
    assert set(data) <= {"error", "detail", "context", "hint", "status", "sqlstate"}


def _stdio(
    url: str, api_key: str | None, extra: dict[str, str] | None = None
) -> StdioServerParameters:
    """`poimen-memory mcp` on this database, with this key in POIMEN_API_KEY."""
    env = {k: v for k, v in os.environ.items() if k.startswith(("PYTHON", "POIMEN_"))}
    env |= {"POIMEN_DATABASE_URL": url, "POIMEN_AUTH_CACHE_S": "0", **(extra or {})}
    if api_key:
        env["POIMEN_API_KEY"] = api_key
    return StdioServerParameters(
        command=sys.executable, args=["-m", "poimen_memory.cli.main", "mcp"], env=env
    )


def test_stdio(fixture_url: str) -> None:
    """`poimen-memory mcp`: the same tools over stdin and stdout; the key from POIMEN_API_KEY."""
    key = make_key(fixture_url, ["poimen"])

    def params(api_key: str | None) -> StdioServerParameters:
        return _stdio(fixture_url, api_key)

    async def run(api_key: str | None, args: dict[str, Any]) -> tuple[list[str], CallToolResult]:
        async with Client(params(api_key)) as client:
            names = [t.name for t in (await client.list_tools()).tools]
            return names, await client.call_tool("memory_query", args)

    names, result = asyncio.run(run(key, {"query": KONG}))
    assert sorted(names) == sorted(TOOLS)

    async def resources() -> dict[str, Any]:
        async with Client(params(key)) as client:
            uris = ["poimen://projects/poimen", "poimen://projects/atlas"]
            return await _resources(uris)(client)

    got = asyncio.run(resources())
    assert [r.uri for r in got["listed"]] == ["poimen://projects/poimen"]
    assert got["read"]["poimen://projects/poimen"] == _summaries(fixture_url)["poimen"]
    _, _, refused = got["read"]["poimen://projects/atlas"]
    assert (refused["error"], refused["status"]) == ("forbidden", 403)
    assert not result.is_error, result.content
    assert {r["project"] for r in result.structured_content["results"]} == {"poimen"}
    _, other = asyncio.run(run(key, {"query": KONG, "project": "atlas"}))
    assert _tool_error(other)["error"] == "forbidden"
    _, anonymous = asyncio.run(run(None, {"query": KONG}))
    assert _tool_error(anonymous)["error"] == "unauthorized"


# -- fetch by id, forget, history: over both transports --------------------------------------

Calls = list[tuple[str, dict[str, Any]]]


def _session(
    transport: str,
    base: str,
    url: str,
    key: str | None,
    calls: Calls,
    env: dict[str, str] | None = None,
) -> list[CallToolResult]:
    """These tool calls in order, in one client session: over HTTP to the service at
    ``base``, or over stdio to a `poimen-memory mcp` of its own on ``url`` (with ``env``)."""

    async def work(client: Client) -> list[CallToolResult]:
        return [await client.call_tool(name, args) for name, args in calls]

    if transport == "http":
        results: list[CallToolResult] = over_http(base, key, work)
        return results

    async def run() -> list[CallToolResult]:
        async with Client(_stdio(url, key, env)) as client:
            return await work(client)

    try:
        return asyncio.run(run())
    except BaseExceptionGroup as group:
        raise _leaf(group) from group


def _ok(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, result.content
    body: dict[str, Any] = result.structured_content
    assert json.loads(result.content[0].text) == body  # type: ignore[union-attr]
    return body


def _http_get(base: str, key: str, node_id: str, **params: str) -> httpx.Response:
    return httpx.get(
        f"{base}/memory/nodes/{node_id}", params=params, headers=_headers(key), timeout=30
    )


def _as_http(tool_error: dict[str, Any]) -> dict[str, Any]:
    """A tool error's body as the HTTP route answers it (without status and sqlstate)."""
    return {k: v for k, v in tool_error.items() if k not in ("status", "sqlstate")}


def _current(url: str, project: str, external_id: str) -> int:
    with connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM memory.nodes n JOIN memory.projects p ON p.id = n.project_id"
            " WHERE p.name = %s AND n.external_id = %s AND n.expired_at IS NULL",
            (project, external_id),
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("transport", ["http", "stdio"])
def test_remember_fetch_forget(transport: str, server: str, fixture_url: str) -> None:
    """Remember, fetch by id, forget, fetch again (unknown_node), with the key checks of the
    HTTP routes: a read-only key fetches but does not forget; a key for another project
    finds nothing of this one's (as if missing) and forgets none of it."""
    word = f"mcp{uuid.uuid4().hex[:10]}"
    turn, mem, comma = f"{word}-turn", f"{word}-mem", f"{word},with-a-comma"
    writer = make_key(fixture_url, ["poimen"], write=True)
    reader = make_key(fixture_url, ["poimen"])
    other = make_key(fixture_url, ["atlas"], write=True)

    def run(key: str, calls: Calls) -> list[CallToolResult]:
        return _session(transport, server, fixture_url, key, calls)

    nodes = [
        {"id": turn, "level": "L0", "text": f"the {word} rollout stalled at 40%"},
        {"id": mem, "level": "L1", "text": f"{word} rollouts stall near half way",
         "parents": [turn], "metadata": {"team": "release"}},
        {"id": comma, "level": "L1", "text": f"{word} ids may hold commas", "parents": [turn]},
    ]  # fmt: skip
    added, got, history = run(
        writer,
        [
            ("memory_add", {"nodes": nodes, "project": "poimen"}),
            ("memory_get", {"id": mem}),
            ("memory_history", {"id": mem}),
        ],
    )
    assert _ok(added)["inserted"] == 3
    node = _ok(got)
    # What GET /memory/nodes/{id} answers, field by field.
    http = _http_get(server, writer, mem)
    assert http.status_code == 200, http.text
    assert node == http.json()
    assert (node["external_id"], node["project"], node["level"]) == (mem, "poimen", "L1")
    assert node["metadata"] == {"team": "release"} and node["support"] == "full"
    assert [p["external_id"] for p in node["parents"]] == [turn]
    (version,) = _ok(history)["versions"]
    assert version["current"] and version["text"] == nodes[1]["text"]

    # A read-only key fetches, and is refused a forget (nothing ended).
    read_get, read_forget = run(
        reader, [("memory_get", {"id": mem}), ("memory_forget", {"ids": [mem]})]
    )
    assert _ok(read_get) == node
    refused = _tool_error(read_forget)
    assert (refused["error"], refused["status"]) == ("forbidden", 403)
    assert refused["detail"] == "this key is read-only"

    # A key for another project: the node is not found, exactly as a missing one is; naming
    # its project is forbidden; a forget ends nothing.
    missing = f"{word}-never-written"
    hidden, absent, named, forget_named, forget_own = run(
        other,
        [
            ("memory_get", {"id": mem}),
            ("memory_get", {"id": missing}),
            ("memory_get", {"id": mem, "project": "poimen"}),
            ("memory_forget", {"ids": [mem], "project": "poimen"}),
            ("memory_forget", {"ids": [mem]}),  # the key's project, atlas
        ],
    )
    hidden_body, absent_body = _tool_error(hidden), _tool_error(absent)
    assert (hidden_body["error"], hidden_body["status"]) == ("unknown_node", 404)
    assert hidden_body == {
        k: (v.replace(missing, mem) if isinstance(v, str) else v) for k, v in absent_body.items()
    }
    http = _http_get(server, other, mem)
    assert http.status_code == 404 and http.json() == _as_http(hidden_body)
    for result in (named, forget_named):
        body = _tool_error(result)
        assert (body["error"], body["status"]) == ("forbidden", 403)
        assert body["detail"] == "this key does not cover project 'poimen'"
    assert (_tool_error(forget_own)["error"], _tool_error(forget_own)["status"]) == (
        "unknown_node", 404,
    )  # fmt: skip
    assert _current(fixture_url, "poimen", mem) == 1

    # The writer forgets: retired, then unknown to a fetch and to a second forget; its
    # history keeps the version. Several ids at once (one holding a comma) are erased.
    forgot, gone, after, again, erased, turn_history = run(
        writer,
        [
            ("memory_forget", {"ids": [mem], "reason": "wrong about the rollout"}),
            ("memory_get", {"id": mem}),
            ("memory_history", {"id": mem, "project": "poimen"}),
            ("memory_forget", {"ids": [mem]}),
            ("memory_forget", {"ids": [turn, comma, missing], "erase": True}),
            ("memory_history", {"id": turn}),
        ],
    )
    report = _ok(forgot)
    assert (report["project"], report["retired"], report["erased"]) == ("poimen", 1, 0)
    assert report["nodes"] == [mem]
    assert _current(fixture_url, "poimen", mem) == 0
    gone_body = _tool_error(gone)
    assert (gone_body["error"], gone_body["status"], gone_body["sqlstate"]) == (
        "unknown_node", 404, "PM444",
    )  # fmt: skip
    http = _http_get(server, writer, mem)
    assert http.status_code == 404 and http.json() == _as_http(gone_body)
    (ended,) = _ok(after)["versions"]
    assert not ended["current"] and ended["end_reason"] == "retired"
    assert ended["end_note"] == "wrong about the rollout"
    assert _tool_error(again)["error"] == "unknown_node"
    wiped = _ok(erased)
    assert (wiped["retired"], wiped["erased"]) == (0, 2)
    assert sorted(wiped["nodes"]) == sorted([turn, comma])  # the missing id: not there
    (tombstone,) = _ok(turn_history)["versions"]
    assert tombstone["end_reason"] == "erased" and tombstone["text"] is None
    assert _current(fixture_url, "poimen", turn) == _current(fixture_url, "poimen", comma) == 0


@pytest.mark.parametrize("transport", ["http", "stdio"])
def test_an_id_in_two_projects_is_ambiguous(transport: str, server: str, fixture_url: str) -> None:
    both = make_key(fixture_url, ["poimen", "atlas"], write=True)
    dup = f"mcp-dup-{uuid.uuid4().hex[:8]}"
    nodes = [
        {"id": dup, "level": "L1", "text": f"{dup} in poimen", "project": "poimen"},
        {"id": dup, "level": "L1", "text": f"{dup} in atlas", "project": "atlas"},
    ]
    # atlas's node updated: a fetch reads its current version, and its old one does not
    # count as a third node of the id.
    update = {**nodes[1], "text": f"{dup} in atlas, updated"}
    added, updated, ambiguous, named, forget = _session(
        transport, server, fixture_url, both,
        [
            ("memory_add", {"nodes": nodes}),
            ("memory_add", {"nodes": [update]}),
            ("memory_get", {"id": dup}),
            ("memory_get", {"id": dup, "project": "atlas"}),
            ("memory_forget", {"ids": [dup]}),  # a key for two projects must name one
        ],
    )  # fmt: skip
    assert _ok(added)["inserted"] == 2 and _ok(updated)["updated"] == 1
    body = _tool_error(ambiguous)
    assert (body["error"], body["status"]) == ("ambiguous_node", 409)
    assert body["detail"] == f'id "{dup}" names nodes in 2 projects'
    http = _http_get(server, both, dup)
    assert http.status_code == 409
    # The same error, each hint in its front's words: a tool argument, a query parameter.
    assert (
        body["hint"] == "name the project with the `project` argument (ids are unique per project)"
    )
    assert http.json()["hint"] == "name the project with ?project= (ids are unique per project)"
    assert {**http.json(), "hint": None} == {**_as_http(body), "hint": None}
    assert "hint: name the project with the `project` argument" in ambiguous.content[0].text  # type: ignore[union-attr]
    assert _ok(named)["text"] == update["text"]
    assert _ok(named) == _http_get(server, both, dup, project="atlas").json()
    refused = _tool_error(forget)
    assert (refused["error"], refused["status"]) == ("forbidden", 403)
    assert refused["hint"] == "name it with the `project` argument: one of atlas, poimen"
    deleted = httpx.delete(f"{server}/memory/nodes/{dup}", headers=_headers(both), timeout=30)
    assert deleted.status_code == 403
    assert deleted.json()["hint"] == "name it with ?project=: one of atlas, poimen"
    assert _current(fixture_url, "poimen", dup) == _current(fixture_url, "atlas", dup) == 1


def test_a_missing_project_is_asked_for_in_each_fronts_words(reader: str) -> None:
    """Anonymous mode: a node's history needs its project (ids are per project)."""
    body = _tool_error(over_http(reader, None, _call("memory_history", {"id": "a"})))
    http = httpx.get(f"{reader}/memory/nodes/a/history", timeout=30)
    assert http.status_code == 400 and (body["error"], body["status"]) == ("invalid_parameter", 400)
    assert body["hint"] == "name it with the `project` argument (ids are per project)"
    assert http.json() == {**_as_http(body), "hint": "name it with ?project= (ids are per project)"}


# The least POIMEN_HTTP_MAX_RESPONSE_BYTES takes, and texts that outweigh it together.
BUDGET = {"POIMEN_HTTP_MAX_RESPONSE_BYTES": str(64 * 1024)}


def _long(word: str, n: int) -> str:
    return (f"{word} note {n} on the storage migration " * 600)[:20_000]


@pytest.mark.parametrize("transport", ["http", "stdio"])
def test_a_read_over_the_byte_budget_is_the_http_413(
    transport: str, fixture_url: str, tmp_path: Path
) -> None:
    """memory_query, memory_get and memory_history answer within the HTTP routes' byte
    budget (POIMEN_HTTP_MAX_RESPONSE_BYTES, one check for both fronts): over it, the tool
    error is the HTTP route's 413 body, plus its status; a write's report is not refused."""
    word = f"budget{uuid.uuid4().hex[:8]}"
    notes = [{"id": f"{word}-{n}", "level": "L1", "text": _long(word, n)} for n in range(4)]
    lived = f"{word}-lived"
    versions = [{"id": lived, "level": "L1", "text": _long(f"{word}v{v}", v)} for v in range(5)]
    calls: Calls = [("memory_add", {"nodes": notes, "project": "poimen"})]
    calls += [("memory_add", {"nodes": [v], "project": "poimen"}) for v in versions]
    search = {"query": f"{word} storage migration", "project": "poimen", "limit": 5}
    calls += [
        ("memory_get", {"id": lived, "project": "poimen"}),
        ("memory_history", {"id": lived, "project": "poimen"}),
        ("memory_query", search),
        ("memory_query", {**search, "limit": 1}),
    ]
    with _serving(fixture_url, tmp_path / "server.log", BUDGET) as base:
        *added, got, history, query, one = _session(
            transport, base, fixture_url, None, calls, BUDGET
        )
        http_history = httpx.get(
            f"{base}/memory/nodes/{lived}/history", params={"project": "poimen"}, timeout=30
        )
        http_query = httpx.get(f"{base}/memory/query", params={**search, "limit": "5"}, timeout=30)
    assert [_ok(a)["inserted"] for a in added[:2]] == [4, 1]
    assert [_ok(a)["updated"] for a in added[2:]] == [1] * 4
    assert _ok(got)["text"] == versions[-1]["text"]
    assert len(_ok(one)["results"]) == 1
    body = _tool_error(history)
    assert (body["error"], body["status"]) == ("response_too_large", 413)
    assert http_history.status_code == 413 and http_history.json() == _as_http(body)
    assert "POIMEN_HTTP_MAX_RESPONSE_BYTES" in body["hint"]
    body = _tool_error(query)
    assert (body["error"], body["status"]) == ("response_too_large", 413)
    refused = http_query.json()
    assert http_query.status_code == 413
    # The weights differ by the latencies' digits; the words do not.
    assert {k: v for k, v in refused.items() if k != "detail"} == {
        k: v for k, v in _as_http(body).items() if k != "detail"
    }
    assert re.fullmatch(r"the answer is \d+ bytes, over the 65536-byte budget", body["detail"])


@pytest.mark.parametrize(
    ("tool", "args", "code", "status"),
    [
        ("memory_get", {}, "invalid_parameter", 400),
        ("memory_get", {"id": ""}, "invalid_parameter", 400),
        ("memory_get", {"id": "x" * (MAX_ID_CHARS + 1)}, "invalid_parameter", 400),
        ("memory_get", {"id": 7}, "invalid_parameter", 400),
        ("memory_get", {"id": "a\x00b"}, "invalid_parameter", 400),  # api/nodes.py's check
        ("memory_get", {"id": "x", "project": "no spaces"}, "invalid_parameter", 400),
        ("memory_get", {"id": "x", "level": "L1"}, "invalid_parameter", 400),
        ("memory_get", {"id": "x", "project": "nope"}, "unknown_project", 404),
        ("memory_forget", {"ids": []}, "invalid_parameter", 400),
        ("memory_forget", {"ids": "a,b", "project": "poimen"}, "invalid_parameter", 400),
        ("memory_forget", {"ids": ["a"], "erase": "yes"}, "invalid_parameter", 400),
        ("memory_forget", {"ids": ["a\x00b"], "project": "poimen"}, "invalid_parameter", 400),
        ("memory_forget", {"ids": ["a"]}, "invalid_parameter", 400),  # no project (no key)
        ("memory_forget", {"ids": ["a"], "project": "nope"}, "unknown_project", 404),
        ("memory_history", {"id": "a"}, "invalid_parameter", 400),  # no project (no key)
        ("memory_history", {"id": "never-written", "project": "poimen"}, "unknown_node", 404),
    ],
)
def test_node_tools_typed_errors(
    reader: str, tool: str, args: dict[str, Any], code: str, status: int
) -> None:
    body = _tool_error(over_http(reader, None, _call(tool, args)))
    assert (body["error"], body["status"]) == (code, status), body


# -- docs/mcp.md: its examples, run ------------------------------------------------------------


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOCS.read_text(), re.S)


def test_the_docs_python_example_runs(server: str, fixture_url: str) -> None:
    key = make_key(fixture_url, ["poimen"])
    (code,) = _blocks("python")
    code = re.sub(r'^URL = ".*"$', f'URL = "{server}/mcp"', code, count=1, flags=re.M)
    code = re.sub(r'^KEY = ".*"$', f'KEY = "{key}"', code, count=1, flags=re.M)
    assert server in code and key in code
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("1 ") and " cites [" in lines[0], out.stdout


def test_the_docs_configurations_and_error_name_what_is_served(reader: str) -> None:
    stdio, http, error, resource = (json.loads(b) for b in _blocks("json"))
    # The table of tools names every tool served, once.
    table = re.findall(r"^\| `(memory_\w+)` \|", DOCS.read_text(), re.M)
    assert sorted(table) == sorted(TOOLS)
    (local,) = stdio["mcpServers"].values()
    assert Path(local["command"]).name == "poimen-memory" and local["args"] == ["mcp"]
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert "mcp" in commands
    env_keys = {f.metadata["env"] for f in fields(Settings) if "env" in f.metadata}
    assert set(local["env"]) <= env_keys
    (remote,) = http["mcpServers"].values()
    assert urlsplit(remote["url"]).path == "/mcp" and remote["type"] == "http"
    assert remote["headers"]["Authorization"].startswith("Bearer pmk_")
    # The error shown is the one the service gives.
    result = over_http(reader, None, _call("memory_query", {"query": KONG, "project": "nope"}))
    assert _tool_error(result) == error
    # The resource shown is poimen's as the service reads it (its latest write aside).
    served = over_http(reader, None, _resources([PROJECT_URI.format(name="poimen")]))["read"]
    (summary,) = served.values()
    assert {**summary, "latest_write": None} == {**resource, "latest_write": None}
    assert summary["latest_write"] and resource["latest_write"]


def test_dns_rebinding_is_refused(reader: str) -> None:
    """Anonymous mode on loopback is what a web page reached through DNS rebinding would
    find: it sends its own name as Host (and its origin as Origin). POST /mcp answers only
    loopback names (POIMEN_MCP_ALLOWED_HOSTS / _ORIGINS), before any tool runs."""
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    headers = {"Accept": "application/json, text/event-stream"}
    port = urlsplit(reader).port
    ok = httpx.post(f"{reader}/mcp", json=ping, headers=headers)
    assert ok.status_code == 200, ok.text
    rebound = httpx.post(
        f"{reader}/mcp", json=ping, headers={**headers, "Host": f"evil.example:{port}"}
    )
    assert rebound.status_code == 421, rebound.text
    foreign = httpx.post(
        f"{reader}/mcp", json=ping, headers={**headers, "Origin": "http://evil.example"}
    )
    assert foreign.status_code == 403, foreign.text
    local = httpx.post(
        f"{reader}/mcp", json=ping, headers={**headers, "Origin": f"http://localhost:{port}"}
    )
    assert local.status_code == 200, local.text
    for bad in ("*", "a,*", ","):
        with pytest.raises(ConfigError):
            Settings.from_env({"POIMEN_MCP_ALLOWED_ORIGINS": bad})
    assert Settings.from_env({"POIMEN_MCP_ALLOWED_HOSTS": "*"}).mcp_allowed_hosts == ("*",)


def test_resources_list_is_paged(
    cluster: Cluster,
    admin: psycopg.Connection[Any],
    template_db: str,
    tmp_path: Path,
) -> None:
    """POIMEN_MCP_PAGE_SIZE bounds a resources/list page; nextCursor walks the rest in name
    order, and a cursor the server did not make is a typed invalid_parameter."""

    async def pages(client: Client) -> dict[str, Any]:
        first = await client.list_resources()
        second = await client.list_resources(cursor=first.next_cursor)
        try:
            await client.list_resources(cursor="not base64 ~~~")
        except MCPError as err:
            bad = (err.code, err.data)
        return {"first": first, "second": second, "bad": bad}

    name = f"mcp_{uuid.uuid4().hex[:12]}"
    admin.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    try:
        env = {"POIMEN_MCP_PAGE_SIZE": "1"}
        with _serving(cluster.url(name), tmp_path / "server.log", env) as base:
            got = over_http(base, None, pages)
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    assert [r.name for r in got["first"].resources] == ["atlas"]
    assert got["first"].next_cursor
    assert [r.name for r in got["second"].resources] == ["poimen"]
    assert got["second"].next_cursor is None
    code, data = got["bad"]
    assert code == -32602 and (data["error"], data["status"]) == ("invalid_parameter", 400), data


def test_a_start_loads_no_mcp_sdk() -> None:
    """The SDK (about a second of CPU to import) is loaded by the first POST /mcp, not by the
    app nor by its lifespan: the endpoint's keeper, started and given the loop, imports none
    of it."""
    code = (
        "import asyncio, sys\n"
        "from poimen_memory.api.app import create_app\n"
        "from poimen_memory.api.mcp_route import McpRoute\n"
        "from poimen_memory.settings import Settings\n"
        "create_app(Settings.from_env({}))\n"
        "async def main():\n"
        "    async with McpRoute(Settings.from_env({})).run():\n"
        "        for _ in range(20):\n"
        "            await asyncio.sleep(0.01)\n"
        "asyncio.run(main())\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mcp', 'mcp_types')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


_PING = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
_ACCEPT = {"Accept": "application/json, text/event-stream"}


def test_concurrent_first_requests_load_the_server_once(
    fixture_url: str, embedder: LocalEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests that arrive while the server loads wait for that one load; the app's other
    routes answer meanwhile (the load is held here until /healthz has answered)."""
    built: list[int] = []
    real = mcp_route._build
    healthy = threading.Event()

    def counting(settings: Settings) -> Any:
        built.append(1)
        assert healthy.wait(30), "GET /healthz did not answer while the MCP server loaded"
        return real(settings)

    monkeypatch.setattr(mcp_route, "_build", counting)
    app = create_app(Settings.from_env({"POIMEN_DATABASE_URL": fixture_url}), embedder=embedder)

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client,
        ):
            pings = [
                asyncio.create_task(client.post("/mcp", json=_PING, headers=_ACCEPT))
                for _ in range(4)
            ]
            await asyncio.sleep(0.2)  # the pings are in, waiting for the load
            health = await client.get("/healthz")
            assert not any(p.done() for p in pings)
            healthy.set()
            return [health, *await asyncio.gather(*pings)]

    answers = asyncio.run(run())
    assert [r.status_code for r in answers] == [200] * 5, [r.text for r in answers]
    assert all(r.json() == {"jsonrpc": "2.0", "id": 1, "result": {}} for r in answers[1:])
    assert built == [1]


def test_a_caller_without_a_key_loads_nothing(
    fixture_url: str, embedder: LocalEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where keys are required, a POST /mcp without one is the 401 it always was, before the
    server is loaded: an anonymous caller cannot make the service import the SDK."""
    built: list[int] = []
    monkeypatch.setattr(mcp_route, "_build", lambda settings: built.append(1))
    make_key(fixture_url, ["poimen"])
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as client:
        r = client.post("/mcp", json=_PING, headers=_ACCEPT)
    assert (r.status_code, r.json()["error"]) == (401, "unauthorized"), r.text
    assert built == []


def test_a_server_that_cannot_load_is_a_typed_500_and_the_rest_serves(
    fixture_url: str,
    embedder: LocalEmbedder,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its cause goes to the log once, not to the client."""

    def broken(settings: Settings) -> Any:
        raise ImportError("No module named 'mcp'")

    monkeypatch.setattr(mcp_route, "_build", broken)
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as client:
        for _ in range(2):
            r = client.post("/mcp", json=_PING, headers=_ACCEPT)
            assert r.status_code == 500, r.text
            body = r.json()
            assert (body["error"], body["detail"]) == (
                "internal_error",
                "the MCP server could not start",
            )
            assert "mcp" not in body["hint"], body
        assert query(client, query=KONG)["results"]
    causes = [r for r in caplog.records if r.getMessage().startswith("the MCP server could not")]
    assert len(causes) == 1 and "No module named 'mcp'" in causes[0].getMessage()
