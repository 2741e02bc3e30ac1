"""The evidence a response cites (memory.select_evidence, memory.evidence, the response's
"evidence" list and trimmed trees) on the fixture's incident and its memories."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb
from starlette.testclient import TestClient

from poimen_memory.embedders.local import LocalEmbedder
from service_client import KONG, query, serve

Conn = psycopg.Connection[Any]
NO_LEG_DOC: dict[str, list[Any]] = {"ids": [], "scores": []}
NO_LEG = json.dumps(NO_LEG_DOC)


@pytest.fixture
def client(fixture_url: str, embedder: LocalEmbedder) -> Iterator[TestClient]:
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as c:
        yield c


def _results(conn: Conn, text: str, k: int = 10) -> list[int]:
    rows = conn.execute(
        "SELECT node_id FROM memory.query(%s, NULL, 'poimen', k => %s, strategy => 'LexicalOnly')"
        " ORDER BY rank",
        (text, k),
    ).fetchall()
    return [r[0] for r in rows]


def _lexical_l0(conn: Conn, text: str, k: int = 50) -> tuple[str, dict[int, float]]:
    rows = conn.execute(
        "SELECT node_id, lexical_score FROM memory.lexical_search(%s, 'poimen', '{L0}', %s)"
        " ORDER BY rank",
        (text, k),
    ).fetchall()
    leg = {"ids": [r[0] for r in rows], "scores": [r[1] for r in rows]}
    return json.dumps(leg), {r[0]: r[1] for r in rows}


def _l0_below(conn: Conn, ids: list[int]) -> dict[int, set[int]]:
    """L0 node -> the 1-based ranks of the results whose provenance reaches it."""
    out: dict[int, set[int]] = {}
    for rank, node in enumerate(ids, start=1):
        rows = conn.execute(
            "SELECT DISTINCT w.parent_id FROM memory.provenance_walk(ARRAY[%s]::bigint[]) w"
            " JOIN memory.nodes n ON n.id = w.parent_id AND n.level = 'L0'",
            (node,),
        ).fetchall()
        for (l0,) in rows:
            out.setdefault(l0, set()).add(rank)
    return out


SELECT_ALL = (
    "SELECT node_id, rank, score, direct_rank, cited_by, neighbour_score FROM "
    "memory.select_evidence(%s, %s, %s, budget => 100, project_name => 'poimen') ORDER BY rank"
)


@pytest.fixture
def no_neighbours(conn: Conn) -> Iterator[None]:
    """No neighbour term, and no routing to the results' sessions (issue 29's default)."""
    conn.execute("SELECT memory.set_policy('evidence_neighbours', '0')")
    conn.execute("SELECT memory.set_policy('evidence_session_weight', '0')")
    yield
    conn.execute("SELECT memory.reset_policy('evidence_neighbours')")
    conn.execute("SELECT memory.reset_policy('evidence_session_weight')")


@pytest.mark.usefixtures("no_neighbours")
def test_scores_are_direct_match_plus_citation_support(conn: Conn) -> None:
    """Each turn's score is its direct match, min-max scaled over the lexical leg (a lone
    leg is fused as in a Hybrid pair), plus 0.5 / sqrt(rank) of every result citing it:
    recomputed here from the leg and the provenance walk."""
    ids = _results(conn, KONG)
    lex, bm25 = _lexical_l0(conn, KONG)
    rows = conn.execute(SELECT_ALL, (ids, NO_LEG, lex)).fetchall()
    assert all(r[5] == 0 for r in rows)
    below = _l0_below(conn, ids)
    lo, hi = min(bm25.values()), max(bm25.values())
    assert hi > lo
    expected = {n: (bm25[n] - lo) / (hi - lo) if n in bm25 else 0.0 for n in set(bm25) | set(below)}
    for n in below:
        expected[n] += sum(0.5 / math.sqrt(r) for r in below[n])
    # Some turn is cited by more than one result, so the sum is tested, not just the best.
    assert any(len(r) > 1 for r in below.values())
    # every candidate scoring above 0, at a budget above them all
    assert {r[0] for r in rows} == {n for n, v in expected.items() if v > 0}
    assert [r[1] for r in rows] == list(range(1, len(rows) + 1))
    for node, _, score, direct_rank, cited_by, _ in rows:
        assert score == pytest.approx(expected[node])
        assert (direct_rank is not None) == (node in bm25)
        if direct_rank is not None:  # its place in the leg (ties aside)
            assert direct_rank == sorted(bm25, key=lambda n: -bm25[n]).index(node) + 1
        assert set(cited_by) == below.get(node, set())
    scores = [r[2] for r in rows]
    assert scores == sorted(scores, reverse=True)
    # Cited by the top result and matched directly: the Kong thread leads.
    assert rows[0][4][0] == 1 and rows[0][3] is not None


def test_neighbours_lift_the_turns_said_beside_a_candidate(conn: Conn) -> None:
    """With evidence_neighbours 0.4 each turn gains 0.4 x the scores of the candidates just
    before and after it (same project and title, the nearest L0 each way within 64 ids): checked
    against the scores without neighbours and the fixture's own turn order."""
    ids = _results(conn, KONG)
    lex, _ = _lexical_l0(conn, KONG)
    conn.execute("SELECT memory.set_policy('evidence_neighbours', '0')")
    try:
        base = {r[0]: r[2] for r in conn.execute(SELECT_ALL, (ids, NO_LEG, lex)).fetchall()}
    finally:
        conn.execute("SELECT memory.reset_policy('evidence_neighbours')")
    rows = conn.execute(SELECT_ALL, (ids, NO_LEG, lex)).fetchall()
    turns = conn.execute(
        "SELECT n.id, n.title FROM memory.nodes n JOIN memory.projects p ON p.id = n.project_id"
        " WHERE p.name = 'poimen' AND n.level = 'L0' ORDER BY n.id"
    ).fetchall()
    title = dict(turns)
    lifted: dict[int, float] = {}
    for node, score in base.items():
        same = [t for t, h in turns if h is not None and h == title[node] and t != node]
        before = [t for t in same if node - 64 <= t < node]
        after = [t for t in same if node < t <= node + 64]
        for t in ([max(before)] if before else []) + ([min(after)] if after else []):
            lifted[t] = lifted.get(t, 0.0) + 0.4 * score
    assert lifted, "the fixture's incident turns share a title"
    got = {r[0]: (r[2], r[5]) for r in rows}
    assert set(got) == {n for n in set(base) | set(lifted) if base.get(n, 0) + lifted.get(n, 0)}
    for node, (score, beside) in got.items():
        assert beside == pytest.approx(lifted.get(node, 0.0))
        assert score == pytest.approx(base.get(node, 0.0) + lifted.get(node, 0.0))


