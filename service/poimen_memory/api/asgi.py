"""Small ASGI pieces the middlewares share: the base of an HTTP-only middleware, the
response status seen as it is sent, the last-resort handler of what no route caught, the
check of the Host a request names and the bound on a request's head."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("poimen_memory")


class HttpMiddleware:
    """A pure ASGI middleware of HTTP requests: anything else (lifespan, websockets) goes
    straight through to the app; a subclass handles each request in ``http``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class StatusRecorder:
    """Wraps ``send``; ``status`` is the response's status once it has started (500 until
    then, which is what an exception before the response becomes). ``on_start`` may edit
    the start message, e.g. to add a header."""

    def __init__(self, send: Send, on_start: Callable[[Message], None] | None = None) -> None:
        self._send, self._on_start = send, on_start
        self.status = 500
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            self.started = True
            if self._on_start is not None:
                self._on_start(message)
        await self._send(message)


class LastResort(HttpMiddleware):
    """Answers what nothing else caught, and keeps the connection usable.

    Starlette's own last handler re-raises after its 500, and uvicorn then closes a
    keep-alive connection without saying so: the client's next request on it failed with
    ECONNRESET. Here the exception ends with the response: a JSON 500 (the route's
    traceback goes to the log), or, for a client that went away mid-body, a 400 nobody
    reads but the request log and the metrics count as the client's doing, not a 500.
    """

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        recorder = StatusRecorder(send)
        try:
            await self.app(scope, receive, recorder)
        except ClientDisconnect:
            if not recorder.started:
                gone = "the client closed the connection before its request body ended"
                await _json(send, 400, {"error": "client_disconnected", "detail": gone})
        except Exception as exc:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if recorder.started:
                raise  # half a response: only closing the connection ends it
            await _json(send, 500, {"error": "internal_error", "detail": type(exc).__name__})


# Every response: a browser must not guess another type than the one declared (a JSON
# answer echoing stored text read as HTML), nor frame or run anything in what is not a
# page. The explorer's page and files set their own, narrower policy (api/ui.py).
SECURITY_HEADERS = (
    (b"x-content-type-options", b"nosniff"),
    (b"content-security-policy", b"default-src 'none'; frame-ancestors 'none'"),
)


