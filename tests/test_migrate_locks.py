"""Deploys block nobody (issue 26): a migrate that changes nothing takes no lock a query or
a write waits for; DDL that must run waits a short lock_timeout per attempt and retries,
naming what it waited for. Asserted on pg_locks (who waited, for what), not on wall clock."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import deploy, locks, migrate
from poimen_memory.db.roles import Roles
from poimen_memory.errors import MigrationError

Conn = psycopg.Connection[Any]

LEXICAL = (
    "SELECT count(*) FROM public.memory_query('kong body buffer', NULL, 'poimen',"
    " strategy => 'LexicalOnly')"
)
# Relation locks in this database not granted, with the waiter's pid.
WAITING = """
SELECT l.pid, coalesce(l.relation::regclass::text, l.locktype), l.mode
FROM pg_locks l
WHERE NOT l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


class Watch:
    """A LexicalOnly query loop on its own connection, and a sampler (every 10 ms) of the
    locks it or migrate waits for."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.waits: list[tuple[float, int, str, str]] = []  # (when, pid, relation, mode)
        self.loop_pid = 0
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._loop), threading.Thread(target=self._sample)]

    def _loop(self) -> None:
        try:
            with connect(self.url, autocommit=True) as c:
                self.loop_pid = c.info.backend_pid
                while not self.stop.is_set():
                    t0 = time.monotonic()
                    c.execute(LEXICAL).fetchall()
                    self.latencies.append(time.monotonic() - t0)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def _sample(self) -> None:
        try:
            with connect(self.url, autocommit=True) as c:
                while not self.stop.is_set():
                    now = time.monotonic()
                    for pid, rel, mode in c.execute(WAITING).fetchall():
                        self.waits.append((now, pid, rel, mode))
                    time.sleep(0.01)
        except BaseException as exc:
            self.errors.append(exc)

    def longest_wait(self, pid: int) -> float:
        """The longest run of consecutive samples in which pid waited for a lock."""
        times = sorted({w[0] for w in self.waits if w[1] == pid})
        longest, start, prev = 0.0, None, None
        for t in times:
            if prev is None or t - prev > 0.05:
                start = t
            prev = t
            assert start is not None
            longest = max(longest, t - start + 0.01)
        return longest

    @contextmanager
    def running(self) -> Iterator[Watch]:
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(self.latencies) < 3 and time.monotonic() < deadline and not self.errors:
            time.sleep(0.02)
        try:
            yield self
        finally:
            self.stop.set()
            for t in self.threads:
                t.join(timeout=60)
        assert self.errors == []


def test_a_noop_migrate_takes_no_lock_beyond_a_writers(
    conn: Conn, plpython_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the deploy's transaction holds on the schema's tables when sql/ is applied and
    nothing differs: ACCESS SHARE (reading the catalog, a LIKE) and ROW EXCLUSIVE (SQL
    functions' bodies are parsed at CREATE: their INSERTs), nothing a query or write waits for."""
    held: list[tuple[str, str]] = []
    real = deploy.apply_sql_files

    def spy(c: Conn, schema: str, roles: Roles) -> list[Path]:
        files = real(c, schema, roles)
        held.extend(
            (str(r[0]), str(r[1]))
            for r in c.execute(
                "SELECT l.relation::regclass::text, l.mode FROM pg_locks l"
                " JOIN pg_class k ON k.oid = l.relation"
                " WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation'"
                " AND k.relnamespace = 'memory'::regnamespace"
            )
        )
        return files

    monkeypatch.setattr(deploy, "apply_sql_files", spy)
    migrate(conn, plpython_root)
    assert held, "the spy saw the transaction"
    strong = [
        (rel, mode) for rel, mode in held if mode not in ("AccessShareLock", "RowExclusiveLock")
    ]
    assert strong == []


def test_a_noop_migrate_waits_for_no_reader_writer_or_vacuum(
    conn: Conn, fixture_url: str, plpython_root: Path
) -> None:
    """A 'long reader' that has read memory.nodes, and one session holding every table of the
    schema ROW EXCLUSIVE and SHARE UPDATE EXCLUSIVE (a writer and a VACUUM in flight): a
    no-op migrate goes through on its first attempt, and a LexicalOnly loop beside it
    never waits for a lock."""
    tables = [
        str(r[0])
        for r in conn.execute(
            "SELECT c.oid::regclass::text FROM pg_class c"
            " WHERE c.relnamespace = 'memory'::regnamespace AND c.relkind IN ('r', 'p')"
        )
    ]
    watch = Watch(fixture_url)
    with (
        connect(fixture_url, autocommit=False) as reader,
        connect(fixture_url, autocommit=False) as holder,
        watch.running(),
    ):
        reader.execute("SELECT count(*) FROM memory.nodes").fetchone()
        holder.execute(f"LOCK TABLE {', '.join(tables)} IN ROW EXCLUSIVE MODE")
        holder.execute(f"LOCK TABLE {', '.join(tables)} IN SHARE UPDATE EXCLUSIVE MODE")
        migrate_pid = conn.info.backend_pid
        t0 = time.monotonic()
        report = migrate(conn, plpython_root, lock_timeout_s=5)
        elapsed = time.monotonic() - t0
        time.sleep(0.2)
        reader.rollback()
        holder.rollback()
    assert report.lock_waits == []
    assert [w for w in watch.waits if w[1] in (migrate_pid, watch.loop_pid)] == []
    assert len(watch.latencies) >= 3
    # Wall clock only as a loose bound (2 cores shared): the lock evidence is above.
    assert elapsed < 30