@pytest.mark.parametrize("extra", [0, 1, 500])
def test_a_session_title_past_its_index_finds_the_same_neighbours(conn: Conn, extra: int) -> None:
    """nodes_l0_session holds the L0 titles of at most 2,000 bytes (a btree entry's limit);
    a candidate with a longer title walks the primary key instead. Every session's title
    rewritten to 2,000 + extra bytes (two-byte characters after its md5, so still one title
    per session): the evidence is the same, neighbours too, at the limit and past it."""
    ids = _results(conn, KONG)
    lex, _ = _lexical_l0(conn, KONG)
    short = conn.execute(SELECT_ALL, (ids, NO_LEG, lex)).fetchall()
    assert any(r[5] > 0 for r in short), "some turn is lifted by a neighbour"
    # Writing such a title works: the index leaves it out rather than refusing the row.
    conn.execute(
        "UPDATE memory.nodes SET title = md5(title) || repeat('é', 984) || repeat('x', %s)"
        " WHERE level = 'L0' AND title IS NOT NULL",
        (extra,),
    )
    row = conn.execute(
        "SELECT min(octet_length(title)), max(octet_length(title)), count(title)"
        " FROM memory.nodes WHERE level = 'L0'"
    ).fetchone()
    assert row is not None and row[0] == row[1] == 2000 + extra and row[2] > 0
    assert conn.execute(SELECT_ALL, (ids, NO_LEG, lex)).fetchall() == short


def test_budget_caps_and_zero_turns_it_off(conn: Conn) -> None:
    ids = _results(conn, KONG)
    lex, _ = _lexical_l0(conn, KONG)
    sql = (
        "SELECT node_id, cited_by FROM memory.select_evidence(%s, %s, %s, budget => %s) "
        "ORDER BY rank"
    )
    all_rows = conn.execute(sql, (ids, NO_LEG, lex, 100)).fetchall()
    assert len(all_rows) > 3
    for budget in (1, 2, 3, len(ids), len(all_rows)):
        # The oracle of issue 24's reservation: in rank order, each result no chosen turn
        # cites yet takes its best cited turn, while the budget lasts; then by score.
        chosen: list[int] = []
        for rank in range(1, len(ids) + 1):
            if len(chosen) >= budget:
                break
            mine = [n for n, by in all_rows if rank in by]
            if mine and not set(mine) & set(chosen):
                chosen.append(mine[0])
        chosen += [n for n, _ in all_rows if n not in chosen][: budget - len(chosen)]
        want = [r for r in all_rows if r[0] in chosen]  # in score order
        assert conn.execute(sql, (ids, NO_LEG, lex, budget)).fetchall() == want, budget
        cited = {rank for _, by in want for rank in by}
        assert len(cited) >= min(budget, len(ids)), budget
    assert conn.execute(sql, (ids, NO_LEG, lex, 0)).fetchall() == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("budget => 101", "budget must be within 0..100"),
        ("budget => -1", "budget must be within 0..100"),
        ("fusion => 'max'", "fusion must be one of rrf, convex, got 'max'"),
        ("max_depth => 0", "max_depth must be at least 1"),
    ],
)
def test_bad_arguments_are_22023(conn: Conn, args: str, message: str) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
        conn.execute(f"SELECT * FROM memory.select_evidence('{{}}', NULL, NULL, {args})")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="result_ids"):
        conn.execute("SELECT * FROM memory.select_evidence(NULL, NULL, NULL)")