class SecurityHeaders(HttpMiddleware):
    """Adds ``SECURITY_HEADERS`` to every response that does not set them itself, errors
    from the middlewares inside it included."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        def add(message: Message) -> None:
            headers = list(message.get("headers", []))
            present = {bytes(name).lower() for name, _ in headers}
            headers += [(name, value) for name, value in SECURITY_HEADERS if name not in present]
            message["headers"] = headers

        await self.app(scope, receive, StatusRecorder(send, add))


def host_allowed(host: str, allowed: Sequence[str]) -> bool:
    """Whether a request's Host is one of ``allowed`` (POIMEN_HTTP_ALLOWED_HOSTS): a name
    as given, ``name:*`` that name on any port (or none), ``*`` alone any Host at all."""
    if tuple(allowed) == ("*",):
        return True
    host = host.lower()
    for name in allowed:
        name = name.lower()
        if host == name:
            return True
        port = host[len(name) - 1 :]
        # a port of ASCII digits: isdigit() alone takes "²" and other scripts' digits
        if name.endswith(":*") and (
            host == name[:-2] or (host.startswith(name[:-1]) and port.isascii() and port.isdigit())
        ):
            return True
    return False


def origin_allowed(origin: str, host: str, allowed: Sequence[str]) -> bool:
    """Whether a browser's Origin may use this service: the page's own (served under the
    Host it asks for, e.g. /ui), or one of ``allowed`` (POIMEN_HTTP_ALLOWED_ORIGINS,
    POIMEN_HTTP_CORS_ORIGINS; ``scheme://name:*`` any port), compared whole, never by
    prefix (``http://127.0.0.1:8765@evil.example`` is not a loopback origin)."""
    scheme, sep, authority = origin.lower().partition("://")
    if sep and scheme in ("http", "https") and authority == host.lower():
        return True
    return origin != "*" and host_allowed(origin, [a for a in allowed if a != "*"])


# Host and Origin lists by path: /mcp has lists of its own (POIMEN_MCP_ALLOWED_HOSTS and
# _ORIGINS), every other route POIMEN_HTTP_ALLOWED_HOSTS and _ORIGINS.
Lists = tuple[Sequence[str], Sequence[str]]


class HostCheck(HttpMiddleware):
    """Answers only requests whose Host is allowed, and whose Origin, when a browser sends
    one, is the page's own or allowed. A web page that reaches a loopback server through DNS
    rebinding sends its own name as Host, and is refused 421; a page of another site that
    posts to it (a form, or a fetch with a text/plain body, which a browser sends without a
    CORS preflight) sends its Origin, and is refused 403 before any route reads the body.
    Both are compared whole, on every route, /mcp included (the MCP SDK's own check
    matches by prefix)."""

    def __init__(self, app: ASGIApp, lists: Lists, by_path: Mapping[str, Lists]) -> None:
        super().__init__(app)
        self.lists, self.by_path = lists, dict(by_path)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        hosts, origins = self.by_path.get(scope.get("path", ""), self.lists)
        # (A head with two Origins never gets here: HeadLimit, before this, refuses it.)
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        origin = headers.get(b"origin")
        if not host_allowed(host, hosts):
            await _json(send, 421, {
                "error": "misdirected_request",
                "detail": f"this service does not answer to Host {host[:200]!r}",
                "hint": "POIMEN_HTTP_ALLOWED_HOSTS (POIMEN_MCP_ALLOWED_HOSTS for /mcp) lists "
                        "the names clients reach it by (behind a proxy or on a public "
                        "address, list those)",
            })  # fmt: skip
            return
        if origin is not None and not origin_allowed(origin.decode("latin-1"), host, origins):
            await _json(send, 403, {
                "error": "cross_origin_refused",
                "detail": f"requests from pages of {origin.decode('latin-1')[:200]!r} are "
                          "not served",
                "hint": "POIMEN_HTTP_ALLOWED_ORIGINS (POIMEN_MCP_ALLOWED_ORIGINS for /mcp) "
                        "lists the web origins that may call this service",
            })  # fmt: skip
            return
        await self.app(scope, receive, send)


# Headers a request gives one value by. With two, which one counts depends on who reads
# the head (Starlette's Headers.get takes the first, a dict of the head the last, a proxy
# in front either), so a proxy and this service could disagree on whose key a request
# carries or which page sent it. h11 already refuses two Host headers, and two
# Content-Length headers that differ.
SINGLE_HEADERS = (b"authorization", b"origin", b"content-type")


def single_header_names(conjunction: str) -> str:
    """SINGLE_HEADERS as a sentence names them: "Authorization, Origin and Content-Type"."""
    names = [name.decode().title() for name in SINGLE_HEADERS]
    return f"{', '.join(names[:-1])} {conjunction} {names[-1]}"


class HeadLimit(HttpMiddleware):
    """Refuses a request whose head (its target and headers) is over ``max_bytes``
    (POIMEN_HTTP_MAX_HEADER_BYTES), 431 before any route runs. uvicorn's h11 applies the
    setting only to a head still arriving: one that came in a single read passed whole
    (a 60 kB header was answered 200). Refuses too, 400, a head that gives one of
    ``SINGLE_HEADERS`` twice."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The request line and each "name: value\r\n", as they came on the wire.
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 16
        size += sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if size > self.max_bytes:
            await _json(send, 431, {
                "error": "request_header_fields_too_large",
                "detail": f"the request's head is about {size} bytes, over the "
                          f"{self.max_bytes}-byte limit",
                "hint": "POIMEN_HTTP_MAX_HEADER_BYTES sets the limit",
            })  # fmt: skip
            return
        # (ASGI servers give header names in lower case.)
        seen = [name for name, _ in scope["headers"] if name in SINGLE_HEADERS]
        twice = next((name for name in SINGLE_HEADERS if seen.count(name) > 1), None)
        if twice is not None:
            named = twice.decode().title()
            await _json(send, 400, {
                "error": "duplicate_header",
                "detail": f"the request has {seen.count(twice)} {named} headers",
                "hint": f"send each of {single_header_names('and')} at most once",
            })  # fmt: skip
            return
        await self.app(scope, receive, send)


async def _json(send: Send, status: int, body: dict[str, str]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": data})
