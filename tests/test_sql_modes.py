"""The SQL suite once more under each hostile setting a DBA may run: forced parallel mode,
an empty search_path, and pgvector installed in a schema named `extensions`, less the files
a mode changes nothing of (MODE_LEAVES_OUT). Each run is a separate pytest session (its
own throwaway cluster) with POIMEN_TEST_SQL_MODE set; the fixtures in conftest.py apply the
mode.

The selected sessions start together, when the main session has collected its tests, and
run side by side and beside the rest of the suite (on this project's 2-core machines the
three took 5 min 46 s together against about 8 min 20 s one after the other, and the main
session spends most of its time waiting on servers); each test below waits for its own."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import EARLY_DIR_KEY, EARLY_LOGS, SQL_MODE, SQL_MODES

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
# The files a mode leaves out, because the mode changes nothing of ours they exercise.
# Forced parallel plans test our functions' PARALLEL labels: a function labelled safe that
# writes, or reads state a worker lacks, fails once a query runs it in a worker (the mode
# found such a case, docs/benchmarks.md), and the files kept call our functions. The two
# below drive migrate and `migrate --check`: DDL and catalog reads, whose cost the mode
# multiplies (measured on one database: migrate 0.74 -> 3.16 s, check 0.47 -> 1.27 s; the
# two files were 47% of the mode's session) while the code it runs in workers is
# PostgreSQL's own (the few functions of ours they call, the kept files call too, or the
# tests create them). Migrate itself still runs under every mode: each session's template
# database is migrated with the mode on (conftest.py), as test_plans.py's databases are.
MODE_LEAVES_OUT: dict[str, frozenset[str]] = {
    "parallel": frozenset({"tests/test_migrations.py", "tests/test_drift_security.py"}),
}
assert set(MODE_LEAVES_OUT) <= set(SQL_MODES), MODE_LEAVES_OUT
assert all(files <= set(SQL_SUITE) for files in MODE_LEAVES_OUT.values()), MODE_LEAVES_OUT

# One bound for all the sessions together, far above their few minutes, so a hung run
# fails instead of holding CI until its own limit.
SESSIONS_TIMEOUT_S = 1500
# A session stopped early gets SIGINT first: pytest then runs its teardown, which stops
# that session's PostgreSQL and removes its directory (SIGKILL would leave both behind).
STOP_GRACE_S = 60

# Each session's files in the run's directory: <mode>.log (its output), <mode>.pid, and
# <mode>.rc (its exit code, written when it ends); `deadline` holds the time (time.time())
# past which the tests stop waiting. Files, so that a test waits the same way wherever it
# runs: in the process that started the sessions, or in a pytest-xdist worker while the
# controller started them (conftest.py).
DEADLINE_FILE = "deadline"
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


def _record_exit(proc: subprocess.Popen[bytes], rc: Path) -> None:
    code = proc.wait()
    tmp = rc.with_suffix(".rc.tmp")
    with contextlib.suppress(FileNotFoundError):  # the run ended and removed the directory
        tmp.write_text(str(code))
        tmp.replace(rc)  # whole or absent: a reader never sees half of it


def suite(mode: str) -> list[str]:
    """The files a mode's session runs."""
    return [f for f in SQL_SUITE if f not in MODE_LEAVES_OUT.get(mode, frozenset())]


def start(modes: list[str], logs: Path) -> dict[str, subprocess.Popen[bytes]]:
    """The sessions of ``modes``, started at once, each logging to its own file in ``logs``;
    a thread per session writes its exit code there when it ends."""
    (logs / DEADLINE_FILE).write_text(repr(time.time() + SESSIONS_TIMEOUT_S))
    running: dict[str, subprocess.Popen[bytes]] = {}
    for mode in dict.fromkeys(modes):
        with (logs / f"{mode}.log").open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-c", _RUN_PYTEST, "-q", "-p", "no:cacheprovider", *suite(mode)],
                cwd=ROOT,
                env=dict(os.environ, POIMEN_TEST_SQL_MODE=mode),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        (logs / f"{mode}.pid").write_text(str(proc.pid))
        threading.Thread(target=_record_exit, args=(proc, logs / f"{mode}.rc"), daemon=True).start()
        running[mode] = proc
    return running


def stop_all(running: dict[str, subprocess.Popen[bytes]]) -> None:
    for proc in running.values():
        _stop(proc)


def _exit_code(logs: Path, mode: str, until: float) -> int | None:
    rc = logs / f"{mode}.rc"
    while not rc.exists():
        if time.time() > until:
            return None
        time.sleep(0.2)
    return int(rc.read_text())


def _stop_by_pid(logs: Path, mode: str) -> None:
    """_stop for a session this process may not have started: SIGINT, then SIGKILL."""
    pid = int((logs / f"{mode}.pid").read_text())
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGINT)
    if _exit_code(logs, mode, time.time() + STOP_GRACE_S) is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def sessions(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """The directory of the sessions of the modes this run selected. conftest.py starts
    them when collection ends (under pytest-xdist, the controller does, once for all its
    workers), so they run beside the rest of the suite (most of which waits on servers,
    not on the cores); run alone, this module starts them itself."""
    workerinput: dict[str, Any] | None = getattr(request.config, "workerinput", None)
    if workerinput is not None:  # a worker never starts them: each would start them all
        yield Path(workerinput[EARLY_DIR_KEY])
        return
    early: Path | None = request.config.stash.get(EARLY_LOGS, None)
    if early is not None:
        yield early
        return
    selected = [
        item.callspec.params["mode"]
        for item in request.session.items
        if item.originalname == "test_sql_suite_passes_in_mode"
    ]
    logs = tmp_path_factory.mktemp("sql-modes")
    running = start(selected, logs)
    try:
        yield logs
    finally:
        stop_all(running)


@pytest.mark.skipif(bool(SQL_MODE), reason="already inside a SQL-mode run")
@pytest.mark.parametrize("mode", SQL_MODES)
def test_sql_suite_passes_in_mode(mode: str, sessions: Path) -> None:
    log = sessions / f"{mode}.log"
    code = _exit_code(sessions, mode, float((sessions / DEADLINE_FILE).read_text()))
    if code is None:
        _stop_by_pid(sessions, mode)
        pytest.fail(
            f"the {mode} session ran past {SESSIONS_TIMEOUT_S} s:\n{log.read_text()[-6000:]}"
        )
    assert code == 0, log.read_text()[-8000:]
