"""`poimen-memory serve` drops connections that never send a request (issue 11: half-open
connections), after POIMEN_HTTP_KEEP_ALIVE_S, and still serves the clients that do."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from conftest import free_port
from poimen_lab.live_server import live_server

SILENT = 20


def _closed_by_server(sock: socket.socket, deadline: float) -> bool:
    """True once the server closes the connection (recv returns b''), before the deadline."""
    sock.settimeout(max(deadline - time.monotonic(), 0.01))
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False


def test_silent_connections_are_closed_and_others_served(fixture_url: str, tmp_path: Path) -> None:
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_HTTP_KEEP_ALIVE_S": "1"}
    with live_server(env, tmp_path / "server.log") as url:
        port = int(url.rsplit(":", 1)[1])
        # Each connection's 1 s timer starts when it is accepted: start the clock before.
        started = time.monotonic()
        silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(SILENT)]
        try:
            # One generous bound for all of them (the deadline is 1 s): the point is that they
            # close at all.
            closed = [_closed_by_server(s, deadline=started + 20) for s in silent]
            assert all(closed), f"{closed.count(False)} of {SILENT} silent connections stayed open"
            assert time.monotonic() - started >= 0.9  # not refused outright: timed out
        finally:
            for s in silent:
                s.close()
        r = httpx.get(f"{url}/memory/query", params={"query": "kong body buffer"}, timeout=30)
        assert r.status_code == 200 and r.json()["results"]


def test_a_request_head_over_the_limit_is_431_and_a_header_twice_400(
    fixture_url: str, tmp_path: Path
) -> None:
    """POIMEN_HTTP_MAX_HEADER_BYTES bounds a request's head: h11 applied it only to a head
    still arriving, so one sent in a single write passed whole (60 kB answered 200). Over
    the limit it is 431 with a JSON body, under it the route answers."""
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_HTTP_MAX_HEADER_BYTES": "16384"}
    with live_server(env, tmp_path / "server.log") as url, httpx.Client(timeout=30) as client:
        r = client.get(f"{url}/healthz", headers={"X-Big": "a" * 60_000})
        assert r.status_code == 431, r.text
        body = r.json()
        assert body["error"] == "request_header_fields_too_large"
        assert "POIMEN_HTTP_MAX_HEADER_BYTES" in body["hint"]
        assert r.headers["x-content-type-options"] == "nosniff"
        r = client.get(f"{url}/memory/query", params={"query": "kong " + "x" * 20_000})
        assert r.status_code == 431, r.text
        r = client.get(f"{url}/healthz", headers={"X-Big": "a" * 8_000})
        assert r.status_code == 200, r.text
        _a_header_twice_is_400(client, url, fixture_url)
        _a_request_h11_cannot_parse_is_400_in_json(url, tmp_path / "server.log")


def _a_header_twice_is_400(client: httpx.Client, url: str, database_url: str) -> None:
    """On the same server: a head that gives Authorization, Origin or Content-Type twice is
    400 before any route runs (which one would count depends on who reads the head: a proxy
    in front and the service could disagree on whose key a request carries). A write so
    refused writes nothing; each header once is served."""
    query = f"{url}/memory/query?query=kong"
    for name, values in (
        ("Authorization", ("Bearer pmk_first", "Bearer pmk_second")),
        ("Origin", ("http://127.0.0.1", "http://127.0.0.1")),
    ):
        r = client.get(query, headers=[(name, v) for v in values])
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["error"] == "duplicate_header"
        assert body["detail"] == f"the request has 2 {name} headers"
        assert r.headers["x-content-type-options"] == "nosniff"
    node = {"id": "twice:1", "level": "L0", "project": "poimen", "text": "sent with two types"}
    r = client.post(
        f"{url}/memory/nodes",
        content=json.dumps([node]),
        headers=[("Content-Type", "application/json"), ("Content-Type", "text/plain")],
    )
    assert r.status_code == 400 and r.json()["error"] == "duplicate_header", r.text
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM memory.nodes WHERE external_id = 'twice:1'"
        ).fetchone()
        assert row == (0,)
    r = client.get(query, headers={"Authorization": "Bearer x", "Origin": "http://127.0.0.1"})
    assert r.status_code == 200, r.text


def _until_closed(sock: socket.socket) -> bytes:
    answer = b""
    while chunk := sock.recv(65536):  # until the server closes
        answer += chunk
    return answer


def _a_request_h11_cannot_parse_is_400_in_json(url: str, log: Path) -> None:
    """On the same server: a request h11 cannot parse (a header line without a colon, a
    request line of no HTTP) never reaches the app; its 400 is the JSON error body with the
    headers every answer carries (uvicorn's was bare text without them), and the server
    closes that connection and serves the next. A body whose framing breaks after a route
    refused the request unread (415) only closes the connection: uvicorn's answer raised
    there, and asyncio logged a fatal error with a traceback."""
    port = int(url.rsplit(":", 1)[1])
    for raw in (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n",
                b"\x16\x03\x01 not http at all\r\n\r\n"):  # fmt: skip
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(raw)
            answer = _until_closed(sock)
        head, _, body = answer.partition(b"\r\n\r\n")
        status, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
        assert status == "HTTP/1.1 400 Bad Request", answer
        assert headers["content-type"] == "application/json"
        assert headers["connection"] == "close"
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["content-security-policy"] == "default-src 'none'; frame-ancestors 'none'"
        assert int(headers["content-length"]) == len(body)
        assert json.loads(body) == {
            "error": "malformed_request",
            "detail": "Invalid HTTP request received.",
            "hint": "send a well-formed HTTP/1.1 request: its request line, headers or body "
            "framing are not",
        }
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /memory/nodes HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n")  # fmt: skip
        answer = b""
        while b'"unsupported_media_type"' not in answer:
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 415 "), answer
        sock.sendall(b"not a chunk size\r\n\r\n")
        assert _until_closed(sock) == b""  # closed, with no second answer
    assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200
    text = log.read_text()
    assert "Traceback" not in text and "Fatal error" not in text, text[-3000:]


def test_sigterm_stops_the_server_gracefully_with_status_0(
    fixture_url: str, tmp_path: Path
) -> None:
    """uvicorn raised SIGTERM again after its graceful shutdown, so `serve` died of it
    (status -15), which a service manager reads as a crash."""
    port = free_port()
    cmd = [sys.executable, "-m", "poimen_memory.cli.main", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning"]  # fmt: skip
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env={**os.environ, "POIMEN_DATABASE_URL": fixture_url}, stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            with httpx.Client(timeout=2) as client:  # one client: each httpx.get makes one
                while True:
                    assert proc.poll() is None, log.read_text()
                    try:
                        if client.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    assert time.monotonic() < deadline, log.read_text()
                    time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=15)


def test_forwarded_addresses_are_believed_only_from_the_proxies_named() -> None:
    """uvicorn believed X-Forwarded-For from 127.0.0.1 by default, and every client of a
    loopback server is 127.0.0.1: each request could name a new address, a new client of
    the fair share in anonymous mode (a helper's attack). `serve`'s own config, run."""
    import asyncio
    from typing import Any

    from poimen_memory.cli.serve import uvicorn_config
    from poimen_memory.settings import Settings

    def client_seen(env: dict[str, str]) -> Any:
        seen: list[Any] = []

        async def app(scope: Any, receive: Any, send: Any) -> None:
            seen.append(scope["client"])

        config = uvicorn_config(app, Settings.from_env(env), "127.0.0.1", 0, "warning")
        config.load()
        scope = {"type": "http", "client": ("127.0.0.1", 40000), "scheme": "http",
                 "headers": [(b"x-forwarded-for", b"203.0.113.9")]}  # fmt: skip
        asyncio.run(config.loaded_app(scope, None, None))
        return seen[0]

    assert tuple(client_seen({})) == ("127.0.0.1", 40000)
    named = {"POIMEN_HTTP_FORWARDED_ALLOW_IPS": "127.0.0.1"}
    assert client_seen(named)[0] == "203.0.113.9"  # behind the proxy named, its client
    # a typo is refused: uvicorn would take it as a name no client matches
    from poimen_memory.errors import ConfigError

    for typo in ("not-an-ip", "10.0.0.1/33", "*,127.0.0.1"):
        with pytest.raises(ConfigError, match="POIMEN_HTTP_FORWARDED_ALLOW_IPS"):
            Settings.from_env({"POIMEN_HTTP_FORWARDED_ALLOW_IPS": typo})