def _calls(conn: Conn, *names: str) -> int:
    """How often the transaction so far called these memory.* functions (the statistics
    collector's count; the session needs track_functions = 'all')."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions"
        " WHERE schemaname = 'memory' AND funcname = ANY (%s)",
        (list(names),),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_memory_evidence_checks_its_budget_before_searching(conn: Conn) -> None:
    """A bad budget fails at once, before any embedding or search: counted by the
    statistics collector, which a good budget moves (the control)."""
    conn.execute("SET track_functions = 'all'")

    def searches() -> int:
        return _calls(conn, "embed", "lexical_search")

    with conn.transaction():
        with (
            pytest.raises(psycopg.errors.InvalidParameterValue, match="budget must be"),
            conn.transaction(),
        ):
            conn.execute("SELECT * FROM memory.evidence('kong', '{}', budget => 500)")
        assert searches() == 0
        # A question the optimizer routes Hybrid: the lexical leg and the embedding.
        conn.execute(
            "SELECT * FROM memory.evidence('why did requests over 10KB fail', '{}', budget => 5)"
        ).fetchall()
        assert searches() >= 2


def test_an_answer_without_an_evidence_list_keeps_whole_trees_without_a_walk(conn: Conn) -> None:
    """evidence => 0 keeps every result's whole tree, so memory._cited_only (which keeps a
    tree to the cited turns) is not called at all; with a list it is (the control), for
    the same results, each then saying how many turns its tree left out."""
    conn.execute("SET track_functions = 'all'")
    with conn.transaction():
        whole = conn.execute("SELECT memory.answer(%s, k => 5, evidence => 0)", (KONG,)).fetchone()
        assert _calls(conn, "_cited_only") == 0
        listed = conn.execute("SELECT memory.answer(%s, k => 5)", (KONG,)).fetchone()
        assert _calls(conn, "_cited_only") >= 1
    assert whole is not None and listed is not None
    assert whole[0]["results"] and whole[0]["evidence"] is None
    ids = [r["node_id"] for r in listed[0]["results"]]
    assert [r["node_id"] for r in whole[0]["results"]] == ids
    assert all("provenance_l0_omitted" not in r for r in whole[0]["results"])
    assert listed[0]["evidence"] and all("provenance_l0_omitted" in r for r in listed[0]["results"])


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("evidence_budget", "101"),
        ("evidence_budget", "-1"),
        ("evidence_candidates", "0"),
        ("evidence_weight", "11"),
        ("evidence_neighbours", "-0.1"),
        ("evidence_neighbours", "lots"),
        ("evidence_session_decay", "1.5"),
        ("evidence_session_decay", "-0.5"),
        ("evidence_session_weight", "11"),
        ("evidence_hop_weight", "twice"),
        ("evidence_hop_seeds", "0"),
        ("evidence_hop_seeds", "101"),
        ("evidence_deeper", "51"),
        ("evidence_deeper", "-1"),
        ("evidence_speaker_weight", "-1"),
        ("evidence_speaker_seeds", "0"),
        ("evidence_speaker_seeds", "101"),
    ],
)
def test_bad_evidence_policy_values_are_22023_and_write_nothing(
    conn: Conn, key: str, value: str
) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=f'for policy key "{key}"'):
        conn.execute("SELECT memory.set_policy(%s, %s)", (key, value))
    assert conn.execute("SELECT count(*) FROM memory.config WHERE key = %s", (key,)).fetchone() == (
        0,
    )


def test_unknown_project_is_pm404(conn: Conn) -> None:
    with pytest.raises(psycopg.Error) as err:
        conn.execute("SELECT * FROM memory.evidence('kong', '{}', project => 'nope')")
    assert err.value.sqlstate == "PM404"


def test_sql_users_get_the_response_evidence(
    conn: Conn, client: TestClient, embedder: LocalEmbedder
) -> None:
    """memory.evidence, given memory.query's results and the same embedding, cites the
    turns GET /memory/query lists, in the same order."""
    body = query(client, query=KONG, project="poimen", limit=5)
    vec = embedder.embed_query(KONG)
    ids = [
        r[0]
        for r in conn.execute(
            "SELECT node_id FROM memory.query(%s, %s, 'poimen', k => 5) ORDER BY rank",
            (KONG, vec),
        ).fetchall()
    ]
    rows = conn.execute(
        "SELECT sha256, cited_by FROM memory.evidence(%s, %s, %s, 'poimen') ORDER BY rank",
        (KONG, ids, vec),
    ).fetchall()
    assert rows and [(e["sha256"], e["cited_by"]) for e in body["evidence"]] == [
        (r[0], r[1]) for r in rows
    ]


def _tree_l0(parents: list[dict[str, Any]]) -> list[str]:
    out = []
    for p in parents:
        if p["level"] == "L0":
            out.append(p["sha256"])
        out.extend(_tree_l0(p["parents"]))
    return out


def test_response_cites_only_its_evidence(client: TestClient) -> None:
    full = query(client, query=KONG, project="poimen", evidence=0)
    assert full["evidence"] == [] and full["plan"]["evidence"]["budget"] == 0
    assert all("provenance_l0_omitted" not in r for r in full["results"])
    body = query(client, query=KONG, project="poimen", evidence=2)
    assert body["plan"]["evidence"] == {
        "budget": 2,
        "source": "argument",
        "direct_candidates": body["plan"]["evidence"]["direct_candidates"],
    }
    listed = [e["sha256"] for e in body["evidence"]]
    assert len(listed) == 2 and [e["rank"] for e in body["evidence"]] == [1, 2]
    assert all(e["level"] == "L0" for e in body["evidence"])
    cited: set[str] = set()
    for trimmed, whole in zip(body["results"], full["results"], strict=True):
        assert trimmed["sha256"] == whole["sha256"]  # evidence never reorders results
        kept, before = _tree_l0(trimmed["parents"]), _tree_l0(whole["parents"])
        assert set(kept) <= set(listed)
        assert trimmed["provenance_l0_omitted"] == len(before) - len(kept)
        cited |= set(kept)
    # The top result's own thread is what the two slots go to.
    assert cited == set(listed)


def test_default_budget_is_the_policy(client: TestClient, conn: Conn) -> None:
    body = query(client, query=KONG)
    assert body["plan"]["evidence"]["source"] == "policy"
    assert body["plan"]["evidence"]["budget"] == 20
    conn.execute("SELECT memory.set_policy('evidence_budget', '1')")
    try:
        body = query(client, query=KONG)
    finally:
        conn.execute("SELECT memory.reset_policy('evidence_budget')")
    assert body["plan"]["evidence"]["budget"] == 1 and len(body["evidence"]) == 1
    assert "evidence_time_ms" in body["metrics"]


def test_evidence_within_its_bounds_is_the_budget(client: TestClient) -> None:
    assert query(client, query=KONG, evidence="7")["plan"]["evidence"]["budget"] == 7


@pytest.mark.parametrize("raw", ["-5", "1000"])
def test_evidence_out_of_range_is_400_as_in_sql(client: TestClient, conn: Conn, raw: str) -> None:
    """Refused, not clamped, in the words memory.answer raises them (22023)."""
    r = client.get("/memory/query", params={"query": KONG, "evidence": raw})
    assert r.status_code == 400, r.text
    detail = f"evidence must be within 0..100, got {raw}"
    assert r.json()["detail"] == detail
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=detail):
        conn.execute("SELECT memory.answer(%s, evidence => %s)", (KONG, int(raw)))


def test_evidence_parameter_must_be_a_number(client: TestClient) -> None:
    r = client.get("/memory/query", params={"query": KONG, "evidence": "many"})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["error"] == "invalid_parameter"
    assert "evidence must be a whole number" in body["detail"]


def test_time_filter_keeps_direct_and_neighbour_turns_in_range(
    client: TestClient, conn: Conn, embedder: LocalEmbedder
) -> None:
    """since/until keep direct matches and neighbours in range, on both paths; a result's
    own sources are cited whatever their time (the result passed the filter)."""
    since, until = "2024-03-05", "2030-01-01"
    body = query(client, query=KONG, since=since, until=until, evidence=100, limit=5)
    assert body["evidence"]
    for e in body["evidence"]:
        if not e["cited_by"]:  # there only by a direct match or a neighbour
            assert e["timestamp"] is not None and e["timestamp"] >= since
    assert any(e["direct_rank"] is not None for e in body["evidence"])
    vec = embedder.embed_query(KONG)
    rows = conn.execute(
        "SELECT \"timestamp\", cited_by FROM memory.evidence(%s, '{}', %s, since => %s,"
        " until => %s, budget => 100)",
        (KONG, vec, since, until),
    ).fetchall()
    assert rows and all(ts is not None and ts.isoformat() >= since for ts, _ in rows)
    unfiltered = conn.execute(
        "SELECT count(*) FROM memory.evidence(%s, '{}', %s, budget => 100)", (KONG, vec)
    ).fetchone()
    assert unfiltered is not None and unfiltered[0] > len(rows)


def test_an_evidence_failure_degrades_and_keeps_the_trees(client: TestClient, conn: Conn) -> None:
    """The selection failing (here: its function gone) leaves a 200 with whole trees and an
    empty list, and says so under degraded; the answer itself is not lost."""
    whole = query(client, query=KONG, evidence=0)
    conn.execute(
        "ALTER FUNCTION memory.select_evidence(bigint[], jsonb, jsonb, text, integer, text,"
        " integer, timestamptz, timestamptz, double precision, integer, jsonb, timestamptz,"
        " bigint[], text, timestamptz)"
        " RENAME TO gone"
    )
    body = query(client, query=KONG)
    assert body["evidence"] == []
    assert {"stage": "evidence", "reason": body["plan"]["evidence"]["degraded"]} in body["degraded"]
    assert [r["parents"] for r in body["results"]] == [r["parents"] for r in whole["results"]]
    assert all("provenance_l0_omitted" not in r for r in body["results"])


def test_an_l0_hybrid_query_reuses_its_legs(client: TestClient) -> None:
    """Asked for L0 alone, Hybrid, at the evidence depth: the direct legs are the query's
    own, so the evidence runs no search of its own."""
    body = query(client, query=KONG, level="L0", strategy="Hybrid", limit=5, evidence=5)
    assert body["metrics"]["evidence_legs"] == 0 and len(body["evidence"]) == 5
    assert query(client, query=KONG, strategy="Hybrid")["metrics"]["evidence_legs"] == 2
    assert query(client, query=KONG, evidence=0)["metrics"]["evidence_legs"] == 0


# Issue 29: a small conversation of three sessions, for the coverage, session and hop keys.
SESSIONS = "cover"
TURNS: list[dict[str, Any]] = [
    {"id": "c:1:1", "title": "session 1", "text": "Ana: the garden has tomatoes and basil now."},
    {"id": "c:1:2", "title": "session 1", "text": "Ana: the tomatoes in the garden are ripe."},
    {"id": "c:1:3", "title": "session 1", "text": "Ana: I water the garden tomatoes every day."},
    {"id": "c:1:4", "title": "session 1", "text": "Ana: garden tomatoes again, the last ones."},
    {"id": "c:2:1", "title": "session 2", "text": "Ana: we started a garden at school."},
    {"id": "c:2:2", "title": "session 2", "text": "Ana: my cousin moved to Lisbon in spring."},
    {"id": "c:3:1", "title": "session 3", "text": "Ana: the trams of Lisbon are yellow and old."},
    {"id": "c:3:2", "title": "session 3", "text": "Ana: nothing to report about the weather."},
]  # fmt: skip


@pytest.fixture
def sessions(conn: Conn) -> Iterator[dict[str, int]]:
    nodes = [{"project": SESSIONS, "level": "L0", **t} for t in TURNS] + [
        {"project": SESSIONS, "level": "L1", "id": "c:m:1", "parents": ["c:1:1"],
         "text": "Ana grows tomatoes and basil in her garden."},
        {"project": SESSIONS, "level": "L1", "id": "c:m:2", "parents": ["c:3:2"],
         "text": "Ana had nothing to say about the weather."},
    ]  # fmt: skip
    conn.execute("SELECT memory.add_nodes(%s)", (Jsonb(nodes),))
    ids = dict(
        conn.execute(
            "SELECT n.external_id, n.id FROM memory.nodes n JOIN memory.projects p"
            " ON p.id = n.project_id WHERE p.name = %s",
            (SESSIONS,),
        ).fetchall()
    )
    conn.execute("SELECT memory.set_policy('evidence_neighbours', '0')")
    conn.execute("SELECT memory.set_policy('evidence_session_weight', '0')")
    yield ids
    conn.execute("SELECT memory.reset_policy()")


def _leg(ids: dict[str, int], scores: dict[str, float]) -> str:
    return json.dumps({"ids": [ids[k] for k in scores], "scores": list(scores.values())})


def _select(conn: Conn, results: list[int], leg: str, budget: int) -> list[tuple[int, float]]:
    rows = conn.execute(
        "SELECT node_id, score FROM memory.select_evidence(%s, %s, %s, budget => %s,"
        " project_name => %s) ORDER BY rank",
        (results, NO_LEG, leg, budget, SESSIONS),
    ).fetchall()
    return [(r[0], r[1]) for r in rows]


GARDEN = {"c:1:1": 10.0, "c:1:2": 9.0, "c:1:3": 8.0, "c:1:4": 7.0, "c:2:1": 6.0, "c:3:2": 1.0}


def test_session_decay_spreads_the_budget_over_sessions(
    conn: Conn, sessions: dict[str, int]
) -> None:
    """The plain top 3 are three turns of session 1; with evidence_session_decay 0.5 the
    n-th turn of a session competes at 0.5^(n-1) of its score, so session 2's best (scaled
    0.556 against session 1's second, 0.889 x 0.5) is in the three: the greedy oracle."""
    title = {sessions[t["id"]]: t["title"] for t in TURNS}
    leg = _leg(sessions, GARDEN)
    plain = _select(conn, [], leg, 3)
    assert [n for n, _ in plain] == [sessions[k] for k in ("c:1:1", "c:1:2", "c:1:3")]
    full = _select(conn, [], leg, 100)
    conn.execute("SELECT memory.set_policy('evidence_session_decay', '0.5')")
    spread = _select(conn, [], leg, 3)
    chosen: list[int] = []
    # the oracle: greedy, each turn at its score x 0.5^(turns of its session chosen before)
    while len(chosen) < 3:
        left = [(s * 0.5 ** sum(title[c] == title[n] for c in chosen), n) for n, s in full
                if n not in chosen]  # fmt: skip
        chosen.append(max(left)[1])
    assert [n for n, _ in spread] == chosen
    assert len({title[n] for n, _ in spread}) > len({title[n] for n, _ in plain}) == 1
    # the scores are the turns' own, and every candidate is still one: only the order of
    # spending the budget changed
    assert dict(spread).items() <= dict(full).items()
    assert sorted(_select(conn, [], leg, 100)) == sorted(full)


