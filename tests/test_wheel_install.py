"""The product installed as its users install it: the wheel, built from the checkout, in a
fresh venv that cannot see the checkout, run by a non-root OS user against a PostgreSQL
with pgvector that is already running (README.md, "With your own PostgreSQL").

One test walks the whole path, as each step needs the one before: build the sdist and
the wheel (python -m build: the wheel is built from the sdist, so the sdist is complete),
`twine check --strict`, what the wheel holds (the SQL, poimen_core; not the lab), install
it into a new venv (its dependencies from the package indexes, pinned by
requirements.lock), then as the other user `migrate`, `doctor`, `ingest`, `serve` on
127.0.0.1 and one query over HTTP."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conftest import FIXTURE, free_port
from poimen_memory.db.cluster import Cluster, find_pg_bin

CHECKOUT = Path(__file__).resolve().parents[1]
USER = "poimen-wheel"  # made with useradd when the suite runs as root (CI does)
ADMIN, SERVICE, DB = "wheel_admin", "wheel_service", "wheeldb"
# The interpreter the venv is made from: one any OS user can run (Debian's, which
# scripts/setup.sh installs), not necessarily the suite's own (it may live under /root).
PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")


def _run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)


def _os_user() -> tuple[str, list[str]]:
    """The non-root OS user the product runs as, and the command prefix that runs as it."""
    if os.geteuid() != 0:
        return pwd.getpwuid(os.geteuid()).pw_name, []
    try:
        pwd.getpwnam(USER)
    except KeyError:
        made = _run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                     USER])  # fmt: skip
        if made.returncode not in (0, 9):  # 9: made meanwhile by another worker
            pytest.skip(f"cannot create the OS user {USER}: {made.stderr.strip()}")
    entry = pwd.getpwnam(USER)
    return USER, ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}",
                  "--clear-groups"]  # fmt: skip


def _python(as_user: list[str]) -> str:
    """A Python >= 3.11 with venv that the OS user can run."""
    probe = "import sys, venv; assert sys.version_info >= (3, 11)"
    for candidate in PYTHONS:
        if Path(candidate).exists() and _run([*as_user, candidate, "-c", probe]).returncode == 0:
            return candidate
    pytest.skip(f"no Python >= 3.11 with venv that {as_user or 'this user'} can run: {PYTHONS}")


@pytest.fixture(scope="module")
def database(work_dir: Path) -> Iterator[tuple[Cluster, str]]:
    """A running cluster of its own (its roles are cluster-wide): an administrator role and
    a database it owns, pgvector available, reached over the socket by peer authentication
    as the OS user the product runs as."""
    user, _ = _os_user()
    base = work_dir / "wheel"  # the server's OS user must reach it
    c = Cluster(base / "data", base / "run", free_port(), find_pg_bin())
    c.start(fast=True)
    with psycopg.connect(c.url("postgres"), autocommit=True) as su:
        su.execute(f"CREATE ROLE {ADMIN} LOGIN SUPERUSER")
        su.execute(f"CREATE DATABASE {DB} OWNER {ADMIN}")
    ident = c.data_dir / "pg_ident.conf"
    ident.write_text(ident.read_text() + f"poimen {user} {ADMIN}\npoimen {user} {SERVICE}\n")
    c.socket_dir.chmod(0o755)  # the server's own (0700); the socket file is 0777
    with psycopg.connect(c.url("postgres"), autocommit=True) as su:
        su.execute("SELECT pg_reload_conf()")
    yield c, c.url(DB, user=ADMIN)
    c.destroy()


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_the_wheel_installs_migrates_serves_and_answers(
    database: tuple[Cluster, str], work_dir: Path
) -> None:
    cluster, admin_url = database
    user, as_user = _os_user()
    python = _python(as_user)
    scratch = Path(tempfile.mkdtemp(prefix="poimen-wheel-", dir=work_dir))
    scratch.chmod(0o755)
    try:
        # --- build, from a copy of what git tracks (the build writes egg-info beside it)
        src = scratch / "src"
        listed = _run(["git", "-C", str(CHECKOUT), "ls-files", "-z"])
        if listed.returncode != 0:
            pytest.skip(f"builds from what git tracks; not a git checkout: {listed.stderr}")
        tracked = listed.stdout.split("\0")
        for rel in filter(None, tracked):
            if rel.split("/")[0] in ("pyproject.toml", "README.md", "service", "plpython"):
                (src / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(CHECKOUT / rel, src / rel)
        dist = scratch / "dist"
        built = _run([sys.executable, "-m", "build", "--outdir", str(dist), str(src)])
        assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
        wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
        assert len(wheels) == 1 and len(sdists) == 1, sorted(dist.iterdir())
        checked = _run(
            [sys.executable, "-m", "twine", "check", "--strict", *map(str, [*wheels, *sdists])]
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr

        # --- what the wheel holds: the database, the PL/Python module; not the lab
        names = set(zipfile.ZipFile(wheels[0]).namelist())
        ours = {p.relative_to(CHECKOUT / "service").as_posix()
                for d in ("sql", "migrations")
                for p in (CHECKOUT / "service" / "poimen_memory" / d).glob("*.sql")}  # fmt: skip
        assert ours and ours <= names, sorted(ours - names)
        assert "poimen_core/optimizer.py" in names and "poimen_memory/data/tokenizer.json" in names
        assert not [n for n in names if n.startswith("poimen_lab")]

        # --- a fresh venv outside the checkout, the wheel alone copied beside it
        inst = scratch / "install"
        inst.mkdir()
        wheel = inst / wheels[0].name
        shutil.copy2(wheels[0], wheel)
        venv = inst / "venv"
        made = _run([python, "-m", "venv", "--without-pip", str(venv)])
        assert made.returncode == 0, made.stderr
        env = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
        env |= {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(inst), "LANG": "C.UTF-8"}
        # This venv's pip installs into the new one (--python): no pip inside it to bootstrap.
        lock = str(CHECKOUT / "requirements.lock")
        pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
               "-q", "--no-compile", "-c", lock, str(wheel)]  # fmt: skip
        installed = _run(pip, env=env, cwd=inst)
        assert installed.returncode == 0, installed.stderr[-3000:]
        for p in inst.rglob("*"):
            p.chmod(p.stat().st_mode | 0o055)  # readable by the OS user; root keeps ownership

        # --- as the OS user, from a directory of its own, PYTHONPATH unset
        home = scratch / "home"
        home.mkdir()
        shutil.copy2(FIXTURE, home / FIXTURE.name)
        if as_user:
            shutil.chown(home, user)
            shutil.chown(home / FIXTURE.name, user)
        home.chmod(0o755)  # the server reaches the PL/Python module migrate puts under it
        user_env = {
            "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
            "HOME": str(home),
            "LANG": "C.UTF-8",
            "POIMEN_HOME": str(home / "poimen"),
            "POIMEN_DATABASE_URL": admin_url,
        }
        bin_ = venv / "bin"

        def run(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
            return _run([*as_user, *args], env=user_env, cwd=home, **kw)

        where = run(str(bin_ / "python"), "-c",
                    "import poimen_memory, poimen_core, importlib.util as u;"
                    " print(poimen_memory.__file__, poimen_core.__file__,"
                    " u.find_spec('poimen_lab'))")  # fmt: skip
        assert where.returncode == 0, where.stderr
        assert where.stdout.count(str(venv)) == 2 and where.stdout.strip().endswith("None")
        assert str(CHECKOUT) not in where.stdout

        migrated = run(str(bin_ / "poimen-memory"), "migrate")
        assert migrated.returncode == 0, migrated.stdout + migrated.stderr
        assert "migrations applied: ['0001_initial'" in migrated.stdout
        drift = run(str(bin_ / "poimen-memory"), "migrate", "--check")
        assert drift.returncode == 0 and "no drift" in drift.stdout, drift.stdout + drift.stderr
        doctor = run(str(bin_ / "poimen-memory"), "doctor", "--json")
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        report = json.loads(doctor.stdout)
        status = {c["name"]: c["status"] for c in report["capabilities"]}
        assert report["ok"] and status["schema"] == "on" and status["plpython_module"] == "on"
        ingested = run(str(bin_ / "poimen-memory"), "ingest", FIXTURE.name, "--quiet")
        assert ingested.returncode == 0, ingested.stdout + ingested.stderr

        # The service's own login role, as a DBA makes it (docs/security.md): under RLS.
        with psycopg.connect(cluster.url("postgres"), autocommit=True) as su:
            su.execute(f"CREATE ROLE {SERVICE} LOGIN")
            su.execute(f"GRANT {DB}_memory_service TO {SERVICE}")
        port = free_port()
        user_env["POIMEN_SERVICE_DATABASE_URL"] = cluster.url(DB, user=SERVICE)
        server = subprocess.Popen(
            [*as_user, str(bin_ / "poimen-memory"), "serve", "--host", "127.0.0.1",
             "--port", str(port), "--log-level", "warning"],
            env=user_env, cwd=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                assert server.poll() is None, server.communicate()
                try:
                    if _get(f"{base}/healthz")[0] == 200:
                        break
                except (urllib.error.URLError, ConnectionError):
                    pass
                assert time.monotonic() < deadline, "serve did not answer /healthz in 60 s"
                time.sleep(0.2)
            code, body = _get(
                f"{base}/memory/query?query=why+did+requests+over+10KB+fail&project=poimen&limit=2"
            )
            assert code == 200, body
            assert body["results"] and body["results"][0]["project"] == "poimen"
            assert body["results"][0]["parents"]  # with its provenance
            assert body["results"][0]["query_score"] is not None  # the service embedded it
        finally:
            server.send_signal(signal.SIGTERM)
            _, err = server.communicate(timeout=60)
        assert server.returncode == 0, err[-3000:]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
