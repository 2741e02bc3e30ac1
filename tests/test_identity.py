"""Identity, support and citation integrity (issue 24), against real PostgreSQL and real HTTP:
results carry their id and metadata; a derived result whose evidence was deleted says so
(support, uncited_reason); memory.get_node and GET /memory/nodes/{id} read a node with its
parents and children; memory.list_nodes and GET /memory/nodes page a project's nodes; and
the evidence budget keeps a cited L0 turn for every result that has one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from starlette.testclient import TestClient

from poimen_memory.embedders.local import LocalEmbedder
from service_client import KONG, make_key, query, serve

Conn = psycopg.Connection[Any]
BACKUP = "why did the nightly backups break"


def _as(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture
def client(fixture_url: str, embedder: LocalEmbedder) -> Iterator[TestClient]:
    env = {"POIMEN_DATABASE_URL": fixture_url, "POIMEN_AUTH_CACHE_S": "0"}
    with serve(env, embedder) as c:
        yield c


def _l0(tree: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for node in tree:
        if node["level"] == "L0":
            out.append(node)
        out += _l0(node["parents"])
    return out


# -- identity in results -----------------------------------------------------------------


def test_results_carry_id_metadata_and_support(conn: Conn, client: TestClient) -> None:
    conn.execute(
        'UPDATE memory.nodes SET metadata = \'{"owner": "ops", "tags": ["kong"]}\' '
        "WHERE external_id = 'poimen:mem:1'"
    )
    body = query(client, query=KONG, project="poimen", limit=3)
    first = next(r for r in body["results"] if r["external_id"] == "poimen:mem:1")
    assert first["metadata"] == {"owner": "ops", "tags": ["kong"]}
    assert first["support"] == "full" and first["uncited_reason"] is None
    # Tree nodes carry their id too, and evidence turns their metadata.
    assert {n["external_id"] for n in _l0(first["parents"])} <= {
        "poimen:chat:1", "poimen:chat:2", "poimen:chat:3"
    }  # fmt: skip
    assert all(e["external_id"] and e["metadata"] == {} for e in body["evidence"])
    rows = conn.execute(
        "SELECT external_id, metadata, support, uncited_reason "
        "FROM memory_query(%s, project => 'poimen', k => 3)",
        (KONG,),
    ).fetchall()
    assert ("poimen:mem:1", {"owner": "ops", "tags": ["kong"]}, "full", None) in rows
    ev = conn.execute(
        "SELECT external_id, metadata FROM memory.evidence(%s, "
        "ARRAY(SELECT node_id FROM memory_query(%s, project => 'poimen', k => 3) ORDER BY rank), "
        "project => 'poimen')",
        (KONG, KONG),
    ).fetchall()
    assert ev and all(m == {} for _, m in ev)


def test_metadata_is_bounded_at_write(client: TestClient) -> None:
    node = {"id": "big", "level": "L0", "project": "poimen", "text": "a big one",
            "metadata": {"blob": "x" * 20_000}}  # fmt: skip
    r = client.post("/memory/nodes", json=[node])
    assert r.status_code == 400 and "metadata" in r.text and "16384" in r.text


# -- support: evidence that vanished -------------------------------------------------------


def test_deleted_evidence_is_flagged(conn: Conn, client: TestClient) -> None:
    conn.execute("DELETE FROM memory.nodes WHERE external_id = 'poimen:chat:6'")
    conn.execute("DELETE FROM memory.nodes WHERE external_id = 'poimen:chat:1'")
    body = query(client, query=BACKUP, project="poimen", limit=5)
    gone = next(r for r in body["results"] if r["external_id"] == "poimen:mem:5")
    assert gone["parents"] == [] and gone["provenance_truncated"] is False
    assert gone["support"] == "none" and gone["uncited_reason"] == "evidence_missing"
    body = query(client, query=KONG, project="poimen", limit=5, evidence=0)
    part = next(r for r in body["results"] if r["external_id"] == "poimen:mem:1")
    assert part["support"] == "partial" and len(part["parents"]) == 2
    # The same from SQL, and from memory.get_node.
    assert conn.execute(
        "SELECT support, uncited_reason FROM memory_query(%s, project => 'poimen', k => 5) "
        "WHERE external_id = 'poimen:mem:5'",
        (BACKUP,),
    ).fetchone() == ("none", "evidence_missing")
    assert conn.execute(
        "SELECT parents_declared, parents_total, support FROM memory.get_node('poimen:mem:1')"
    ).fetchone() == (3, 2, "partial")


def test_a_later_link_raises_the_declared_count(conn: Conn) -> None:
    """A stored node linked to a parent by a later write counts it, so its loss shows."""
    row = conn.execute(
        "SELECT encode(sha256, 'hex') FROM memory.nodes WHERE external_id = 'poimen:mem:5'"
    ).fetchone()
    assert row is not None
    again = {"sha256": row[0], "project": "poimen", "level": "L1", "text": "x",
             "external_id": "poimen:mem:5",
             "parents": ["poimen:chat:6", "poimen:chat:5"]}  # fmt: skip
    conn.execute(
        "SELECT memory._write_nodes(%s::jsonb, ARRAY[NULL]::vector[])", (json.dumps([again]),)
    )
    assert conn.execute(
        "SELECT parents_declared, parents_total, support FROM memory.get_node('poimen:mem:5')"
    ).fetchone() == (2, 2, "full")
    conn.execute("DELETE FROM memory.nodes WHERE external_id = 'poimen:chat:5'")
    assert conn.execute("SELECT support FROM memory.get_node('poimen:mem:5')").fetchone() == (
        "partial",
    )


# -- reading a node ------------------------------------------------------------------------


def test_get_node_in_sql(conn: Conn) -> None:
    cur = conn.cursor(row_factory=dict_row)
    node = cur.execute("SELECT * FROM memory.get_node('poimen:mem:1')").fetchone()
    assert node is not None
    assert (node["external_id"], node["project"], node["level"]) == ("poimen:mem:1", "poimen", "L1")
    assert [p["external_id"] for p in node["parents"]] == [
        "poimen:chat:1", "poimen:chat:2", "poimen:chat:3"
    ]  # fmt: skip
    assert [c["external_id"] for c in node["children"]] == ["poimen:syn:1"]
    assert node["support"] == "full" and node["versions"] is None
    with pytest.raises(psycopg.Error) as e:
        conn.execute("SELECT * FROM memory.get_node('no-such-id')")
    assert e.value.sqlstate == "PM444"
    with pytest.raises(psycopg.Error) as e:
        conn.execute("SELECT * FROM memory.get_node('poimen:mem:1', project => 'atlas')")
    assert e.value.sqlstate == "PM444"
    with pytest.raises(psycopg.Error) as e:
        conn.execute("SELECT * FROM memory.get_node('poimen:mem:1', project => 'nope')")
    assert e.value.sqlstate == "PM404"


def test_get_node_reads_the_current_version(conn: Conn) -> None:
    """An updated node is its latest content, not several nodes of the id; a retired or
    erased one has no current version and is not found (memory.history keeps it). The
    listing agrees."""
    conn.execute(
        "SELECT memory.add_nodes(%s)",
        (json.dumps([{"project": "poimen", "level": "L0", "id": "v:1", "text": "first"}]),),
    )
    conn.execute(
        "SELECT memory.add_nodes(%s)",
        (json.dumps([{"project": "poimen", "level": "L0", "id": "v:1", "text": "second"}]),),
    )
    assert conn.execute("SELECT text FROM memory.get_node('v:1')").fetchone() == ("second",)
    listed = (
        "SELECT text FROM memory.list_nodes(project => 'poimen', \"limit\" => 100)"
        " WHERE external_id = 'v:1'"
    )
    assert conn.execute(listed).fetchall() == [("second",)]  # the current version only
    conn.execute("SELECT memory.forget('poimen', 'v:1')")
    assert conn.execute(listed).fetchall() == []
    with pytest.raises(psycopg.Error) as e:
        conn.execute("SELECT * FROM memory.get_node('v:1')")
    assert e.value.sqlstate == "PM444"
    with pytest.raises(psycopg.Error) as e:
        conn.execute("SELECT * FROM memory.get_node('v:1', 'poimen')")
    assert e.value.sqlstate == "PM444"
    assert conn.execute(
        "SELECT array_agg(end_reason ORDER BY revision) FROM memory.history('poimen', 'v:1')"
    ).fetchone() == (["superseded", "retired"],)


def test_get_node_shows_its_revision_and_each_parent_once(conn: Conn, client: TestClient) -> None:
    """GET carries the node's current revision (an optimistic update needs no history
    call), and each parent once: the version the node rests on, with that version's
    revision and the parent's current one. Updates of a parent used to list every version
    it was linked to, superseded ones beside the current one."""

    def add(nodes: list[dict[str, Any]]) -> None:
        conn.execute("SELECT memory.add_nodes(%s)", (json.dumps(nodes),))

    turn = {"project": "poimen", "level": "L0", "id": "r:turn", "text": "Mara drinks coffee."}
    other = {"project": "poimen", "level": "L0", "id": "r:other", "text": "Mara drinks tea."}
    memory = {"project": "poimen", "level": "L1", "id": "r:mem", "parents": ["r:turn", "r:other"],
              "text": "Mara likes black coffee and tea."}  # fmt: skip
    add([turn, other, memory])
    add([{**memory, "metadata": {"checked": True}}])  # the memory's revision 2
    # Two versions of the turn with its text (metadata, then timestamp): the memory is
    # linked to each in turn, and rests on the newest.
    add([{**turn, "metadata": {"mood": "tired"}}])
    add([{**turn, "metadata": {"mood": "tired"}, "timestamp": "2025-06-12T08:00:00Z"}])
    conn.execute("SELECT memory.forget('poimen', 'r:other')")
    cur = conn.cursor(row_factory=dict_row)
    node = cur.execute("SELECT * FROM memory.get_node('r:mem')").fetchone()
    assert node is not None and node["revision"] == 2
    assert [
        (p["external_id"], p["precedence"], p["revision"], p["current_revision"])
        for p in node["parents"]
    ] == [("r:turn", 0, 3, 3), ("r:other", 1, 1, None)]
    assert node["parents_total"] == 2
    body = client.get("/memory/nodes/r:mem").json()
    assert body["revision"] == 2 and body["parents"] == node["parents"]
    listed = cur.execute(
        "SELECT external_id, revision FROM memory.list_nodes(project => 'poimen', \"limit\" => 100)"
        " WHERE external_id LIKE 'r:%'"
    ).fetchall()
    assert sorted((r["external_id"], r["revision"]) for r in listed) == [
        ("r:mem", 2), ("r:turn", 3)
    ]  # fmt: skip
    page = client.get("/memory/nodes", params={"project": "poimen", "limit": 100}).json()
    assert {n["external_id"]: n["revision"] for n in page["nodes"]}["r:turn"] == 3


def _twin(conn: Conn) -> None:
    """The id poimen:chat:1 in project atlas too (ids are unique per project only)."""
    conn.execute(
        "INSERT INTO memory.nodes (sha256, project_id, level, external_id, text) "
        "SELECT sha256('twin'), id, 'L0', 'poimen:chat:1', 'the twin' "
        "FROM memory.projects WHERE name = 'atlas'"
    )


def test_an_id_in_two_projects_needs_one(conn: Conn) -> None:
    _twin(conn)
    with pytest.raises(psycopg.Error) as e:
        conn.execute("SELECT * FROM memory.get_node('poimen:chat:1')")
    assert e.value.sqlstate == "PMA09" and e.value.diag.message_hint
    assert "atlas, poimen" in (e.value.diag.message_detail or "")
    row = conn.execute("SELECT text FROM memory.get_node('poimen:chat:1', 'atlas')").fetchone()
    assert row == ("the twin",)


def test_get_node_over_http(client: TestClient, conn: Conn, fixture_url: str) -> None:
    r = client.get("/memory/nodes/poimen:mem:5")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["external_id"] == "poimen:mem:5" and body["support"] == "full"
    assert body["revision"] == 1
    assert body["parents"] == [
        {"node_id": body["parents"][0]["node_id"], "external_id": "poimen:chat:6",
         "level": "L0", "precedence": 0, "revision": 1, "current_revision": 1}
    ]  # fmt: skip
    assert client.get("/memory/nodes/nope").json()["error"] == "unknown_node"
    assert client.get("/memory/nodes/nope").status_code == 404
    # An id with "#" and "/" is percent-encoded in the path.
    conn.execute(
        "INSERT INTO memory.nodes (sha256, project_id, level, external_id, text) "
        "SELECT sha256('odd'), id, 'L0', 'a/b#c d', 'odd id' FROM memory.projects "
        "WHERE name = 'poimen'"
    )
    assert client.get("/memory/nodes/a%2Fb%23c%20d").json()["text"] == "odd id"
    # A newline is part of the id, wherever it is: "poimen:mem:5\n" is not poimen:mem:5, and
    # an id of a newline alone is an id like any other (schemathesis found both misread).
    misread = [
        ("poimen:mem:5%0A", "poimen:mem:5\n"),
        ("%0A", "\n"),
        ("%0Apoimen:mem:5", "\npoimen:mem:5"),
        ("poimen:mem:5%0A/history?project=poimen", None),
    ]
    for path, nid in misread:
        r = client.get("/memory/nodes/" + path)
        assert r.status_code == 404 and r.json()["error"] == "unknown_node", (path, r.text)
        assert nid is None or f'"{nid}"' in r.json()["detail"], (path, r.text)
    conn.execute(
        "INSERT INTO memory.nodes (sha256, project_id, level, external_id, text) "
        "SELECT sha256('nl'), id, 'L0', E'line\\nbreak\\n', 'newline id' FROM memory.projects "
        "WHERE name = 'poimen'"
    )
    assert client.get("/memory/nodes/line%0Abreak%0A").json()["text"] == "newline id"
    assert client.get("/memory/nodes/line%0Abreak").status_code == 404
    _twin(conn)
    r = client.get("/memory/nodes/poimen:chat:1")
    assert r.status_code == 409 and r.json()["error"] == "ambiguous_node"
    assert (
        client.get("/memory/nodes/poimen:chat:1", params={"project": "atlas"}).json()["text"]
        == "the twin"
    )
    # Keys: a key for atlas does not find poimen's node (404: its existence does not leak),
    # and one for both gets the 409.
    atlas = make_key(fixture_url, ["atlas"])
    r = client.get("/memory/nodes/poimen:mem:5", headers=_as(atlas))
    assert r.status_code == 404 and r.json()["error"] == "unknown_node"
    r = client.get("/memory/nodes/poimen:chat:1", headers=_as(atlas))
    assert r.status_code == 200 and r.json()["project"] == "atlas"
    r = client.get("/memory/nodes/poimen:mem:5", params={"project": "poimen"}, headers=_as(atlas))
    assert r.status_code == 403
    both = make_key(fixture_url, ["atlas", "poimen"])
    assert client.get("/memory/nodes/poimen:chat:1", headers=_as(both)).status_code == 409
    assert client.get("/memory/nodes/poimen:mem:5").status_code == 401


# -- listing nodes -------------------------------------------------------------------------


def test_list_nodes_pages_by_keyset(conn: Conn, client: TestClient) -> None:
    every = [r[0] for r in conn.execute(
        "SELECT external_id FROM memory.nodes n JOIN memory.projects p ON p.id = n.project_id "
        "WHERE p.name = 'poimen' ORDER BY n.id").fetchall()]  # fmt: skip
    seen: list[str] = []
    after = None
    while True:
        params = {"project": "poimen", "limit": "4", **({"after": after} if after else {})}
        r = client.get("/memory/nodes", params=params)
        assert r.status_code == 200, r.text
        page = r.json()
        seen += [n["external_id"] for n in page["nodes"]]
        after = page["next_cursor"]
        if after is None:
            break
    assert seen == every
    sql = [r[0] for r in conn.execute(
        "SELECT external_id FROM memory.list_nodes(project => 'poimen', level => 'L1', "
        "since => '2024-05-01', until => '2024-07-31')").fetchall()]  # fmt: skip
    http = client.get(
        "/memory/nodes",
        params={"project": "poimen", "level": "L1", "since": "2024-05-01", "until": "2024-07-31"},
    ).json()["nodes"]
    assert sql == [n["external_id"] for n in http] and sql
    assert all(n["level"] == "L1" for n in http)
    by_source = client.get("/memory/nodes", params={"source": "poimen:mem:5"}).json()["nodes"]
    assert [n["external_id"] for n in by_source] == ["poimen:mem:5"]
    r = client.get("/memory/nodes", params={"after": "not-a-cursor"})
    assert r.status_code == 400 and r.json()["error"] == "invalid_parameter"
    assert client.get("/memory/nodes", params={"level": "L3"}).status_code == 400
    assert client.get("/memory/nodes", params={"project": "nope"}).status_code == 404
    r = client.get("/memory/nodes", params={"limit": "1000"})  # refused, as SQL refuses it
    assert r.status_code == 400 and r.json()["detail"] == "limit must be within 1..100, got 1000"
    with pytest.raises(psycopg.Error) as e:
        conn.execute('SELECT * FROM memory.list_nodes("limit" => 0)')
    assert e.value.sqlstate == "22023"


def test_list_nodes_under_keys(client: TestClient, fixture_url: str) -> None:
    atlas = make_key(fixture_url, ["atlas"])
    page = client.get("/memory/nodes", headers=_as(atlas)).json()
    assert page["nodes"] and {n["project"] for n in page["nodes"]} == {"atlas"}
    assert (
        client.get("/memory/nodes", params={"project": "poimen"}, headers=_as(atlas)).status_code
        == 403
    )


# -- citation integrity under the budget ---------------------------------------------------


def test_every_result_keeps_a_cited_turn(conn: Conn, client: TestClient) -> None:
    """With a budget of 3 and five results, the selection by score alone fills the budget
    with the top results' turns; the reservation keeps one for each result first, while the
    budget lasts, and says why for the rest."""
    for budget in (3, 5, 20):
        body = query(client, query=KONG, project="poimen", limit=5, level="L1", evidence=budget)
        assert len(body["evidence"]) <= budget
        cited = [r for r in body["results"] if _l0(r["parents"])]
        assert len(cited) >= min(budget, len(body["results"]))
        for r in body["results"]:
            if not _l0(r["parents"]):
                assert r["uncited_reason"] == "evidence_budget" and r["provenance_l0_omitted"]
    # The SQL function behind it, directly: the reserved turns are each result's best.
    ids = [r[0] for r in conn.execute(
        "SELECT node_id FROM memory_query(%s, project => 'poimen', levels => '{L1}', k => 5) "
        "ORDER BY rank", (KONG,)).fetchall()]  # fmt: skip
    rows = conn.execute(
        "SELECT cited_by FROM memory.select_evidence(%s, NULL, NULL, budget => %s, "
        "project_name => 'poimen')",
        (ids, len(ids)),
    ).fetchall()
    assert set().union(*(set(c) for (c,) in rows)) == set(range(1, len(ids) + 1))
