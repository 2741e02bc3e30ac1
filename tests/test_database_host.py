"""A database on another host (issue 44): its server runs in a mount namespace of its own in
which the checkout, the venv and the migrating process's POIMEN_HOME are empty directories,
so no file the migrating process sees exists for the server. `migrate` from this process
must leave it complete: doctor reports plpython, the module and (once its packages are
installed on the database host, the documented way) the embedder on, the optimizer routes,
memory.embed works; a stale path of the client is cleared by migrate and by --no-plpython;
--check answers the same whatever POIMEN_HOME the caller has."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import free_port
from poimen_memory.db.cluster import Cluster, find_pg_bin
from poimen_memory.db.connect import connect
from poimen_memory.embedders.local import LocalEmbedder

CLI = [sys.executable, "-m", "poimen_memory.cli.main"]

# The checkout these tests run from (the package may be installed elsewhere).
ROOT = Path(__file__).resolve().parents[1]


def _hidden_cluster(base: Path, hidden: list[Path]) -> Cluster:
    """A cluster whose postmaster runs in its own mount namespace, an empty directory bound
    over each of `hidden`: it outlives the `unshare` that made the namespace."""
    c = Cluster(base / "data", base / "run", free_port(), find_pg_bin())
    c.start(fast=True)  # initdb, the defaults and the database, as the fixtures' cluster
    c.stop()
    empty = base / "empty"
    empty.mkdir()
    mounts = " && ".join(f"mount --bind {empty} {p}" for p in hidden)
    opts = f"-p {c.port} -k {c.socket_dir} -c listen_addresses='' -c fsync=off"
    start = (
        f"{mounts} && exec setpriv --reuid=postgres --regid=postgres --init-groups"
        f' {c.bin_dir / "pg_ctl"} -D {c.data_dir} -l {c.log_file} -o "{opts}" -w -t 60 start'
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    run = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", start],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return c


@pytest.fixture
def remote(work_dir: Path) -> Iterator[tuple[Cluster, Path]]:
    if os.geteuid() != 0:
        pytest.skip("needs root: mount namespaces, and the server runs as postgres")
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        pytest.skip("needs unshare and setpriv (util-linux)")
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.decode().strip()}")
    base = work_dir / f"remote-{uuid.uuid4().hex[:8]}"
    base.mkdir()
    base.chmod(0o755)
    home = base / "client-home"  # the migrating process's POIMEN_HOME: not on the server
    home.mkdir()
    wanted = [ROOT, Path(sys.prefix).resolve(), home]
    # A path inside another hidden one (CI's venv is inside its checkout) is hidden with it,
    # and cannot be mounted over once its parent is empty.
    hidden = [p for p in wanted if not any(q != p and p.is_relative_to(q) for q in wanted)]
    c = _hidden_cluster(base, hidden)
    try:
        yield c, home
    finally:
        c.stop()
        shutil.rmtree(base, ignore_errors=True)


def _cli(env: dict[str, str], *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    run = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, check=False)
    if ok:
        assert run.returncode == 0, run.stdout + run.stderr
    return run


def _doctor(env: dict[str, str]) -> dict[str, dict[str, str]]:
    out = _cli(env, "doctor", "--json", ok=False)
    return {c["name"]: c for c in json.loads(out.stdout)["capabilities"]}


def test_migrate_from_a_host_the_server_cannot_see(
    remote: tuple[Cluster, Path], work_dir: Path, embedder: LocalEmbedder
) -> None:
    c, home = remote
    url = c.url()
    env = {**os.environ, "POIMEN_DATABASE_URL": url, "POIMEN_HOME": str(home)}
    with connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        conn.execute("CREATE EXTENSION IF NOT EXISTS plpython3u")
        conn.execute(
            "CREATE FUNCTION pg_temp.sees(p text) RETURNS bool LANGUAGE plpython3u AS"
            " $$ import os; return os.path.isdir(p) and len(os.listdir(p)) > 0 $$"
        )
        # The server's world: the checkout, the venv and the client's home are empty there.
        for p in (ROOT, Path(sys.prefix).resolve()):
            assert conn.execute("SELECT pg_temp.sees(%s)", (str(p),)).fetchone() == (False,)

    # The bug this mends: a path of the client recorded for the server (here asked for).
    _cli(env, "migrate", "--plpython-dir", str(home / "plpython"))
    caps = _doctor(env)
    assert caps["plpython_module"]["status"] == "off"
    assert "No module named 'poimen_core'" in caps["plpython_module"]["detail"]
    # doctor's advice, run migrate, mends it: the module comes from the database.
    _cli(env, "migrate")
    caps = _doctor(env)
    assert caps["plpython3u"]["status"] == "on", caps
    assert caps["plpython_module"]["status"] == "on", caps
    assert caps["plpython_module"]["detail"].startswith("imported from memory._plpython_modules")
    # The embedder's packages are not on the server: doctor names what is missing there,
    # where the server's Python looked, and what to do on that host.
    emb = caps["embedder"]
    assert emb["status"] == "off"
    assert "cannot be imported on the database host (No module named '" in emb["detail"]
    # Where: the client's packages, which that first migrate recorded (migrate keeps the
    # embedder's packages the database records until told others).
    made = Path(sys.prefix) / "server-python"
    assert f"looked in {made}/3." in emb["detail"], emb["detail"]
    assert "then run `poimen-memory migrate --embedder-packages DIR`" in emb["detail"]

    # --no-plpython clears a stale path too.
    with connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO memory.config (key, value) VALUES ('plpython_path', %s)",
            (str(home / "plpython" / "0123456789abcdef"),),
        )
    assert "plpython_path" in _cli(env, "migrate", "--check", ok=False).stdout
    _cli(env, "migrate", "--no-plpython")
    assert _doctor(env)["plpython_module"]["status"] == "on"

    # The documented install on the database host: the packages `make setup` fills, copied
    # to a directory the server reads, named to migrate.
    if not any(made.glob("*/.poimen-deps")):
        pytest.skip("`make setup` did not install the embedder's packages for the server")
    packages = work_dir / f"db-host-packages-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(made, packages, symlinks=True)
        packages.chmod(0o755)
        _cli(env, "migrate", "--embedder-packages", str(packages))
        caps = _doctor(env)
        assert caps["embedder"]["status"] == "on", caps["embedder"]
        assert str(packages) in caps["embedder"]["detail"]
        with connect(url, autocommit=True) as conn:
            plan = conn.execute(
                "SELECT memory.optimize_query('deployment failures in 2024') ->> 'search_strategy'"
            ).fetchone()
            assert plan == ("LexicalFirst",)
            got = conn.execute("SELECT memory.embed('kong gateway timeouts')::text").fetchone()
            assert got is not None
            vec = np.array(json.loads(got[0]), dtype=np.float32)
            want = np.asarray(embedder.embed_query("kong gateway timeouts"), dtype=np.float32)
            assert vec.shape == (384,) and float(vec @ want) > 0.9999
        # --check answers the same from any POIMEN_HOME, given the same arguments.
        answers = set()
        for h in (home, work_dir / "another-home-never-made"):
            e = {**env, "POIMEN_HOME": str(h)}
            run = _cli(e, "migrate", "--check", "--embedder-packages", str(packages), ok=False)
            assert run.returncode == 0 and "no drift" in run.stdout, run.stdout + run.stderr
            answers.add(run.stdout)
        assert len(answers) == 1
        # Without the argument, migrate keeps the packages the database records (the
        # database host's, not this one's): the same answer.
        run = _cli(env, "migrate", "--check", ok=False)
        assert run.returncode == 0 and run.stdout in answers, run.stdout
        _cli(env, "migrate")
        assert _doctor(env)["embedder"]["status"] == "on"
    finally:
        shutil.rmtree(packages, ignore_errors=True)
