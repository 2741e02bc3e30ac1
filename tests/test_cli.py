"""The CLI end to end: its own embedded cluster, migrate, ingest twice, query, db lifecycle."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from conftest import FIXTURE, free_port
from poimen_memory.cli.main import main
from poimen_memory.db.connect import embedded_cluster, embedded_replica
from poimen_memory.errors import ClusterError
from poimen_memory.settings import Settings

CLI = [sys.executable, "-m", "poimen_memory.cli.main"]


@pytest.fixture(scope="module")
def cli_env() -> Iterator[dict[str, str]]:
    home = Path(tempfile.mkdtemp(prefix="poimen-cli-"))
    home.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    env.update(
        POIMEN_HOME=str(home),
        POIMEN_PG_PORT=str(free_port()),
        POIMEN_REPLICA_PG_PORT=str(free_port()),
    )
    yield env
    # What `db replica stop` and `db stop` run, in this process (no interpreter start-up).
    settings = Settings.from_env(env)
    for cluster in (embedded_replica(settings), embedded_cluster(settings)):
        with contextlib.suppress(ClusterError):
            cluster.stop()
    subprocess.run(["rm", "-rf", str(home)], check=False)


def run(env: dict[str, str], *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=300)
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def run_here(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: dict[str, str],
    *args: str,
) -> subprocess.CompletedProcess[str]:
    """The same command line through the CLI's own main() in this process, with the same
    POIMEN_* environment: its exit code, stdout and stderr, without the ~1 s of a new
    interpreter importing the stack (for checks repeated per parameter)."""
    for key in [k for k in os.environ if k.startswith("POIMEN_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith("POIMEN_"):
            monkeypatch.setenv(key, value)
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def _loaded(env: dict[str, str]) -> bool:
    """The CLI's cluster is running and holds the fixture (so migrate and ingest ran)."""
    url = embedded_cluster(Settings.from_env(env)).url()
    try:
        with psycopg.connect(url, connect_timeout=10) as conn:
            return conn.execute("SELECT count(*) FROM memory.nodes").fetchone() == (21,)
    except psycopg.Error:
        return False


