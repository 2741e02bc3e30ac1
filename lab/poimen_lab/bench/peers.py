"""`poimen-memory bench-peers`: poimen-memory beside the PostgreSQL recipes a user would pick
instead (issue 42), in one database of the same cluster, from the same nodes and the same
vectors, the same questions sent to every system in turn, query by query.

The peers:

- **Supabase's hybrid_search** (https://supabase.com/docs/guides/ai/hybrid-search): a
  ``documents`` table with a stored ``tsvector`` (``to_tsvector('english', content)``, GIN)
  and a pgvector column (HNSW, ``vector_ip_ops``), and the documented SQL function: full text
  (``websearch_to_tsquery``, ranked by ``ts_rank_cd``) and inner product, each
  ``least(match_count, 30) * 2`` deep, fused by RRF (k 50, weights 1). Added to the recipe: a
  ``project`` column and a ``filter_project`` argument applied in both legs (the questions
  are asked of one conversation each). Its semantic leg orders by ``row_number()`` over the
  distance, which the planner cannot stop early: it computes every row's distance and sorts
  (a sequential scan, exact; the HNSW index goes unused at these sizes).
- **langchain-postgres' PGVectorStore with HybridSearchConfig** (when the package imports;
  ``lab[peers]``, see docs/benchmarks.md): its own table (content, embedding, a ``content_tsv``
  column, metadata columns ``project`` and ``node_id``), HNSW (cosine) and GIN indexes made by
  ``apply_vector_index`` and ``apply_hybrid_search_index``; ``similarity_search`` runs a dense
  statement (``hnsw.iterative_scan = strict_order`` on its sessions, pgvector 0.8's way to
  fill a filtered HNSW scan) and a sparse one (``plainto_tsquery``, ``ts_rank_cd``) and
  fuses them in Python with ``reciprocal_rank_fusion`` (k 60), each leg ``2 * k`` deep.
  Each call gets a fresh copy of the config: the store writes the first query's text into
  the shared config and runs every later query's full-text leg with it (0.0.19).
- **poimen-memory**: ``GET /memory/query`` of the real server (``poimen-memory serve`` in a
  child process, the local embedder, its embedding cache off, no reranker) connected as the
  service's role under row-level security, with its default evidence list and with
  ``evidence=0``.

The peers hold the L0 nodes (what they can cite), their content the node's title and text as
our lexical index reads them, their vectors copied from ``memory.nodes``; they embed each
question in this process with the same local model, as a client of theirs would.

Quality, per question, on the set's own measure: a folder with L1/L2 nodes (LoCoMo) is
scored by evidence recall: the gold L0 turns among the turns an answer cites (ours: a
limit-10 answer at the default levels, its trees and evidence list; a peer: its top
``--turns`` L0 rows, 20 by default, what our answer cites); a folder of L0 nodes only
(SciFact) by nDCG@10 of the top 10 (ours at ``level=L0``).

Cost, per question and system: wall time of the call, and CPU time (from /proc's schedstat,
nanoseconds) of the PostgreSQL backends that served it, of the server process (ours), and of
this process around the call (the client: embedding the question for a peer, langchain's
Python fusion, parsing).

Throughput (``--clients N``, off by default): after that pass, each system in turn (the order
rotating per round, ``--rounds``) gets N concurrent clients for ``--seconds``, each cycling
through the set's questions from its own starting point, and reports queries a second
(answers completed / the window), p50 and p95 latency under that load, errors, and CPU per
query over the window (the same three parts). A client is a thread with its own connection:
Supabase, a psycopg connection (the question embedded in that thread, as before); poimen, an
HTTP connection to the server (the server embeds); langchain, the one store whose sync calls
all run on the engine's single event-loop thread (``PGEngine``), N of them at a time over a
SQLAlchemy pool of at least N connections (its pool is sized to the clients, so none is
closed and reopened under load). Before each window every client asks one question, so the
pools (langchain's, the server's) hold their connections before the clock starts. The
server's per-client share (``POIMEN_HTTP_CLIENT_INFLIGHT``, 8) is raised to N when N is
larger: the N threads come from one address, and are N clients, as the peers' are.

The version before a change (``--base REF``, issue 42's "the run before the change beside
it"): the machine's speed drifts by 10-25% between runs and between boots, so a change is
measured against the commit it changes in the same run, question by question. The base's
``service`` and ``plpython`` folders are taken from git (``git archive``, kept under
``--cache``); its database is a copy of the loaded one (``CREATE DATABASE ... TEMPLATE``)
that the base's own code migrates (its SQL functions over the same rows and indexes), and its
own server runs from those folders. This version answers from a copy too, made the same way,
so that neither side reads the database the load and the peers' builds wrote. Run HEAD
against HEAD to see the noise: SciFact's database CPU measured 1.022x and 1.023x with this
version on the original, 0.981x and 0.979x with both on copies (LoCoMo within 1.2%).
Each poimen system then has a twin ``<name>@base``, asked the same questions in the same
rotation, and the table adds this version over the base: CPU per question (the ratio of
means and the median of the per-question ratios) and how many answers are identical. The
base's copy is made before this version migrates a reused database (``--database``), so a
database last migrated by the base serves a change that adds a run-once migration; a base
whose code lacks a migration the loaded database holds is refused by its own migrate (a
database is never migrated backwards).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import http.client
import importlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import numpy as np
import psycopg
from pgvector.psycopg import register_vector
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from poimen_lab.bench import realistic, synthetic
from poimen_lab.bench.scratch import drop_database, fresh_database
from poimen_lab.eval.data import EvalData
from poimen_lab.eval.data import load as load_eval
from poimen_lab.live_server import live_server_process
from poimen_lab.measures import coverage, ndcg_at
from poimen_lab.report import table
from poimen_memory.db.connect import connect, database_url, ensure_service_login
from poimen_memory.db.migrate import migrate
from poimen_memory.db.queries import q as query_sql
from poimen_memory.settings import Settings

DATA_DEFAULT = Path(__file__).resolve().parents[3].parent / "shared" / "data"
CACHE_DEFAULT = Path("/tmp/poimen-bench-cache")
SUPABASE_APP = "peer_supabase"
LANGCHAIN_APP = "peer_langchain"

# The recipe as documented, plus `project` (the tenant) and `node_id` (which memory.nodes row
# a document copies: the bench's bookkeeping, never read by the search).
SUPABASE_TABLE = """
CREATE SCHEMA IF NOT EXISTS peer_supabase;
CREATE TABLE peer_supabase.documents (
  id bigint PRIMARY KEY GENERATED ALWAYS AS IDENTITY,
  content text,
  fts tsvector GENERATED ALWAYS AS (to_tsvector('english', content)) STORED,
  embedding vector({dim}),
  project text NOT NULL,
  node_id bigint NOT NULL
)
"""
PEER_PROJECT_INDEX = "CREATE INDEX ON {table} (project)"
# The recipe's two indexes, and the tenant column's B-tree, as pgvector's README advises for
# a filtered search (an index on the filter column: exact, and fast in many cases).
# Without it each question read the whole table: at 100k nodes its semantic leg was a
# sequential scan of every project's rows, 45 ms of CPU a question where the index takes
# 1.5 (docs/benchmarks.md, "The peers at 100k nodes").
SUPABASE_INDEXES = (
    "CREATE INDEX ON peer_supabase.documents USING gin (fts)",
    "CREATE INDEX ON peer_supabase.documents USING hnsw (embedding vector_ip_ops)",
    PEER_PROJECT_INDEX.format(table="peer_supabase.documents"),
)
# Supabase's hybrid_search, word for word but for filter_project in both legs and STABLE (it
# only reads): PostgreSQL inlines a STABLE SQL function into the calling statement, where
# the call's project is a constant and "filter_project IS NULL OR project = filter_project"
# folds to an index condition. A VOLATILE one (the guide's default) runs its statement under
# a plan made without the arguments' values, where the OR can only be a filter.
SUPABASE_FUNCTION = """
CREATE OR REPLACE FUNCTION peer_supabase.hybrid_search(
  query_text text,
  query_embedding vector({dim}),
  match_count int,
  full_text_weight float = 1,
  semantic_weight float = 1,
  rrf_k int = 50,
  filter_project text = NULL
)
RETURNS SETOF peer_supabase.documents
LANGUAGE sql STABLE
AS $$
WITH full_text AS (
  SELECT id,
         -- ts_rank_cd is not indexable but only ranks the matches of the WHERE clause
         row_number() OVER (ORDER BY ts_rank_cd(fts, websearch_to_tsquery(query_text)) DESC)
           AS rank_ix
  FROM peer_supabase.documents
  WHERE fts @@ websearch_to_tsquery(query_text)
    AND (filter_project IS NULL OR project = filter_project)
  ORDER BY rank_ix
  LIMIT least(match_count, 30) * 2
),
semantic AS (
  SELECT id,
         row_number() OVER (ORDER BY embedding <#> query_embedding) AS rank_ix
  FROM peer_supabase.documents
  WHERE filter_project IS NULL OR project = filter_project
  ORDER BY rank_ix
  LIMIT least(match_count, 30) * 2
)
SELECT peer_supabase.documents.*
FROM full_text
  FULL OUTER JOIN semantic ON full_text.id = semantic.id
  JOIN peer_supabase.documents ON coalesce(full_text.id, semantic.id) = documents.id
ORDER BY coalesce(1.0 / (rrf_k + full_text.rank_ix), 0.0) * full_text_weight
       + coalesce(1.0 / (rrf_k + semantic.rank_ix), 0.0) * semantic_weight DESC
LIMIT least(match_count, 30)
$$
"""
SUPABASE_QUERY = (
    "SELECT id, content, node_id FROM peer_supabase.hybrid_search(%(text)s, %(vec)s, %(k)s,"
    " filter_project => %(project)s)"
)
# The L0 nodes as the peers hold them: the title and text our lexical index reads, the vector
# ingest stored.
PEER_ROWS = """
SELECT n.id, p.name, coalesce(n.title || ' ', '') || n.text, n.embedding
FROM memory.nodes n JOIN memory.projects p ON p.id = n.project_id
WHERE n.level = 'L0' AND n.expired_at IS NULL AND n.embedding IS NOT NULL
ORDER BY n.id
"""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "bench-peers",
        help="poimen-memory beside Supabase's hybrid_search and langchain-postgres",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        type=Path,
        metavar="DIR",
        help="a data folder (nodes.jsonl, queries*.jsonl, qrels*.jsonl); repeat for several "
        "(default: locomo-dev and scifact in ../shared/data beside the repository)",
    )
    p.add_argument(
        "--queries",
        type=int,
        default=None,
        help="first N questions of each set (--corpus real: N questions, default 400)",
    )
    p.add_argument("--warmup", type=int, default=5, help="first questions run, not counted")
    p.add_argument("--turns", type=int, default=20, help="L0 rows a peer cites on LoCoMo")
    p.add_argument(
        "--systems",
        default="supabase,langchain,poimen,poimen-evidence0",
        help="comma-separated: supabase, langchain, poimen, poimen-evidence0",
    )
    p.add_argument("--cache", type=Path, default=CACHE_DEFAULT, help="node vectors, kept here")
    p.add_argument("--database", help="reuse a database this command loaded (--keep-db)")
    p.add_argument("--keep-db", action="store_true")
    p.add_argument(
        "--seed", type=int, default=0, help="bootstrap intervals' seed (and the realistic corpus')"
    )
    p.add_argument(
        "--clients",
        type=int,
        default=0,
        metavar="N",
        help="then a throughput phase: N concurrent clients per system (default: none)",
    )
    p.add_argument("--seconds", type=float, default=30.0, help="throughput window per system")
    p.add_argument("--rounds", type=int, default=2, help="throughput rounds (medians over them)")
    p.add_argument(
        "--base",
        metavar="REF",
        help="also run a git commit's version of ours, side by side (<system>@base)",
    )
    p.add_argument(
        "--anonymous",
        action="store_true",
        help="our servers without API keys (every project asserted, as runs 1-12 were); "
        "default: one read-only key per project, each question asked with its project's",
    )
    p.add_argument(
        "--corpus",
        choices=("sets", "real"),
        default="sets",
        help="sets: the --set folders, each system scored on their judgements; real: issue "
        "42's measure, the realistic corpus (bench/realistic.py: real MiniLM vectors of the "
        "LoCoMo and SciFact texts recombined into --nodes nodes in --projects Zipf-sized "
        "projects, COPY-loaded), its real questions each asked of the project nearest it: "
        "cost only, no judgements",
    )
    p.add_argument(
        "--ask",
        choices=("nearest", "by-size"),
        default="nearest",
        help="with --corpus real: which project a question is asked of: nearest, the one whose "
        "topic is nearest it (most projects are small, so most questions go to small ones); "
        "by-size, a project drawn with a chance in proportion to its nodes (traffic that "
        "follows the data), asked the real questions nearest its nodes",
    )
    p.add_argument("--nodes", type=int, default=100_000, help="with --corpus real")
    p.add_argument("--projects", type=int, default=1000, help="with --corpus real")
    p.add_argument(
        "--data",
        type=Path,
        default=DATA_DEFAULT,
        metavar="DIR",
        help="with --corpus real: the folder holding locomo-dev/ and scifact/",
    )
    p.add_argument("--json", type=Path, metavar="OUT")
    p.add_argument("--plot", type=Path, metavar="OUT.png")
    # recall.real_texts reads it (bench-recall's option; none here)
    p.set_defaults(func=cmd_bench_peers, vectors_from=[])


# -- CPU ---------------------------------------------------------------------------------


def _schedstat_ns(path: Path) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def process_cpu_ns(pid: int) -> int:
    """On-CPU nanoseconds of every thread of a process still running (Linux schedstat);
    threads that ended are not counted."""
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0
    for task in tasks:
        total += _schedstat_ns(task / "schedstat")
    return total


class Backends:
    """The PostgreSQL backends of the bench databases, by who opened them, and their CPU.
    databases: the database of each version of ours (``version``: "" or "base"), and of
    the peers (``PEERS``; default: this version's)."""

    def __init__(self, url: str, service_role: str, databases: Mapping[str, str]) -> None:
        self.conn = connect(url, autocommit=True)
        self.service_role = service_role
        self.databases = dict(databases)

    def pids(self, system: str) -> list[int]:
        rows = self.conn.execute(
            "SELECT pid, usename, application_name, datname FROM pg_catalog.pg_stat_activity"
            " WHERE backend_type = 'client backend' AND pid <> pg_catalog.pg_backend_pid()"
        ).fetchall()
        if system.startswith("poimen"):
            db = self.databases[version(system)]
            return [int(r[0]) for r in rows if r[1] == self.service_role and r[3] == db]
        db = self.databases.get(PEERS, self.databases[""])
        return [int(r[0]) for r in rows if r[2] == system_app(system) and r[3] == db]

    @staticmethod
    def cpu(pids: Iterable[int]) -> dict[int, int]:
        return {pid: _schedstat_ns(Path(f"/proc/{pid}/schedstat")) for pid in pids}

    def close(self) -> None:
        self.conn.close()


def system_app(system: str) -> str:
    return {"supabase": SUPABASE_APP, "langchain": LANGCHAIN_APP}.get(system, system)


BASE = "base"
# Backends' key of the database the peers' recipes are built in (the loaded one)
PEERS = "peers"


def version(system: str) -> str:
    """Which version of ours a system name asks: "" (this one) or "base" (``poimen@base``)."""
    return system.partition("@")[2]


def request_kind(system: str) -> str:
    """The system name less its version: what is asked (``poimen-evidence0@base``:
    ``poimen-evidence0``)."""
    return system.partition("@")[0]


def server_cpu_ns(servers: Mapping[str, int], system: str) -> int:
    """The CPU so far of the server that answers ``system`` (0: a peer, which has none)."""
    pid = servers.get(version(system)) if system.startswith("poimen") else None
    return process_cpu_ns(pid) if pid else 0


# -- data and loading --------------------------------------------------------------------


def _qfile(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    if not found:
        raise SystemExit(f"error: {folder}: no {pattern}")
    # qrels.jsonl beside qrels_sessions.jsonl: the plain one
    plain = [f for f in found if "_" not in f.stem]
    return (plain or found)[0]


def load_set(folder: Path, limit: int | None) -> EvalData:
    if not (folder / "nodes.jsonl").is_file():
        raise SystemExit(f"error: {folder}/nodes.jsonl: no such file")
    return load_eval(
        folder / "nodes.jsonl",
        _qfile(folder, "queries*.jsonl"),
        _qfile(folder, "qrels*.jsonl"),
        dataset=folder.name,
        limit_queries=limit,
    )


def evidence_set(data: EvalData) -> bool:
    """A set with memories above its turns (LoCoMo) is scored by the evidence an answer
    cites; a set of L0 documents alone (SciFact) by nDCG@10."""
    return any(r.level != "L0" for r in data.records)


@dataclass
class QuestionSet:
    """What one pass asks every system: its questions, whether ours answers at the default
    levels with the evidence list (a store with memories above its turns) or at L0, and
    the judgements an answer is scored on (None: cost only, the realistic corpus)."""

    name: str
    questions: list[Question]
    nodes: int
    evidence: bool
    data: EvalData | None = None

    @classmethod
    def judged(cls, data: EvalData) -> QuestionSet:
        return cls(
            data.dataset,
            [Question(q.id, q.text, q.project) for q in data.judged],
            len(data.records),
            evidence_set(data),
            data,
        )

    @property
    def measure(self) -> str | None:
        if self.data is None:
            return None
        return "evidence recall" if self.evidence else "nDCG@10"


class KnownVectors:
    """The embedder, but a document text already embedded (``--cache``) is not embedded
    again: every system gets the vectors of one embedding run."""

    def __init__(self, inner: Any, known: dict[str, np.ndarray[Any, Any]]) -> None:
        self.inner, self.known = inner, known

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray[Any, Any]:
        missing = list(dict.fromkeys(t for t in texts if t not in self.known))
        if missing:
            vectors = self.inner.embed_documents(missing)
            self.known.update(zip(missing, np.asarray(vectors, dtype=np.float32), strict=True))
        return np.stack([self.known[t] for t in texts]) if texts else np.zeros((0, 0))


def _seeded(folder: Path, model: str, cache: Path) -> dict[str, np.ndarray[Any, Any]]:
    """The vectors bench-recall's realistic corpus cached already (the same texts of the same
    data folder, embedded by the same model), when its cache file exists; else none."""
    from poimen_lab.bench import realistic

    folder = folder.resolve()
    folders = [folder.parent / n for n in realistic.SOURCES]
    if folder not in folders or not all((f / "nodes.jsonl").is_file() for f in folders):
        return {}

    def refuse(texts: list[str]) -> Any:
        raise LookupError

    try:
        real = realistic.embed_cached(folders, refuse, model, cache)
    except LookupError:
        return {}
    return dict(zip(real.texts, real.vectors, strict=True))


def cached_vectors(
    texts: list[str], embedder: Any, cache: Path, folder: Path | None = None
) -> dict[str, np.ndarray[Any, Any]]:
    """text -> vector for the texts, embedded once per model and content under ``cache``
    (outside the repository)."""
    texts = list(dict.fromkeys(texts))
    digest = hashlib.sha256(
        json.dumps([embedder.model_name, texts], ensure_ascii=False).encode()
    ).hexdigest()[:16]
    path = cache / f"peers-{digest}.npz"
    if path.exists():
        with np.load(path) as z:
            return dict(zip(texts, z["vectors"], strict=True))
    known = _seeded(folder, embedder.model_name, cache) if folder is not None else {}
    missing = [t for t in texts if t not in known]
    print(f"bench-peers: embedding {len(missing)} texts once ({path})", file=sys.stderr)
    if missing:
        known.update(zip(missing, np.asarray(embedder.embed_documents(missing)), strict=True))
    vectors = np.stack([np.asarray(known[t], dtype=np.float32) for t in texts])
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, vectors=vectors)
    tmp.replace(path)
    return dict(zip(texts, vectors, strict=True))


def load_poimen(
    url: str, sets: Sequence[tuple[Path, EvalData]], embedder: Any, cache: Path
) -> float:
    """Every set's nodes through the product's ingest (its vectors from the cache); seconds of
    ingest, embedding the texts the cache lacked left out."""
    from poimen_memory.ingest.writer import ingest

    s = Settings.from_env()
    took = 0.0
    with connect(url, autocommit=True) as conn:
        migrate(conn, s.plpython_root)
        for folder, data in sets:
            known = cached_vectors([r.text for r in data.records], embedder, cache, folder)
            t0 = time.perf_counter()
            ingest(
                conn,
                data.records,
                KnownVectors(embedder, known),
                batch_size=s.ingest_batch,
                embed_group=s.ingest_embed_group,
                progress=False,
            )
            took += time.perf_counter() - t0
        conn.execute("VACUUM ANALYZE")
    return took


REAL_QUESTIONS = 400  # --corpus real without --queries


def realistic_corpus(
    args: argparse.Namespace, s: Settings
) -> tuple[synthetic.Corpus, realistic.RealTexts]:
    """Issue 42's corpus: bench-recall's realistic one (the same real vectors, cached under
    --cache), its questions the real ones, each assigned to the project nearest it."""
    from poimen_lab.bench.recall import real_texts

    real = real_texts(args, s)
    corpus = realistic.generate(
        real,
        args.nodes,
        REAL_QUESTIONS if args.queries is None else args.queries,
        seed=args.seed,
        projects=args.projects,
    )
    return corpus, real


def realistic_set(
    corpus: synthetic.Corpus, real: realistic.RealTexts, ask: str, seed: int
) -> QuestionSet:
    """Its questions, each asked of one project (``ask``: see --ask), ours at the default
    levels with the evidence list (the store holds L1 and L2 nodes): no judgements, so cost
    only."""
    pairs = list(zip(corpus.query_texts, corpus.query_projects, strict=True))
    if ask == "by-size":
        sizes = Counter(corpus.projects)
        names = sorted(sizes)
        weights = np.array([sizes[n] for n in names], dtype=np.float64)
        rng = np.random.default_rng(seed)
        drawn = Counter(rng.choice(names, size=len(pairs), p=weights / weights.sum()).tolist())
        pairs = []
        for project, count in sorted(drawn.items()):
            # asked more often than there are questions: they come round again, as the
            # corpus' own questions do (realistic.generate)
            texts = realistic.project_queries(real, corpus, project, count)[1]
            pairs += [(texts[i % len(texts)], project) for i in range(count)]
        # the projects interleaved, as their tenants' questions arrive
        pairs = [pairs[i] for i in rng.permutation(len(pairs))]
    questions = [Question(f"q{i}", text, project) for i, (text, project) in enumerate(pairs)]
    name = f"realistic-{len(corpus.texts)}" + ("-by-size" if ask == "by-size" else "")
    return QuestionSet(name, questions, len(corpus.texts), True)


def load_realistic(url: str, corpus: synthetic.Corpus, model: str) -> dict[str, float]:
    """The corpus COPY-loaded into the migrated database, graphs built after (synthetic.load,
    as `poimen-memory bench` loads): seconds of each part."""
    s = Settings.from_env()
    with connect(url, autocommit=True) as conn:
        migrate(conn, s.plpython_root)
        load = synthetic.load(conn, corpus, model)
    keys = ("copy_seconds", "hnsw_both_graphs_seconds", "project_graphs_seconds")
    return {k: round(float(load[k]), 2) for k in keys} | {"project_graphs": load["project_graphs"]}


def same_corpus(url: str, corpus: synthetic.Corpus) -> None:
    """A reused database (--database) must hold the corpus its questions are generated for
    (the same --nodes, --projects and --seed): its size, and its first nodes' texts and
    projects, which the seed decides (synthetic.load names node i "n<i>")."""
    first = min(len(corpus.texts), 32)
    with connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*), count(DISTINCT project_id) FROM memory.nodes WHERE expired_at IS NULL"
        ).fetchone()
        held = dict(
            conn.execute(
                "SELECT n.external_id, (n.text, p.name::text) FROM memory.nodes n"
                " JOIN memory.projects p ON p.id = n.project_id WHERE n.external_id = ANY (%s)",
                ([f"n{i}" for i in range(first)],),
            ).fetchall()
        )
    want = (len(corpus.texts), len(set(corpus.projects)))
    if row is None or (int(row[0]), int(row[1])) != want:
        raise SystemExit(
            f"error: the database holds {row and row[0]} nodes in {row and row[1]} projects, "
            f"the corpus {want[0]} in {want[1]}: pass the --nodes, --projects and --seed it "
            "was loaded with"
        )
    if any(held.get(f"n{i}") != (corpus.texts[i], corpus.projects[i]) for i in range(first)):
        raise SystemExit(
            "error: the database holds another corpus of this size: pass the --seed it was "
            "loaded with"
        )


