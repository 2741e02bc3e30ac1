"""Two product databases in one cluster stay apart (issue 26): each has its own roles, and
PUBLIC may not connect to either, so a grant, an API key or the service role of one reads
nothing of the other. Roles are the cluster's, which is why this needs saying."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conftest import FIXTURE, db_roles, make_role
from poimen_core.vocabulary import check_role_prefix
from poimen_memory.db.cluster import Cluster
from poimen_memory.db.connect import connect, ensure_service_login
from poimen_memory.db.migrate import check, migrate
from poimen_memory.db.migrate import roles as migrate_roles
from poimen_memory.db.roles import LEGACY, Roles, prefix_for
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.errors import MigrationError
from poimen_memory.ingest.nodes import parse_lines
from poimen_memory.ingest.writer import ingest
from service_client import make_key, serve

Conn = psycopg.Connection[Any]
SERVICE_LOGIN = "poimen_service"  # the one login the test cluster maps besides postgres


def _one(conn: Conn, query: str, params: Any = None) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


@pytest.fixture
def two_databases(
    cluster: Cluster, admin: Conn, plpython_root: Path, embedder: LocalEmbedder
) -> Iterator[tuple[str, str]]:
    """Two databases migrated from scratch (not copies of one template: a copy shares its
    template's roles), each holding the fixture's nodes."""
    names = [f"t_roles_{uuid.uuid4().hex[:8]}" for _ in range(2)]
    records, errors = parse_lines(FIXTURE.read_text().splitlines())
    assert not errors
    try:
        for name in names:
            admin.execute(f"CREATE DATABASE {name}")
            with connect(cluster.url(name), autocommit=True) as conn:
                migrate(conn, plpython_root)
                ingest(conn, records, embedder, progress=False)
        yield cluster.url(names[0]), cluster.url(names[1])
    finally:
        for name in names:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _dbname(url: str) -> str:
    return url.split("?")[0].rsplit("/", 1)[-1]


def test_each_database_has_its_own_roles_and_public_may_not_connect(
    two_databases: tuple[str, str], admin: Conn
) -> None:
    a_url, b_url = two_databases
    with connect(a_url, autocommit=True) as a, connect(b_url, autocommit=True) as b:
        ra, rb = db_roles(a), db_roles(b)
        assert ra == Roles(_dbname(a_url)) and rb == Roles(_dbname(b_url))
        assert not set(ra.all) & set(rb.all)
        for conn, roles in ((a, ra), (b, rb)):
            assert not _one(
                conn, "SELECT has_database_privilege('public', current_database(), 'CONNECT')"
            )
            assert _one(
                conn,
                "SELECT has_database_privilege(%s, current_database(), 'CONNECT')",
                (roles.reader,),
            )
            drift = check(conn)
            assert drift.clean and drift.warnings == [], drift
    # The other database's roles may not connect here.
    assert not _one(
        admin, "SELECT has_database_privilege(%s, %s, 'CONNECT')", (ra.reader, _dbname(b_url))
    )


def test_a_grant_in_one_database_reads_nothing_of_the_other(two_databases: tuple[str, str]) -> None:
    a_url, b_url = two_databases
    with connect(a_url, autocommit=True) as a:
        make_role(a, "roles_every_project", "reader")
        a.execute("SELECT memory.grant_project('roles_every_project', '*')")
        a.execute("SET ROLE roles_every_project")
        assert _one(a, "SELECT count(*) FROM memory.nodes") > 0
    with connect(b_url, autocommit=True) as b:
        assert not _one(
            b, "SELECT has_database_privilege('roles_every_project', current_database(), 'CONNECT')"
        )
        # Even switched to by the superuser (past CONNECT), it has nothing here.
        b.execute("SET ROLE roles_every_project")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            b.execute("SELECT count(*) FROM memory.nodes")


def test_the_service_role_of_one_database_reads_nothing_of_the_other(
    cluster: Cluster, two_databases: tuple[str, str]
) -> None:
    a_url, b_url = two_databases
    with connect(a_url, autocommit=True) as a:
        ensure_service_login(a, SERVICE_LOGIN)
    claim = "SELECT set_config('poimen.read_projects', '*', false)"
    with connect(a_url.replace("postgres@", f"{SERVICE_LOGIN}@"), autocommit=True) as svc:
        svc.execute(claim)
        assert _one(svc, "SELECT count(*) FROM memory.nodes") > 0
    with pytest.raises(psycopg.OperationalError, match="permission denied for database"):
        connect(b_url.replace("postgres@", f"{SERVICE_LOGIN}@"), autocommit=True)
    with connect(b_url, autocommit=True) as b:
        b.execute(f"SET ROLE {SERVICE_LOGIN}")
        b.execute(claim)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            b.execute("SELECT count(*) FROM memory.nodes")


def test_an_api_key_of_one_database_is_unknown_to_the_other(
    two_databases: tuple[str, str], embedder: LocalEmbedder
) -> None:
    a_url, b_url = two_databases
    a_key, b_key = make_key(a_url, ["poimen"]), make_key(b_url, ["poimen"])
    with serve({"POIMEN_DATABASE_URL": b_url, "POIMEN_AUTH_CACHE_S": "0"}, embedder) as client:
        params = {"query": "kong", "project": "poimen"}
        refused = client.get(
            "/memory/query", params=params, headers={"Authorization": f"Bearer {a_key}"}
        )
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"] == "unauthorized"
        served = client.get(
            "/memory/query", params=params, headers={"Authorization": f"Bearer {b_key}"}
        )
        assert served.status_code == 200 and served.json()["results"], served.text


def test_the_prefix_is_kept_and_a_different_one_refused(
    two_databases: tuple[str, str], plpython_root: Path
) -> None:
    a_url, _ = two_databases
    with connect(a_url, autocommit=True) as a:
        before = db_roles(a)
        row = "SELECT xmin::text FROM pg_database WHERE datname = current_database()"
        version = _one(a, row)
        assert migrate(a, plpython_root, role_prefix=before.prefix).roles == before
        assert _one(a, row) == version  # CONNECT already right: the row is not rewritten
        with pytest.raises(MigrationError, match="POIMEN_ROLE_PREFIX is other_db"):
            migrate(a, plpython_root, role_prefix="other_db")
        assert db_roles(a) == before


def test_a_template_copy_shares_its_roles_and_check_says_so(conn: Conn) -> None:
    """CREATE DATABASE ... TEMPLATE copies the grants to the template's roles: no drift
    from sql/, but a warning that a grant in one database reaches the other."""
    drift = check(conn)
    assert drift.clean, drift
    (warning,) = drift.warnings
    assert warning.startswith(f"this database's roles ({', '.join(db_roles(conn).all)})")
    assert "tmpl_fixture" in warning, warning


def test_a_database_of_the_cluster_wide_roles_moves_to_its_own(
    cluster: Cluster,
    admin: Conn,
    empty_url: str,
    plpython_root: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A database migrated before roles were per database: its grants were the shared
    memory_reader trio's, and no prefix is recorded. Its next migrate gives it its own roles,
    the shared roles' members here keep their access (and are named), the project grants
    follow, and the shared roles keep nothing here."""
    with connect(empty_url, autocommit=True) as conn:
        # The old layout: sql/ rendered with the cluster-wide names, no prefix recorded.
        monkeypatch.setattr(migrate_roles, "prefix_for", lambda _name: LEGACY.prefix)
        migrate(conn, plpython_root)
        monkeypatch.undo()
        conn.execute("DELETE FROM memory.config WHERE key = 'role_prefix'")
        make_role(conn, "roles_old_app", "memory_reader")
        conn.execute("SELECT memory.grant_project('memory_reader', 'poimen')")
        assert _one(conn, "SELECT has_schema_privilege('memory_reader', 'memory', 'USAGE')")

        before = check(conn)
        assert "config missing (migrate restores it): memory.config role_prefix" in " ".join(
            before.findings
        ), before.findings
        report = migrate(conn, plpython_root)
        new = Roles(prefix_for(_dbname(empty_url)))
        assert report.roles == new == db_roles(conn)
        assert any(
            f"{new.reader} in place of the cluster-wide memory_reader" in n and "roles_old_app" in n
            for n in report.notices
        ), report.notices
        for old in LEGACY.all:
            assert not _one(conn, "SELECT has_schema_privilege(%s, 'memory', 'USAGE')", (old,))
            assert not _one(
                conn,
                "SELECT has_function_privilege(%s, 'memory.version()', 'EXECUTE')",
                (old,),
            )
        assert _one(conn, "SELECT pg_has_role('roles_old_app', %s, 'MEMBER')", (new.reader,))
        assert conn.execute(
            "SELECT role_name::text, project FROM memory.project_grants ORDER BY 1"
        ).fetchall() == [(new.reader, "poimen")]
        assert check(conn).clean
        again = migrate(conn, plpython_root)
        assert again.notices == [] and again.roles == new


@pytest.mark.parametrize(
    ("database", "prefix"),
    [
        ("poimen", "poimen"),
        # Names that are not plain identifiers, or too long, keep a hash of the real name,
        # so "My-Memory" and "my_memory" get two prefixes.
        ("My-Memory", "my_memory_0a152db7"),
        ("my_memory", "my_memory"),
        ("2024", "db_2024_6557739a"),
        ("x" * 63, "x" * 31 + "_75220b47"),
    ],
)
def test_the_default_prefix_is_a_plain_identifier(database: str, prefix: str) -> None:
    assert prefix_for(database) == prefix and check_role_prefix(prefix) == prefix
    assert len(Roles(prefix).service) <= 63
