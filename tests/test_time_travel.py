"""Time travel and valid time (issue 24): as_of answers from the versions the database held
then, in every leg, with BM25 scored on the corpus as it stood; valid_at selects by world
time and still fills its limit. Real PostgreSQL, real SQL, the real app."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pgvector.psycopg import register_vector

from poimen_memory.db.migrate import migrate
from poimen_memory.embedders.local import LocalEmbedder
from service_client import query, serve
from test_lifecycle import P, _node, _vec, _write

Conn = psycopg.Connection[Any]


def _now(conn: Conn) -> datetime:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    t: datetime = row[0]
    return t


def _ids(conn: Conn, q: str, **kw: Any) -> list[tuple[str, int]]:
    """memory_query's (external_id, node_id), best first."""
    register_vector(conn)
    args = {"q": q, "p": kw.pop("project", P), "lv": kw.pop("levels", ["L0", "L1", "L2"]), **kw}
    named = "".join(f", {k} => %({k})s" for k in kw)
    rows = conn.execute(
        f"SELECT external_id, node_id FROM memory_query(%(q)s, project => %(p)s, "
        f"levels => %(lv)s{named}) ORDER BY rank",
        args,
    ).fetchall()
    return [(r[0], r[1]) for r in rows]


def test_as_of_answers_from_the_versions_known_then_in_every_leg(conn: Conn) -> None:
    _write(conn, [_node("pref:1", "Mara prefers tea in the morning"),
                  _node("note:1", "The kettle is broken")], seed=1)  # fmt: skip
    old_id = conn.execute(
        "SELECT id FROM memory.nodes WHERE external_id = 'pref:1' AND revision = 1"
    ).fetchone()
    assert old_id is not None
    t1 = _now(conn)
    _write(conn, [_node("pref:1", "Mara prefers coffee in the morning")], seed=50)
    conn.execute("SELECT memory.forget(%s, ARRAY['note:1'])", (P,))
    lex = {"strategy": "LexicalOnly", "k": 10}
    # today: the tea version and the kettle are gone
    assert _ids(conn, "tea", **lex) == []
    assert _ids(conn, "kettle", **lex) == []
    assert [i for i, _ in _ids(conn, "coffee", **lex)] == ["pref:1"]
    # as of t1: what the database held then, and nothing written later
    assert _ids(conn, "tea", as_of=t1, **lex) == [("pref:1", old_id[0])]
    assert [i for i, _ in _ids(conn, "kettle", as_of=t1, **lex)] == ["note:1"]
    assert _ids(conn, "coffee", as_of=t1, **lex) == []
    # the vector legs too: the old version's own vector finds it only under as_of
    v1 = _vec(1)
    sem = {"strategy": "SemanticOnly", "k": 3, "query_embedding": v1}
    assert _ids(conn, "tea", as_of=t1, **sem)[0] == ("pref:1", old_id[0])
    assert old_id[0] not in [n for _, n in _ids(conn, "tea", **sem)]
    hybrid = _ids(conn, "tea", as_of=t1, strategy="Hybrid", k=3, query_embedding=v1)
    assert hybrid[0] == ("pref:1", old_id[0])
    cascade = _ids(conn, "tea", as_of=t1, strategy="LexicalFirst", k=3, query_embedding=v1)
    assert cascade == [("pref:1", old_id[0])]
    # the plan says what it answered from
    row = conn.execute(
        "SELECT memory.plan_query('tea', project => %s, as_of => %s)", (P, t1)
    ).fetchone()
    assert row is not None and datetime.fromisoformat(row[0]["as_of"]) == t1
    # before anything was written: nothing
    assert _ids(conn, "tea", as_of=datetime(2001, 1, 1).astimezone(), **lex) == []


def test_bm25_as_of_scores_with_the_corpus_as_it_stood(conn: Conn) -> None:
    docs = [
        ("a", "the red fox jumps over the lazy dog"),
        ("b", "a red apple and a green apple"),
        ("c", "the dog sleeps by the red door"),
    ]
    _write(conn, [_node(i, t) for i, t in docs])
    t1 = _now(conn)
    # later: one updated, one retired, one added, in a corpus that grows
    _write(conn, [_node("a", "a blue bird sings"), _node("d", "red red red everywhere")], seed=9)
    conn.execute("SELECT memory.forget(%s, ARRAY['b'])", (P,))
    # the same contents written fresh in a project of their own: the reference
    _write(conn, [{**_node(i, t), "project": "as-it-stood"} for i, t in docs], seed=20)
    sql = (
        "SELECT n.external_id, round(l.lexical_score::numeric, 9) FROM memory.lexical_search("
        "'red dog', %s, k => 10, as_of => %s) l JOIN memory.nodes n ON n.id = l.node_id "
        "ORDER BY l.rank"
    )
    past = conn.execute(sql, (P, t1)).fetchall()
    ref = conn.execute(sql.replace("as_of => %s", "as_of => NULL"), ("as-it-stood",)).fetchall()
    assert len(past) == 3 and past == ref
    # and today's answer differs: its statistics are today's
    now = conn.execute(sql.replace("as_of => %s", "as_of => NULL"), (P,)).fetchall()
    assert sorted(i for i, _ in now) == ["c", "d"]