def build_supabase(url: str, dim: int) -> dict[str, float]:
    """The recipe's table, filled from memory.nodes' L0 rows, its indexes and its function."""
    with connect(url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS peer_supabase CASCADE")
        for stmt in SUPABASE_TABLE.format(dim=dim).split(";"):
            conn.execute(stmt)
        t0 = time.perf_counter()
        conn.execute(
            "INSERT INTO peer_supabase.documents (content, embedding, project, node_id)"
            " SELECT text, embedding, name, id FROM ("
            + PEER_ROWS
            + ") r(id, name, text, embedding)"
        )
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for stmt in SUPABASE_INDEXES:
            conn.execute(stmt)
        index_s = time.perf_counter() - t0
        conn.execute(SUPABASE_FUNCTION.format(dim=dim))
        conn.execute("ANALYZE peer_supabase.documents")
        n = conn.execute("SELECT count(*) FROM peer_supabase.documents").fetchone()
    return {"rows": float(n[0] if n else 0), "load_s": load_s, "index_s": index_s}


def langchain_available() -> bool:
    try:
        importlib.import_module("langchain_postgres")
    except ImportError:
        return False
    return True


def _sqlalchemy_url(url: str, app: str) -> str:
    """A libpq URL (or conninfo) as SQLAlchemy's postgresql+psycopg URL, with an
    application_name and the iterative HNSW scan on its sessions."""
    d = {k: str(v) for k, v in conninfo_to_dict(url).items() if v is not None}
    user = quote(d.pop("user", ""), safe="")
    password = d.pop("password", None)
    host = d.pop("host", "")
    port = d.pop("port", None)
    dbname = d.pop("dbname", "")
    auth = user + (":" + quote(password, safe="") if password else "")
    params = {**d, "application_name": app, "options": "-c hnsw.iterative_scan=strict_order"}
    where = ""
    if host and not host.startswith("/"):
        where = host + (f":{port}" if port else "")
    elif host:
        params["host"] = host
        if port:
            params["port"] = port
    return f"postgresql+psycopg://{auth}@{where}/{dbname}?{urlencode(params)}"


def _floats(v: Any) -> Any:
    """A pgvector value as a sequence of floats (pgvector-python 0.3+ returns Vector)."""
    return v.to_numpy() if hasattr(v, "to_numpy") else v


class LangchainPeer:
    """langchain-postgres' PGVectorStore with a HybridSearchConfig (RRF)."""

    TABLE = "documents"
    SCHEMA = "peer_langchain"

    def __init__(self, url: str, embedder: Any, dim: int, clients: int = 0) -> None:
        lp = importlib.import_module("langchain_postgres")
        hs = importlib.import_module("langchain_postgres.v2.hybrid_search_config")
        core = importlib.import_module("langchain_core.embeddings")
        self._lp, self._hs = lp, hs
        self.dim = dim

        class MiniLM(core.Embeddings):  # type: ignore[misc,name-defined]
            def embed_documents(self, texts: list[str]) -> list[list[float]]:
                return [list(map(float, v)) for v in embedder.embed_documents(texts)]

            def embed_query(self, text: str) -> list[float]:
                return [float(x) for x in embedder.embed_query(text)]

        self.embeddings = MiniLM()
        # SQLAlchemy's pool keeps 5 connections and closes any more when they come back:
        # sized to the throughput's clients, none is reopened under load.
        self.engine = lp.PGEngine.from_connection_string(
            _sqlalchemy_url(url, LANGCHAIN_APP), pool_size=max(5, clients)
        )
        self.config = hs.HybridSearchConfig(
            tsv_column="content_tsv",
            tsv_lang="pg_catalog.english",
            fusion_function=hs.reciprocal_rank_fusion,
            fusion_function_parameters={"rrf_k": 60},
        )
        self.store: Any = None

    def _open(self) -> None:
        self.store = self._lp.PGVectorStore.create_sync(
            self.engine,
            embedding_service=self.embeddings,
            table_name=self.TABLE,
            schema_name=self.SCHEMA,
            metadata_columns=["project", "node_id"],
            hybrid_search_config=self.config,
        )

    def build(self, url: str) -> dict[str, float]:
        with connect(url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {self.SCHEMA} CASCADE")
            conn.execute(f"CREATE SCHEMA {self.SCHEMA}")
            register_vector(conn)
            rows = conn.execute(PEER_ROWS).fetchall()
        self.engine.init_vectorstore_table(
            self.TABLE,
            self.dim,
            schema_name=self.SCHEMA,
            metadata_columns=[
                self._lp.Column("project", "TEXT", nullable=False),
                self._lp.Column("node_id", "BIGINT", nullable=False),
            ],
            hybrid_search_config=self.config,
        )
        self._open()
        t0 = time.perf_counter()
        for start in range(0, len(rows), 500):
            part = rows[start : start + 500]
            self.store.add_embeddings(
                texts=[r[2] for r in part],
                embeddings=[[float(x) for x in _floats(r[3])] for r in part],
                metadatas=[{"project": r[1], "node_id": int(r[0])} for r in part],
                ids=[str(uuid.uuid4()) for _ in part],
            )
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        index = importlib.import_module("langchain_postgres.v2.indexes")
        self.store.apply_vector_index(index.HNSWIndex())
        self.store.apply_hybrid_search_index()
        with connect(url, autocommit=True) as conn:  # the filter's column (SUPABASE_INDEXES)
            conn.execute(PEER_PROJECT_INDEX.format(table=f"{self.SCHEMA}.{self.TABLE}"))
        index_s = time.perf_counter() - t0
        with connect(url, autocommit=True) as conn:
            conn.execute(f"ANALYZE {self.SCHEMA}.{self.TABLE}")
        return {"rows": float(len(rows)), "load_s": load_s, "index_s": index_s}

    def search(self, text: str, project: str | None, k: int) -> list[int]:
        if self.store is None:
            self._open()
        # A config of its own per call: the store keeps the first query's text in a shared
        # config (fts_query) and would run every later full-text leg with it.
        config = dataclasses.replace(
            self.config,
            fts_query=text,
            primary_top_k=2 * k,
            secondary_top_k=2 * k,
            fusion_function_parameters=dict(self.config.fusion_function_parameters),
        )
        docs = self.store.similarity_search(
            text, k=k, filter={"project": project} if project else None,
            hybrid_search_config=config,
        )  # fmt: skip
        return [int(d.metadata["node_id"]) for d in docs]

    def close(self) -> None:
        with contextlib.suppress(Exception):  # best effort at exit
            self.engine._run_as_sync(self.engine.close())


# -- the systems -------------------------------------------------------------------------


@dataclass
class Answer:
    """One call's answer: the external ids it ranks, and the L0 turns it cites; doc: the
    response as the server sent it (ours: what ``digest`` compares)."""

    ranked: list[str] = field(default_factory=list)
    cited: set[str] = field(default_factory=set)
    doc: Any = None

    def digest(self) -> str | None:
        """Of the response less its timings: two versions gave the same answer when their
        digests are equal. Computed after the call's clock stops: not a cost of the call."""
        if self.doc is None:
            return None
        text = json.dumps(untimed(self.doc), sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Question:
    id: str
    text: str
    project: str | None


class Systems:
    """Each system's call for one question of one set; returns an Answer. servers: the HTTP
    address of each version of ours ("": this one, "base": ``--base``'s)."""

    def __init__(
        self,
        url: str,
        embedder: Any,
        names: Sequence[str],
        servers: Mapping[str, str],
        langchain: LangchainPeer | None,
        keys: Mapping[str | None, str] | None = None,
    ) -> None:
        self.embedder = embedder
        # project -> the API key our servers are asked with (none: anonymous mode)
        self.keys = dict(keys or {})
        self.names = list(names)
        self.url, self.servers = url, dict(servers)
        self.by_db_id: dict[int, str] = {}
        self.by_sha: dict[str, str] = {}
        with connect(url, autocommit=True) as conn:
            for nid, sha, ext in conn.execute(
                "SELECT id, encode(sha256, 'hex'), external_id FROM memory.nodes"
                " WHERE external_id IS NOT NULL"
            ).fetchall():
                self.by_db_id[int(nid)] = str(ext)
                self.by_sha[str(sha)] = str(ext)
        self.supabase: psycopg.Connection[Any] | None = None
        if "supabase" in self.names:
            self.supabase = self._supabase()
        self.langchain = langchain
        self.http = {v: self._http_connection(a) for v, a in self.servers.items()}

    def _supabase(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(self.url, autocommit=True, application_name=SUPABASE_APP)
        register_vector(conn)
        return conn

    @staticmethod
    def _http_connection(base: str) -> http.client.HTTPConnection:
        host, port = base.removeprefix("http://").split(":")
        return http.client.HTTPConnection(host, int(port), timeout=120)

    def fork(self) -> Systems:
        """The same systems on connections of their own: a throughput client's (langchain's
        store is shared: its calls take connections from its engine's pool)."""
        other = copy.copy(self)
        other.supabase = self._supabase() if self.supabase is not None else None
        other.http = {v: self._http_connection(a) for v, a in self.servers.items()}
        return other

    def recover(self) -> None:
        """After a failed call: a broken database connection is opened again, the HTTP
        connection closed (the next request opens it again)."""
        if self.supabase is not None and (self.supabase.broken or self.supabase.closed):
            with contextlib.suppress(Exception):
                self.supabase.close()
            self.supabase = self._supabase()
        for conn in self.http.values():
            conn.close()

    def call(self, system: str, q: Question, evidence: bool, turns: int) -> Answer:
        k = turns if evidence else 10
        if system == "supabase":
            assert self.supabase is not None
            vec = np.asarray(self.embedder.embed_query(q.text), dtype=np.float32)
            rows = self.supabase.execute(
                SUPABASE_QUERY, {"text": q.text, "vec": vec, "k": k, "project": q.project}
            ).fetchall()
            ranked = [self.by_db_id[int(r[2])] for r in rows]
            return Answer(ranked, set(ranked))
        if system == "langchain":
            assert self.langchain is not None
            ranked = [self.by_db_id[i] for i in self.langchain.search(q.text, q.project, k)]
            return Answer(ranked, set(ranked))
        params = {"query": q.text, "limit": "10"}
        if q.project:
            params["project"] = q.project
        if not evidence:
            params["level"] = "L0"
        if request_kind(system) == "poimen-evidence0":
            params["evidence"] = "0"
        key = self.keys.get(q.project)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return self._http(self.http[version(system)], params, headers)

    def _http(
        self,
        conn: http.client.HTTPConnection,
        params: Mapping[str, str],
        headers: Mapping[str, str],
    ) -> Answer:
        conn.request("GET", "/memory/query?" + urlencode(params), headers=dict(headers))
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"GET /memory/query: {resp.status} {body[:300]!r}")
        doc = json.loads(body)
        ranked = [self.by_sha[r["sha256"]] for r in doc["results"] if r["sha256"] in self.by_sha]
        cited: set[str] = set()
        stack = [p for r in doc["results"] for p in r.get("parents") or []]
        while stack:
            node = stack.pop()
            if node.get("level") == "L0" and node.get("sha256") in self.by_sha:
                cited.add(self.by_sha[node["sha256"]])
            stack.extend(node.get("parents") or [])
        for e in doc.get("evidence") or []:
            if e.get("sha256") in self.by_sha:
                cited.add(self.by_sha[e["sha256"]])
        return Answer(ranked, cited, doc)

    def close(self) -> None:
        if self.supabase is not None:
            self.supabase.close()
        for conn in self.http.values():
            conn.close()


def untimed(doc: Any) -> Any:
    """A response less what differs between two runs of the same answer: its timings
    (``*_ms``, ``stages``) and its request id."""
    if isinstance(doc, dict):
        return {
            k: untimed(v)
            for k, v in doc.items()
            if not k.endswith("_ms") and k not in ("stages", "timings", "request_id")
        }
    if isinstance(doc, list):
        return [untimed(x) for x in doc]
    return doc


@dataclass
class Tally:
    ms: list[float] = field(default_factory=list)
    client_ns: list[int] = field(default_factory=list)
    server_ns: list[int] = field(default_factory=list)
    database_ns: list[int] = field(default_factory=list)
    quality: list[float] = field(default_factory=list)
    cited: list[int] = field(default_factory=list)
    per_query: dict[str, float] = field(default_factory=dict)
    digests: list[str | None] = field(default_factory=list)

    def cpu_ns(self) -> list[int]:
        """Each question's CPU, every process summed."""
        parts = zip(self.database_ns, self.server_ns, self.client_ns, strict=True)
        return [d + s + c for d, s, c in parts]


def score(data: EvalData, qid: str, answer: Answer, evidence: bool) -> float:
    judged = data.qrels.get(qid, {})
    if evidence:
        return coverage({d for d, r in judged.items() if r >= 1}, answer.cited)
    return ndcg_at(judged, answer.ranked, 10)


def run_set(
    qs: QuestionSet,
    systems: Systems,
    backends: Backends,
    servers: Mapping[str, int],
    turns: int,
    warmup: int,
) -> dict[str, Tally]:
    evidence, questions = qs.evidence, qs.questions
    names = systems.names
    out = {name: Tally() for name in names}
    for i, q in enumerate(questions):
        order = names[i % len(names) :] + names[: i % len(names)]
        if i % 2:
            order = twins_swapped(order)
        for name in order:
            pids = backends.pids(name)
            db0 = Backends.cpu(pids)
            srv0 = server_cpu_ns(servers, name)
            c0 = time.process_time_ns()
            t0 = time.perf_counter()
            answer = systems.call(name, q, evidence, turns)
            took = (time.perf_counter() - t0) * 1000
            c1 = time.process_time_ns()
            srv1 = server_cpu_ns(servers, name)
            db1 = Backends.cpu(set(pids) | set(backends.pids(name)))
            if i < warmup:
                continue
            t = out[name]
            t.ms.append(took)
            t.client_ns.append(c1 - c0)
            t.server_ns.append(srv1 - srv0)
            t.database_ns.append(sum(v - db0.get(pid, 0) for pid, v in db1.items() if v))
            if qs.data is not None:
                value = score(qs.data, q.id, answer, evidence)
                t.quality.append(value)
                t.per_query[q.id] = value
            t.cited.append(len(answer.cited))
            t.digests.append(answer.digest())
        if (i + 1) % 100 == 0:
            print(f"bench-peers: {qs.name}: {i + 1}/{len(questions)}", file=sys.stderr)
    return out


def twins_swapped(order: Sequence[str]) -> list[str]:
    """The order with each version of ours and its base twin next to it (``poimen``,
    ``poimen@base``) swapped: run_set does it every other question, so neither version is
    always the one asked a question second."""
    out = list(order)
    j = 0
    while j < len(out) - 1:
        a, b = out[j], out[j + 1]
        if b == f"{a}@{BASE}" or a == f"{b}@{BASE}":
            out[j], out[j + 1] = b, a
            j += 1
        j += 1
    return out


def bootstrap(values: Sequence[float], seed: int, n: int = 2000) -> tuple[float, float]:
    if not values:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    x = np.asarray(values, dtype=np.float64)
    means = x[rng.integers(0, len(x), size=(n, len(x)))].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def summarize(tallies: Mapping[str, Tally], seed: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, t in tallies.items():
        n = max(len(t.ms), 1)
        lo, hi = bootstrap(t.quality, seed)
        row: dict[str, Any] = {
            "questions": len(t.ms),
            "quality": statistics.fmean(t.quality) if t.quality else float("nan"),
            "quality_ci95": [lo, hi],
            "cited": statistics.fmean(t.cited) if t.cited else 0.0,
            "p50_ms": statistics.median(t.ms) if t.ms else float("nan"),
            "p95_ms": float(np.percentile(t.ms, 95)) if t.ms else float("nan"),
            "database_cpu_ms": sum(t.database_ns) / n / 1e6,
            "server_cpu_ms": sum(t.server_ns) / n / 1e6,
            "client_cpu_ms": sum(t.client_ns) / n / 1e6,
        }
        row["cpu_ms"] = row["database_cpu_ms"] + row["server_cpu_ms"] + row["client_cpu_ms"]
        out[name] = row
    ref = out.get("supabase")
    for row in out.values():
        if ref:
            row["p50_over_supabase"] = row["p50_ms"] / max(ref["p50_ms"], 1e-9)
            row["cpu_over_supabase"] = row["cpu_ms"] / max(ref["cpu_ms"], 1e-9)
    for name, t in tallies.items():
        base = tallies.get(f"{name}@{BASE}")
        if base is not None:
            out[name]["over_base"] = over_base(t, base)
    return out


def over_base(head: Tally, base: Tally) -> dict[str, Any]:
    """This version against the base, on the same questions asked in the same rotation: each
    CPU part as a ratio of means, the whole CPU also as the median of the per-question
    ratios, the p50 ratio, and how many answers were identical."""

    def ratio(a: Sequence[int] | Sequence[float], b: Sequence[int] | Sequence[float]) -> float:
        return statistics.fmean(a) / max(statistics.fmean(b), 1e-9) if a and b else float("nan")

    per_q = [h / b for h, b in zip(head.cpu_ns(), base.cpu_ns(), strict=True) if b > 0]
    same = sum(
        1 for h, b in zip(head.digests, base.digests, strict=True) if h is not None and h == b
    )
    return {
        "questions": len(head.ms),
        "same_answers": same,
        "cpu": ratio(head.cpu_ns(), base.cpu_ns()),
        "cpu_median_per_question": statistics.median(per_q) if per_q else float("nan"),
        "database_cpu": ratio(head.database_ns, base.database_ns),
        "server_cpu": ratio(head.server_ns, base.server_ns),
        "client_cpu": ratio(head.client_ns, base.client_ns),
        "p50": statistics.median(head.ms) / max(statistics.median(base.ms), 1e-9)
        if head.ms and base.ms
        else float("nan"),
    }


# -- throughput ---------------------------------------------------------------------------


@dataclass
class Window:
    """One system's throughput window: N clients for S seconds."""

    answers: int = 0
    errors: int = 0
    elapsed_s: float = 0.0
    ms: list[float] = field(default_factory=list)
    database_ns: int = 0
    server_ns: int = 0
    client_ns: int = 0
    error: str | None = None

    def row(self) -> dict[str, Any]:
        n = max(self.answers, 1)
        out: dict[str, Any] = {
            "answers": self.answers,
            "errors": self.errors,
            "elapsed_s": self.elapsed_s,
            "qps": self.answers / self.elapsed_s if self.elapsed_s > 0 else 0.0,
            "p50_ms": statistics.median(self.ms) if self.ms else float("nan"),
            "p95_ms": float(np.percentile(self.ms, 95)) if self.ms else float("nan"),
            "database_cpu_ms": self.database_ns / n / 1e6,
            "server_cpu_ms": self.server_ns / n / 1e6,
            "client_cpu_ms": self.client_ns / n / 1e6,
        }
        out["cpu_ms"] = out["database_cpu_ms"] + out["server_cpu_ms"] + out["client_cpu_ms"]
        if self.error is not None:
            out["first_error"] = self.error
        return out


def load_window(
    systems: Systems,
    name: str,
    questions: Sequence[Question],
    evidence: bool,
    turns: int,
    clients: int,
    seconds: float,
    backends: Backends,
    servers: Mapping[str, int],
) -> Window:
    """``clients`` threads, each on connections of its own, asking ``name`` the questions in
    turn (each from its own starting point) for ``seconds``; a call in flight at the end is
    waited for and counted. Each client asks one question first, outside the window (the
    pools open their connections). CPU over the window: the system's backends, the server
    (ours), this process."""
    forks: list[Systems] = []
    try:
        for _ in range(clients):
            forks.append(systems.fork())
        w = Window()
        lock = threading.Lock()
        gate = threading.Barrier(clients + 1)
        deadline = [0.0]

        def failed(c: int, exc: BaseException) -> None:
            with lock:
                w.errors += 1
                if w.error is None:
                    w.error = f"{type(exc).__name__}: {str(exc)[:300]}"
            with contextlib.suppress(Exception):
                forks[c].recover()

        def client(c: int) -> None:
            i = (c * len(questions)) // clients
            gate.wait()  # the warm-up question, all clients at once
            try:
                forks[c].call(name, questions[i % len(questions)], evidence, turns)
            except Exception as exc:  # counted; the client goes on
                failed(c, exc)
            i += 1
            gate.wait()  # warmed up
            gate.wait()  # the window opens
            mine: list[float] = []
            answers = 0
            while time.perf_counter() < deadline[0]:
                q = questions[i % len(questions)]
                i += 1
                t0 = time.perf_counter()
                try:
                    forks[c].call(name, q, evidence, turns)
                except Exception as exc:  # counted; the client goes on
                    failed(c, exc)
                    continue
                mine.append((time.perf_counter() - t0) * 1000)
                answers += 1
            with lock:
                w.ms.extend(mine)
                w.answers += answers

        threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
        for t in threads:
            t.start()
        try:
            gate.wait()
            gate.wait()
            w.errors, w.error = 0, None  # the warm-up's failures are not the window's
            pids = backends.pids(name)
            db0 = Backends.cpu(pids)
            srv0 = server_cpu_ns(servers, name)
            c0 = time.process_time_ns()
            t0 = time.perf_counter()
            deadline[0] = t0 + seconds
            gate.wait()
        except BaseException:
            gate.abort()  # no client waits at the gate for ever
            raise
        for t in threads:
            t.join()
        w.elapsed_s = time.perf_counter() - t0
        w.client_ns = time.process_time_ns() - c0
        w.server_ns = server_cpu_ns(servers, name) - srv0
        db1 = Backends.cpu(set(pids) | set(backends.pids(name)))
        w.database_ns = sum(v - db0.get(pid, 0) for pid, v in db1.items() if v)
        return w
    finally:
        for f in forks:
            f.close()


def throughput(
    qs: QuestionSet,
    systems: Systems,
    backends: Backends,
    servers: Mapping[str, int],
    turns: int,
    clients: int,
    seconds: float,
    rounds: int,
) -> dict[str, dict[str, Any]]:
    """Every system's windows, ``rounds`` times, the order rotating; per system the medians
    over rounds (errors: their sum), and ratios to the peer of most queries a second."""
    evidence, questions = qs.evidence, qs.questions
    if not questions:
        return {}
    names = systems.names
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            w = load_window(
                systems, name, questions, evidence, turns, clients, seconds, backends, servers
            )
            one = w.row()
            runs[name].append(one)
            print(
                f"bench-peers: {qs.name}: round {r + 1}/{rounds}, {name}:"
                f" {one['qps']:.1f} q/s, {w.errors} errors",
                file=sys.stderr,
            )
    # The server closed the idle keep-alive connection of the quality pass meanwhile
    # (POIMEN_HTTP_KEEP_ALIVE_S): the next set's first call opens a new one.
    systems.recover()
    out: dict[str, dict[str, Any]] = {}
    keys = ("qps", "p50_ms", "p95_ms", "cpu_ms", "database_cpu_ms", "server_cpu_ms",
            "client_cpu_ms")  # fmt: skip
    for name, rows in runs.items():
        row: dict[str, Any] = {k: statistics.median([x[k] for x in rows]) for k in keys}
        row["errors"] = sum(x["errors"] for x in rows)
        row["answers"] = sum(x["answers"] for x in rows)
        row.update(clients=clients, seconds=seconds, rounds=rounds, per_round=rows)
        out[name] = row
    peers = [n for n in out if n in ("supabase", "langchain")]
    if peers:
        best = max(peers, key=lambda n: out[n]["qps"])
        ref = out[best]
        for row in out.values():
            row["best_peer"] = best
            row["qps_over_best_peer"] = row["qps"] / max(ref["qps"], 1e-9)
            row["p50_over_best_peer"] = row["p50_ms"] / max(ref["p50_ms"], 1e-9)
            row["cpu_over_best_peer"] = row["cpu_ms"] / max(ref["cpu_ms"], 1e-9)
    for name, row in out.items():
        base = out.get(f"{name}@{BASE}")
        if base is not None:
            ratios = ("qps", "p50_ms", "cpu_ms", "database_cpu_ms")
            row["over_base"] = {k: row[k] / max(base[k], 1e-9) for k in ratios}
    return out


LABELS = {
    "supabase": "Supabase hybrid_search",
    "langchain": "langchain-postgres hybrid",
    "poimen": "poimen GET /memory/query",
    "poimen-evidence0": "poimen GET /memory/query evidence=0",
}


def label(system: str) -> str:
    name, v = request_kind(system), version(system)
    return LABELS.get(name, name) + (f" ({v})" if v else "")


def print_table(result: Mapping[str, Any]) -> None:
    for name, s in result["sets"].items():
        measure = s["measure"] or "quality"
        judged = s["measure"] or "no judgements, cost only"
        print(f"\n{name}: {s['questions']} questions, {judged}; {s['nodes']} nodes")
        rows = []
        for system, r in s["systems"].items():
            lo, hi = r["quality_ci95"]
            quality = f"{r['quality']:.3f} [{lo:.3f}, {hi:.3f}]" if s["measure"] else "-"
            rows.append([
                label(system), quality,
                round(r["cited"], 1), round(r["p50_ms"], 1), round(r["database_cpu_ms"], 1),
                round(r["server_cpu_ms"], 1), round(r["client_cpu_ms"], 1), round(r["cpu_ms"], 1),
                round(r.get("p50_over_supabase", float("nan")), 2),
                round(r.get("cpu_over_supabase", float("nan")), 2),
            ])  # fmt: skip
        head = ["system", measure + " [95% CI]", "cited", "p50 ms", "db CPU ms/q",
                "server CPU ms/q", "client CPU ms/q", "CPU ms/q", "p50 / supabase",
                "CPU / supabase"]  # fmt: skip
        print(table(rows, head))
        print_over_base(s["systems"], result.get("base"))
        if "throughput" in s:
            print_throughput(s["throughput"])


def print_throughput(tput: Mapping[str, Mapping[str, Any]]) -> None:
    first = next(iter(tput.values()), None)
    if first is None:
        return
    best = first.get("best_peer")
    print(
        f"\nthroughput: {first['clients']} clients, {first['seconds']:g} s per system,"
        f" medians of {first['rounds']} rounds" + (f"; against {LABELS[best]}" if best else "")
    )
    rows = []
    for system, r in tput.items():
        rows.append([
            label(system), round(r["qps"], 1), round(r["p50_ms"], 1),
            round(r["p95_ms"], 1), r["errors"], round(r["database_cpu_ms"], 1),
            round(r["server_cpu_ms"], 1), round(r["client_cpu_ms"], 1), round(r["cpu_ms"], 1),
            round(r.get("qps_over_best_peer", float("nan")), 2),
            round(r.get("cpu_over_best_peer", float("nan")), 2),
        ])  # fmt: skip
    head = ["system", "q/s", "p50 ms", "p95 ms", "errors", "db CPU ms/q", "server CPU ms/q",
            "client CPU ms/q", "CPU ms/q", "q/s / best peer", "CPU / best peer"]  # fmt: skip
    print(table(rows, head))
    rows = [
        [label(system), round(r["over_base"]["qps"], 3), round(r["over_base"]["p50_ms"], 3),
         round(r["over_base"]["cpu_ms"], 3), round(r["over_base"]["database_cpu_ms"], 3)]
        for system, r in tput.items() if "over_base" in r
    ]  # fmt: skip
    if rows:
        print("\nthroughput, this version over the base:")
        print(table(rows, ["system", "q/s", "p50", "CPU/q", "db CPU/q"]))


def print_over_base(systems: Mapping[str, Mapping[str, Any]], base: Any) -> None:
    rows = []
    for system, r in systems.items():
        if "over_base" not in r:
            continue
        o = r["over_base"]
        rows.append([
            label(system), f"{o['same_answers']}/{o['questions']}", round(o["cpu"], 3),
            round(o["cpu_median_per_question"], 3), round(o["database_cpu"], 3),
            round(o["server_cpu"], 3), round(o["client_cpu"], 3), round(o["p50"], 3),
        ])  # fmt: skip
    if rows:
        where = f"{base['ref']}, {base['commit'][:12]}"
        print(f"\nthis version over the base ({where}), the same questions:")
        head = ["system", "same answers", "CPU/q", "CPU/q median of ratios", "db CPU/q",
                "server CPU/q", "client CPU/q", "p50"]  # fmt: skip
        print(table(rows, head))


def _sets(args: argparse.Namespace) -> list[Path]:
    if args.sets:
        return list(args.sets)
    found = [DATA_DEFAULT / n for n in ("locomo-dev", "scifact") if (DATA_DEFAULT / n).is_dir()]
    if not found:
        raise SystemExit(f"error: no --set given and none of locomo-dev, scifact in {DATA_DEFAULT}")
    return found


KEY_NOTE = "bench-peers"


def tenant_keys(urls: Sequence[str]) -> dict[str | None, str]:
    """A deployment's keys: one read-only API key per project, the same keys stored in
    each database our servers read (this version's and the base's), so that each request
    asserts its one project to row-level security as a keyed deployment does. Anonymous
    mode asserts every project, which the policies pass on a setting alone. Stored by this
    version's statement, in the base's database too: the columns it writes are
    memory.api_keys' since migration 0005."""
    from poimen_memory.api.auth import key_hash, new_key

    with connect(urls[0], autocommit=True) as conn:
        rows = conn.execute("SELECT name FROM memory.projects ORDER BY name").fetchall()
    projects = [str(r[0]) for r in rows]
    keys: dict[str | None, str] = {p: new_key() for p in projects}
    for url in urls:
        with connect(url, autocommit=True) as conn:
            for project, key in keys.items():
                conn.execute(
                    query_sql("key_insert"),
                    {
                        "key_hash": key_hash(key),
                        "prefix": key[:12],
                        "projects": [project],
                        "can_write": False,
                        "note": KEY_NOTE,
                    },
                )
    return keys


def drop_tenant_keys(urls: Sequence[str]) -> None:
    """The keys tenant_keys made (their note says so) out of each database: none left, a
    database answers without a key again (deleted, not revoked: revoking every key would
    lock the service instead)."""
    for url in urls:
        with connect(url, autocommit=True) as conn:
            conn.execute("DELETE FROM memory.api_keys WHERE note = %s", (KEY_NOTE,))


@contextmanager
def _server(
    service_url: str, clients: int = 0, code: Path | None = None
) -> Iterator[tuple[str, int]]:
    """Our server on service_url, its embedding cache off, no reranker or OpenSearch; code: a
    base's source tree (base_code) to run instead of this version."""
    drop = ("POIMEN_RERANK_URL", "POIMEN_OPENSEARCH_URL")
    env = {"POIMEN_DATABASE_URL": service_url, "POIMEN_EMBED_CACHE_SIZE": "0"}
    if code is not None:
        env["PYTHONPATH"] = base_pythonpath(code)
    if clients > Settings.from_env().http_client_inflight:
        # the throughput's clients share one address: N clients, not one client's share
        env["POIMEN_HTTP_CLIENT_INFLIGHT"] = str(clients)
    with (
        tempfile.TemporaryDirectory() as tmp,
        live_server_process(
            env,
            Path(tmp) / "server.log",
            drop=drop,
        ) as (base, pid),
    ):
        yield base, pid


# -- the version before a change (--base) ---------------------------------------------------

REPO = Path(__file__).resolve().parents[3]
# Run by the base's own Python: its migrate over the copied database, with no PL/Python
# copy on this host (None: the database server imports the base's modules from the database,
# so this version's copy under POIMEN_HOME is not replaced); prints where its code came from.
BASE_MIGRATE = """
import sys
import poimen_memory
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import migrate
with connect(sys.argv[1], autocommit=True) as conn:
    migrate(conn, None)
print(poimen_memory.__file__)
"""


def base_pythonpath(code: Path) -> str:
    return os.pathsep.join(str(code / d) for d in ("service", "plpython"))


def base_code(ref: str, cache: Path) -> tuple[str, Path]:
    """The commit ref names and its service/ and plpython/ folders, extracted once under
    cache (git archive: the repository's worktree list and index are not touched)."""
    rev = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", "--end-of-options",
         f"{ref}^{{commit}}"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if rev.returncode != 0:
        raise SystemExit(f"error: --base {ref}: not a commit of {REPO}")
    commit = rev.stdout.strip()
    tree = cache / f"base-{commit[:16]}"
    if (tree / ".complete").is_file():
        return commit, tree
    out = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", commit, "service", "plpython"],
        capture_output=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"error: --base {ref}: git archive: {out.stderr.decode()[:300]}")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".base-", dir=cache))
    try:
        with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        (tmp / ".complete").touch()
        # A complete tree is never replaced: another run may be running its code. An
        # incomplete one (an extraction killed half way) is.
        if tree.exists() and not (tree / ".complete").is_file():
            shutil.rmtree(tree, ignore_errors=True)
        try:
            tmp.rename(tree)
        except OSError:
            if not (tree / ".complete").is_file():  # not another run's complete copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return commit, tree


def base_database(name: str) -> str:
    """The name of the base's copy of the loaded database ``name``."""
    return f"{name}_base"


def _template_copy(server: str, name: str, copy_name: str) -> str:
    """copy_name, made afresh as a copy of the loaded database name (CREATE DATABASE ...
    TEMPLATE: the same rows and indexes); returns its URL."""
    drop_database(server, copy_name)
    with psycopg.connect(make_conninfo(server, dbname="postgres"), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {copy_name} TEMPLATE {name}")
    return make_conninfo(server, dbname=copy_name)


def head_database(name: str) -> str:
    """The name of this version's copy of the loaded database ``name`` (with ``--base``)."""
    return f"{name}_head"


def copy_for_head(server: str, name: str, plpython_root: Path | None) -> str:
    """With --base, this version too answers from a copy of the loaded database, made and
    flushed as the base's is, so the two sides differ in their code alone (HEAD against
    HEAD with this version on the original: SciFact 1.022x and 1.023x of the database CPU).
    Returns its URL; the caller drops it."""
    url = _template_copy(server, name, head_database(name))
    with connect(url, autocommit=True) as conn:
        migrate(conn, plpython_root)
        conn.execute("CHECKPOINT")  # the copy's writes flushed before anything is timed
    return url


def copy_for_base(server: str, name: str, code: Path) -> str:
    """A copy of the loaded database (name) migrated by the base's code: the same rows and
    indexes under the base's functions; returns its URL. The caller drops the copy
    (base_database(name)) whatever happens here. Functions of this version the base does
    not define stay in the copy, unused (an overload whose arguments changed would make a
    call ambiguous: the run then fails, it does not measure the wrong function). The base's
    PL/Python modules are imported from the database (its migrate is given no directory, so
    this version's copy on disk is not replaced); an answer over HTTP runs none."""
    url = _template_copy(server, name, base_database(name))
    done = subprocess.run(
        [sys.executable, "-c", BASE_MIGRATE, url],
        env={**os.environ, "PYTHONPATH": base_pythonpath(code)},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"error: the base's migrate failed:\n{done.stderr[-2000:]}")
    lines = done.stdout.strip().splitlines()
    used = Path(lines[-1]) if lines else None
    if used is None or not used.is_relative_to(code):
        raise SystemExit(f"error: the base's migrate ran {used}, not the code in {code}")
    with psycopg.connect(url, autocommit=True) as conn:
        # The copy's writes (CREATE DATABASE, migrate) flushed before anything is timed.
        conn.execute("CHECKPOINT")
    return url


def cmd_bench_peers(args: argparse.Namespace) -> int:
    from poimen_memory.embedders.factory import build_embedder

    s = Settings.from_env()
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = set(names) - set(LABELS)
    if unknown:
        print(f"error: unknown systems {sorted(unknown)}", file=sys.stderr)
        return 2
    ours = [n for n in names if n.startswith("poimen")]
    if args.base is not None and not ours:
        print("error: --base compares a version of ours: name a poimen system", file=sys.stderr)
        return 2
    if args.clients < 0 or args.seconds <= 0 or args.rounds < 1:
        print("error: --clients >= 0, --seconds > 0 and --rounds >= 1", file=sys.stderr)
        return 2
    if "langchain" in names and not langchain_available():
        print(
            "note: langchain-postgres does not import here: its peer is skipped (install "
            "lab[peers], then langchain-postgres with --no-deps; docs/benchmarks.md)",
            file=sys.stderr,
        )
        names.remove("langchain")
    real = args.corpus == "real"
    if real and (args.nodes < 1 or args.projects < 1):
        print("error: --nodes and --projects >= 1", file=sys.stderr)
        return 2
    folders = [] if real else _sets(args)
    loaded = [load_set(folder, args.queries) for folder in folders]
    corpus, texts = realistic_corpus(args, s) if real else (None, None)
    sets = [QuestionSet.judged(d) for d in loaded]
    if corpus is not None and texts is not None:
        sets.append(realistic_set(corpus, texts, args.ask, args.seed))
    unscoped = next((q.id for qs in sets for q in qs.questions if not q.project), None)
    if ours and not args.anonymous and unscoped is not None:
        # A key covering several projects must name one (403), as a deployment's would.
        print(
            f"error: question {unscoped!r} names no project: a keyed run asks each question "
            "with its project's API key",
            file=sys.stderr,
        )
        print("hint: pass --anonymous to ask every project without keys", file=sys.stderr)
        return 2
    base: dict[str, Any] | None = None
    code: Path | None = None
    if args.base is not None:
        commit, code = base_code(args.base, args.cache)
        base = {"ref": args.base, "commit": commit}
        # each base right after its twin: run_set alternates which of the two goes first
        names = [x for n in names for x in ((n, f"{n}@{BASE}") if n in ours else (n,))]
    embedder = build_embedder(s.embedding)
    embedder.embed_query("warm up")  # loads the model: no system's first question pays it
    server = database_url(s, start=True)
    if args.database:
        name, url = args.database, make_conninfo(server, dbname=args.database)
    else:
        name, url = fresh_database(server, "poimen_bench_peers")
    result: dict[str, Any] = {"database": name, "systems": names, "sets": {}, "load": {}}
    databases = {"": name, PEERS: name}
    ours_url = url  # this version's database: a copy of it with --base (copy_for_head)
    try:
        with ExitStack() as stack:
            if not args.database and corpus is not None:
                print(f"bench-peers: loading {args.nodes} nodes (COPY)", file=sys.stderr)
                result["load"]["poimen_copy"] = load_realistic(url, corpus, embedder.model_name)
            elif not args.database:
                print("bench-peers: loading poimen-memory (ingest)", file=sys.stderr)
                result["load"]["poimen_ingest_s"] = load_poimen(
                    url, list(zip(folders, loaded, strict=True)), embedder, args.cache
                )
            elif corpus is not None:
                same_corpus(url, corpus)
            if base is not None and code is not None:
                # Before the peers are built: a template may have no connections, and
                # langchain's engine keeps some open. Before this version migrates the
                # loaded database, too: a run-once migration the base does not know would
                # make the base's copy one its code refuses (a database is never migrated
                # backwards), so a database last migrated by the base measures both.
                print(f"bench-peers: the base ({args.base}): copy, migrate", file=sys.stderr)
                base["database"] = databases[BASE] = base_database(name)
                if not args.keep_db:
                    stack.callback(drop_database, server, base["database"])
                base_url = copy_for_base(server, name, code)
                result["base"] = base
            if args.database:
                # a database loaded by an earlier version: its functions made this version's
                with connect(url, autocommit=True) as conn:
                    migrate(conn, s.plpython_root)
            if base is not None and code is not None:
                databases[""] = base["head_database"] = head_database(name)
                if not args.keep_db:
                    stack.callback(drop_database, server, databases[""])
                ours_url = copy_for_head(server, name, s.plpython_root)
            if "supabase" in names:
                print("bench-peers: building the Supabase recipe", file=sys.stderr)
                result["load"]["supabase"] = build_supabase(url, embedder.dim)
            langchain = None
            if "langchain" in names:
                print("bench-peers: building langchain-postgres' store", file=sys.stderr)
                langchain = LangchainPeer(url, embedder, embedder.dim, args.clients)
                stack.callback(langchain.close)
                result["load"]["langchain"] = langchain.build(url)
            with connect(url, autocommit=True) as conn:
                ensure_service_login(conn, s.service_role)
            keys: dict[str | None, str] = {}
            ours_urls = [ours_url] + ([base_url] if base is not None else [])
            # The keys of a run before this one's (a kept database, a run stopped midway)
            # go first: a key left behind would refuse an anonymous run's every request.
            drop_tenant_keys(ours_urls)
            if ours and not args.anonymous:
                stack.callback(drop_tenant_keys, ours_urls)
                keys = tenant_keys(ours_urls)
                result["keys"] = "one read-only key per project"
            else:
                result["keys"] = "anonymous"
            addresses: dict[str, str] = {}
            servers: dict[str, int] = {}
            if ours:
                addresses[""], servers[""] = stack.enter_context(
                    _server(make_conninfo(ours_url, user=s.service_role), args.clients)
                )
            if base is not None:
                addresses[BASE], servers[BASE] = stack.enter_context(
                    _server(make_conninfo(base_url, user=s.service_role), args.clients, code)
                )
            systems = Systems(url, embedder, names, addresses, langchain, keys)
            stack.callback(systems.close)
            backends = Backends(url, s.service_role, databases)
            stack.callback(backends.close)
            for qs in sets:
                n = len(qs.questions)
                print(f"bench-peers: {qs.name}, {n} questions", file=sys.stderr)
                tallies = run_set(qs, systems, backends, servers, args.turns, args.warmup)
                result["sets"][qs.name] = {
                    "measure": qs.measure,
                    "questions": n - min(args.warmup, n),
                    "nodes": qs.nodes,
                    "peer_turns": args.turns if qs.evidence else 10,
                    "systems": summarize(tallies, args.seed),
                    "per_query": {n: t.per_query for n, t in tallies.items()},
                }
                if args.clients:
                    result["sets"][qs.name]["throughput"] = throughput(
                        qs, systems, backends, servers, args.turns, args.clients, args.seconds,
                        args.rounds,
                    )  # fmt: skip
    finally:
        if not args.database and not args.keep_db:
            drop_database(server, name)
        elif not args.database:
            print(f"kept database {name}", file=sys.stderr)
        if base is not None and args.keep_db and "database" in base:
            print(f"kept database {base['database']} (the base's)", file=sys.stderr)
            print(f"kept database {databases['']} (this version's)", file=sys.stderr)
    result["machine"] = {"load_average": os.getloadavg(), "cpus": os.cpu_count()}
    print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        from poimen_lab.bench.plot import peers_cost_quality

        peers_cost_quality(args.plot, result)
    return 0
