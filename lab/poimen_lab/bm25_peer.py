"""The bm25s library as a peer for memory.lexical_search, on exactly our tokenisation: the
lexemes (with term frequencies) that PostgreSQL's english to_tsvector produced, read once
from memory.postings, and the query's to_tsvector lexemes. One index per project, as our
statistics are per project; BM25 with Lucene's IDF and the same k1/b on both sides."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg

NODES_SQL = """
SELECT n.id, n.project_id, n.level,
       coalesce(array_agg(p.lexeme) FILTER (WHERE p.lexeme IS NOT NULL), '{}'),
       coalesce(array_agg(p.tf) FILTER (WHERE p.lexeme IS NOT NULL), '{}')
FROM memory.nodes n
LEFT JOIN memory.postings p ON p.node_id = n.id AND p.project_id = n.project_id
WHERE n.project_id = ANY(%(projects)s::int[])
GROUP BY n.id, n.project_id, n.level ORDER BY n.id
"""
QUERY_LEXEMES_SQL = """
SELECT tsvector_to_array(to_tsvector('english'::regconfig, u.t))
FROM unnest(%(texts)s::text[]) WITH ORDINALITY AS u(t, i) ORDER BY u.i
"""
PROJECT_IDS_SQL = "SELECT name, id FROM memory.projects WHERE name = ANY(%(names)s::text[])"


@dataclass
class _Index:
    model: Any
    ids: np.ndarray[Any, Any]
    levels: np.ndarray[Any, Any]


class PgLexemeBM25:
    """bm25s over the database's own lexemes; ``search`` mirrors memory.lexical_search."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        projects: Sequence[str],
        *,
        k1: float = 1.2,
        b: float = 0.75,
    ) -> None:
        import bm25s

        self.conn = conn
        pids = dict(conn.execute(PROJECT_IDS_SQL, {"names": list(projects)}).fetchall())
        rows = conn.execute(NODES_SQL, {"projects": list(pids.values())}).fetchall()
        t0 = time.perf_counter()
        # Per project, and one over all of them for queries without a project: with no
        # project filter, lexical_search sums the statistics of every project.
        self.indexes: dict[str | None, _Index] = {}
        groups: list[tuple[str | None, list[tuple[Any, ...]]]] = [
            (name, [r for r in rows if r[1] == pid]) for name, pid in pids.items()
        ]
        if len(pids) > 1:
            groups.append((None, rows))
        for name, mine in groups:
            corpus = [
                [lex for lex, tf in zip(r[3], r[4], strict=True) for _ in range(tf)] for r in mine
            ]
            model = bm25s.BM25(k1=k1, b=b, method="lucene")
            model.index(corpus, show_progress=False)
            self.indexes[name] = _Index(
                model,
                np.array([r[0] for r in mine], dtype=np.int64),
                np.array([r[2] for r in mine]),
            )
        self.index_seconds = time.perf_counter() - t0

    def query_lexemes(self, texts: Sequence[str]) -> list[list[str]]:
        """to_tsvector lexemes, deduplicated as lexical_search does (tsvector keeps each once)."""
        return [list(r[0]) for r in self.conn.execute(QUERY_LEXEMES_SQL, {"texts": list(texts)})]

    def search(
        self, lexemes: Sequence[str], project: str | None, levels: Sequence[str] | None, k: int
    ) -> list[int]:
        """Node ids by descending score; only nodes matching a query lexeme, like ours."""
        return self.search_scored(lexemes, project, levels, k)[0]

    def search_scored(
        self, lexemes: Sequence[str], project: str | None, levels: Sequence[str] | None, k: int
    ) -> tuple[list[int], list[float]]:
        """Node ids and their BM25 scores, best first (ties by id, as lexical_search)."""
        hits: list[tuple[float, int]] = []
        ix = self.indexes.get(project) or self.indexes[next(iter(self.indexes))]
        tokens = [t for t in lexemes if t in ix.model.vocab_dict]
        if tokens:
            mask = None if levels is None else np.isin(ix.levels, list(levels)).astype(np.float32)
            docs, scores = ix.model.retrieve(
                [tokens], k=min(k, len(ix.ids)), show_progress=False, weight_mask=mask
            )
            hits = [
                (float(s), int(ix.ids[d])) for d, s in zip(docs[0], scores[0], strict=True) if s > 0
            ]
        hits.sort(key=lambda h: (-h[0], h[1]))
        return [nid for _, nid in hits[:k]], [s for s, _ in hits[:k]]
