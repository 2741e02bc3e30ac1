"""Shared fixtures: one throwaway PostgreSQL cluster per test session, a migrated template
database loaded with tests/fixtures/memory_nodes.jsonl, and per-test clones of it."""

from __future__ import annotations

import gc
import logging
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from poimen_memory.db.cluster import Cluster, find_pg_bin
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import migrate
from poimen_memory.db.roles import KINDS, Roles
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.ingest.nodes import parse_lines
from poimen_memory.ingest.writer import ingest
from poimen_memory.settings import Settings

FIXTURE = Path(__file__).parent / "fixtures" / "memory_nodes.jsonl"

# Scratch space. The suite's clusters, CLI homes and servers' files go where tempfile puts
# them. This project's CI machines have / on ext4 without a journal, where creating a file
# while many were deleted in the last 30 s scans the inode table past every one of them:
# a CREATE DATABASE per test (about 300 files) and a DROP DATABASE after it made that scan
# (find_inode_bit, recently_deleted) a quarter of the machine's CPU in perf, 0.85 ms of CPU
# a file on /tmp against 0.015 ms on tmpfs. So a run takes a directory of its own on a
# tmpfs (/dev/shm) that has room, and removes it at the end; the pytest-xdist workers and
# the SQL-mode sessions inherit it (TMPDIR). pytest's own tmp_path stays where it was
# (PYTEST_DEBUG_TEMPROOT), kept for a look after a failure. With POIMEN_TEST_SCRATCH set
# (to anything) tempfile is left alone: a run sets it for its workers and sessions.
SCRATCH_ENV = "POIMEN_TEST_SCRATCH"
SCRATCH_TMPFS = Path("/dev/shm")
SCRATCH_MIN_FREE = 4 << 30


def _tmpfs_with_room(path: Path) -> bool:
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
        st = os.statvfs(path)
    except OSError:
        return False
    tmpfs = any(m.split()[1:3] == [str(path), "tmpfs"] for m in mounts if len(m.split()) > 2)
    return tmpfs and st.f_bavail * st.f_frsize >= SCRATCH_MIN_FREE and os.access(path, os.W_OK)


def _own_scratch() -> Path | None:
    if SCRATCH_ENV in os.environ or not _tmpfs_with_room(SCRATCH_TMPFS):
        return None
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    d = Path(tempfile.mkdtemp(prefix="poimen-tests-", dir=SCRATCH_TMPFS))
    d.chmod(0o755)  # the server runs as postgres and must reach its directories inside
    os.environ[SCRATCH_ENV] = os.environ["TMPDIR"] = str(d)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    return d


OWN_SCRATCH = _own_scratch()

# The SQL suite runs once more under each of these (tests/test_sql_modes.py sets it):
#   parallel           force_parallel_mode = on with free parallel costs (one worker a
#                      Gather), cluster-wide;
#   empty_search_path  every test connection runs with search_path = '';
#   extensions         pgvector lives in schema "extensions" (as on Supabase), found through
#                      the cluster's search_path, before migrate runs.
SQL_MODE = os.environ.get("POIMEN_TEST_SQL_MODE", "")
SQL_MODES = ("parallel", "empty_search_path", "extensions")
if SQL_MODE and SQL_MODE not in SQL_MODES:
    raise RuntimeError(f"POIMEN_TEST_SQL_MODE must be one of {SQL_MODES}, not {SQL_MODE!r}")


# The SQL-mode sessions started early (pytest_collection_finish), for tests/test_sql_modes.py:
# the running processes and their directory. Under pytest-xdist the controller starts them
# (it alone sees every worker) and hands the directory to the workers in workerinput.
EARLY = pytest.StashKey[dict[str, Any]]()
EARLY_LOGS = pytest.StashKey[Path]()
EARLY_DIR_KEY = "poimen_sql_modes_dir"
MODE_TEST_NAME = "test_sql_suite_passes_in_mode"
MODE_TEST = f"test_sql_modes.py::{MODE_TEST_NAME}["


