"""memory.add_nodes: writing from SQL with the CLI's guarantees (validation first with the
same code, content-hash idempotence, parents by id, memory.embed, all or nothing, RLS)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest
from psycopg.types.json import Jsonb

from conftest import make_role, prepare_conn
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import migrate
from poimen_memory.ingest.nodes import node_sha256

Conn = psycopg.Connection[Any]

PROJECT = "sqlwrite"
NODES: list[dict[str, Any]] = [
    {"project": PROJECT, "level": "L0", "id": "w:raw:1", "source": "chat/2025-01-07",
     "timestamp": "2025-01-07T09:30:00Z", "breadcrumb": ["chat", "standup"],
     "text": "Mara said the nightly backup of the billing database failed: the disk was full."},
    {"project": PROJECT, "level": "L0", "id": "w:raw:2", "source": "chat/2025-01-08",
     "text": "Ops moved billing backups to the new 4 TB volume and the nightly job passed."},
    {"project": PROJECT, "level": "L1", "id": "w:mem:1", "parents": ["w:raw:1", "w:raw:2"],
     "title": "Billing backup outage", "metadata": {"confidence": 0.9},
     "text": "The billing database backup failed on a full disk until it moved to a 4 TB volume."},
    {"project": PROJECT, "level": "L2", "id": "w:syn:1", "parents": ["w:mem:1"],
     "text": "Backups fail silently when disks fill; watch free space on backup volumes."},
]  # fmt: skip


def _add(conn: Conn, nodes: Any) -> dict[str, Any]:
    row = conn.execute("SELECT memory.add_nodes(%s)", (Jsonb(nodes),)).fetchone()
    assert row is not None
    return dict(row[0])


def _count(conn: Conn) -> tuple[int, int, int]:
    row = conn.execute(
        "SELECT (SELECT count(*) FROM memory.nodes), (SELECT count(*) FROM memory.edges),"
        " (SELECT count(*) FROM memory.projects)"
    ).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


def test_written_from_sql_then_found_with_provenance(conn: Conn) -> None:
    before = _count(conn)
    summary = _add(conn, NODES)
    answered = summary.pop("nodes")
    assert summary == {"inserted": 4, "duplicates": 0, "updated": 0, "edges": 3, "unresolved": []}
    assert [(a["id"], a["revision"], a["status"]) for a in answered] == [
        (n["id"], 1, "created") for n in NODES
    ]
    assert _count(conn) == (before[0] + 4, before[1] + 3, before[2] + 1)
    # Keys are the writer's node_sha256; the vectors are memory.embed's.
    stored = conn.execute(
        "SELECT n.external_id, n.sha256, n.ts, n.breadcrumb, n.metadata,"
        " n.embedding::text = memory.embed(n.text)::text"
        " FROM memory.nodes n JOIN memory.projects p ON p.id = n.project_id"
        " WHERE p.name = %s ORDER BY n.id",
        (PROJECT,),
    ).fetchall()
    assert [r[0] for r in stored] == ["w:raw:1", "w:raw:2", "w:mem:1", "w:syn:1"]
    for node, row in zip(NODES, stored, strict=True):
        want = node_sha256(PROJECT, node["level"], node["id"], node.get("source"),
                           node.get("title"), node["text"])  # fmt: skip
        assert bytes(row[1]) == want and row[5] is True
    assert stored[0][2].isoformat() == "2025-01-07T09:30:00+00:00"
    assert stored[0][3] == ["chat", "standup"] and stored[2][4] == {"confidence": 0.9}
    rows = conn.execute(
        "SELECT external_id, level, provenance FROM public.memory_query("
        "'why did the billing backup fail', project => %s, k => 5)",
        (PROJECT,),
    ).fetchall()
    by_id = {r[0]: r for r in rows}
    assert set(by_id) == {"w:mem:1", "w:syn:1"}  # the default levels, L1 and L2
    # Parents in the order the node lists them (edge precedence), down to L0.
    mem = by_id["w:mem:1"][2]
    assert [(p["level"], p["source"]) for p in mem] == [
        ("L0", "chat/2025-01-07"),
        ("L0", "chat/2025-01-08"),
    ]
    syn = by_id["w:syn:1"][2]
    assert [(p["level"], p["title"]) for p in syn] == [("L1", "Billing backup outage")]
    assert [p["text"] for p in syn[0]["parents"]] == [NODES[0]["text"], NODES[1]["text"]]


def test_a_second_call_reports_duplicates_and_writes_nothing(conn: Conn) -> None:
    _add(conn, NODES)
    before = _count(conn)
    again = _add(conn, NODES)
    assert [a["status"] for a in again.pop("nodes")] == ["unchanged"] * 4
    assert again == {
        "inserted": 0,
        "duplicates": 4,
        "updated": 0,
        "edges": 0,
        "unresolved": [],
    }
    assert _count(conn) == before
    # A parent already stored links by id; one found nowhere is reported, the rest kept.
    more = [
        {"project": PROJECT, "level": "L1", "id": "w:mem:2", "parents": ["w:raw:2", "w:gone"],
         "text": "Billing backups now land on the 4 TB volume."},
    ]  # fmt: skip
    out = _add(conn, more)
    assert [a["status"] for a in out.pop("nodes")] == ["created"]
    assert out == {
        "inserted": 1,
        "duplicates": 0,
        "updated": 0,
        "edges": 1,
        "unresolved": ["node 1: parent 'w:gone' not found"],
    }


@pytest.mark.parametrize(
    ("bad", "field", "words"),
    [
        ({"level": "L0", "parents": ["w:raw:1"]}, "parents", "an L0 node has no parents"),
        ({"level": "L2", "parents": ["w:raw:1"]}, "parents", "must be L1"),
        ({"level": "L3"}, "level", "must be one of L0, L1, L2"),
        ({"timestamp": "9999-12-31T23:59:59-14:00"}, "timestamp", "out of range"),
        ({"text": "x" * 100_001}, "text", "longer than 100000"),
        ({"metadata": json.loads("[" * 40 + "]" * 40)}, "<json>", "nested deeper than 32"),
        ({"id": "w:raw:1", "text": "other words"}, "id", "already used on line 1"),
        ({"id": "w:" + "x" * 3000}, "id", "longer than 512 characters"),
    ],
)
def test_a_bad_node_in_the_middle_writes_nothing(
    conn: Conn, bad: dict[str, Any], field: str, words: str
) -> None:
    before = _count(conn)
    node = {"project": PROJECT, "level": "L1", "id": "w:bad", "text": "middle", **bad}
    with pytest.raises(psycopg.Error) as exc:
        _add(conn, [NODES[0], NODES[1], node, NODES[2]])
    assert exc.value.sqlstate == "22023"
    # The message starts with what is wrong, not with PL/Python's "plpy.Error: ".
    assert (exc.value.diag.message_primary or "").startswith(f"node 3: field '{field}'")
    assert words in (exc.value.diag.message_detail or "")
    assert exc.value.diag.message_hint
    assert _count(conn) == before  # not even the project


def test_an_id_stored_with_other_content_gets_a_new_version(conn: Conn) -> None:
    _add(conn, NODES[:1])
    out = _add(conn, [{**NODES[0], "text": "rewritten"}])
    assert (out["inserted"], out["updated"]) == (1, 1)
    rows = conn.execute(
        "SELECT revision, current, end_reason FROM memory.history(%s, %s)",
        (PROJECT, NODES[0]["id"]),
    ).fetchall()
    assert rows == [(1, False, "superseded"), (2, True, None)]


def _versions(conn: Conn, external_id: str) -> list[tuple[Any, ...]]:
    """(revision, current, sha256, metadata, timestamp, the vector as text) per version."""
    return conn.execute(
        "SELECT h.revision, h.current, h.sha256, h.metadata, h.timestamp, n.embedding::text"
        " FROM memory.history(%s, %s) h JOIN memory.nodes n ON n.id = h.node_id"
        " ORDER BY h.revision",
        (PROJECT, external_id),
    ).fetchall()


def test_every_node_is_answered_with_id_revision_and_status(conn: Conn) -> None:
    node = {"project": PROJECT, "level": "L0", "id": "w:status", "text": "Mara likes tea.",
            "metadata": {"user": 42}, "timestamp": "2025-03-01T08:00:00Z"}  # fmt: skip
    first = _add(conn, [node])["nodes"]
    assert [(a["project"], a["id"], a["revision"], a["status"]) for a in first] == [
        (PROJECT, "w:status", 1, "created")
    ]
    assert _add(conn, [node])["nodes"] == [{**first[0], "status": "unchanged"}]
    # The same text under other metadata, then another timestamp: each a new version (they
    # were dropped as duplicates), reusing the vector, with the same content hash.
    meta = _add(conn, [{**node, "metadata": {"user": 43}}])
    assert (meta["inserted"], meta["updated"], meta["duplicates"]) == (1, 1, 0)
    assert [(a["revision"], a["status"]) for a in meta["nodes"]] == [(2, "new_version")]
    ts = _add(conn, [{**node, "metadata": {"user": 43}, "timestamp": "2025-03-02T08:00:00Z"}])
    assert [(a["revision"], a["status"]) for a in ts["nodes"]] == [(3, "new_version")]
    assert ts["nodes"][0]["node_id"] != meta["nodes"][0]["node_id"] != first[0]["node_id"]
    versions = _versions(conn, "w:status")
    assert [(v[0], v[1], v[3]) for v in versions] == [
        (1, False, {"user": 42}), (2, False, {"user": 43}), (3, True, {"user": 43})
    ]  # fmt: skip
    assert len({v[2] for v in versions}) == 1 and len({v[5] for v in versions}) == 1
    assert versions[2][4].isoformat() == "2025-03-02T08:00:00+00:00"
    # The metadata-only change under a stale revision is refused like any other change.
    with pytest.raises(psycopg.Error) as exc:
        _add(conn, [{**node, "revision": 2}])
    assert exc.value.sqlstate == "PM419"
    # The same node named twice in one call: written once, the second unchanged.
    twice = _add(conn, [{**node, "text": "Mara likes green tea."}] * 2)["nodes"]
    assert [(a["revision"], a["status"]) for a in twice] == [(4, "new_version"), (4, "unchanged")]


def test_a_node_without_an_id_gets_one_that_get_update_and_forget_take(conn: Conn) -> None:
    node = {"project": PROJECT, "level": "L0", "text": "An id-less note about the cellar."}
    out = _add(conn, [node])
    (made,) = out["nodes"]
    assert made["status"] == "created" and made["revision"] == 1
    assert made["id"].startswith("n:") and len(made["id"]) == 38  # n: and a UUID
    # Its hash is the one it always had (an empty id): re-ingest is still a duplicate, and
    # answers with the stored node's id.
    row = conn.execute(
        "SELECT sha256 FROM memory.nodes WHERE id = %s", (made["node_id"],)
    ).fetchone()
    assert row is not None and bytes(row[0]) == node_sha256(
        PROJECT, "L0", None, None, None, node["text"]
    )
    assert _add(conn, [node])["nodes"] == [{**made, "status": "unchanged"}]
    got = conn.execute(
        "SELECT node_id, external_id, revision FROM memory.get_node(%s, %s)",
        (made["id"], PROJECT),
    ).fetchone()
    assert got == (made["node_id"], made["id"], 1)
    # Its id names it for an update: the same text with metadata is a new version with the
    # same content hash (as the id-less write made it), not new content.
    same = _add(conn, [{**node, "id": made["id"]}])["nodes"]
    assert same == [{**made, "status": "unchanged"}]
    meta = _add(conn, [{**node, "id": made["id"], "metadata": {"room": "cellar"}}])["nodes"]
    assert [(a["id"], a["revision"], a["status"]) for a in meta] == [(made["id"], 2, "new_version")]
    versions = _versions(conn, made["id"])
    assert versions[0][2] == versions[1][2]
    text = _add(conn, [{**node, "id": made["id"], "text": "The cellar is dry now."}])["nodes"]
    assert [(a["revision"], a["status"]) for a in text] == [(3, "new_version")]
    forgot = conn.execute("SELECT memory.forget(%s, %s)", (PROJECT, made["id"])).fetchone()
    assert forgot is not None and forgot[0]["nodes"] == [made["id"]]
    with pytest.raises(psycopg.Error) as exc:
        conn.execute("SELECT * FROM memory.get_node(%s, %s)", (made["id"], PROJECT))
    assert exc.value.sqlstate == "PM444"
    # Written again without an id once retired, the content comes back under its id (its
    # old rows hold its hash: a new id would collide with them, and the write was lost).
    back = _add(conn, [node])["nodes"]
    assert [(a["id"], a["revision"], a["status"]) for a in back] == [(made["id"], 4, "created")]
    # Erased, nothing links the content to the id any more: written again, a new node.
    conn.execute("SELECT memory.forget(%s, %s, erase => true)", (PROJECT, made["id"]))
    anew = _add(conn, [node])["nodes"]
    assert anew[0]["id"] != made["id"] and (anew[0]["revision"], anew[0]["status"]) == (
        1, "created"
    )  # fmt: skip


def test_a_new_version_keeps_the_level(conn: Conn) -> None:
    _add(conn, NODES[:1])
    with pytest.raises(psycopg.Error) as exc:
        _add(conn, [{**NODES[0], "level": "L1", "text": "rewritten"}])
    assert exc.value.sqlstate == "22023"
    assert "a new version keeps its level" in (exc.value.diag.message_detail or "")


@pytest.mark.parametrize("value", ["{}", "null", '"x"'])
def test_not_an_array(conn: Conn, value: str) -> None:
    with pytest.raises(psycopg.Error) as exc:
        conn.execute(f"SELECT memory.add_nodes('{value}'::jsonb)")
    assert exc.value.sqlstate == "22023" and "JSON array" in str(exc.value)
    with pytest.raises(psycopg.Error):
        conn.execute("SELECT memory.add_nodes(NULL)")


def test_a_writer_writes_only_its_granted_projects(conn: Conn) -> None:
    make_role(conn, "addnodes_writer", "writer")
    conn.execute("SELECT memory.grant_project('addnodes_writer', 'proj_a', write => true)")
    conn.execute("SELECT memory.grant_project('addnodes_writer', 'proj_b')")  # read only
    before = _count(conn)
    conn.execute("SET ROLE addnodes_writer")
    a = [{**n, "project": "proj_a"} for n in NODES]
    b = {"project": "proj_b", "level": "L0", "text": "should not land"}
    with pytest.raises(psycopg.errors.InsufficientPrivilege) as exc:
        _add(conn, [*a, b])  # one node of project B: nothing at all is written
    assert (exc.value.diag.message_primary or "").startswith("node 5: role ")
    assert "proj_b" in str(exc.value)
    assert "grant_project" in (exc.value.diag.message_hint or "")
    conn.execute("RESET ROLE")
    assert _count(conn) == before
    conn.execute("SET ROLE addnodes_writer")
    assert _add(conn, a)["inserted"] == 4
    conn.execute("RESET ROLE")
    assert _count(conn)[0] == before[0] + 4


def test_a_reader_may_not_call_it(conn: Conn) -> None:
    make_role(conn, "addnodes_reader", "reader")
    conn.execute("SELECT memory.grant_project('addnodes_reader', '*', write => true)")
    conn.execute("SET ROLE addnodes_reader")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        _add(conn, NODES)


@pytest.fixture
def fresh(empty_url: str, plpython_root: Path) -> Iterator[Conn]:
    """A migrated database with no node and no embedding model yet."""
    with connect(empty_url, autocommit=True) as c:
        migrate(c, plpython_root)
    with connect(empty_url, autocommit=True) as c:
        yield prepare_conn(c)


def test_the_first_write_configures_the_model_when_the_role_may(fresh: Conn) -> None:
    make_role(fresh, "addnodes_plain", "writer")
    make_role(fresh, "addnodes_service", "service")
    for role in ("addnodes_plain", "addnodes_service"):
        fresh.execute(f"SELECT memory.grant_project('{role}', '*', write => true)")
    fresh.execute("SET ROLE addnodes_plain")
    with pytest.raises(psycopg.Error) as exc:
        _add(fresh, NODES)
    assert exc.value.sqlstate == "PM412"
    assert "memory.configure_embedding" in (exc.value.diag.message_hint or "")
    fresh.execute("SET ROLE addnodes_service")  # as the service's first ingest would
    assert _add(fresh, NODES)["inserted"] == 4
    fresh.execute("RESET ROLE")
    model = fresh.execute("SELECT model, dim FROM memory.embedding_model").fetchone()
    assert model == ("all-MiniLM-L6-v2-onnx-int8", 384)
    vec = fresh.execute("SELECT embedding FROM memory.nodes ORDER BY id LIMIT 1").fetchone()
    assert vec is not None and np.asarray(vec[0].to_numpy()).shape == (384,)


def test_a_long_nodes_vector_stays_in_its_row(conn: Conn) -> None:
    """Migration 0010: a node over the 2 kB toast target keeps its vector inline (the tsvector
    and text give way), so exact rankings read no TOAST. An inline vector's datum is 4 bytes
    longer than the out-of-line copy pg_column_size reports (its full varlena header)."""

    def vector_bytes(external_id: str) -> tuple[int, int]:
        row = conn.execute(
            "SELECT pg_column_size(n.embedding), m.dim"
            " FROM memory.nodes n, memory.embedding_model m WHERE n.external_id = %s",
            (external_id,),
        ).fetchone()
        assert row is not None
        return row[0], row[1]

    storage = conn.execute(
        "SELECT attstorage FROM pg_attribute"
        " WHERE attrelid = 'memory.nodes'::regclass AND attname = 'embedding'"
    ).fetchone()
    assert storage == ("m",)
    words = " ".join(f"backup{i} volume{i * 7} disk{i * 13}" for i in range(120))
    long = {"project": PROJECT, "level": "L1", "id": "w:long:1", "text": words}
    _add(conn, [long])
    size, dims = vector_bytes("w:long:1")
    assert size == 8 + 4 * dims
    # The same row with pgvector's own EXTERNAL storage: the vector leaves the row.
    conn.execute("ALTER TABLE memory.nodes ALTER COLUMN embedding SET STORAGE EXTERNAL")
    _add(conn, [{**long, "id": "w:long:2"}])
    size, dims = vector_bytes("w:long:2")
    assert size == 4 + 4 * dims


def test_a_far_utc_offset_is_stored_as_its_instant(conn: Conn) -> None:
    """Python accepts offsets PostgreSQL's input refuses (+21:42): memory.add_nodes stores
    the instant, as ingest does (poimen_core.nodes.timestamp_text serves both)."""
    far = {"project": PROJECT, "level": "L0", "id": "w:far", "text": "a far offset",
           "timestamp": "0221-11-27T23:49:42+21:42"}  # fmt: skip
    assert _add(conn, [far])["inserted"] == 1
    row = conn.execute(
        "SELECT ts = '0221-11-27 02:07:42+00'::timestamptz FROM memory.nodes"
        " WHERE external_id = 'w:far'"
    ).fetchone()
    assert row == (True,)
