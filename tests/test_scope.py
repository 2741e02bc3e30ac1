"""Scope, expiry and retention (issue 40), against real PostgreSQL and the real app: list,
count and forget by metadata (JSON containment), source, level and time, with a dry run and a
bound, under API keys and row-level security; a node's expiry and a project's retention,
honoured by every answer at once and applied by `poimen-memory expire`; and the way back to
anonymous mode (`poimen-memory keys anonymous`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb
from starlette.testclient import TestClient

from poimen_core.vocabulary import SQLSTATES
from poimen_memory.cli.main import main
from poimen_memory.db.connect import connect
from poimen_memory.db.queries import q
from poimen_memory.embedders.local import LocalEmbedder
from service_client import KONG, make_key, serve
from test_api_keys import _as
from test_lifecycle import _write
from test_plans import _index_names, _nested_plans

Conn = psycopg.Connection[Any]
U42 = {"user": "42"}


def _n(project: str, i: str, text: str, level: str = "L0", **kw: Any) -> dict[str, Any]:
    return {"project": project, "id": i, "level": level, "text": text, **kw}


def _people(conn: Conn, project: str = "scope") -> None:
    """Three nodes of user 42 (two L0, one L1) and two of user 7, in one project."""
    _write(
        conn,
        [
            _n(project, "a", "Mara likes tea", metadata={"user": "42", "kind": "pref"}),
            _n(project, "b", "Mara moved to Lisbon", metadata={"user": "42"}, source="chat"),
            _n(project, "c", "Mara lives in Lisbon and likes tea", "L1", metadata=U42),
            _n(project, "d", "Tom likes coffee", metadata={"user": "7"}),
            _n(project, "e", "Tom moved to Berlin", metadata={"user": "7"}, source="chat"),
        ],
    )


def _forget(conn: Conn, **kw: Any) -> dict[str, Any]:
    args = {k: Jsonb(v) if k == "filter" else v for k, v in kw.items()}
    named = ", ".join(f"{k} => %({k})s" for k in args)
    row = conn.execute(f"SELECT memory.forget('scope', {named})", args).fetchone()
    assert row is not None
    out: dict[str, Any] = row[0]
    return out


def _count(conn: Conn, **kw: Any) -> int:
    args = {k: Jsonb(v) if k == "filter" else v for k, v in kw.items()}
    named = ", ".join(f"{k} => %({k})s" for k in args)
    row = conn.execute(f"SELECT memory.count_nodes({named})", args).fetchone()
    assert row is not None
    return int(row[0])


def _listed(conn: Conn, **kw: Any) -> list[str]:
    args = {k: Jsonb(v) if k == "filter" else v for k, v in kw.items()}
    named = ", ".join(f"{k} => %({k})s" for k in args)
    return [r[0] for r in conn.execute(f"SELECT external_id FROM memory.list_nodes({named})", args)]


# --- list, count and forget by filter (SQL) -----------------------------------------------


def test_list_and_count_by_metadata_source_and_level(conn: Conn) -> None:
    _people(conn)
    assert _listed(conn, project="scope", filter=U42) == ["a", "b", "c"]
    assert _count(conn, project="scope", filter=U42) == 3
    assert _listed(conn, project="scope", filter=U42, level="L0") == ["a", "b"]
    assert _count(conn, project="scope", filter=U42, source="chat") == 1
    assert _listed(conn, project="scope", filter={"user": "42", "kind": "pref"}) == ["a"]
    assert _count(conn, project="scope", filter={"user": "nobody"}) == 0
    # newest first, paged with the cursor
    first = conn.execute(
        "SELECT external_id, cursor FROM memory.list_nodes('scope', filter => %s, "
        'newest_first => true, "limit" => 2)',
        (Jsonb(U42),),
    ).fetchall()
    assert [r[0] for r in first] == ["c", "b"]
    rest = _listed(conn, project="scope", filter=U42, newest_first=True, after=first[-1][1])
    assert rest == ["a"]


@pytest.mark.parametrize(
    "bad", [[1, 2], "user", {"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": 1}}}}}}}}}]
)
def test_a_filter_is_an_object_of_bounded_depth(conn: Conn, bad: Any) -> None:
    _people(conn)
    for call in (
        lambda: _count(conn, project="scope", filter=bad),
        lambda: _forget(conn, filter=bad, dry_run=True),
    ):
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            call()
    # eight deep is allowed
    ok = {"a": {"b": {"c": {"d": {"e": {"f": {"g": 1}}}}}}}
    assert _count(conn, project="scope", filter=ok) == 0


def test_a_dry_run_counts_what_the_forget_then_ends(conn: Conn) -> None:
    _people(conn)
    before = conn.execute("SELECT count(*) FROM memory.nodes WHERE expired_at IS NULL").fetchone()
    dry = _forget(conn, filter=U42, dry_run=True)
    assert dry["dry_run"] is True and dry["matched"] == 3
    assert sorted(dry["nodes"]) == ["a", "b", "c"] and dry["retired"] == 0
    after = conn.execute("SELECT count(*) FROM memory.nodes WHERE expired_at IS NULL").fetchone()
    assert before == after  # nothing written
    real = _forget(conn, filter=U42, reason="user 42 asked")
    assert "dry_run" not in real  # the answer's keys as before
    assert real["retired"] == dry["matched"] and sorted(real["nodes"]) == sorted(dry["nodes"])
    assert _count(conn, project="scope", filter=U42) == 0
    assert _listed(conn, project="scope") == ["d", "e"]
    # by level and source too; erase reaches every version matched, b's retired one too
    assert _forget(conn, level="L0", source="chat", erase=True)["nodes"] == ["b", "e"]
    assert _listed(conn, project="scope") == ["d"]


def test_a_forget_past_its_bound_is_refused_whole(conn: Conn) -> None:
    _people(conn)
    with pytest.raises(psycopg.Error) as exc:
        _forget(conn, filter=U42, max_nodes=2)
    assert exc.value.sqlstate == SQLSTATES["too_many_nodes"] == "PM422"
    assert "more than max_nodes = 2" in (exc.value.diag.message_primary or "")
    assert _count(conn, project="scope", filter=U42) == 3  # nothing forgotten
    assert _forget(conn, filter=U42, dry_run=True, max_nodes=2)["matched"] == 3
    assert _forget(conn, filter=U42, max_nodes=3)["retired"] == 3
    # the default bound is 1000 (memory._forget_max_nodes); NULL: none
    assert conn.execute("SELECT memory._forget_max_nodes()").fetchone() == (1000,)


# --- over HTTP, under API keys --------------------------------------------------------------


@pytest.fixture
def client(fixture_url: str, embedder: LocalEmbedder) -> Iterator[TestClient]:
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_AUTH_CACHE_S": "0"}
    with serve(env, embedder) as c:
        yield c


def test_http_list_count_and_forget_by_filter_within_a_keys_projects(
    client: TestClient, fixture_url: str
) -> None:
    with connect(fixture_url, autocommit=True) as conn:
        _people(conn, "scope")
        _people(conn, "other")  # the same metadata in a second project
    mine = make_key(fixture_url, ["scope"], write=True)
    flt = json.dumps(U42)
    page = client.get(
        "/memory/nodes", params={"filter": flt, "count": "true", "limit": 2}, headers=_as(mine)
    )
    assert page.status_code == 200, page.text
    body = page.json()
    assert [n["external_id"] for n in body["nodes"]] == ["a", "b"] and body["count"] == 3
    assert {n["project"] for n in body["nodes"]} == {"scope"}
    assert "expires_at" in body["nodes"][0]
    bad = client.get("/memory/nodes", params={"filter": "[1]"}, headers=_as(mine))
    assert bad.status_code == 400 and "JSON object" in bad.json()["detail"]
    # the other project: forbidden, by the service and by row-level security alike
    other = client.delete("/memory/nodes", params={"project": "other", "filter": flt},
                          headers=_as(mine))  # fmt: skip
    assert other.status_code == 403
    dry = client.delete(
        "/memory/nodes", params={"filter": flt, "dry_run": "true"}, headers=_as(mine)
    )
    assert dry.status_code == 200, dry.text
    assert dry.json()["matched"] == 3 and dry.json()["project"] == "scope"
    # an id that names nothing is refused, not dropped: beside the filter it would have
    # forgotten the filter's every node
    for empty in ("", ","):
        none = client.delete(
            "/memory/nodes", params={"filter": flt, "id": empty}, headers=_as(mine)
        )
        assert none.status_code == 400 and "id must name" in none.json()["detail"], none.text
    over = client.delete(
        "/memory/nodes", params={"filter": flt, "max_nodes": "2"}, headers=_as(mine)
    )
    assert over.status_code == 422 and over.json()["error"] == "too_many_nodes"
    assert "max_nodes = 2" in over.json()["detail"]
    done = client.delete("/memory/nodes", params={"filter": flt}, headers=_as(mine))
    assert done.status_code == 200 and done.json()["retired"] == dry.json()["matched"]
    with connect(fixture_url) as conn:
        left = conn.execute(
            "SELECT p.name, count(*) FROM memory.nodes n JOIN memory.projects p "
            "ON p.id = n.project_id WHERE n.expired_at IS NULL AND n.metadata @> %s "
            "GROUP BY 1 ORDER BY 1",
            (Jsonb(U42),),
        ).fetchall()
    assert left == [("other", 3)]  # the key forgot only in its project


def test_the_service_bound_is_a_setting(fixture_url: str, embedder: LocalEmbedder) -> None:
    with connect(fixture_url, autocommit=True) as conn:
        _people(conn)
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_FORGET_MAX_NODES": "2"}
    with serve(env, embedder) as c:
        flt = json.dumps(U42)
        r = c.delete("/memory/nodes", params={"project": "scope", "filter": flt})
        assert r.status_code == 422 and "max_nodes = 2" in r.json()["detail"]
        r = c.delete("/memory/nodes", params={"project": "scope", "filter": flt, "max_nodes": 3})
        assert r.status_code == 200 and r.json()["retired"] == 3


# --- the index ------------------------------------------------------------------------------


def test_a_metadata_filter_reads_the_partial_gin_index(conn: Conn) -> None:
    """10,000 current nodes of 250 users and 2,000 ended versions: listing, counting and
    forgetting one user's nodes read nodes_metadata_current_gin."""
    conn.execute("INSERT INTO memory.projects (name) VALUES ('big')")
    pid = conn.execute("SELECT memory.project_id('big')").fetchone()[0]  # type: ignore[index]
    with conn.cursor().copy(
        "COPY memory.nodes (sha256, project_id, level, text, metadata, expired_at, end_reason)"
        " FROM STDIN"
    ) as copy:
        for i in range(12000):
            ended = ("2024-01-01", "retired") if i >= 10000 else (None, None)
            copy.write_row((i.to_bytes(32, "big"), pid, "L0", f"note {i}",
                            json.dumps({"user": str(i % 250)}), *ended))  # fmt: skip
    conn.execute("ANALYZE memory.nodes")
    f = Jsonb({"user": "7"})
    for sql in (
        "SELECT * FROM memory.list_nodes('big', filter => %s)",
        "SELECT memory.count_nodes('big', filter => %s)",
        "SELECT memory.forget('big', filter => %s, dry_run => true)",
    ):
        assert "nodes_metadata_current_gin" in _index_names(_nested_plans(conn, sql, (f,))), sql
    assert _count(conn, project="big", filter={"user": "7"}) == 40


