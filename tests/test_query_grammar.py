"""The query grammar (sql/018_grammar.sql) and metadata filters in every engine: Postgres
BM25 and the vector legs through memory_query(), GET /memory/query, and the OpenSearch
request body against the REST double."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb
from starlette.testclient import TestClient

from doubles.opensearch_server import OpenSearchServer, run_opensearch_server
from poimen_core.vocabulary import E5_MODEL, LOCAL_MODEL, MODEL_FLOORS
from poimen_memory.embedders.local import LocalEmbedder
from poimen_memory.ingest.outbox import reindex
from poimen_memory.upstreams.opensearch import OpenSearchEngine, search_body
from service_client import query, serve

Conn = psycopg.Connection[Any]

# Nodes whose words differ only in order, stem or exact token (project "grammar").
NODES = [
    ("g1", "the request buffer body was too large"),
    ("g2", "the body buffer filled up on the gateway"),
    ("g3", "buffer sizes and a body limit, nowhere near each other"),
    ("g4", "networking broke after the switch upgrade #networking"),
    ("g5", "the network was slow for the whole network team"),
    ("g6", "@devops rotated the network certificates"),
    ("g7", "the gateway network buffer had a bug"),
]


def add_grammar_nodes(conn: Conn, embedder: LocalEmbedder, extra: int = 0) -> None:
    """The nodes above (and extra notes with metadata) in project "grammar", embedded by
    memory.add_nodes in the database (the embedder fixture loads the model it uses)."""
    del embedder
    nodes = [{"id": e, "level": "L1", "project": "grammar", "text": t} for e, t in NODES] + [
        {
            "id": f"f{i}",
            "level": "L1",
            "project": "grammar",
            "text": f"gateway buffer note number {i}",
            "metadata": {"user": "alice" if i % 3 == 0 else "bob", "n": i},
        }
        for i in range(extra)
    ]
    conn.execute("SELECT memory.add_nodes(%s)", (Jsonb(nodes),))


def texts(conn: Conn, q: str, **kw: Any) -> list[str]:
    args = ", ".join(f"{k} => %({k})s" for k in kw)
    sql = "SELECT text FROM memory_query(%(q)s" + (", " + args if args else "") + ")"
    return [r[0] for r in conn.execute(sql, {"q": q, **kw}).fetchall()]


def lexical(conn: Conn, q: str, project: str = "grammar", k: int = 10) -> list[str]:
    return [
        r[0]
        for r in conn.execute(
            "SELECT n.text FROM memory.lexical_search(%s, %s, NULL, %s) l "
            "JOIN memory.nodes n ON n.id = l.node_id ORDER BY l.rank",
            (q, project, k),
        ).fetchall()
    ]


def parse(conn: Conn, q: str) -> dict[str, Any]:
    row = conn.execute("SELECT memory.parse_query(%s)", (q,)).fetchone()
    assert row is not None
    return dict(row[0])


# --- the parser ----------------------------------------------------------------------------


def test_parse_plain_words_report_no_operators(conn: Conn) -> None:
    g = parse(conn, "kong body buffer in 2024")
    assert g["operators"] is False and g["text"] == "kong body buffer in 2024"
    assert g["required"] == [] and g["exclude"] == []


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT memory.parse_query(repeat('#t ', 5000))",
        "SELECT count(*) FROM memory.lexical_search(repeat('#t ', 5000), 'poimen')",
    ],
)
def test_an_over_long_query_is_refused_before_it_is_parsed(conn: Conn, sql: str) -> None:
    """As a reader calls them: 15 kB of tags was parsed whole first (18.7 s; 60 kB, 210 s),
    and only then refused, if at all (a helper's attack)."""
    with pytest.raises(psycopg.errors.InvalidParameterValue) as exc:
        conn.execute(sql)
    assert str(exc.value).startswith("query is longer than 2000 characters")
    assert exc.value.diag.message_detail == "It has 15000 characters."


def test_parse_every_operator(conn: Conn) -> None:
    g = parse(conn, 'kong -nginx -"body buffer" +"Buffer  Body" #Networking OR @dev.ops')
    assert g["operators"] is True
    assert g["text"] == "kong buffer body networking dev.ops"
    assert [e["kind"] for e in g["exclude"]] == ["term", "phrase"]
    assert [[i["kind"] for i in grp] for grp in g["required"]] == [["phrase"], ["tag", "mention"]]
    assert g["required"][0][0]["value"] == "buffer body" and g["or"] == 1
    assert g["boost"] == [] and "routing_text" not in g


@pytest.mark.parametrize(
    ("raw", "strict"),
    [
        # a question around the phrase: soft (it raises, never filters)
        ('when did melanie read "nothing is impossible"', False),
        ('what is "little women" about', False),  # stop words are words too
        ('kong "body buffer"', False),
        # +"...": strict wherever it is
        ('when did melanie read +"nothing is impossible"', True),
        # a query made only of operators: nothing but the phrase was asked for
        ('"body buffer"', True),
        ('"body buffer" #gateway -nginx', True),
        ('"body buffer" ?', True),  # punctuation is not a word
    ],
)
def test_a_phrase_is_soft_in_a_question_and_strict_on_its_own(
    conn: Conn, raw: str, strict: bool
) -> None:
    g = parse(conn, raw)
    phrases = [i for grp in g["required"] for i in grp if i["kind"] == "phrase"]
    assert (len(phrases), len(g["boost"])) == ((1, 0) if strict else (0, 1)), g
    # a soft phrase is routed as its words: the optimizer reads routing_text
    assert ("routing_text" in g) is not strict
    if not strict:
        assert '"' not in g["routing_text"] and g["boost"][0]["kind"] == "phrase"
    # its words are scored either way
    value = (phrases or g["boost"])[0]["value"]
    assert value in g["text"].lower()


def test_plus_only_marks_a_phrase(conn: Conn) -> None:
    # "+" before anything but a quote stays part of the word, as before the grammar had it
    g = parse(conn, 'c++ +5 "kong gateway" upload')
    assert g["text"] == "c++ +5 kong gateway upload" and g["required"] == []
    assert [b["value"] for b in g["boost"]] == ["kong gateway"]


@pytest.mark.parametrize(
    ("raw", "text", "note"),
    [
        ('"unclosed buffer body', "unclosed buffer body", "unmatched quote"),
        ('kong "" nginx', "kong nginx", "empty phrase"),
        ("OR kong", "kong", "nothing before"),
        ("kong OR", "kong", "nothing after"),
        ("-5 -- - kong", "-5 -- - kong", None),
    ],
)
def test_malformed_syntax_degrades_to_plain_words(
    conn: Conn, raw: str, text: str, note: str | None
) -> None:
    g = parse(conn, raw)
    assert g["text"] == text and g["required"] == [] and g["exclude"] == []
    assert note is None or any(note in n for n in g["notes"])
    # and it answers, never an error
    conn.execute("SELECT * FROM memory_query(%s, levels => '{L0,L1,L2}')", (raw,)).fetchall()


# --- Postgres: BM25 and the whole pipeline ---------------------------------------------------


def test_exclusion_on_the_demo_data(conn: Conn) -> None:
    # The report: "kong -nginx" at L0 returned exactly the nginx turns.
    assert texts(conn, "kong -nginx", project="poimen", levels=["L0"]) == []
    rows = texts(conn, "kong -nginx", project="poimen", levels=["L0", "L1", "L2"], k=10)
    assert rows and not any("nginx" in t.lower() for t in rows)
    assert any("nginx" in t.lower() for t in texts(conn, "kong", project="poimen", levels=["L0"]))


def test_an_excluded_term_never_appears_in_any_leg(conn: Conn, embedder: LocalEmbedder) -> None:
    add_grammar_nodes(conn, embedder)
    for strategy in ("LexicalOnly", "Hybrid", "SemanticOnly", "LexicalFirst"):
        rows = texts(
            conn, "gateway buffer body network -network", project="grammar", strategy=strategy
        )
        assert not any(re.search(r"\bnetwork", t) for t in rows), (strategy, rows)
        rows = texts(conn, 'gateway buffer -"body buffer"', project="grammar", strategy=strategy)
        assert not any("body buffer" in t for t in rows), (strategy, rows)


def test_phrase_order_matters(conn: Conn, embedder: LocalEmbedder) -> None:
    add_grammar_nodes(conn, embedder)
    assert lexical(conn, '"buffer body"') == ["the request buffer body was too large"]
    assert lexical(conn, '"body buffer"') == ["the body buffer filled up on the gateway"]
    assert len(lexical(conn, "buffer body")) >= 3  # bag of words without quotes
    for strategy in ("Hybrid", "SemanticOnly", "LexicalOnly"):
        rows = texts(conn, 'what filled +"body buffer"', project="grammar", strategy=strategy)
        assert rows == ["the body buffer filled up on the gateway"], strategy


def test_a_strict_phrase_filters_and_a_soft_one_raises(conn: Conn, embedder: LocalEmbedder) -> None:
    """The same question with +"..." and with "...": the strict phrase keeps only the node
    holding the words in that order; the soft one answers as the question without quotes
    would, with that node first, and never empties the answer."""
    add_grammar_nodes(conn, embedder)
    g2 = NODES[1][1]  # "the body buffer filled up on the gateway"
    for strategy in ("Hybrid", "SemanticOnly", "LexicalOnly", "LexicalFirst", None):
        kw: dict[str, Any] = {"project": "grammar", "k": 10, "min_cosine": -1}
        if strategy:
            kw["strategy"] = strategy
        strict = texts(conn, 'which buffer was too large +"body buffer"', **kw)
        assert strict == [g2], strategy
        plain = texts(conn, "which buffer was too large body buffer", **kw)
        soft = texts(conn, 'which buffer was too large "body buffer"', **kw)
        # without quotes the words rank another node first ("buffer body was too large")
        assert plain[0] != g2 and g2 in plain, strategy
        assert soft[0] == g2, strategy  # the phrase raised what contains it
        assert sorted(soft) == sorted(plain), strategy  # and took nothing away
    # a phrase no node holds filters everything strict, nothing soft
    assert texts(conn, 'gateway buffer +"buffer gateway"', project="grammar") == []
    assert texts(conn, 'gateway buffer "buffer gateway"', project="grammar", min_cosine=-1)
    # what the soft phrase raised is in the plan
    row = conn.execute(
        "SELECT memory.plan_query('which buffer was too large \"body buffer\"', "
        "project => 'grammar')"
    ).fetchone()
    assert row is not None
    plan = row[0]
    assert [b["value"] for b in plan["grammar"]["boost"]] == ["body buffer"]
    assert plan["search_strategy"] != "LexicalOnly"  # routed as a question, not as syntax


def test_tags_and_mentions_are_exact(conn: Conn, embedder: LocalEmbedder) -> None:
    add_grammar_nodes(conn, embedder)
    # "network" stems like "networking": a plain word finds both, the tag only its token
    assert len(lexical(conn, "networking")) >= 3
    assert lexical(conn, "#networking") == ["networking broke after the switch upgrade #networking"]
    assert set(lexical(conn, "#network")) == {t for _, t in NODES if re.search(r"\bnetwork\b", t)}
    assert lexical(conn, "@devops network") == ["@devops rotated the network certificates"]
    # OR between required operands: either satisfies
    assert set(lexical(conn, "#networking OR @devops")) == {NODES[3][1], NODES[5][1]}


def test_plan_reports_the_parse(conn: Conn) -> None:
    row = conn.execute(
        "SELECT memory.plan_query('kong -nginx +\"body buffer\"', project => 'poimen')"
    ).fetchone()
    assert row is not None
    g = row[0]["grammar"]
    assert g["operators"] and g["exclude"][0]["value"] == "nginx"
    assert g["required"][0][0]["value"] == "body buffer"
    rows = conn.execute(
        "SELECT stage, plan FROM memory.explain_query('kong -nginx', project => 'poimen')"
    ).fetchall()
    assert rows[0][0] == "plan" and rows[0][1]["grammar"]["exclude"][0]["value"] == "nginx"


# --- metadata filters -------------------------------------------------------------------


def test_a_filtered_query_fills_its_limit(conn: Conn, embedder: LocalEmbedder) -> None:
    add_grammar_nodes(conn, embedder, extra=60)
    alice = '{"user": "alice"}'  # 20 of the 60 notes
    for strategy in ("LexicalOnly", "Hybrid", "SemanticOnly", "LexicalFirst"):
        rows = conn.execute(
            "SELECT node_id FROM memory_query('gateway buffer note', project => 'grammar', "
            "strategy => %s, k => 10, filter => %s::jsonb)",
            (strategy, alice),
        ).fetchall()
        assert len(rows) == 10, strategy
        meta = conn.execute(
            "SELECT DISTINCT metadata ->> 'user' FROM memory.nodes WHERE id = ANY(%s)",
            ([r[0] for r in rows],),
        ).fetchall()
        assert meta == [("alice",)], strategy


@pytest.mark.parametrize("bad", ["[1]", '"alice"', "3"])
def test_a_filter_that_is_not_an_object_is_refused(conn: Conn, bad: str) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="filter must be a JSON object"):
        conn.execute("SELECT * FROM memory_query('kong', filter => %s::jsonb)", (bad,))


