"""Postings as blocks, measured (issue 42): what BM25's postings would weigh and cost to score
if a row held a run of a term's postings instead of one.

Today a posting is a row of `memory.postings` (lexeme, project, node, level, tf, dl) with a
covering key: about 135 bytes a posting, most of it the tuple header and the key. This bench
builds, from a loaded database's postings and beside them (a scratch schema, dropped after),
two block layouts of the same postings, one row per (lexeme, project, run of --block nodes
in id order):

- ``packed``: node ids, tf and dl, and levels as bytea (big-endian int8, int4 pairs, a byte),
  which numpy reads without a copy: scored by a PL/Python function with numpy (where the
  database allows PL/Python and the server's Python has numpy: memory.config plpython_deps,
  what memory.embed uses);
- ``arrays``: the same as int8[] / int4[] / "char"[], scored in plain SQL by ``unnest`` (the
  scorer a managed database without PL/Python would have).

Every query's terms and weights are the product's (memory.lexical_query and
memory.term_stats, as memory.lexical_search computes them), and each scorer returns the top k
of the same BM25 sum over every posting of the terms: ``rows`` is memory.lexical_search's
exhaustive statement over memory.postings, the reference every other list must equal.
``lexical_search`` is the product's function (pruned when a query's postings are many; a
query with grammar, quotes, a leading "-" or OR, scores other terms there, which would show
as a different top k).
Each scorer runs on a connection of its own, as the service's role under row-level security
(the blocks carry memory.postings' read policy) with every project readable, as the HTTP
service without a key; its backend's CPU (/proc schedstat) over a pass of every query is the
measure; passes alternate the scorers' order, round by round.

    python -m poimen_lab.bench.blocks --url postgresql:///poimen --natural ../shared/data/scifact
    python -m poimen_lab.bench.blocks --url ... --nodes 100000 --reuse <kept bench database>
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from poimen_lab.bench import synthetic
from poimen_lab.bench.command import NATURAL_INSERT
from poimen_lab.bench.peers import process_cpu_ns
from poimen_lab.bench.recall import service_connection
from poimen_lab.bench.scratch import drop_database, fresh_database, module_parser
from poimen_lab.report import table
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import migrate
from poimen_memory.settings import Settings

SCHEMA = "poimen_bench_blocks"

# The blocks, built set-wise from memory.postings: a posting's block is its rank within
# (lexeme, project) in node order, divided by the block size.
BUILD = {
    "packed": f"""
CREATE TABLE {SCHEMA}.packed (
    lexeme text, project_id integer, first_node bigint, n integer,
    nodes bytea, tfdl bytea, levels bytea, PRIMARY KEY (lexeme, project_id, first_node));
INSERT INTO {SCHEMA}.packed
SELECT lexeme, project_id, min(node_id), count(*),
       string_agg(int8send(node_id), ''::bytea ORDER BY node_id),
       string_agg(int4send(tf) || int4send(dl), ''::bytea ORDER BY node_id),
       string_agg(convert_to(right(level, 1), 'SQL_ASCII'), ''::bytea ORDER BY node_id)
FROM (SELECT p.*, (row_number() OVER (PARTITION BY lexeme, project_id ORDER BY node_id) - 1)
                  / %(block)s AS b
      FROM memory.postings p) s
GROUP BY lexeme, project_id, b""",
    "arrays": f"""
CREATE TABLE {SCHEMA}.arrays (
    lexeme text, project_id integer, first_node bigint,
    nodes bigint[], tfs integer[], dls integer[], levels "char"[],
    PRIMARY KEY (lexeme, project_id, first_node));
INSERT INTO {SCHEMA}.arrays
SELECT lexeme, project_id, min(node_id), array_agg(node_id ORDER BY node_id),
       array_agg(tf ORDER BY node_id), array_agg(dl ORDER BY node_id),
       array_agg(right(level, 1)::"char" ORDER BY node_id)
FROM (SELECT p.*, (row_number() OVER (PARTITION BY lexeme, project_id ORDER BY node_id) - 1)
                  / %(block)s AS b
      FROM memory.postings p) s
GROUP BY lexeme, project_id, b""",
}

# A query's terms and BM25 constants, as memory.lexical_search derives them.
TERMS = f"""
CREATE FUNCTION {SCHEMA}.terms(query text, pid integer, k integer,
    OUT t_lex text[], OUT t_w double precision[],
    OUT c1 double precision, OUT c2 double precision, OUT c3 double precision)
