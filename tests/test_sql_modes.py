"""The SQL suite once more under each hostile setting a DBA may run: forced parallel mode,
an empty search_path, and pgvector installed in a schema named `extensions`. Each run is a
separate pytest session (its own throwaway cluster) with POIMEN_TEST_SQL_MODE set; the
fixtures in conftest.py apply the mode.

The three sessions start together and run side by side: each spends much of its time
waiting on its own PostgreSQL, so together they take about half the time they took one
after the other. Each test below waits for its own session."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import SQL_MODE, SQL_MODES

ROOT = Path(__file__).resolve().parents[1]
SQL_SUITE = [
    "tests/test_sql_functions.py",
    "tests/test_memory_query.py",
    "tests/test_plans.py",
    "tests/test_migrations.py",
    "tests/test_sql_hygiene.py",
    "tests/test_tenants.py",
    "tests/test_sql_edges.py",
    "tests/test_provenance_caps.py",
    "tests/test_time_filter.py",
    "tests/test_sql_embed.py",
    "tests/test_add_nodes.py",
]
# A bound on each session, far above its few minutes, so a hung run fails instead of
# holding CI until its own limit.
SESSION_TIMEOUT_S = 1500


@pytest.fixture(scope="module")
def sessions(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], Path]]]:
    logs = tmp_path_factory.mktemp("sql-modes")
    running: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    for mode in SQL_MODES:
        log = logs / f"{mode}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SQL_SUITE],
                cwd=ROOT,
                env=dict(os.environ, POIMEN_TEST_SQL_MODE=mode),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        running[mode] = (proc, log)
    yield running
    for proc, _ in running.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(bool(SQL_MODE), reason="already inside a SQL-mode run")
@pytest.mark.parametrize("mode", SQL_MODES)
def test_sql_suite_passes_in_mode(
    mode: str, sessions: dict[str, tuple[subprocess.Popen[bytes], Path]]
) -> None:
    proc, log = sessions[mode]
    try:
        code = proc.wait(timeout=SESSION_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(
            f"the {mode} session ran over {SESSION_TIMEOUT_S} s:\n{log.read_text()[-6000:]}"
        )
    assert code == 0, log.read_text()[-8000:]
