"""Every SQL and HTTP example in docs/*.md runs here, so the docs cannot drift.

The examples are parsed out of the Markdown (tests/docs_examples.py says what counts as one,
and the markers a block may carry). Each psql transcript runs through the real ``psql``
binary (``-X -q``, ``footer=off``, ``SHOW_CONTEXT never``, ``PGTZ=UTC``) against a copy of
the fixture database (tests/fixtures/memory_nodes.jsonl; its own copy when the block may
write, else one shared by the read-only blocks), and its output is compared with the doc's
as text; a ``$`` line in it runs in bash (``poimen-memory`` being this checkout's CLI) with
``POIMEN_DATABASE_URL`` set to that copy; each SQL script runs in a transaction that is
rolled back; each ``curl`` runs (with httpx) against the real service (``poimen-memory
serve`` on 127.0.0.1, started for the block) over its copy. With
``POIMEN_DOCS_REGENERATE=1`` the test writes what the product printed back into the docs
(abridged and subset outputs excepted) instead of failing: review the diff.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from conftest import SQL_MODE, make_role, own_connect
from docs_examples import (
    DOC_SERVER,
    Example,
    Statement,
    all_examples,
    compare_varying,
    matches_abridged,
    normalise,
)
from doubles.embedding_server import EmbeddingServer, run_embedding_server
from poimen_lab.live_server import free_port, live_server
from poimen_memory.db.cluster import Cluster, find_pg_bin
from poimen_memory.db.connect import connect
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.ingest.nodes import parse_lines
from poimen_memory.ingest.writer import ingest

# The docs show psql's output under the default settings (tests/test_sql_modes.py's modes
# change plans, ACLs and the path pgvector is found on): run in the default mode only.
pytestmark = pytest.mark.skipif(
    bool(SQL_MODE), reason=f"docs examples run in the default SQL mode, not {SQL_MODE}"
)

REGENERATE = os.environ.get("POIMEN_DOCS_REGENERATE") == "1"
EXAMPLES = all_examples()
DOC_EMBEDDING_SERVER = "http://127.0.0.1:37989"  # the embedding server the docs name
SEP = "@@docs-example@@"
LOCOMO = Path(__file__).resolve().parents[2] / "shared" / "data" / "locomo-dev"
DATA = {"locomo-dev": LOCOMO / "nodes.jsonl"}
CONVERSATION = "conv-26"

# What the test prepares before a block marked `setup=NAME` (the owner's connection to the
# block's own database). The embedding-server set-ups also rewrite the doc's server URL
# to the real one, in the statements and in the expected output.
SETUPS: dict[str, str] = {
    # the host has no in-database embedder: its packages' directory is not recorded
    "no-embedder": "DELETE FROM memory.config WHERE key = 'plpython_deps'",
    # the PL/Python module cannot be imported: its directory is not there
    "no-optimizer": "UPDATE memory.config SET value = '/nonexistent' WHERE key = 'plpython_path'",
    # a poimen_memory_writer granted the project notes only
    "notes-writer": "SELECT memory.grant_project('notes_writer', 'notes', write => true)",
    "embedding-server": "",  # the test double (tests/doubles/embedding_server.py), 384 dims
    "embedding-server-down": "",  # configured at a port where nothing listens
    # the id poimen:chat:1 in project atlas too (ids are unique per project only)
    "twin-id": "INSERT INTO memory.nodes (sha256, project_id, level, external_id, text) "
    "SELECT sha256('twin'), id, 'L0', 'poimen:chat:1', 'the twin' FROM memory.projects "
    "WHERE name = 'atlas'",
    # the L0 turn poimen:mem:5 was derived from, deleted
    "delete-chat-6": "DELETE FROM memory.nodes WHERE external_id = 'poimen:chat:6'",
}


def _examples(*kinds: str) -> list[Any]:
    return [pytest.param(ex, id=ex.id) for ex in EXAMPLES if ex.kind in kinds]


@pytest.fixture(scope="module")
def psql() -> Path:
    return Path(find_pg_bin()) / "psql"


@pytest.fixture(scope="module")
def double() -> Iterator[EmbeddingServer]:
    with run_embedding_server(dim=384) as server:
        yield server


@pytest.fixture(scope="module")
def data_templates(
    cluster: Cluster, admin: psycopg.Connection[Any], plpython_root: Path, embedder: LocalEmbedder
) -> Iterator[Callable[[str], str]]:
    """Template databases for `data=NAME` blocks, made when first asked for: the fixture
    plus, for locomo-dev, conversation conv-26 of LoCoMo dev (~700 nodes)."""
    made: dict[str, str] = {}

    def get(data: str) -> str:
        if data not in made:
            assert data == "locomo-dev", data
            lines = [ln for ln in DATA[data].read_text().splitlines() if ln.strip()]
            lines = [ln for ln in lines if json.loads(ln)["project"] == CONVERSATION]
            name = f"t_docs_{uuid.uuid4().hex[:8]}"
            admin.execute(f"CREATE DATABASE {name} TEMPLATE tmpl_fixture")
            with connect(cluster.url(name), autocommit=True) as conn:
                records, errors = parse_lines(lines)
                assert not errors
                report = ingest(conn, records, embedder, progress=False)
                assert report.inserted == len(records)
            made[data] = name
        return made[data]

    yield get
    for name in made.values():
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


# A block that may change the database gets its own copy; the others share one.
WRITES = re.compile(
    r"\b(INSERT|UPDATE|DELETE|CREATE|ALTER|DROP|VACUUM|GRANT|REVOKE|TRUNCATE|add_nodes"
    r"|partition_by_project|configure_embedding\w*|clear_embedding_server|set_policy"
    r"|reset_policy|grant_project|revoke_project|curl)\b",
    re.IGNORECASE,
)


def _writes(ex: Example) -> bool:
    return bool(ex.markers.keys() - {"varies", "abridged", "subset"}) or any(
        WRITES.search(s.text) for s in ex.statements
    )


@pytest.fixture(scope="module")
def shared_database(
    cluster: Cluster, admin: psycopg.Connection[Any], template_db: str
) -> Iterator[str]:
    """One copy of the fixture database for the blocks that only read."""
    name = f"t_docs_{uuid.uuid4().hex[:12]}"
    admin.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    own_connect(cluster.url(name))
    try:
        yield cluster.url(name)
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def database(
    request: pytest.FixtureRequest,
    cluster: Cluster,
    admin: psycopg.Connection[Any],
    template_db: str,
) -> Iterator[str]:
    """The block's own copy of the fixture database (or of its data's template), or, for a
    block that only reads, the shared copy. SQL scripts roll back: they share it too."""
    ex: Example = request.node.callspec.params["ex"]
    if (ex.kind == "sql-script" and not ex.marker("data")) or not _writes(ex):
        yield request.getfixturevalue("shared_database")
        return
    template = template_db
    for data in ex.marker("data"):
        if not DATA.get(data, Path("/nonexistent")).is_file():
            pytest.skip(f"{ex.id} needs {data}, not found at {DATA.get(data)}")
        template = request.getfixturevalue("data_templates")(data)
    name = f"t_docs_{uuid.uuid4().hex[:12]}"
    admin.execute(f"CREATE DATABASE {name} TEMPLATE {template}")
    own_connect(cluster.url(name))
    try:
        yield cluster.url(name)
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _prepare(ex: Example, url: str, request: pytest.FixtureRequest) -> dict[str, str]:
    """Run the block's set-up; returns the doc text → real text substitutions."""
    if reason := ex.marker("skip"):
        pytest.skip(f"{ex.id}: {reason[0]}")
    unknown = set(ex.marker("setup")) - set(SETUPS)
    assert not unknown, f"{ex.id}: unknown setup {unknown} (tests/test_docs_examples.py SETUPS)"
    subs: dict[str, str] = {}
    with connect(url, autocommit=True) as conn:
        for role in ex.marker("roles"):
            make_role(conn, role)
        for name in ex.marker("setup"):
            if name == "notes-writer":
                make_role(conn, "notes_writer", "writer")
            if name == "embedding-server":
                double: EmbeddingServer = request.getfixturevalue("double")
                double.reset(dim=384)
                subs[DOC_EMBEDDING_SERVER] = double.url
            if name == "embedding-server-down":
                down = f"http://127.0.0.1:{free_port()}"  # closed at once: nothing listens
                conn.execute("SELECT memory.configure_embedding_server(%s)", (down,))
                subs[DOC_EMBEDDING_SERVER] = down
            if SETUPS[name]:
                conn.execute(SETUPS[name])
    return subs


