"""API keys over real HTTP: once a key exists every data request needs one; a key sees and
writes only its projects; revocation takes effect; `poimen-memory keys` manages them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from poimen_memory.api.auth import key_hash
from poimen_memory.db.connect import connect
from poimen_memory.db.queries import q
from poimen_memory.embedders.local import LocalEmbedder
from service_client import KONG, make_key, serve

PLANT = {"id": "plant", "level": "L1", "project": "atlas", "text": "Caroline researched kong"}


@pytest.fixture
def client(fixture_url: str, embedder: LocalEmbedder) -> Iterator[TestClient]:
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_AUTH_CACHE_S": "0"}
    with serve(env, embedder) as c:
        yield c


def _as(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _query(client: TestClient, key: str | None, **params: Any) -> Any:
    return client.get("/memory/query", params={"query": KONG, **params}, headers=_as(key))


def test_anonymous_until_the_first_key(client: TestClient, fixture_url: str) -> None:
    assert _query(client, None).status_code == 200
    make_key(fixture_url, ["poimen"])
    r = _query(client, None)
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"
    assert _query(client, "pmk_not-a-key").status_code == 401
    assert client.get("/healthz").status_code == 200  # probes stay open


def test_a_key_reads_only_its_projects(client: TestClient, fixture_url: str) -> None:
    key = make_key(fixture_url, ["poimen"])
    mine = _query(client, key)  # no project named: the key's one project
    assert mine.status_code == 200
    assert {r["project"] for r in mine.json()["results"]} == {"poimen"}
    other = _query(client, key, project="atlas")
    assert other.status_code == 403 and other.json()["error"] == "forbidden"
    several = make_key(fixture_url, ["poimen", "atlas"])
    assert _query(client, several).status_code == 403  # must name one of its projects
    assert _query(client, several, project="atlas").status_code == 200


def test_writes_need_a_write_key_for_every_project(client: TestClient, fixture_url: str) -> None:
    reader = make_key(fixture_url, ["atlas"])
    writer = make_key(fixture_url, ["poimen"], write=True)
    owner = make_key(fixture_url, ["atlas"], write=True)
    for key, status in ((None, 401), (reader, 403), (writer, 403)):
        r = client.post("/memory/nodes", json=[PLANT], headers=_as(key))
        assert r.status_code == status, r.text
    with connect(fixture_url) as conn:
        assert conn.execute(
            "SELECT count(*) FROM memory.nodes WHERE external_id = 'plant'"
        ).fetchone() == (0,)
    assert client.post("/memory/nodes", json=[PLANT], headers=_as(owner)).status_code == 201


def test_a_revoked_key_is_refused(client: TestClient, fixture_url: str) -> None:
    key = make_key(fixture_url, ["poimen"])
    assert _query(client, key).status_code == 200
    with connect(fixture_url, autocommit=True) as conn:
        conn.execute(q("key_revoke"), {"key": key[:12]})
    # Revoking the last key locks the API; it does not reopen it to anonymous callers.
    assert _query(client, key).status_code == 401
    assert _query(client, None).status_code == 401


def test_an_unauthenticated_body_is_refused_before_it_is_read(
    client: TestClient, fixture_url: str
) -> None:
    make_key(fixture_url, ["poimen"], write=True)
    r = client.post("/memory/nodes", content=b"not even json")
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"


def test_keys_are_stored_hashed_and_hidden_from_sql_roles(fixture_url: str) -> None:
    key = make_key(fixture_url, ["poimen"])
    with connect(fixture_url, autocommit=True) as conn:
        stored = conn.execute("SELECT key_hash, prefix FROM memory.api_keys").fetchall()
        assert stored == [(key_hash(key), key[:12])]
        conn.execute("SET ROLE poimen_memory_writer")
        with pytest.raises(Exception, match="permission denied"):
            conn.execute("SELECT * FROM memory.api_keys")
