"""What per-project HNSW graphs cost every statement (issue 42): planning and a single-row
insert with 0 project graphs, at the cap (project_graphs_max) and at twice the cap, on one
database. `python -m poimen_lab.bench.graphcap --url ... [--cap 2]`.

One database: the synthetic corpus (project bench-main) and Zipf-sized tenants, thresholds
lowered so that more tenants qualify than 2x the cap. Each round sets project_graphs_max to
0, cap and 2x cap in a shuffled order and lets the product keep the graphs
(memory._ensure_indexes drops, build_project_graphs builds), then measures, as the HTTP
service's role under row-level security asserting bench-main (poimen.read_projects /
write_projects): the planning time of the semantic leg's statement shape on memory.nodes
(EXPLAIN (SUMMARY) SELECT ... WHERE project_id = ... ORDER BY embedding <=> ... LIMIT 10),
a whole hybrid memory_query call (its legs' planning and execution, wall time), and a
single-row INSERT INTO memory.nodes (triggers and every index's upkeep; rolled back).
With pg_stat_statements preloaded (track = all, track_planning = on), also the planning
time of every statement a memory_query call runs, nested ones too (its legs are SQL
functions, planned at every call on PostgreSQL 15). Prints medians over the rounds and the
ratio to 0 graphs."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import psycopg
from pgvector.psycopg import register_vector

from poimen_lab.bench import synthetic
from poimen_lab.bench.scratch import drop_database, fresh_database, module_parser
from poimen_lab.report import table
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import build_project_graphs, migrate
from poimen_memory.settings import Settings

PLAN = (
    "EXPLAIN (SUMMARY, FORMAT JSON) SELECT id FROM memory.nodes WHERE project_id = %(pid)s"
    " AND level = ANY (ARRAY['L0','L1','L2']) AND expired_at IS NULL"
    " ORDER BY embedding <=> %(vec)s LIMIT 10"
)
QUERY = (
    "SELECT node_id, final_score FROM public.memory_query(%(text)s, %(vec)s,"
    " project => %(project)s, levels => ARRAY['L0','L1','L2'], k => 10, strategy => 'Hybrid')"
)
INSERT = (
    "INSERT INTO memory.nodes (sha256, project_id, level, text, embedding)"
    " VALUES (%(sha)s, %(pid)s, 'L0', %(text)s, %(vec)s)"
)


def _set_graphs(owner: psycopg.Connection[Any], k: int) -> int:
    owner.execute("SELECT memory.set_policy('project_graphs_max', %s)", (str(k),))
    owner.execute("SELECT memory._ensure_indexes()")
    build_project_graphs(owner)
    (n,) = owner.execute(
        "SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
        " WHERE i.indrelid = 'memory.nodes'::regclass AND memory._is_project_graph(c.relname)"
    ).fetchone() or (0,)
    return int(n)


def _params(corpus: Any, j: int, main_id: int, seq: int) -> dict[str, Any]:
    return {"pid": main_id, "vec": corpus.query_vectors[j], "text": corpus.query_texts[j],
            "project": synthetic.MAIN, "sha": (10**12 + seq).to_bytes(32, "big")}  # fmt: skip


def _assert(svc: psycopg.Connection[Any], p: dict[str, Any]) -> None:
    """The projects the service asserts for one request (sql/085_tenants.sql)."""
    svc.execute(
        "SELECT set_config('poimen.read_projects', %(project)s, true),"
        " set_config('poimen.write_projects', %(project)s, true)",
        p,
    )


def main() -> int:
    ap = module_parser(__doc__)
    ap.add_argument("--cap", type=int, default=2, help="project_graphs_max measured (and twice it)")
    ap.add_argument("--projects", type=int, default=200, help="Zipf-sized tenants")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=10, help="of each kind per round and setting")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    name, url = fresh_database(args.url, "poimen_bench_graphcap")
    try:
        corpus = synthetic.generate(args.nodes, args.dim, 50, seed=args.seed)
        with connect(url, autocommit=True) as owner:
            migrate(owner, Settings.from_env().plpython_root)
            synthetic.load(owner, corpus, "synthetic")
            synthetic.add_tenants(owner, args.projects, largest=400, seed=args.seed)
            for key in ("exact_scan_max_nodes", "project_graph_min_nodes"):
                owner.execute("SELECT memory.set_policy(%s, '5')", (key,))
            owner.execute("SELECT memory.set_policy('project_graphs_max', '1000')")
            qualifying = len(owner.execute("SELECT 1 FROM memory._project_graphs()").fetchall())
            if qualifying < 2 * args.cap:
                raise SystemExit(f"{qualifying} projects qualify, fewer than 2x the cap")
            main_id = owner.execute(
                "SELECT id FROM memory.projects WHERE name = %s", (synthetic.MAIN,)
            ).fetchone()[0]  # type: ignore[index]
            _r, _w, service = owner.execute("SELECT * FROM memory.roles()").fetchone()  # type: ignore[misc]
            nodes = owner.execute("SELECT count(*) FROM memory.nodes").fetchone()[0]  # type: ignore[index]
            settings = [0, args.cap, 2 * args.cap]
            svc = connect(url, autocommit=False)
            register_vector(svc)
            svc.execute(f'SET ROLE "{service}"')
            svc.commit()
            pgss = bool(owner.execute(
                "SELECT 1 FROM pg_settings WHERE name = 'shared_preload_libraries'"
                " AND setting LIKE '%pg_stat_statements%'"
            ).fetchone())  # fmt: skip
            if pgss:
                owner.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            labels = ["planning, all of a memory_query", "hybrid memory_query (wall)",
                      "planning, one nodes statement", "single-row INSERT (wall)"]  # fmt: skip
            plans_per_call: dict[int, float] = {}
            got: dict[tuple[int, str], list[float]] = {
                (k, lb): [] for k in settings for lb in labels
            }
            graphs: dict[int, int] = {}
            rng = random.Random(args.seed)
            seq = 0
            for rnd in range(args.rounds + 1):
                order = settings[:]
                rng.shuffle(order)
                for k in order:
                    graphs[k] = _set_graphs(owner, k)
                    for i in range(args.calls + 2):
                        if i == 2 and pgss:
                            owner.execute("SELECT pg_stat_statements_reset()")
                        j = (rnd * args.calls + i) % len(corpus.query_texts)
                        p = _params(corpus, j, main_id, seq := seq + 1)
                        _assert(svc, p)
                        t0 = time.perf_counter()
                        svc.execute(QUERY, p).fetchall()
                        t1 = time.perf_counter()
                        svc.rollback()
                        if rnd and i >= 2:  # warm-up: the first round, each setting's first calls
                            got[(k, labels[1])].append((t1 - t0) * 1000)
                    if pgss and rnd:
                        # every statement the service's role planned for the calls, nested too
                        plan_ms, plans = owner.execute(
                            "SELECT sum(total_plan_time), sum(plans) FROM pg_stat_statements"
                            " WHERE userid = %s::regrole",
                            (service,),
                        ).fetchone() or (0, 0)
                        got[(k, labels[0])].append(float(plan_ms) / args.calls)
                        plans_per_call[k] = int(plans) / args.calls
                    for i in range(args.calls + 2):
                        j = (rnd * args.calls + i) % len(corpus.query_texts)
                        p = _params(corpus, j, main_id, seq := seq + 1)
                        _assert(svc, p)
                        plan = svc.execute(PLAN, p).fetchone()[0][0]  # type: ignore[index]
                        t1 = time.perf_counter()
                        svc.execute(INSERT, p)
                        t2 = time.perf_counter()
                        svc.rollback()
                        if rnd and i >= 2:
                            got[(k, labels[2])].append(plan["Planning Time"])
                            got[(k, labels[3])].append((t2 - t1) * 1000)
            svc.close()
        rows = []
        for lb in labels:
            if not got[(0, lb)]:
                continue
            base = statistics.median(got[(0, lb)])
            for k in settings:
                med = statistics.median(got[(k, lb)])
                rows.append([lb, k, graphs[k], med, med / base])
        print(
            f"{nodes} nodes, {args.projects + 2} projects ({qualifying} qualify at thresholds 5);"
            f" service role asserting {synthetic.MAIN}; {args.rounds} rounds x {args.calls} calls,"
            " settings shuffled each round; medians (ms)"
        )
        if pgss:
            print(
                "planning, all of a memory_query: pg_stat_statements (track = all, track_planning)"
                f" total_plan_time of the service role's statements per call, nested too;"
                f" {plans_per_call.get(0, 0):.0f} plans a call"
            )
        print(table(rows, ["what", "project_graphs_max", "indexes", "median ms", "ratio to 0"]))
    finally:
        if args.keep_db:
            print(f"kept database {name}")
        else:
            drop_database(args.url, name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