# --- expiry and retention -------------------------------------------------------------------


def _query_ids(conn: Conn, text: str, levels: list[str] | None = None) -> list[str]:
    rows = conn.execute(
        "SELECT external_id FROM memory_query(%s, project => 'scope', levels => %s, "
        "strategy => 'LexicalOnly', k => 20)",
        (text, levels or ["L0", "L1", "L2"]),
    ).fetchall()
    return [r[0] for r in rows]


def test_an_expired_node_leaves_every_answer_at_once(conn: Conn) -> None:
    _write(
        conn,
        [
            _n("scope", "old", "the parking code is 1234", expires_at="2020-01-01T00:00:00Z"),
            _n("scope", "new", "the parking code changes monthly",
               expires_at="2999-01-01T00:00:00Z"),
            _n("scope", "mem", "parking needs a code", "L1", parents=["old", "new"]),
        ],
    )  # fmt: skip
    assert _query_ids(conn, "parking code", ["L0"]) == ["new"]
    with pytest.raises(psycopg.Error) as exc:
        conn.execute("SELECT * FROM memory.get_node('old', 'scope')")
    assert exc.value.sqlstate == SQLSTATES["unknown_node"]
    assert _listed(conn, project="scope") == ["new", "mem"]
    # evidence and provenance cite only the unexpired turn
    cited = conn.execute(
        "SELECT e.external_id FROM memory.evidence('parking code', "
        "ARRAY(SELECT node_id FROM memory_query('parking code', project => 'scope', "
        "levels => ARRAY['L1']) ORDER BY rank), project => 'scope', levels => ARRAY['L1']) e"
    ).fetchall()
    assert [r[0] for r in cited] == ["new"]
    # still current (history) until poimen-memory expire ends it; as of a time before its
    # expiry it was visible
    assert conn.execute("SELECT current FROM memory.history('scope', 'old')").fetchall() == [
        (True,)
    ]
    assert _query_ids(conn, "parking code", ["L0"]) == ["new"]
    assert "old" in [
        r[0] for r in conn.execute(
            "SELECT external_id FROM memory_query('parking code', project => 'scope', "
            "levels => ARRAY['L0'], strategy => 'LexicalOnly', valid_at => '2019-06-01')"
        )
    ]  # fmt: skip