def test_the_metadata_index_is_used_when_selective(conn: Conn, embedder: LocalEmbedder) -> None:
    add_grammar_nodes(conn, embedder, extra=60)
    conn.execute("ANALYZE memory.nodes")
    conn.execute("SET enable_seqscan = off")
    row = conn.execute(
        "EXPLAIN (FORMAT JSON) SELECT id FROM memory.nodes WHERE metadata @> '{\"n\": 7}'"
    ).fetchone()
    assert row is not None
    assert "nodes_metadata_gin" in json.dumps(row[0])


# --- the relevance floor ------------------------------------------------------------------

OFF_TOPIC = "what is a good chocolate cake recipe"


def test_the_floor_withholds_and_an_empty_answer_cites_nothing(conn: Conn) -> None:
    row = conn.execute(
        "SELECT memory.answer(%s, project => 'poimen', min_cosine => 0.3)", (OFF_TOPIC,)
    ).fetchone()
    assert row is not None
    doc = row[0]
    assert doc["results"] == [] and doc["evidence"] == []
    assert doc["counts"]["withheld"] > 0
    floor = doc["plan"]["floor"]
    assert (floor["min_cosine"], floor["source"], floor["applied"]) == (0.3, "argument", True)
    # a sentence: a candidate below the floor is kept only holding half its terms
    assert floor["terms"] == ["cake", "chocol", "good", "recip"] and floor["keep_with_terms"] == 2
    # without a floor (-1: every cosine clears it) the same question returns memories
    assert texts(conn, OFF_TOPIC, project="poimen", min_cosine=-1)
    # an on-topic question keeps what clears the floor, in order
    rows = conn.execute(
        "SELECT query_score FROM memory_query('why did uploads over 10KB fail at the gateway', "
        "project => 'poimen', min_cosine => 0.3)"
    ).fetchall()
    assert rows and all(r[0] >= 0.3 for r in rows)