def test_valid_at_selects_by_world_time_and_still_fills_its_limit(conn: Conn) -> None:
    groups = {
        "old": {"valid_to": "2020-01-01T00:00:00Z"},
        "mid": {"valid_from": "2020-01-01T00:00:00Z", "valid_to": "2024-01-01T00:00:00Z"},
        "new": {"valid_from": "2024-01-01T00:00:00Z"},
    }
    nodes = [
        _node(f"{g}:{i}", f"Mara lives in a flat, note {g} {i}", **bounds)
        for g, bounds in groups.items()
        for i in range(10)
    ]
    nodes += [_node(f"plain:{i}", f"unrelated words {i}") for i in range(200)]
    _write(conn, nodes, seed=100)
    lex = {"strategy": "LexicalOnly", "k": 5}

    def groups_of(rows: list[tuple[str, int]]) -> set[str]:
        return {i.split(":")[0] for i, _ in rows}

    # today (2026): only what holds now
    today = _ids(conn, "flat", **lex)
    assert len(today) == 5 and groups_of(today) == {"new"}
    mid = _ids(conn, "flat", valid_at=datetime.fromisoformat("2022-06-01T00:00:00+00:00"), **lex)
    assert len(mid) == 5 and groups_of(mid) == {"mid"}
    # valid_to is exclusive: at the boundary the next group holds
    edge = datetime.fromisoformat("2024-01-01T00:00:00+00:00")
    assert groups_of(_ids(conn, "flat", valid_at=edge, **lex)) == {"new"}
    # the vector leg fills its limit under the filter too (30 of 230 nodes match in time);
    # the vectors are random, so the relevance floor is off (min_cosine -1)
    old = datetime.fromisoformat("2019-01-01T00:00:00+00:00")
    sem = _ids(conn, "flat", valid_at=old, strategy="SemanticOnly", k=5, query_embedding=_vec(7),
               min_cosine=-1.0)  # fmt: skip
    assert len(sem) == 5 and groups_of(sem) <= {"old", "plain"} and "mid" not in groups_of(sem)
    # a new valid time for the same text is a new version (the old one leaves answers)
    out = _write(conn, [_node("new:0", "Mara lives in a flat, note new 0",
                              valid_from="2024-01-01T00:00:00Z",
                              valid_to="2025-01-01T00:00:00Z")])  # fmt: skip
    assert (out["inserted"], out["updated"]) == (1, 1)
    assert "new:0" not in [i for i, _ in _ids(conn, "flat", strategy="LexicalOnly", k=20)]
    hist = conn.execute(
        "SELECT revision, valid_from, valid_to FROM memory.history(%s, 'new:0')", (P,)
    ).fetchall()
    assert [(r[0], r[2] is None) for r in hist] == [(1, True), (2, False)]


def test_a_bad_instant_is_refused_by_name(conn: Conn) -> None:
    for arg in ("as_of", "valid_at"):
        with pytest.raises(psycopg.Error) as exc:
            conn.execute(f"SELECT * FROM memory_query('tea', {arg} => 'infinity')")
        assert exc.value.sqlstate == "22023"
        assert arg in (exc.value.diag.message_primary or "")


