"""The SQL suite once more under each hostile setting a DBA may run: forced parallel mode,
an empty search_path, and pgvector installed in a schema named `extensions`. Each run is a
separate pytest session (its own throwaway cluster) with POIMEN_TEST_SQL_MODE set; the
fixtures in conftest.py apply the mode.

The selected sessions start together, when the main session has collected its tests, and
run side by side and beside the rest of the suite (on this project's 2-core machines the
three took 5 min 46 s together against about 8 min 20 s one after the other, and the main
session spends most of its time waiting on servers); each test below waits for its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import EARLY, EARLY_DEADLINE, SQL_MODE, SQL_MODES

ROOT = Path(__file__).resolve().parents[1]
SQL_SUITE = [
    "tests/test_sql_functions.py",
    "tests/test_memory_query.py",
    "tests/test_plans.py",
    "tests/test_migrations.py",
    "tests/test_sql_hygiene.py",
    "tests/test_drift_security.py",
    "tests/test_tenants.py",
    "tests/test_sql_edges.py",
    "tests/test_provenance_caps.py",
    "tests/test_time_filter.py",
    "tests/test_sql_embed.py",
    "tests/test_add_nodes.py",
]
# One bound for all the sessions together, far above their few minutes, so a hung run
# fails instead of holding CI until its own limit.
SESSIONS_TIMEOUT_S = 1500
# A session stopped early gets SIGINT first: pytest then runs its teardown, which stops
# that session's PostgreSQL and removes its directory (SIGKILL would leave both behind).
STOP_GRACE_S = 60

Session = tuple[subprocess.Popen[bytes], Path]
# pytest with Python's own SIGINT handler even where SIGINT is inherited as ignored (a
# background job of a non-interactive shell): without it the SIGINT below does nothing.
_RUN_PYTEST = (
    "import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.exit(pytest.main(sys.argv[1:]))"
)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start(modes: list[str], logs: Path) -> dict[str, Session]:
    """The sessions of ``modes``, started at once, each logging to its own file."""
    running: dict[str, Session] = {}
    for mode in dict.fromkeys(modes):
        log = logs / f"{mode}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-c", _RUN_PYTEST, "-q", "-p", "no:cacheprovider", *SQL_SUITE],
                cwd=ROOT,
                env=dict(os.environ, POIMEN_TEST_SQL_MODE=mode),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        running[mode] = (proc, log)
    return running


def stop_all(running: dict[str, Session]) -> None:
    for proc, _ in running.values():
        _stop(proc)


@pytest.fixture(scope="module")
def sessions(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict[str, Session], float]]:
    """The sessions of the modes this run selected, and their deadline. conftest.py starts
    them when collection ends, so they run beside the rest of the suite (most of which
    waits on servers, not on the cores); run alone, this module starts them itself."""
    early: dict[str, Session] | None = request.config.stash.get(EARLY, None)
    if early is not None:
        yield early, request.config.stash[EARLY_DEADLINE]
        return
    selected = [
        item.callspec.params["mode"]
        for item in request.session.items
        if item.originalname == "test_sql_suite_passes_in_mode"
    ]
    running = start(selected, tmp_path_factory.mktemp("sql-modes"))
    try:
        yield running, time.monotonic() + SESSIONS_TIMEOUT_S
    finally:
        stop_all(running)


@pytest.mark.skipif(bool(SQL_MODE), reason="already inside a SQL-mode run")
@pytest.mark.parametrize("mode", SQL_MODES)
def test_sql_suite_passes_in_mode(mode: str, sessions: tuple[dict[str, Session], float]) -> None:
    running, deadline = sessions
    proc, log = running[mode]
    try:
        code = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        _stop(proc)
        pytest.fail(
            f"the {mode} session ran past {SESSIONS_TIMEOUT_S} s:\n{log.read_text()[-6000:]}"
        )
    assert code == 0, log.read_text()[-8000:]
