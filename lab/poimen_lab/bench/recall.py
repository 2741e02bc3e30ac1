"""`poimen-memory bench-recall`: semantic recall@10 of memory.semantic_search against numpy's
exact top 10, unfiltered and for projects of several sizes, as the service's own role under
row-level security (every project asserted, as anonymous mode does), on the realistic corpus
(real MiniLM vectors recombined: bench/realistic.py) or the synthetic one.

For each project the run compares, query by query and interleaved (one run, same warm
caches): the default path (exact stage for a project up to exact_scan_max_nodes, HNSW at
filtered_ef_search above it) against the exact stage off (exact_scan_max_nodes = 0) and, on
the HNSW path, ef_search 100 (the unfiltered default) against filtered_ef_search. Medians."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import psycopg.sql
from psycopg.conninfo import make_conninfo

from poimen_lab.bench import realistic, synthetic
from poimen_lab.bench.ann import K, recall
from poimen_lab.bench.scratch import drop_database, fresh_database
from poimen_lab.measures import percentile
from poimen_lab.report import table
from poimen_memory.db.connect import connect, database_url, ensure_service_login
from poimen_memory.db.migrate import migrate
from poimen_memory.db.queries import q
from poimen_memory.settings import Settings

SEMANTIC = "SELECT node_id FROM memory.semantic_search(%s, %s, NULL, %s, %s)"
# Target shares of the store for the filtered runs (the project nearest each is measured).
SHARES = (0.10, 0.01, 0.001)


def add_corpus_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--corpus",
        choices=("real", "synthetic"),
        default="synthetic",
        help="real: MiniLM vectors of the LoCoMo and SciFact texts recombined (bench/realistic.py; "
        "embedded once, cached under --cache); synthetic: clustered Gaussian vectors",
    )
    p.add_argument(
        "--data",
        type=Path,
        default=realistic.DATA_DEFAULT,
        metavar="DIR",
        help="with --corpus real: the folder holding locomo-dev/ and scifact/ "
        "(default ../shared/data beside the repository)",
    )
    p.add_argument(
        "--cache",
        type=Path,
        default=realistic.CACHE_DEFAULT,
        help="with --corpus real: where the real vectors are cached (never the repository)",
    )
    p.add_argument(
        "--vectors-from",
        action="append",
        default=[],
        metavar="URL",
        help="with --corpus real: a database whose nodes already hold this embedder's vectors of "
        "these texts (e.g. the one `poimen-memory eval` ingested); texts found there are not "
        "embedded again (repeatable)",
    )
    p.add_argument(
        "--projects",
        type=int,
        default=1000,
        help="with --corpus real: Zipf-sized projects (the r-th holds a share ~ 1/r)",
    )


def real_texts(args: argparse.Namespace, s: Settings) -> realistic.RealTexts:
    """The real vectors (embedded once by the configured embedder, cached)."""
    from poimen_memory.embedders.factory import build_embedder

    embedder = build_embedder(s.embedding)
    folders = [args.data / name for name in realistic.SOURCES if (args.data / name).is_dir()]
    if not folders:
        raise SystemExit(f"error: --corpus real needs locomo-dev/ or scifact/ in {args.data}")
    known: dict[str, Any] = {}
    for url in args.vectors_from:
        known.update(stored_vectors(url, embedder.model_name))

    def embed(texts: list[str]) -> Any:
        missing = [t for t in texts if t not in known]
        if missing:
            known.update(zip(missing, embedder.embed_documents(missing), strict=True))
        return np.stack([np.asarray(known[t], dtype=np.float32) for t in texts])

    return realistic.embed_cached(folders, embed, embedder.model_name, args.cache)


def stored_vectors(url: str, model: str) -> dict[str, Any]:
    """text -> vector of a database's current nodes, when its model is ``model`` (ingest
    embeds a node's text alone, as embed_cached would)."""
    with connect(url) as conn:
        row = conn.execute("SELECT model FROM memory.embedding_model").fetchone()
        if row is None or row[0] != model:
            raise SystemExit(f"error: {url} holds vectors of {row and row[0]!r}, not {model!r}")
        rows = conn.execute(
            "SELECT text, embedding::real[] FROM memory.nodes"
            " WHERE embedding IS NOT NULL AND expired_at IS NULL"
        ).fetchall()
    return {str(t): np.asarray(v, dtype=np.float32) for t, v in rows}