def test_the_floor_is_on_by_default(conn: Conn) -> None:
    """The policy's floor (issue 45): an off-topic sentence comes back empty, counted as
    withheld, citing nothing; the demo's keyword queries keep their exact matches."""
    row = conn.execute("SELECT memory.answer(%s, project => 'poimen')", (OFF_TOPIC,)).fetchone()
    assert row is not None
    doc = row[0]
    floor = doc["plan"]["floor"]
    assert floor["source"] == "model" and floor["min_cosine"] == 0.3 and floor["applied"]
    assert doc["results"] == [] and doc["evidence"] == [] and doc["counts"]["withheld"] > 0
    for q in ("kong", "deploy key rotation"):
        for levels in (["L1", "L2"], ["L0"], ["L0", "L1", "L2"]):
            floored = texts(conn, q, project="poimen", levels=levels, k=10)
            unfloored = texts(conn, q, project="poimen", levels=levels, k=10, min_cosine=-1)
            terms = conn.execute(
                "SELECT tsvector_to_array(to_tsvector('english', %s))", (q,)
            ).fetchone()
            assert terms is not None
            exact = [
                t
                for t in unfloored
                if set(terms[0])
                & set(
                    (
                        conn.execute(
                            "SELECT tsvector_to_array(to_tsvector('english', %s))", (t,)
                        ).fetchone()
                        or [[]]
                    )[0]
                )
            ]
            assert exact, (q, levels)  # the demo holds exact matches of both
            assert [t for t in floored if t in exact] == exact, (q, levels)
    # a keyword query routed LexicalOnly needs no vector for the floor: every candidate
    # holds one of its terms
    row = conn.execute("SELECT memory.plan_query('kong', project => 'poimen')").fetchone()
    assert row is not None
    plan = row[0]
    assert plan["search_strategy"] == "LexicalOnly" and plan["needs_embedding"] is False
    assert plan["floor"]["applied"] is False and "keyword" in plan["floor"]["why"]


