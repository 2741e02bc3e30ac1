"""One JSON line per HTTP request, on the ``poimen_memory.request`` logger.

The request id is the client's ``X-Request-ID`` when it sends a sane one (1-128 characters
of ``A-Za-z0-9._:/+=@-``), else a new random one; either way it is returned in the
response's ``X-Request-ID`` header and written in the line. Routes add fields to the
line with ``annotate`` (the query route adds strategy, stage timings and degraded stages,
see metrics.observe_query). The line carries the path, never the query string, so query
text is logged only when ``POIMEN_LOG_QUERY_TEXT`` is on.

Example (one line; wrapped here)::

    {"ts": "2026-11-30T18:02:11.514Z", "level": "info", "logger": "poimen_memory.request",
     "request_id": "3f6c...", "method": "GET", "path": "/memory/query", "status": 200,
     "duration_ms": 24.3, "project": "poimen", "strategy": "Hybrid", ...,
     "timings_ms": {"embed": 7.9, "lexical": 5.2, ...}, "degraded": ["rerank:not_configured"]}

When nothing in the process has configured logging (no handler on the root logger, as
under ``poimen-memory serve``), the lines go to stderr; an application that configures
logging itself receives them through its own handlers instead.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import uuid
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs

from starlette.datastructures import MutableHeaders
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from poimen_memory.api.asgi import HttpMiddleware, StatusRecorder

__all__ = ["HEADER", "LOGGER", "RequestLogMiddleware", "annotate", "request_id"]

LOGGER = "poimen_memory.request"
HEADER = "X-Request-ID"
_VALID_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
_FIELDS = "poimen_log_fields"
_ID = "poimen_request_id"

log = logging.getLogger(LOGGER)


def annotate(conn: HTTPConnection, **fields: Any) -> None:
    """Add fields to this request's log line (no-op outside the middleware)."""
    state = conn.scope.get("state")
    if isinstance(state, dict) and isinstance(state.get(_FIELDS), dict):
        state[_FIELDS].update(fields)


def request_id(conn: HTTPConnection) -> str | None:
    """This request's id, as logged and returned in the X-Request-ID header."""
    state = conn.scope.get("state")
    return state.get(_ID) if isinstance(state, dict) else None


def _incoming_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            candidate = value.decode("latin-1").strip()
            return candidate if _VALID_ID.fullmatch(candidate) else None
    return None


def _ensure_output() -> None:
    """INFO lines must go somewhere: when nothing configured logging, to stderr."""
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)


class RequestLogMiddleware(HttpMiddleware):
    def __init__(self, app: ASGIApp, *, log_query_text: bool = False) -> None:
        super().__init__(app)
        self.log_query_text = log_query_text
        _ensure_output()

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        rid = _incoming_id(scope) or uuid.uuid4().hex
        # scope["state"] is per request (uvicorn and TestClient copy the lifespan state), and
        # Request.state reads and writes this same dict.
        state = scope.setdefault("state", {})
        fields: dict[str, Any] = {}
        state[_FIELDS], state[_ID] = fields, rid
        started = time.perf_counter()

        def add_id(message: Message) -> None:
            message.setdefault("headers", [])
            MutableHeaders(scope=message)[HEADER] = rid

        recorder = StatusRecorder(send, add_id)
        try:
            await self.app(scope, receive, recorder)
        finally:
            status = recorder.status
            line: dict[str, Any] = {
                "ts": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                "level": "error" if status >= 500 else "info",
                "logger": LOGGER,
                "request_id": rid,
                "method": scope["method"],
                "path": scope["path"],
                "status": status,
                "duration_ms": round((time.perf_counter() - started) * 1000, 3),
            }
            if self.log_query_text:
                query = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("query")
                if query:
                    line["query"] = query[0]
            line.update(fields)
            level = logging.ERROR if status >= 500 else logging.INFO
            # ASCII: a path's U+2028 or U+0085, written raw, is a line break to readers
            # that split on Unicode's (str.splitlines, JavaScript), and broke the record
            log.log(level, json.dumps(line, default=str))
