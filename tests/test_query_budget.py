"""Issue 43 in SQL: a query's cost is bounded before it runs (its text, the grammar's
operands, a work budget memory._plan checks), the SQL functions name a NULL argument, a
forget's reason is capped, recency ages a future timestamp, and a caller under row-level
security sees no row counts in memory.explain_query. The HTTP and MCP fronts run the same
plan: tests/test_mcp.py shows the same refusals there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from conftest import make_role
from poimen_core.vocabulary import NOTE_MAX_CHARS, QUERY_MAX_CHARS, QUERY_MAX_OPERANDS, SQLSTATES
from poimen_memory.db.migrate import layout

Conn = psycopg.Connection[Any]

KONG = "kong client body buffer size"
# The attack's query (issue 43): 290 distinct exclusions, 1,928 characters.
EXCLUSIONS = "Caroline " + " ".join(f"-w{i}x" for i in range(290))
QUERIES = Path(__file__).parent / "fixtures" / "eval_queries.jsonl"


def _refused(conn: Conn, sql: str, params: Any = None) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as raised:
        conn.execute(sql, params)
    return raised.value


# --- the query's text and its operands ------------------------------------------------------


def test_the_attacks_query_and_a_megabyte_of_text_are_refused_before_they_run(conn: Conn) -> None:
    assert len(EXCLUSIONS) == 1928
    err = _refused(conn, "SELECT * FROM memory_query(%s)", (EXCLUSIONS,))
    assert err.sqlstate == "22023"
    assert err.diag.message_primary == (
        f"query has 290 operands, at most {QUERY_MAX_OPERANDS} are allowed"
    )
    assert err.diag.message_hint is not None and "-exclusions" in err.diag.message_hint
    err = _refused(conn, "SELECT * FROM memory_query(repeat('kong buffer ', 90000))")
    assert err.sqlstate == "22023"
    assert err.diag.message_primary == f"query is longer than {QUERY_MAX_CHARS} characters"
    assert err.diag.message_detail == "It has 1080000 characters."


def test_the_limits_are_exact_and_hold_for_a_leg_called_alone(conn: Conn) -> None:
    at = "kong " + " ".join(f"-w{i}x" for i in range(QUERY_MAX_OPERANDS))
    over = at + " -nginx"
    assert conn.execute("SELECT count(*) FROM memory.query(%s)", (at,)).fetchone() is not None
    for sql in ("SELECT * FROM memory.query(%s)", "SELECT * FROM memory.lexical_search(%s)",
                "SELECT * FROM memory.plan_query(%s)"):  # fmt: skip
        assert _refused(conn, sql, (over,)).sqlstate == "22023", sql
    # A phrase, tag or mention OR-ed with a plain word is scored only: not counted.
    optional = "kong " + " ".join(f"w{i} OR #t{i}" for i in range(QUERY_MAX_OPERANDS + 4))
    conn.execute("SELECT count(*) FROM memory.query(%s)", (optional,))
    required = " OR ".join(f"#t{i}" for i in range(QUERY_MAX_OPERANDS + 1))
    assert _refused(conn, "SELECT * FROM memory.query(%s)", (required,)).sqlstate == "22023"
    text = ("kong buffer " * 200)[:QUERY_MAX_CHARS]
    conn.execute("SELECT count(*) FROM memory.lexical_search(%s)", (text,))
    for sql in ("SELECT * FROM memory.query(%s)", "SELECT * FROM memory.lexical_search(%s)"):
        assert _refused(conn, sql, (text + "x",)).sqlstate == "22023", sql


# --- the work budget ------------------------------------------------------------------------


def _plan(conn: Conn, query: str, **req: Any) -> dict[str, Any]:
    request = Jsonb({"query": query, "k": 10, **req})
    row = conn.execute("SELECT memory._plan(%s)", (request,)).fetchone()
    assert row is not None
    plan: dict[str, Any] = row[0]
    return plan


def test_the_plan_reports_the_budget_it_checked(conn: Conn) -> None:
    cost = _plan(conn, KONG, project="poimen")["cost"]
    assert cost["checked"] is True and cost["terms"] == 5
    assert cost["max_terms"] == 256 and cost["max_postings"] == 250000
    df = conn.execute(
        "SELECT sum(t.df) FROM memory.term_stats t"
        " JOIN memory.projects p ON p.id = t.project_id WHERE p.name = 'poimen'"
        " AND t.lexeme = ANY (tsvector_to_array(to_tsvector('english', %s)))",
        (KONG,),
    ).fetchone()
    assert df is not None and cost["postings"] == df[0] > 0
    # No Postgres lexical leg reads postings: reported, not checked.
    semantic = _plan(conn, KONG, strategy="SemanticOnly", evidence=0)["cost"]
    assert semantic["checked"] is False


def test_over_the_budget_is_pm400_naming_the_limit(conn: Conn) -> None:
    try:
        conn.execute("SELECT memory.set_policy('query_max_postings', '3')")
        err = _refused(conn, "SELECT * FROM memory_query(%s)", (KONG,))
        assert err.sqlstate == SQLSTATES["query_too_costly"] == "PM400"
        assert err.diag.message_primary is not None
        assert err.diag.message_primary.endswith("postings, at most 3 are read")
        assert err.diag.message_hint is not None and "query_max_postings" in err.diag.message_hint
        # Semantic alone reads no postings: answered.
        conn.execute("SELECT * FROM memory_query(%s, strategy => 'SemanticOnly')", (KONG,))
        conn.execute("SELECT memory.reset_policy('query_max_postings')")
        conn.execute("SELECT memory.set_policy('query_max_terms', '4')")
        err = _refused(conn, "SELECT * FROM memory.answer(%s)", (KONG,))
        assert err.sqlstate == "PM400"
        assert err.diag.message_primary == "query has 5 distinct terms, at most 4 are scored"
        assert err.diag.message_hint is not None and "query_max_terms" in err.diag.message_hint
    finally:
        conn.execute("SELECT memory.reset_policy('query_max_postings')")
        conn.execute("SELECT memory.reset_policy('query_max_terms')")
    for key, bad in [("query_max_terms", "0"), ("query_max_terms", "1001"),
                     ("query_max_postings", "0"), ("query_max_postings", "x")]:  # fmt: skip
        with pytest.raises(psycopg.errors.InvalidParameterValue, match=key):
            conn.execute("SELECT memory.set_policy(%s, %s)", (key, bad))


def test_the_budget_refuses_no_real_question(conn: Conn) -> None:
    """The fixture's evaluation questions, in their project and across every project, are
    planned, checked and answered as before (LoCoMo's 1,157 and SciFact's claims are
    measured in docs/sql-api.md, "Query cost")."""
    questions = [json.loads(line) for line in QUERIES.read_text().splitlines() if line.strip()]
    assert questions
    for q in questions:
        for project in {q.get("project"), None}:
            cost = _plan(conn, q["text"], project=project)["cost"]
            assert cost["checked"] and cost["terms"] <= 32 and cost["postings"] < 1000, q
            sql = "SELECT count(*) FROM memory_query(%s, project => %s)"
            conn.execute(sql, (q["text"], project))


# --- argument hygiene -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sql", "name"),
    [
        ("SELECT * FROM memory.history(NULL, NULL)", "project"),
        ("SELECT * FROM memory.history('poimen', NULL)", "external_id"),
        ("SELECT * FROM memory.provenance_walk(NULL, -1, NULL)", "node_ids"),
        ("SELECT * FROM memory.provenance_walk('{1}', -1, NULL)", "max_depth"),
        ("SELECT * FROM memory.provenance_walk('{1}', NULL)", "max_depth"),
    ],
)
def test_a_null_argument_is_22023_naming_it(conn: Conn, sql: str, name: str) -> None:
    err = _refused(conn, sql)
    assert err.sqlstate == "22023"
    assert err.diag.message_primary is not None
    assert err.diag.message_primary.startswith(f"{name} must")


@pytest.mark.parametrize("name", ["as_of", "valid_at", "reference_time"])
@pytest.mark.parametrize(("value", "says"), [("", "must not be empty"), (" ", "must not be empty"),
                                             ("soon", "must be an ISO timestamp")])  # fmt: skip
def test_an_empty_or_malformed_instant_in_a_request_is_22023_naming_it(
    conn: Conn, name: str, value: str, says: str
) -> None:
    err = _refused(conn, "SELECT memory._plan(%s)", (Jsonb({"query": KONG, "k": 5, name: value}),))
    assert err.sqlstate == "22023"
    assert err.diag.message_primary is not None
    assert err.diag.message_primary.startswith(f"{name} {says}")
    assert _plan(conn, KONG, **{name: None})["query"] == KONG  # JSON null: absent


def test_a_forget_reason_and_a_review_note_are_capped_in_sql(conn: Conn) -> None:
    ext = conn.execute("SELECT external_id FROM memory.nodes WHERE external_id IS NOT NULL"
                       " AND expired_at IS NULL AND project_id = memory.project_id('poimen')"
                       " LIMIT 1").fetchone()  # fmt: skip
    assert ext is not None
    long = "x" * (NOTE_MAX_CHARS + 1)
    for sql in ("SELECT memory.forget('poimen', %s::text, reason => %s)",
                "SELECT memory.forget('poimen', ARRAY[%s], reason => %s)",
                "SELECT memory.forget('poimen', 'no such node', reason => %s || %s)"):  # fmt: skip
        err = _refused(conn, sql, (ext[0] if "no such" not in sql else "", long))
        assert err.sqlstate == "22023", sql
        assert err.diag.message_primary == f"reason is longer than {NOTE_MAX_CHARS} characters"
    current = conn.execute("SELECT count(*) FROM memory.history('poimen', %s) WHERE current",
                           (ext[0],)).fetchone()  # fmt: skip
    assert current == (1,)  # nothing forgotten
    err = _refused(conn, "SELECT memory.review_confirm(1, %s)", ("x" * (NOTE_MAX_CHARS + 1),))
    assert err.diag.message_primary == f"note is longer than {NOTE_MAX_CHARS} characters"
    # the vocabulary's word in the source, as the service's check reads it
    assert "2000" not in (layout.SQL_DIR / "074_review.sql").read_text()


# --- recency and the future ------------------------------------------------------------------


def test_recency_ages_a_timestamp_from_the_future_by_its_distance(conn: Conn) -> None:
    nodes = [
        {"id": f"f-{name}", "level": "L1", "project": "recency",
         "text": f"the deploy key rotation happened ({name})", "timestamp": ts}
        for name, ts in [("past", "2026-05-31T00:00:00Z"), ("soon", "2026-06-02T00:00:00Z"),
                         ("far", "9999-01-01T00:00:00Z")]
    ]  # fmt: skip
    conn.execute("SELECT memory.add_nodes(%s)", (Jsonb(nodes),))
    sql = ("SELECT external_id, final_score FROM memory_query('deploy key rotation',"
           " project => 'recency', strategy => 'Hybrid', reference_time => %s)")  # fmt: skip
    before = dict(conn.execute(sql, ("2026-06-01T00:00:00Z",)).fetchall())
    conn.execute("SELECT memory.set_policy('recency_half_life_days', '30')")
    conn.execute("SELECT memory.set_policy('recency_weight', '0.8')")
    try:
        after = dict(conn.execute(sql, ("2026-06-01T00:00:00Z",)).fetchall())
        now = dict(conn.execute(sql.replace("%s", "NULL")).fetchall())
    finally:
        conn.execute("SELECT memory.reset_policy('recency_half_life_days')")
        conn.execute("SELECT memory.reset_policy('recency_weight')")
    # a day before and a day after the moment asked about are aged alike
    for ext in ("f-past", "f-soon"):
        assert after[ext] == pytest.approx(before[ext] * (1 - 0.8 + 0.8 * 0.5 ** (1 / 30))), ext
    # the year 9999 gains nothing: the factor of a node aged for ever (1 - w)
    assert after["f-far"] == pytest.approx(before["f-far"] * 0.2)
    assert now["f-far"] == pytest.approx(before["f-far"] * 0.2)


# --- plans under row-level security ---------------------------------------------------------

COUNTS = ("Rows Removed by", "Actual Rows", "Plan Rows", "Blocks", "Heap Fetches")


def _keys(plan: Any) -> set[str]:
    if isinstance(plan, dict):
        return set(plan) | {k for v in plan.values() for k in _keys(v)}
    if isinstance(plan, list):
        return {k for v in plan for k in _keys(v)}
    return set()


def test_explain_shows_a_one_project_reader_no_row_counts(conn: Conn) -> None:
    make_role(conn, "budget_reader", "reader")
    conn.execute("SELECT memory.grant_project('budget_reader', 'poimen')")
    sql = ("SELECT stage, plan FROM memory.explain_query(%s, project => 'poimen', actual => true,"
           " strategy => 'LexicalOnly')")  # fmt: skip
    owner = dict(conn.execute(sql, (KONG,)).fetchall())
    assert any(k.startswith(COUNTS) for k in _keys(owner["lexical"]))
    conn.execute("SET ROLE budget_reader")
    try:
        mine = dict(conn.execute(sql, (KONG,)).fetchall())
    finally:
        conn.execute("RESET ROLE")
    assert set(mine) == set(owner)
    for stage, plan in mine.items():
        if stage == "plan":
            continue
        assert not [k for k in _keys(plan) if k.startswith(COUNTS) or "Blocks" in k], stage
        assert "hidden" in plan["Counts"] and "Execution Time" in plan, stage
        assert plan["Plan"]["Node Type"] == owner[stage]["Plan"]["Node Type"]
