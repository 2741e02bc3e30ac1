"""Python side of memory.add_nodes: the service's ingest, inside one SQL statement.

Same rules as the CLI and POST /memory/nodes, because they are the same code: every node
is parsed with parse_line (poimen_core.nodes), then written by the write sequence the
service's ingest runs too (poimen_core.writes), here over plpy: the batch is validated
against itself and the stored nodes before anything is written, keys are node_sha256, and
duplicates, edges and unresolved parents are counted (and every node answered with its id,
revision and status) alike by the one writer, memory._write_nodes (sql/068_write.sql). Vectors come
from memory.embed, the service's own model. An error raised anywhere aborts the calling
statement, so a failed call writes nothing. Row-level security applies as to any INSERT
(the function runs as its caller); the write grants are also checked up front, so that
the error names the node rather than a table.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from poimen_core.nodes import LineError, NodeRecord, parse_line
from poimen_core.plentry import INVALID_PARAMETER_VALUE, PlpyLike
from poimen_core.vocabulary import LOCAL_DIM, LOCAL_MODEL, SQLSTATES
from poimen_core.writes import Checked, Writer, write_nodes

__all__ = ["add_nodes_for_sql"]

INSUFFICIENT_PRIVILEGE = "42501"
NOT_CONFIGURED = SQLSTATES["embedding_not_configured"]  # as memory.check_embedding
MODEL_MISMATCH = SQLSTATES["embedding_model_mismatch"]  # as memory.configure_embedding
STALE_REVISION = SQLSTATES["stale_revision"]  # memory._write_nodes refuses a stale revision
MAX_LISTED = 20  # errors listed in the DETAIL, as the CLI prints them


class PlpySPI(PlpyLike, Protocol):
    """The slice of ``plpy`` that runs statements."""

    def prepare(self, query: str, argtypes: Sequence[str], /) -> object: ...

    def execute(self, plan: object, args: Sequence[Any], /) -> Any: ...


class _Statement(NamedTuple):
    sql: str
    params: tuple[tuple[str, str], ...] = ()  # name and type of $1, $2, ...
    json: tuple[str, ...] = ()  # jsonb columns: PL/Python returns them as text


# The write sequence's statements (poimen_core.writes.Executor), then this side's own.
_STATEMENTS = {
    "ensure_projects": _Statement("SELECT memory._ensure_projects($1)", (("names", "text[]"),)),
    "stored_nodes": _Statement(
        "SELECT * FROM memory._stored_nodes($1, $2)",
        (("projects", "text[]"), ("external_ids", "text[]")),
    ),
    "stored_hashes": _Statement(
        "SELECT sha256 FROM memory._stored_hashes($1)", (("shas", "bytea[]"),)
    ),
    "embed_nodes": _Statement(
        "SELECT memory._write_nodes($1, embed => true) AS report",
        (("nodes", "jsonb"),),
        ("report",),
    ),
    "kind": _Statement("SELECT jsonb_typeof($1) AS t", (("nodes", "jsonb"),)),
    "elements": _Statement(
        "SELECT e::text AS node FROM jsonb_array_elements($1) WITH ORDINALITY AS x(e, i)"
        " ORDER BY i",
        (("nodes", "jsonb"),),
    ),
    "write_grants": _Statement(
        "SELECT pg_catalog.row_security_active('memory.nodes') AS rls,"
        " memory.granted_projects(true) AS granted, current_user AS who"
    ),
    "embedding_model": _Statement(
        "SELECT (SELECT model FROM memory.embedding_model) AS model, current_user AS who,"
        " pg_catalog.has_function_privilege("
        "'memory.configure_embedding(text, integer)', 'EXECUTE') AS may"
    ),
    "configure_embedding": _Statement(
        "SELECT memory.configure_embedding($1, $2)", (("model", "text"), ("dim", "integer"))
    ),
}


class _Spi:
    """The write sequence's Executor over plpy, inside the calling statement."""

    def __init__(self, plpy: PlpySPI) -> None:
        self.plpy = plpy
        self._plans: dict[str, object] = {}

    def run(self, statement: str, params: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
        st = _STATEMENTS[statement]
        plan = self._plans.get(statement)
        if plan is None:
            plan = self._plans[statement] = self.plpy.prepare(st.sql, [t for _, t in st.params])
        rows: Sequence[Mapping[str, Any]] = self.plpy.execute(
            plan, [params[n] for n, _ in st.params]
        )
        if not st.json:
            return rows
        return [{**row, **{c: json.loads(row[c]) for c in st.json}} for row in rows]


def _parse(plpy: PlpySPI, ex: _Spi, nodes: str | None) -> list[NodeRecord]:
    kind = ex.run("kind", {"nodes": nodes})[0]["t"]
    if kind != "array":
        plpy.error(
            f"nodes must be a JSON array of node objects, got {kind or 'NULL'}",
            hint='Pass \'[{"project": "p", "level": "L0", "text": "..."}]\'::jsonb '
            "(the format of docs/ingest.md, one array element per JSONL line).",
            sqlstate=INVALID_PARAMETER_VALUE,
        )
    records: list[NodeRecord] = []
    errors: list[LineError] = []
    for i, row in enumerate(ex.run("elements", {"nodes": nodes}), start=1):
        parsed = parse_line(row["node"], i, None)
        if isinstance(parsed, list):
            errors.extend(parsed)
        else:
            records.append(parsed)
    _refuse(plpy, errors)
    return records


def _refuse(plpy: PlpySPI, errors: Sequence[LineError]) -> None:
    if not errors:
        return
    errors = sorted(errors, key=lambda e: e.line_no)
    listed = "\n".join(e.describe("node") for e in errors[:MAX_LISTED])
    more = f"\n... and {len(errors) - MAX_LISTED} more" if len(errors) > MAX_LISTED else ""
    plpy.error(
        f"{errors[0].describe('node')} ({len(errors)} invalid node(s); nothing was written)",
        detail=listed + more,
        hint="Nodes are counted from 1 in the array; the rules are those of "
        "`poimen-memory ingest` (docs/ingest.md). Fix every listed node and call again.",
        sqlstate=INVALID_PARAMETER_VALUE,
    )


def _spi_error(exc: Exception) -> tuple[str | None, str | None, str | None]:
    """SQLSTATE, detail and hint of a plpy.SPIError. A code PL/Python has no class for comes
    as a generic SPIError whose sqlstate is None: its spidata holds the packed code."""
    data = getattr(exc, "spidata", None)
    if not isinstance(data, tuple) or not data or not isinstance(data[0], int):
        return getattr(exc, "sqlstate", None), None, None
    code = "".join(chr(((data[0] >> (6 * i)) & 0x3F) + ord("0")) for i in range(5))
    detail = data[1] if len(data) > 1 and isinstance(data[1], str) else None
    hint = data[2] if len(data) > 2 and isinstance(data[2], str) else None
    return code, detail, hint


class _AddNodes:
    """memory.add_nodes's side of the write sequence: one statement holds every step, and
    every refusal is an error of that statement (so nothing is written)."""

    keep_answers = True

    def __init__(self, plpy: PlpySPI, ex: _Spi) -> None:
        self.plpy, self.ex = plpy, ex

    def before_reading(self, records: Sequence[NodeRecord]) -> None:
        self._check_write_grants(records)
        # Before anything is read (memory._ensure_projects says why). A project left without
        # nodes cannot happen: a node's hash includes its project, and an error below rolls
        # the projects back with everything else.
        self.ex.run("ensure_projects", {"names": sorted({r.project for r in records})})

    def screen(self, checked: Checked) -> list[NodeRecord]:
        _refuse(self.plpy, checked.problems)
        return checked.records

    def writing(self, todo: Sequence[NodeRecord]) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()  # the calling statement's transaction holds it all

    def ensure_model(self, todo: Sequence[NodeRecord]) -> None:
        """As the service's first ingest: record the model if none is, when the role may."""
        if not todo:
            return
        row = self.ex.run("embedding_model", {})[0]
        if row["model"] is None and row["may"]:
            self.ex.run("configure_embedding", {"model": LOCAL_MODEL, "dim": LOCAL_DIM})
        elif row["model"] is None:
            self.plpy.error(
                f"no embedding model is configured, and role {row['who']} may not configure one",
                detail="The first write records the model and builds the HNSW indexes, which "
                "only the owner and the database's service role (memory.roles()) may do.",
                hint=f"The owner runs SELECT memory.configure_embedding('{LOCAL_MODEL}', "
                f"{LOCAL_DIM}); or call memory.add_nodes once as the owner or a member of "
                "the service role.",
                sqlstate=NOT_CONFIGURED,
            )
        elif row["model"] != LOCAL_MODEL:
            self.plpy.error(
                f"the database stores {row['model']} vectors; memory.add_nodes embeds with "
                f"{LOCAL_MODEL}",
                detail="Mixing embedding models would make cosine scores meaningless.",
                hint="Write these nodes through the service or `poimen-memory ingest`, which "
                "embed with the configured model.",
                sqlstate=MODEL_MISMATCH,
            )

    def write(self, writer: Writer, records: Sequence[NodeRecord], todo: list[NodeRecord]) -> None:
        # Every record in input order, so the writer's node numbers (and its per-node answer)
        # are the caller's; the stored ones too: the writer decides whether each is
        # unchanged or a new version (other metadata or timestamp), reusing its vector.
        refused: tuple[str, str | None, str | None] | None = None
        try:
            writer.call("embed_nodes", records)
        except Exception as exc:  # plpy.SPIError: the writer's own refusal, re-raised as itself
            code, detail, hint = _spi_error(exc)
            if code != STALE_REVISION:
                raise
            refused = (str(exc.args[0]) if exc.args else str(exc), detail, hint)
        if refused is not None:  # outside the except: PL/Python would prefix the message
            self.plpy.error(refused[0], detail=refused[1], hint=refused[2], sqlstate=STALE_REVISION)

    def _check_write_grants(self, records: Sequence[NodeRecord]) -> None:
        """The policies would refuse the INSERT anyway; this names the node and the project."""
        row = self.ex.run("write_grants", {})[0]
        if not row["rls"] or "*" in row["granted"]:
            return  # the owner, a superuser or BYPASSRLS; or a grant of every project
        for r in records:
            if r.project not in row["granted"]:
                self.plpy.error(
                    f"node {r.line_no}: role {row['who']} may not write project {r.project!r} "
                    "(nothing was written)",
                    detail="Row-level security: writing a project needs a write grant on it.",
                    hint=f"The owner runs SELECT memory.grant_project('{row['who']}', "
                    f"'{r.project}', write => true).",
                    sqlstate=INSUFFICIENT_PRIVILEGE,
                )


def add_nodes_for_sql(plpy: PlpySPI, nodes: str | None) -> str:
    """Validate, then write nodes and edges; the summary as JSON text (see the SQL comment)."""
    ex = _Spi(plpy)
    writer = write_nodes(ex, _parse(plpy, ex, nodes), _AddNodes(plpy, ex))
    return json.dumps(
        {
            "nodes": writer.answers(),
            "inserted": writer.inserted,
            "duplicates": writer.duplicates,
            "updated": writer.updated,
            "edges": writer.edges,
            "unresolved": [f"node {n}: parent {p!r} not found" for n, p in writer.unresolved],
        }
    )