def _sub(text: str, subs: dict[str, str]) -> str:
    for doc, real in subs.items():
        text = text.replace(doc, real)
    return text


def _run_psql(psql: Path, url: str, statements: list[str]) -> list[list[str]]:
    """One psql session over the statements; the output of each (stderr merged in order:
    psql flushes stdout before every message)."""
    script = "".join(f"\\echo {SEP}\n{s}\n" for s in statements) + f"\\echo {SEP}\n"
    env = {**os.environ, "PGTZ": "UTC", "PGCLIENTENCODING": "UTF8"}
    cmd = [str(psql), "-X", "-q", "-v", "SHOW_CONTEXT=never", "-P", "footer=off",
           "-P", "pager=off", "-d", url]  # fmt: skip
    proc = subprocess.run(
        cmd, input=script, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=120, check=False,
    )  # fmt: skip
    chunks = proc.stdout.split(SEP + "\n")
    assert len(chunks) == len(statements) + 2, proc.stdout
    return [c.splitlines() for c in chunks[1:-1]]


def _run_shell(command: str, url: str, root: Path) -> list[str]:
    # The fixture was migrated with a PL/Python directory its server reads: named to
    # migrate (a database named by a URL records none unless asked), so --check compares
    # memory.config with it.
    prelude = (
        'poimen-memory() { if [ "$1" = migrate ]; then shift;'
        f' set -- migrate --plpython-dir {shlex.quote(str(root))} "$@"; fi;'
        f' {shlex.quote(sys.executable)} -m poimen_memory.cli.main "$@"; }}\n'
    )
    env = {**os.environ, "POIMEN_DATABASE_URL": url}
    proc = subprocess.run(
        ["bash", "-c", prelude + command], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=120, check=False,
    )  # fmt: skip
    return proc.stdout.splitlines()


