"""`poimen-memory bench-tenants`: what a tenant check costs as the number of projects a caller
may see grows (issue 42). One database of many projects; the same query, naming one
project, made by callers who differ only in how many projects they may read: a role granted
that project alone, one granted 1,000, one granted every project ('*'), and the HTTP
service's role asserting one project or 1,000 (what an API key covering them does), while
another role holds a grant row for every project. The calls go round robin, query by
query, on warm connections; every caller must get the same rows. Prints each caller's
median time and its backend's CPU per call (from /proc), and the ratio to the one-project
caller of its kind."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import psycopg
from pgvector.psycopg import register_vector
from psycopg.conninfo import make_conninfo

from poimen_lab.bench import synthetic
from poimen_lab.bench.scratch import drop_database, fresh_database
from poimen_lab.report import table
from poimen_memory.db.connect import connect, database_url
from poimen_memory.db.migrate import migrate
from poimen_memory.settings import Settings

PREFIX = "poimen_bench_tenants"
QUERY = (
    "SELECT node_id, final_score FROM public.memory_query(%(text)s, %(vec)s,"
    " project => %(project)s, levels => ARRAY['L0','L1','L2'], k => 10)"
)
_TICK = os.sysconf("SC_CLK_TCK")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench-tenants", help="tenant-check cost against the projects a caller sees")
    p.add_argument("--nodes", type=int, default=20_000, help="nodes of the queried project")
    p.add_argument("--projects", type=int, default=3_000, help="other projects (Zipf-sized)")
    p.add_argument("--covered", type=int, default=1_000, help="projects of the wide callers")
    p.add_argument("--queries", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--database",
        action="append",
        help="reuse a database this command loaded (--keep-db); given twice, both are measured"
        " in one run, call by call (a database migrated by the code before a change, and one"
        " by the code after it)",
    )
    p.add_argument("--keep-db", action="store_true")
    p.set_defaults(func=cmd_bench_tenants)


def _backend_cpu(pid: int) -> float:
    """Seconds of CPU the backend has used (user + system), from /proc: the server runs on
    this machine in every set-up the bench supports (127.0.0.1 or a socket)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _load(url: str, args: argparse.Namespace) -> dict[str, list[Any]]:
    corpus = synthetic.generate(args.nodes, 384, args.queries, seed=args.seed)
    with connect(url, autocommit=True) as owner:
        migrate(owner, Settings.from_env().plpython_root)
        synthetic.load(owner, corpus, "synthetic")
        synthetic.add_tenants(owner, args.projects, largest=200, seed=args.seed)
    return {"texts": list(corpus.query_texts), "vectors": list(corpus.query_vectors)}


def _roles(owner: psycopg.Connection[Any], covered: list[str], every: list[str]) -> None:
    reader, _writer, service = owner.execute("SELECT * FROM memory.roles()").fetchone()  # type: ignore[misc]
    for name, member_of in [("one", reader), ("many", reader), ("star", reader),
                            ("other", reader), ("svc", service)]:  # fmt: skip
        role = f"{PREFIX}_{name}"
        owner.execute(
            f"DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}')"
            f" THEN CREATE ROLE {role} NOLOGIN; END IF; END $$"
        )
        owner.execute(f'GRANT "{member_of}" TO {role}')
    owner.execute("DELETE FROM memory.project_grants WHERE role_name LIKE %s", (PREFIX + "%",))
    owner.execute("SELECT memory.grant_project(%s, %s)", (f"{PREFIX}_one", synthetic.MAIN))
    owner.execute(
        "SELECT memory.grant_project(%s, p) FROM unnest(%s::text[]) p", (f"{PREFIX}_many", covered)
    )
    owner.execute("SELECT memory.grant_project(%s, '*')", (f"{PREFIX}_star",))
    owner.execute(
        "SELECT memory.grant_project(%s, p) FROM unnest(%s::text[]) p", (f"{PREFIX}_other", every)
    )