LANGUAGE plpgsql STABLE AS $$
DECLARE terms text[]; n double precision; avgdl double precision;
        k1 double precision := 1.2; b double precision := 0.75;
BEGIN
    SELECT x.terms, x.n, x.avgdl INTO terms, n, avgdl
    FROM memory.lexical_query(query, pid, k, k1, b) x;
    c1 := k1 + 1; c2 := k1 * (1 - b); c3 := k1 * b / nullif(avgdl, 0);
    SELECT array_agg(g.lexeme ORDER BY g.lexeme), array_agg(g.w ORDER BY g.lexeme) INTO t_lex, t_w
    FROM (SELECT t.lexeme, ln(1 + (n - sum(t.df) + 0.5) / (sum(t.df) + 0.5)) AS w
          FROM memory.term_stats t
          WHERE t.lexeme = ANY (terms) AND t.project_id = pid GROUP BY t.lexeme) g;
END $$"""

_ARGS = (
    "t_lex text[], t_w double precision[], c1 double precision, c2 double precision, "
    "c3 double precision, pid integer, k integer"
)
_RETURNS = "RETURNS TABLE (node_id bigint, score double precision)"

SCORERS = {
    # memory.lexical_search's exhaustive statement, over the rows
    "rows": f"""
CREATE FUNCTION {SCHEMA}.rows({_ARGS}) {_RETURNS} LANGUAGE sql STABLE AS $$
SELECT p.node_id, memory._bm25_score(sum(w.w * p.tf * c1 / (p.tf + c2 + c3 * p.dl))) AS score
FROM unnest(t_lex, t_w) AS w(lexeme, w)
JOIN memory.postings p ON p.lexeme = w.lexeme
WHERE p.project_id = pid
GROUP BY p.node_id ORDER BY score DESC, p.node_id LIMIT k $$""",
    "arrays+sql": f"""
CREATE FUNCTION {SCHEMA}.arrays_sql({_ARGS}) {_RETURNS} LANGUAGE sql STABLE AS $$
SELECT x.id, memory._bm25_score(sum(w.w * x.tf * c1 / (x.tf + c2 + c3 * x.dl))) AS score
FROM unnest(t_lex, t_w) AS w(lexeme, w)
JOIN {SCHEMA}.arrays b ON b.lexeme = w.lexeme AND b.project_id = pid
CROSS JOIN LATERAL unnest(b.nodes, b.tfs, b.dls) AS x(id, tf, dl)
GROUP BY x.id ORDER BY score DESC, x.id LIMIT k $$""",
    # The sum is memory._bm25_score's: rounded to 1e-9, so ties break by id as in SQL.
    "packed+numpy": f"""
CREATE FUNCTION {SCHEMA}.packed_numpy({_ARGS}) {_RETURNS} LANGUAGE plpython3u STABLE AS $$
if "np" not in SD:
    import os, sys
    deps = plpy.execute("SELECT value FROM memory.config WHERE key = 'plpython_deps'")
    if deps and deps[0]["value"]:
        d = os.path.join(deps[0]["value"], "%d.%d" % sys.version_info[:2])
        if d not in sys.path:
            sys.path.insert(0, d)
    import numpy
    SD["np"] = numpy
    SD["plan"] = plpy.prepare(
        "SELECT u.ord::integer AS ord, b.n, b.nodes, b.tfdl FROM unnest($1::text[])"
        " WITH ORDINALITY AS u(lexeme, ord) JOIN {SCHEMA}.packed b"
        " ON b.lexeme = u.lexeme AND b.project_id = $2", ["text[]", "integer"])
np = SD["np"]
rows = plpy.execute(SD["plan"], [t_lex, pid])
if rows.nrows() == 0:
    return []
ids = np.frombuffer(b"".join([r["nodes"] for r in rows]), ">i8")
tfdl = np.frombuffer(b"".join([r["tfdl"] for r in rows]), ">i4").reshape(-1, 2).astype(np.float64)
w = np.repeat(np.array([t_w[r["ord"] - 1] for r in rows]), [r["n"] for r in rows])
tf = tfdl[:, 0]
node, inv = np.unique(ids, return_inverse=True)
total = np.round(np.bincount(inv, weights=w * tf * c1 / (tf + c2 + c3 * tfdl[:, 1])), 9)
if len(node) > k:
    top = np.argpartition(-total, k - 1)[:k]
    top = np.nonzero(total >= total[top].min())[0]  # every tie at the k-th score
else:
    top = np.arange(len(node))
