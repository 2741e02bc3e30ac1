"""`poimen-memory bench-proxy`: what the PL/Proxy hop costs (docs/scaling.md#pl-proxy).

One synthetic multi-tenant corpus (Zipf-sized tenants, clustered vectors, no embedder)
loaded twice on this machine: whole into one database, and split by project into the
partition databases of three shard clusters behind a proxy database (`poimen-memory shard
init`'s code), each cluster of its own (ports, sockets, fsync off: a benchmark's). The same
hybrid `memory_query` (text and vector given, k 10) then runs through the service's own
role under row-level security, asserting the query's tenant as the HTTP service does for a
key: on the one database, and through the proxy. Two rounds (one database first, then the
proxy first); per call p50/p95 wall time, and CPU per call: the one database's sessions,
against the proxy's sessions plus the partitions' sessions the proxy opened. The same for a
query naming no project ('*' asserted): every partition, merged. Prints a table."""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
from pgvector.psycopg import register_vector

from poimen_lab.bench import synthetic
from poimen_lab.bench.http import CPU
from poimen_lab.measures import percentile
from poimen_lab.report import table
from poimen_memory import shard
from poimen_memory.db.cluster import Cluster, find_pg_bin
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import migrate

SERVICE = "poimen_service"  # the proxy's trusted caller, and a member of the one database's
CALLER = "poimen_bench_proxy_caller"
# Rows compared by (project, text): each database numbers its own copy of a node.
QUERY = (
    "SELECT project || ':' || text FROM public.memory_query(%(text)s, %(vec)s,"
    " project => %(project)s, k => 10, strategy => 'Hybrid')"
)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench-proxy", help="one database against 3 shards behind PL/Proxy")
    p.add_argument("--nodes", type=int, default=1_000_000)
    p.add_argument("--tenants", type=int, default=200)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--shards", type=int, default=3)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", type=Path, default=None, help="where the clusters go (default: tmp)")
    p.add_argument(
        "--maintenance-work-mem",
        default="3GB",
        help="maintenance_work_mem of the loads' sessions: the HNSW builds (a graph that does "
        "not fit is built on disk, several times slower: 1M nodes of 384 dimensions need "
        "about 2 GB), as a DBA sets it for a bulk load",
    )
    p.set_defaults(func=cmd_bench_proxy)


def subset(corpus: synthetic.Corpus, keep: set[str]) -> synthetic.Corpus:
    """The nodes of the kept projects, parents renumbered (they stay within a project)."""
    idx = [i for i, pr in enumerate(corpus.projects) if pr in keep]
    new = {old: n for n, old in enumerate(idx)}
    return synthetic.Corpus(
        vectors=corpus.vectors[np.array(idx, dtype=np.int64)] if idx else corpus.vectors[:0],
        texts=[corpus.texts[i] for i in idx],
        levels=[corpus.levels[i] for i in idx],
        projects=[corpus.projects[i] for i in idx],
        parents=[[new[p] for p in corpus.parents[i]] for i in idx],
        query_vectors=corpus.query_vectors,
        query_texts=corpus.query_texts,
        query_projects=corpus.query_projects,
    )


def _postmaster(c: Cluster) -> int:
    return int((c.data_dir / "postmaster.pid").read_text().split()[0])


def _caller(url: str) -> psycopg.Connection[Any]:
    conn = connect(url, autocommit=True)
    register_vector(conn)
    conn.execute(f"SET ROLE {CALLER}")
    return conn


def _phase(
    conn: psycopg.Connection[Any],
    cpus: list[CPU],
    corpus: synthetic.Corpus,
    named: bool,
    times: list[float],
    results: list[list[str]],
) -> float:
    """Every query once on conn; wall ms appended to times; CPU seconds of the sessions."""
    before = [c.snapshot() for c in cpus]
    for text, vec, project in zip(
        corpus.query_texts, corpus.query_vectors, corpus.query_projects, strict=True
    ):
        conn.execute(
            "SELECT set_config('poimen.read_projects', %s, false)", (project if named else "*",)
        )
        t0 = time.perf_counter()
        rows = conn.execute(
            QUERY, {"text": text, "vec": vec, "project": project if named else None}
        ).fetchall()
        times.append((time.perf_counter() - t0) * 1000)
        results.append([str(r[0]) for r in rows])
    after = [c.snapshot() for c in cpus]
    return sum(CPU.spent(b, a)[1] for b, a in zip(before, after, strict=True))


