"""`poimen-memory serve`: the HTTP service under uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from poimen_memory.cli.common import load_settings, service_settings, started_url
from poimen_memory.db.connect import connect
from poimen_memory.settings import LOOPBACK_HOSTS, Settings


def cmd_serve(args: argparse.Namespace) -> int:
    from poimen_memory.api.app import create_app

    s = load_settings()
    # Start the embedded cluster (when no URL is configured) before serving.
    url = started_url(s)
    if not _loopback(args.host) and not args.allow_anonymous and not _has_keys(url):
        print(
            f"error: refusing to serve on {args.host} without authentication",
            file=sys.stderr,
        )
        print(
            "hint: create API keys (poimen-memory keys create), bind 127.0.0.1 (the "
            "default), or pass --allow-anonymous if a proxy in front authenticates clients",
            file=sys.stderr,
        )
        return 2
    if not _loopback(args.host) and s.http_allowed_hosts == LOOPBACK_HOSTS:
        # Not an error: a proxy on this machine may forward with Host 127.0.0.1.
        print(
            f"warning: serving on {args.host}, but POIMEN_HTTP_ALLOWED_HOSTS names loopback "
            "hosts only: a request for any other Host gets 421 misdirected_request",
            file=sys.stderr,
        )
        print(
            "hint: set POIMEN_HTTP_ALLOWED_HOSTS to the names clients reach the service by",
            file=sys.stderr,
        )
    # The superuser only migrates; the service runs as its own role, under row-level security.
    app = create_app(service_settings(s))
    config = uvicorn_config(app, s, args.host, args.port, args.log_level)
    _graceful_server(config).run()
    return 0


def uvicorn_config(app: Any, s: Settings, host: str, port: int, log_level: str) -> Any:
    """uvicorn's Config for ``app`` as `serve` runs it."""
    import uvicorn

    from poimen_memory.api.http_protocol import FirstRequestDeadline

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        # The JSON request log replaces the access log, which would print query text.
        access_log=False,
        # Also the time a new connection has to send its first request (http_protocol.py).
        http=FirstRequestDeadline,
        timeout_keep_alive=s.http_keep_alive_s,
        limit_concurrency=s.http_max_concurrency,
        h11_max_incomplete_event_size=s.http_max_header_bytes,
        # A client's address is the connection's unless a proxy it names forwards it.
        proxy_headers=bool(s.http_forwarded_allow_ips),
        forwarded_allow_ips=list(s.http_forwarded_allow_ips) or None,
    )


def _graceful_server(config: Any) -> Any:
    """uvicorn.Server, except that a stop by SIGTERM or SIGINT, once the server has shut
    down gracefully, exits 0 (as PostgreSQL's does): uvicorn raises the signal again, and
    the process then died of it (status -15, 143 in a shell), which a service manager reads
    as a crash. (uvicorn is imported only by `serve`: the other commands start faster.)"""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                self._captured_signals.clear()  # handled: nothing to raise again

    return Server(config)


def _has_keys(url: str) -> bool:
    from poimen_memory.db.queries import q

    with connect(url) as conn:
        return any(r[6] is None for r in conn.execute(q("keys_list")).fetchall())


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    sv = sub.add_parser("serve", help="run the HTTP service (uvicorn)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--log-level", default="info")
    sv.add_argument(
        "--allow-anonymous",
        action="store_true",
        help="serve on a non-loopback address without authentication",
    )
    sv.set_defaults(func=cmd_serve)