def test_the_floor_keeps_what_the_query_words_vouch_for(conn: Conn) -> None:
    """Below the floor, a keyword query's candidate holding one of its terms and a
    sentence's candidate holding floor_term_share of them are kept; a query with required
    operands is not floored (its candidates matched them)."""
    nodes = [
        {"id": "v1", "level": "L1", "project": "vouch",
         "text": "Zanzibar ferry timetable: the morning boat leaves at seven"},
        {"id": "v2", "level": "L1", "project": "vouch",
         "text": "Quarterly revenue grew by four percent #finance"},
    ]  # fmt: skip
    conn.execute("SELECT memory.add_nodes(%s)", (Jsonb(nodes),))

    def got(q: str, **kw: Any) -> list[str]:
        return texts(conn, q, project="vouch", strategy="Hybrid", min_cosine=0.99, **kw)

    assert got("ferry") == [nodes[0]["text"]]  # one word: its match is kept
    assert got("zanzibar cake") == [nodes[0]["text"]]  # two: either word vouches
    # a sentence: one of its five terms does not vouch for a candidate; three of them do
    assert got("when does the ferry to the island come back in the evening") == []
    assert got("when does the evening ferry leave from the island") == [nodes[0]["text"]]
    assert got("when does the morning ferry to zanzibar leave") == [nodes[0]["text"]]
    conn.execute("SELECT memory.set_policy('floor_term_share', '1')")  # all of them
    try:
        assert got("when does the evening ferry leave from the island") == []
        assert got("when does the morning ferry to zanzibar leave") == [nodes[0]["text"]]
    finally:
        conn.execute("SELECT memory.reset_policy('floor_term_share')")
    assert got("#finance how did the numbers move") == [nodes[1]["text"]]
    assert got("zanzibar cake recipe") == [nodes[0]["text"]]  # three: one of them vouches
    # floor_keyword_words 0: no keyword query, half the terms of any query
    conn.execute("SELECT memory.set_policy('floor_keyword_words', '0')")
    try:
        assert got("zanzibar cake recipe") == []
        assert got("zanzibar ferry recipe") == [nodes[0]["text"]]
    finally:
        conn.execute("SELECT memory.reset_policy('floor_keyword_words')")
    for key, bad in [("floor_keyword_words", "-1"), ("floor_keyword_words", "51"),
                     ("floor_keyword_words", "x"), ("floor_term_share", "1.5"),
                     ("floor_term_share", "-0.5")]:  # fmt: skip
        with pytest.raises(psycopg.errors.InvalidParameterValue, match=key):
            conn.execute("SELECT memory.set_policy(%s, %s)", (key, bad))