def test_a_retention_expires_current_and_new_nodes(conn: Conn) -> None:
    _people(conn)
    out = conn.execute("SELECT memory.set_retention('scope', 'L0', '1 hour')").fetchone()[0]  # type: ignore[index]
    assert out["nodes_updated"] == 4 and out["action"] == "retire"
    rows = conn.execute(
        "SELECT external_id, expires_at = created_at + interval '1 hour' FROM memory.nodes "
        "WHERE project_id = memory.project_id('scope') ORDER BY id"
    ).fetchall()
    assert rows == [("a", True), ("b", True), ("c", None), ("d", True), ("e", True)]
    _write(conn, [_n("scope", "f", "a new turn")])
    assert conn.execute(
        "SELECT expires_at BETWEEN now() + interval '59 minutes' AND now() + interval '1 hour' "
        "FROM memory.nodes WHERE external_id = 'f'"
    ).fetchone() == (True,)
    # A retention of a second: gone from answers at once
    conn.execute("SELECT memory.set_retention('scope', 'L0', '1 microsecond', 'erase')")
    assert _listed(conn, project="scope") == ["c"]
    assert conn.execute("SELECT * FROM memory.retention()").fetchall()[0][:4] == (
        "scope", "L0", __import__("datetime").timedelta(microseconds=1), "erase",
    )  # fmt: skip