def _xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _start_early(config: pytest.Config, modes: list[str]) -> None:
    """Start the SQL-mode sessions of ``modes`` (once per run) into EARLY_LOGS."""
    if not modes or SQL_MODE or config.option.collectonly or EARLY in config.stash:
        return
    from test_sql_modes import start

    logs = config.stash.get(EARLY_LOGS, None)
    if logs is None:
        logs = config.stash[EARLY_LOGS] = Path(tempfile.mkdtemp(prefix="poimen-sql-modes-"))
    config.stash[EARLY] = start(modes, logs)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist, in the controller, before each worker starts: tell it where the
    sessions will write (made here: pytest-xdist's own pytest_configure runs last, so a
    conftest's cannot tell a controller yet)."""
    if SQL_MODE:
        return
    config = node.config
    logs = config.stash.get(EARLY_LOGS, None)
    if logs is None:
        logs = config.stash[EARLY_LOGS] = Path(tempfile.mkdtemp(prefix="poimen-sql-modes-"))
    node.workerinput[EARLY_DIR_KEY] = str(logs)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """pytest-xdist, in the controller: the first worker to finish collecting says which
    modes the run selected (every worker collects the same tests)."""
    modes = [i.split(MODE_TEST, 1)[1].rstrip("]") for i in ids if MODE_TEST in i]
    _start_early(node.config, modes)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The SQL-mode tests last. They only wait for the sessions started when collection
    ends; a pytest-xdist worker given them in the middle of its share sat there (372 s in
    one run) while its other tests waited behind them."""
    items.sort(key=lambda item: getattr(item, "originalname", "") == MODE_TEST_NAME)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the SQL-mode sessions the run selected as soon as it knows: they then run
    beside the rest of the suite instead of after it (tests/test_sql_modes.py). A
    pytest-xdist worker leaves that to the controller.

    And move what collection left alive (every imported module, class, function, test
    item: about 200,000 objects) out of the garbage collector's sight with gc.freeze():
    the per-test gc.collect() of no_unretrieved_task_exceptions then scans only what the
    tests themselves allocate, not the whole import graph each time (it took 0.6 s a test
    on a loaded 2-core machine, about a tenth of the suite). A frozen object is still freed
    when its reference count drops; only a cycle among them would stay, and none of these
    is a task. Each pytest-xdist worker collects, so each freezes its own."""
    gc.collect()
    gc.freeze()
    if _xdist_worker(session.config):
        return
    modes = [
        item.callspec.params["mode"]
        for item in session.items
        if getattr(item, "originalname", "") == MODE_TEST_NAME and hasattr(item, "callspec")
    ]
    _start_early(session.config, modes)


def pytest_sessionfinish(session: pytest.Session) -> None:
    early = session.config.stash.get(EARLY, None)
    if early:
        from test_sql_modes import stop_all

        stop_all(early)
    logs = session.config.stash.get(EARLY_LOGS, None)
    if logs is not None:
        shutil.rmtree(logs, ignore_errors=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    if OWN_SCRATCH is not None:
        shutil.rmtree(OWN_SCRATCH, ignore_errors=True)


def prepare_conn(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """Apply the SQL mode to a test connection (after pgvector's types are registered)."""
    if SQL_MODE == "empty_search_path":
        conn.execute("SET search_path = ''")
    return conn


def prepare_database(conn: psycopg.Connection[Any]) -> None:
    """Before migrate: in the extensions mode pgvector goes into its own schema first."""
    if SQL_MODE == "extensions":
        conn.execute("CREATE SCHEMA IF NOT EXISTS extensions")
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector SCHEMA extensions")


def db_roles(conn: psycopg.Connection[Any]) -> Roles:
    """The database's own reader, writer and service roles (memory.roles())."""
    row = conn.execute("SELECT reader FROM memory.roles()").fetchone()
    assert row is not None and str(row[0]).endswith("_memory_reader")
    return Roles(str(row[0]).removesuffix("_memory_reader"))


def make_role(conn: psycopg.Connection[Any], name: str, *member_of: str) -> None:
    """A NOLOGIN role, member of the given roles: "reader", "writer" and "service" name the
    database's own (memory.roles()). Roles are cluster-wide and the session's databases
    share them: created once, granted again harmlessly."""
    if any(r in KINDS for r in member_of):
        roles = db_roles(conn)
        member_of = tuple(roles.name(r) if r in KINDS else r for r in member_of)
    conn.execute(
        f"""DO $$ BEGIN
                IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{name}') THEN
                    CREATE ROLE {name} NOLOGIN;
                END IF;
            END $$"""
    )
    for r in member_of:
        conn.execute(f"GRANT {r} TO {name}")


def stage_migrations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, below: str
) -> Callable[[str], None]:
    """Point migrate at a copy of migrations/ holding only the versions before `below`;
    the returned function adds the rest from a given version on (a later deploy)."""
    from poimen_memory.db.migrate import layout

    real, staged = layout.MIGRATIONS_DIR, tmp_path / "staged"
    staged.mkdir()

    def copy(keep: Callable[[str], bool]) -> None:
        for m in sorted(real.glob("*.sql")):
            if keep(m.stem):
                (staged / m.name).write_text(m.read_text())

    copy(lambda v: v < below)
    monkeypatch.setattr(layout, "MIGRATIONS_DIR", staged)
    return lambda start: copy(lambda v: v >= start)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def work_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="poimen-test-"))
    d.chmod(0o755)  # the server runs as postgres and must reach its data and PL/Python code
    yield d
    shutil.rmtree(d, ignore_errors=True)


def force_parallel(conn: psycopg.Connection[Any]) -> str:
    """The setting that forces parallel plans: renamed debug_parallel_query in PostgreSQL 16."""
    return "debug_parallel_query" if conn.info.server_version >= 160000 else "force_parallel_mode"