def test_the_floor_comes_from_the_policy(conn: Conn) -> None:
    conn.execute("SELECT memory.set_policy('min_cosine', '-1')")
    try:
        assert texts(conn, OFF_TOPIC, project="poimen")  # off: the question gets memories
        row = conn.execute("SELECT memory.answer(%s, project => 'poimen')", (OFF_TOPIC,)).fetchone()
        assert row is not None and row[0]["plan"]["floor"]["min_cosine"] == -1
    finally:
        conn.execute("SELECT memory.reset_policy('min_cosine')")
    assert texts(conn, OFF_TOPIC, project="poimen") == []
    conn.execute("SELECT memory.set_policy('min_cosine', '0.1')")
    try:
        row = conn.execute("SELECT memory.plan_query(%s, project => 'poimen')", (OFF_TOPIC,))
        floor = (row.fetchone() or [{}])[0]["floor"]
        assert (floor["source"], floor["min_cosine"]) == ("policy", 0.1)
    finally:
        conn.execute("SELECT memory.reset_policy('min_cosine')")
    # LexicalOnly forced by the caller: no embedding behind its back, so no floor
    row = conn.execute(
        "SELECT memory.answer(%s, project => 'poimen', strategy => 'LexicalOnly')", (OFF_TOPIC,)
    ).fetchone()
    assert row is not None and row[0]["plan"]["needs_embedding"] is False
    assert row[0]["plan"]["floor"]["applied"] is False
    assert "forced" in row[0]["plan"]["floor"]["why"]
    for bad in ("1.5", "x"):
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            conn.execute("SELECT memory.set_policy('min_cosine', %s)", (bad,))
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="min_cosine"):
        conn.execute("SELECT * FROM memory_query('kong', min_cosine => 2)")