def test_poimen_memory_expire_ends_what_expired(
    conn: Conn,
    fixture_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _people(conn)
    conn.execute("SELECT memory.set_retention('scope', 'L0', '1 microsecond', 'erase')")
    _write(conn, [_n("scope", "x", "expires by itself", "L1", expires_at="2020-01-01")])
    monkeypatch.setenv("POIMEN_DATABASE_URL", fixture_url)
    capsys.readouterr()
    assert main(["expire", "--project", "scope", "--batch", "2"]) == 0
    out, err = capsys.readouterr()
    assert "expired: 1 retired, 4 erased, 0 derived ended, in 1 project(s)" in out
    assert err.count("notice: expire: scope:") == 3  # batches of 2: 2 erased, 2 erased, then
    ended = conn.execute(
        "SELECT external_id, end_reason, end_note, erased_at IS NOT NULL FROM memory.nodes "
        "WHERE project_id = memory.project_id('scope') AND expired_at IS NOT NULL ORDER BY id"
    ).fetchall()
    assert ended == [
        ("a", "erased", "expired", True), ("b", "erased", "expired", True),
        ("d", "erased", "expired", True), ("e", "erased", "expired", True),
        ("x", "retired", "expired", False),
    ]  # fmt: skip
    # nothing left: a second run ends nothing
    assert main(["expire", "--project", "scope"]) == 0
    assert "expired: 0 retired, 0 erased" in capsys.readouterr().out


# --- the way back to anonymous mode ----------------------------------------------------------


def test_keys_anonymous_reopens_the_service_once_every_key_is_revoked(
    client: TestClient,
    fixture_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    key = make_key(fixture_url, ["poimen"])
    monkeypatch.setenv("POIMEN_DATABASE_URL", fixture_url)
    capsys.readouterr()
    # a key is active: refused, and nothing changes
    assert main(["keys", "anonymous", "--yes"]) == 3
    assert "revoke them first" in capsys.readouterr().err
    with connect(fixture_url, autocommit=True) as conn:
        conn.execute(q("key_revoke"), {"key": key[:12]})
    params = {"query": KONG}
    assert client.get("/memory/query", params=params).status_code == 401  # locked
    assert main(["keys", "anonymous"]) == 2  # asks for --yes
    assert main(["keys", "anonymous", "--yes"]) == 0
    assert "1 revoked key(s) set aside" in capsys.readouterr().out
    assert client.get("/memory/query", params=params).status_code == 200  # anonymous again
    assert client.get("/memory/query", params=params, headers=_as(key)).status_code == 200
    assert main(["keys", "list"]) == 0
    assert "(set aside)" in capsys.readouterr().out
    # the next key closes it again
    make_key(fixture_url, ["poimen"])
    assert client.get("/memory/query", params=params).status_code == 401
