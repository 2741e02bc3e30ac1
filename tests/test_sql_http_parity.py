"""memory_query() from plain SQL, given text only, answers like GET /memory/query: 100 LoCoMo
dev questions through both (the service over real HTTP in its own process, no reranker, no
OpenSearch; SQL embedding in the database) return the same node ids in the same order."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from poimen_lab.live_server import live_server
from poimen_memory.db.cluster import Cluster
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import migrate
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.ingest.nodes import parse_lines
from poimen_memory.ingest.writer import ingest

ROOT = Path(__file__).resolve().parents[1]
LOCOMO = ROOT.parent / "shared" / "data" / "locomo-dev"
PROJECT = "conv-26"  # one conversation (of six) keeps the load to ~700 nodes
QUESTIONS = 100
K = 10

pytestmark = pytest.mark.skipif(
    not (LOCOMO / "nodes.jsonl").is_file(),
    reason=f"LoCoMo dev data not found at {LOCOMO} (see /work/shared/data/README.md)",
)


def _lines(name: str) -> list[str]:
    return [
        line
        for line in (LOCOMO / name).read_text().splitlines()
        if line.strip() and json.loads(line)["project"] == PROJECT
    ]


@pytest.fixture(scope="module")
def locomo_url(
    cluster: Cluster,
    admin: psycopg.Connection[Any],
    plpython_root: Path,
    embedder: LocalEmbedder,
) -> Iterator[str]:
    name = f"t_locomo_{uuid.uuid4().hex[:8]}"
    admin.execute(f"CREATE DATABASE {name}")
    try:
        with connect(cluster.url(name), autocommit=True) as conn:
            migrate(conn, plpython_root)
            records, errors = parse_lines(_lines("nodes.jsonl"))
            assert not errors
            report = ingest(conn, records, embedder, progress=False)
            assert report.inserted == len(records)
        yield cluster.url(name)
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_sql_and_http_return_the_same_nodes_for_100_locomo_questions(
    locomo_url: str, tmp_path: Path
) -> None:
    questions = [json.loads(line)["text"] for line in _lines("queries.jsonl")][:QUESTIONS]
    assert len(questions) == QUESTIONS
    strategies: Counter[str] = Counter()
    env = {"POIMEN_DATABASE_URL": locomo_url}  # no POIMEN_RERANK_URL, no POIMEN_OPENSEARCH_URL
    with (
        live_server(env, tmp_path / "server.log") as url,
        connect(locomo_url, autocommit=True) as conn,
        httpx.Client(base_url=url, timeout=60) as http,
    ):
        for text in questions:
            sql_rows = conn.execute(
                "SELECT node_id, search_strategy FROM public.memory_query(%s, project => %s,"
                " k => %s)",
                (text, PROJECT, K),
            ).fetchall()
            response = http.get(
                "/memory/query", params={"query": text, "project": PROJECT, "limit": K}
            )
            assert response.status_code == 200, response.text
            body = response.json()
            # Only the reranker is absent (as intended): no embedder or engine fell back.
            assert {d["stage"] for d in body["degraded"]} <= {"rerank"}, (text, body["degraded"])
            http_ids = [
                row[0]
                for r in body["results"]
                for row in conn.execute(
                    "SELECT n.id FROM memory.nodes n JOIN memory.projects p ON p.id = n.project_id"
                    " WHERE p.name = %s AND n.sha256 = decode(%s, 'hex')",
                    (PROJECT, r["sha256"]),
                ).fetchall()
            ]
            assert [r[0] for r in sql_rows] == http_ids, text
            assert {r[1] for r in sql_rows} <= {body["search_strategy"]}, text
            strategies[body["search_strategy"]] += 1
    # Most questions embed in the database (the semantic leg runs), not LexicalOnly.
    print("strategies:", dict(strategies))
    assert strategies["Hybrid"] + strategies["LexicalFirst"] >= QUESTIONS // 2, strategies
