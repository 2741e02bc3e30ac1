"""Ingestion: idempotent by content hash, parents resolved, bad input never half-applied."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

from poimen_memory.db.connect import connect
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.errors import ConfigError, EmbeddingModelMismatch, IngestError
from poimen_memory.ingest.nodes import node_sha256, parse_lines
from poimen_memory.ingest.writer import ingest
from poimen_memory.settings import Settings

Conn = psycopg.Connection[Any]


def _lines(*nodes: dict[str, Any]) -> list[str]:
    return [json.dumps(n) for n in nodes]


def test_reingest_is_a_noop(conn: Conn, embedder: LocalEmbedder) -> None:
    from conftest import FIXTURE

    records, _errors = parse_lines(FIXTURE.read_text().splitlines())
    before = conn.execute("SELECT count(*), (SELECT count(*) FROM memory.edges) FROM memory.nodes")
    counts = before.fetchone()
    report = ingest(conn, records, embedder, progress=False)
    assert (report.inserted, report.duplicates, report.edges) == (0, len(records), 0)
    after = conn.execute("SELECT count(*), (SELECT count(*) FROM memory.edges) FROM memory.nodes")
    assert after.fetchone() == counts


def test_levels_and_edges_match_the_file(conn: Conn) -> None:
    from conftest import FIXTURE

    lines = [json.loads(x) for x in FIXTURE.read_text().splitlines()]
    want = {lv: sum(1 for n in lines if n["level"] == lv) for lv in ("L0", "L1", "L2")}
    got = dict(conn.execute("SELECT level, count(*) FROM memory.nodes GROUP BY 1").fetchall())
    assert got == want
    assert conn.execute("SELECT count(*) FROM memory.edges").fetchone() == (
        sum(len(n["parents"]) for n in lines),
    )


def test_parents_resolve_within_file_and_to_stored_nodes(
    conn: Conn, embedder: LocalEmbedder
) -> None:
    # The child comes before its in-file parent, and also cites an already stored node.
    records, _ = parse_lines(
        _lines(
            {"id": "n:child", "level": "L1", "project": "poimen", "text": "derived memory",
             "parents": ["n:parent", "poimen:chat:1"]},
            {"id": "n:parent", "level": "L0", "project": "poimen", "text": "raw turn"},
        )
    )  # fmt: skip
    report = ingest(conn, records, embedder, progress=False)
    assert report.inserted == 2 and report.edges == 2 and not report.unresolved
    parents = conn.execute(
        "SELECT p.external_id FROM memory.edges e JOIN memory.nodes c ON c.id = e.child_id"
        " JOIN memory.nodes p ON p.id = e.parent_id WHERE c.external_id = 'n:child'"
        " ORDER BY e.precedence"
    ).fetchall()
    assert [r[0] for r in parents] == ["n:parent", "poimen:chat:1"]


def test_unresolved_parents_are_reported(conn: Conn, embedder: LocalEmbedder) -> None:
    records, _ = parse_lines(
        _lines({"id": "x", "level": "L1", "project": "poimen", "text": "t", "parents": ["ghost"]})
    )
    report = ingest(conn, records, embedder, progress=False)
    assert report.inserted == 1 and report.unresolved == [(1, "ghost")]
    assert "unresolved parents 1" in report.summary()


def test_invalid_line_aborts_with_line_and_field(conn: Conn, embedder: LocalEmbedder) -> None:
    records, errors = parse_lines(
        [
            *_lines(
                {"id": "ok", "level": "L0", "project": "poimen", "text": "fine"},
                {"id": "bad", "level": "L7", "project": "poimen", "text": "wrong level"},
            ),
            "{not json",
        ]
    )
    assert [(e.line_no, e.field) for e in errors] == [(2, "level"), (3, "<json>")]
    count = conn.execute("SELECT count(*) FROM memory.nodes").fetchone()
    with pytest.raises(IngestError) as exc:
        ingest(conn, records, embedder, invalid=errors, progress=False)
    assert "line 2: field 'level'" in (exc.value.detail or "")
    assert conn.execute("SELECT count(*) FROM memory.nodes").fetchone() == count
    report = ingest(conn, records, embedder, invalid=errors, skip_invalid=True, progress=False)
    assert report.inserted == 1 and len(report.invalid) == 2


@pytest.mark.parametrize(
    ("node", "field"),
    [
        ({"level": "L0", "project": "p"}, "text"),
        ({"level": "L0", "project": "p", "text": "   "}, "text"),
        ({"level": "L0", "text": "t"}, "project"),
        ({"level": "L0", "project": "p", "text": "t", "timestamp": "yesterday"}, "timestamp"),
        ({"level": "L0", "project": "p", "text": "t", "parents": "a"}, "parents"),
        ({"level": "L0", "project": "p", "text": "t", "title": 5}, "title"),
        # Bounds: each write fits its indexes, and every answer carrying a node is bounded.
        ({"level": "L0", "project": "p", "text": "t", "id": "x" * 513}, "id"),
        ({"level": "L0", "project": "p", "text": "t", "id": 12345}, "id"),
        ({"level": "L0", "project": "p", "text": "t", "id": ""}, "id"),
        ({"level": "L1", "project": "p", "text": "t", "parents": ["ok", "y" * 513]}, "parents"),
        (
            {"level": "L1", "project": "p", "text": "t", "parents": [f"{i}" for i in range(257)]},
            "parents",
        ),
        ({"level": "L1", "project": "p", "text": "t", "parents": [" "]}, "parents"),
        ({"level": "L0", "project": "p", "text": "\u200b\u3000\ufeff"}, "text"),
        ({"level": "L0", "project": "p", "text": "t", "title": "x" * 1001}, "title"),
        ({"level": "L0", "project": "p", "text": "t", "source": "x" * 2049}, "source"),
        ({"level": "L0", "project": "p", "text": "t", "breadcrumb": ["a"] * 33}, "breadcrumb"),
        ({"level": "L0", "project": "p", "text": "t", "metadata": {"k": "é" * 8200}}, "metadata"),
    ],
)
def test_field_validation(node: dict[str, Any], field: str) -> None:
    _, errors = parse_lines(_lines(node))
    assert [e.field for e in errors] == [field]


def test_the_bounds_themselves_are_accepted() -> None:
    node = {"level": "L1", "project": "p", "text": "t", "id": "x" * 512,
            "parents": [f"p{i}" for i in range(255)] + ["y" * 512], "title": "x" * 1000,
            "source": "s" * 2048, "breadcrumb": ["b" * 1000] * 32,
            "metadata": {"k": "m" * 16_376}}  # fmt: skip
    records, errors = parse_lines(_lines(node))
    assert errors == [] and records[0].external_id == "x" * 512


def test_hash_is_canonical_and_distinguishes_sources() -> None:
    a = node_sha256("p", "L0", "id1", "src", None, "caf\u00e9")
    assert a == node_sha256("p", "L0", "id1", "src", None, "cafe\u0301")  # NFC-equal text
    assert a != node_sha256("p", "L0", "id1", "other-src", None, "caf\u00e9")
    assert a != node_sha256("p", "L1", "id1", "src", None, "caf\u00e9")
    assert len(a) == 32


def test_embedding_model_mismatch_is_refused(fixture_url: str) -> None:
    other = LocalEmbedder()
    other.model_name = "some-other-model"
    records, _ = parse_lines(_lines({"level": "L0", "project": "poimen", "text": "new text"}))
    with (
        connect(fixture_url, autocommit=True) as conn,
        pytest.raises(EmbeddingModelMismatch) as exc,
    ):
        ingest(conn, records, other, progress=False)
    assert exc.value.sqlstate == "PM409" and exc.value.http_status == 409


class _DiesAfter:
    """The real embedder, which fails on its n-th batch: a CLI ingest killed mid-way."""

    def __init__(
        self, inner: LocalEmbedder, batches: int, error: BaseException | None = None
    ) -> None:
        self.inner, self.left = inner, batches
        self.model_name, self.dim = inner.model_name, inner.dim
        self.error = error or KeyboardInterrupt()

    def embed_documents(self, texts: Any) -> Any:
        if self.left == 0:
            raise self.error
        self.left -= 1
        return self.inner.embed_documents(texts)


def test_an_interrupted_bulk_ingest_leaves_no_node_without_its_provenance(
    empty_url: str, embedder: LocalEmbedder
) -> None:
    """Children listed before their parents, small batches committed one by one, killed
    after three: every committed L1/L2 node already has its edges, and a re-run completes
    the rest. By default the same kill leaves nothing: the load is one transaction."""
    from poimen_memory.db.migrate import migrate

    memories = [
        {"id": f"m{i}", "level": "L1", "project": "p", "text": f"memory {i}",
         "parents": [f"e{i}", f"e{i + 1}"]} for i in range(4)
    ]  # fmt: skip
    turns = [{"id": f"e{i}", "level": "L0", "project": "p", "text": f"turn {i}"} for i in range(5)]
    nodes = memories + turns
    records, _ = parse_lines(_lines(*nodes))
    with connect(empty_url, autocommit=True) as conn:
        migrate(conn, None)
        with pytest.raises(KeyboardInterrupt):
            ingest(
                conn,
                records,
                _DiesAfter(embedder, 3),  # type: ignore[arg-type]
                batch_size=2,
                embed_group=2,
                progress=False,
            )
        assert conn.execute("SELECT count(*) FROM memory.nodes").fetchone() == (0,)
        with pytest.raises(KeyboardInterrupt):
            ingest(
                conn,
                records,
                _DiesAfter(embedder, 3),  # type: ignore[arg-type]
                batch_size=2,
                embed_group=2,
                progress=False,
                commit_every_batch=True,
            )
        orphans = conn.execute(
            "SELECT count(*) FROM memory.nodes n WHERE n.level <> 'L0' "
            "AND NOT EXISTS (SELECT 1 FROM memory.edges e WHERE e.child_id = n.id)"
        ).fetchone()
        stored = conn.execute("SELECT count(*) FROM memory.nodes").fetchone()
        assert orphans == (0,) and stored == (6,)  # 3 batches of 2: 5 L0 and 1 L1
        report = ingest(conn, records, embedder, batch_size=2, progress=False)
        assert (report.inserted, report.duplicates, report.edges) == (3, 6, 6)
        assert conn.execute("SELECT count(*) FROM memory.edges").fetchone() == (8,)


@pytest.mark.parametrize("per_batch", [False, True])
def test_a_failed_bulk_ingest_says_what_it_committed(
    empty_url: str, embedder: LocalEmbedder, per_batch: bool
) -> None:
    """The error of a failed load says what it left written: nothing by default (one
    transaction: the table is as it was), or exactly the nodes of the committed batches."""
    from poimen_memory.db.migrate import migrate
    from poimen_memory.errors import EmbeddingUnavailable

    records, _ = parse_lines(
        _lines(*({"id": f"t{i}", "level": "L0", "project": "p", "text": f"turn {i}"}
                 for i in range(10)))
    )  # fmt: skip
    dies = _DiesAfter(
        embedder, 3, EmbeddingUnavailable("the embedder went away", reason="transport")
    )
    with connect(empty_url, autocommit=True) as conn:
        migrate(conn, None)
        with pytest.raises(EmbeddingUnavailable) as exc:
            ingest(conn, records, dies, batch_size=2, embed_group=2, progress=False,  # type: ignore[arg-type]
                   commit_every_batch=per_batch)  # fmt: skip
        stored = conn.execute("SELECT count(*) FROM memory.nodes").fetchone()
    detail = exc.value.detail or ""
    if per_batch:
        assert stored == (6,)
        assert "6 node(s) were written and committed before the failure" in detail
    else:
        assert stored == (0,)
        assert "Nothing was written" in detail
        # The project and the model were recorded up front, and the message says so.
        assert "project p" in detail and "the embedding model" in detail


def test_a_stale_revision_is_found_before_a_bulk_ingest_writes(
    conn: Conn, embedder: LocalEmbedder
) -> None:
    """A stale revision anywhere in the file stops the load before its first write, both
    modes alike (per-batch commits once wrote the batches before it, then said that
    nothing was written)."""
    from poimen_memory.errors import StaleRevision

    first, _ = parse_lines(_lines({"id": "s:1", "level": "L0", "project": "stale", "text": "v1"}))
    ingest(conn, first, embedder, progress=False)
    stale = {"id": "s:1", "level": "L0", "project": "stale", "text": "v2", "revision": 0}
    lines = _lines(*({"id": f"s:n{i}", "level": "L0", "project": "stale", "text": f"n {i}"}
                     for i in range(9)), stale)  # fmt: skip
    records, _ = parse_lines(lines)
    count = "SELECT count(*) FROM memory.nodes"
    before = conn.execute(count).fetchone()
    for per_batch in (False, True):
        with pytest.raises(StaleRevision) as exc:
            ingest(conn, records, embedder, progress=False, batch_size=2,
                   commit_every_batch=per_batch)  # fmt: skip
        assert conn.execute(count).fetchone() == before
        assert "nothing was written" in exc.value.message
        assert "line 10: node s:1 of project stale is at revision 1, not 0" in (
            exc.value.detail or ""
        )


def test_the_bulk_ingest_answers_per_node_and_versions_metadata_changes(
    conn: Conn, embedder: LocalEmbedder
) -> None:
    """Each record answered in the file's order; a stored node whose metadata changed is
    sent to the writer without a vector (nothing embedded) and becomes its next version."""
    nodes = [{"id": "b:1", "level": "L0", "project": "bulk", "text": "one"},
             {"level": "L0", "project": "bulk", "text": "no id"}]  # fmt: skip
    records, _ = parse_lines(_lines(*nodes))
    report = ingest(conn, records, embedder, progress=False, report_nodes=True)
    assert report.nodes is not None
    assert [(n["status"], n["revision"]) for n in report.nodes] == [("created", 1)] * 2
    generated = report.nodes[1]["id"]
    assert generated.startswith("n:")
    spy = _Spy(embedder)
    again, _ = parse_lines(_lines({**nodes[0], "metadata": {"k": 1}}, nodes[1]))
    report = ingest(conn, again, spy, progress=False, report_nodes=True)  # type: ignore[arg-type]
    assert report.nodes is not None
    assert [(n["id"], n["status"], n["revision"]) for n in report.nodes] == [
        ("b:1", "new_version", 2), (generated, "unchanged", 1)
    ]  # fmt: skip
    assert (report.inserted, report.updated, report.duplicates) == (1, 1, 1)
    assert sum(spy.calls) == 0


class _Spy:
    """The real embedder, recording how many texts each call embeds."""

    def __init__(self, inner: LocalEmbedder) -> None:
        self.inner = inner
        self.calls: list[int] = []
        self.model_name, self.dim = inner.model_name, inner.dim

    def embed_documents(self, texts: Any) -> Any:
        self.calls.append(len(texts))
        return self.inner.embed_documents(texts)


def test_nodes_are_embedded_in_groups_and_written_in_batches(
    empty_url: str, embedder: LocalEmbedder
) -> None:
    """The first group is one batch, the others whole batches (5 rounds down to 4 with
    batches of 2); every node keeps its own vector and the file's order, and a failure in
    the third group leaves the first two groups' batches committed, each node with its
    vector."""
    from poimen_memory.db.migrate import migrate

    texts = [
        f"turn {i} about {w}"
        for i, w in enumerate(["kong", "upload", "backup", "pool", "s3", "bucket", "x", "y", "z"])
    ]
    records, _ = parse_lines(
        _lines(
            *(
                {"id": f"e{i}", "level": "L0", "project": "p", "text": t}
                for i, t in enumerate(texts)
            )
        )
    )
    with connect(empty_url, autocommit=True) as conn:
        migrate(conn, None)
        spy = _Spy(embedder)
        report = ingest(
            conn,
            records,
            spy,  # type: ignore[arg-type]
            batch_size=2,
            embed_group=5,
            progress=False,
        )
        assert spy.calls == [2, 4, 3] and report.inserted == 9
        rows = conn.execute("SELECT text, embedding::text FROM memory.nodes ORDER BY id").fetchall()
        assert [r[0] for r in rows] == texts
        for text, vec in rows:
            want = embedder.embed_query(text)
            assert max(abs(a - b) for a, b in zip(json.loads(vec), want, strict=True)) < 1e-5
    with connect(empty_url, autocommit=True) as conn:
        conn.execute("DELETE FROM memory.nodes")
        with pytest.raises(KeyboardInterrupt):
            ingest(
                conn,
                records,
                _DiesAfter(embedder, 2),  # type: ignore[arg-type]
                batch_size=2,
                embed_group=4,
                progress=False,
                commit_every_batch=True,  # what was written before the kill stays
            )
        stored = conn.execute("SELECT count(*), count(embedding) FROM memory.nodes").fetchone()
        assert stored == (6, 6)


@pytest.mark.parametrize("raw", ["0", "-4", "many", "2.5"])
def test_embed_group_setting_refuses_what_is_not_a_positive_count(raw: str) -> None:
    assert Settings.from_env({"POIMEN_INGEST_EMBED_GROUP": "512"}).ingest_embed_group == 512
    with pytest.raises(ConfigError, match="POIMEN_INGEST_EMBED_GROUP"):
        Settings.from_env({"POIMEN_INGEST_EMBED_GROUP": raw})


def test_a_batch_is_one_insert_so_the_statement_triggers_run_once_per_batch(
    conn: Conn, embedder: LocalEmbedder
) -> None:
    """Seven nodes in batches of three: the BM25 statistics trigger runs three times, not
    seven (it fired once per node while nodes went in one INSERT each), and the statistics
    it keeps still count every node."""
    records, _ = parse_lines(
        _lines(*({"id": f"b{i}", "level": "L0", "project": "batched",
                  "text": f"batch node {i} about zeppelins"} for i in range(7)))
    )  # fmt: skip
    # The counters of the current transaction: ingest's own transactions nest inside it.
    with conn.transaction():
        conn.execute("SET LOCAL track_functions = 'pl'")
        report = ingest(conn, records, embedder, batch_size=3, progress=False)
        calls = conn.execute(
            "SELECT pg_stat_get_xact_function_calls('memory.nodes_lexical_statement'::regproc),"
            " pg_stat_get_xact_function_calls('memory.nodes_lexical_row'::regproc)"
        ).fetchone()
    assert report.inserted == 7
    assert calls == (3, 7)
    stats = conn.execute(
        "SELECT c.n_docs, t.df FROM memory.corpus_stats c JOIN memory.projects p"
        " ON p.id = c.project_id JOIN memory.term_stats t ON t.project_id = p.id"
        " WHERE p.name = 'batched' AND t.lexeme = 'zeppelin'"
    ).fetchone()
    assert stats == (7, 7)


def test_timestamps_keep_their_instant_whatever_the_offset(
    conn: Conn, embedder: LocalEmbedder
) -> None:
    """Python accepts UTC offsets PostgreSQL's own input refuses (+21:42, found by
    schemathesis through POST /memory/nodes); the writer stores every aware timestamp as
    its instant, and a naive one in the session's time zone, as PostgreSQL reads it."""
    stamps = {
        "far": "0221-11-27T23:49:42+21:42",
        "zulu": "2024-03-04T09:12:00.250Z",
        "naive": "2024-03-04T09:12:00",
        "none": None,
    }
    records, errors = parse_lines(
        _lines(*({"id": k, "level": "L0", "project": "stamps", "text": f"stamp {k}",
                  "timestamp": v} for k, v in stamps.items()))
    )  # fmt: skip
    assert not errors
    ingest(conn, records, embedder, progress=False)
    rows = dict(
        conn.execute(
            "SELECT n.external_id, n.ts FROM memory.nodes n JOIN memory.projects p"
            " ON p.id = n.project_id WHERE p.name = 'stamps'"
        ).fetchall()
    )
    naive = conn.execute("SELECT '2024-03-04 09:12:00'::timestamptz").fetchone()
    assert naive is not None
    assert rows == {
        "far": datetime(221, 11, 27, 2, 7, 42, tzinfo=UTC),
        "zulu": datetime(2024, 3, 4, 9, 12, 0, 250000, tzinfo=UTC),
        "naive": naive[0],
        "none": None,
    }