def _connect(url: str, role: str, asserted: str | None) -> tuple[psycopg.Connection[Any], int]:
    c = connect(url, autocommit=False)
    register_vector(c)
    c.execute(f"SET ROLE {role}")
    if asserted is not None:
        c.execute("SELECT set_config('poimen.read_projects', %s, false)", (asserted,))
    pid = c.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
    c.commit()
    return c, pid


def _callers(url: str, covered: int) -> dict[str, tuple[str, str | None]]:
    with connect(url, autocommit=True) as owner:
        others = [r[0] for r in owner.execute(
            "SELECT name FROM memory.projects WHERE name <> %s ORDER BY id", (synthetic.MAIN,)
        ).fetchall()]  # fmt: skip
        wide = [synthetic.MAIN, *others[: covered - 1]]
        _roles(owner, wide, [synthetic.MAIN, *others])
    return {
        "role, 1 project": (f"{PREFIX}_one", None),
        f"role, {len(wide)} projects": (f"{PREFIX}_many", None),
        "role, '*'": (f"{PREFIX}_star", None),
        "service, 1 project": (f"{PREFIX}_svc", synthetic.MAIN),
        f"service, {len(wide)} projects": (f"{PREFIX}_svc", ",".join(wide)),
        "service, '*'": (f"{PREFIX}_svc", "*"),
    }


def cmd_bench_tenants(args: argparse.Namespace) -> int:
    server = database_url(Settings.from_env(), start=True)
    if args.database:
        names = list(args.database)
        corpus = synthetic.generate(args.nodes, 384, args.queries, seed=args.seed)
        queries: dict[str, list[Any]] = {
            "texts": list(corpus.query_texts),
            "vectors": list(corpus.query_vectors),
        }
    else:
        name, url = fresh_database(server)
        names = [name]
        queries = _load(url, args)
    try:
        conns: dict[tuple[str, str], tuple[psycopg.Connection[Any], int]] = {}
        for db in names:
            url = make_conninfo(server, dbname=db)
            for label, (role, asserted) in _callers(url, args.covered).items():
                conns[(db, label)] = _connect(url, role, asserted)
        keys = list(conns)
        times: dict[tuple[str, str], list[float]] = {k: [] for k in keys}
        cpu: dict[tuple[str, str], float] = dict.fromkeys(keys, 0.0)
        for i, (text, vec) in enumerate(zip(queries["texts"], queries["vectors"], strict=True)):
            params = {"text": text, "vec": vec, "project": synthetic.MAIN}
            seen = None
            for key in keys[i % len(keys) :] + keys[: i % len(keys)]:
                c, pid = conns[key]
                c0 = _backend_cpu(pid)
                t0 = time.perf_counter()
                rows = c.execute(QUERY, params).fetchall()
                c.commit()
                times[key].append((time.perf_counter() - t0) * 1000)
                cpu[key] += _backend_cpu(pid) - c0
                if seen is None:
                    seen = rows
                elif rows != seen:
                    raise AssertionError(f"{key}: another answer to query {i}")
        for c, _pid in conns.values():
            c.close()
        n = len(queries["texts"])
        out = []
        for db, label in keys:
            ref = (db, "role, 1 project" if label.startswith("role") else "service, 1 project")
            p50, p50_ref = statistics.median(times[(db, label)]), statistics.median(times[ref])
            out.append([
                db, label, p50, p50 / p50_ref, cpu[(db, label)] / n * 1000,
                cpu[(db, label)] / max(cpu[ref], 1e-9),
            ])  # fmt: skip
        print(
            f"{n} hybrid memory_query calls per caller naming {synthetic.MAIN}; another role "
            "holds a grant of every project; round robin over callers (and databases)"
        )
        print(table(out, ["database", "caller", "p50 ms", "p50 ratio", "CPU ms/call", "CPU ratio"]))
    finally:
        if not args.database and not args.keep_db:
            drop_database(server, names[0])
        elif not args.database:
            print(f"kept database {names[0]}")
    return 0
