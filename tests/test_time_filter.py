"""The time filter in SQL: since/until on memory_query() and since/before on every stage
function, applied inside each leg before its top k, on nodes with known timestamps
(tests/timeline.py). The HTTP side is tests/test_time_filter_http.py."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

from poimen_core.optimizer import optimize_query
from poimen_memory.embedders.local import LocalEmbedder
from timeline import FEB, FEB_START, MAR_START, PROJECT, QUERY, in_february, load

Conn = psycopg.Connection[Any]


@pytest.fixture
def tconn(conn: Conn, embedder: LocalEmbedder) -> Conn:
    load(conn, embedder)
    # The time filter's mechanics (a filtered query fills its limit, bounds are inclusive):
    # the relevance floor, on by default, would hold back the synthetic notes whose cosine
    # is low; tests/test_query_grammar.py tests the floor.
    conn.execute("SELECT memory.set_policy('min_cosine', '-1')")
    return conn


def _ts(conn: Conn, ids: list[int]) -> list[datetime | None]:
    rows = conn.execute(
        "SELECT n.ts FROM unnest(%s::bigint[]) WITH ORDINALITY u(id, o) "
        "JOIN memory.nodes n ON n.id = u.id ORDER BY u.o",
        (ids,),
    ).fetchall()
    return [r[0] for r in rows]


@pytest.mark.parametrize("strategy", ["LexicalOnly", "Hybrid", "SemanticOnly", "LexicalFirst"])
def test_memory_query_filter_fills_its_limit(
    tconn: Conn, embedder: LocalEmbedder, strategy: str
) -> None:
    vec = embedder.embed_query(QUERY)
    sql = (
        "SELECT node_id, \"timestamp\" FROM public.memory_query(%s, %s, %s, ARRAY['L0'], 10, %s,"
        " since => %s, until => %s)"
    )
    unfiltered = tconn.execute(sql, (QUERY, vec, PROJECT, strategy, None, None)).fetchall()
    assert len(unfiltered) == 10 and not any(in_february(r[1]) for r in unfiltered)
    rows = tconn.execute(sql, (QUERY, vec, PROJECT, strategy, *FEB)).fetchall()
    assert len(rows) == 10, strategy
    assert all(in_february(r[1]) for r in rows), rows
    assert _ts(tconn, [r[0] for r in rows]) == [r[1] for r in rows]


def test_text_only_query_filters_too(tconn: Conn) -> None:
    rows = tconn.execute(
        'SELECT "timestamp", search_strategy FROM public.memory_query(%s, project => %s,'
        " levels => ARRAY['L0'], k => 10, since => '2023-02-01', until => '2023-02-28')",
        (QUERY, PROJECT),
    ).fetchall()
    # No vector given: the query is embedded in the database and routed as over HTTP; every
    # leg it runs applies the window.
    assert len(rows) == 10 and all(in_february(r[0]) for r in rows)
    assert {r[1] for r in rows} == {optimize_query(QUERY).search_strategy.value}


@pytest.mark.parametrize("fn", ["lexical_search", "semantic_search", "exact_search", "by_ids"])
def test_every_stage_function_filters_before_top_k(
    tconn: Conn, embedder: LocalEmbedder, fn: str
) -> None:
    vec = embedder.embed_query(QUERY)
    window = {"since": FEB_START, "before": MAR_START}
    tail = "%(p)s, NULL, 10, since => %(since)s, before => %(before)s)"
    if fn == "lexical_search":
        sql, args = (
            "memory.lexical_search(%(q)s, " + tail,
            {"q": QUERY},
        )
    elif fn == "by_ids":
        ids = [r[0] for r in tconn.execute("SELECT id FROM memory.nodes WHERE text LIKE 'Kong%%'")]
        sql = "memory.search_by_ids(%(e)s, %(ids)s, " + tail
        args = {"e": vec, "ids": ids}
    else:
        sql = f"memory.{fn}(%(e)s, " + tail
        args = {"e": vec}
    ids = [
        r[0] for r in tconn.execute(f"SELECT node_id FROM {sql}", {**args, **window, "p": PROJECT})
    ]
    assert len(ids) == 10 and all(in_february(t) for t in _ts(tconn, ids)), fn


def test_until_is_inclusive_and_a_date_is_a_whole_utc_day(tconn: Conn) -> None:
    rows = tconn.execute(
        "SELECT \"timestamp\" FROM public.memory_query(%s, project => %s, levels => ARRAY['L0'],"
        " k => 10, since => '2023-02-03', until => '2023-02-03')",
        (QUERY, PROJECT),
    ).fetchall()
    assert [r[0] for r in rows] == [datetime(2023, 2, 3, 13, tzinfo=UTC)]
    # A timestamp bound includes its own second, and offsets are honoured.
    (lo, hi) = tconn.execute(
        "SELECT since_ts, before_ts FROM memory.time_range('2023-02-03T15:00:00+02:00', "
        "'2023-02-03T13:00:00Z')"
    ).fetchone() or (None, None)
    assert lo == datetime(2023, 2, 3, 13, tzinfo=UTC)
    assert hi == datetime(2023, 2, 3, 13, 0, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("until", "before"),
    [
        ("2023-05-08", datetime(2023, 5, 9, tzinfo=UTC)),  # the whole day
        ("2023-05-08T13:56", datetime(2023, 5, 8, 13, 57, tzinfo=UTC)),  # the whole minute
        ("2023-05-08 13:56Z", datetime(2023, 5, 8, 13, 57, tzinfo=UTC)),
        ("2023-05-08T23:59+02:00", datetime(2023, 5, 8, 22, 0, tzinfo=UTC)),
        ("2023-05-08T13:56:30", datetime(2023, 5, 8, 13, 56, 31, tzinfo=UTC)),  # the second
        ("2023-05-08T13:56:30-01:30", datetime(2023, 5, 8, 15, 26, 31, tzinfo=UTC)),
        ("2023-05-08T13:56:30.5", datetime(2023, 5, 8, 13, 56, 30, 600000, tzinfo=UTC)),
        ("2023-05-08T13:56:30.120Z", datetime(2023, 5, 8, 13, 56, 30, 121000, tzinfo=UTC)),
        ("2023-05-08T13:56:30.123456", datetime(2023, 5, 8, 13, 56, 30, 123457, tzinfo=UTC)),
        ("2023-05-08T23:59:59.999999", datetime(2023, 5, 9, tzinfo=UTC)),
    ],
)
def test_until_covers_the_precision_it_is_given(conn: Conn, until: str, before: datetime) -> None:
    """An exclusive upper bound one unit of the given precision later, as a date is a whole
    day; since (the lower bound) is the instant written."""
    row = conn.execute("SELECT * FROM memory.time_range(%s, %s)", (until, until)).fetchone()
    assert row is not None
    since_ts, before_ts = row
    assert before_ts == before
    written = datetime.fromisoformat(until.replace("Z", "+00:00"))
    written = written if written.tzinfo else written.replace(tzinfo=UTC)
    assert since_ts == written


def test_until_a_minute_includes_a_node_within_it(tconn: Conn) -> None:
    """until => '…T13:00' keeps a node stamped 13:00:30, as until => a date keeps its day."""
    tconn.execute(
        "UPDATE memory.nodes SET ts = ts + interval '30 seconds'"
        " WHERE ts = '2023-02-03 13:00:00+00'"
    )
    rows = tconn.execute(
        "SELECT \"timestamp\" FROM public.memory_query(%s, project => %s, levels => ARRAY['L0'],"
        " k => 10, since => '2023-02-03T13:00', until => '2023-02-03T13:00')",
        (QUERY, PROJECT),
    ).fetchall()
    assert [r[0] for r in rows] == [datetime(2023, 2, 3, 13, 0, 30, tzinfo=UTC)]


def test_nodes_without_a_timestamp_never_pass_a_filter(tconn: Conn) -> None:
    rows = tconn.execute(
        "SELECT \"timestamp\" FROM public.memory_query(%s, project => %s, levels => ARRAY['L0'],"
        " k => 50, since => '1900-01-01')",
        (QUERY, PROJECT),
    ).fetchall()
    assert len(rows) == 50 and all(r[0] is not None for r in rows)


@pytest.mark.parametrize(
    ("since", "until", "named"),
    [
        ("May 2023", None, "since"),
        ("2023-02-30", None, "since"),
        (None, "2023-13-01", "until"),
        (None, "2023-02-01T25:00:00Z", "until"),
        ("2023-03-01", "2023-02-01", "since (2023-03-01) is after until (2023-02-01)"),
    ],
)
def test_bad_bounds_are_22023_naming_the_argument(
    tconn: Conn, since: str | None, until: str | None, named: str
) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue) as info:
        tconn.execute(
            "SELECT * FROM public.memory_query('kong', since => %s, until => %s)", (since, until)
        )
    assert str(info.value).startswith(named)


def test_extracted_dates_filter_only_under_the_policy(tconn: Conn, embedder: LocalEmbedder) -> None:
    text = "kong gateway notes on 3 February 2023"
    vec = embedder.embed_query(text)
    sql = "SELECT \"timestamp\" FROM public.memory_query(%s, %s, %s, ARRAY['L0'], 5, since => %s)"
    annotated = [r[0] for r in tconn.execute(sql, (text, vec, PROJECT, None))]
    assert len(annotated) == 5 and not all(in_february(t) for t in annotated)
    tconn.execute("SELECT memory.set_policy('extracted_dates', 'filter')")
    filtered = [r[0] for r in tconn.execute(sql, (text, vec, PROJECT, None))]
    assert filtered == [datetime(2023, 2, 3, 13, tzinfo=UTC)]
    # The caller's own since/until win over what the text says.
    explicit = [r[0] for r in tconn.execute(sql, (text, vec, PROJECT, "2023-02-10"))]
    assert len(explicit) == 5 and all(
        t is not None and t >= datetime(2023, 2, 10, tzinfo=UTC) for t in explicit
    )


def test_relative_dates_count_from_reference_time(tconn: Conn) -> None:
    tconn.execute("SELECT memory.set_policy('extracted_dates', 'filter')")
    plan = tconn.execute(
        "SELECT memory.optimize_query('kong notes from last week', '2023-02-08T12:00:00Z')"
    ).fetchone()
    assert plan is not None and plan[0]["time_filter"] == {
        "since": "2023-01-30",
        "until": "2023-02-05",
    }
    rows = tconn.execute(
        "SELECT \"timestamp\" FROM public.memory_query('kong notes from last week', project => %s,"
        " levels => ARRAY['L0'], k => 10, reference_time => '2023-02-08T12:00:00Z')",
        (PROJECT,),
    ).fetchall()
    days = sorted(r[0].day for r in rows)
    assert days == [1, 2, 3, 4, 5, 30]  # the notes of 30 January to 5 February


@pytest.mark.parametrize(
    ("query", "reference"),
    [
        ("kong notes", "infinity"),
        ("kong notes", "-infinity"),
        ("kong notes from last week", "0001-01-01T00:00:00Z"),
        ("kong notes from last year", "0001-03-01T00:00:00Z"),
        ("kong notes from yesterday", "0001-01-01 00:00:00+00 BC"),
        ("kong notes from this month", "9999-12-31T00:00:00Z"),
    ],
)
def test_a_reference_time_far_from_now_is_22023(tconn: Conn, query: str, reference: str) -> None:
    """Was 38000 ValueError (infinity) or OverflowError (year 1), from PL/Python."""
    for sql in (
        "SELECT memory.optimize_query(%s, %s)",
        "SELECT * FROM public.memory_query(%s, reference_time => %s)",
        "SELECT * FROM public.memory_query(%s, strategy => 'LexicalOnly', reference_time => %s)",
    ):
        with pytest.raises(psycopg.errors.InvalidParameterValue) as info:
            tconn.execute(sql, (query, reference))
        assert str(info.value).startswith("reference_time must be an ISO timestamp within years")
        assert info.value.diag.message_hint and "plpy" not in str(info.value)
        tconn.rollback()
    ok = "SELECT count(*) FROM public.memory_query(%s, reference_time => %s)"
    for edge in ("0002-01-01T00:00:00Z", "9998-12-31T23:59:59Z"):
        assert tconn.execute(ok, (query, edge)).fetchone() is not None


def test_explain_query_reports_the_plan_that_ran(tconn: Conn, embedder: LocalEmbedder) -> None:
    """With fusion_by_type and extracted_dates = filter set, explain_query's plan is the one
    memory.query ran: the per-type fusion, the dates of the text as the time range, in every
    stage it explains (the semantic stage runs with those bounds), and the same answer."""
    text = "what is in the kong gateway notes on 3 February 2023"  # a Factual question
    vec = embedder.embed_query(text)
    tconn.execute("SELECT memory.set_policy('extracted_dates', 'filter')")
    tconn.execute("""SELECT memory.set_policy('fusion_by_type', '{"Factual": "rrf"}')""")
    rows = tconn.execute(
        "SELECT stage, search_strategy, plan, time_ms FROM memory.explain_query(%s, %s, %s,"
        " ARRAY['L0'], 5, 'Hybrid', actual => true, evidence => 0)",
        (text, vec, PROJECT),
    ).fetchall()
    stages = {r[0]: r for r in rows}
    assert list(stages) == ["plan", "lexical", "semantic", "fusion", "provenance"]
    plan = stages["plan"][2]
    assert plan["question_type"] == "Factual" and plan["fusion"] == "rrf"
    assert plan["time_filter"]["source"] == "extracted" and plan["time_filter"]["applied"]
    since = datetime.fromisoformat(plan["since_ts"])
    before = datetime.fromisoformat(plan["before_ts"])
    assert (since, before) == (datetime(2023, 2, 3, tzinfo=UTC), datetime(2023, 2, 4, tzinfo=UTC))
    # The semantic stage was explained with those bounds: its one row is the one in range.
    assert stages["semantic"][2]["Plan"]["Actual Rows"] == 1
    assert all(r[3] is not None for r in rows[1:])
    ran = tconn.execute(
        "SELECT fusion_method, \"timestamp\" FROM public.memory_query(%s, %s, %s, ARRAY['L0'], 5,"
        " 'Hybrid')",
        (text, vec, PROJECT),
    ).fetchall()
    assert ran == [("rrf", datetime(2023, 2, 3, 13, tzinfo=UTC))]