def test_the_default_floor_is_the_models(conn: Conn) -> None:
    """Each model's cosines have a scale of their own (e5 gives off-topic text about 0.8,
    MiniLM about 0.1): unset by the policy, the floor is the database model's, and a model
    without one (a remote server's) is not floored rather than floored on another scale."""

    def floor() -> dict[str, Any]:
        row = conn.execute("SELECT memory.plan_query(%s, project => 'poimen')", (OFF_TOPIC,))
        return dict((row.fetchone() or [{}])[0]["floor"])

    assert (floor()["min_cosine"], floor()["source"]) == (MODEL_FLOORS[LOCAL_MODEL], "model")
    for model, expected in [(E5_MODEL, MODEL_FLOORS[E5_MODEL]), ("a-remote-model", None)]:
        conn.execute("SELECT memory.reset_embedding(%s, 384)", (model,))
        got = floor()
        assert got["min_cosine"] == expected, model
        assert got["applied"] is (expected is not None), model
    assert MODEL_FLOORS[E5_MODEL] > 0.8 > MODEL_FLOORS[LOCAL_MODEL]


# --- HTTP ---------------------------------------------------------------------------------


@pytest.fixture
def client(fixture_url: str, embedder: LocalEmbedder) -> Iterator[TestClient]:
    with serve({"POIMEN_DATABASE_URL": fixture_url}, embedder) as c:
        yield c


def test_http_grammar_and_filter(client: TestClient) -> None:
    body = query(client, query="kong -nginx", project="poimen", level="L0,L1,L2", limit=10)
    assert body["plan"]["grammar"]["exclude"][0]["value"] == "nginx"
    assert body["results"] and not any("nginx" in r["text"].lower() for r in body["results"])
    body = query(client, query="kong", project="poimen", filter='{"nobody": true}')
    assert body["results"] == [] and body["plan"]["filter"] == {"nobody": True}
    for bad in ("{", "[1]", "x" * 5000):
        r = client.get("/memory/query", params={"query": "kong", "filter": bad})
        assert r.status_code == 400, r.text
    body = query(client, query='"unclosed kong', project="poimen")
    assert body["results"] and body["plan"]["grammar"]["notes"]
    body = query(client, query="what is a good chocolate cake recipe", min_cosine="0.3")
    assert body["results"] == [] and body["evidence"] == [] and body["withheld"] > 0
    # the policy's floor, as in SQL; -1 turns it off for one request
    body = query(client, query="what is a good chocolate cake recipe", project="poimen")
    assert body["results"] == [] and body["evidence"] == [] and body["withheld"] > 0
    body = query(client, query="what is a good chocolate cake recipe", min_cosine="-1")
    assert body["results"] and body["withheld"] == 0
    # a soft phrase over HTTP: routed as a question, raises the turn holding it
    body = query(client, query='what did alice raise in "kong.conf"', project="poimen", level="L0")
    assert body["plan"]["grammar"]["boost"][0]["value"] == "kong.conf"
    assert body["search_strategy"] != "LexicalOnly"
    assert "kong.conf" in body["results"][0]["text"]
    body = query(client, query='what did alice raise +"kong.conf"', project="poimen", level="L0")
    assert body["search_strategy"] == "LexicalOnly"
    assert body["results"] and all("kong.conf" in r["text"] for r in body["results"])
    for bad in ("2", "x"):
        r = client.get("/memory/query", params={"query": "kong", "min_cosine": bad})
        assert r.status_code == 400, r.text


# --- OpenSearch: the request body, against the double -----------------------------------------


