"""The service as a non-superuser role under row-level security, over real HTTP: it serves
every project in anonymous mode, and with an API key Postgres itself confines it to the
key's projects, even where the Python checks are switched off."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.requests import Request
from starlette.testclient import TestClient

from poimen_memory.api.auth import KeyRing
from poimen_memory.db.connect import connect, ensure_service_login, open_pool
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.services import warn_if_rls_bypassed
from service_client import make_key, serve
from test_api_keys import PLANT, _as

ROLE = "poimen_service"  # the embedded cluster's default; the test cluster maps it too
ALL_LEVELS = "L0,L1,L2"


@pytest.fixture
def service_url(fixture_url: str) -> str:
    with connect(fixture_url, autocommit=True) as conn:
        ensure_service_login(conn, ROLE)
    return fixture_url.replace("postgresql://postgres@", f"postgresql://{ROLE}@")


@pytest.fixture
def client(service_url: str, embedder: LocalEmbedder) -> Iterator[TestClient]:
    with serve({"POIMEN_DATABASE_URL": service_url, "POIMEN_AUTH_CACHE_S": "0"}, embedder) as c:
        yield c


def _projects(r: Any) -> set[str]:
    assert r.status_code == 200, r.text
    return {row["project"] for row in r.json()["results"]}


def _q(client: TestClient, key: str | None, **params: Any) -> Any:
    params = {"query": "kong gateway uploads", "level": ALL_LEVELS, "limit": 50, **params}
    return client.get("/memory/query", params=params, headers=_as(key))


def _count(url: str, external_id: str) -> int:
    with connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM memory.nodes WHERE external_id = %s", (external_id,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_the_service_role_is_no_superuser_and_sees_nothing_by_itself(service_url: str) -> None:
    with connect(service_url) as conn:
        row = conn.execute(
            "SELECT rolsuper, rolbypassrls FROM pg_roles WHERE rolname = current_user"
        ).fetchone()
        assert row == (False, False)
        assert conn.execute("SELECT count(*) FROM memory.nodes").fetchone() == (0,)
        conn.execute("SELECT set_config('poimen.read_projects', '*', false)")
        assert conn.execute("SELECT count(*) FROM memory.nodes").fetchone() != (0,)


def test_anonymous_mode_serves_every_project(
    client: TestClient, fixture_url: str, service_url: str
) -> None:
    assert _projects(_q(client, None)) == {"poimen", "atlas"}
    assert _projects(_q(client, None, project="atlas")) == {"atlas"}
    r = client.post("/memory/nodes", json=[PLANT])
    assert r.status_code == 201, r.text
    assert _count(fixture_url, "plant") == 1
    health = client.get("/healthz").json()
    with connect(fixture_url) as conn:
        total = conn.execute("SELECT count(*) FROM memory.nodes").fetchone()
    assert total is not None and health["checks"]["database"]["nodes"] == total[0]


def test_postgres_confines_a_key_even_without_the_python_checks(
    client: TestClient, fixture_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defence in depth: with KeyRing's project checks replaced by bare authentication, a
    poimen key still reads and writes nothing of atlas, because the service's transactions
    assert the key's projects and RLS applies them."""

    async def any_project(self: KeyRing, request: Request, project: str | None) -> str | None:
        await self.grant(request)
        return project

    async def any_write(self: KeyRing, request: Request, projects: Any) -> None:
        await self.grant(request)

    monkeypatch.setattr(KeyRing, "read_project", any_project)
    monkeypatch.setattr(KeyRing, "write_projects", any_write)
    reader = make_key(fixture_url, ["poimen"])
    writer = make_key(fixture_url, ["poimen"], write=True)
    assert _projects(_q(client, reader)) == {"poimen"}  # no project named: only the key's
    hidden = _q(client, reader, project="atlas")
    assert hidden.status_code == 404 and hidden.json()["error"] == "unknown_project"
    # A planted node in another project cannot be written...
    r = client.post("/memory/nodes", json=[PLANT], headers=_as(writer))
    assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
    assert _count(fixture_url, "plant") == 0
    # ...nor, by a read-only key, in its own project.
    mine = {**PLANT, "id": "mine", "project": "poimen"}
    r = client.post("/memory/nodes", json=[mine], headers=_as(reader))
    assert r.status_code == 403, r.text
    assert client.post("/memory/nodes", json=[mine], headers=_as(writer)).status_code == 201
    assert _count(fixture_url, "mine") == 1
    # Planted by the owner, it is still not read through the poimen key.
    with connect(fixture_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO memory.nodes (sha256, project_id, level, text)"
            " SELECT sha256('planted'::bytea), id, 'L1', 'kong gateway uploads kong gateway'"
            " FROM memory.projects WHERE name = 'atlas'"
        )
    assert _projects(_q(client, reader)) == {"poimen"}


