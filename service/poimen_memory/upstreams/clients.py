"""What the HTTP upstreams (remote embedder, reranker) share: which endpoints a configured
URL means, and httpx clients made on first use and closed only by their maker.

A caller may pass shared clients (the app shares one per process); those stay the caller's
to close.
"""

from __future__ import annotations

import logging
from typing import TypeVar

import httpx

from poimen_core.openai_embed import endpoint_candidates as core_endpoint_candidates
from poimen_core.openai_embed import shown_url
from poimen_memory.errors import ConfigError, UpstreamUnavailable

log = logging.getLogger(__name__)

E = TypeVar("E", bound=UpstreamUnavailable)


def endpoint_candidates(url: str, route: str) -> list[str]:
    """poimen_core's rule (memory.embed follows the same one inside PostgreSQL), with a bad
    URL reported as the setting's ConfigError."""
    try:
        return core_endpoint_candidates(url, route)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def fallback_endpoint(
    candidates: list[str], current: str, response: httpx.Response, what: str
) -> str | None:
    """After a 404 from a guessed path, the next candidate (the caller keeps it for later
    calls); None when the answer was not a 404 or no candidate is left."""
    at = candidates.index(current)
    if response.status_code != 404 or at + 1 >= len(candidates):
        return None
    log.info(
        "%s: %s answered 404, using %s", what, shown_url(current), shown_url(candidates[at + 1])
    )
    return candidates[at + 1]


def raise_for_status(error: type[E], what: str, endpoint: str, response: httpx.Response) -> None:
    """An HTTP error status as the upstream's typed error, naming the URL it came from."""
    if response.status_code >= 400:
        raise error(
            f"{what} {shown_url(endpoint)} answered {response.status_code}: "
            f"{response.text[:200]!r}",
            reason="http_status",
            status=response.status_code,
        )


class UpstreamClients:
    def __init__(
        self, client: httpx.Client | None = None, async_client: httpx.AsyncClient | None = None
    ) -> None:
        self._client = client
        self._owns_client = client is None
        self._async_client = async_client
        self._owns_async_client = async_client is None

    def sync(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client()
        return self._client

    def async_(self) -> httpx.AsyncClient:
        if self._async_client is None:
            self._async_client = httpx.AsyncClient()
        return self._async_client

    def close(self) -> None:
        if self._owns_client and self._client is not None:
            self._client.close()
            self._client = None

    async def aclose(self) -> None:
        self.close()
        if self._owns_async_client and self._async_client is not None:
            await self._async_client.aclose()
            self._async_client = None