def _problems(ex: Example, stmt: Statement, expected: list[str], actual: list[str]) -> list[str]:
    expected, actual = normalise(expected), normalise(actual)
    if not expected:  # output not shown: it must run
        errors = [a for a in actual if a.startswith("ERROR:")]
        return [f"raised {errors}"] if errors else []
    varies = ex.marker("varies")
    if ex.flag("subset"):
        return _subset(expected, actual, varies)
    if ex.flag("abridged"):
        ok = matches_abridged(
            [compare_mask(e, varies) for e in expected], [compare_mask(a, varies) for a in actual]
        )
        return [] if ok else ["abridged output does not match"]
    if varies:
        return compare_varying(expected, actual, varies)
    return [] if expected == actual else ["output differs"]


def _subset(expected: list[str], actual: list[str], varies: list[str]) -> list[str]:
    """Every line shown is among the lines produced, in the same order; in a line whose
    first word contains a `varies` item, only that first word (a metric's name and labels)
    is compared."""

    def key(line: str) -> str:
        first = line.split(" ")[0]
        return first if any(v in first for v in varies) else line

    produced = iter([key(a) for a in actual])
    missing = [e for e in expected if key(e) not in produced]
    return [f"not produced (in this order): {missing}"] if missing else []


def compare_mask(line: str, varies: list[str]) -> str:
    return re.sub(r"\d+(\.\d+)? s\b", "… s", line) if "seconds" in varies else line


