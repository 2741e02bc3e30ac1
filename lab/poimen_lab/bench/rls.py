"""`poimen-memory bench-rls`: what row-level security costs a query. One synthetic corpus in
a fresh database; each query runs once as the owner (RLS bypassed) and once as a role
granted the project (RLS applied), alternating which goes first, on two warm connections;
the two must return the same rows. Prints medians and p95 per call."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import psycopg
from pgvector.psycopg import register_vector

from poimen_lab.bench import synthetic
from poimen_lab.bench.scratch import drop_database, fresh_database
from poimen_lab.measures import percentile
from poimen_lab.report import table
from poimen_memory.db.connect import connect, database_url
from poimen_memory.db.migrate import migrate
from poimen_memory.settings import Settings

ROLE = "poimen_bench_tenant"
CALLS = {
    "lexical memory_query": "SELECT node_id, final_score FROM public.memory_query(%(text)s,"
    " project => %(project)s, levels => ARRAY['L0','L1','L2'], k => 10)",
    "hybrid memory_query": "SELECT node_id, final_score FROM public.memory_query(%(text)s,"
    " %(vec)s, project => %(project)s, levels => ARRAY['L0','L1','L2'], k => 10,"
    " strategy => 'Hybrid')",
    "semantic_search": "SELECT node_id, query_score FROM memory.semantic_search(%(vec)s,"
    " %(project)s, k => 10)",
    "lexical_search": "SELECT node_id, lexical_score FROM memory.lexical_search(%(text)s,"
    " %(project)s, k => 10)",
}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench-rls", help="query latency with row-level security on and off")
    p.add_argument("--nodes", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-db", action="store_true")
    p.set_defaults(func=cmd_bench_rls)


def _timed(conn: psycopg.Connection[Any], sql: str, params: dict[str, Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    rows = conn.execute(sql, params).fetchall()
    return time.perf_counter() - t0, rows


def cmd_bench_rls(args: argparse.Namespace) -> int:
    server = database_url(Settings.from_env(), start=True)
    name, url = fresh_database(server)
    try:
        corpus = synthetic.generate(args.nodes, args.dim, args.queries, seed=args.seed)
        with connect(url, autocommit=True) as owner:
            migrate(owner, None)
            synthetic.load(owner, corpus, "synthetic")
            row = owner.execute("SELECT reader FROM memory.roles()").fetchone()
            assert row is not None
            owner.execute(
                f"DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}')"
                f" THEN CREATE ROLE {ROLE} NOLOGIN; END IF; END $$"
            )
            owner.execute(f'GRANT "{row[0]}" TO {ROLE}')
            owner.execute("SELECT memory.grant_project(%s, %s)", (ROLE, synthetic.MAIN))
            with connect(url, autocommit=True) as tenant:
                register_vector(tenant)
                tenant.execute(f"SET ROLE {ROLE}")
                rows = []
                for label, sql in CALLS.items():
                    off: list[float] = []
                    on: list[float] = []
                    for i, (text, vec) in enumerate(
                        zip(corpus.query_texts, corpus.query_vectors, strict=True)
                    ):
                        params = {"text": text, "vec": vec, "project": synthetic.MAIN}
                        order = [(owner, off), (tenant, on)]
                        results = []
                        for conn, times in order if i % 2 == 0 else order[::-1]:
                            s, got = _timed(conn, sql, params)
                            times.append(s * 1000)
                            results.append(got)
                        if results[0] != results[1]:
                            raise AssertionError(f"{label}: RLS changed the result of query {i}")
                    rows.append(_row(label, off, on))
        print(
            f"{args.queries} queries x {len(CALLS)} calls, {args.nodes} nodes, project "
            f"{synthetic.MAIN} (99% of the nodes), same database, alternating; ms"
        )
        print(
            table(
                rows,
                ["call", "off p50", "on p50", "on/off p50", "off p95", "on p95", "on/off p95"],
            )
        )
    finally:
        if not args.keep_db:
            drop_database(server, name)
    return 0


def _row(label: str, off: list[float], on: list[float]) -> list[Any]:
    p50_off, p50_on = statistics.median(off), statistics.median(on)
    p95_off, p95_on = percentile(off, 95), percentile(on, 95)
    return [label, p50_off, p50_on, p50_on / p50_off, p95_off, p95_on, p95_on / p95_off]