def test_session_weight_routes_to_the_sessions_results_cite(
    conn: Conn, sessions: dict[str, int]
) -> None:
    """A direct match in a session a result's provenance reaches gains
    evidence_session_weight x its direct score x 1/sqrt(the result's rank)."""
    results = [sessions["c:m:1"]]
    leg = _leg(sessions, {"c:1:2": 5.0, "c:2:1": 5.0, "c:3:2": 1.0})
    base = dict(_select(conn, results, leg, 100))
    conn.execute("SELECT memory.set_policy('evidence_session_weight', '0.5')")
    routed = dict(_select(conn, results, leg, 100))
    assert base[sessions["c:1:2"]] == pytest.approx(base[sessions["c:2:1"]])
    assert routed[sessions["c:1:2"]] == pytest.approx(1.5 * base[sessions["c:1:2"]])
    assert routed[sessions["c:2:1"]] == pytest.approx(base[sessions["c:2:1"]])
    # the cited turn itself is no direct match: it keeps its citation score
    assert routed[sessions["c:1:1"]] == pytest.approx(base[sessions["c:1:1"]])


def test_a_second_hop_follows_the_names_in_the_best_evidence(
    conn: Conn, sessions: dict[str, int]
) -> None:
    """With evidence_hop_weight the capitalised words inside the best turns' sentences
    (here "Lisbon") are a second lexical query: the turn of another session that shares the
    name and no word of the first leg becomes a candidate, scored the weight times its
    BM25 over the best."""
    leg = _leg(sessions, {"c:2:2": 3.0, "c:3:2": 1.0})
    base = dict(_select(conn, [], leg, 100))
    assert sessions["c:3:1"] not in base
    conn.execute("SELECT memory.set_policy('evidence_hop_weight', '0.5')")
    conn.execute("SELECT memory.set_policy('evidence_hop_seeds', '1')")
    hopped = dict(_select(conn, [], leg, 100))
    lisbon = dict(
        conn.execute(
            "SELECT node_id, lexical_score FROM memory.lexical_search('Lisbon', %s, '{L0}')",
            (SESSIONS,),
        ).fetchall()
    )
    assert set(lisbon) == {sessions["c:2:2"], sessions["c:3:1"]}
    best = max(lisbon.values())
    assert hopped[sessions["c:3:1"]] == pytest.approx(0.5 * lisbon[sessions["c:3:1"]] / best)
    assert hopped[sessions["c:2:2"]] == pytest.approx(
        base[sessions["c:2:2"]] + 0.5 * lisbon[sessions["c:2:2"]] / best
    )
    # "Ana" opens every sentence (the speaker) and is no name to follow
    assert set(hopped) == set(base) | {sessions["c:3:1"]}


