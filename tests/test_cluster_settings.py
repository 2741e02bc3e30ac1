"""The embedded cluster's server defaults yield to ALTER SYSTEM, as a DBA expects: they live
in an included file, not on the server's command line."""

from __future__ import annotations

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
