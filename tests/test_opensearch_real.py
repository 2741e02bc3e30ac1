"""Against a real OpenSearch cluster; runs only when POIMEN_OPENSEARCH_URL is set."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import psycopg
import pytest

from poimen_memory.db.queries import q
from poimen_memory.ingest.outbox import reindex
from poimen_memory.settings import Settings
from poimen_memory.upstreams.opensearch import OpenSearchEngine, engine_from_settings

pytestmark = [
    pytest.mark.opensearch,
    pytest.mark.skipif(
        not os.environ.get("POIMEN_OPENSEARCH_URL"), reason="POIMEN_OPENSEARCH_URL is not set"
    ),
]


@pytest.fixture
def engine() -> Iterator[OpenSearchEngine]:
    # A throwaway index, so the test never touches a configured one.
    base = Settings.from_env()
    settings = replace(base.opensearch, index=f"poimen-test-{uuid.uuid4().hex[:8]}")
    engine = engine_from_settings(settings)
    assert engine is not None
    try:
        yield engine
    finally:
        engine.delete_index()
        engine.close()


def test_reindex_then_search_ranks_a_poimen_node_first(
    conn: psycopg.Connection[Any], engine: OpenSearchEngine
) -> None:
    assert engine.healthy()
    total = conn.execute(q("count_nodes")).fetchone()
    assert total is not None and reindex(conn, engine, progress=False) == total[0]
    hits = engine.search("kong body buffer", "poimen", None, 5, 5.0)
    assert hits
    [(node_id, _)] = conn.execute(
        q("ids_for_sha256"), {"shas": [bytes.fromhex(hits[0].sha256)]}
    ).fetchall()
    row = conn.execute(
        "SELECT p.name, n.text FROM memory.nodes n JOIN memory.projects p "
        "ON p.id = n.project_id WHERE n.id = %s",
        [node_id],
    ).fetchone()
    assert row is not None and row[0] == "poimen" and "buffer" in row[1].lower()
