"""A managed PostgreSQL (RDS, Cloud SQL, Azure, Supabase, Neon), as far as one cluster can
play it: the application's role owns its database and may create roles, an administrator
created `vector` for it, and `plpython3u` does not exist (only a superuser may create it,
and managed services never offer it). `migrate` ran into 42501 there; now it succeeds as
that owner, PL/Python's functions become PM503 stubs, and the service and memory_query()
with a caller's vector answer in full. A cluster of its own: its roles are cluster-wide."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conftest import FIXTURE, free_port
from poimen_core import vocabulary
from poimen_memory.db.cluster import Cluster, find_pg_bin
from poimen_memory.db.connect import connect, ensure_service_login
from poimen_memory.db.migrate import check, migrate, plpython_status
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.errors import MigrationError
from poimen_memory.ingest.nodes import parse_lines
from poimen_memory.ingest.writer import ingest
from service_client import KONG, query, serve

OWNER = "app_owner"

# The checkout these tests run from (the package may be installed elsewhere).
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def managed(work_dir: Path) -> Iterator[tuple[Cluster, str]]:
    base = work_dir / "managed"  # the server's OS user must reach it
    c = Cluster(base / "data", base / "run", free_port(), find_pg_bin())
    c.start(fast=True)
    with psycopg.connect(c.url("postgres"), autocommit=True) as su:
        su.execute(f"CREATE ROLE {OWNER} LOGIN CREATEROLE")
        su.execute(f"CREATE DATABASE managed OWNER {OWNER}")
    with psycopg.connect(c.url("managed"), autocommit=True) as su:
        su.execute("CREATE EXTENSION vector")  # what the provider's administrator does
    # This OS user may log in as the owner too (peer authentication, as for the service).
    me = "root" if os.geteuid() == 0 else None
    users = ["postgres", "root"] if me else [os.environ.get("USER", "postgres")]
    ident = c.data_dir / "pg_ident.conf"
    ident.write_text(ident.read_text() + "".join(f"poimen {u} {OWNER}\n" for u in users))
    with psycopg.connect(c.url("postgres"), autocommit=True) as su:
        su.execute("SELECT pg_reload_conf()")
    yield c, c.url("managed", user=OWNER)
    c.destroy()


@pytest.fixture(scope="module")
def migrated(managed: tuple[Cluster, str], embedder: LocalEmbedder) -> str:
    _, url = managed
    with connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")\
            .fetchone() == (False,)  # fmt: skip
        assert plpython_status(conn) == (False, False)
        migrate(conn, None)
        ensure_service_login(conn, "poimen_service")
        records, _ = parse_lines(FIXTURE.read_text().splitlines())
        ingest(conn, records, embedder, progress=False)
    return url


def test_migrate_succeeds_as_the_owner_and_check_finds_no_drift(migrated: str) -> None:
    with connect(migrated, autocommit=True) as conn:
        assert conn.execute(
            "SELECT count(*) FROM pg_extension WHERE extname = 'plpython3u'"
        ).fetchone() == (0,)
        drift = check(conn)
        assert drift.clean, drift
        migrate(conn, None)  # and again: idempotent
        langs = dict(
            conn.execute(
                "SELECT p.proname, l.lanname FROM pg_proc p JOIN pg_language l"
                " ON l.oid = p.prolang WHERE p.pronamespace = 'memory'::regnamespace"
                " AND p.proname IN ('embed', 'add_nodes', '_optimize_query', 'plpython_load')"
            ).fetchall()
        )
    assert langs == dict.fromkeys(("embed", "add_nodes", "_optimize_query", "plpython_load"),
                                  "plpgsql")  # fmt: skip


def test_the_pl_python_functions_say_what_is_missing(migrated: str) -> None:
    with connect(migrated) as conn:
        for call in ("SELECT memory.embed('kong')", "SELECT memory.optimize_query('kong')",
                     "SELECT memory.add_nodes('[]')"):  # fmt: skip
            with pytest.raises(psycopg.Error) as info:
                conn.execute(call)
            assert info.value.sqlstate == "PM503"
            assert "needs PL/Python" in str(info.value) and info.value.diag.message_hint
            conn.rollback()


def test_memory_query_answers_with_the_callers_vector_and_without_one(
    migrated: str, embedder: LocalEmbedder
) -> None:
    notices: list[str] = []
    with connect(migrated) as conn:
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        vec = embedder.embed_query(KONG)
        full: list[Any] = conn.execute(
            "SELECT external_id, search_strategy FROM public.memory_query(%s, %s, 'poimen')",
            (KONG, vec),
        ).fetchall()
        assert full and {r[1] for r in full} == {"Hybrid"}  # no optimizer: routed as Hybrid
        text_only = conn.execute(
            "SELECT external_id FROM public.memory_query('kong body buffer', project => 'poimen')"
        ).fetchall()
    assert text_only and any("lexical leg answers alone" in n for n in notices)


def test_the_service_is_complete_on_it(
    managed: tuple[Cluster, str], migrated: str, embedder: LocalEmbedder
) -> None:
    cluster, _ = managed
    with serve({"POIMEN_DATABASE_URL": cluster.url("managed", user="poimen_service")},
               embedder) as client:  # fmt: skip
        body = query(client, query=KONG, project="poimen")
        assert body["results"] and body["search_strategy"] in ("Hybrid", "LexicalFirst")
        r = client.post(
            "/memory/nodes",
            json=[{"id": "managed:1", "level": "L0", "project": "poimen",
                   "text": "written through the service on a managed database"}],
        )  # fmt: skip
        assert r.status_code == 201 and r.json()["inserted"] == 1, r.text


def test_doctor_lists_what_is_off_and_what_it_costs(
    managed: tuple[Cluster, str], migrated: str
) -> None:
    """`poimen-memory doctor` as the owner: exit 0 (nothing required is missing), PL/Python
    and what needs it off, each with its reason and the vocabulary's cost."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    proc = subprocess.run(
        [sys.executable, "-m", "poimen_memory.cli.main", "doctor", "--json"],
        env={**env, "POIMEN_DATABASE_URL": migrated},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    caps = {c["name"]: c for c in body["capabilities"]}
    costs = {n: c for n, _r, _w, c in vocabulary.CAPABILITIES}
    assert body["ok"] is True and body["role"] == OWNER
    assert {n for n, c in caps.items() if c["status"] == "off"} == {
        "plpython3u", "plpython_module", "embedder", "pg_stat_statements",
    }  # fmt: skip
    # The test cluster's server has the package; a managed service's does not offer it.
    assert caps["plpython3u"]["detail"] == (
        "not in this database; the server offers it, but only a superuser may create it"
    )
    assert caps["plpython3u"]["cost"] == costs["plpython3u"]
    for without in vocabulary.WITHOUT_PLPYTHON[1:]:
        assert f"{without[0]}: {without[2]}" in caps["plpython3u"]["cost"]
    assert caps["plpython_module"]["detail"] == caps["embedder"]["detail"] == "needs plpython3u"
    assert caps["owner"]["detail"] == (
        f"{OWNER}: owns schema memory; not a superuser; may create roles"
    )
    rls = caps["row_level_security"]["detail"]
    assert rls.endswith("this role bypasses it (it owns the tables)")
    text = subprocess.run(
        [sys.executable, "-m", "poimen_memory.cli.main", "doctor"],
        # The table wraps at the terminal's width (COLUMNS where set): 100, as without one.
        env={**env, "POIMEN_DATABASE_URL": migrated, "COLUMNS": "100"},
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert text.splitlines()[-1] == (
        "warning: off (optional): plpython3u, plpython_module, embedder, pg_stat_statements"
    )
    # Once each: under what needs plpython3u only its reason, not the same cost again.
    assert text.count("without it: ") == 2  # plpython3u's and pg_stat_statements'
    assert "routed as Hybrid unless" in " ".join(text.split())
    # The service's role, under row-level security: the same report, as it sees it.
    cluster, _ = managed
    with connect(cluster.url("managed", user="poimen_service")) as conn:
        rows = dict(conn.execute("SELECT name, status FROM memory.capabilities()").fetchall())
    assert rows["owner"] == "off" and rows["schema"] == "on"


COUNTS = "SELECT (SELECT count(*) FROM memory.nodes), (SELECT count(*) FROM memory.postings)"
PL_PYTHON_IN_THE_LIST = re.compile(r"FUNCTION \(memory \)\?\(([^)]*)\)")


def _restore_step(name: str) -> str:
    """The shell commands of docs/maintenance.md's restore step `name`, as written there."""
    text = (ROOT / "docs" / "maintenance.md").read_text()
    after = text.split(f"<!-- restore: {name} -->", 1)[1]
    return textwrap.dedent(after.split("```sh\n", 1)[1].split("```", 1)[0])


def test_a_dump_restores_as_the_owner_with_the_documented_commands(
    managed: tuple[Cluster, str], work_dir: Path, embedder: LocalEmbedder
) -> None:
    """Issue 44: pg_dump -Fc of a database a superuser migrated (PL/Python and all), then
    docs/maintenance.md's commands, exactly, into a database a non-superuser owner creates:
    no error, and `migrate --check` finds no drift."""
    c, _ = managed
    src, target = "restore_src", "restored_by_owner"
    with psycopg.connect(c.url("postgres"), autocommit=True) as su:
        for db in (src, target):
            su.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        su.execute(f"CREATE DATABASE {src}")
        su.execute(f"ALTER ROLE {OWNER} CREATEDB")
    with connect(c.url(src), autocommit=True) as conn:
        migrate(conn, None, role_prefix=src)
        records, _ = parse_lines(FIXTURE.read_text().splitlines())
        ingest(conn, records, embedder, progress=False)
        counts = conn.execute(COUNTS).fetchone()
        pl_python = {
            str(r[0])
            for r in conn.execute(
                "SELECT p.proname FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang"
                " WHERE l.lanname = 'plpython3u'"
                " AND p.pronamespace = 'memory'::regnamespace"
            )
        }
    # The documented list names every PL/Python function of the dump.
    listed = PL_PYTHON_IN_THE_LIST.search(_restore_step("owner-restore"))
    assert listed is not None and set(listed.group(1).split("|")) == pl_python, pl_python
    dump = work_dir / "restore_src.dump"
    subprocess.run(
        [str(c.bin_dir / "pg_dump"), "-Fc", "-h", str(c.socket_dir), "-p", str(c.port),
         "-U", "postgres", "-f", str(dump), src],
        check=True, capture_output=True,
    )  # fmt: skip
    dump.chmod(0o644)
    here = work_dir / "restore-cwd"
    here.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PATH": f"{c.bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PGHOST": str(c.socket_dir),
        "PGPORT": str(c.port),
        "DUMP": str(dump),
        "DB": target,
        "OWNER": OWNER,
    }
    try:
        for step, user in (
            ("owner-create", OWNER),
            ("administrator", "postgres"),
            ("owner-restore", OWNER),
        ):
            run = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", _restore_step(step)],
                env={**env, "PGUSER": user}, cwd=here, capture_output=True, text=True,
                check=False,
            )  # fmt: skip
            assert run.returncode == 0, (step, run.stdout, run.stderr)
            assert "error" not in run.stderr.lower(), (step, run.stderr)
        assert run.stdout.splitlines()[-1] == "no drift", run.stdout
        with psycopg.connect(c.url(target), autocommit=True) as su:
            owner = su.execute(
                "SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'memory'"
            ).fetchone()
            assert owner == (OWNER,)
            assert su.execute(COUNTS).fetchone() == counts
    finally:
        with psycopg.connect(c.url("postgres"), autocommit=True) as su:
            for db in (src, target):
                su.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
            su.execute(f"ALTER ROLE {OWNER} NOCREATEDB")