# Regeneration: the doc lines to replace, collected over the run and written at the end.
_REWRITES: dict[Path, list[tuple[int, int, list[str]]]] = {}


def _record(ex: Example, stmt: Statement, actual: list[str], subs: dict[str, str]) -> None:
    back = {real: doc for doc, real in subs.items()}
    lines = [ex.indent + _sub(a, back).rstrip() if a.strip() else "" for a in normalise(actual)]
    _REWRITES.setdefault(ex.path, []).append((*stmt.output_lines, lines))


@pytest.fixture(scope="module", autouse=True)
def _write_regenerated() -> Iterator[None]:
    yield
    for path, edits in _REWRITES.items():
        lines = path.read_text().splitlines()
        for start, end, new in sorted(edits, reverse=True):
            lines[start:end] = new
        path.write_text("\n".join(lines) + "\n")


def _check(ex: Example, outputs: list[tuple[Statement, list[str]]], subs: dict[str, str]) -> None:
    failures = []
    for stmt, actual in outputs:
        expected = [_sub(e, subs) for e in stmt.expected]
        problems = _problems(ex, stmt, expected, actual)
        if problems and REGENERATE and stmt.expected and not ex.flag("abridged"):
            _record(ex, stmt, actual, subs)
            continue
        if problems:
            failures.append(
                f"{ex.path.name}:{stmt.line}: {'; '.join(problems)}\n--- shown\n"
                + "\n".join(normalise(expected))
                + "\n--- produced\n"
                + "\n".join(normalise(actual))
            )
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("ex", _examples("psql"))
def test_psql_example(
    ex: Example, psql: Path, database: str, plpython_root: Path, request: pytest.FixtureRequest
) -> None:
    subs = _prepare(ex, database, request)
    outputs: list[tuple[Statement, list[str]]] = []
    pending: list[Statement] = []

    def flush() -> None:
        if pending:
            texts = [_sub(s.text, subs) for s in pending]
            outputs.extend(zip(pending, _run_psql(psql, database, texts), strict=True))
            pending.clear()

    for stmt in ex.statements:
        if stmt.shell:  # between psql sessions
            flush()
            outputs.append((stmt, _run_shell(_sub(stmt.text, subs), database, plpython_root)))
        else:
            pending.append(stmt)
    flush()
    _check(ex, outputs, subs)


@pytest.mark.parametrize("ex", _examples("sql-script"))
def test_sql_script_example(
    ex: Example, psql: Path, database: str, request: pytest.FixtureRequest
) -> None:
    subs = _prepare(ex, database, request)
    texts = ["BEGIN;", *(_sub(s.text, subs) for s in ex.statements), "ROLLBACK;"]
    outputs = _run_psql(psql, database, texts)
    errors = [
        (t, o) for t, o in zip(texts, outputs, strict=True) if any("ERROR:" in ln for ln in o)
    ]
    assert not errors, f"{ex.id}: {errors}"


# ---- HTTP -----------------------------------------------------------------------------


def _curl(command: str, base: str) -> list[str]:
    """The curl command lines the docs use (-s, -i, -H, -X METHOD, -d BODY, -o /dev/null, a
    `| grep -i`), run with httpx against the real server; its output as curl would print it."""
    command = command.replace("\\\n", " ")
    pipeline = [shlex.split(part) for part in command.split(" | ")]
    args, filters = pipeline[0], pipeline[1:]
    assert args[0] == "curl", command
    headers, include, discard, url = {}, False, False, ""
    method, body = "GET", None
    it = iter(args[1:])
    for arg in it:
        if arg == "-X":
            method = next(it)
        elif arg == "-d":
            body = next(it).encode()
            method = "POST" if method == "GET" else method
        elif arg == "-H":
            k, _, v = next(it).partition(":")
            headers[k.strip()] = v.strip()
        elif arg == "-o":
            discard = next(it) == "/dev/null"
        elif arg.startswith("-") and not arg.startswith("--"):
            assert set(arg[1:]) <= {"s", "i"}, f"curl option {arg} not supported here"
            include = include or "i" in arg
        else:
            url = arg.replace(DOC_SERVER, base)
    response = httpx.request(method, url, headers=headers, content=body, timeout=30)
    out: list[str] = []
    if include:
        out.append(f"HTTP/1.1 {response.status_code} {response.reason_phrase}")
        out += [f"{k.decode()}: {v.decode()}" for k, v in response.headers.raw]
        out.append("")
    if not discard:
        out += response.text.splitlines()
    for f in filters:
        assert f[:2] == ["grep", "-i"] and len(f) == 3, f"filter {f} not supported here"
        out = [line for line in out if f[2].lower() in line.lower()]
    return out


