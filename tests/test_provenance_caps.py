"""The issue's attack: a provenance tree with fan-out 20 at depth 4 (168,420 tree nodes
uncapped, 30 MB in one result). Parents per node and nodes per tree are capped, the cut is
flagged in SQL (memory.provenance, hydrate, memory_query) and over HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from starlette.testclient import TestClient

from poimen_memory.embedders.local import LocalEmbedder
from service_client import serve

Conn = psycopg.Connection[Any]
FAN_OUT, DEPTH = 20, 4
LEVELS = ["L2", "L1", "L0", "L0", "L0"]  # the level check is ingest's; SQL takes any edge


def _plant_fan_out(conn: Conn) -> int:
    """A root with FAN_OUT distinct parents per node, DEPTH levels down (as the owner)."""
    pid = conn.execute("SELECT id FROM memory.projects WHERE name = 'atlas'").fetchone()
    assert pid is not None

    def nodes(level: str, count: int, depth: int) -> list[int]:
        rows = conn.execute(
            "INSERT INTO memory.nodes (sha256, project_id, level, text)"
            " SELECT sha256(('fan' || %s || ':' || i)::bytea), %s, %s, 'kongfan node ' || i"
            " FROM generate_series(1, %s) i RETURNING id",
            (depth, pid[0], level, count),
        )
        return [r[0] for r in rows.fetchall()]

    root = nodes(LEVELS[0], 1, 0)[0]
    layer = [root]
    for d in range(1, DEPTH + 1):
        # Distinct parents for every node would be 168k rows; sharing each level's 20
        # parents makes the same tree (the walk expands shared ancestors into copies).
        parents = nodes(LEVELS[d], FAN_OUT, d)
        conn.execute(
            "INSERT INTO memory.edges (child_id, parent_id, precedence, project_id)"
            " SELECT c, p.id, p.ord, n.project_id FROM unnest(%s::bigint[]) c"
            " JOIN memory.nodes n ON n.id = c,"
            " unnest(%s::bigint[]) WITH ORDINALITY p(id, ord)",
            (layer, parents),
        )
        layer = parents
    return root


def _count(tree: list[dict[str, Any]]) -> int:
    return sum(1 + _count(p["parents"]) for p in tree)


def _cut(tree: list[dict[str, Any]]) -> int:
    return sum(int(p["truncated"]) + _cut(p["parents"]) for p in tree)


def test_fan_out_20_at_depth_4_is_bounded_and_flagged(conn: Conn) -> None:
    root = _plant_fan_out(conn)
    row = conn.execute("SELECT tree, truncated FROM memory.provenance(%s)", (root,)).fetchone()
    assert row is not None
    tree, truncated = row
    assert truncated is True
    assert _count(tree) == 256  # the default provenance_max_nodes
    assert len(tree) == 20 and all(len(p["parents"]) <= 32 for p in tree)
    # 9 instances cut at depth 2 (the tree fills there), and every one of the 236 left at
    # depth 3, where a full tree only asks whether a parent exists
    assert _cut(tree) == 245
    # The tighter caps, as the owner sets them.
    conn.execute("SELECT memory.set_policy('provenance_max_parents', '3')")
    conn.execute("SELECT memory.set_policy('provenance_max_nodes', '100')")
    tree, truncated = conn.execute(
        "SELECT tree, truncated FROM memory.provenance(%s)", (root,)
    ).fetchone() or (None, None)
    assert truncated is True and len(tree) == 3 and _count(tree) == 3 + 9 + 27 + 61
    assert len(json.dumps(tree)) < 50_000
    hyd = conn.execute(
        "SELECT provenance, provenance_truncated FROM memory.hydrate(ARRAY[%s]::bigint[])",
        (root,),
    ).fetchone()
    assert hyd == (tree, True)
    q = conn.execute(
        "SELECT provenance_truncated FROM public.memory_query('kongfan', project => 'atlas',"
        " levels => ARRAY['L2'], k => 1)"
    ).fetchall()
    assert q == [(True,)]
    conn.execute("SELECT memory.reset_policy('provenance_max_nodes')")
    _, truncated = conn.execute(
        "SELECT tree, truncated FROM memory.provenance(%s, 1)", (root,)
    ).fetchone() or (None, None)
    assert truncated is True  # 20 parents, 3 allowed


def reach_is_the_walks_pairs(conn: Conn, ids: list[int], as_of: Any = None) -> int:
    """memory._provenance_reach against its oracle, memory.provenance_walk's distinct
    (root, source) pairs, at every depth from 1 to 6; each pair comes once. The pairs at
    depth 6."""
    reach: list[tuple[int, int]] = []
    for depth in range(1, 7):
        walk = conn.execute(
            "SELECT DISTINCT root_id, parent_id FROM memory.provenance_walk(%s, %s, %s)",
            (ids, depth, as_of),
        ).fetchall()
        reach = conn.execute(
            "SELECT root_id, parent_id FROM memory._provenance_reach(%s, %s, %s)",
            (ids, depth, as_of),
        ).fetchall()
        assert len(reach) == len(set(reach)) and set(reach) == set(walk), depth
    # No graph here is deeper than 6, so the largest depth reaches nothing more; the search
    # stops when a step finds nothing new, whatever max_depth (a cycle included).
    deepest = conn.execute(
        "SELECT root_id, parent_id FROM memory._provenance_reach(%s, 2147483647, %s)",
        (ids, as_of),
    ).fetchall()
    assert sorted(deepest) == sorted(reach)
    return len(reach)


def test_the_evidence_reaches_each_source_once(conn: Conn) -> None:
    """The walk returns a row per path (168,420 here); what the evidence cites is each
    source once (80 pairs), with its citing rank, in work bounded by the sources."""
    root = _plant_fan_out(conn)
    paths = conn.execute(
        "SELECT count(*) FROM memory.provenance_walk(ARRAY[%s]::bigint[])", (root,)
    )
    assert paths.fetchone() == (sum(FAN_OUT**d for d in range(1, DEPTH + 1)),)
    (pairs,) = conn.execute(
        "SELECT count(*) FROM memory._provenance_reach(ARRAY[%s]::bigint[])", (root,)
    ).fetchone() or (None,)
    assert pairs == FAN_OUT * DEPTH
    cited = conn.execute(
        "SELECT n.level, e.cited_by FROM memory.select_evidence(ARRAY[%s]::bigint[], NULL, NULL,"
        " budget => 100) e JOIN memory.nodes n ON n.id = e.node_id",
        (root,),
    ).fetchall()
    assert len(cited) == FAN_OUT * (DEPTH - 1)  # the L0 sources, each once
    assert all(c == ("L0", [1]) for c in cited)
    # The oracle on the fixture's graph (the fan-out left out: the walk's paths at depth 6
    # would be a million rows), with a cycle through it (chat:1 -> syn:1 -> mem:1 ->
    # chat:1), from every node at once.
    conn.execute(
        "INSERT INTO memory.edges (child_id, parent_id, project_id)"
        " SELECT c.id, s.id, s.project_id FROM memory.nodes c, memory.nodes s"
        " WHERE c.external_id = 'poimen:chat:1' AND s.external_id = 'poimen:syn:1'"
    )
    ids = [
        r[0]
        for r in conn.execute(
            "SELECT id FROM memory.nodes WHERE text NOT LIKE 'kongfan%' ORDER BY id"
        ).fetchall()
    ]
    assert reach_is_the_walks_pairs(conn, ids) > 0


def test_an_uncut_tree_is_not_flagged(conn: Conn) -> None:
    nid = conn.execute("SELECT id FROM memory.nodes WHERE external_id = 'poimen:mem:1'").fetchone()
    assert nid is not None
    tree, truncated = conn.execute(
        "SELECT tree, truncated FROM memory.provenance(%s)", (nid[0],)
    ).fetchone() or (None, None)
    assert truncated is False and tree and not _cut(tree)
    assert tree == conn.execute("SELECT memory.provenance_tree(%s)", (nid[0],)).fetchone()[0]  # type: ignore[index]


def test_a_forest_is_each_tree_built_alone(conn: Conn) -> None:
    """memory.provenance_forest (hydrate's one pass over a page) gives every node the tree
    it has on its own: its own provenance_max_nodes budget, input order kept, a repeated
    node twice, an unknown id an empty tree, nodes of different projects side by side."""
    root = _plant_fan_out(conn)
    others = [
        r[0]
        for r in conn.execute(
            "SELECT n.id FROM memory.nodes n JOIN memory.projects p ON p.id = n.project_id"
            " WHERE n.level <> 'L0' AND p.name <> 'atlas' ORDER BY n.id LIMIT 4"
        ).fetchall()
    ]
    projects = conn.execute(
        "SELECT count(DISTINCT project_id) FROM memory.nodes WHERE id = ANY(%s)",
        ([root, *others],),
    ).fetchone()
    assert projects is not None and projects[0] >= 2 and len(others) == 4
    ids = [others[0], root, others[1], -1, root, *others[2:]]
    conn.execute("SELECT memory.set_policy('provenance_max_nodes', '100')")
    forest = conn.execute(
        "SELECT position, node_id, tree, truncated FROM memory.provenance_forest(%s)", (ids,)
    ).fetchall()
    alone = [
        conn.execute("SELECT tree, truncated FROM memory.provenance(%s)", (i,)).fetchone()
        for i in ids
    ]
    assert [(pos, nid) for pos, nid, _, _ in forest] == list(enumerate(ids, start=1))
    assert [(tree, cut) for _, _, tree, cut in forest] == alone
    # The fan-out root fills its own budget twice over; the others stay whole.
    assert [_count(t) for _, nid, t, _ in forest if nid == root] == [100, 100]
    assert [cut for _, _, _, cut in forest] == [False, True, False, False, True, False, False]
    assert forest[3][2] == [] and all(t for _, nid, t, _ in forest if nid in others)
    hyd = conn.execute(
        "SELECT node_id, provenance, provenance_truncated FROM memory.hydrate(%s)", (ids,)
    ).fetchall()
    assert hyd == [(nid, t, cut) for _, nid, t, cut in forest if nid != -1]


@pytest.mark.parametrize(
    ("key", "bad"), [("provenance_max_parents", "0"), ("provenance_max_nodes", "100001")]
)
def test_the_caps_are_validated(conn: Conn, key: str, bad: str) -> None:
    with pytest.raises(psycopg.Error) as exc:
        conn.execute("SELECT memory.set_policy(%s, %s)", (key, bad))
    assert exc.value.sqlstate == "22023" and key in (exc.value.diag.message_primary or "")


@pytest.fixture
def client(fixture_url: str, embedder: LocalEmbedder) -> Iterator[TestClient]:
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as c:
        yield c


def test_http_results_carry_the_flag(client: TestClient, fixture_url: str) -> None:
    with psycopg.connect(fixture_url, autocommit=True) as conn:
        _plant_fan_out(conn)
    r = client.get(
        "/memory/query",
        params={"query": "kongfan", "project": "atlas", "level": "L2", "limit": 1},
    )
    assert r.status_code == 200, r.text
    (result,) = r.json()["results"]
    assert result["provenance_truncated"] is True
    assert _count(result["parents"]) == 256 and _cut(result["parents"]) > 0
    plain = client.get("/memory/query", params={"query": "kong gateway", "project": "poimen"})
    assert plain.status_code == 200
    assert all(x["provenance_truncated"] is False for x in plain.json()["results"])
    spec = client.get("/openapi.json").json()["components"]["schemas"]
    assert spec["Result"]["properties"]["provenance_truncated"] == {"type": "boolean"}
    assert spec["Parent"]["properties"]["truncated"] == {"type": "boolean"}


def _parents(tree: list[dict[str, Any]], child: str) -> list[tuple[str, list[str]]]:
    """(child, its parents in the tree's order) for every node that has parents."""
    out = [(child, [p["sha256"] for p in tree])] if tree else []
    for p in tree:
        out += _parents(p["parents"], p["sha256"])
    return out


def test_an_uncut_forest_holds_exactly_the_recursive_walks_edges(conn: Conn) -> None:
    """An oracle that shares no code with the forest: memory.provenance_walk's recursive
    CTE. Every uncut tree of a page lists, under each node, the parents the walk finds for
    it from that root, in edge precedence order (then sha256), each once."""
    sha = {i: s for i, s in conn.execute("SELECT id, sha256 FROM memory.nodes").fetchall()}
    ids = [
        r[0]
        for r in conn.execute(
            "SELECT id FROM memory.nodes WHERE level <> 'L0' ORDER BY id LIMIT 12"
        ).fetchall()
    ]
    forest = conn.execute(
        "SELECT node_id, tree, truncated FROM memory.provenance_forest(%s)", (ids,)
    ).fetchall()
    walk = conn.execute(
        "SELECT DISTINCT root_id, child_id, parent_id, precedence FROM memory.provenance_walk(%s)",
        (ids,),
    ).fetchall()
    assert any(tree for _, tree, _ in forest) and not any(cut for _, _, cut in forest)
    for node, tree, _ in forest:
        expected: dict[str, list[str]] = {}
        for _, c, p, _prec in sorted(
            (r for r in walk if r[0] == node), key=lambda r: (r[1], r[3], sha[r[2]])
        ):
            expected.setdefault(sha[c].hex(), []).append(sha[p].hex())
        got = _parents(tree, sha[node].hex())
        assert dict(got) == expected and len(got) == len(expected)  # no node listed twice


def test_root_projects_must_match_the_nodes(conn: Conn) -> None:
    rows = conn.execute(
        "SELECT id, project_id FROM memory.nodes WHERE level <> 'L0' ORDER BY id LIMIT 3"
    ).fetchall()
    ids, pids = [r[0] for r in rows], [r[1] for r in rows]
    given = conn.execute(
        "SELECT tree FROM memory.provenance_forest(%s, 4, %s)", (ids, pids)
    ).fetchall()
    looked_up = conn.execute("SELECT tree FROM memory.provenance_forest(%s)", (ids,)).fetchall()
    assert given == looked_up and any(t for (t,) in given)
    for node_ids, projects in ((ids, pids[:2]), ([], pids[:1])):
        with pytest.raises(psycopg.Error) as exc:
            conn.execute(
                "SELECT * FROM memory.provenance_forest(%s::bigint[], 4, %s)", (node_ids, projects)
            )
        assert exc.value.sqlstate == "22023" and "root_projects" in (
            exc.value.diag.message_primary or ""
        )