def test_http_as_of_and_valid_at(fixture_url: str, embedder: LocalEmbedder, conn: Conn) -> None:
    _write(conn, [_node("pref:1", "Mara prefers tea in the morning")])
    t1 = _now(conn)
    _write(conn, [_node("pref:1", "Mara prefers coffee in the morning")], seed=3)
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as client:
        params = {"query": "tea", "project": P, "level": "L0", "strategy": "LexicalOnly"}
        assert query(client, **params)["results"] == []
        body = query(client, **params, as_of=t1.isoformat())
        assert [r["text"] for r in body["results"]] == ["Mara prefers tea in the morning"]
        assert datetime.fromisoformat(body["plan"]["as_of"]) == t1
        # the same answer as SQL's
        sql = _ids(conn, "tea", levels=["L0"], strategy="LexicalOnly", as_of=t1)
        assert [r["external_id"] for r in body["results"]] == [i for i, _ in sql] == ["pref:1"]
        # not ISO 8601 (the service refuses it), and a year the database refuses (22023)
        for bad in ("yesterday", "infinity", "0001-01-01T00:00:00Z"):
            r = client.get("/memory/query", params={**params, "as_of": bad})
            assert r.status_code == 400, r.text
            assert "as_of" in r.json()["detail"], r.text
        r = client.get("/memory/query", params={**params, "valid_at": "2022-01-01T00:00:00Z"})
        assert r.status_code == 200 and r.json()["plan"]["valid_at"].startswith("2022-01-01")


def _evidence(
    conn: Conn, fn: str, q: str, levels: tuple[str, ...] = ("L1",), **kw: Any
) -> list[tuple[int, int, float]]:
    """The evidence of the page memory_query gives for these arguments, as (rank, node_id,
    score): from memory.evidence (fn "evidence", given the page) or memory.answer's own."""
    args = {"q": q, "p": P, "lv": list(levels), "s": "LexicalOnly", **kw}
    named = "".join(f", {k} => %({k})s" for k in kw)
    common = f"%(q)s, project => %(p)s, levels => %(lv)s, strategy => %(s)s{named}"
    if fn == "answer":
        rows = conn.execute(
            f"SELECT (e ->> 'rank')::integer, (e ->> 'node_id')::bigint, (e ->> 'score')::float8"
            f" FROM memory.answer({common}) a, jsonb_array_elements(a -> 'evidence') e",
            args,
        ).fetchall()
    else:
        page = f"ARRAY(SELECT node_id FROM memory_query({common}) ORDER BY rank)"
        rows = conn.execute(
            f"SELECT rank, node_id, score FROM memory.evidence(%(q)s, {page}, project => %(p)s,"
            f" levels => %(lv)s, strategy => %(s)s{named}) ORDER BY rank",
            args,
        ).fetchall()
    return [(r[0], r[1], round(r[2], 9)) for r in rows]


