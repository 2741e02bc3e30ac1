"""Shared helpers for the service tests: the real app behind Starlette's TestClient."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from starlette.testclient import TestClient

from poimen_memory.api.app import create_app
from poimen_memory.api.auth import key_hash, new_key
from poimen_memory.db.connect import connect
from poimen_memory.db.queries import q
from poimen_memory.embedders.base import Embedder
from poimen_memory.settings import Settings

KONG = "how do I fix uploads over 10KB failing through the kong gateway"  # routes Hybrid


class LoopbackClient(TestClient):
    """Starlette's TestClient as a local client: its requests name a loopback Host, one the
    service answers by default (POIMEN_HTTP_ALLOWED_HOSTS), not ``testserver``."""

    def __init__(self, app: Any, base_url: str = "http://127.0.0.1", **kw: Any) -> None:
        super().__init__(app, base_url=base_url, **kw)


@contextmanager
def serve(env: Mapping[str, str], embedder: Embedder | None = None) -> Iterator[TestClient]:
    app = create_app(Settings.from_env(env), embedder=embedder)
    with LoopbackClient(app) as client:
        yield client


def query(client: TestClient, **params: Any) -> dict[str, Any]:
    """GET /memory/query, asserting 200, and return the body."""
    response = client.get("/memory/query", params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def make_key(url: str, projects: list[str], write: bool = False) -> str:
    """A new API key for these projects (read-only unless ``write``), stored as the service
    stores one: what a test needs to call the service as a tenant."""
    key = new_key()
    with connect(url, autocommit=True) as conn:
        conn.execute(
            q("key_insert"),
            {"key_hash": key_hash(key), "prefix": key[:12], "projects": projects,
             "can_write": write, "note": "test"},
        )  # fmt: skip
    return key
