"""The SQL suite once more under each hostile setting a DBA may run: forced parallel mode,
an empty search_path, and pgvector installed in a schema named `extensions`. Each run is a
separate pytest session (its own throwaway cluster) with POIMEN_TEST_SQL_MODE set; the
fixtures in conftest.py apply the mode."""

from __future__ import annotations

import os
import subprocess
import sys
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


@pytest.mark.skipif(bool(SQL_MODE), reason="already inside a SQL-mode run")
@pytest.mark.parametrize("mode", SQL_MODES)
def test_sql_suite_passes_in_mode(mode: str) -> None:
    env = dict(os.environ, POIMEN_TEST_SQL_MODE=mode)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SQL_SUITE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