top = top[np.lexsort((node[top], -total[top]))][:k]
return list(zip(node[top].tolist(), total[top].tolist()))
$$""",
}
CALLS = {
    "rows": f"SELECT node_id FROM {SCHEMA}.rows(%s, %s, %s, %s, %s, %s, %s)",
    "arrays+sql": f"SELECT node_id FROM {SCHEMA}.arrays_sql(%s, %s, %s, %s, %s, %s, %s)",
    "packed+numpy": f"SELECT node_id FROM {SCHEMA}.packed_numpy(%s, %s, %s, %s, %s, %s, %s)",
}
LEXICAL = "SELECT node_id FROM memory.lexical_search(%s, %s, NULL, %s)"
# what the scorers are given, timed on its own: the product pays it inside lexical_search
TERMS_CALL = f"SELECT 1 FROM {SCHEMA}.terms(%s, %s, %s)"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--natural",
        type=Path,
        metavar="DIR",
        help="a nodes.jsonl + queries*.jsonl folder (SciFact, LoCoMo) loaded lexically, no"
        " vectors (default: the synthetic corpus of --nodes)",
    )
    ap.add_argument(
        "--reuse",
        metavar="DBNAME",
        help="a database loaded before (this bench's --keep-db, or `poimen-memory bench"
        " --keep-db` with the same --nodes and --seed for the synthetic queries)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--queries", type=int, default=400)
    ap.add_argument("--k", type=int, default=50, help="top k (the legs' default depth is 50)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--block", type=int, default=128, help="postings a block")
    ap.add_argument("--json", type=Path, metavar="OUT")


def _natural(url: str, folder: Path, n: int) -> list[tuple[str, str]]:
    nodes = [json.loads(x) for x in (folder / "nodes.jsonl").read_text().splitlines()]
    qfile = sorted(folder.glob("queries*.jsonl"))[0]
    queries = [json.loads(x) for x in qfile.read_text().splitlines()][:n]
    with connect(url, autocommit=True) as conn:
        migrate(conn, Settings.from_env().plpython_root)
        for project in sorted({x["project"] for x in nodes}):
            conn.execute("INSERT INTO memory.projects (name) VALUES (%s)", (project,))
            mine = [x for x in nodes if x["project"] == project]
            conn.execute(
                NATURAL_INSERT,
                {
                    "p": project,
                    "ext": [x["id"] for x in mine],
                    "titles": [x.get("title") for x in mine],
                    "texts": [x["text"] for x in mine],
                },
            )
    return [(q["text"], q["project"]) for q in queries]


def _synthetic(
    url: str, nodes: int, dim: int, n: int, seed: int, load: bool
) -> list[tuple[str, str]]:
    corpus = synthetic.generate(nodes, dim, n, seed=seed)
    if load:
        with connect(url, autocommit=True) as conn:
            migrate(conn, Settings.from_env().plpython_root)
            synthetic.load(conn, corpus, "synthetic")
    return list(zip(corpus.query_texts, corpus.query_projects, strict=True))


def _sizes(conn: psycopg.Connection[Any]) -> dict[str, float]:
    postings = conn.execute("SELECT count(*) FROM memory.postings").fetchone()[0]  # type: ignore[index]
    lists = conn.execute(
        "SELECT count(*) FROM (SELECT DISTINCT lexeme, project_id FROM memory.postings) l"
    ).fetchone()[0]  # type: ignore[index]
    out = {"postings": float(postings), "lists": float(lists)}
    for name, rel in (
        ("rows", "memory.postings"),
        ("packed", f"{SCHEMA}.packed"),
        ("arrays", f"{SCHEMA}.arrays"),
    ):
        # every partition's, on the partitioned layout (a partitioned table has no storage;
        # a plain one has no partition tree)
        size = conn.execute(
            "SELECT coalesce((SELECT sum(pg_total_relation_size(relid))"
            " FROM pg_partition_tree(%(r)s::regclass)), pg_total_relation_size(%(r)s::regclass))",
            {"r": rel},
        ).fetchone()
        out[f"{name}_bytes_per_posting"] = round(float(size[0]) / max(postings, 1), 1)  # type: ignore[index]
        if name != "rows":
            n = conn.execute(f"SELECT count(*) FROM {rel}").fetchone()
            out[f"{name}_blocks"] = float(n[0])  # type: ignore[index]
    return out


def _numpy_in_database(conn: psycopg.Connection[Any]) -> str | None:
    """Why the PL/Python scorer cannot run here (None: it can)."""
    try:
        conn.execute("CREATE EXTENSION IF NOT EXISTS plpython3u")
        conn.execute(SCORERS["packed+numpy"])
        conn.execute(f"SELECT * FROM {SCHEMA}.packed_numpy('{{}}', '{{}}', 1, 1, 1, 0, 1)")
    except psycopg.Error as e:
        return str(e).splitlines()[0]
    return None


def measure(
    url: str, queries: Sequence[tuple[str, str]], args: argparse.Namespace
) -> dict[str, Any]:
    """Builds the blocks beside the postings, scores every query with each scorer, and drops
    the scratch schema (unless --keep-db), whatever happened."""
    try:
        return _measure(url, queries, args)
    finally:
        if not args.keep_db:
            with connect(url, autocommit=True) as owner:
                owner.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")


def _local_backend(pid: int) -> int:
    """The backend's pid, when its CPU can be read here: a server on another machine or in
    another pid namespace would give zeros, or another process's time."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            if f.read().startswith("postgres"):
                return pid
    except OSError:
        pass
    raise SystemExit(f"backend {pid} is not a local postgres process: run the bench on the server")