def test_an_owner_a_superuser_changed_is_named_not_an_abort(
    managed: tuple[Cluster, str], migrated: str
) -> None:
    """Issue 44: a table of the product given to another role by a superuser. The owner's
    `--check` used to abort with 42501; now it names the table and the statement a
    superuser runs, and migrate refuses with the same, changing nothing."""
    c, _ = managed
    db = migrated.split("?")[0].rsplit("/", 1)[-1]
    with psycopg.connect(c.url(db), autocommit=True) as su:
        su.execute(
            "DO $$ BEGIN IF to_regrole('managed_other') IS NULL THEN"
            " CREATE ROLE managed_other; END IF; END $$"
        )
        su.execute("ALTER TABLE memory.api_keys OWNER TO managed_other")
        statement = f'ALTER TABLE memory.api_keys OWNER TO "{OWNER}"'
        try:
            with connect(migrated, autocommit=True) as conn:
                drift = check(conn)
                assert drift.findings[0] == (
                    "owner changed by hand: TABLE memory.api_keys: managed_other (migrate"
                    f" makes it: {OWNER}, the owner of schema memory); {OWNER} may not change"
                    f" it (must be owner of table api_keys): a superuser runs {statement}"
                ), drift.findings
                with pytest.raises(MigrationError, match="owned by a role") as err:
                    migrate(conn, None)
                assert statement in str(err.value.detail)
        finally:
            su.execute(statement)
    with connect(migrated, autocommit=True) as conn:
        assert check(conn).clean
