"""The embedded cluster admits only its own OS user (and root): no trust authentication, and
a socket directory no one else can enter."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import psycopg
import pytest

from poimen_memory.db.cluster import Cluster
from poimen_memory.errors import ClusterError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as user nobody")


def _as_nobody(cluster: Cluster, *sql_args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
         str(cluster.bin_dir / "psql"), "-X", "-h", str(cluster.socket_dir),
         "-p", str(cluster.port), "-U", "postgres", "-d", "postgres", *sql_args],
        capture_output=True, text=True, timeout=30, check=False, cwd="/",
    )  # fmt: skip


def test_user_nobody_cannot_connect(cluster: Cluster) -> None:
    proc = _as_nobody(cluster, "-c", "COPY (SELECT 1) TO PROGRAM 'id'")
    assert proc.returncode != 0
    assert "Permission denied" in proc.stderr or "authentication failed" in proc.stderr


def test_socket_directory_is_private(cluster: Cluster) -> None:
    mode = stat.S_IMODE(Path(cluster.socket_dir).stat().st_mode)
    assert mode == 0o700
    assert Path(cluster.socket_dir).owner() == "postgres"


def test_authentication_is_peer_not_trust(cluster: Cluster) -> None:
    with psycopg.connect(cluster.url("postgres")) as conn:
        rules = conn.execute(
            "SELECT type, database, auth_method FROM pg_hba_file_rules WHERE error IS NULL"
        ).fetchall()
    # Everything, and streaming replication (db replica), by peer over the private socket.
    assert rules == [("local", ["all"], "peer"), ("local", ["replication"], "peer")]


def test_even_with_the_socket_reachable_peer_auth_refuses_other_users(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Defence in depth: open the directory for a moment; peer auth still refuses nobody."""
    sock = Path(cluster.socket_dir)
    sock.chmod(0o755)
    try:
        proc = _as_nobody(cluster, "-c", "SELECT 1")
    finally:
        sock.chmod(0o700)
    assert proc.returncode != 0
    assert "Peer authentication failed" in proc.stderr


def test_a_shared_socket_directory_is_never_taken_over(cluster: Cluster, tmp_path: Path) -> None:
    """POIMEN_PG_SOCKET_DIR=/tmp (or any busy directory) must not be chowned and chmodded."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "someone-elses-file").write_text("x")
    other = Cluster(tmp_path / "data", shared, cluster.port + 1, cluster.bin_dir)
    with pytest.raises(ClusterError, match="not empty"):
        other.start(fast=True)
    assert stat.S_IMODE(shared.stat().st_mode) != 0o700 and shared.owner() == "root"
