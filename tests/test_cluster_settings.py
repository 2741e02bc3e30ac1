"""The embedded cluster's server defaults yield to ALTER SYSTEM, as a DBA expects: they live
in an included file, not on the server's command line."""

from __future__ import annotations

import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from conftest import free_port
from poimen_memory.db.cluster import DEFAULTS_FILE, SERVER_DEFAULTS, Cluster


@pytest.fixture
def own_cluster(cluster: Cluster) -> Iterator[Cluster]:
    base = cluster.data_dir.parent / "settings"
    c = Cluster(base / "data", base / "run", free_port(), cluster.bin_dir)
    c.start(fast=True)
    yield c
    c.destroy()


def _show(c: Cluster, name: str) -> str:
    with psycopg.connect(c.url("postgres")) as conn:
        row = conn.execute(f"SHOW {name}").fetchone()
    assert row is not None
    return str(row[0])


def test_defaults_apply_and_alter_system_overrides_them(own_cluster: Cluster) -> None:
    assert _show(own_cluster, "shared_buffers") == SERVER_DEFAULTS["shared_buffers"]
    assert _show(own_cluster, "maintenance_work_mem") == SERVER_DEFAULTS["maintenance_work_mem"]
    with psycopg.connect(own_cluster.url("postgres"), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET shared_buffers = '192MB'")
        conn.execute("ALTER SYSTEM SET maintenance_work_mem = '1GB'")
    own_cluster.stop()
    own_cluster.start(fast=True)
    assert _show(own_cluster, "shared_buffers") == "192MB"
    assert _show(own_cluster, "maintenance_work_mem") == "1GB"


def test_the_include_is_written_once(own_cluster: Cluster) -> None:
    own_cluster.stop()
    own_cluster.start(fast=True)
    conf = (Path(own_cluster.data_dir) / "postgresql.conf").read_text().splitlines()
    assert conf.count(f"include_if_exists '{DEFAULTS_FILE}'") == 1


def test_the_server_log_is_private_rotated_and_says_who_and_where(own_cluster: Cluster) -> None:
    """pgdata.log was 0644 in a 0755 POIMEN_HOME, with the SQL of failed statements (node
    text included) readable by every OS user, no user or database on its lines, and no
    rotation."""
    with psycopg.connect(own_cluster.url("postgres")) as conn:
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 'a secret node text', 1 / 0")
        conn.rollback()
        row = conn.execute("SELECT pg_current_logfile()").fetchone()
    assert row is not None and row[0]
    current = own_cluster.data_dir / row[0]
    assert current.parent == own_cluster.log_dir
    deadline = time.monotonic() + 10  # the collector writes a moment later
    while "division by zero" not in (text := current.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "postgres@postgres ERROR:  division by zero" in text and "a secret node text" in text
    assert stat.S_IMODE(current.stat().st_mode) == 0o600
    assert stat.S_IMODE(own_cluster.data_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(own_cluster.log_file.stat().st_mode) == 0o600
    assert (_show(own_cluster, "log_rotation_age"), _show(own_cluster, "log_rotation_size")) == (
        "1d",
        "100MB",
    )
    if os.geteuid() == 0:  # another OS user, as an attacker on the host would be
        for path in (current, own_cluster.log_file):
            other = subprocess.run(
                ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups",
                 "cat", str(path)],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            assert other.returncode != 0 and "Permission denied" in other.stderr
