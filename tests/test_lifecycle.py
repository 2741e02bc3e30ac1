"""Memory that changes (issue 24): versions, optimistic concurrency, retire and erase by id
and by filter, history, the support of derived nodes, and BM25 statistics that stay equal
to a rebuild from the current rows, against real PostgreSQL and the real app."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest
from pgvector.psycopg import register_vector
from starlette.testclient import TestClient

from poimen_core.vocabulary import SQLSTATES
from poimen_memory.db.connect import connect, ensure_service_login
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.ingest.nodes import parse_lines, write_row
from service_client import make_key, serve
from test_api_keys import _as

Conn = psycopg.Connection[Any]
P = "life"
ROLE = "poimen_service"
DIM = 384

# The BM25 statistics rebuilt from the current rows, compared with the stored ones: every
# difference, both ways (an empty result is equality).
REBUILD_DIFF = """
WITH cur AS (SELECT * FROM memory.nodes WHERE expired_at IS NULL),
post AS (SELECT u.lexeme, n.project_id, n.id AS node_id, n.level, cardinality(u.positions) AS tf,
                n.lex_len AS dl FROM cur n, unnest(n.tsv) u),
df AS (SELECT project_id, lexeme, count(*)::integer AS df FROM post GROUP BY 1, 2),
corpus AS (SELECT project_id, count(*)::bigint AS n, sum(lex_len)::bigint AS len
           FROM cur GROUP BY 1),
stored AS (SELECT lexeme, project_id, node_id, level, tf, dl FROM memory.postings)
SELECT 'postings' AS t, x::text FROM
  ((SELECT * FROM post EXCEPT SELECT * FROM stored)
   UNION ALL
   (SELECT * FROM stored EXCEPT SELECT * FROM post)) x
UNION ALL
SELECT 'term_stats', x::text FROM
  ((SELECT * FROM df EXCEPT SELECT project_id, lexeme, df FROM memory.term_stats)
   UNION ALL
   (SELECT project_id, lexeme, df FROM memory.term_stats EXCEPT SELECT * FROM df)) x
UNION ALL
SELECT 'corpus_stats', x::text FROM
  ((SELECT * FROM corpus EXCEPT SELECT project_id, n_docs, total_len FROM memory.corpus_stats)
   UNION ALL
   (SELECT project_id, n_docs, total_len FROM memory.corpus_stats WHERE n_docs > 0
    EXCEPT SELECT * FROM corpus)) x
