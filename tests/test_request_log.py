"""One JSON log line per request, carrying the request id that the response header
returns; query text only when POIMEN_LOG_QUERY_TEXT is on."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from poimen_lab.live_server import live_server
from poimen_memory.api.app import create_app
from poimen_memory.api.request_log import LOGGER
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.settings import Settings
from service_client import KONG, LoopbackClient

TIMINGS = {"embed", "lexical", "semantic", "fusion", "rerank", "provenance", "evidence", "total"}


def lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    out = []
    for record in caplog.records:
        if record.name == LOGGER:
            message = record.getMessage()
            assert "\n" not in message  # one line each
            out.append(json.loads(message))
    return out


@pytest.fixture
def client_for(fixture_url: str, embedder: LocalEmbedder) -> Iterator[Any]:
    clients: list[TestClient] = []

    def make(extra: Mapping[str, str] | None = None) -> TestClient:
        env = {"POIMEN_DATABASE_URL": fixture_url, **(extra or {})}
        c = LoopbackClient(create_app(Settings.from_env(env), embedder=embedder))
        c.__enter__()
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def test_client_request_id_is_logged_and_returned(
    client_for: Any, caplog: pytest.LogCaptureFixture
) -> None:
    client = client_for()
    caplog.clear()
    response = client.get(
        "/memory/query",
        params={"query": KONG, "project": "poimen"},
        headers={"X-Request-ID": "trace-7f3a.b:2"},
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "trace-7f3a.b:2"
    body = response.json()
    (line,) = lines(caplog)
    assert line["request_id"] == "trace-7f3a.b:2"
    assert line["logger"] == LOGGER and line["level"] == "info"
    assert (line["method"], line["path"], line["status"]) == ("GET", "/memory/query", 200)
    assert line["duration_ms"] > 0
    assert line["strategy"] == body["search_strategy"] == "Hybrid"
    assert line["project"] == "poimen"
    assert line["results"] == len(body["results"])
    assert set(line["timings_ms"]) == TIMINGS
    assert line["timings_ms"]["total"] == body["metrics"]["total_time_ms"]
    assert line["degraded"] == ["rerank:not_configured"]
    # No query text, in any field, unless configured.
    raw = json.dumps(line)
    assert "query" not in line and "kong" not in raw.lower() and "10KB" not in raw


def test_generated_ids_are_fresh_per_request(
    client_for: Any, caplog: pytest.LogCaptureFixture
) -> None:
    client = client_for()
    caplog.clear()
    responses = [
        client.get("/healthz"),
        client.get("/memory/query", params={"query": "kong", "project": "nope"}),
        client.get("/memory/query", headers={"X-Request-ID": "bad id with spaces"}),
        client.get("/memory/query", headers={"X-Request-ID": "x" * 129}),
    ]
    logged = lines(caplog)
    assert len(logged) == len(responses)  # exactly one line per request
    ids = [r.headers["x-request-id"] for r in responses]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids), ids  # unusable ids replaced
    assert len(set(ids)) == len(ids)
    assert [x["request_id"] for x in logged] == ids
    assert [x["status"] for x in logged] == [200, 404, 400, 400]
    # A failed query has no strategy or timings to report.
    assert "strategy" not in logged[1] and "timings_ms" not in logged[1]


def test_query_text_only_when_configured(client_for: Any, caplog: pytest.LogCaptureFixture) -> None:
    client = client_for({"POIMEN_LOG_QUERY_TEXT": "true"})
    caplog.clear()
    client.get("/memory/query", params={"query": KONG, "project": "poimen"})
    client.get("/memory/query", params={"query": "x", "project": "nope"})
    logged = lines(caplog)
    assert [x["query"] for x in logged] == [KONG, "x"]


def test_real_server_writes_json_lines(fixture_url: str, tmp_path: Path) -> None:
    """`uvicorn --factory` with nothing configuring logging: the lines reach stderr."""
    output = tmp_path / "server.log"
    with live_server({"POIMEN_DATABASE_URL": fixture_url}, output) as url:
        response = httpx.get(
            f"{url}/memory/query",
            params={"query": KONG, "project": "poimen"},
            headers={"X-Request-ID": "live-42"},
            timeout=30,
        )
        assert response.status_code == 200
        assert response.headers["x-request-id"] == "live-42"
        # U+2028 and U+0085 in a path, raw in the log, split the record for readers that
        # break lines as Unicode does (str.splitlines, JavaScript): a helper's attack
        odd = httpx.get(
            f"{url}/y%E2%80%A8%7B%22fake%22:1%7D%C2%85z", headers={"X-Request-ID": "odd-1"}
        )
        assert odd.status_code == 404
    logged = [json.loads(x) for x in output.read_text().splitlines() if x.startswith("{")]
    (line,) = [x for x in logged if x["request_id"] == "live-42"]
    assert line["status"] == 200 and line["strategy"] == "Hybrid"
    (odd_line,) = [x for x in logged if x["request_id"] == "odd-1"]
    assert odd_line["status"] == 404 and "fake" not in odd_line
    assert "kong" not in output.read_text().lower()
