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
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psycopg

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
    p.add_argument("--keep-db", action="store_true")
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


def measure(
    owner: psycopg.Connection[Any],
    service: psycopg.Connection[Any],
    corpus: synthetic.Corpus,
    db_ids: np.ndarray[Any, Any],
    queries: dict[str | None, np.ndarray[Any, Any]],
    scope_list: list[tuple[str, str | None, np.ndarray[Any, Any]]],
) -> list[dict[str, Any]]:
    """Each scope's settings interleaved query by query: default, exact stage off, and on
    the HNSW path ef_search 100. The policy is switched by the owner between calls."""
    pos = {int(d): i for i, d in enumerate(db_ids)}
    filtered_ef = int(_one(owner, "SELECT memory._policy_value('filtered_ef_search')"))
    cap = int(_one(owner, "SELECT memory._policy_value('exact_scan_max_nodes')"))
    results = []
    for label, project, idx in scope_list:
        qv = queries[project]
        truth = _truth(corpus.vectors, idx, qv)
        exact_default = project is not None and cap > 0 and len(idx) <= cap
        settings: list[tuple[str, int | None, bool]] = [("default", None, True)]
        if exact_default:
            settings.append(("exact stage off", None, False))
        if project is not None:
            settings.append(("HNSW, ef_search 100", 100, False))
        found: dict[str, list[list[int]]] = {s[0]: [] for s in settings}
        ms: dict[str, list[float]] = {s[0]: [] for s in settings}
        for i, vec in enumerate(qv):
            order = settings if i % 2 == 0 else settings[::-1]
            for name, ef, exact in order:
                owner.execute(
                    "SELECT memory.set_policy('exact_scan_max_nodes', %s)",
                    (str(cap) if exact else "0",),
                )
                t, ids = _run(service, vec, project, ef)
                ms[name].append(t)
                found[name].append([pos[d] for d in ids])
        owner.execute("SELECT memory.reset_policy('exact_scan_max_nodes')")
        if cap != 5000:
            owner.execute("SELECT memory.set_policy('exact_scan_max_nodes', %s)", (str(cap),))
        for name, ef, exact in settings:
            path = (
                "exact"
                if exact and exact_default
                else f"hnsw ef {ef or (filtered_ef if project is not None else 100)}"
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


def service_connection(
    url: str, owner: psycopg.Connection[Any], s: Settings
) -> psycopg.Connection[Any]:
    """A connection as the service's role under row-level security, every project asserted
    (anonymous mode), as the service's pool has it."""
    from psycopg.conninfo import make_conninfo

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
    name, url = fresh_database(server)
    out: dict[str, Any] = {"corpus": args.corpus, "nodes": args.nodes, "queries": args.queries}
    try:
        with connect(url, autocommit=True) as owner:
            migrate(owner, None)
            model = "synthetic" if real is None else "realistic-minilm"
            load = synthetic.load(owner, corpus, model)
            db_ids = load.pop("db_ids")
            out["load"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in load.items()}
            scope_list = scopes(corpus)
            queries: dict[str | None, np.ndarray[Any, Any]] = {None: corpus.query_vectors}
            for _label, project, _idx in scope_list[1:]:
                assert project is not None
                queries[project] = (
                    realistic.project_queries(real, corpus, project, args.queries)
                    if real is not None
                    else _nearby(corpus, project, args.queries, args.seed)
                )
            with service_connection(url, owner, s) as service:
                for _label, project, _idx in scope_list:  # warm-up, discarded
                    _run(service, queries[project][0], project, None)
                out["results"] = measure(owner, service, corpus, db_ids, queries, scope_list)
            if real is not None:
                out["profile"] = {
                    "real": realistic.profile(real.vectors),
                    "corpus": realistic.profile(corpus.vectors),
                }
    finally:
        if not args.keep_db:
            drop_database(server, name)
    _print(out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def _nearby(corpus: synthetic.Corpus, project: str, count: int, seed: int) -> np.ndarray[Any, Any]:
    """Synthetic queries for a project: its own nodes, perturbed as synthetic.generate does."""
    rng = np.random.default_rng(seed + 3)
    idx = np.array([i for i, p in enumerate(corpus.projects) if p == project])
    src = corpus.vectors[rng.choice(idx, size=count)]
    dim = corpus.vectors.shape[1]
    jitter = rng.standard_normal(src.shape).astype(np.float32) / np.sqrt(dim)
    v = src + jitter
    return np.ascontiguousarray(v / np.linalg.norm(v, axis=1, keepdims=True))


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
    if "profile" in out:
        print("neighbour profile (median cosine): " + json.dumps(out["profile"]))