def _as_the_service(owner: psycopg.Connection[Any]) -> str:
    """Lets the service's role run the scorers under row-level security, as it runs
    memory.lexical_search: the blocks get memory.postings' own read policy (its expression,
    read from the catalog), and the role the scratch schema. Returns the role."""
    row = owner.execute("SELECT service FROM memory.roles()").fetchone()
    qual = owner.execute(
        "SELECT pg_get_expr(polqual, polrelid) FROM pg_policy"
        " WHERE polrelid = 'memory.postings'::regclass AND polname = 'granted_read'"
    ).fetchone()
    assert row is not None and qual is not None
    for blocks in ("packed", "arrays"):
        owner.execute(f"ALTER TABLE {SCHEMA}.{blocks} ENABLE ROW LEVEL SECURITY")
        owner.execute(
            f"CREATE POLICY granted_read ON {SCHEMA}.{blocks} FOR SELECT USING ({qual[0]})"
        )
    owner.execute(f"GRANT USAGE ON SCHEMA {SCHEMA} TO {row[0]}")
    owner.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA {SCHEMA} TO {row[0]}")
    owner.execute(f"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {SCHEMA} TO {row[0]}")
    return str(row[0])


def _measure(
    url: str, queries: Sequence[tuple[str, str]], args: argparse.Namespace
) -> dict[str, Any]:
    with connect(url, autocommit=True) as owner:
        owner.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        owner.execute(f"CREATE SCHEMA {SCHEMA}")
        build: dict[str, float] = {}
        for name, sql in BUILD.items():
            t0 = time.perf_counter()
            with owner.transaction():
                for statement in sql.split(";\n"):
                    owner.execute(statement, {"block": args.block})
            build[f"{name}_seconds"] = round(time.perf_counter() - t0, 2)
        owner.execute("VACUUM ANALYZE memory.postings")
        owner.execute(f"VACUUM ANALYZE {SCHEMA}.packed")
        owner.execute(f"VACUUM ANALYZE {SCHEMA}.arrays")
        owner.execute(TERMS)
        for name in ("rows", "arrays+sql"):
            owner.execute(SCORERS[name])
        no_numpy = _numpy_in_database(owner)
        service = _as_the_service(owner)
        sizes = _sizes(owner)
        pids = dict(owner.execute("SELECT name, id FROM memory.projects").fetchall())
        work = []
        for text, project in queries:
            t = owner.execute(
                f"SELECT * FROM {SCHEMA}.terms(%s, %s, %s)", (text, pids[project], args.k)
            ).fetchone()
            if t is not None and t[0]:
                work.append((text, project, pids[project], t))
    names = ["terms", "rows", "lexical_search", "arrays+sql"]
    names += [] if no_numpy else ["packed+numpy"]
    # as the HTTP service reads, with no key: its login, every project asserted
    with connect(url, autocommit=True) as owner:
        conns = {n: service_connection(url, owner, Settings.from_env()) for n in names}
    try:
        backend = {n: _local_backend(int(c.info.backend_pid)) for n, c in conns.items()}

        def one_pass(name: str) -> tuple[float, float, list[list[int]]]:
            c, got = conns[name], []
            cpu0, t0 = process_cpu_ns(backend[name]), time.perf_counter()
            for text, project, pid, (lex, w, c1, c2, c3) in work:
                if name == "lexical_search":
                    rows = c.execute(LEXICAL, (text, project, args.k)).fetchall()
                elif name == "terms":
                    rows = c.execute(TERMS_CALL, (text, pid, args.k)).fetchall()
                else:
                    rows = c.execute(CALLS[name], (lex, w, c1, c2, c3, pid, args.k)).fetchall()
                got.append([r[0] for r in rows])
            n = max(len(work), 1)
            return (
                (process_cpu_ns(backend[name]) - cpu0) / 1e6 / n,
                (time.perf_counter() - t0) * 1000 / n,
                got,
            )

        for name in names:  # warm: plans, caches, numpy's import
            one_pass(name)
        cpu: dict[str, list[float]] = {n: [] for n in names}
        wall: dict[str, list[float]] = {n: [] for n in names}
        same: dict[str, list[int]] = {n: [] for n in names}
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            lists = {}
            for name in order:
                c_ms, w_ms, lists[name] = one_pass(name)
                cpu[name].append(c_ms)
                wall[name].append(w_ms)
            for name in names[2:]:  # not the terms, nor the reference itself
                same[name].append(
                    sum(a == b for a, b in zip(lists["rows"], lists[name], strict=True))
                )
            print(
                f"round {r + 1}: "
                + ", ".join(f"{n} {cpu[n][-1]:.3f}" for n in names)
                + " ms CPU a query",
                file=sys.stderr,
            )
    finally:
        for c in conns.values():
            c.close()
    base = statistics.median(cpu["rows"])
    return {
        "queries": len(work),
        "role": service,
        "k": args.k,
        "block": args.block,
        "rounds": args.rounds,
        "sizes": sizes,
        "build": build,
        "numpy_unavailable": no_numpy,
        "scorers": {
            n: {
                "cpu_ms": round(statistics.median(cpu[n]), 3),
                "over_rows": round(statistics.median(cpu[n]) / base, 3) if base else None,
                "wall_ms": round(statistics.median(wall[n]), 3),
                "same_top_k": min(same[n]) if same[n] else None,
            }
            for n in names
        },
    }