def test_deeper_candidates_cite_at_the_ranks_after_the_results(
    conn: Conn, sessions: dict[str, int]
) -> None:
    """The fused candidates after the results (memory._deeper, evidence_deeper of them) cite
    their provenance at the ranks after the results', and reserve no turn."""
    m1, m2 = sessions["c:m:1"], sessions["c:m:2"]
    rows = conn.execute(
        "SELECT node_id, score, cited_by FROM memory.select_evidence(%s, %s, %s, budget => 100,"
        " project_name => %s, deeper => %s) ORDER BY rank",
        ([m1], NO_LEG, NO_LEG, SESSIONS, [m2]),
    ).fetchall()
    got = {r[0]: (r[1], r[2]) for r in rows}
    assert got == {
        sessions["c:1:1"]: (pytest.approx(0.5), [1]),
        sessions["c:3:2"]: (pytest.approx(0.5 / math.sqrt(2)), [2]),
    }
    # budget 1: the result's own turn is reserved, the deeper one waits
    one = conn.execute(
        "SELECT node_id FROM memory.select_evidence(%s, %s, %s, budget => 1, deeper => %s)",
        ([m1], NO_LEG, NO_LEG, [m2]),
    ).fetchall()
    assert one == [(sessions["c:1:1"],)]
    # memory._deeper: the legs fused again past the results, at most evidence_deeper
    plan = Jsonb({"search_strategy": "LexicalOnly", "fusion": "convex", "dense_weight": 0.4,
                  "rrf_k": 10})  # fmt: skip
    state = Jsonb({"lexical": {"ids": [m1, m2, sessions["c:1:2"]], "scores": [3.0, 2.0, 1.0]}})
    deeper = "SELECT memory._deeper(%s, %s, %s)"
    conn.execute("SELECT memory.set_policy('evidence_deeper', '1')")
    assert conn.execute(deeper, (plan, state, [m1])).fetchone() == ([m2],)
    conn.execute("SELECT memory.set_policy('evidence_deeper', '0')")
    assert conn.execute(deeper, (plan, state, [m1])).fetchone() == ([],)