def _psql_on(url: str) -> Callable[[str], str]:
    """psql -XtAc on url: one statement's unaligned output."""

    def psql(sql: str) -> str:
        out = subprocess.run(
            ["psql", url, "-XtAc", sql], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()

    return psql


def ready(env: dict[str, str]) -> None:
    """The cluster running, migrated and loaded, whatever ran before: each test that needs
    data says so, so any one of them can run alone (start, migrate, ingest are idempotent).
    Already so (an earlier test did it), nothing is run again: the three commands cost a
    new interpreter each, and their repeated runs are tested where they are the subject
    (ingest twice above, migrate twice in tests/test_migrations.py)."""
    if _loaded(env):
        return
    run(env, "db", "start")
    run(env, "migrate")
    run(env, "ingest", str(FIXTURE))
    assert _loaded(env)


def test_db_lifecycle_and_sql_user(cli_env: dict[str, str]) -> None:
    assert run(cli_env, "db", "status", ok=False).returncode == 3
    run(cli_env, "db", "start")
    assert run(cli_env, "db", "status").stdout.startswith("running")
    url = run(cli_env, "db", "url").stdout.strip()
    assert cli_env["POIMEN_HOME"] in url and cli_env["POIMEN_PG_PORT"] in url
    run(cli_env, "migrate")
    first = run(cli_env, "ingest", str(FIXTURE), "--json")
    report = json.loads(first.stdout.strip().splitlines()[-1])
    assert report["inserted"] == 21 and report["edges"] == 17
    second = json.loads(run(cli_env, "ingest", str(FIXTURE), "--json").stdout.splitlines()[-1])
    assert (second["inserted"], second["duplicates"], second["edges"]) == (0, 21, 0)
    # A SQL user with the default search_path, through psql, sees an HNSW scan.
    psql = subprocess.run(
        ["psql", url, "-XtAc",
         "SET enable_seqscan = off; EXPLAIN SELECT id FROM memory.nodes "
         "ORDER BY embedding <=> (SELECT embedding FROM memory.nodes LIMIT 1) LIMIT 5"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "nodes_embedding_hnsw" in psql.stdout
    rows = subprocess.run(
        ["psql", url, "-XtAc", "SELECT level FROM memory_query('kong body buffer')"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert rows and set(rows) <= {"L1", "L2"}


def test_query_prints_citations(cli_env: dict[str, str]) -> None:
    ready(cli_env)
    out = run(cli_env, "query", "why did requests over 10KB fail", "--project", "poimen").stdout
    assert "[L1] poimen poimen:mem:1" in out and "└─ [L0] poimen:chat:2" in out
    js = json.loads(run(cli_env, "query", "kong body buffer", "--json").stdout)
    assert js["results"] and js["metrics"]["total_time_ms"] > 0


def test_doctor_reports_on_the_embedded_cluster(cli_env: dict[str, str]) -> None:
    """`poimen-memory doctor` without POIMEN_DATABASE_URL: the CLI's own cluster, as every
    command; migrated by it, so PL/Python imports from POIMEN_HOME and memory.embed works."""
    ready(cli_env)
    body = json.loads(run(cli_env, "doctor", "--json").stdout)
    caps = {c["name"]: c for c in body["capabilities"]}
    assert body["ok"] and caps["embedder"]["status"] == "on"
    plpython = Path(cli_env["POIMEN_HOME"]) / "plpython"
    assert caps["plpython_module"]["detail"].startswith(f"imported from the directory {plpython}/")


def test_a_product_command_loads_no_other_packages_commands() -> None:
    """A command of the product's own parses without importing the lab's commands (their
    modules import numpy, httpx and the retrieval stack); any other command line, `--help`
    and the lab's commands, loads them."""
    probe = (
        "import sys\n"
        "from poimen_memory.cli.main import build_parser\n"
        "line = sys.argv[1:]\n"
        "names = build_parser(line)._subparsers._group_actions[0].choices\n"
        "print('bench-peers' in names, any(m.startswith('poimen_lab') for m in sys.modules))\n"
    )
    for line, expected in (
        (["keys", "list"], "False False"),
        (["migrate", "--check"], "False False"),
        (["--help"], "True True"),
        (["bench-peers", "--queries", "3"], "True True"),
        ([], "True True"),
    ):
        out = subprocess.run(
            [sys.executable, "-c", probe, *line], capture_output=True, text=True, check=True
        ).stdout
        assert out.split("\n")[0] == expected, (line, out)


def test_errors_are_clear(cli_env: dict[str, str]) -> None:
    ready(cli_env)
    missing = run(cli_env, "ingest", "/nonexistent.jsonl", ok=False)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    bad = Path(cli_env["POIMEN_HOME"]) / "bad.jsonl"
    bad.write_text('{"level": "L0", "project": "p"}\n')
    proc = run(cli_env, "ingest", str(bad), ok=False)
    assert proc.returncode == 1 and "line 1: field 'text'" in proc.stderr
    # All or nothing per file: a 3,000-character id on line 201 once let 192 nodes commit.
    lines = [json.dumps({"id": f"b{i}", "level": "L0", "project": "bounds", "text": f"turn {i}"})
             for i in range(200)]  # fmt: skip
    bad.write_text(
        "\n".join(
            [
                *lines,
                json.dumps({"id": "b" * 3000, "level": "L0", "project": "bounds", "text": "t"}),
            ]
        )
        + "\n"
    )
    proc = run(cli_env, "ingest", str(bad), ok=False)
    assert proc.returncode == 1 and "line 201: field 'id'" in proc.stderr
    url = run(cli_env, "db", "url").stdout.strip()
    count = subprocess.run(
        ["psql", url, "-XtAc", "SELECT count(*) FROM memory.projects WHERE name = 'bounds'"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert count.stdout.strip() == "0"
    unknown = run(cli_env, "query", "kong", "--project", "nope", ok=False)
    assert unknown.returncode == 1 and "unknown project" in unknown.stderr


def test_ingest_is_all_or_nothing_and_says_so(cli_env: dict[str, str]) -> None:
    """201 lines with a stale revision on line 193: the database is as it was, and the
    message says nothing was written (per-batch commits once wrote 192 lines, then said
    "Nothing was written."). --report names each node written."""
    ready(cli_env)
    psql = _psql_on(run(cli_env, "db", "url").stdout.strip())
    home = Path(cli_env["POIMEN_HOME"])
    first = home / "first.jsonl"
    first.write_text(
        json.dumps({"id": "s193", "level": "L0", "project": "all193", "text": "v1"}) + "\n"
        + json.dumps({"level": "L0", "project": "all193", "text": "a note without an id"})
        + "\n"
    )  # fmt: skip
    report = home / "report.jsonl"
    run(cli_env, "ingest", str(first), "--report", str(report))
    written = [json.loads(line) for line in report.read_text().splitlines()]
    assert [(w["id"], w["revision"], w["status"]) for w in written][:1] == [("s193", 1, "created")]
    assert written[1]["id"].startswith("n:") and written[1]["status"] == "created"
    lines = [json.dumps({"id": f"a{i}", "level": "L0", "project": "all193", "text": f"turn {i}"})
             for i in range(200)]  # fmt: skip
    lines.insert(192, json.dumps({"id": "s193", "level": "L0", "project": "all193",
                                  "text": "v2", "revision": 2}))  # fmt: skip
    bad = home / "stale.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    count = "SELECT count(*) FROM memory.nodes"
    before = psql(count)
    try:
        for extra in ((), ("--commit-every-batch",)):
            proc = run(cli_env, "ingest", str(bad), "--batch", "16", *extra, ok=False)
            assert proc.returncode != 0
            assert "nothing was written" in proc.stderr
            assert "line 193: node s193 of project all193 is at revision 1, not 2" in proc.stderr
            assert psql(count) == before
    finally:
        # The module's other tests find the cluster holding the fixture and nothing else
        # (ready(): 21 nodes): the project goes, its nodes and edges with it.
        psql("DELETE FROM memory.projects WHERE name = 'all193'")


def test_ingest_of_bytes_that_are_not_utf8_or_of_a_directory_names_the_fault(
    cli_env: dict[str, str],
) -> None:
    """A byte that is not UTF-8 was a UnicodeDecodeError traceback for the whole file, even
    with --skip-invalid; a directory, IsADirectoryError (a helper's attack). Now the line is
    invalid by the node rules (skipped with --skip-invalid), and a directory exits 2."""
    ready(cli_env)
    psql = _psql_on(run(cli_env, "db", "url").stdout.strip())
    home = Path(cli_env["POIMEN_HOME"])
    mixed = home / "mixed.jsonl"
    good = json.dumps({"id": "u8:1", "level": "L0", "project": "utf8", "text": "fine"})
    mixed.write_bytes(good.encode() + b'\n{"id": "u8:2", "level": "L0", "project": "utf8",'
                      b' "text": "bad \xff byte"}\n')  # fmt: skip
    refused = run(cli_env, "ingest", str(mixed), ok=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "line 2: field '<json>': contains an unpaired surrogate" in refused.stderr
    assert "nothing was written" in refused.stderr
    skipped = run(cli_env, "ingest", str(mixed), "--skip-invalid")
    assert "inserted 1 " in skipped.stdout and "invalid lines 1" in skipped.stdout
    folder = run(cli_env, "ingest", str(home), ok=False)
    assert folder.returncode == 2 and "is a directory" in folder.stderr, folder.stderr
    psql("DELETE FROM memory.projects WHERE name = 'utf8'")  # ready()'s 21 nodes again


def test_reembed_rebuilds_every_vector(cli_env: dict[str, str]) -> None:
    ready(cli_env)
    psql = _psql_on(run(cli_env, "db", "url").stdout.strip())

    before = psql("SELECT embedding::text FROM memory.nodes WHERE external_id = 'poimen:mem:1'")
    out = run(cli_env, "reembed").stdout
    assert "re-embedded 21 nodes" in out
    assert psql("SELECT count(*) FROM memory.nodes WHERE embedding IS NULL") == "0"
    assert psql("SELECT count(*) FROM pg_indexes WHERE indexname = 'nodes_embedding_hnsw'") == "1"
    after = psql("SELECT embedding::text FROM memory.nodes WHERE external_id = 'poimen:mem:1'")
    assert after == before  # same model: the same vectors come back


def test_migrate_and_reembed_build_a_project_graph_after_commit(cli_env: dict[str, str]) -> None:
    """A project past tiny thresholds ('atlas', 6 of 21 nodes): migrate --check names its
    graphs and builds none; migrate builds them after its transaction and says so (a line
    per graph with its time, and its progress on stderr); reembed drops them with the
    column and builds them again once the vectors are back."""
    ready(cli_env)
    psql = _psql_on(run(cli_env, "db", "url").stdout.strip())

    pid = psql("SELECT id FROM memory.projects WHERE name = 'atlas'")
    names = [f"nodes_embedding_hnsw_p{pid}", f"nodes_embedding_hnsw_l1_l2_p{pid}"]
    valid = (
        "SELECT string_agg(c.relname || ':' || i.indisvalid, ',' ORDER BY c.relname DESC)"
        " FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
        f" WHERE c.relname IN ('{names[0]}', '{names[1]}')"
    )
    psql("SELECT memory.set_policy('exact_scan_max_nodes', '1')")
    psql("SELECT memory.set_policy('project_graph_min_nodes', '1')")
    try:
        checked = run(cli_env, "migrate", "--check", ok=False).stdout
        assert f"project graph to build: memory.{names[0]} (project {pid}): missing" in checked
        assert psql(valid) == ""
        migrated = run(cli_env, "migrate", "--build-lock-timeout", "60")
        for name in names:
            assert f"project graph built: memory.{name} (project {pid}, was missing) in " in (
                migrated.stdout
            )
            assert f"notice: building memory.{name} (project {pid}, missing)" in migrated.stderr
        assert psql(valid) == f"{names[0]}:true,{names[1]}:true"
        assert "project graph built" not in run(cli_env, "migrate").stdout
        reembedded = run(cli_env, "reembed").stdout
        assert f"project graph built: memory.{names[1]} (project {pid}, was missing)" in (
            reembedded
        )
        assert psql(valid) == f"{names[0]}:true,{names[1]}:true"
    finally:
        psql("SELECT memory.reset_policy('exact_scan_max_nodes')")
        psql("SELECT memory.reset_policy('project_graph_min_nodes')")
        run(cli_env, "migrate")
    assert psql(valid) == ""


def test_db_replica_lifecycle(cli_env: dict[str, str]) -> None:
    """A streaming standby made with pg_basebackup: read-only, has the primary's data, and
    receives new writes."""
    ready(cli_env)
    assert run(cli_env, "db", "replica", "status", ok=False).returncode == 3
    started = run(cli_env, "db", "replica", "start")
    assert started.stdout.startswith("streaming standby running")
    read_url = run(cli_env, "db", "replica", "url").stdout.strip()
    assert cli_env["POIMEN_REPLICA_PG_PORT"] in read_url and "/replica/run" in read_url
    primary = run(cli_env, "db", "url").stdout.strip()

    def psql(target: str, sql: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["psql", target, "-XtAc", sql], capture_output=True, text=True, check=check
        )

    # The URL for POIMEN_READ_URLS is the service's role, subject to row-level security:
    # it sees nothing until the service asserts projects, then what the primary has.
    assert read_url.startswith("postgresql://poimen_service@"), read_url
    role = "SELECT rolsuper OR rolbypassrls FROM pg_roles WHERE rolname = current_user"
    assert psql(read_url, role).stdout.strip() == "f"
    count = "SELECT count(*) FROM memory.nodes"
    assert psql(read_url, count).stdout.strip() == "0"
    every = "SELECT set_config('poimen.read_projects', '*', false); " + count
    assert psql(read_url, every).stdout.splitlines()[-1] == psql(primary, count).stdout.strip()
    assert psql(primary, count).stdout.strip() != "0"
    url = read_url.replace("postgresql://poimen_service@", "postgresql://postgres@")
    assert psql(url, "SELECT pg_is_in_recovery()").stdout.strip() == "t"
    refused = psql(url, "CREATE TABLE public.nope (x int)", check=False)
    assert "read-only transaction" in refused.stderr
    psql(
        primary, "CREATE TABLE public.replicated (x int); INSERT INTO public.replicated VALUES (7)"
    )
    deadline = time.monotonic() + 30
    while psql(url, "SELECT x FROM public.replicated", check=False).stdout.strip() != "7":
        assert time.monotonic() < deadline, "the write never reached the standby"
        time.sleep(0.05)
    status = run(cli_env, "db", "replica", "status").stdout
    assert status.startswith("running: standby, wal receiver streaming"), status
    assert "lag" in status
    assert run(cli_env, "db", "replica", "start").returncode == 0  # idempotent
    run(cli_env, "db", "replica", "stop")
    assert run(cli_env, "db", "replica", "status", ok=False).returncode == 3
    assert run(cli_env, "db", "replica", ok=False).returncode == 2
    assert run(cli_env, "db", "start", "stop", ok=False).returncode == 2


def test_stop(cli_env: dict[str, str]) -> None:
    run(cli_env, "db", "stop")
    assert run(cli_env, "db", "status", ok=False).returncode == 3


def test_serve_refuses_a_public_address_without_authentication(
    cli_env: dict[str, str],
) -> None:
    # serve reads whether keys exist: a migrated database, whatever ran before
    ready(cli_env)
    proc = run(cli_env, "serve", "--host", "0.0.0.0", "--port", "1", ok=False)
    assert proc.returncode == 2
    assert "refusing to serve on 0.0.0.0" in proc.stderr and "--allow-anonymous" in proc.stderr


def test_serve_on_a_public_address_warns_of_the_loopback_host_list(
    cli_env: dict[str, str],
) -> None:
    """Bound beyond loopback with the default POIMEN_HTTP_ALLOWED_HOSTS, every request that
    names the machine's address would be a 421: said at start-up. (Port 70000 makes uvicorn
    give up right after, so the test starts no server.)"""
    run(cli_env, "db", "start")
    args = ("serve", "--host", "0.0.0.0", "--port", "70000", "--allow-anonymous")
    warned = run(cli_env, *args, ok=False)
    assert "POIMEN_HTTP_ALLOWED_HOSTS names loopback hosts only" in warned.stderr
    listed = run({**cli_env, "POIMEN_HTTP_ALLOWED_HOSTS": "memory.example:*"}, *args, ok=False)
    assert warned.returncode != 0 and listed.returncode != 0  # neither served
    assert "POIMEN_HTTP_ALLOWED_HOSTS" not in listed.stderr


def test_keys_create_list_revoke(cli_env: dict[str, str]) -> None:
    ready(cli_env)
    created = run(cli_env, "keys", "create", "--project", "poimen", "--write", "--note", "ci")
    key = created.stdout.strip()
    assert key.startswith("pmk_") and len(key) > 40 and "shown once" in created.stderr
    listed = run(cli_env, "keys", "list").stdout
    assert key[:12] in listed and "read-write" in listed and "poimen" in listed
    assert key not in listed  # only the prefix is ever shown again
    run(cli_env, "keys", "revoke", key[:12])
    assert "revoked" in run(cli_env, "keys", "list").stdout
    assert run(cli_env, "keys", "revoke", key[:12], ok=False).returncode == 3
    assert run(cli_env, "keys", "create", ok=False).returncode == 2


@pytest.mark.parametrize("name", ["*", "poimen,atlas", "", " poimen", "_x", "a" * 129])
def test_keys_create_refuses_an_invalid_project_name(
    cli_env: dict[str, str],
    name: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """'*' or 'a,b' would assert every project (or two) to row-level security. The CLI's
    main() in this process, against the same running cluster (test_keys_create_list_revoke
    runs `keys` as its own process)."""
    ready(cli_env)
    before = run_here(monkeypatch, capsys, cli_env, "keys", "list")
    assert before.returncode == 0, before.stderr
    proc = run_here(
        monkeypatch, capsys, cli_env, "keys", "create", "--project", "poimen", "--project", name
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"invalid project name {name!r}" in proc.stderr and "[A-Za-z0-9]" in proc.stderr
    after = run_here(monkeypatch, capsys, cli_env, "keys", "list")
    assert after.returncode == 0 and after.stdout == before.stdout  # nothing stored