def report(r: dict[str, Any]) -> str:
    s = r["sizes"]
    lines = [
        f"{r['queries']} queries, top {r['k']}, {int(s['postings']):,} postings, blocks of"
        f" {r['block']}, medians of {r['rounds']} passes, as {r['role']} under row-level security",
        table(
            [
                ["rows (memory.postings and its indexes)", s["rows_bytes_per_posting"], 1.0, "-"],
                [
                    "packed (bytea)",
                    s["packed_bytes_per_posting"],
                    round(s["packed_bytes_per_posting"] / s["rows_bytes_per_posting"], 3),
                    r["build"]["packed_seconds"],
                ],
                [
                    "arrays (int8[], int4[])",
                    s["arrays_bytes_per_posting"],
                    round(s["arrays_bytes_per_posting"] / s["rows_bytes_per_posting"], 3),
                    r["build"]["arrays_seconds"],
                ],
            ],
            ["layout", "bytes a posting", "÷ rows", "built from the rows, s"],
        ),
        table(
            [
                [
                    "the terms alone (not in the scorers below)" if n == "terms" else n,
                    v["cpu_ms"],
                    v["over_rows"],
                    v["wall_ms"],
                    "-" if v["same_top_k"] is None else f"{v['same_top_k']}/{r['queries']}",
                ]
                for n, v in r["scorers"].items()
            ],
            ["scorer", "backend CPU ms a query", "÷ rows", "wall ms", "top k as rows"],
        ),
    ]
    if r["numpy_unavailable"]:
        lines.append(f"packed+numpy not measured: {r['numpy_unavailable']}")
    return "\n\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = module_parser(__doc__)
    add_arguments(ap)
    args = ap.parse_args(argv)
    if args.reuse:
        name, url = None, make_conninfo(args.url, dbname=args.reuse)
    else:
        name, url = fresh_database(args.url, "poimen_bench_blocks")
    try:
        if args.natural is not None:
            if args.reuse:
                qfile = sorted(args.natural.glob("queries*.jsonl"))[0]
                lines = qfile.read_text().splitlines()[: args.queries]
                queries = [(q["text"], q["project"]) for q in map(json.loads, lines)]
            else:
                queries = _natural(url, args.natural, args.queries)
        else:
            queries = _synthetic(
                url, args.nodes, args.dim, args.queries, args.seed, load=not args.reuse
            )
        result = measure(url, queries, args)
    finally:
        if name is not None and not args.keep_db:
            drop_database(args.url, name)
        elif name is not None:
            print(f"kept database {name}", file=sys.stderr)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
