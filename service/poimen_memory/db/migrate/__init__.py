"""Apply versioned migrations once (frozen by checksum), then re-apply sql/ on every deploy.

Everything runs in one transaction under an advisory lock, so a failed deploy leaves the
database as it was and two concurrent deploys serialise. A lock that cannot be taken within
``lock_timeout`` fails the deploy with a clear message instead of waiting forever.

A deploy that changes nothing takes no lock a query or a write would wait for: sql/ compares
before it re-creates a trigger, policy, index or comment. DDL that must run waits at most a
short ``lock_timeout`` per attempt (a queued ACCESS EXCLUSIVE request blocks every query
behind it) and is retried, as a whole transaction, until ``--lock-timeout`` is spent.

One module a concern:

- ``deploy``: ``migrate``, the one transaction and what follows its commit;
- ``ledger``: migrations/ applied once, frozen by checksum;
- ``render``: a sql/ file's markers as this database runs it (``render_sql``);
- ``apply``: sql/ rendered and run, pgvector's schema, the functions' search_path;
- ``roles``: this database's own roles, chosen, recorded and moved to;
- ``plpython``: the PL/Python module and the embedder's packages, installed and recorded;
- ``graphs``: the large projects' own HNSW graphs, built CONCURRENTLY after the commit;
- ``locks``: the advisory locks, and the retry of a transaction refused a lock;
- ``drift``: ``check`` (``migrate --check``), changing nothing;
- ``script``: ``migrate --render-sql``, migrate's transaction written down for psql;
- ``interface``: the reports and defaults callers read; ``layout``: where the SQL the
  package ships is (importlib.resources) and catalog.sql, the statements migrate sends of
  its own.
"""

from poimen_memory.db.migrate.apply import vector_schema
from poimen_memory.db.migrate.deploy import migrate
from poimen_memory.db.migrate.drift import check
from poimen_memory.db.migrate.graphs import (
    build_project_graphs,
    missing_project_graphs,
    scale_warnings,
)
from poimen_memory.db.migrate.interface import (
    GRAPH_BUILD_LOCK_TIMEOUT_S,
    DriftReport,
    GraphBuild,
    MigrateReport,
)
from poimen_memory.db.migrate.layout import (
    MIGRATIONS_DIR,
    PLPYTHON_SRC,
    SQL_DIR,
    TOKENIZER,
)
from poimen_memory.db.migrate.plpython import (
    Placement,
    install_plpython,
    placement,
    plpython_checksum,
    plpython_sources,
    plpython_status,
    remove_old_copies,
    server_python_deps,
)
from poimen_memory.db.migrate.render import render_sql
from poimen_memory.db.migrate.roles import database_roles

__all__ = [
    "GRAPH_BUILD_LOCK_TIMEOUT_S",
    "MIGRATIONS_DIR",
    "PLPYTHON_SRC",
    "SQL_DIR",
    "TOKENIZER",
    "DriftReport",
    "GraphBuild",
    "MigrateReport",
    "Placement",
    "build_project_graphs",
    "check",
    "database_roles",
    "install_plpython",
    "migrate",
    "missing_project_graphs",
    "placement",
    "plpython_checksum",
    "plpython_sources",
    "plpython_status",
    "remove_old_copies",
    "render_sql",
    "scale_warnings",
    "server_python_deps",
    "vector_schema",
]