@pytest.fixture(scope="module")
def http_examples_done() -> dict[str, tuple[Path, str]]:
    """Each HTTP example's server log and X-Request-ID, for the request-log block after it."""
    return {}


@pytest.mark.parametrize("ex", _examples("http"))
def test_http_example(
    ex: Example,
    database: str,
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    http_examples_done: dict[str, tuple[Path, str]],
) -> None:
    subs = _prepare(ex, database, request)
    log = tmp_path_factory.mktemp("docs-http") / "server.log"
    outputs: list[tuple[Statement, list[str]]] = []
    with live_server({"POIMEN_DATABASE_URL": database}, log) as base:
        for stmt in ex.statements:
            outputs.append((stmt, _curl(stmt.text, base)))
    ids = re.findall(r"X-Request-ID: ([^'\"]+)", " ".join(s.text for s in ex.statements))
    http_examples_done[ex.id] = (log, ids[0] if ids else "")
    _check(ex, outputs, subs)


@pytest.fixture(scope="module")
def shared_server(
    shared_database: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[httpx.Client]:
    """One server over the shared copy, for the blocks of URLs (they only read): a start is
    several seconds of CPU, once per module rather than once per block."""
    log = tmp_path_factory.mktemp("docs-urls") / "server.log"
    with (
        live_server({"POIMEN_DATABASE_URL": shared_database}, log) as base,
        httpx.Client(base_url=base, timeout=30) as client,
    ):
        yield client


@pytest.mark.parametrize("ex", _examples("http-urls"))
def test_http_urls_example(ex: Example, shared_server: httpx.Client) -> None:
    urls = [b.strip() for b in ex.body if b.strip()]
    base = str(shared_server.base_url).rstrip("/")
    statuses = {u: shared_server.get(u.replace(DOC_SERVER, base)).status_code for u in urls}
    assert statuses == dict.fromkeys(urls, 200), statuses


@pytest.mark.parametrize("ex", _examples("request-log"))
def test_request_log_example(ex: Example, http_examples_done: dict[str, tuple[Path, str]]) -> None:
    before = [e for e in EXAMPLES if e.path == ex.path and e.kind == "http" and e.line < ex.line]
    assert before, f"{ex.id}: no HTTP example before this request-log block"
    if before[-1].id not in http_examples_done:
        pytest.skip(f"{ex.id}: its HTTP example {before[-1].id} did not run")
    log, request_id = http_examples_done[before[-1].id]
    lines = [json.loads(ln) for ln in log.read_text().splitlines() if ln.startswith("{")]
    mine = [ln for ln in lines if ln.get("request_id") == request_id]
    assert len(mine) == 1, log.read_text()
    shown = json.loads("\n".join(ex.body))
    varies = set(ex.marker("varies"))
    if REGENERATE and shown != mine[0]:
        start = ex.line  # the body's first line, 0-based
        line = json.dumps(mine[0], ensure_ascii=False)
        _REWRITES.setdefault(ex.path, []).append((start, start + len(ex.body), [line]))
        return
    assert sorted(shown) == sorted(mine[0]), (sorted(shown), sorted(mine[0]))
    for key, value in shown.items():
        if key in varies:
            if isinstance(value, dict):
                assert sorted(value) == sorted(mine[0][key]), key
            continue
        assert mine[0][key] == value, (key, value, mine[0][key])
