"""What callers of migrate get back, and its defaults: the reports of ``migrate`` and
``check`` and of the project graphs' builds. Imports none of the modules that do the work,
so a caller that only reads a report (or a default) depends on nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field

from poimen_memory.db.roles import LEGACY, Roles

# How long each concurrent build waits for a lock, or for the transactions it must outlast
# (CREATE INDEX CONCURRENTLY waits for every writer, then every older snapshot, to finish).
# Writes and queries do not wait behind it, so this can be long; migrate --build-lock-timeout.
GRAPH_BUILD_LOCK_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class GraphBuild:
    """A large project's own HNSW graph that build_project_graphs built."""

    index: str
    project_id: int
    was: str
    """What it was before: missing, invalid (a failed or interrupted build's leftover, which
    was dropped first) or differs (from its definition in sql/; dropped first too)."""
    seconds: float

    def line(self) -> str:
        return (
            f"memory.{self.index} (project {self.project_id}, was {self.was})"
            f" in {self.seconds:.1f} s"
        )


@dataclass(frozen=True)
class MigrateReport:
    applied: list[str]
    already: list[str]
    sql_files: list[str]
    plpython_path: str | None
    vector_schema: str = "public"
    removed_copies: list[str] = field(default_factory=list)
    embedder_path: str | None = None
    notices: list[str] = field(default_factory=list)
    """What the migrations applied now told the operator (RAISE NOTICE in their DO blocks):
    e.g. 0008 names the roles that row-level security now shows no project."""
    lock_waits: list[str] = field(default_factory=list)
    """Each attempt that gave up on a lock (and was retried): what it waited for."""
    plpython_installed: bool = True
    """False on a database without plpython3u (a managed service): the functions that need
    it raise PM503 (docs/managed-postgres.md)."""
    roles: Roles = field(default_factory=lambda: LEGACY)
    """This database's own roles (db/roles.py)."""
    warnings: list[str] = field(default_factory=list)
    """This database's roles holding privileges in another database too."""
    scale_warnings: list[str] = field(default_factory=list)
    """What the store has outgrown (memory.scale_warnings(), issue 28), one line each."""
    project_graphs: list[GraphBuild] = field(default_factory=list)
    """The large projects' own HNSW graphs built after the transaction (CONCURRENTLY)."""


@dataclass(frozen=True)
class DriftReport:
    """What `migrate --check` found: nothing is changed in the database."""

    pending_migrations: list[str]
    changed: list[str]  # functions whose definition differs from sql/
    missing: list[str]  # functions sql/ defines that the database lacks
    extra: list[str]  # functions in schema memory that sql/ does not define (a DBA's own)
    # What protects the data and differs from what sql/ makes: row-level security, policies,
    # indexes, triggers, grants, default privileges, the product's memory.config keys.
    findings: list[str] = field(default_factory=list)
    lock_waits: list[str] = field(default_factory=list)
    # Not drift from sql/ (nothing migrate would change), but worth a DBA's look: this
    # database's roles holding privileges in another database too.
    warnings: list[str] = field(default_factory=list)
    # Not drift either: what the store has outgrown (memory.scale_warnings(), issue 28).
    scale_warnings: list[str] = field(default_factory=list)
    # The large projects' own HNSW graphs the next migrate builds (concurrently, after its
    # transaction), one line each: not drift, as migrate's transaction leaves them to it too.
    project_graphs: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.pending_migrations or self.changed or self.missing or self.findings)
