"""The write sequence: the steps every writer of nodes takes, in their order, whether it runs
inside PostgreSQL (memory.add_nodes, poimen_core.addnodes, over plpy) or in the service
(poimen_memory.ingest.writer, over psycopg):

1. what the side checks and locks before it reads (memory.add_nodes: the write grants,
   then the projects: memory._ensure_projects says why they come before any read);
2. the stored nodes the records name, as node or parent (memory._stored_nodes);
3. their hashes adopted (a node written without an id, named now by its generated id);
4. the batch validated against itself and them, and the side's verdict on what is invalid;
5. the records whose content is not stored yet (memory._stored_hashes): the ones to embed;
6. the embedding model recorded or checked;
7. the one writer, memory._write_nodes (sql/068_write.sql), which answers per node.

Both run their statements through an Executor: a named statement, named parameters, rows
back. What differs between them is a WriteSide's: how a refusal is told, where vectors come
from, which transactions hold the writes. This module imports neither side.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

from poimen_core.nodes import (
    Key,
    LineError,
    NodeRecord,
    adopt_stored_hashes,
    new_records,
    reference_keys,
    validate,
    write_row,
)

__all__ = ["Checked", "Executor", "StoredNode", "WriteSide", "Writer", "write_nodes"]

CHUNK = 5000  # array elements in one lookup statement


class Executor(Protocol):
    """Runs one named statement of the write sequence and returns its rows, each a mapping of
    column to value (jsonb decoded, bytea as bytes). The statements and their parameters:

    - ``ensure_projects``: names (text[])
    - ``stored_nodes``: projects, external_ids (text[] each, pairwise) -> project,
      external_id, id, level, sha256, revision
    - ``stored_hashes``: shas (bytea[]) -> sha256
    - ``write_nodes``: nodes (JSON text), embeddings (one vector a node) -> report (jsonb)
    - ``link_nodes``: nodes -> report (stored nodes: no vectors, nothing embedded)
    - ``embed_nodes``: nodes -> report (the database embeds what is new: memory.embed)

    An implementation may hold more statements for its own side."""

    def run(self, statement: str, params: Mapping[str, Any], /) -> Sequence[Mapping[str, Any]]: ...


class StoredNode(NamedTuple):
    """The current version of a stored node, as memory._stored_nodes returns it."""

    project: str
    external_id: str
    id: int
    level: str
    sha256: bytes
    revision: int


class Checked(NamedTuple):
    """Step 4: the batch (hashes adopted), what is invalid in it, and the stored nodes it
    was checked against."""

    records: list[NodeRecord]
    problems: list[LineError]
    stored: Mapping[Key, StoredNode]


class Writer:
    """Step 7: one run's calls of memory._write_nodes, and what they answered, summed."""

    def __init__(
        self, ex: Executor, records: Sequence[NodeRecord], keep_answers: bool = True
    ) -> None:
        self.ex = ex
        self.inserted = self.duplicates = self.updated = self.edges = 0
        self.unresolved: list[tuple[int, str]] = []  # (line number, parent id)
        # The writer's answer for each record, by its position in records (when kept: a
        # bulk load does not hold them).
        self._keep = keep_answers
        self._answer: dict[int, dict[str, Any]] = {}
        self._position = {id(r): i for i, r in enumerate(records)}

    def call(
        self, statement: str, batch: Sequence[NodeRecord], embeddings: Sequence[Any] | None = None
    ) -> int:
        """One call of the writer over ``batch``; how many versions it inserted."""
        nodes = json.dumps([write_row(r) for r in batch])
        out = self.ex.run(statement, {"nodes": nodes, "embeddings": embeddings})[0]["report"]
        self.inserted += out["inserted"]
        self.updated += out["updated"]
        # Stored before, given twice, or stored first by a concurrent writer (ON CONFLICT
        # waited for it).
        self.duplicates += out["duplicates"]
        self.edges += out["edges"]
        # The writer numbers the batch's nodes from 1.
        self.unresolved += [(batch[n - 1].line_no, p) for n, p in out["unresolved"]]
        if self._keep:
            for r, node in zip(batch, out["nodes"], strict=True):
                self._answer[self._position[id(r)]] = node
        inserted: int = out["inserted"]
        return inserted

    def answers(self) -> list[dict[str, Any]]:
        """The writer's answer per record written, in input order."""
        return [self._answer[i] for i in sorted(self._answer)]


class WriteSide(Protocol):
    """What one writer does at the sequence's fixed points."""

    keep_answers: bool

    def before_reading(self, records: Sequence[NodeRecord]) -> None:
        """Step 1."""

    def screen(self, checked: Checked) -> list[NodeRecord]:
        """Step 4's verdict: raise, or the records to write."""
        ...

    def writing(self, todo: Sequence[NodeRecord]) -> AbstractContextManager[Any]:
        """What steps 6 and 7 run in (a transaction), entered once ``todo`` is known."""
        ...

    def ensure_model(self, todo: Sequence[NodeRecord]) -> None:
        """Step 6."""

    def write(self, writer: Writer, records: Sequence[NodeRecord], todo: list[NodeRecord]) -> None:
        """Step 7: ``records`` through ``writer``, ``todo`` (new content) with vectors."""


def stored_nodes(ex: Executor, keys: Sequence[Key]) -> dict[Key, StoredNode]:
    out: dict[Key, StoredNode] = {}
    for i in range(0, len(keys), CHUNK):
        chunk = keys[i : i + CHUNK]
        rows = ex.run(
            "stored_nodes",
            {"projects": [k[0] for k in chunk], "external_ids": [k[1] for k in chunk]},
        )
        for x in rows:
            node = StoredNode(x["project"], x["external_id"], x["id"], x["level"],
                              bytes(x["sha256"]), x["revision"])  # fmt: skip
            out[(node.project, node.external_id)] = node
    return out


def stored_hashes(ex: Executor, shas: Sequence[bytes]) -> set[bytes]:
    out: set[bytes] = set()
    for i in range(0, len(shas), CHUNK):
        rows = ex.run("stored_hashes", {"shas": list(shas[i : i + CHUNK])})
        out.update(bytes(x["sha256"]) for x in rows)
    return out


def write_nodes(ex: Executor, records: Sequence[NodeRecord], side: WriteSide) -> Writer:
    """The seven steps over ``records`` (valid lines, in input order); the writer's answer."""
    side.before_reading(records)
    stored = stored_nodes(ex, reference_keys(records))
    # A node written without an id and now named by its generated id hashes as it did.
    adopted = adopt_stored_hashes(records, stored)
    kept = side.screen(Checked(adopted, validate(adopted, stored), stored))
    shas = stored_hashes(ex, [r.sha256 for r in kept]) | {s.sha256 for s in stored.values()}
    todo, _ = new_records(kept, shas)
    writer = Writer(ex, kept, side.keep_answers)
    with side.writing(todo):
        side.ensure_model(todo)
        side.write(writer, kept, todo)
    return writer
