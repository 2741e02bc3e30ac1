"""What no route catches (api/asgi.py LastResort), on a real uvicorn server: a JSON 500 on a
connection that stays usable (it was closed without `Connection: close`, so the client's
next request failed with ECONNRESET), and a client that leaves mid-body is its own doing,
not a 500 in the request log."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from starlette.requests import Request
from starlette.routing import Route

from conftest import free_port
from poimen_memory.api.app import create_app
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.settings import Settings


async def _boom(request: Request) -> Any:
    raise RuntimeError("a bug no handler knows")


@pytest.fixture
def server(fixture_url: str, embedder: LocalEmbedder) -> Iterator[int]:
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_HTTP_BODY_TIMEOUT_S": "1"}
    app = create_app(Settings.from_env(env), embedder=embedder)
    app.router.routes.insert(0, Route("/memory/boom", _boom))  # a route with a bug
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    yield port
    srv.should_exit = True
    thread.join(10)


def test_an_unexpected_error_is_a_json_500_and_the_connection_stays_usable(server: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=10)
    try:
        conn.request("GET", "/memory/boom")
        r = conn.getresponse()
        body = json.loads(r.read())
        assert r.status == 500 and body == {"error": "internal_error", "detail": "RuntimeError"}
        assert r.getheader("connection") != "close"
        conn.request("GET", "/healthz")  # the same connection
        again = conn.getresponse()
        again.read()
        assert again.status == 200
    finally:
        conn.close()


def test_a_client_that_leaves_mid_body_is_not_a_server_error(
    server: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="poimen_memory.request")
    with socket.create_connection(("127.0.0.1", server), timeout=10) as sock:
        sock.sendall(
            b"POST /memory/nodes HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100000\r\n\r\n[{"level": "L0"'
        )
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    lines: list[dict[str, Any]] = []
    while not lines and time.monotonic() < deadline:
        logged = [r.getMessage() for r in caplog.records if r.name == "poimen_memory.request"]
        lines = [json.loads(m) for m in logged if "/memory/nodes" in m]
        time.sleep(0.05)
    assert lines and lines[0]["status"] == 400, lines


@pytest.mark.parametrize("path", [b"/memory/nodes", b"/mcp"])
def test_a_body_that_trickles_in_is_408_within_its_time(server: int, path: bytes) -> None:
    """A slow body held its connection (and, for a write, an ingest slot) without limit.
    POST /mcp too: the MCP SDK waits for a body as long as it takes, and a few such
    uploads took every work slot, so that every tenant got 503 (a helper's attack)."""
    with socket.create_connection(("127.0.0.1", server), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(
            b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Accept: application/json, text/event-stream\r\nContent-Length: 1000\r\n\r\n["
        )
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
        elapsed = time.monotonic() - started
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(body)["error"] == "request_timeout"
    # It waited its time (a lower bound, which load cannot break); that it did not wait
    # for the body is the 408 itself, which a server without the limit never sends.
    assert elapsed >= 0.9


def test_a_database_error_no_table_names_keeps_the_servers_words_in_the_log(
    fixture_url: str, embedder: LocalEmbedder, caplog: pytest.LogCaptureFixture
) -> None:
    """An unmapped SQLSTATE once went to the client word for word: EFBIG is XX000 'could not
    extend file "base/16384/2619": File too large', raised here as the server raises it."""
    import psycopg

    from service_client import LoopbackClient

    async def read_file(request: Request) -> Any:
        with psycopg.connect(fixture_url) as conn:
            conn.execute(
                'DO $$ BEGIN RAISE EXCEPTION \'could not extend file "base/16384/2619": File '
                "too large' USING ERRCODE = 'XX000'; END $$"
            )

    app = create_app(Settings.from_env({"POIMEN_DATABASE_URL": fixture_url}), embedder=embedder)
    app.router.routes.insert(0, Route("/memory/read-file", read_file))
    with LoopbackClient(app) as client:
        r = client.get("/memory/read-file")
    body = r.json()
    assert r.status_code == 500 and body["error"] == "database_error"
    assert "XX000" in body["detail"] and "16384" not in r.text and "X-Request-ID" in body["hint"]
    assert any("base/16384/2619" in m.getMessage() for m in caplog.records)
