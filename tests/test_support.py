"""Memory that keeps itself true (issue 40): derived memories rest on the versions they were
derived from, their support is transitive and evaluated in time, answers demote (or leave
out) what a change put in doubt, and the review queue lists it for workers, against real
PostgreSQL."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import psycopg
import pytest

from poimen_core.vocabulary import SQLSTATES
from poimen_memory.db.connect import connect
from test_lifecycle import Conn, P, _node, _write
from test_provenance_caps import reach_is_the_walks_pairs


def _coffee(conn: Conn) -> None:
    _write(conn, [
        _node("t:coffee", "Mara: I take my coffee black, always."),
        _node("t:office", "Mara: the office has an espresso machine."),
        _node("m:coffee", "Mara takes her coffee black", "L1", parents=["t:coffee"]),
        _node("m:office", "The office has an espresso machine", "L1", parents=["t:office"]),
        # the profile the update will put in doubt, and a weaker competitor that stays true
        _node("s:profile", "Mara profile: a black coffee drinker, coffee coffee black",
              "L2", parents=["m:coffee"]),
        _node("s:office", "Office profile: coffee from the espresso machine", "L2",
              parents=["m:office"]),
    ])  # fmt: skip


def _answer(conn: Conn, query: str, **kw: Any) -> dict[str, Any]:
    row = conn.execute(
        "SELECT memory.answer(%(q)s, project => %(p)s, levels => ARRAY['L2'], "
        "strategy => 'LexicalOnly', k => 5, as_of => %(as_of)s, unsupported => %(u)s)",
        {"q": query, "p": P, "as_of": kw.get("as_of"), "u": kw.get("unsupported")},
    ).fetchone()
    assert row is not None
    out: dict[str, Any] = row[0]
    return out


def _queue(conn: Conn) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT external_id, reason, changes FROM memory.review_list(%s) ORDER BY item_id", (P,)
    ).fetchall()


def _support_of(conn: Conn, external_id: str) -> str | None:
    row = conn.execute(
        "SELECT s.support FROM memory.nodes n, memory.support(ARRAY[n.id]) s "
        "WHERE n.external_id = %s AND n.project_id = memory.project_id(%s) "
        "AND n.expired_at IS NULL", (external_id, P)
    ).fetchone()  # fmt: skip
    assert row is not None
    return None if row[0] is None else str(row[0])


def test_the_coffee_scenario(conn: Conn) -> None:
    _coffee(conn)
    before = _answer(conn, "coffee black drinker")
    assert [r["external_id"] for r in before["results"]] == ["s:profile", "s:office"]
    assert [r["support"] for r in before["results"]] == ["full", "full"]
    assert _queue(conn) == []
    t_before = conn.execute("SELECT now()").fetchone()
    conn.commit() if not conn.autocommit else None
    # the memory changes: revision 2 of the L1
    _write(conn, [_node("m:coffee", "Mara now drinks her coffee with oat milk", "L1",
                        parents=["t:coffee"], revision=1)])  # fmt: skip
    after = _answer(conn, "coffee black drinker")
    profile = next(r for r in after["results"] if r["external_id"] == "s:profile")
    assert profile["support"] == "stale"
    assert profile["changed_parents"] == [
        {"external_id": "m:coffee", "revision": 1, "current_revision": 2, "state": "superseded"}
    ]
    # it cites the version it rested on, marked
    (cited,) = profile["provenance"]
    assert cited["text"] == "Mara takes her coffee black" and cited["superseded"] is True
    assert (cited["revision"], cited["current_revision"]) == (1, 2)
    # it ranks below the supported competitor with the lower score, and the answer says so
    assert [r["external_id"] for r in after["results"]] == ["s:office", "s:profile"]
    assert after["results"][1]["final_score"] > after["results"][0]["final_score"]
    assert after["counts"]["demoted"] == 1 and after["plan"]["unsupported"]["policy"] == "demote"
    # per request: keep the fused order, or leave it out
    kept = _answer(conn, "coffee black drinker", unsupported="keep")
    assert [r["external_id"] for r in kept["results"]] == ["s:profile", "s:office"]
    assert kept["counts"]["demoted"] == 0
    excluded = _answer(conn, "coffee black drinker", unsupported="exclude")
    assert [r["external_id"] for r in excluded["results"]] == ["s:office"]
    assert excluded["counts"]["excluded"] == 1
    # in the review queue, with the change named
    (item,) = _queue(conn)
    assert item[:2] == ("s:profile", "evidence_changed")
    assert item[2][0]["external_id"] == "m:coffee" and item[2][0]["state"] == "superseded"
    # as of a time before the update it was fully supported
    assert t_before is not None
    old = _answer(conn, "coffee black drinker", as_of=t_before[0])
    assert [(r["external_id"], r["support"]) for r in old["results"]] == [
        ("s:profile", "full"),
        ("s:office", "full"),
    ]
    # completing the review with a new version makes it full and takes it off the queue
    _write(conn, [_node("s:profile", "Mara profile: a coffee drinker, with oat milk", "L2",
                        parents=["m:coffee"])])  # fmt: skip
    assert _support_of(conn, "s:profile") == "full"
    assert _queue(conn) == []
    outcome = conn.execute(
        "SELECT outcome, completed_by FROM memory.review_queue q WHERE external_id = 's:profile'"
    ).fetchall()
    assert outcome == [("rewritten", "role:postgres")]


def test_forgetting_evidence_takes_support_two_levels_up(conn: Conn) -> None:
    _coffee(conn)
    conn.execute("SELECT memory.forget(%s, 't:coffee')", (P,))
    assert _support_of(conn, "m:coffee") == "none"
    assert _support_of(conn, "s:profile") == "none"  # its only parent has no support left
    assert _support_of(conn, "s:office") == "full"
    reasons = {r[0]: r[1] for r in _queue(conn)}
    assert reasons == {"m:coffee": "evidence_gone", "s:profile": "evidence_stale"}
    # a synthesis over two memories, one of which lost its evidence: partial
    _write(conn, [_node("s:both", "Mara and the office: coffee", "L2",
                        parents=["m:coffee", "m:office"])])  # fmt: skip
    assert _support_of(conn, "s:both") == "partial"
    # as of before the forget, everything held
    row = conn.execute(
        "SELECT s.support FROM memory.nodes n, memory._support_at(ARRAY[n.id], "
        "(SELECT created_at FROM memory.nodes WHERE external_id = 's:profile')) s "
        "WHERE n.external_id = 's:profile'"
    ).fetchone()
    assert row == ("full",)


def _calls(conn: Conn, sql: str, params: Any) -> tuple[int, int, Any]:
    """Calls of memory._support_at and memory._rested_parents (its recursion included) made
    by one statement, and its value. The session's function statistics not yet flushed,
    before and after (PostgreSQL 15's pg_stat_xact_user_functions holds the earlier
    transactions' too until they are flushed)."""
    counts = (
        "SELECT funcname, calls FROM pg_stat_xact_user_functions "
        "WHERE schemaname = 'memory' AND funcname IN ('_support_at', '_rested_parents')"
    )
    with conn.transaction():
        conn.execute("SET LOCAL track_functions = 'all'")
        before = dict(conn.execute(counts).fetchall())
        row = conn.execute(sql, params).fetchone()
        assert row is not None
        after = dict(conn.execute(counts).fetchall())
    made = {f: after.get(f, 0) - before.get(f, 0) for f in ("_support_at", "_rested_parents")}
    return made["_support_at"], made["_rested_parents"], row[0]


def test_an_answer_computes_support_once(conn: Conn) -> None:
    """Issue 42: the demotion of results in doubt and their rows share one computation of
    support (memory._finish hands it to memory._hydrate), and it is still each node's."""
    _coffee(conn)
    _write(conn, [_node("m:coffee", "Mara now drinks her coffee with oat milk", "L1",
                        parents=["t:coffee"], revision=1)])  # fmt: skip
    sql = ("SELECT memory.answer('coffee black drinker', project => %s, levels => ARRAY['L2'], "
           "strategy => 'LexicalOnly', k => 5, unsupported => %s)")  # fmt: skip
    # one computation for both results: memory._rested_parents of the L2 nodes, then of the
    # L1 parents they rest on (the recursion through derived parents), one call each
    both = ("(SELECT array_agg(n.id) FROM memory.nodes n WHERE n.level = 'L2'"
            " AND n.project_id = memory.project_id(%s) AND n.expired_at IS NULL)")  # fmt: skip
    once = _calls(conn, f"SELECT count(*) FROM memory._support_at({both})", (P,))
    assert once == (2, 2, 2)
    expected = {
        "demote": ["s:office", "s:profile"],
        "exclude": ["s:office"],
        "keep": ["s:profile", "s:office"],
    }
    for policy, order in expected.items():
        support_at, rested, doc = _calls(conn, sql, (P, policy))
        assert (support_at, rested) == once[:2], policy
        assert [r["external_id"] for r in doc["results"]] == order
        assert doc["counts"]["demoted"] == (1 if policy == "demote" else 0)
        assert doc["counts"]["excluded"] == (1 if policy == "exclude" else 0)
        by_id = {r["external_id"]: r for r in doc["results"]}
        assert by_id["s:office"]["support"] == "full"
        assert by_id["s:office"]["changed_parents"] is None
        if "s:profile" in by_id:
            assert by_id["s:profile"]["support"] == "stale"
            assert by_id["s:profile"]["changed_parents"] == [
                {"external_id": "m:coffee", "revision": 1, "current_revision": 2,
                 "state": "superseded"}
            ]  # fmt: skip
        # memory.hydrate, which computes support itself, says the same of each row
        rows = conn.execute(
            "SELECT external_id, support, changed_parents"
            " FROM memory.hydrate(%s, project_name => %s)",
            ([r["node_id"] for r in doc["results"]], P),
        ).fetchall()
        assert [(r[0], r[1], r[2]) for r in rows] == [
            (r["external_id"], r["support"], r["changed_parents"]) for r in doc["results"]
        ]


def test_a_metadata_only_version_of_evidence_keeps_its_children_supported(conn: Conn) -> None:
    _coffee(conn)
    # the same text under a new source is new content; a relink happens only for equal content
    _write(conn, [_node("t:coffee", "Mara: I take my coffee black, always.", source="chat/9")])
    assert _support_of(conn, "m:coffee") == "stale"
    # confirming the claim against the current evidence: full again, the item done, and the
    # profile above, in doubt only because of it, holds again too
    items = {r[0]: r[1] for r in conn.execute(
        "SELECT external_id, item_id FROM memory.review_list(%s)", (P,)).fetchall()}  # fmt: skip
    assert set(items) == {"m:coffee", "s:profile"}
    with pytest.raises(psycopg.Error) as exc:  # the profile's parent is itself in doubt
        conn.execute("SELECT memory.review_confirm(%s)", (items["s:profile"],))
    assert exc.value.sqlstate == SQLSTATES["review_conflict"]
    assert "Review the parent first" in (exc.value.diag.message_hint or "")
    out = conn.execute(
        "SELECT memory.review_confirm(%s, 'still black')", (items["m:coffee"],)
    ).fetchone()
    assert out is not None
    assert out[0]["support"] == "full" and out[0]["relinked"] == 1
    assert out[0]["resolved"] == [items["s:profile"]]
    assert _support_of(conn, "m:coffee") == "full" and _support_of(conn, "s:profile") == "full"
    assert _queue(conn) == []
    done = conn.execute(
        "SELECT external_id, outcome, note FROM memory.review_queue ORDER BY id"
    ).fetchall()
    assert done[0] == ("m:coffee", "confirmed", "still black")
    with pytest.raises(psycopg.Error) as exc:
        conn.execute("SELECT memory.review_confirm(%s)", (items["m:coffee"],))
    assert exc.value.sqlstate == SQLSTATES["unknown_review_item"]


def _many_stale(conn: Conn, n: int) -> None:
    _write(
        conn,
        [_node(f"t:{i}", f"turn number {i}") for i in range(n)]
        + [_node(f"m:{i}", f"memory number {i}", "L1", parents=[f"t:{i}"]) for i in range(n)],
    )
    _write(conn, [_node(f"t:{i}", f"turn number {i}, corrected") for i in range(n)], seed=50)
    conn.commit() if not conn.autocommit else None


def test_concurrent_workers_claim_disjoint_items_and_a_dead_one_loses_nothing(
    fixture_url: str,
) -> None:
    with connect(fixture_url, autocommit=True) as c:
        _many_stale(c, 40)
        assert c.execute("SELECT count(*) FROM memory.review_list(%s, 100)", (P,)).fetchone() == (
            40,
        )
    workers = 8
    barrier = threading.Barrier(workers)
    claimed: list[list[int]] = []
    lock = threading.Lock()

    def work() -> None:
        with connect(fixture_url, autocommit=True) as c:
            barrier.wait()
            got: list[int] = []
            for _ in range(5):
                rows = c.execute(
                    "SELECT item_id FROM memory.review_claim(%s, 2, 60)", (P,)
                ).fetchall()
                got += [r[0] for r in rows]
            with lock:
                claimed.append(got)

    threads = [threading.Thread(target=work) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [i for got in claimed for i in got]
    assert len(every) == len(set(every)) == 40  # each item once, none lost
    with connect(fixture_url, autocommit=True) as c:
        # all are claimed now: a ninth worker gets nothing until a timeout passes
        assert c.execute("SELECT * FROM memory.review_claim(%s, 10, 60)", (P,)).fetchall() == []
        # a worker dies mid-item: it claimed, its session ends, it never completes
        c.execute("UPDATE memory.review_queue SET vt = now() WHERE id = %s", (every[0],))
    dead = psycopg.connect(fixture_url, autocommit=True)
    (item,) = dead.execute("SELECT item_id FROM memory.review_claim(%s, 1, 1)", (P,)).fetchone()
    assert item == every[0]
    with connect(fixture_url, autocommit=True) as c:
        c.execute("SELECT pg_terminate_backend(%s)", (dead.info.backend_pid,))
        assert c.execute("SELECT * FROM memory.review_claim(%s, 1, 60)", (P,)).fetchall() == []
        time.sleep(1.2)  # the visibility timeout passes: the item comes back
        back = c.execute(
            "SELECT item_id, claims, text, parents FROM memory.review_claim(%s, 1, 60)", (P,)
        ).fetchall()
        assert [(r[0], r[1]) for r in back] == [(item, 3)]  # claimed thrice: 8 workers, dead, now
        # what a worker needs: the memory and the turn then and now
        (parent,) = back[0][3]
        assert parent["state"] == "superseded" and parent["current_text"].endswith("corrected")
        assert back[0][2].startswith("memory number")
    with pytest.raises(psycopg.Error):
        dead.execute("SELECT 1")


def test_review_arguments_are_checked(conn: Conn) -> None:
    _coffee(conn)
    for sql in (
        "SELECT * FROM memory.review_claim(%s, 0)",
        "SELECT * FROM memory.review_claim(%s, 101)",
        "SELECT * FROM memory.review_claim(%s, 1, 0)",
        "SELECT * FROM memory.review_list(%s, 0)",
    ):
        with pytest.raises(psycopg.Error) as exc:
            conn.execute(sql, (P,))
        assert exc.value.sqlstate == "22023"
        conn.rollback() if not conn.autocommit else None
    with pytest.raises(psycopg.Error) as exc:
        conn.execute("SELECT * FROM memory.review_list('no-such-project')")
    assert exc.value.sqlstate == SQLSTATES["unknown_project"]
    with pytest.raises(psycopg.Error) as exc:
        conn.execute("SELECT memory.answer('x', unsupported => 'hide')")
    assert (
        exc.value.sqlstate == "22023"
        and "unsupported must be one of demote, exclude, keep" in str(exc.value)
    )


def test_the_evidence_list_cites_the_superseded_version_marked(conn: Conn) -> None:
    _coffee(conn)
    _write(conn, [_node("t:coffee", "Mara: these days I take oat milk in my coffee.")])
    row = conn.execute(
        "SELECT memory.answer('coffee black espresso', project => %s, levels => ARRAY['L1'], "
        "strategy => 'LexicalOnly', k => 3, evidence => 10)", (P,)
    ).fetchone()  # fmt: skip
    assert row is not None
    ev = {e["text"]: e for e in row[0]["evidence"]}
    old = ev["Mara: I take my coffee black, always."]
    assert old["superseded"] is True and old["revision"] == 1
    assert all(e["superseded"] is False for t, e in ev.items() if t != old["text"])
    results = {r["external_id"]: r for r in row[0]["results"]}
    assert results["m:coffee"]["support"] == "stale"
    assert json.dumps(results["m:office"]["changed_parents"]) == "null"


def _item_of(conn: Conn, external_id: str) -> int:
    row = conn.execute(
        "SELECT item_id FROM memory.review_list(%s) WHERE external_id = %s", (P, external_id)
    ).fetchone()
    assert row is not None
    return int(row[0])


def _after_the_writer(writer: Any, work: Any, out: list[Any]) -> None:
    """Run ``work`` in a thread while ``writer`` holds its transaction open: it must wait
    for the writer's lock, then finish once the writer commits."""
    worker = threading.Thread(target=work)
    worker.start()
    time.sleep(0.5)
    assert worker.is_alive() and out == []  # waiting for the writer's lock
    writer.commit()
    writer.close()
    worker.join(30)
    assert out, "the worker never finished"


def test_a_confirm_racing_a_writer_rests_on_what_the_writer_wrote(fixture_url: str) -> None:
    """The writer supersedes the parent while a worker confirms the child: the confirm waits
    for it and rests the child on the version the writer made, never on the one it ended."""
    with connect(fixture_url, autocommit=True) as c:
        _coffee(c)
        _write(c, [_node("m:coffee", "Mara takes oat milk in her coffee", "L1",
                         parents=["t:coffee"])], seed=10)  # fmt: skip
        item = _item_of(c, "s:profile")
    writer = psycopg.connect(fixture_url)  # a transaction held open
    _write(writer, [_node("m:coffee", "Mara takes soy milk in her coffee", "L1",
                          parents=["t:coffee"])], seed=20)  # fmt: skip
    out: list[Any] = []

    def confirm() -> None:
        with connect(fixture_url, autocommit=True) as c:
            out.append(c.execute("SELECT memory.review_confirm(%s)", (item,)).fetchone())

    _after_the_writer(writer, confirm, out)
    assert out[0][0]["support"] == "full"
    with connect(fixture_url, autocommit=True) as c:
        (cited,) = c.execute(
            "SELECT r.revision, r.state FROM memory.nodes n, memory._rested_parents(ARRAY[n.id]) r "
            "WHERE n.external_id = 's:profile' AND n.expired_at IS NULL"
        ).fetchall()
        assert cited == (3, "current")
        assert _support_of(c, "s:profile") == "full" and _queue(c) == []


def test_support_in_time_expiry_and_what_a_rewritten_parent_hides(conn: Conn) -> None:
    _coffee(conn)
    _write(conn, [_node("m:coffee", "Mara takes oat milk in her coffee", "L1",
                        parents=["t:coffee"])], seed=10)  # fmt: skip
    (between,) = conn.execute("SELECT clock_timestamp()").fetchone() or (None,)
    conn.execute("SELECT memory.review_confirm(%s)", (_item_of(conn, "s:profile"),))
    assert _support_of(conn, "s:profile") == "full"
    # as of before the confirmation the profile was stale: the edge it made is not the past's
    row = conn.execute(
        "SELECT s.support FROM memory.nodes n, memory._support_at(ARRAY[n.id], %s) s "
        "WHERE n.external_id = 's:profile' AND n.expired_at IS NULL", (between,)
    ).fetchone()  # fmt: skip
    assert row == ("stale",)
    # the sources the evidence cites, then and now: the walk's, the rewritten version too
    ids = [r[0] for r in conn.execute("SELECT id FROM memory.nodes ORDER BY id").fetchall()]
    assert reach_is_the_walks_pairs(conn, ids, between) > 0
    assert reach_is_the_walks_pairs(conn, ids) > 0
    # an answer as of now says what an answer without as_of says, for a claim derived from a
    # fact whose valid time has ended too (support tests valid time only at a valid_at given)
    _write(conn, [
        _node("t:cafe", "Mara: I drank my coffee black at the old cafe.",
              valid_to="2020-01-01T00:00:00Z"),
        _node("m:cafe", "Mara drank black coffee at the old cafe", "L1", parents=["t:cafe"]),
        _node("s:cafe", "Cafe profile: a black coffee drinker, coffee black", "L2",
              parents=["m:cafe"]),
    ], seed=40)  # fmt: skip
    now = _answer(conn, "coffee black drinker")
    assert ("s:cafe", "full") in [(r["external_id"], r["support"]) for r in now["results"]]
    (at,) = conn.execute("SELECT clock_timestamp()").fetchone() or (None,)
    assert [r["support"] for r in _answer(conn, "coffee black drinker", as_of=at)["results"]] == [
        r["support"] for r in now["results"]
    ]
    # an expired turn supports nothing, before any maintenance retires it
    conn.execute(
        "UPDATE memory.nodes SET expires_at = now() - interval '1 minute' "
        "WHERE external_id = 't:office' AND expired_at IS NULL"
    )
    assert _support_of(conn, "m:office") == "none"
    # a rewritten parent whose own evidence went: gone for the node resting on it too
    _write(conn, [_node("m:office", "The office has a new espresso machine", "L1",
                        parents=["t:office"])], seed=30)  # fmt: skip
    assert _support_of(conn, "s:office") == "none"


def test_an_erase_racing_a_writer_erases_the_version_the_writer_made(fixture_url: str) -> None:
    """A privacy erase that waits for a writer of the same node blanks the version that
    writer made too: nothing of the node is left current or readable."""
    with connect(fixture_url, autocommit=True) as c:
        _write(c, [_node("pii:race", "Zed's phone number is 555-0100")])
    writer = psycopg.connect(fixture_url)  # a transaction held open
    _write(writer, [_node("pii:race", "Zed's phone number is 555-0199")], seed=5)
    out: list[Any] = []

    def erase() -> None:
        with connect(fixture_url, autocommit=True) as c:
            out.append(c.execute(
                "SELECT memory.forget(%s, 'pii:race', erase => true)", (P,)
            ).fetchone())  # fmt: skip

    _after_the_writer(writer, erase, out)
    assert out[0][0]["erased"] == 2
    with connect(fixture_url, autocommit=True) as c:
        rows = c.execute(
            "SELECT revision, current, text, end_reason FROM memory.history(%s, 'pii:race')",
            (P,),
        ).fetchall()
        assert rows == [(1, False, None, "superseded"), (2, False, None, "erased")]
        assert c.execute(
            "SELECT count(*) FROM memory.nodes WHERE text LIKE '%%555-01%%'"
        ).fetchone() == (0,)