@pytest.mark.parametrize("stored", [["*"], ["poimen,atlas"], ["atlas", "*"]])
def test_a_stored_key_with_an_invalid_project_name_is_refused(
    client: TestClient, fixture_url: str, stored: list[str]
) -> None:
    """A key written before the CLI checked names: refused, never widened to '*' or two
    projects by the ',' join of the per-transaction setting."""
    key = make_key(fixture_url, stored)
    r = _q(client, key, project="atlas")
    assert r.status_code == 403, r.text
    body = r.json()
    assert body["error"] == "forbidden" and "invalid project" in body["detail"]
    assert "keys revoke" in body["hint"]


def _rls_warnings(url: str) -> list[str]:
    """What the start-up check finds for one real pool connected to ``url``."""

    async def check() -> list[str]:
        found: list[str] = []
        pool = open_pool(url, min_size=1, max_size=1)
        await pool.open(wait=True)
        try:
            await warn_if_rls_bypassed(pool, "the primary pool", found)
        finally:
            await pool.close()
        return found

    return asyncio.run(check())


def test_a_pool_that_skips_row_level_security_is_named(fixture_url: str, service_url: str) -> None:
    assert _rls_warnings(service_url) == []
    (warning,) = _rls_warnings(fixture_url)  # the tests' owner: a superuser
    assert "'postgres' (superuser)" in warning and "not enforced by Postgres" in warning


def test_healthz_lists_the_warning(fixture_url: str, embedder: LocalEmbedder) -> None:
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_HEALTH_CACHE_S": "0"}
    with serve(env, embedder) as c:
        # The check runs in the background after start-up: poll (bounded).
        deadline = time.monotonic() + 30
        while not (warnings := c.get("/healthz").json()["warnings"]):
            assert time.monotonic() < deadline, "no warning for a superuser pool"
            time.sleep(0.05)
    assert len(warnings) == 1 and "the primary pool connects as role 'postgres'" in warnings[0]


def test_healthz_counts_the_scale_warnings(
    fixture_url: str, service_url: str, embedder: LocalEmbedder
) -> None:
    """A project past exact_scan_max_nodes holding under half of the store is a scale
    warning (memory.scale_warnings(), issue 28): /healthz, as the service's role under
    row-level security, counts it (migrate --check names it)."""
    env = {"POIMEN_DATABASE_URL": service_url, "POIMEN_HEALTH_CACHE_S": "0"}
    with connect(fixture_url, autocommit=True) as conn:
        sizes = dict(
            conn.execute(
                "SELECT p.name, c.n_docs FROM memory.corpus_stats c"
                " JOIN memory.projects p ON p.id = c.project_id"
            ).fetchall()
        )
        with serve(env, embedder) as c:
            assert c.get("/healthz").json()["checks"]["database"]["scale_warnings"] == 0
            conn.execute("SELECT memory.set_policy('exact_scan_max_nodes', '1')")
            database = c.get("/healthz").json()["checks"]["database"]
        flagged = conn.execute("SELECT project, what FROM memory.scale_warnings()").fetchall()
    total = sum(sizes.values())
    expected = {(name, "filtered_hnsw") for name, n in sizes.items() if n > 1 and 2 * n < total}
    assert expected and set(flagged) == expected
    assert database["scale_warnings"] == len(expected)