def _fused_order(
    conn: Conn, sem: dict[str, Any], lex: dict[str, Any], strategy: str, cut: int
) -> list[int]:
    """The ids memory.fuse_legs gives (convex 0.4, k 10) cut at ``cut``, best first: the
    order memory._run_legs stores as fused_order."""
    row = conn.execute(
        "SELECT array_agg(f.node_id ORDER BY f.fused_score DESC, least(f.ranks[1], f.ranks[2]),"
        " f.node_id) FROM memory.fuse_legs(%s, %s, %s, 'convex', 0.4, 10, %s) f",
        (Jsonb(sem), Jsonb(lex), strategy, cut),
    ).fetchone()
    assert row is not None and row[0] is not None
    return list(row[0])


@pytest.mark.parametrize("cut", [10, 30, 1000])
@pytest.mark.parametrize("deep", [1, 20, 50])
def test_the_deeper_candidates_reuse_the_answers_fusion(conn: Conn, cut: int, deep: int) -> None:
    """memory._deeper reads the candidates after the results from the fusion
    memory._run_legs made (state fused_order, cut at fused_cut) when it went deep enough or
    held every candidate, and fuses the legs again otherwise: the same ids either way."""
    sem = {"ids": list(range(1, 61)), "scores": [1 - i / 100 for i in range(60)]}
    lex = {"ids": list(range(80, 20, -1)), "scores": [30 - i / 3 for i in range(60)]}
    plan = Jsonb({"search_strategy": "Hybrid", "fusion": "convex", "dense_weight": 0.4,
                  "rrf_k": 10})  # fmt: skip
    order = _fused_order(conn, sem, lex, "Hybrid", cut)
    whole = _fused_order(conn, sem, lex, "Hybrid", 1000)
    assert len(whole) == 80
    assert order == whole[:cut]
    results, withheld = whole[:5], whole[7:9]
    stored = {"fused_order": order, "fused_cut": cut, "withheld_ids": withheld}
    # Where the stored order serves (as deep as the results and deep, or every candidate),
    # the legs are left out of the state: only the stored order can answer.
    serves = len(order) >= 5 + deep or len(order) < cut
    legs = (
        {"semantic": NO_LEG_DOC, "lexical": NO_LEG_DOC}
        if serves
        else {"semantic": sem, "lexical": lex}
    )
    deeper = "SELECT memory._deeper(%s, %s, %s)"
    conn.execute("SELECT memory.set_policy('evidence_deeper', %s)", (str(deep),))
    try:
        again = conn.execute(
            deeper,
            (plan, Jsonb({"semantic": sem, "lexical": lex, "withheld_ids": withheld}), results),
        ).fetchone()
        reused = conn.execute(deeper, (plan, Jsonb({**stored, **legs}), results)).fetchone()
    finally:
        conn.execute("SELECT memory.reset_policy('evidence_deeper')")
    # the fused candidates after the results, within the first results + deep, none withheld
    expected = [i for i in whole[: 5 + deep] if i not in results + withheld][:deep]
    assert again == (expected,)
    assert reused == again


