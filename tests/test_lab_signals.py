"""poimen_lab.eval.signals, the in-process measurement of ranking signals (docs/benchmarks.md:
SciFact beyond two legs): its fusion must be the database's, or its rows measure something
else."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest

from poimen_lab.bm25_peer import PgLexemeBM25
from poimen_lab.eval.data import Query
from poimen_lab.eval.signals import (
    CONFIGS,
    best_per_owner,
    convex,
    load_corpus,
    measure,
    sentences,
)
from poimen_memory.embedders.local import LocalEmbedder

Conn = psycopg.Connection[Any]
QUESTIONS = ["kong upload body buffer", "postgres connection pool timeouts", "backup s3 bucket"]


def test_sentences_split_at_sentence_ends_only() -> None:
    text = "Alpha rose 3.5 fold. Beta fell! (Gamma) held? 2 groups differed.  "
    assert sentences(text) == [
        "Alpha rose 3.5 fold.",
        "Beta fell!",
        "(Gamma) held?",
        "2 groups differed.",
    ]
    assert sentences("no end here") == ["no end here"]
    assert sentences("   ") == []


def test_best_per_owner_takes_each_owners_maximum() -> None:
    out = best_per_owner(np.array([0.1, 0.7, 0.3, -0.2]), np.array([0, 0, 2, 2]), 4)
    assert out.tolist() == [0.7, -1.0, 0.3, -1.0]


def test_convex_ranks_as_memory_fuse_legs(
    fixture_url: str, conn: Conn, embedder: LocalEmbedder
) -> None:
    """The default row's rule on full score vectors against the SQL path on the legs' top
    5 (fewer than the project's nodes, so each list's min-max is over its own top, as on
    SciFact): the same nodes in the same order."""
    corpus = load_corpus(fixture_url)
    peer = PgLexemeBM25(conn, ["poimen"])
    position = {int(i): j for j, i in enumerate(corpus.ids)}
    sizes: list[int] = []
    for text in QUESTIONS:
        v = np.asarray(embedder.embed_query(text), dtype=np.float64)
        bm25 = np.zeros(len(corpus.ids))
        ix = peer.indexes["poimen"]
        terms = [t for t in peer.query_lexemes([text])[0] if t in ix.model.vocab_dict]
        for node, s in zip(ix.ids, ix.model.get_scores(terms), strict=True):
            bm25[position[int(node)]] = s
        ours = convex(
            {"bm25": bm25, "dense": corpus.vectors @ v},
            {"bm25": 0.6, "dense": 0.4},
            corpus.ids,
            5,
            np.array(corpus.projects) == "poimen",
        )
        vec = "[" + ",".join(map(str, v.tolist())) + "]"
        sql = conn.execute(
            """
            WITH lex AS (
                SELECT jsonb_build_object('ids', jsonb_agg(node_id ORDER BY rank),
                                          'scores', jsonb_agg(lexical_score ORDER BY rank)) j
                FROM memory.lexical_search(%(t)s, 'poimen', NULL, 5)
            ), sem AS (
                SELECT jsonb_build_object('ids', jsonb_agg(node_id ORDER BY rank),
                                          'scores', jsonb_agg(query_score ORDER BY rank)) j
                FROM memory.exact_search(%(v)s::vector, 'poimen', NULL, 5)
            )
            SELECT f.node_id
            FROM lex, sem, memory.fuse_legs(sem.j, lex.j, 'Hybrid', 'convex', 0.4, 10, 10) f
            """,
            {"t": text, "v": vec},
        ).fetchall()
        assert [int(corpus.ids[i]) for i in ours] == [r[0] for r in sql]
        sizes.append(len(sql))
    assert min(sizes) >= 5 and max(sizes) > 5  # at least once the legs disagreed


def test_measure_reports_every_row_and_reuses_its_cache(
    fixture_url: str, conn: Conn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    best = conn.execute(
        "SELECT n.external_id"
        " FROM memory.lexical_search('kong body buffer size', 'poimen', NULL, 1) l"
        " JOIN memory.nodes n ON n.id = l.node_id"
    ).fetchone()
    assert best is not None
    queries = [Query("q1", "kong body buffer size", "poimen")]
    judged = {"q1": {best[0]: 1}}
    configs = {name: CONFIGS[name] for name in [*list(CONFIGS)[:5], "bm25 .5, mixed .5"]}
    cache = tmp_path / "sentences.npz"
    calls: list[int] = []
    embed = LocalEmbedder.embed_documents

    def counted(self: LocalEmbedder, texts: Any) -> Any:
        calls.append(len(texts))
        return embed(self, texts)

    monkeypatch.setattr(LocalEmbedder, "embed_documents", counted)
    first = measure(fixture_url, queries, judged, cache=cache, configs=configs)
    assert len(calls) == 2 and calls[1] == 1  # the sentences, then the one query
    assert list(first) == list(configs)
    assert first["lexical only"] == [1.0]  # lexical_search's first, first here too
    assert all(0 <= v[0] <= 1 for v in first.values())
    saved = np.load(cache)
    assert saved["owner"].max() < len(saved["ids"]) and len(saved["vectors"]) >= len(saved["ids"])
    assert measure(fixture_url, queries, judged, cache=cache, configs=configs) == first
    assert len(calls) == 3  # only the query: the sentences came from the cache
    json.dumps(first)  # the --json file is this mapping