def cmd_bench_proxy(args: argparse.Namespace) -> int:
    base = Path(tempfile.mkdtemp(prefix="poimen-bench-proxy-", dir=args.dir))
    base.chmod(0o755)
    bin_dir = find_pg_bin()
    ports = iter(range(56400, 56500))
    main = Cluster(base / "main", base / "run-main", next(ports), bin_dir)
    shards = [
        Cluster(
            base / f"shard{i}", base / f"run{i}", next(ports), bin_dir, shard.DEFAULT_PROXY_ROLE
        )
        for i in range(args.shards)
    ]
    try:
        for c in (main, *shards):
            c.start(fast=True)
        corpus = synthetic.generate(
            args.nodes, args.dim, args.queries, seed=args.seed, projects=args.tenants
        )
        t0 = time.perf_counter()
        with connect(main.url("postgres"), autocommit=True) as a:
            a.execute("CREATE DATABASE one")
            a.execute("CREATE DATABASE proxy")
        with connect(main.url("one"), autocommit=True) as one:
            migrate(one, None, role_prefix="one")
            one.execute(
                "SELECT set_config('maintenance_work_mem', %s, false)", (args.maintenance_work_mem,)
            )
            synthetic.load(one, corpus, "synthetic")
        one_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        shard.init(
            main.url("proxy"),
            [f"host={c.socket_dir} port={c.port}" for c in shards],
            args.partitions,
            prefix="bench",
            service_role=SERVICE,
        )
        with psycopg.connect(main.url("proxy")) as p:
            parts = shard.partitions(p)
            where = {
                pr: int(p.execute("SELECT memory_proxy.partition_of(%s)", (pr,)).fetchone()[0])  # type: ignore[index]
                for pr in sorted(set(corpus.projects))
            }
        for part in parts:
            with connect(part.admin("postgres"), autocommit=True) as pc:
                keep = {pr for pr, n in where.items() if n == part.number}
                pc.execute(
                    "SELECT set_config('maintenance_work_mem', %s, false)",
                    (args.maintenance_work_mem,),
                )
                synthetic.load(pc, subset(corpus, keep), "synthetic")
        shards_s = time.perf_counter() - t0
        # A query over every tenant reads more postings than the default budget allows
        # (PM400) once the corpus passes ~100k nodes: raised alike on both sides, since
        # what is measured is the hop, not the guard.
        for url in [main.url("one"), *(pt.admin("postgres") for pt in parts)]:
            with connect(url, autocommit=True) as owner:
                owner.execute("SELECT memory.set_policy('query_max_postings', %s)", (str(10**9),))
        with connect(main.url("one"), autocommit=True) as one:
            row = one.execute("SELECT service FROM memory.roles()").fetchone()
            assert row is not None
            one.execute(
                f"DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{CALLER}')"
                f" THEN CREATE ROLE {CALLER} NOLOGIN; END IF; END $$"
            )
            one.execute(f'GRANT "{row[0]}", {SERVICE} TO {CALLER}')
        one_cpu = [CPU(_postmaster(main), main.url("one"))]
        proxy_cpu = [CPU(_postmaster(main), main.url("proxy"))] + [
            CPU(_postmaster(next(c for c in shards if f"port={c.port}" in pt.conninfo)),
                pt.admin("postgres"))
            for pt in parts
        ]  # fmt: skip
        out: list[list[Any]] = []
        agree: dict[str, float] = {}
        with _caller(main.url("one")) as direct, _caller(main.url("proxy")) as proxied:
            for named in (True, False):
                label = "named project" if named else "all projects"
                t_one: list[float] = []
                t_px: list[float] = []
                r_one: list[list[str]] = []
                r_px: list[list[str]] = []
                cpu_one = cpu_px = 0.0
                _phase(direct, [], corpus, named, [], [])  # warm: caches, plans
                _phase(proxied, [], corpus, named, [], [])  # warm: the proxy's connections
                for first_direct in (True, False):
                    order = [(direct, one_cpu, t_one, r_one), (proxied, proxy_cpu, t_px, r_px)]
                    for conn, cpus, times, res in order if first_direct else order[::-1]:
                        spent = _phase(conn, cpus, corpus, named, times, res)
                        if conn is direct:
                            cpu_one += spent
                        else:
                            cpu_px += spent
                calls = len(t_one)
                same = sum(a == b for a, b in zip(r_one, r_px, strict=True)) / calls
                agree[label] = same
                for what, times, cpu in (("one database", t_one, cpu_one), ("proxy", t_px, cpu_px)):
                    out.append([label, what, statistics.median(times), percentile(times, 95),
                                cpu / calls * 1000])  # fmt: skip
                p50 = statistics.median(t_px) / statistics.median(t_one)
                p95 = percentile(t_px, 95) / percentile(t_one, 95)
                out.append([label, "proxy / one", p50, p95, cpu_px / max(cpu_one, 1e-9)])
        print(
            f"{args.nodes} nodes, {args.tenants} tenants (Zipf), {args.partitions} partitions on "
            f"{args.shards} shard clusters, {args.queries} hybrid queries x 2 rounds, same "
            f"machine; load: one database {one_s:.0f} s, partitions {shards_s:.0f} s"
        )
        print(table(out, ["query", "path", "p50 ms", "p95 ms", "CPU ms/call"]))
        for label, same in agree.items():
            print(
                f"{label}: the same rows in the same order from both paths in {same:.0%} of calls"
            )
    finally:
        for c in (main, *shards):
            c.destroy()
        shutil.rmtree(base, ignore_errors=True)
    return 0
