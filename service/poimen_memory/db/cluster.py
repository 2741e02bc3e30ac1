"""The embedded PostgreSQL cluster: initdb/start/stop/status for a private data directory.

Used by the CLI when POIMEN_DATABASE_URL is unset, and by the tests for throwaway
clusters. As root, every server binary runs as the ``postgres`` user (initdb refuses
root), so the data directory must live outside /root.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from poimen_memory.errors import ClusterError

# Where scripts/setup.sh records the PostgreSQL major it prepared (POIMEN_SETUP_STATE).
DEFAULT_SETUP_STATE = Path("/var/cache/poimen-memory/setup")
INITDB_CACHE = Path("/var/cache/poimen-memory/initdb")
DB_NAME = "poimen"
# Server defaults of the embedded cluster. They live in a file that postgresql.conf
# includes, not on the command line: a command-line setting beats ALTER SYSTEM, and a DBA
# who raises shared_buffers for a million nodes must be able to.
DEFAULTS_FILE = "poimen.conf"
SERVER_DEFAULTS = {
    "shared_buffers": "256MB",
    "maintenance_work_mem": "512MB",
    # The server log holds the SQL of failed statements, node text included: PostgreSQL's
    # own collector writes it inside the data directory (0700), each file 0600, one file a
    # weekday truncated a week later, a new one past 100 MB; every line says who and where.
    "logging_collector": "on",
    "log_directory": "log",
    "log_filename": "postgresql-%a.log",
    "log_file_mode": "0600",
    "log_truncate_on_rotation": "on",
    "log_rotation_age": "1d",
    "log_rotation_size": "100MB",
    "log_line_prefix": "%m [%p] %q%u@%d ",
}


def find_pg_bin(explicit: Path | None = None, setup_state: Path = DEFAULT_SETUP_STATE) -> Path:
    """Pick the server that `make setup` prepared (it has plpython3u and pgvector)."""
    if explicit is not None:
        return explicit
    recorded = setup_state / "pg_major"
    if recorded.exists():
        major = recorded.read_text().strip()
        candidate = Path(f"/usr/lib/postgresql/{major}/bin")
        if (candidate / "postgres").exists():
            return candidate
    majors = sorted(
        (p for p in Path("/usr/lib/postgresql").glob("*") if (p / "bin/postgres").exists()),
        key=lambda p: int(p.name) if p.name.isdigit() else 0,
        reverse=True,
    )
    for m in majors:
        if Path(f"/usr/share/postgresql/{m.name}/extension/vector.control").exists():
            return m / "bin"
    raise ClusterError(
        "no PostgreSQL server with pgvector found",
        hint="run `make setup` (as root) or set POIMEN_PG_BIN_DIR / POIMEN_DATABASE_URL",
    )


def _as_postgres() -> list[str]:
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]


def _chown_postgres(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")


@dataclass(frozen=True)
class Cluster:
    data_dir: Path
    socket_dir: Path
    port: int
    bin_dir: Path
    # The HTTP service's login role (POIMEN_SERVICE_ROLE), made by `poimen-memory migrate`.
    service_role: str = "poimen_service"

    @property
    def log_file(self) -> Path:
        """What the server says while it starts, before its collector takes over."""
        return self.data_dir.parent / f"{self.data_dir.name}.log"

    @property
    def log_dir(self) -> Path:
        """The server's log (SERVER_DEFAULTS: log_directory), private to its OS user."""
        return self.data_dir / "log"

    def url(self, dbname: str = DB_NAME, user: str = "postgres") -> str:
        return f"postgresql://{user}@/{dbname}?host={self.socket_dir}&port={self.port}"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, LC_ALL="C.UTF-8", LANG="C.UTF-8")
        # Server-side PL/Python must not pick up the venv's interpreter settings.
        env.pop("PYTHONPATH", None)
        env.pop("PYTHONHOME", None)
        proc = subprocess.run(
            [*_as_postgres(), *args], env=env, capture_output=True, text=True, check=False
        )
        if check and proc.returncode != 0:
            raise ClusterError(
                f"{Path(args[0]).name} failed (exit {proc.returncode})",
                detail=(proc.stderr or proc.stdout).strip()[-2000:],
                hint=f"see {self.log_file} and {self.log_dir}",
            )
        return proc

    def initialized(self) -> bool:
        return (self.data_dir / "PG_VERSION").exists()

    def init(self) -> None:
        """initdb once per server version into a cache, then copy (about 10x faster)."""
        if self.initialized():
            return
        major = self.bin_dir.parent.name
        template = INITDB_CACHE / major
        if not (template / "PG_VERSION").exists():
            self._initdb_into(template)
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(template, self.data_dir, symlinks=True)
        if os.geteuid() == 0:
            subprocess.run(["chown", "-R", "postgres:postgres", str(self.data_dir)], check=True)
        self.data_dir.chmod(0o700)

    def _initdb_into(self, target: Path) -> None:
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for p in (tmp, tmp.parent, tmp.parent.parent):
            _chown_postgres(p)
        self._run(
            str(self.bin_dir / "initdb"),
            "-D",
            str(tmp),
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
            "--auth-local=trust",
            "--auth-host=trust",
        )
        try:
            tmp.rename(target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race

    def _write_defaults(self) -> None:
        """Write poimen.conf and include it from postgresql.conf once. postgresql.auto.conf
        (ALTER SYSTEM) is read after both, so a DBA's setting wins."""
        path = self.data_dir / DEFAULTS_FILE
        path.write_text(
            "# Written by poimen-memory at every start (db/cluster.py); override with ALTER"
            " SYSTEM.\n" + "".join(f"{k} = '{v}'\n" for k, v in SERVER_DEFAULTS.items())
        )
        _chown_postgres(path)
        conf = self.data_dir / "postgresql.conf"
        line = f"include_if_exists '{DEFAULTS_FILE}'"
        text = conf.read_text()
        if line not in text.splitlines():
            conf.write_text(text.rstrip("\n") + f"\n# poimen-memory server defaults\n{line}\n")

    def _lock_down(self) -> None:
        """Only the server's own OS user (and root, mapped to it) may connect: peer
        authentication over a socket in a directory no one else can enter. Written before
        every start, so clusters made by older versions (trust, 0777 socket) are fixed."""
        me = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        (self.data_dir / "pg_hba.conf").write_text(
            "# Written by poimen-memory (db/cluster.py): local peer authentication only.\n"
            "local all all peer map=poimen\n"
            "# A streaming standby (poimen-memory db replica) connects as the same OS user.\n"
            "local replication all peer map=poimen\n"
        )
        users = ["postgres", "root"] if os.geteuid() == 0 else [me]
        # The same OS users may also log in as the service's role (non-superuser, subject to
        # row-level security): `serve` connects as that one, `migrate` as postgres.
        (self.data_dir / "pg_ident.conf").write_text(
            "# OS user -> database role; nobody else may connect.\n"
            + "".join(f"poimen {u} {r}\n" for u in users for r in ("postgres", self.service_role))
        )
        for name in ("pg_hba.conf", "pg_ident.conf"):
            (self.data_dir / name).chmod(0o600)
            _chown_postgres(self.data_dir / name)
        owner = "postgres" if os.geteuid() == 0 else me
        if self.socket_dir.exists() and self.socket_dir.owner() not in (owner, "root"):
            # A directory someone else owns (a shared /tmp, the system's own socket
            # directory) is never taken over: chowning it would lock its users out.
            raise ClusterError(
                f"socket directory {self.socket_dir} belongs to {self.socket_dir.owner()}",
                hint="point POIMEN_PG_SOCKET_DIR at a directory of its own (it is made 0700)",
            )
        if (
            self.socket_dir.exists()
            and self.socket_dir.owner() == "root"
            and any(self.socket_dir.iterdir())
        ):
            raise ClusterError(
                f"socket directory {self.socket_dir} is not empty and not the server's own",
                hint="point POIMEN_PG_SOCKET_DIR at a new or empty directory",
            )
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        _chown_postgres(self.socket_dir)
        self.socket_dir.chmod(0o700)

    def make_standby_of(self, primary: Cluster) -> None:
        """Make this (uninitialized) cluster a streaming standby of ``primary``, the way a
        DBA would: ``pg_basebackup -R`` copies the running primary with the WAL it needs and
        writes ``standby.signal`` and ``primary_conninfo`` (the primary's socket, same OS
        user, peer authentication). No replication slot: a standby left stopped longer than
        the primary keeps WAL must be made again (docs/scaling.md)."""
        if self.initialized():
            return
        if not primary.running():
            raise ClusterError(
                "the primary is not running", hint="poimen-memory db start (or start it first)"
            )
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.data_dir.mkdir(parents=True)
        _chown_postgres(self.data_dir)
        self.data_dir.chmod(0o700)
        try:
            self._run(
                str(self.bin_dir / "pg_basebackup"),
                "-D",
                str(self.data_dir),
                "-h",
                str(primary.socket_dir),
                "-p",
                str(primary.port),
                "-U",
                "postgres",
                "-X",
                "stream",
                "-c",
                "fast",
                "-R",
            )
        except ClusterError:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            raise

    def is_standby(self) -> bool:
        return (self.data_dir / "standby.signal").exists()

    def running(self) -> bool:
        proc = self._run(
            str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "status", check=False
        )
        return proc.returncode == 0

    def start(self, *, fast: bool = False) -> None:
        """Start if not running. ``fast`` trades durability for speed (tests only)."""
        self.init()
        if self.running():
            return
        self._lock_down()
        self._write_defaults()
        opts = [
            f"-p {self.port}",
            f"-k {self.socket_dir}",
            "-c listen_addresses=''",
            "-c max_connections=100",
        ]
        if fast:
            opts += ["-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off"]
        self.log_file.touch()
        self.log_file.chmod(0o600)  # it was 0644 in a 0755 POIMEN_HOME: anyone read it
        _chown_postgres(self.log_file)
        self._run(
            str(self.bin_dir / "pg_ctl"),
            "-D",
            str(self.data_dir),
            "-l",
            str(self.log_file),
            "-o",
            " ".join(opts),
            "-w",
            "-t",
            "60",
            "start",
        )
        if not self.is_standby():  # a standby is read-only and has the primary's databases
            self._ensure_database()

    def _ensure_database(self) -> None:
        psql = str(self.bin_dir / "psql")
        base = [
            psql,
            "-X",
            "-q",
            "-h",
            str(self.socket_dir),
            "-p",
            str(self.port),
            "-U",
            "postgres",
        ]
        exists = self._run(
            *base,
            "-d",
            "postgres",
            "-tAc",
            f"SELECT 1 FROM pg_database WHERE datname = '{DB_NAME}'",
        )
        if exists.stdout.strip() != "1":
            self._run(*base, "-d", "postgres", "-c", f"CREATE DATABASE {DB_NAME}")

    def stop(self) -> None:
        if self.initialized() and self.running():
            self._run(
                str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", "fast", "-w", "stop"
            )

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.log_file.unlink(missing_ok=True)

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.running():
                return
            time.sleep(0.05)
        raise ClusterError(
            "cluster did not become ready", hint=f"see {self.log_file} and {self.log_dir}"
        )