"""


def _stats_exact(conn: Conn) -> None:
    assert conn.execute(REBUILD_DIFF).fetchall() == []


def _rows(conn: Conn, nodes: list[dict[str, Any]]) -> Any:
    records, invalid = parse_lines([json.dumps(n) for n in nodes])
    assert not invalid
    return json.dumps([write_row(r) for r in records])


def _vec(seed: int) -> Any:
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def _write(conn: Conn, nodes: list[dict[str, Any]], seed: int = 0) -> dict[str, Any]:
    """memory._write_nodes with given vectors (no embedder needed: 8 writers at once)."""
    register_vector(conn)
    vecs = [_vec(seed + i) for i in range(len(nodes))]
    row = conn.execute(
        "SELECT memory._write_nodes(%s::jsonb, %s::vector[])", (_rows(conn, nodes), vecs)
    ).fetchone()
    assert row is not None
    out: dict[str, Any] = row[0]
    return out


def _node(i: str, text: str, level: str = "L0", **kw: Any) -> dict[str, Any]:
    return {"project": P, "id": i, "level": level, "text": text, **kw}


def _history(conn: Conn, i: str) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT revision, current, end_reason, text FROM memory.history(%s, %s)", (P, i)
    ).fetchall()


def _found(conn: Conn, query: str, **kw: Any) -> list[str]:
    rows = conn.execute(
        "SELECT external_id FROM memory_query(%(q)s, project => %(p)s, levels => %(lv)s, "
        "strategy => 'LexicalOnly', k => 20)",
        {"q": query, "p": P, "lv": kw.get("levels", ["L0", "L1", "L2"])},
    ).fetchall()
    return [r[0] for r in rows]


def test_an_update_is_a_new_version_and_the_old_one_leaves_answers(conn: Conn) -> None:
    assert _write(conn, [_node("pref:1", "Mara prefers tea in the morning")])["inserted"] == 1
    # identical content: a no-op
    same = _write(conn, [_node("pref:1", "Mara prefers tea in the morning")])
    assert [(n["id"], n["revision"], n["status"]) for n in same.pop("nodes")] == [
        ("pref:1", 1, "unchanged")
    ]
    assert same == {"inserted": 0, "duplicates": 1, "updated": 0, "edges": 0, "unresolved": []}
    out = _write(conn, [_node("pref:1", "Mara prefers coffee in the morning")], seed=7)
    assert (out["inserted"], out["updated"]) == (1, 1)
    assert _history(conn, "pref:1") == [
        (1, False, "superseded", "Mara prefers tea in the morning"),
        (2, True, None, "Mara prefers coffee in the morning"),
    ]
    assert _found(conn, "tea") == []
    assert _found(conn, "coffee") == ["pref:1"]
    # each version its own row, hash and writer
    rows = conn.execute(
        "SELECT revision, written_by, ended_by FROM memory.nodes WHERE project_id = "
        "memory.project_id(%s) ORDER BY revision", (P,)
    ).fetchall()  # fmt: skip
    assert rows == [(1, "role:postgres", "role:postgres"), (2, "role:postgres", None)]
    # the old content written again: a third version, not a duplicate of the first
    out = _write(conn, [_node("pref:1", "Mara prefers tea in the morning")])
    assert (out["inserted"], out["updated"]) == (1, 1)
    assert [r[:2] for r in _history(conn, "pref:1")] == [(1, False), (2, False), (3, True)]
    assert _found(conn, "tea") == ["pref:1"]
    _stats_exact(conn)


def test_a_stale_revision_is_refused_with_detail_and_hint(conn: Conn) -> None:
    _write(conn, [_node("doc:1", "first draft")])
    _write(conn, [_node("doc:1", "second draft", revision=1)])
    with pytest.raises(psycopg.Error) as exc:
        _write(conn, [_node("doc:1", "a draft from revision one", revision=1)])
    assert exc.value.sqlstate == SQLSTATES["stale_revision"] == "PM419"
    assert "is at revision 2, not 1" in (exc.value.diag.message_primary or "")
    assert "Nothing was written" in (exc.value.diag.message_detail or "")
    assert "current revision" in (exc.value.diag.message_hint or "")
    # a stale revision with the current content is the no-op it would be anyway
    assert _write(conn, [_node("doc:1", "second draft", revision=1)])["duplicates"] == 1
    # revision 0: create only
    with pytest.raises(psycopg.Error) as exc:
        _write(conn, [_node("doc:1", "again", revision=0)])
    assert exc.value.sqlstate == "PM419"
    assert _write(conn, [_node("doc:2", "new", revision=0)])["inserted"] == 1
    assert [r[:2] for r in _history(conn, "doc:1")] == [(1, False), (2, True)]


def test_eight_writers_one_winner_per_revision_and_no_lost_update(fixture_url: str) -> None:
    with connect(fixture_url, autocommit=True) as c:
        _write(c, [_node("race:1", "version zero of the race")])
    n = 8
    barrier = threading.Barrier(n)
    results: list[tuple[str, int, str]] = []
    lock = threading.Lock()

    def writer(i: int, named: int | None) -> None:
        with connect(fixture_url, autocommit=True) as c:
            text = f"writer {i} named {named}"
            node = _node("race:1", text, **({} if named is None else {"revision": named}))
            barrier.wait()
            try:
                _write(c, [node], seed=100 + i)
                outcome = "won"
            except psycopg.Error as exc:
                outcome = exc.sqlstate or "?"
            with lock:
                results.append((outcome, i, text))

    for named in (1, None):
        results.clear()
        threads = [threading.Thread(target=writer, args=(i, named)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        outcomes = sorted(r[0] for r in results)
        if named == 1:
            assert outcomes == ["PM419"] * (n - 1) + ["won"]  # exactly one winner
        else:
            assert outcomes == ["won"] * n  # each goes on top of the last: no lost update
        with connect(fixture_url, autocommit=True) as c:
            texts = {r[3] for r in _history(c, "race:1")}
            assert {r[2] for r in results if r[0] == "won"} <= texts
    with connect(fixture_url, autocommit=True) as c:
        hist = _history(c, "race:1")
        assert [r[0] for r in hist] == list(range(1, 2 + 1 + n))  # 1, the winner, 8 more
        assert [r[1] for r in hist].count(True) == 1 and hist[-1][1]
        _stats_exact(c)


def _load_derived(conn: Conn) -> None:
    _write(conn, [
        _node("t:1", "Mara moved to Lisbon in May", source="chat/1"),
        _node("t:2", "Mara works remotely for a Berlin studio", source="chat/1"),
        _node("t:3", "Mara adopted a cat named Pixel", source="chat/2"),
        _node("m:1", "Mara lives in Lisbon and works remotely", "L1", parents=["t:1", "t:2"]),
        _node("m:2", "Mara has a cat called Pixel", "L1", parents=["t:3"]),
        _node("s:1", "Mara: Lisbon, remote work, a cat", "L2", parents=["m:1", "m:2"]),
    ])  # fmt: skip


def _support(conn: Conn) -> dict[str, str]:
    rows = conn.execute(
        "SELECT n.external_id, s.support FROM memory.nodes n, "
        "LATERAL memory.support(ARRAY[n.id]) s "
        "WHERE n.project_id = memory.project_id(%s) AND n.expired_at IS NULL", (P,)
    ).fetchall()  # fmt: skip
    return dict(rows)


def test_retire_by_id_and_by_filter_flags_derived_nodes(conn: Conn) -> None:
    _load_derived(conn)
    _stats_exact(conn)
    out = conn.execute("SELECT memory.forget(%s, 't:1', reason => 'wrong')", (P,)).fetchone()
    assert out is not None and out[0]["retired"] == 1 and out[0]["derived_policy"] == "flag"
    assert _found(conn, "Lisbon", levels=["L0"]) == []
    # support is transitive: the synthesis over the memory that lost a turn lost it too
    assert _support(conn)["m:1"] == "partial" and _support(conn)["s:1"] == "partial"
    _stats_exact(conn)
    # provenance no longer cites the retired turn
    prov = conn.execute(
        "SELECT provenance FROM memory_query('works remotely', project => %s, "
        "levels => ARRAY['L1'], strategy => 'LexicalOnly', k => 1)", (P,)
    ).fetchone()  # fmt: skip
    assert prov is not None and "Lisbon in May" not in json.dumps(prov[0])
    hist = conn.execute(
        "SELECT end_reason, end_note, ended_by FROM memory.history(%s, 't:1')", (P,)
    ).fetchall()
    assert hist == [("retired", "wrong", "role:postgres")]
    # by filter: the source
    out = conn.execute("SELECT memory.forget(%s, source => 'chat/1')", (P,)).fetchone()
    assert out is not None and out[0]["retired"] == 1 and out[0]["nodes"] == ["t:2"]
    assert _support(conn)["m:1"] == "none"
    assert "m:1" in _found(conn, "Lisbon")  # flagged, not removed
    _stats_exact(conn)
    # unknown ids are typed; a forget without ids or filter is refused
    with pytest.raises(psycopg.Error) as exc:
        conn.execute("SELECT memory.forget(%s, 't:1')", (P,))
    assert exc.value.sqlstate == "PM444" and exc.value.diag.message_hint
    with pytest.raises(psycopg.Error) as exc:
        conn.execute("SELECT memory.forget(%s)", (P,))
    assert exc.value.sqlstate == "22023"


def test_cascade_retires_derived_nodes_left_without_support(conn: Conn) -> None:
    _load_derived(conn)
    conn.execute("SELECT memory.set_policy('forget_derived', 'cascade')")
    out = conn.execute("SELECT memory.forget(%s, ARRAY['t:1', 't:2'])", (P,)).fetchone()
    assert out is not None and out[0]["derived_ended"] == 1  # m:1; s:1 keeps m:2
    assert "m:1" not in _support(conn) and _support(conn)["s:1"] == "partial"
    out = conn.execute("SELECT memory.forget(%s, 't:3')", (P,)).fetchone()
    assert out is not None and out[0]["derived_ended"] == 2  # m:2, then s:1
    assert set(_support(conn)) == set()
    assert _found(conn, "Mara") == []
    _stats_exact(conn)


def test_an_updated_parent_leaves_its_children_stale_citing_the_old_version(conn: Conn) -> None:
    _load_derived(conn)
    _write(conn, [_node("t:3", "Mara adopted a grey cat named Pixel")])
    # not relinked in silence: the memory rests on the version it was derived from
    assert _support(conn)["m:2"] == "stale" and _support(conn)["s:1"] == "stale"
    prov = conn.execute(
        "SELECT provenance FROM memory_query('cat Pixel', project => %s, "
        "levels => ARRAY['L1'], strategy => 'LexicalOnly', k => 1)", (P,)
    ).fetchone()  # fmt: skip
    assert prov is not None and "grey cat" not in json.dumps(prov[0])
    (cited,) = prov[0]
    assert cited["text"] == "Mara adopted a cat named Pixel"
    assert cited["superseded"] is True and cited["revision"] == 1
    assert cited["current_revision"] == 2


SECRET = "Zorblax Quintavelle's passport number is QX7731942"


def test_erase_leaves_a_tombstone_and_no_text_anywhere(fixture_url: str) -> None:
    with connect(fixture_url, autocommit=True) as conn:
        conn.execute("SELECT memory.enable_outbox()")
        _write(conn, [_node("pii:1", SECRET, source="form/7")])
        _write(conn, [_node("pii:1", SECRET + " (renewed)", source="form/8")])
        _write(conn, [_node("keep:1", "Nothing secret here about passports")])
        conn.execute("ANALYZE memory.nodes")
        out = conn.execute("SELECT memory.forget(%s, 'pii:1', erase => true)", (P,)).fetchone()
        assert out is not None and out[0]["erased"] == 2
        hist = conn.execute(
            "SELECT revision, sha256, text, source, end_reason, erased_at IS NOT NULL "
            "FROM memory.history(%s, 'pii:1')", (P,)
        ).fetchall()  # fmt: skip
        assert hist == [
            (1, None, None, None, "superseded", True),
            (2, None, None, None, "erased", True),
        ]
        assert conn.execute(
            "SELECT count(*) FROM memory.nodes WHERE text LIKE '%%Zorblax%%' OR embedding IS NULL "
            "AND erased_at IS NULL"
        ).fetchone() == (0,)
        deletes = conn.execute(
            "SELECT count(DISTINCT o.sha256) FROM memory.opensearch_outbox o "
            "JOIN memory.nodes n ON n.id = o.node_id "
            "WHERE n.external_id = 'pii:1' AND o.op = 'delete'"
        ).fetchone()  # fmt: skip
        assert deletes == (2,)  # both versions' documents
        assert _found(conn, "passport Zorblax") == ["keep:1"]
        _stats_exact(conn)
        # What docs/lifecycle.md tells a DBA to run after an erase.
        conn.execute("VACUUM FULL memory.nodes, memory.postings, memory.term_stats")
        conn.execute("ANALYZE memory.nodes")
        conn.execute("CHECKPOINT")
        datadir = Path(conn.execute("SHOW data_directory").fetchone()[0])  # type: ignore[index]
        files = [
            r[0]
            for r in conn.execute(
                "SELECT pg_relation_filepath(c.oid) FROM pg_class c "
                "WHERE c.relkind IN ('r', 'i', 't', 'm') "
                "AND pg_relation_filepath(c.oid) IS NOT NULL"
            ).fetchall()
        ]
    needle = b"Zorblax"
    hits = []
    for rel in files:
        for path in (datadir / rel).parent.glob(Path(rel).name + "*"):
            if needle in path.read_bytes():
                hits.append(str(path))
    assert hits == []


# -- HTTP ------------------------------------------------------------------------------


@pytest.fixture
def client(fixture_url: str, embedder: LocalEmbedder) -> Iterator[TestClient]:
    with connect(fixture_url, autocommit=True) as conn:
        ensure_service_login(conn, ROLE)
    url = fixture_url.replace("postgresql://postgres@", f"postgresql://{ROLE}@")
    with serve({"POIMEN_DATABASE_URL": url, "POIMEN_AUTH_CACHE_S": "0"}, embedder) as c:
        yield c


def _post(client: TestClient, key: str | None, nodes: list[dict[str, Any]]) -> Any:
    body = "\n".join(json.dumps(n) for n in nodes)
    return client.post("/memory/nodes", content=body, headers=_as(key))


def test_the_hint_for_forgetting_a_whole_project_matches_every_node(
    client: TestClient, fixture_url: str
) -> None:
    """A forget that names nothing is refused with a hint; following it (a level at a time)
    matches every current node of the project, those without a timestamp too, which the
    hint it replaced (since=0001-01-01) left out."""
    timed = _node("w:timed", "The office plant is a fern", timestamp="2024-05-01T10:00:00Z")
    untimed = [_node("w:untimed", "The office plant needs water"), timed]
    untimed.append(_node("w:summary", "Plants in the office", level="L1", parents=["w:timed"]))
    r = _post(client, None, untimed)
    assert r.status_code == 201, r.text
    with connect(fixture_url) as conn:
        row = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE n.ts IS NULL) FROM memory.nodes n"
            " JOIN memory.projects p ON p.id = n.project_id"
            " WHERE p.name = %s AND n.expired_at IS NULL",
            (P,),
        ).fetchone()
    assert row is not None
    current, untimed = row
    assert current > untimed > 0, row
    base = {"project": P, "dry_run": "true", "max_nodes": "10000"}
    r = client.delete("/memory/nodes", params=base)
    assert r.status_code == 400, r.text
    hint = r.json()["hint"]
    levels = re.findall(r"\bL[012]\b", hint)
    assert sorted(levels) == ["L0", "L1", "L2"], hint
    matched = [
        client.delete("/memory/nodes", params={**base, "level": level}).json()["matched"]
        for level in levels
    ]
    assert sum(matched) == current, (matched, current)
    old = client.delete("/memory/nodes", params={**base, "since": "0001-01-01"}).json()
    assert old["matched"] == current - untimed


def test_http_update_history_retire_erase_under_keys(client: TestClient, fixture_url: str) -> None:
    writer = make_key(fixture_url, [P], write=True)
    other = make_key(fixture_url, ["poimen"], write=True)
    reader = make_key(fixture_url, [P])
    r = _post(client, writer, [_node("h:1", "The office plant is a monstera")])
    assert r.status_code == 201, r.text
    r = _post(client, writer, [_node("h:1", "The office plant is a ficus", revision=1)])
    assert r.status_code == 201 and r.json()["updated"] == 1, r.text
    r = _post(client, writer, [_node("h:1", "The office plant is a cactus", revision=1)])
    assert r.status_code == 409 and r.json()["error"] == "stale_revision", r.text
    assert r.json()["hint"] and r.json()["context"]
    r = client.get("/memory/nodes/h:1/history", params={"project": P}, headers=_as(reader))
    assert r.status_code == 200, r.text
    versions = r.json()["versions"]
    key_id = writer_id(fixture_url, writer)
    assert [(v["revision"], v["current"], v["end_reason"], v["written_by"]) for v in versions] == [
        (1, False, "superseded", f"api_key:{key_id}"),
        (2, True, None, f"api_key:{key_id}"),
    ]
    q = {"query": "office plant", "project": P, "level": "L0", "strategy": "LexicalOnly"}
    texts = [
        x["text"]
        for x in client.get("/memory/query", params=q, headers=_as(reader)).json()["results"]
    ]
    assert texts == ["The office plant is a ficus"]
    # keys: a read-only key and a key of another project may not forget
    assert (
        client.delete("/memory/nodes/h:1", params={"project": P}, headers=_as(reader)).status_code
        == 403
    )
    assert (
        client.delete("/memory/nodes/h:1", params={"project": P}, headers=_as(other)).status_code
        == 403
    )
    assert (
        client.delete("/memory/nodes/nope", params={"project": P}, headers=_as(writer)).status_code
        == 404
    )
    r = client.delete(
        "/memory/nodes/h:1", params={"project": P, "reason": "moved"}, headers=_as(writer)
    )
    assert r.status_code == 200 and r.json()["retired"] == 1, r.text
    assert client.get("/memory/query", params=q, headers=_as(reader)).json()["results"] == []
    # by filter, and erase
    _post(client, writer, [_node("h:2", "Lunch is at noon", source="memo/1"),
                           _node("h:3", "Lunch moved to one", source="memo/1")])  # fmt: skip
    r = client.delete("/memory/nodes", params={"project": P, "source": "memo/1", "erase": "true"},
                      headers=_as(writer))  # fmt: skip
    assert r.status_code == 200 and r.json()["erased"] == 2, r.text
    r = client.get("/memory/nodes/h:2/history", params={"project": P}, headers=_as(reader))
    assert (
        r.json()["versions"][0]["text"] is None
        and r.json()["versions"][0]["end_reason"] == "erased"
    )
    r = client.delete("/memory/nodes", params={"project": P}, headers=_as(writer))
    assert r.status_code == 400
    with connect(fixture_url, autocommit=True) as conn:
        _stats_exact(conn)


def writer_id(url: str, key: str) -> int:
    import hashlib

    with connect(url) as conn:
        row = conn.execute(
            "SELECT id FROM memory.api_keys WHERE key_hash = %s",
            (hashlib.sha256(key.encode()).digest(),),
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_the_vector_leg_fills_k_past_superseded_versions(conn: Conn) -> None:
    """Old versions stay in the HNSW graphs (as_of will read them): the leg filters them out
    before its top k, so a query still gets k current nodes."""
    _write(conn, [_node(f"v:{i}", f"vector node {i}", "L1") for i in range(40)], seed=1000)
    _write(conn, [_node(f"v:{i}", f"vector node {i} again", "L1") for i in range(30)], seed=2000)
    register_vector(conn)
    rows = conn.execute(
        "SELECT s.node_id, n.expired_at IS NULL FROM memory.semantic_search(%s, %s, "
        "ARRAY['L1'], 40) s JOIN memory.nodes n ON n.id = s.node_id",
        (_vec(2005), P),
    ).fetchall()
    assert len(rows) == 40 and all(current for _, current in rows)