@pytest.fixture(scope="session")
def cluster(work_dir: Path) -> Iterator[Cluster]:
    c = Cluster(work_dir / "data", work_dir / "run", free_port(), find_pg_bin())
    c.start(fast=True)
    settings: dict[str, str] = {}
    if SQL_MODE == "parallel":
        with psycopg.connect(c.url("postgres")) as probe:
            forcing = force_parallel(probe)
        settings = {
            forcing: "on",
            "parallel_setup_cost": "0",
            "parallel_tuple_cost": "0",
            "min_parallel_table_scan_size": "0",
            "min_parallel_index_scan_size": "0",
            # One worker a Gather: it runs our functions in a worker as two do, and every
            # worker is a fork (the session took 342 CPU-s with two, 277 with one).
            "max_parallel_workers_per_gather": "1",
        }
    elif SQL_MODE == "extensions":
        settings = {"search_path": '"$user", public, extensions'}  # written unquoted
    if settings:
        with psycopg.connect(c.url("postgres"), autocommit=True) as conn:
            for key, value in settings.items():
                v = value if key == "search_path" else f"'{value}'"
                conn.execute(f"ALTER SYSTEM SET {key} = {v}")
            conn.execute("SELECT pg_reload_conf()")
    yield c
    c.destroy()


@pytest.fixture(scope="session")
def plpython_root(work_dir: Path) -> Path:
    return work_dir / "plpython"


@pytest.fixture(scope="session")
def admin(cluster: Cluster) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(cluster.url("postgres"), autocommit=True) as conn:
        yield conn


@pytest.fixture(scope="session")
def embedder() -> LocalEmbedder:
    e = LocalEmbedder.from_settings(Settings.from_env(os.environ).embedding)
    e.load()
    return e


@pytest.fixture(scope="session")
def template_db(
    cluster: Cluster, admin: psycopg.Connection[Any], plpython_root: Path, embedder: LocalEmbedder
) -> str:
    name = "tmpl_fixture"
    admin.execute(f"DROP DATABASE IF EXISTS {name}")
    admin.execute(f"CREATE DATABASE {name}")
    with connect(cluster.url(name), autocommit=True) as conn:
        prepare_database(conn)
        # The demo database's role names (poimen_memory_reader, ...): the docs' examples
        # run in copies of this one and name them.
        migrate(conn, plpython_root, role_prefix="poimen")
        records, errors = parse_lines(FIXTURE.read_text().splitlines())
        assert not errors
        report = ingest(conn, records, embedder, progress=False)
        assert report.inserted == len(records) and not report.unresolved
    return name


# A copy made with CREATE DATABASE ... TEMPLATE starts with the default privileges on the
# database, PUBLIC's CONNECT among them (they belong to pg_database, not to the copied
# files): what migrate makes of them (sql/900_grants.sql), so the copy is as a migrated
# database is and `migrate --check` finds no drift in it.
_OWN_CONNECT = """
DO $$ BEGIN
    IF pg_catalog.to_regprocedure('memory.roles()') IS NOT NULL THEN
        EXECUTE format('REVOKE CONNECT ON DATABASE %I FROM PUBLIC', current_database());
        EXECUTE format('GRANT CONNECT ON DATABASE %I TO %I', current_database(),
                       (SELECT reader FROM memory.roles()));
    END IF;
END $$
"""


def own_connect(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(_OWN_CONNECT)


def _clone(cluster: Cluster, admin: psycopg.Connection[Any], template: str | None) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin.execute(f"CREATE DATABASE {name}" + (f" TEMPLATE {template}" if template else ""))
    if template:
        own_connect(cluster.url(name))
    try:
        yield cluster.url(name)
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def fixture_url(
    cluster: Cluster, admin: psycopg.Connection[Any], template_db: str
) -> Iterator[str]:
    """A private copy of the migrated, fixture-loaded database."""
    yield from _clone(cluster, admin, template_db)


@pytest.fixture
def empty_url(cluster: Cluster, admin: psycopg.Connection[Any]) -> Iterator[str]:
    """A brand-new database with nothing installed."""
    yield from _clone(cluster, admin, None)


@pytest.fixture
def conn(fixture_url: str) -> Iterator[psycopg.Connection[Any]]:
    with connect(fixture_url, autocommit=True) as c:
        yield prepare_conn(c)


class _NeverRetrieved(logging.Handler):
    """Collects asyncio's 'Task exception was never retrieved' reports."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "exception was never retrieved" in message:
            self.seen.append(message)


@pytest.fixture(autouse=True)
def no_unretrieved_task_exceptions() -> Iterator[None]:
    """Every task the code starts is awaited or cancelled: a test fails if asyncio reports a
    task whose exception nobody retrieved (reported when the task is collected)."""
    handler = _NeverRetrieved()
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    try:
        yield
        gc.collect()
    finally:
        logger.removeHandler(handler)
    assert handler.seen == [], handler.seen