@pytest.mark.parametrize("cut", [10, 1000])
def test_a_cascade_fuses_its_deeper_candidates_again(conn: Conn, cut: int) -> None:
    """A LexicalFirst cascade drops the lexical ids its by-ids stage did not rank after the
    fusion's cut (memory.fuse_legs), so its stored order is no prefix of a deeper fusion:
    memory._deeper fuses again (found in review: the stored order gave other ids)."""
    lex = {"ids": list(range(1, 41)), "scores": [40 - i for i in range(40)]}
    # the by-ids stage ranks the lexical ids with a vector: 3 of them have none
    ranked = [i for i in range(1, 41) if i not in (4, 9, 13)]
    sem = {"ids": ranked, "scores": [0.9 - i / 100 for i in range(len(ranked))]}
    plan = Jsonb({"search_strategy": "LexicalFirst", "fusion": "convex", "dense_weight": 0.4,
                  "rrf_k": 10})  # fmt: skip
    order = _fused_order(conn, sem, lex, "LexicalFirst", cut)
    state = {"semantic": sem, "lexical": lex, "withheld_ids": []}
    results = order[:3]
    deeper = "SELECT memory._deeper(%s, %s, %s)"
    conn.execute("SELECT memory.set_policy('evidence_deeper', '20')")
    try:
        again = conn.execute(deeper, (plan, Jsonb(state), results)).fetchone()
        stored = {**state, "fused_order": order, "fused_cut": cut}
        reused = conn.execute(deeper, (plan, Jsonb(stored), results)).fetchone()
    finally:
        conn.execute("SELECT memory.reset_policy('evidence_deeper')")
    assert again is not None and len(again[0]) > 10
    assert reused == again


