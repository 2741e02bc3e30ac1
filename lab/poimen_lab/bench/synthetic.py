"""A synthetic memory graph for benchmarks: clustered unit vectors generated directly (no
embedder), text drawn from a small vocabulary with Zipfian word frequencies (plus a few
topic words per cluster, so lexical and vector similarity roughly agree), L0/L1/L2 levels
with provenance edges, and a 1% project for selective filters. Loaded with COPY."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg

from poimen_memory.db.migrate import build_project_graphs
from poimen_memory.ingest.nodes import node_sha256

MAIN, SMALL = "bench-main", "bench-small"
SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ne",
    "ru",
    "sa",
    "ti",
    "vo",
    "xe",
    "zu",
    "bar",
    "den",
    "fil",
    "gor",
    "hun",
    "jam",
    "kel",
    "mor",
    "nip",
    "pal",
    "quo",
    "ris",
    "tev",
    "wal",
)
LEVEL_SHARE = (("L0", 0.70), ("L1", 0.25), ("L2", 0.05))


@dataclass
class Corpus:
    vectors: np.ndarray[Any, np.dtype[np.float32]]
    texts: list[str]
    levels: list[str]
    projects: list[str]
    parents: list[list[int]]
    """Per node, the indexes of its parents (L1 -> L0, L2 -> L1, within the project)."""
    query_vectors: np.ndarray[Any, np.dtype[np.float32]]
    query_texts: list[str]
    query_projects: list[str]
    """Per query, the project whose nodes it was drawn from (for filtered runs)."""


def vocabulary(size: int, rng: np.random.Generator) -> list[str]:
    words: set[str] = set()
    while len(words) < size:
        n = int(rng.integers(2, 5))
        words.add("".join(SYLLABLES[int(i)] for i in rng.integers(0, len(SYLLABLES), n)))
    return sorted(words)


def _unit(x: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.float32]]:
    x = x.astype(np.float32)
    out: np.ndarray[Any, np.dtype[np.float32]] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def project_names(count: int) -> list[str]:
    return [f"tenant-{i:03d}" for i in range(count)]


def generate(
    n: int,
    dim: int,
    n_queries: int,
    *,
    seed: int = 0,
    vocab: int = 5000,
    noise: float = 0.9,
    projects: int = 0,
) -> Corpus:
    """projects = 0: the main project and a 1% one; otherwise that many projects with
    Zipf-distributed sizes (the i-th largest holds a share proportional to 1/i), as tenants
    of a shared service are."""
    rng = np.random.default_rng(seed)
    words = vocabulary(vocab, rng)
    zipf = 1.0 / np.arange(1, vocab + 1) ** 1.1
    zipf /= zipf.sum()
    n_clusters = max(4, n // 250)
    centers = rng.standard_normal((n_clusters, dim)).astype(np.float32)
    topics = rng.integers(0, vocab, (n_clusters, 12))
    cluster = rng.integers(0, n_clusters, n)
    vectors = _unit(centers[cluster] + noise * rng.standard_normal((n, dim)).astype(np.float32))

    def text(c: int, length: int) -> str:
        bg = rng.choice(vocab, size=length, p=zipf)
        topical = rng.choice(topics[c], size=max(1, length // 4))
        return " ".join(words[int(i)] for i in np.concatenate([bg, topical]))

    levels = list(rng.choice([lv for lv, _ in LEVEL_SHARE], size=n, p=[p for _, p in LEVEL_SHARE]))
    if projects:
        share = 1.0 / np.arange(1, projects + 1)
        names = project_names(projects)
        picked = rng.choice(projects, size=n, p=share / share.sum())
        projects_of = [names[int(i)] for i in picked]
    else:
        projects_of = [SMALL if x < 0.01 else MAIN for x in rng.random(n)]
    lengths = {"L0": (15, 50), "L1": (8, 25), "L2": (30, 80)}
    texts = [text(int(cluster[i]), int(rng.integers(*lengths[levels[i]]))) for i in range(n)]
    pools: dict[tuple[str, str], list[int]] = {}
    for i, (lv, pr) in enumerate(zip(levels, projects_of, strict=True)):
        pools.setdefault((pr, lv), []).append(i)
    below = {"L1": "L0", "L2": "L1"}
    parents: list[list[int]] = []
    for lv, pr in zip(levels, projects_of, strict=True):
        pool = pools.get((pr, below.get(lv, "")), [])
        k = 0 if not pool else int(rng.integers(1, 4 if lv == "L1" else 8))
        parents.append(sorted({pool[int(j)] for j in rng.integers(0, len(pool), k)}) if k else [])

    src = rng.integers(0, n, n_queries)
    # A query is a perturbed node: noise of norm ~1 against a unit vector, so its nearest
    # neighbours are well defined but not trivial (top-1 cosine ~0.7, top-10 ~0.45).
    jitter = rng.standard_normal((n_queries, dim)).astype(np.float32) / np.sqrt(dim)
    qvec = _unit(vectors[src] + jitter)
    qtext = [text(int(cluster[i]), int(rng.integers(3, 7))) for i in src]
    return Corpus(
        vectors,
        texts,
        levels,
        projects_of,
        parents,
        qvec,
        qtext,
        [projects_of[int(i)] for i in src],
    )


COPY_NODES = (
    "COPY memory.nodes (sha256, project_id, level, external_id, text, source, embedding) "
    "FROM STDIN (FORMAT BINARY)"
)
COPY_EDGES = (
    "COPY memory.edges (child_id, parent_id, precedence, project_id) FROM STDIN (FORMAT BINARY)"
)


def load(conn: psycopg.Connection[Any], corpus: Corpus, model: str) -> dict[str, Any]:
    """COPY the corpus into a migrated, empty database; the HNSW index is dropped first and
    rebuilt (timed) afterwards, as a bulk load should. Returns the node ids and timings."""
    from pgvector.psycopg import register_vector

    register_vector(conn)
    dim = corpus.vectors.shape[1]
    conn.execute("SELECT memory.configure_embedding(%s, %s)", (model, dim))
    conn.execute("DROP INDEX IF EXISTS memory.nodes_embedding_hnsw")
    conn.execute("DROP INDEX IF EXISTS memory.nodes_embedding_hnsw_l1_l2")
    conn.execute(
        "INSERT INTO memory.projects (name) SELECT unnest(%s::text[]) ORDER BY 1"
        " ON CONFLICT DO NOTHING",
        (sorted({MAIN, SMALL} | set(corpus.projects)),),
    )
    pid = dict(conn.execute("SELECT name, id FROM memory.projects").fetchall())
    t0 = time.perf_counter()
    with conn.transaction(), conn.cursor() as cur, cur.copy(COPY_NODES) as copy:
        copy.set_types(["bytea", "int4", "text", "text", "text", "text", "vector"])
        for i, (vec, txt) in enumerate(zip(corpus.vectors, corpus.texts, strict=True)):
            pr, lv, ext = corpus.projects[i], corpus.levels[i], f"n{i}"
            sha = node_sha256(pr, lv, ext, ext, None, txt)
            copy.write_row((sha, pid[pr], lv, ext, txt, ext, vec))
    copy_s = time.perf_counter() - t0
    ids = dict(conn.execute("SELECT external_id, id FROM memory.nodes").fetchall())
    db_ids = np.array([ids[f"n{i}"] for i in range(len(corpus.texts))], dtype=np.int64)
    t0 = time.perf_counter()
    with conn.transaction(), conn.cursor() as cur, cur.copy(COPY_EDGES) as copy:
        copy.set_types(["int8", "int8", "int4", "int4"])
        for child, ps in enumerate(corpus.parents):
            for pos, p in enumerate(ps):
                copy.write_row(
                    (int(db_ids[child]), int(db_ids[p]), pos, pid[corpus.projects[child]])
                )
    edges_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    conn.execute(
        "CREATE INDEX nodes_embedding_hnsw ON memory.nodes "
        "USING hnsw (embedding vector_cosine_ops) WITH (m = 16, ef_construction = 64)"
    )
    hnsw_s = time.perf_counter() - t0
    conn.execute(
        "CREATE INDEX nodes_embedding_hnsw_l1_l2 ON memory.nodes USING hnsw "
        "(embedding vector_cosine_ops) WITH (m = 16, ef_construction = 64) "
        "WHERE level IN ('L1', 'L2')"
    )
    all_graphs_s = time.perf_counter() - t0
    # What migrate adds now that the projects have their sizes: the graphs of each large
    # project (memory._project_graphs, issue 28), built concurrently after its transaction.
    t0 = time.perf_counter()
    conn.execute("SELECT memory._ensure_indexes()")
    own = build_project_graphs(conn)
    project_graphs_s = time.perf_counter() - t0
    conn.execute("VACUUM ANALYZE memory.nodes")
    conn.execute("VACUUM ANALYZE memory.postings")
    conn.execute("VACUUM ANALYZE memory.edges")
    size = conn.execute(
        "SELECT pg_relation_size('memory.nodes_embedding_hnsw'), "
        "current_setting('max_parallel_maintenance_workers'), "
        "current_setting('shared_buffers'), current_setting('maintenance_work_mem'), "
        "(SELECT coalesce(sum(pg_relation_size(indexrelid)), 0)::bigint FROM pg_index i "
        " JOIN pg_class c ON c.oid = i.indexrelid "
        " WHERE i.indrelid = 'memory.nodes'::regclass"
        "   AND c.relname LIKE 'nodes_embedding_hnsw%%'), "
        "pg_total_relation_size('memory.nodes')"
    ).fetchone()
    assert size is not None
    return {
        "db_ids": db_ids,
        "copy_seconds": copy_s,
        "copy_nodes_per_s": len(corpus.texts) / copy_s,
        "edges": sum(len(p) for p in corpus.parents),
        "edges_seconds": edges_s,
        "hnsw_build_seconds": hnsw_s,
        "hnsw_index_mb": size[0] / 2**20,
        "hnsw_both_graphs_seconds": all_graphs_s,
        "project_graphs": len({g.project_id for g in own}),
        "project_graphs_seconds": project_graphs_s,
        "hnsw_all_indexes_mb": size[4] / 2**20,
        "nodes_total_mb": size[5] / 2**20,
        "parallel_maintenance_workers": int(size[1]),
        "shared_buffers": size[2],
        "maintenance_work_mem": size[3],
    }


def add_tenants(conn: psycopg.Connection[Any], n: int, largest: int, seed: int) -> dict[str, Any]:
    """n more projects, sized by a Zipf law (the r-th holds ceil(largest / r) nodes, half
    L0, half L1): a store serving many tenants, as the service meets it. Random unit vectors
    and words of their own (the vocabulary's words, so BM25 statistics are shared), written
    by SQL in one statement, then analysed."""
    words = vocabulary(5000, np.random.default_rng(seed))
    sizes = [int(np.ceil(largest / r)) for r in range(1, n + 1)]
    t0 = time.perf_counter()
    conn.execute(
        """
        WITH p AS (
            INSERT INTO memory.projects (name)
            SELECT format('tenant-%%s', r) FROM generate_series(1, %(n)s) r
            ON CONFLICT (name) DO NOTHING
            RETURNING id, (regexp_match(name, '[0-9]+$'))[1]::integer AS r
        )
        INSERT INTO memory.nodes (sha256, project_id, level, external_id, text, embedding)
        SELECT sha256(convert_to(p.id || ':' || j, 'UTF8')), p.id,
               CASE WHEN j %% 2 = 0 THEN 'L0' ELSE 'L1' END, format('t%%s-%%s', p.r, j),
               (SELECT string_agg((%(words)s::text[])[1 + floor(random() * %(nw)s)::integer], ' ')
                FROM generate_series(1, 12) WHERE j > 0),
               (SELECT l2_normalize(array_agg(random() - 0.5)::vector)
                FROM generate_series(1, %(dim)s) WHERE j > 0)
        FROM p, generate_series(1, (%(sizes)s::integer[])[p.r]) j
        """,
        {
            "n": n,
            "sizes": sizes,
            "words": list(words),
            "nw": len(words),
            "dim": conn.execute("SELECT dim FROM memory.embedding_model").fetchone()[0],  # type: ignore[index]
        },
    )
    conn.execute("VACUUM ANALYZE")
    return {"projects": n, "nodes": sum(sizes), "largest": largest,
            "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
