"""A small piece both middlewares need: the response status, seen as it is sent."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import Message, Send


class StatusRecorder:
    """Wraps ``send``; ``status`` is the response's status once it has started (500 until
    then, which is what an exception before the response becomes). ``on_start`` may edit
    the start message, e.g. to add a header."""

    def __init__(self, send: Send, on_start: Callable[[Message], None] | None = None) -> None:
        self._send, self._on_start = send, on_start
        self.status = 500

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            if self._on_start is not None:
                self._on_start(message)
        await self._send(message)