SPEAKERS = "speakers"


def test_speaker_weight_lifts_the_turns_of_the_person_the_question_names(conn: Conn) -> None:
    """With evidence_speaker_weight (0.5 by default; 0 turns it off) a turn whose text opens
    with a label the question has as a word ("Ana: ...", case aside) scores 1 + the weight
    times as much, when most of the
    evidence_speaker_seeds best candidates are that person's; another speaker's turn, a
    label inside a longer word, a person whose turns are not most of the best, or no
    question text change nothing."""
    turns = [
        {"id": "s:1", "text": "Ana: I grow tomatoes on the balcony."},
        {"id": "s:2", "text": "Ana: the basil grows there too."},
        {"id": "s:3", "text": "Ana: and some mint, in a pot."},
        {"id": "s:4", "text": "Bo: I grow basil on the balcony."},
        {"id": "s:5", "text": "Anabel: my balcony has tomatoes too."},
    ]
    conn.execute(
        "SELECT memory.add_nodes(%s)",
        (Jsonb([{"project": SPEAKERS, "level": "L0", "title": "day 1", **t} for t in turns]),),
    )
    ids = dict(
        conn.execute(
            "SELECT n.external_id, n.id FROM memory.nodes n JOIN memory.projects p"
            " ON p.id = n.project_id WHERE p.name = %s",
            (SPEAKERS,),
        ).fetchall()
    )
    ana = {ids["s:1"], ids["s:2"], ids["s:3"]}
    leg = json.dumps({"ids": [ids[t["id"]] for t in turns], "scores": [2.0] * len(turns)})
    sql = (
        "SELECT node_id, score FROM memory.select_evidence('{}', %s, %s, budget => 100,"
        " project_name => %s, query => %s)"
    )

    def select(text: str | None) -> dict[int, float]:
        return dict(conn.execute(sql, (NO_LEG, leg, SPEAKERS, text)).fetchall())

    try:
        conn.execute("SELECT memory.set_policy('evidence_neighbours', '0')")
        conn.execute("SELECT memory.set_policy('evidence_speaker_weight', '0')")
        plain = select("What does ana grow?")
        conn.execute("SELECT memory.set_policy('evidence_speaker_weight', '0.5')")
        named = select("What does ana grow?")
        other = select("What does Bo grow?")
        nobody = select("Who grows basil?")
        no_text = select(None)
        conn.execute("SELECT memory.set_policy('evidence_speaker_seeds', '2')")
        two = select("What does Bo grow?")  # the two best (by id on a tie) are Ana's
    finally:
        conn.execute("SELECT memory.reset_policy()")
    assert set(plain) == set(ids.values())
    assert all(v == pytest.approx(1.0) for v in plain.values())
    for node, score in named.items():
        assert score == pytest.approx(1.5 if node in ana else 1.0), node
    assert other == pytest.approx(plain) and two == pytest.approx(plain)
    assert nobody == pytest.approx(plain) and no_text == pytest.approx(plain)


@pytest.mark.usefixtures("no_neighbours")
def test_a_direct_match_out_of_range_counts_only_as_cited(conn: Conn) -> None:
    """With since, a direct match dated before it is no direct match: a result that cites it
    still brings it (direct_rank NULL, its citation alone scores it), and the direct ranks
    number the in-range matches alone, from 1 in the leg's order."""
    since = "2024-03-05"
    ids = _results(conn, KONG)
    lex, bm25 = _lexical_l0(conn, KONG)
    ts = dict(
        conn.execute(
            "SELECT id, ts FROM memory.nodes WHERE id = ANY (%s)", (list(bm25),)
        ).fetchall()
    )
    inside = [
        n for n in sorted(bm25, key=lambda n: -bm25[n]) if ts[n] and ts[n].isoformat() >= since
    ]
    below = _l0_below(conn, ids)
    rows = conn.execute(
        "SELECT node_id, score, direct_rank, cited_by FROM memory.select_evidence(%s, %s, %s,"
        " budget => 100, project_name => 'poimen', since => %s) ORDER BY rank",
        (ids, NO_LEG, lex, since),
    ).fetchall()
    got = {r[0]: r for r in rows}
    outside_cited = [n for n in bm25 if n not in inside and n in below]
    assert inside and outside_cited  # the fixture has both kinds, or this tests nothing
    for n in outside_cited:
        assert got[n][2] is None
        assert got[n][1] == pytest.approx(sum(0.5 / math.sqrt(r) for r in below[n]))
    ranked = {r[0]: r[2] for r in rows if r[2] is not None}
    assert set(ranked) <= set(inside)
    assert sorted(ranked.values()) == [
        inside.index(n) + 1 for n in sorted(ranked, key=inside.index)
    ]
    assert 1 in ranked.values()
