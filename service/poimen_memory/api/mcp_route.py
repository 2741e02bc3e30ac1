"""``POST /mcp`` in the service, with the MCP server (api/mcp_server.py) loaded at the first
request rather than at every start.

Importing the MCP SDK and building the server costs about a second of CPU, as much as the
rest of the app's imports together, and a deployment that no agent calls never needs it:
every start paid it (a restart, each worker, each server a test or a benchmark starts).

The SDK's session manager holds a task group for its whole life, and anyio requires a task
group to be entered and left by the same task. So the lifespan (`run`) starts one task that
waits for the first request's signal, loads the server (the import in a thread, so that the
other requests go on meanwhile), enters the manager and stays in it until shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from poimen_memory.errors import Busy, PoimenError
from poimen_memory.settings import Settings

if TYPE_CHECKING:
    from poimen_memory.api.mcp_server import McpEndpoint

log = logging.getLogger(__name__)


def _build(settings: Settings) -> McpEndpoint:
    from poimen_memory.api.mcp_server import McpEndpoint

    return McpEndpoint(settings)


class McpRoute:
    """The ASGI endpoint of ``POST /mcp``; `run` is entered in the app's lifespan."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._endpoint: McpEndpoint | None = None
        self._failed = False
        self._wanted: asyncio.Event | None = None
        self._loaded: asyncio.Event | None = None

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        wanted, loaded, stop = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self._wanted, self._loaded, self._failed = wanted, loaded, False
        keeper = asyncio.create_task(self._keep(wanted, loaded, stop))
        try:
            yield
        finally:
            stop.set()
            wanted.set()  # a keeper still waiting for its first request ends now
            await keeper
            self._endpoint = self._wanted = self._loaded = None

    async def _keep(
        self, wanted: asyncio.Event, loaded: asyncio.Event, stop: asyncio.Event
    ) -> None:
        # `loaded` is set however this ends: a request waiting on it never waits past it.
        try:
            await wanted.wait()
            if stop.is_set():
                return
            endpoint = await asyncio.to_thread(_build, self.settings)
            if stop.is_set():  # the service began to stop during the import
                return
            async with endpoint.run():
                self._endpoint = endpoint
                loaded.set()
                await stop.wait()
        except Exception as exc:
            # Logged once and kept: the requests answer a 500 each (raised here, it would
            # surface only at shutdown).
            log.exception("the MCP server could not start or stopped: %s", exc)
            self._failed = True
        finally:
            self._endpoint = None
            loaded.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._endpoint is None:
            if self._wanted is None or self._loaded is None:
                # Outside the lifespan: the service is stopping (a 503 to retry elsewhere).
                raise Busy("the service is stopping: it no longer answers MCP requests")
            # The key first, as the endpoint checks it: a caller without one gets its 401
            # before it can make the service import anything.
            request = Request(scope)
            await request.app.state.keys.grant(request.headers)
            self._wanted.set()
            await self._loaded.wait()
        endpoint = self._endpoint
        if endpoint is None:
            if self._failed:
                # An install that cannot import its own SDK: a 500, as any fault of ours,
                # its cause (paths of the host, perhaps) in the log only.
                raise PoimenError(
                    "the MCP server could not start",
                    hint="the service's log names the cause, logged at its first request",
                )
            raise Busy("the service is stopping: it no longer answers MCP requests")
        await endpoint(scope, receive, send)