@pytest.fixture
def os_engine(
    conn: Conn, embedder: LocalEmbedder
) -> Iterator[tuple[OpenSearchServer, OpenSearchEngine]]:
    add_grammar_nodes(conn, embedder)
    with (
        run_opensearch_server() as server,
        OpenSearchEngine(server.url, "grammar-test", timeout_s=2.0, bulk_timeout_s=5.0) as e,
    ):
        reindex(conn, e, progress=False)
        yield server, e


def os_texts(conn: Conn, engine: OpenSearchEngine, q: str) -> list[str]:
    g = parse(conn, q)
    hits = engine.search(q, "grammar", None, 20, 2.0, g)
    rows = conn.execute(
        "SELECT encode(sha256, 'hex'), text FROM memory.nodes "
        "WHERE encode(sha256, 'hex') = ANY(%s)",
        ([h.sha256 for h in hits],),
    ).fetchall()
    by = dict(rows)
    return [by[h.sha256] for h in hits]


def test_opensearch_body_carries_the_grammar(conn: Conn) -> None:
    g = parse(conn, 'kong -nginx +"body buffer" #net OR @ops')
    body = search_body("ignored", "poimen", None, 5, g)
    b = body["query"]["bool"]
    assert b["must"][0]["multi_match"]["query"] == "kong body buffer net ops"
    assert b["filter"][1] == {
        "bool": {
            "should": [
                {
                    "multi_match": {
                        "query": "body buffer",
                        "type": "phrase",
                        "fields": ["content", "section_title", "breadcrumb"],
                    }
                }
            ],
            "minimum_should_match": 1,
        }
    }
    tag = b["filter"][2]["bool"]["should"][0]["multi_match"]
    assert tag["fields"][0] == "content.exact" and tag["query"] == "net"
    assert [c["multi_match"]["query"] for c in b["must_not"]] == ["nginx", "nginx"]
    # without operators the body is the seed's
    assert search_body("kong", None, None, 5, parse(conn, "kong")) == search_body(
        "kong", None, None, 5
    )


def test_opensearch_operators_against_the_double(
    conn: Conn, os_engine: tuple[OpenSearchServer, OpenSearchEngine]
) -> None:
    _, engine = os_engine
    rows = os_texts(conn, engine, "gateway buffer network -network")
    assert rows and not any(re.search(r"\bnetwork\b", t) for t in rows)
    assert os_texts(conn, engine, '"buffer body"') == [NODES[0][1]]
    assert os_texts(conn, engine, '"body buffer"') == [NODES[1][1]]
    assert os_texts(conn, engine, "#networking") == [NODES[3][1]]
    assert os_texts(conn, engine, "@devops network") == [NODES[5][1]]
    assert os_texts(conn, engine, "-network") == []
    assert os_texts(conn, engine, '"unclosed buffer')  # malformed: plain words, answers


# --- recency -------------------------------------------------------------------------------


def _recency_nodes(conn: Conn) -> None:
    """Three notes of one project that match a query equally well, one a day, a month and a
    year old (from 2026-06-01), and one without a timestamp."""
    nodes = [
        {"id": f"r-{age}", "level": "L1", "project": "recency",
         "text": f"the deploy key rotation happened ({age})",
         "timestamp": ts}
        for age, ts in [("day", "2026-05-31T00:00:00Z"), ("month", "2026-05-02T00:00:00Z"),
                        ("year", "2025-06-01T00:00:00Z"), ("untimed", None)]
    ]  # fmt: skip
    conn.execute("SELECT memory.add_nodes(%s)", (Jsonb(nodes),))


def _ranked(conn: Conn, **kw: Any) -> list[tuple[str, float]]:
    args = "".join(f", {k} => %({k})s" for k in kw)
    rows = conn.execute(
        "SELECT external_id, final_score FROM memory_query('deploy key rotation', "
        "project => 'recency', strategy => 'Hybrid', reference_time => '2026-06-01T00:00:00Z'"
        + args
        + ")",
        kw,
    ).fetchall()
    return [(r[0], r[1]) for r in rows]


def test_recency_is_off_by_default_and_the_plan_says_so(conn: Conn) -> None:
    _recency_nodes(conn)
    row = conn.execute(
        "SELECT memory.answer('deploy key rotation', project => 'recency')"
    ).fetchone()
    assert row is not None
    assert row[0]["plan"]["recency"]["applied"] is False
    assert row[0]["plan"]["recency"]["half_life_days"] is None


