"""Issue 43's batteries, kept: inputs a hostile client sends, each a typed 4xx with nothing
written and nothing of the server's own words shown (the browser's cross-origin write is in
test_ui_browser.py, Host and Origin in test_service_misc.py, fair admission in
test_admission.py, the query contract's bounds in test_contract.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from starlette.testclient import TestClient

from poimen_core.vocabulary import NOTE_MAX_CHARS
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.errors import from_sqlstate
from service_client import KONG, serve

Conn = psycopg.Connection[Any]


@pytest.fixture
def client(fixture_url: str, embedder: LocalEmbedder) -> Iterator[TestClient]:
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as c:
        yield c


def _error(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert body["error"] == code, body
    return body


def _write(client: TestClient, external_id: str) -> None:
    node = {"id": external_id, "level": "L1", "project": "poimen", "text": f"about {external_id}"}
    r = client.post("/memory/nodes", json=[node])
    assert r.status_code == 201, r.text


def _versions(conn: Conn, external_id: str) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT revision, end_reason, end_note FROM memory.nodes WHERE external_id = %s"
        " ORDER BY revision",
        (external_id,),
    ).fetchall()


def test_a_nul_in_a_history_id_is_400(client: TestClient) -> None:
    body = _error(client.get("/memory/nodes/a%00b/history", params={"project": "poimen"}), 400,
                  "invalid_parameter")  # fmt: skip
    assert body["detail"] == "id contains a NUL character"


def test_a_reason_longer_than_a_note_is_400_and_forgets_nothing(
    client: TestClient, conn: Conn
) -> None:
    _write(client, "kept-node")
    long = "r" * (NOTE_MAX_CHARS + 1)
    r = client.delete("/memory/nodes/kept-node", params={"project": "poimen", "reason": long})
    body = _error(r, 400, "invalid_parameter")
    assert body["detail"] == f"reason is longer than {NOTE_MAX_CHARS} characters"
    assert _versions(conn, "kept-node") == [(1, None, None)]
    fine = "r" * NOTE_MAX_CHARS
    r = client.delete("/memory/nodes/kept-node", params={"project": "poimen", "reason": fine})
    assert r.status_code == 200, r.text
    assert _versions(conn, "kept-node") == [(1, "retired", fine)]


def test_an_id_ending_in_history_is_not_deleted_by_its_path(client: TestClient, conn: Conn) -> None:
    """GET /memory/nodes/x/history reads x's history, so DELETE of the same path may not
    retire a node called x/history; the query form names it."""
    _write(client, "x/history")
    r = client.delete("/memory/nodes/x/history", params={"project": "poimen"})
    body = _error(r, 400, "invalid_parameter")
    assert "DELETE /memory/nodes?id=" in body["hint"]
    assert _versions(conn, "x/history") == [(1, None, None)]
    r = client.delete("/memory/nodes", params={"project": "poimen", "id": "x/history"})
    assert r.status_code == 200, r.text
    assert _versions(conn, "x/history")[0][1] == "retired"


@pytest.mark.parametrize(
    "flt",
    [
        '{"a":' * 1000 + "1" + "}" * 1000,  # 1,000 deep: was a RecursionError, a 500
        '{"k\\u0000": "v"}',  # jsonb holds no NUL: was 22P05, a 500
        '{"k": ["v\\u0000"]}',
    ],
)
@pytest.mark.parametrize("route", ["/memory/query", "/memory/nodes"])
def test_a_deep_or_nul_filter_is_400(client: TestClient, route: str, flt: str) -> None:
    params = {"query": KONG, "filter": flt} if route == "/memory/query" else {"filter": flt}
    body = _error(client.get(route, params=params), 400, "invalid_parameter")
    assert body["detail"].startswith("filter "), body


def test_the_servers_own_words_are_never_shown() -> None:
    """A full disk's error names a data file: HTTP and MCP alike show its SQLSTATE alone
    (PoimenError.public_json, the one place that decides)."""
    err = from_sqlstate(
        "53100", 'could not extend file "base/16384/2619.1": No space left on device'
    )
    for front in ("http", "mcp"):
        body = err.public_json(front)
        assert "base/" not in json.dumps(body) and "53100" in body["detail"]
        assert body["error"] == "database_unavailable"
    ours = from_sqlstate("22023", "k must be within 1..50, got 0")
    assert ours.public_json("http")["detail"] == "k must be within 1..50, got 0"
