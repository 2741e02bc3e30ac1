"""Pruned BM25 (memory.lexical_search, MaxScore over per-term bounds) ranks exactly as the
exhaustive reference (exhaustive => true): on a Zipfian corpus large enough for the
pruning to engage, on SciFact's real abstracts and claims when ../shared/data is present,
and after deletes and updates that leave the stored bounds loose."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest

from poimen_memory.db.cluster import Cluster
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import migrate

Conn = psycopg.Connection[Any]
ROOT = Path(__file__).resolve().parents[1]
SCIFACT = ROOT.parent / "shared" / "data" / "scifact"

WINDOW = "since => %s::timestamptz, before => %s::timestamptz"
PRUNED = f"SELECT node_id, lexical_score FROM memory.lexical_search(%s, %s, %s, %s, {WINDOW})"
EXACT = (
    f"SELECT node_id, lexical_score FROM memory.lexical_search(%s, %s, %s, %s, {WINDOW},"
    " exhaustive => true)"
)
INSERT = """
INSERT INTO memory.nodes (sha256, project_id, level, text)
SELECT sha256(convert_to(%(tag)s || ':' || u.i, 'UTF8')),
       (SELECT id FROM memory.projects WHERE name = %(project)s), u.level, u.text
FROM unnest(%(texts)s::text[], %(levels)s::text[]) WITH ORDINALITY AS u(text, level, i)
"""


def _words(n: int, rng: np.random.Generator) -> list[str]:
    syl = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "bar", "den", "fil", "gor", "hun"]
    out: set[str] = set()
    while len(out) < n:
        out.add("".join(syl[int(i)] for i in rng.integers(0, len(syl), int(rng.integers(2, 5)))))
    return sorted(out)


def zipf_texts(n: int, length: tuple[int, int], seed: int, vocab: int = 800) -> list[str]:
    rng = np.random.default_rng(seed)
    words = _words(vocab, np.random.default_rng(0))
    p = 1.0 / np.arange(1, vocab + 1) ** 1.1
    p /= p.sum()
    return [
        " ".join(words[int(i)] for i in rng.choice(vocab, int(rng.integers(*length)), p=p))
        for _ in range(n)
    ]


def load(conn: Conn, project: str, texts: list[str], levels: list[str]) -> None:
    conn.execute(
        "INSERT INTO memory.projects (name) VALUES (%s) ON CONFLICT DO NOTHING", (project,)
    )
    tag = uuid.uuid4().hex
    conn.execute(INSERT, {"tag": tag, "project": project, "texts": texts, "levels": levels})


def assert_same_ranking(
    conn: Conn, query: str, project: str | None, levels: Any, k: int, window: Any = (None, None)
) -> None:
    args = (query, project, levels, k, *window)
    got = conn.execute(PRUNED, args).fetchall()
    want = conn.execute(EXACT, args).fetchall()
    # Both sum the same per-term weights, in different orders, so their raw sums may differ
    # in the last bits; rounded (memory._bm25_score), equal documents tie exactly and break
    # by id: the same ids, the same order, the same scores.
    assert got == want, (query, got, want)


@pytest.fixture(scope="module")
def zipf_db(cluster: Cluster, admin: psycopg.Connection[Any], plpython_root: Path) -> Iterator[str]:
    name = f"t_zipf_{uuid.uuid4().hex[:8]}"
    admin.execute(f"CREATE DATABASE {name}")
    try:
        with connect(cluster.url(name), autocommit=True) as conn:
            migrate(conn, plpython_root)
            rng = np.random.default_rng(1)
            texts = zipf_texts(6000, (10, 60), seed=1)
            levels = [
                str(x) for x in rng.choice(["L0", "L1", "L2"], len(texts), p=[0.7, 0.25, 0.05])
            ]
            load(conn, "big", texts[:5400], levels[:5400])
            load(conn, "small", texts[5400:], levels[5400:])
            conn.execute("ANALYZE memory.postings")
        yield cluster.url(name)
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def queries(n: int, seed: int) -> list[str]:
    # Mixed: frequent and rare words, 2-8 terms, as the bench draws them.
    return zipf_texts(n, (2, 9), seed=seed, vocab=800)


def test_pruning_engages_and_bounds_hold(zipf_db: str) -> None:
    with connect(zipf_db, autocommit=True) as conn:
        bad = conn.execute(
            "SELECT count(*) FROM memory.postings p "
            "JOIN memory.term_stats t USING (project_id, lexeme) "
            "WHERE p.tf > t.max_tf OR p.dl::float8 / p.tf < t.min_dl_per_tf"
        ).fetchone()
        assert bad == (0,)
        # The bound-tracking columns are exact after inserts alone.
        assert conn.execute("SELECT memory.refresh_lexical_bounds()").fetchone() == (0,)
        # Enough postings per query for the pruned path (not the small-query shortcut).
        big = conn.execute(
            "SELECT sum(df) FROM memory.term_stats WHERE lexeme = ANY ("
            "tsvector_to_array(to_tsvector('english', %s)))",
            (queries(1, 7)[0],),
        ).fetchone()
        assert big is not None and big[0] > 4 * 10 + 256


@pytest.mark.parametrize("k", [1, 10, 50])
def test_pruned_equals_exact_on_zipfian_corpus(zipf_db: str, k: int) -> None:
    with connect(zipf_db, autocommit=True) as conn:
        for i, text in enumerate(queries(60, seed=100 + k)):
            project = (None, "big", "small")[i % 3]
            levels = (None, ["L1", "L2"], ["L0"])[i % 3 if i % 2 else 0]
            assert_same_ranking(conn, text, project, levels, k)


def test_pruned_equals_exact_under_a_time_filter(zipf_db: str) -> None:
    """The filter applies where candidates enter (seed and essential terms); the
    non-essential terms only add to candidates already in range, so the pruning stays exact."""
    with connect(zipf_db) as conn, conn.transaction(force_rollback=True):
        conn.execute(
            "UPDATE memory.nodes SET ts = timestamptz '2023-01-01' + (id % 365) * interval '1 day'"
            " WHERE id % 17 <> 0"  # and some nodes without a timestamp
        )
        windows = [("2023-03-01", "2023-04-01"), ("2023-06-15", None), (None, "2023-01-20")]
        for i, text in enumerate(queries(45, seed=300)):
            window = windows[i % 3]
            assert_same_ranking(conn, text, (None, "big")[i % 2], None, (1, 10, 50)[i % 3], window)
            lo, hi = (datetime.fromisoformat(w).replace(tzinfo=UTC) if w else None for w in window)
            rows = conn.execute(
                f"SELECT n.ts FROM memory.lexical_search(%s, NULL, NULL, 50, {WINDOW}) l "
                "JOIN memory.nodes n ON n.id = l.node_id",
                (text, lo, hi),
            ).fetchall()
            assert rows
            assert all(
                r[0] and (lo is None or r[0] >= lo) and (hi is None or r[0] < hi) for r in rows
            )


def test_pruned_equals_exact_after_deletes_and_updates(zipf_db: str) -> None:
    with connect(zipf_db, autocommit=True) as conn, conn.transaction():
        # Remove the documents that set the bounds, and rewrite others: the stored bounds
        # stay valid (loose) until refreshed, and rankings must not change either way.
        conn.execute(
            "DELETE FROM memory.nodes WHERE id IN (SELECT p.node_id FROM memory.postings p "
            "JOIN memory.term_stats t USING (project_id, lexeme) WHERE p.tf = t.max_tf LIMIT 300)"
        )
        conn.execute("UPDATE memory.nodes SET text = text || ' ' || text WHERE id % 7 = 0")
        qs = queries(40, seed=9)
        for text in qs:
            assert_same_ranking(conn, text, None, None, 10)
        tightened = conn.execute("SELECT memory.refresh_lexical_bounds()").fetchone()
        assert tightened is not None and tightened[0] > 0
        for text in qs:
            assert_same_ranking(conn, text, "big", None, 10)
        raise psycopg.Rollback()  # leave the module's corpus as it was


@pytest.mark.skipif(not (SCIFACT / "nodes.jsonl").exists(), reason="../shared/data absent")
def test_pruned_equals_exact_on_scifact(
    cluster: Cluster, admin: psycopg.Connection[Any], plpython_root: Path
) -> None:
    name = f"t_scifact_{uuid.uuid4().hex[:8]}"
    admin.execute(f"CREATE DATABASE {name}")
    try:
        with connect(cluster.url(name), autocommit=True) as conn:
            migrate(conn, plpython_root)
            nodes = [
                json.loads(line) for line in (SCIFACT / "nodes.jsonl").read_text().splitlines()
            ]
            texts = [((n.get("title") or "") + " " + n["text"]).strip() for n in nodes]
            load(conn, "scifact", texts, ["L0"] * len(texts))
            conn.execute("ANALYZE memory.postings")
            claims = [
                json.loads(line)["text"]
                for line in (SCIFACT / "queries-train.jsonl").read_text().splitlines()
            ]
            for i, claim in enumerate(claims):
                assert_same_ranking(conn, claim, "scifact" if i % 2 else None, None, 10)
            for claim in claims[:100]:
                assert_same_ranking(conn, claim, "scifact", None, 100)
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
