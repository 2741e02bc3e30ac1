"""The postings-as-blocks bench (lab/poimen_lab/bench/blocks.py) on the fixture: every block
scorer must return the rows scorer's top k for every query, and the blocks weigh less."""

from __future__ import annotations

from typing import Any

import psycopg

from poimen_lab.bench import blocks
from poimen_lab.bench.scratch import module_parser

QUERIES = [
    ("uploads failing with 413 from the gateway", "poimen"),
    ("kong client body buffer size nginx limit", "poimen"),
    ("why do request bodies get buffered to disk", "poimen"),
    ("atlas deploy", "atlas"),
]


def test_block_scorers_rank_as_the_rows(fixture_url: str, conn: psycopg.Connection[Any]) -> None:
    ap = module_parser(blocks.__doc__)
    blocks.add_arguments(ap)
    # blocks of 2 postings: every common term spans several blocks
    args = ap.parse_args(["--url", fixture_url, "--block", "2", "--rounds", "2", "--k", "5"])
    r = blocks.measure(fixture_url, QUERIES, args)
    # as the HTTP service reads: its role, under row-level security
    assert (r["role"],) == conn.execute("SELECT service FROM memory.roles()").fetchone()
    assert r["numpy_unavailable"] is None  # memory.embed's numpy is the server's (make setup)
    assert r["queries"] >= 3
    assert set(r["scorers"]) == {"terms", "rows", "lexical_search", "arrays+sql", "packed+numpy"}
    assert r["scorers"]["rows"]["same_top_k"] is None  # the reference
    for name in ("lexical_search", "arrays+sql", "packed+numpy"):
        assert r["scorers"][name]["same_top_k"] == r["queries"], name
    for name in r["scorers"]:
        assert r["scorers"][name]["cpu_ms"] > 0, name
    s = r["sizes"]
    assert s["postings"] == conn.execute("SELECT count(*) FROM memory.postings").fetchone()[0]  # type: ignore[index]
    # blocks of 2: as many blocks as ceil(postings / 2) over each (lexeme, project) list
    want = conn.execute(
        "SELECT sum((n + 1) / 2) FROM (SELECT count(*) AS n FROM memory.postings"
        " GROUP BY lexeme, project_id) l"
    ).fetchone()
    assert want is not None and s["packed_blocks"] == s["arrays_blocks"] == want[0]
    assert s["lists"] < s["packed_blocks"] < s["postings"]
    assert 0 < s["packed_bytes_per_posting"] < s["rows_bytes_per_posting"]
    assert "packed+numpy" in blocks.report(r)
    # the scratch schema is gone
    assert conn.execute(
        "SELECT count(*) FROM pg_namespace WHERE nspname = %s", (blocks.SCHEMA,)
    ).fetchone() == (0,)