def test_recency_multiplies_each_score_by_its_decay(conn: Conn) -> None:
    _recency_nodes(conn)
    before = dict(_ranked(conn))
    conn.execute("SELECT memory.set_policy('recency_half_life_days', '30')")
    conn.execute("SELECT memory.set_policy('recency_weight', '0.8')")
    try:
        after = _ranked(conn)
        row = conn.execute(
            "SELECT memory.answer('deploy key rotation', project => 'recency', "
            "reference_time => '2026-06-01T00:00:00Z')"
        ).fetchone()
    finally:
        conn.execute("SELECT memory.reset_policy('recency_half_life_days')")
        conn.execute("SELECT memory.reset_policy('recency_weight')")
    assert row is not None
    rec = row[0]["plan"]["recency"]
    assert rec["applied"] is True and rec["half_life_days"] == 30 and rec["weight"] == 0.8
    assert rec["origin"].startswith("2026-06-01")
    days = {"r-day": 1, "r-month": 30, "r-year": 365}
    for ext, score in after:
        decay = 0.5 ** (days[ext] / 30) if ext in days else 0.0  # untimed: no boost
        assert score == pytest.approx(before[ext] * (1 - 0.8 + 0.8 * decay)), ext
    order = [e for e, _ in after]
    assert order.index("r-day") < order.index("r-month") < order.index("r-year")
    assert _ranked(conn) and dict(_ranked(conn)) == pytest.approx(before)  # reset: as before


def test_recency_policy_values_are_checked(conn: Conn) -> None:
    for key, bad in [("recency_half_life_days", "0"), ("recency_half_life_days", "x"),
                     ("recency_half_life_days", "-3"), ("recency_weight", "1.5")]:  # fmt: skip
        with pytest.raises(psycopg.errors.InvalidParameterValue, match=key):
            conn.execute("SELECT memory.set_policy(%s, %s)", (key, bad))


def test_http_reports_recency_as_sql_does(client: TestClient, fixture_url: str) -> None:
    with psycopg.connect(fixture_url, autocommit=True) as c:
        c.execute("SELECT memory.set_policy('recency_half_life_days', '7')")
    body = query(client, query="kong", project="poimen", reference_time="2024-03-01T00:00:00Z")
    assert body["plan"]["recency"] == {
        "half_life_days": 7, "weight": 0.5, "applied": True,
        "origin": "2024-03-01T00:00:00+00:00",
    }  # fmt: skip


def test_the_filter_holds_in_evidence_and_exact_search(conn: Conn) -> None:
    """memory.evidence and memory.exact_search take the metadata filter memory.query takes:
    every turn they return contains it (without it, both users' turns come back)."""
    turns = [
        {"id": f"t{i}", "level": "L0", "project": "flt", "title": "session",
         "text": f"the gateway buffer overflowed again, report {i}",
         "metadata": {"user": "alice" if i % 2 else "bob"}}
        for i in range(12)
    ]  # fmt: skip
    conn.execute("SELECT memory.add_nodes(%s)", (Jsonb(turns),))
    users = "SELECT DISTINCT metadata ->> 'user' FROM ({}) x"
    ev = (
        "SELECT metadata FROM memory.evidence('gateway buffer overflow', '{{}}', project => 'flt'"
        ", levels => ARRAY['L0']{})"
    )
    ex = (
        "SELECT n.metadata FROM memory.exact_search(memory.embed('gateway buffer overflow'),"
        " 'flt', ARRAY['L0'], 10{}) e JOIN memory.nodes n ON n.id = e.node_id"
    )
    alice = ', filter => \'{"user": "alice"}\''
    for sql in (ev, ex):
        assert {r[0] for r in conn.execute(users.format(sql.format(""))).fetchall()} == {
            "alice",
            "bob",
        }, sql
        rows = conn.execute(users.format(sql.format(alice))).fetchall()
        assert {r[0] for r in rows} == {"alice"}, sql
    for sql in (ev, ex):  # not an object: 22023 from both, as from memory_query
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            conn.execute(sql.format(", filter => '[1]'"))