def _version(conn: Conn, external_id: str, revision: int) -> int:
    row = conn.execute(
        "SELECT id FROM memory.nodes WHERE project_id = memory.project_id(%s)"
        " AND external_id = %s AND revision = %s",
        (P, external_id, revision),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_evidence_as_of_cites_the_turns_known_then_as_the_answer_does(conn: Conn) -> None:
    """memory.evidence takes memory.query's as_of: the evidence of a page asked as of t is
    cited from the versions held then (a turn superseded or forgotten since comes back,
    one written later does not), and is the list memory.answer gives for the same page."""
    _write(conn, [
        _node("t:1", "Mara: I drink green tea every morning", title="s1"),
        _node("t:2", "Ben: tea in the morning keeps me calm", title="s1"),
        _node("m:1", "Mara drinks tea every morning", "L1", parents=["t:1"]),
    ], seed=200)  # fmt: skip
    t1 = _now(conn)
    _write(conn, [_node("t:1", "Mara: I drink tea with lemon every morning", title="s1")], seed=300)
    conn.execute("SELECT memory.forget(%s, ARRAY['t:2'])", (P,))
    old, new, gone = _version(conn, "t:1", 1), _version(conn, "t:1", 2), _version(conn, "t:2", 1)
    past = _evidence(conn, "evidence", "tea morning", as_of=t1)
    now = _evidence(conn, "evidence", "tea morning")
    # as of t1: the first version of t:1 (cited by m:1) and t:2 (a direct match), not t:1's
    # second version; today the second version (a direct match) and still the first, which
    # m:1 rests on (issue 40: marked superseded), never the forgotten t:2
    assert {old, gone} <= {n for _, n, _ in past} and new not in {n for _, n, _ in past}
    assert {new, old} <= {n for _, n, _ in now} and gone not in {n for _, n, _ in now}
    # one pipeline: the list memory.answer cites for the same page, rank for rank
    assert past == _evidence(conn, "answer", "tea morning", as_of=t1)
    assert now == _evidence(conn, "answer", "tea morning")
    # valid_at defaults to as_of there, as in memory_query; a bad instant is refused alike
    assert _evidence(conn, "evidence", "tea morning", as_of=t1, valid_at=t1) == past
    for arg in ("as_of", "valid_at"):
        for bad in ("infinity", "0001-01-01T00:00:00Z"):
            with pytest.raises(psycopg.Error) as exc:
                conn.execute(f"SELECT * FROM memory.evidence('tea', '{{}}', {arg} => %s)", (bad,))
            with pytest.raises(psycopg.Error) as ref:
                conn.execute(f"SELECT * FROM memory_query('tea', {arg} => %s)", (bad,))
            assert exc.value.sqlstate == ref.value.sqlstate == "22023"
            assert arg in (exc.value.diag.message_primary or "")


def test_evidence_neighbours_hold_in_valid_time(
    fixture_url: str, embedder: LocalEmbedder, conn: Conn
) -> None:
    """A turn said beside a direct match is cited only where it holds at the instant the
    legs test valid time at (valid_at, else as_of, else now), in memory.evidence, in
    memory.answer and over HTTP alike: today's answer does not cite a fact that ended in
    2024."""
    _write(conn, [
        _node("t:a", "Mara: where do you live these days?", title="s2"),
        _node("t:b", "Ben: Berlin, in a flat by the river", title="s2",
              valid_to="2024-06-01T00:00:00Z"),
        _node("t:c", "Ben: Lisbon, in a flat by the sea", title="s2",
              valid_from="2024-06-01T00:00:00Z"),
    ], seed=400)  # fmt: skip
    berlin, lisbon = _version(conn, "t:b", 1), _version(conn, "t:c", 1)
    then = datetime.fromisoformat("2023-01-01T00:00:00+00:00")
    q, lv = "where do you live", ("L0",)
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as client:
        for when in ({}, {"valid_at": then}):
            ev = _evidence(conn, "evidence", q, lv, **when)
            assert ev == _evidence(conn, "answer", q, lv, **when), when
            # the neighbour is the nearest turn of the session that holds then
            assert {n for _, n, _ in ev} & {berlin, lisbon} == ({berlin} if when else {lisbon})
            params = {"query": q, "project": P, "level": "L0", "strategy": "LexicalOnly"}
            http = query(client, **params, **{k: v.isoformat() for k, v in when.items()})
            sha = dict(conn.execute(
                "SELECT id, encode(sha256, 'hex') FROM memory.nodes WHERE id = ANY (%s)",
                ([n for _, n, _ in ev],),
            ).fetchall())  # fmt: skip
            assert [e["sha256"] for e in http["evidence"]] == [sha[n] for _, n, _ in ev]


# The forms before as_of and valid_at (sql/072_evidence.sql drops them).
OLD_EVIDENCE_FORMS = [
    "memory.evidence(query text, result_ids bigint[], query_embedding vector, project text,"
    " budget integer, since text, until text, fusion text, levels text[], strategy text,"
    " candidates integer, dense_weight double precision, rrf_k integer,"
    " reference_time timestamptz, filter jsonb)",
    "memory._evidence(text, bigint[], vector, text, integer, text, text, text, text[], text,"
    " integer, double precision, integer, timestamptz, jsonb)",
    "memory.select_evidence(bigint[], jsonb, jsonb, text, integer, text, integer, timestamptz,"
    " timestamptz, double precision, integer, jsonb, timestamptz, bigint[], text)",
]


def test_migrate_leaves_one_evidence_signature(conn: Conn, plpython_root: Path) -> None:
    """A database migrated before as_of came keeps no older form beside the new one, so a
    call naming only the old arguments is not ambiguous. Old signatures are dropped once, by
    migration 0022: the database is made one that has not applied it yet."""
    for sig in OLD_EVIDENCE_FORMS:
        conn.execute(
            f"CREATE FUNCTION {sig} RETURNS SETOF memory.evidence_row LANGUAGE sql"
            " SET search_path = pg_catalog, public, pg_temp"
            " AS 'SELECT NULL::memory.evidence_row WHERE false'"
        )
    conn.execute("DELETE FROM memory.schema_migrations WHERE version = '0022_drop_old_signatures'")
    assert "0022_drop_old_signatures" in migrate(conn, plpython_root).applied
    rows = conn.execute(
        "SELECT proname, count(*) FROM pg_proc WHERE pronamespace = 'memory'::regnamespace"
        " AND proname IN ('evidence', '_evidence', 'select_evidence') GROUP BY 1 ORDER BY 1"
    ).fetchall()
    assert rows == [("_evidence", 1), ("evidence", 1), ("select_evidence", 1)]
    # beside an older form this call would be ambiguous (42725)
    conn.execute("SELECT count(*) FROM memory.evidence('kong', '{}')")