def test_ddl_that_must_run_waits_briefly_retries_and_says_for_what(
    conn: Conn, fixture_url: str, plpython_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real drift (row-level security off) behind a long reader: each attempt queues its
    ACCESS EXCLUSIVE for at most the attempt timeout, so the query loop behind it waits that
    long at most; migrate gives up naming the table, the lock and the session holding it,
    and succeeds once the reader is gone, telling what it waited for. Counted from migrate's
    lock reports, not timed: a loaded machine changes how long, not how many."""
    conn.execute("ALTER TABLE memory.nodes DISABLE ROW LEVEL SECURITY")
    watch = Watch(fixture_url)
    with connect(fixture_url, autocommit=False) as reader, watch.running():
        reader.execute("SELECT count(*) FROM memory.nodes").fetchone()
        reader_pid = reader.info.backend_pid
        with pytest.raises(MigrationError, match="could not take a lock within 2 s") as exc:
            migrate(conn, plpython_root, lock_timeout_s=2)
        detail = exc.value.detail or ""
        assert "ENABLE ROW LEVEL SECURITY" in detail, detail
        assert f"memory.nodes AccessShareLock held by pid {reader_pid}" in detail, detail
        # A later deploy: the reader finishes while it retries. Each attempt that gives up
        # reports what it waited for (locks.waited_for); counted here as it happens,
        # with how many queries the loop beside it had answered by then.
        refused: list[int] = []
        given_up = threading.Event()
        real = locks.waited_for

        def report(c: Conn, exc: psycopg.errors.LockNotAvailable) -> str:
            refused.append(len(watch.latencies))
            if len(refused) >= 3:
                given_up.set()
            return real(c, exc)

        monkeypatch.setattr(locks, "waited_for", report)
        done: dict[str, Any] = {}

        def deploy() -> None:
            try:
                with connect(fixture_url, autocommit=True) as c:
                    done["report"] = migrate(c, plpython_root, lock_timeout_s=20)
            except BaseException as exc:  # reported below
                done["error"] = exc

        t = threading.Thread(target=deploy)
        t.start()
        # The reader finishes once the deploy has given up three attempts behind it. A
        # migrate that waited its whole lock timeout in one attempt would give up once, at
        # the end (20 s), and fail here.
        while not given_up.wait(0.05) and t.is_alive():
            pass
        reader.rollback()
        t.join(timeout=60)
    assert len(refused) >= 3, (refused, done)
    report = done["report"]
    assert len(report.lock_waits) == len(refused), report.lock_waits
    assert all("memory.nodes" in w for w in report.lock_waits), report.lock_waits
    assert conn.execute(
        "SELECT relrowsecurity FROM pg_class WHERE oid = 'memory.nodes'::regclass"
    ).fetchone() == (True,)
    # The loop queued behind each attempt for one attempt at most: between the deploy's
    # first and third refused attempts it answered queries (behind an attempt that waited
    # throughout it would have answered none).
    assert refused[2] > refused[0], refused


def test_serve_starts_and_answers_beside_a_writer_and_a_vacuum(
    conn: Conn, fixture_url: str, embedder: Any
) -> None:
    """The service starting (pool, plan checks, the key ring) takes no lock that a writer or
    a VACUUM holding every table of the schema would make it wait for: it comes up and
    answers a query while they hold them (an issue saw serve refuse to start behind any
    session's lock on memory.*)."""
    from service_client import KONG, query, serve

    tables = [
        str(r[0])
        for r in conn.execute(
            "SELECT c.oid::regclass::text FROM pg_class c"
            " WHERE c.relnamespace = 'memory'::regnamespace AND c.relkind IN ('r', 'p')"
        )
    ]
    with connect(fixture_url, autocommit=False) as holder:
        holder.execute(f"LOCK TABLE {', '.join(tables)} IN ROW EXCLUSIVE MODE")
        holder.execute(f"LOCK TABLE {', '.join(tables)} IN SHARE UPDATE EXCLUSIVE MODE")
        env = {"POIMEN_DATABASE_URL": fixture_url}
        with serve(env, embedder) as client:
            assert client.get("/healthz").status_code == 200
            assert query(client, query=KONG, project="poimen")["results"]
        waiting = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND database ="
            " (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
        holder.rollback()
    assert waiting == (0,)