def make_corpus(
    args: argparse.Namespace, s: Settings
) -> tuple[synthetic.Corpus, realistic.RealTexts | None]:
    if args.corpus == "real":
        if args.dim != 384:
            raise SystemExit("error: --corpus real has the embedder's 384 dimensions (--dim 384)")
        real = real_texts(args, s)
        corpus = realistic.generate(
            real, args.nodes, args.queries, seed=args.seed, projects=args.projects
        )
        return corpus, real
    return synthetic.generate(
        args.nodes, args.dim, args.queries, seed=args.seed, projects=100
    ), None


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "bench-recall",
        help="semantic recall@10 against an exact ground truth, unfiltered and per project",
        description=__doc__,
    )
    p.add_argument("--nodes", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--queries", type=int, default=200, help="queries per scope")
    p.add_argument("--seed", type=int, default=0)
    add_corpus_arguments(p)
    p.add_argument(
        "--answer-queries",
        type=int,
        default=100,
        metavar="N",
        help="queries per scope for memory_query()'s recall against an exact semantic leg "
        "(0: skip)",
    )
    for key in ("exact_scan_max_nodes", "project_graph_min_nodes", "project_graphs_max"):
        p.add_argument(
            "--" + key.replace("_", "-"),
            type=int,
            metavar="N",
            help=f"the policy's {key} for this run's database (default: the policy's own)",
        )
    p.add_argument(
        "--maintenance-work-mem",
        default="3GB",
        help="for the HNSW builds: above the largest graph (about 2 GB at 1M nodes)",
    )
    p.add_argument(
        "--http-requests",
        type=int,
        default=0,
        metavar="N",
        help="with --corpus real: GET /memory/query per scope, N requests at one client and N "
        "at eight, beside the embedder's own rate (0: skip)",
    )
    p.add_argument("--keep-db", action="store_true")
    p.add_argument(
        "--reuse-db",
        metavar="NAME",
        help="a database an earlier run kept (--keep-db) with the same --nodes, --seed and "
        "corpus: migrated by this checkout, then measured (kept afterwards)",
    )
    p.add_argument("--json", type=Path, metavar="OUT")
    p.set_defaults(func=cmd_bench_recall, corpus="real")


def _truth(
    vectors: np.ndarray[Any, Any], subset: np.ndarray[Any, Any], qv: np.ndarray[Any, Any]
) -> list[list[int]]:
    mat = np.ascontiguousarray(vectors[subset])
    out = []
    for v in qv:
        scores = mat @ v
        top = np.argpartition(-scores, min(K, len(subset) - 1))[:K]
        out.append([int(subset[j]) for j in top[np.argsort(-scores[top], kind="stable")]])
    return out


def scopes(
    corpus: synthetic.Corpus, shares: tuple[float, ...] = SHARES
) -> list[tuple[str, str | None, np.ndarray[Any, Any]]]:
    """(label, project, node indexes): everything, the largest project, and the project
    nearest each share of the store."""
    names, counts = np.unique(np.array(corpus.projects), return_counts=True)
    n = len(corpus.projects)
    out: list[tuple[str, str | None, np.ndarray[Any, Any]]] = [("unfiltered", None, np.arange(n))]
    picked: list[str] = []
    for share in (max(counts) / n, *shares):
        name = str(names[int(np.argmin(np.abs(counts / n - share)))])
        if name in picked:
            continue
        picked.append(name)
        idx = np.array([i for i, p in enumerate(corpus.projects) if p == name])
        out.append((f"project {100 * len(idx) / n:.2g}%", name, idx))
    return out


def _one(conn: psycopg.Connection[Any], sql: str) -> Any:
    row = conn.execute(sql).fetchone()
    assert row is not None
    return row[0]


def _run(
    conn: psycopg.Connection[Any], vec: Any, project: str | None, ef: int | None
) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    rows = conn.execute(SEMANTIC, (vec, project, K, ef)).fetchall()
    return (time.perf_counter() - t0) * 1000, [r[0] for r in rows]


# The HNSW stage's own SQL text (memory.stage_sql('semantic'): $1 vector, $2 k, $3 the
# visibility) with its project test written project_id + 0 = $4 beside a visibility that
# names no project (NULL: the current versions): the same rows, but a predicate the planner
# cannot match to a project's partial index (its own graph, memory._project_graphs), so the
# scan is the project-filtered one of the shared graph, as memory.semantic_search ran it
# before projects had graphs of their own. Sent with its parameters bound (a custom plan, as
# the function's EXECUTE has).
def shared_graph_sql(conn: psycopg.Connection[Any]) -> str:
    text = str(_one(conn, "SELECT memory.stage_sql('semantic')"))
    visible = "memory._visible(n, $3::memory.visibility)"
    assert text.count(visible) == 1 and "%" not in text, text
    text = text.replace(visible, visible + " AND n.project_id + 0 = $4")
    return re.sub(r"\$(\d+)", r"%(p\1)s", text)


def _run_shared(
    conn: psycopg.Connection[Any], sql: str, vec: Any, project_id: int, ef: int
) -> tuple[float, list[int]]:
    conn.execute(
        "SELECT set_config('hnsw.iterative_scan', 'relaxed_order', false),"
        " set_config('max_parallel_workers_per_gather', '0', false),"
        " set_config('hnsw.ef_search', %s, false)",
        (str(ef),),
    )
    params: dict[str, Any] = {"p1": vec, "p2": K, "p3": None, "p4": project_id}
    t0 = time.perf_counter()
    rows = conn.execute(sql, params, prepare=False).fetchall()
    ms = (time.perf_counter() - t0) * 1000
    conn.execute("RESET hnsw.iterative_scan; RESET max_parallel_workers_per_gather; "
                 "RESET hnsw.ef_search")  # fmt: skip
    return ms, [r[0] for r in rows]


def own_graphs(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """project name -> id, for the projects that have HNSW graphs of their own."""
    rows = conn.execute(
        "SELECT p.name, p.id FROM memory.projects p WHERE EXISTS ("
        " SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
        " WHERE i.indrelid = 'memory.nodes'::regclass AND i.indisvalid"
        " AND c.relname = (memory._project_graph_names(p.id))[1])"
    ).fetchall()
    return {str(n): int(i) for n, i in rows}


def measure(
    owner: psycopg.Connection[Any],
    service: psycopg.Connection[Any],
    corpus: synthetic.Corpus,
    db_ids: np.ndarray[Any, Any],
    queries: dict[str | None, tuple[np.ndarray[Any, Any], list[str]]],
    scope_list: list[tuple[str, str | None, np.ndarray[Any, Any]]],
) -> list[dict[str, Any]]:
    """Each scope's settings interleaved query by query: default, exact stage off, and on
    the HNSW path ef_search 100; for a project with graphs of its own, the shared graph's
    project-filtered scan beside them (at filtered_ef_search and at 100). The policy is
    switched by the owner between calls."""
    pos = {int(d): i for i, d in enumerate(db_ids)}
    filtered_ef = int(_one(owner, "SELECT memory._policy_value('filtered_ef_search')"))
    # what a scan naming no project runs at here (large_store_ef_search past large_store_nodes)
    unfiltered_ef = int(_one(owner, "SELECT coalesce(memory._semantic_ef(NULL), 100)"))
    cap = int(_one(owner, "SELECT memory._policy_value('exact_scan_max_nodes')"))
    own = own_graphs(owner)
    shared_sql = shared_graph_sql(owner)
    results = []
    for label, project, idx in scope_list:
        qv = queries[project][0]
        truth = _truth(corpus.vectors, idx, qv)
        exact_default = project is not None and cap > 0 and len(idx) <= cap
        # (name, ef_search, exact stage on, the shared graph's filtered scan)
        settings: list[tuple[str, int | None, bool, bool]] = [("default", None, True, False)]
        if exact_default:
            settings.append(("exact stage off", None, False, False))
        if project is not None:
            settings.append(("HNSW, ef_search 100", 100, False, False))
            if project in own:
                settings.append(("HNSW, ef_search 200", 200, False, False))
        else:
            # what a wider beam buys the unfiltered scan as the store grows
            wider = [ef for ef in (100, 200, 400) if ef != unfiltered_ef]
            settings += [(f"ef_search {ef}", ef, False, False) for ef in wider]
        if project in own:
            settings.append(("shared graph", filtered_ef, False, True))
            settings.append(("shared graph, ef_search 100", 100, False, True))
        found: dict[str, list[list[int]]] = {s[0]: [] for s in settings}
        ms: dict[str, list[float]] = {s[0]: [] for s in settings}
        try:
            for i, vec in enumerate(qv):
                order = settings if i % 2 == 0 else settings[::-1]
                for name, ef, exact, shared in order:
                    if shared:
                        assert project is not None and ef is not None
                        t, ids = _run_shared(service, shared_sql, vec, own[project], ef)
                    else:
                        owner.execute(
                            "SELECT memory.set_policy('exact_scan_max_nodes', %s)",
                            (str(cap) if exact else "0",),
                        )
                        t, ids = _run(service, vec, project, ef)
                    ms[name].append(t)
                    found[name].append([pos[d] for d in ids])
        finally:
            # The store's own setting back, whatever stopped the run.
            owner.execute("SELECT memory.set_policy('exact_scan_max_nodes', %s)", (str(cap),))
        for name, ef, exact, shared in settings:
            graph = "own graph" if project in own and not shared else "shared graph"
            path = (
                "exact"
                if exact and exact_default
                else f"{graph}, ef {ef or (filtered_ef if project is not None else unfiltered_ef)}"
            )
            results.append(
                {
                    "scope": label,
                    "project": project,
                    "nodes": len(idx),
                    "setting": name,
                    "path": path,
                    "queries": len(qv),
                    "recall@10": round(recall(found[name], truth), 4),
                    "p50_ms": round(statistics.median(ms[name]), 3),
                    "p95_ms": round(percentile(ms[name], 95), 3),
                }
            )
    return results


ANSWER = "SELECT node_id FROM memory_query(%s, %s, %s, k => %s)"


def answer_recall(
    owner: psycopg.Connection[Any],
    service: psycopg.Connection[Any],
    queries: dict[str | None, tuple[np.ndarray[Any, Any], list[str]]],
    scope_list: list[tuple[str, str | None, np.ndarray[Any, Any]]],
    count: int,
) -> list[dict[str, Any]]:
    """recall@10 of memory_query() (the one pipeline at its defaults: both legs, fusion, the
    default levels L1/L2) against the same calls with an exact semantic leg. The ground truth
    is computed by the owner in a transaction that drops every HNSW index on memory.nodes,
    so each semantic leg is a scan and an exact sort, and is rolled back; the defaults then
    run as the service's role under row-level security, which sees the same rows (every
    project asserted)."""
    calls = [
        (label, project, text, vec)
        for label, project, _idx in scope_list
        for vec, text in list(zip(*queries[project], strict=True))[:count]
    ]
    truth: list[list[int]] = []
    truth_ms: dict[str, list[float]] = {}
    with owner.transaction(force_rollback=True):
        for (index,) in owner.execute(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "JOIN pg_am a ON a.oid = c.relam "
            "WHERE i.indrelid = 'memory.nodes'::regclass AND a.amname = 'hnsw'"
        ).fetchall():
            drop = psycopg.sql.SQL("DROP INDEX memory.{}")
            owner.execute(drop.format(psycopg.sql.Identifier(index)))
        for label, project, text, vec in calls:
            t0 = time.perf_counter()
            truth.append([r[0] for r in owner.execute(ANSWER, (text, vec, project, K)).fetchall()])
            truth_ms.setdefault(label, []).append((time.perf_counter() - t0) * 1000)
    found: dict[str, list[list[int]]] = {}
    want: dict[str, list[list[int]]] = {}
    ms: dict[str, list[float]] = {}
    for (label, project, text, vec), exact in zip(calls, truth, strict=True):
        t0 = time.perf_counter()
        got = [r[0] for r in service.execute(ANSWER, (text, vec, project, K)).fetchall()]
        ms.setdefault(label, []).append((time.perf_counter() - t0) * 1000)
        found.setdefault(label, []).append(got)
        want.setdefault(label, []).append(exact)
    return [
        {
            "scope": label,
            "project": project,
            "nodes": len(idx),
            "queries": len(found[label]),
            "recall@10": round(_id_recall(found[label], want[label]), 4),
            "p50_ms": round(statistics.median(ms[label]), 3),
            "exact_p50_ms": round(statistics.median(truth_ms[label]), 3),
        }
        for label, project, idx in scope_list
        if label in found
    ]


def http_rows(
    service_url: str,
    questions: list[str],
    scope_list: list[tuple[str, str | None, np.ndarray[Any, Any]]],
    requests: int,
    embedder: Any,
) -> dict[str, Any]:
    """GET /memory/query (limit 10, no evidence list) per scope, one client and eight, as the
    service's role (anonymous mode), with the embedder's own rate at eight threads beside
    it. Each request a question text not sent before (no embedding-cache hits)."""
    from poimen_lab.bench import inprocess
    from poimen_lab.bench.http import loads, serving

    need = 5 + 2 * requests
    texts = [f"{questions[i % len(questions)]} ({i})" for i in range(need * (len(scope_list) + 1))]
    rows: dict[str, Any] = {"scopes": []}
    # One server for every scope (each scope's texts its own, so no cache hits): a server
    # started per scope cost the run more than its requests did.
    with serving(service_url) as served:
        for n, (label, project, idx) in enumerate(scope_list):
            params = {"limit": "10", "evidence": "0"} | ({"project": project} if project else {})
            rows["scopes"].append({
                "scope": label, "project": project, "nodes": len(idx),
                "loads": loads(served, service_url, texts[n * need : (n + 1) * need],
                               requests=requests, params=params),
            })  # fmt: skip
    rows["embed_only"] = inprocess.embed_throughput(
        embedder.embed_query, texts[len(scope_list) * need :], 8
    )
    return rows


def _id_recall(found: list[list[int]], truth: list[list[int]]) -> float:
    """Mean share of each exact answer's ids the default answer holds (an answer shorter
    than k, as a min_cosine floor or a thin project gives, counts against its own length)."""
    shares = [len(set(f) & set(t)) / len(t) for f, t in zip(found, truth, strict=True) if t]
    return statistics.fmean(shares) if shares else 1.0


def service_connection(
    url: str, owner: psycopg.Connection[Any], s: Settings
) -> psycopg.Connection[Any]:
    """A connection as the service's role under row-level security, every project asserted
    (anonymous mode), as the service's pool has it."""
    from poimen_memory.db.tenant import ALL_PROJECTS

    ensure_service_login(owner, s.service_role)
    conn = connect(make_conninfo(url, user=s.service_role), autocommit=True)
    row = conn.execute(
        "SELECT rolsuper, rolbypassrls FROM pg_roles WHERE rolname = current_user"
    ).fetchone()
    assert row == (False, False), "the service role must be under row-level security"
    conn.execute(q("assert_projects_session"), ALL_PROJECTS.params())
    return conn


def cmd_bench_recall(args: argparse.Namespace) -> int:
    s = Settings.from_env()
    server = database_url(s, start=True)
    t0 = time.perf_counter()
    corpus, real = make_corpus(args, s)
    print(
        f"bench-recall: {args.nodes} nodes generated in {time.perf_counter() - t0:.1f}s",
        file=sys.stderr,
    )
    if args.reuse_db:
        name, url = args.reuse_db, make_conninfo(server, dbname=args.reuse_db)
    else:
        name, url = fresh_database(server)
    out: dict[str, Any] = {"corpus": args.corpus, "nodes": args.nodes, "queries": args.queries}
    try:
        with connect(url, autocommit=True) as owner:
            # The HNSW builds (the shared graphs, then each large project's) hold a graph in
            # memory; past it they slow down by an order of magnitude.
            owner.execute(
                "SELECT set_config('maintenance_work_mem', %s, false)", (args.maintenance_work_mem,)
            )
            t0 = time.perf_counter()
            migrate(owner, s.plpython_root, role_prefix=s.role_prefix)
            # Before the load: its index pass builds the graphs these thresholds ask for.
            # (project_graphs_max: issue 28's runs had no cap; 1000 reproduces them)
            for key in ("exact_scan_max_nodes", "project_graph_min_nodes", "project_graphs_max"):
                value = getattr(args, key)
                if value is not None:
                    owner.execute("SELECT memory.set_policy(%s, %s)", (key, str(value)))
            if args.reuse_db:
                # Migrate builds what this checkout's SQL wants of the kept database (the
                # graphs of its large projects among them), so the timing is migrate's.
                out["load"] = {"migrate_seconds": round(time.perf_counter() - t0, 3)}
                ids = dict(owner.execute("SELECT external_id, id FROM memory.nodes").fetchall())
                db_ids = np.array([ids[f"n{i}"] for i in range(args.nodes)], dtype=np.int64)
            else:
                model = "synthetic" if real is None else "realistic-minilm"
                load = synthetic.load(owner, corpus, model)
                db_ids = load.pop("db_ids")
                out["load"] = {
                    k: round(v, 3) if isinstance(v, float) else v for k, v in load.items()
                }
            scope_list = scopes(corpus)
            queries: dict[str | None, tuple[np.ndarray[Any, Any], list[str]]] = {
                None: (corpus.query_vectors, corpus.query_texts)
            }
            for _label, project, _idx in scope_list[1:]:
                assert project is not None
                queries[project] = (
                    realistic.project_queries(real, corpus, project, args.queries)
                    if real is not None
                    else _nearby(corpus, project, args.queries, args.seed)
                )
            with service_connection(url, owner, s) as service:
                for _label, project, _idx in scope_list:  # warm-up, discarded
                    _run(service, queries[project][0][0], project, None)
                out["results"] = measure(owner, service, corpus, db_ids, queries, scope_list)
                if args.answer_queries > 0:
                    out["answers"] = answer_recall(
                        owner, service, queries, scope_list, args.answer_queries
                    )
            if args.http_requests > 0:
                from poimen_memory.embedders.factory import build_embedder

                if real is None:
                    raise SystemExit("error: --http-requests needs --corpus real")
                out["http"] = http_rows(
                    make_conninfo(url, user=s.service_role),
                    real.questions,
                    scope_list,
                    args.http_requests,
                    build_embedder(s.embedding),
                )
            if real is not None:
                out["profile"] = {
                    "real": realistic.profile(real.vectors),
                    "corpus": realistic.profile(corpus.vectors),
                }
    finally:
        if not args.keep_db and not args.reuse_db:
            drop_database(server, name)
    _print(out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def _nearby(
    corpus: synthetic.Corpus, project: str, count: int, seed: int
) -> tuple[np.ndarray[Any, Any], list[str]]:
    """Synthetic queries for a project: its own nodes, perturbed as synthetic.generate does,
    with their texts."""
    rng = np.random.default_rng(seed + 3)
    idx = np.array([i for i, p in enumerate(corpus.projects) if p == project])
    picks = rng.choice(idx, size=count)
    src = corpus.vectors[picks]
    dim = corpus.vectors.shape[1]
    jitter = rng.standard_normal(src.shape).astype(np.float32) / np.sqrt(dim)
    v = src + jitter
    return np.ascontiguousarray(v / np.linalg.norm(v, axis=1, keepdims=True)), [
        corpus.texts[int(i)] for i in picks
    ]


def _print(out: dict[str, Any]) -> None:
    print(
        f"{out['corpus']} corpus, {out['nodes']} nodes; recall@10 against numpy's exact top 10; "
        "memory.semantic_search as the service's role under row-level security; medians"
    )
    print(
        table(
            [
                [
                    r["scope"],
                    r["project"] or "-",
                    r["nodes"],
                    r["setting"],
                    r["path"],
                    r["recall@10"],
                    r["p50_ms"],
                    r["p95_ms"],
                ]
                for r in out.get("results", [])
            ],
            ["scope", "project", "nodes", "setting", "path", "recall@10", "p50_ms", "p95_ms"],
        )
    )
    if out.get("answers"):
        print(
            "memory_query() (k 10, the default levels) against the same calls with an exact "
            "semantic leg; medians"
        )
        print(
            table(
                [
                    [a["scope"], a["project"] or "-", a["nodes"], a["queries"], a["recall@10"],
                     a["p50_ms"], a["exact_p50_ms"]]
                    for a in out["answers"]
                ],
                ["scope", "project", "nodes", "queries", "recall@10", "p50_ms", "exact_p50_ms"],
            )
        )  # fmt: skip
    if out.get("http"):
        h = out["http"]
        print(
            "GET /memory/query (limit 10, no evidence list) as the service's role; the "
            f"embedder alone: {h['embed_only']['queries_per_s']} q/s at 8 threads"
        )
        print(
            table(
                [
                    [x["scope"], x["project"] or "-", x["nodes"], load["clients"],
                     load["p50_ms"], load["p95_ms"], load["req_per_s"], load["errors"]]
                    for x in h["scopes"]
                    for load in x["loads"]
                ],
                ["scope", "project", "nodes", "clients", "p50_ms", "p95_ms", "req_per_s", "errors"],
            )
        )  # fmt: skip
    if "profile" in out:
        print("neighbour profile (median cosine): " + json.dumps(out["profile"]))


def main(argv: list[str] | None = None) -> int:
    """`python -m poimen_lab.bench.recall RUN.json ... --plot OUT.png`: recall@10 against the
    store's size, from bench-recall runs at several sizes."""
    from poimen_lab.bench.plot import recall_by_size

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("runs", nargs="+", type=Path, help="bench-recall --json outputs")
    ap.add_argument("--plot", type=Path, required=True, metavar="OUT")
    args = ap.parse_args(argv)
    recall_by_size(args.plot, [json.loads(p.read_text()) for p in args.runs])
    print(args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
