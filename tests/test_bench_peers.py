"""`poimen-memory bench-peers` on the project's own fixture (issue 42): the peers' SQL returns
the rows their recipes define (checked against the same legs recomputed here), and the
command runs end to end on a tiny corpus. No timing is asserted."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest
from pgvector.psycopg import register_vector
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from conftest import stage_migrations
from poimen_lab.bench import peers
from poimen_lab.bench.scratch import drop_database
from poimen_memory.cli.main import main
from poimen_memory.db.connect import connect
from poimen_memory.db.migrate import layout

FIXTURES = Path(__file__).parent / "fixtures"
QUERIES = [json.loads(x) for x in (FIXTURES / "eval_queries.jsonl").read_text().splitlines()]


def _documents(conn: psycopg.Connection[Any]) -> dict[int, tuple[str, np.ndarray[Any, Any]]]:
    register_vector(conn)
    rows = conn.execute("SELECT id, project, embedding FROM peer_supabase.documents").fetchall()
    return {int(i): (p, np.asarray(peers._floats(e), dtype=np.float64)) for i, p, e in rows}


def _rrf(legs: list[list[int]], k: float, first: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for leg in legs:
        for rank, i in enumerate(leg, start=first):
            out[i] = out.get(i, 0.0) + 1.0 / (k + rank)
    return out


def _same_ranking(got: list[int], want: dict[int, float], n: int) -> None:
    """got is the top n of want's scores: the same scores in the same order (ties may swap
    rows), and the same rows wherever the n-th score is not tied past the cut."""
    best = sorted(want.values(), reverse=True)[:n]
    assert [round(want[i], 12) for i in got] == [round(s, 12) for s in best]
    cut = best[-1] if best else None
    if cut is not None and sum(1 for s in want.values() if abs(s - cut) < 1e-12) == 1:
        assert set(got) == {i for i, s in want.items() if s >= cut - 1e-12}


def test_supabase_hybrid_search_returns_the_recipes_rows(fixture_url: str, embedder: Any) -> None:
    """Supabase's hybrid_search over the fixture's L0 nodes: the full-text leg (websearch
    tsquery, ts_rank_cd), the inner-product leg (exact: the recipe's window
    ordering scans every row) and RRF with
    k 50 and weights 1, recomputed here, give the function's rows and order."""
    load = peers.build_supabase(fixture_url, embedder.dim)
    with connect(fixture_url, autocommit=True) as conn:
        n_l0 = conn.execute(
            "SELECT count(*) FROM memory.nodes WHERE level = 'L0' AND expired_at IS NULL"
        ).fetchone()
        assert n_l0 is not None and load["rows"] == n_l0[0] > 0
        docs = _documents(conn)
        external = dict(
            conn.execute(
                "SELECT d.id, n.external_id FROM peer_supabase.documents d"
                " JOIN memory.nodes n ON n.id = d.node_id"
            ).fetchall()
        )
        for qy in QUERIES:
            project, k = qy.get("project"), 4
            vec = np.asarray(embedder.embed_query(qy["text"]), dtype=np.float32)
            got = [
                int(r[0])
                for r in conn.execute(
                    peers.SUPABASE_QUERY,
                    {"text": qy["text"], "vec": vec, "k": k, "project": project},
                ).fetchall()
            ]
            lexical = [
                int(r[0])
                for r in conn.execute(
                    "SELECT id FROM peer_supabase.documents"
                    " WHERE fts @@ websearch_to_tsquery(%(t)s)"
                    " AND (%(p)s::text IS NULL OR project = %(p)s)"
                    " ORDER BY ts_rank_cd(fts, websearch_to_tsquery(%(t)s)) DESC, id",
                    {"t": qy["text"], "p": project},
                ).fetchall()
            ][: 2 * k]
            scope = [i for i, (p, _) in docs.items() if project is None or p == project]
            dense = sorted(scope, key=lambda i: -float(docs[i][1] @ vec))[: 2 * k]
            _same_ranking(got, _rrf([lexical, dense], 50, 1), k)
            assert all(project is None or docs[i][0] == project for i in got)
        # The gold turns of the fixture's first question come first.
        q1 = QUERIES[0]
        vec = np.asarray(embedder.embed_query(q1["text"]), dtype=np.float32)
        top = conn.execute(
            peers.SUPABASE_QUERY, {"text": q1["text"], "vec": vec, "k": 3, "project": "poimen"}
        ).fetchall()
        assert {external[int(r[0])] for r in top} == {
            "poimen:chat:1",
            "poimen:chat:2",
            "poimen:chat:3",
        }
        # The project filter reaches the table's B-tree: the function is inlined into the
        # call, where the project is a constant (a VOLATILE function's statement is planned
        # without it, and "filter_project IS NULL OR project = ..." stays a filter). The
        # fixture is small enough for a sequential scan: it is turned off to read the plan.
        with conn.transaction():
            conn.execute("SET LOCAL enable_seqscan = off")
            plan = "\n".join(
                str(r[0])
                for r in conn.execute(
                    "EXPLAIN " + peers.SUPABASE_QUERY.replace("%(k)s", "%(k)s::int"),
                    {"text": q1["text"], "vec": vec, "k": 3, "project": "poimen"},
                ).fetchall()
            )
        assert "Function Scan" not in plan, plan
        assert plan.count("Index Cond: (project = 'poimen'::text)") == 2, plan


def test_langchain_hybrid_returns_its_fusion_of_both_legs(fixture_url: str, embedder: Any) -> None:
    """langchain-postgres' hybrid store (when installed): its rows are RRF (k 60, ranks from
    0) of the cosine leg and the plainto_tsquery / ts_rank_cd leg, each 2k deep, per call
    with that call's own question (the shared config would keep the first one's)."""
    pytest.importorskip("langchain_postgres")
    peer = peers.LangchainPeer(fixture_url, embedder, embedder.dim)
    try:
        peer.build(fixture_url)
        with connect(fixture_url, autocommit=True) as conn:
            register_vector(conn)
            rows = conn.execute(
                "SELECT node_id, project, embedding FROM peer_langchain.documents"
            ).fetchall()
            docs = {int(i): (p, np.asarray(peers._floats(e))) for i, p, e in rows}
            # its filter's column indexed, as the Supabase peer's (peers.PEER_PROJECT_INDEX)
            indexed = conn.execute(
                "SELECT count(*) FROM pg_indexes WHERE schemaname = 'peer_langchain'"
                " AND indexdef LIKE '%%btree (project)'"
            ).fetchone()
            assert indexed == (1,)
            for qy in QUERIES:
                project, k = qy.get("project"), 3
                vec = np.asarray(embedder.embed_query(qy["text"]), dtype=np.float64)
                got = peer.search(qy["text"], project, k)
                scope = [i for i, (p, _) in docs.items() if project is None or p == project]
                cos = {
                    i: float(docs[i][1] @ vec) / (np.linalg.norm(docs[i][1]) * np.linalg.norm(vec))
                    for i in scope
                }
                dense = sorted(scope, key=lambda i: -cos[i])[: 2 * k]
                sparse = [
                    int(r[0])
                    for r in conn.execute(
                        "SELECT node_id FROM peer_langchain.documents"
                        " WHERE content_tsv @@ plainto_tsquery('pg_catalog.english', %(t)s)"
                        " AND (%(p)s::text IS NULL OR project = %(p)s)"
                        " ORDER BY ts_rank_cd(content_tsv,"
                        " plainto_tsquery('pg_catalog.english', %(t)s)) DESC",
                        {"t": qy["text"], "p": project},
                    ).fetchall()
                ][: 2 * k]
                _same_ranking(got, _rrf([dense, sparse], 60, 0), k)
        # Calls at once from several threads (bench-peers' throughput clients): each its own
        # answer through the engine's event loop and pool, no error.
        systems = peers.Systems(fixture_url, embedder, ["langchain"], {}, peer)
        dbname = conninfo_to_dict(fixture_url)["dbname"]
        backends = peers.Backends(fixture_url, "no_such_role", {"": str(dbname)})
        try:
            questions = [peers.Question(q["id"], q["text"], q.get("project")) for q in QUERIES]
            w = peers.load_window(systems, "langchain", questions, False, 3, 3, 0.5, backends, {})
        finally:
            systems.close()
            backends.close()
        assert w.answers > 0 and w.errors == 0, w.error
        assert w.database_ns > 0  # its pool's backends, found by application_name
    finally:
        peer.close()


@pytest.fixture
def sets(tmp_path: Path) -> tuple[Path, Path]:
    """The fixture as two data folders: all levels (scored by cited evidence, as LoCoMo)
    and its L0 nodes alone as documents (scored by nDCG@10, as SciFact)."""
    mem, docs = tmp_path / "mem", tmp_path / "docs"
    mem.mkdir()
    docs.mkdir()
    (mem / "nodes.jsonl").write_text((FIXTURES / "memory_nodes.jsonl").read_text())
    (mem / "queries.jsonl").write_text((FIXTURES / "eval_queries.jsonl").read_text())
    (mem / "qrels.jsonl").write_text((FIXTURES / "eval_qrels.jsonl").read_text())
    nodes = [json.loads(x) for x in (FIXTURES / "memory_nodes.jsonl").read_text().splitlines()]
    (docs / "nodes.jsonl").write_text(
        "".join(
            json.dumps({**n, "project": "docs", "parents": []}) + "\n"
            for n in nodes
            if n["level"] == "L0"
        )
    )
    (docs / "queries.jsonl").write_text(
        "".join(json.dumps({**q, "project": "docs"}) + "\n" for q in QUERIES)
    )
    (docs / "qrels.jsonl").write_text((FIXTURES / "eval_qrels.jsonl").read_text())
    return mem, docs


@pytest.fixture
def databases(
    empty_url: str, work_dir: Path, admin: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> Callable[[], set[str]]:
    """The command's environment (empty_url's cluster, its own home, the local embedder);
    returns what lists the cluster's databases, so a test can check that none is left."""
    monkeypatch.setenv("POIMEN_DATABASE_URL", empty_url)
    monkeypatch.setenv("POIMEN_HOME", str(work_dir))
    monkeypatch.delenv("POIMEN_EMBEDDINGS_URL", raising=False)
    return lambda: {r[0] for r in admin.execute("SELECT datname FROM pg_database").fetchall()}


def test_bench_peers_end_to_end(
    databases: Callable[[], set[str]],
    sets: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = databases()
    out, png = tmp_path / "peers.json", tmp_path / "peers.png"
    mem, docs = sets
    args = ["bench-peers", "--set", str(mem), "--set", str(docs), "--warmup", "1",
            "--systems", "supabase,poimen", "--cache", str(tmp_path / "cache"),
            "--json", str(out), "--plot", str(png), "--anonymous",
            "--clients", "2", "--seconds", "1", "--rounds", "1"]  # fmt: skip
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert r["sets"]["mem"]["measure"] == "evidence recall"
    assert r["sets"]["docs"]["measure"] == "nDCG@10"
    # Anonymous mode: every project asserted (a question of the mem set names none).
    assert r["keys"] == "anonymous"
    for name, s in r["sets"].items():
        assert set(s["systems"]) == {"supabase", "poimen"}
        for system, row in s["systems"].items():
            # 8 judged questions, the first one a warm-up
            assert row["questions"] == 7 == len(s["per_query"][system]), (name, system)
            assert 0.5 <= row["quality"] <= 1.0, (name, system, row["quality"])
            assert row["p50_ms"] > 0 and row["cpu_ms"] > 0
            assert row["database_cpu_ms"] > 0  # the backends that served it were found
        assert s["systems"]["poimen"]["server_cpu_ms"] > 0
        assert s["systems"]["supabase"]["server_cpu_ms"] == 0
        # The throughput phase: 2 clients a system, one 1-second window each.
        tput = s["throughput"]
        assert set(tput) == {"supabase", "poimen"}, name
        for system, row in tput.items():
            assert row["qps"] > 0 and row["errors"] == 0, (name, system, row)
            assert (row["clients"], row["seconds"], row["rounds"]) == (2, 1, 1)
            assert row["p95_ms"] >= row["p50_ms"] > 0 and row["cpu_ms"] > 0
            assert row["best_peer"] == "supabase"
        assert tput["poimen"]["server_cpu_ms"] > 0 == tput["supabase"]["server_cpu_ms"]
    # The peer cites what the evidence measure counts: its rows, at most --turns of them.
    assert r["sets"]["mem"]["systems"]["supabase"]["cited"] <= 20
    assert png.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "Supabase hybrid_search" in printed and "poimen GET /memory/query" in printed
    assert "throughput: 2 clients" in printed
    assert databases() == before  # its scratch database is gone


def test_bench_peers_on_the_realistic_corpus(
    databases: Callable[[], set[str]],
    empty_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--corpus real (issue 42's measure): the realistic corpus COPY-loaded, its questions
    each asked of its own project with that project's key; no judgements, so no quality,
    and cost for every system. Reused with --database, the same corpus is asked again; a
    database of another corpus is refused."""
    before = databases()
    data = tmp_path / "data"
    (data / "locomo-dev").mkdir(parents=True)
    shutil.copy(FIXTURES / "memory_nodes.jsonl", data / "locomo-dev" / "nodes.jsonl")
    shutil.copy(FIXTURES / "eval_queries.jsonl", data / "locomo-dev" / "queries.jsonl")
    out, cache = tmp_path / "peers.json", tmp_path / "cache"
    common = ["bench-peers", "--corpus", "real", "--data", str(data), "--cache", str(cache),
              "--nodes", "600", "--projects", "6", "--queries", "6", "--warmup", "1",
              "--systems", "supabase,poimen,poimen-evidence0", "--json", str(out)]  # fmt: skip
    assert main([*common, "--keep-db"]) == 0
    r = json.loads(out.read_text())
    kept = r["database"]
    try:
        assert r["keys"] == "one read-only key per project"
        assert r["load"]["poimen_copy"]["copy_seconds"] > 0
        s = r["sets"]["realistic-600"]
        assert s["measure"] is None and s["nodes"] == 600 and s["questions"] == 5
        for system, row in s["systems"].items():
            assert row["questions"] == 5 and row["quality"] != row["quality"], system  # NaN
            assert row["p50_ms"] > 0 and row["database_cpu_ms"] > 0, system
        assert s["systems"]["poimen"]["server_cpu_ms"] > 0
        with connect(make_conninfo(empty_url, dbname=kept)) as conn:
            row = conn.execute(
                "SELECT count(*), count(DISTINCT project_id), count(*) FILTER (WHERE level = 'L0')"
                " FROM memory.nodes"
            ).fetchone()
            peer = conn.execute("SELECT count(*) FROM peer_supabase.documents").fetchone()
        assert row is not None and row[:2] == (600, 6)
        assert peer == (row[2],)  # the peer holds the L0 nodes
        assert "no judgements, cost only" in capsys.readouterr().out
        # The kept database answers the same corpus again, here its questions asked of
        # projects drawn by size; another corpus is refused.
        assert main([*common, "--database", kept, "--ask", "by-size"]) == 0
        again = json.loads(out.read_text())["sets"]
        assert list(again) == ["realistic-600-by-size"]
        assert again["realistic-600-by-size"]["questions"] == 5
        other = [x if x != "600" else "700" for x in common]
        with pytest.raises(SystemExit, match="holds 600 nodes in 6 projects"):
            main([*other, "--database", kept])
        with pytest.raises(SystemExit, match="another corpus of this size"):
            main([*common, "--database", kept, "--seed", "1"])
    finally:
        drop_database(empty_url, kept)
    assert databases() == before


def test_realistic_questions_asked_by_size_follow_the_projects_nodes() -> None:
    """--ask by-size: a project is asked in proportion to its nodes, each question one of
    the real ones nearest the project's nodes; --ask nearest keeps the corpus' own."""
    from poimen_lab.bench import realistic, synthetic

    rng = np.random.default_rng(3)

    def unit(x: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.float32]]:
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    real = realistic.RealTexts(
        [f"t{i}" for i in range(50)], unit(rng.standard_normal((50, 8))),
        [f"question {i}" for i in range(400)], unit(rng.standard_normal((400, 8))),
    )  # fmt: skip
    projects = ["big"] * 900 + ["mid"] * 90 + ["tiny"] * 10
    corpus = synthetic.Corpus(
        unit(rng.standard_normal((1000, 8))), ["x"] * 1000, ["L0"] * 1000, projects,
        [[] for _ in range(1000)], real.question_vectors[:300], real.questions[:300],
        ["tiny"] * 300,
    )  # fmt: skip
    nearest = peers.realistic_set(corpus, real, "nearest", 0)
    assert {q.project for q in nearest.questions} == {"tiny"} and len(nearest.questions) == 300
    asked = peers.realistic_set(corpus, real, "by-size", 0)
    assert asked.name.endswith("-by-size") and len(asked.questions) == 300
    by = {p: [q for q in asked.questions if q.project == p] for p in ("big", "mid", "tiny")}
    assert 240 <= len(by["big"]) <= 300 and len(by["big"]) > len(by["mid"]) > len(by["tiny"])
    for project, qs in by.items():
        want = realistic.project_queries(real, corpus, project, len(qs))[1]
        assert sorted(q.text for q in qs) == sorted(want), project
    assert len({q.id for q in asked.questions}) == 300


def test_bench_peers_runs_the_version_before_a_change_beside_this_one(
    databases: Callable[[], set[str]],
    sets: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--base REF: a commit's code on a copy of the loaded database, its own server, asked
    the same questions; HEAD against itself gives the same answers, each version's CPU is
    read from its own backends and server, and the copy is dropped afterwards."""
    before = databases()
    out, cache = tmp_path / "peers.json", tmp_path / "cache"
    mem, _ = sets
    # A keyed run asks each question with its project's key: the one question of the
    # fixture that names none is asked of its answer's project here.
    queries = [json.loads(x) for x in (mem / "queries.jsonl").read_text().splitlines()]
    (mem / "queries.jsonl").write_text(
        "".join(json.dumps({**q, "project": q.get("project") or "poimen"}) + "\n" for q in queries)
    )
    args = ["bench-peers", "--set", str(mem), "--warmup", "1", "--systems", "poimen",
            "--base", "HEAD", "--cache", str(cache), "--json", str(out),
            "--clients", "1", "--seconds", "0.5", "--rounds", "1"]  # fmt: skip
    assert main(args) == 0
    r = json.loads(out.read_text())
    head = subprocess.run(
        ["git", "-C", str(peers.REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert r["base"]["ref"] == "HEAD" and r["base"]["commit"] == head
    # Asked as a keyed deployment is, both versions: each question with its project's key,
    # stored in both copies (a request without one would be refused, 401, failing the run).
    assert r["keys"] == "one read-only key per project"
    # Both versions answer from copies of the loaded database, made the same way.
    assert r["base"]["database"] == f"{r['database']}_base"
    assert r["base"]["head_database"] == f"{r['database']}_head"
    # The base's code is taken from git and kept under --cache (its migrate checks that it
    # imported this tree: copy_for_base).
    tree = cache / f"base-{head[:16]}"
    assert (tree / "service" / "poimen_memory" / "sql" / "072_evidence.sql").is_file()
    s = r["sets"]["mem"]
    assert set(s["systems"]) == {"poimen", "poimen@base"}
    for system in ("poimen", "poimen@base"):
        row = s["systems"][system]
        assert row["questions"] == 7
        assert row["database_cpu_ms"] > 0 and row["server_cpu_ms"] > 0, system
    o = s["systems"]["poimen"]["over_base"]
    assert o["questions"] == 7 and o["same_answers"] == 7, o
    assert min(o["cpu"], o["database_cpu"], o["server_cpu"]) > 0, o
    assert s["systems"]["poimen"]["quality"] == s["systems"]["poimen@base"]["quality"]
    tput = s["throughput"]
    assert set(tput) == {"poimen", "poimen@base"}
    assert tput["poimen@base"]["qps"] > 0 and tput["poimen@base"]["errors"] == 0
    assert tput["poimen"]["over_base"]["qps"] > 0
    printed = capsys.readouterr().out
    assert "this version over the base (HEAD, " in printed
    assert "poimen GET /memory/query (base)" in printed
    assert databases() == before  # the database and its base copy are gone


def test_a_base_without_the_newest_migration_runs_on_a_database_it_migrated_last(
    databases: Callable[[], set[str]],
    sets: tuple[Path, Path],
    tmp_path: Path,
    empty_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--database and --base, where this version adds a run-once migration the base does
    not have: the base's copy is made before this version migrates the reused database, so
    the base's migrate finds no migration it does not know (it refuses a database that
    holds one: a database is never migrated backwards)."""
    newest = max(layout.MIGRATIONS_DIR.glob("*.sql")).stem
    # The base: this tree without its newest run-once migration.
    base = tmp_path / "base"
    for folder in ("service", "plpython"):
        shutil.copytree(peers.REPO / folder, base / folder)
    (base / "service" / "poimen_memory" / "migrations" / f"{newest}.sql").unlink()
    monkeypatch.setattr(peers, "base_code", lambda ref, cache: ("0" * 40, base))
    before = databases()
    mem, _ = sets
    cache, kept, out = tmp_path / "cache", tmp_path / "kept.json", tmp_path / "peers.json"
    common = ["--set", str(mem), "--warmup", "1", "--systems", "poimen", "--cache", str(cache),
              "--anonymous"]  # fmt: skip
    # A database loaded and kept by the base's migrations (this version's without its newest).
    add_migrations = stage_migrations(tmp_path, monkeypatch, below=newest)
    assert main(["bench-peers", *common, "--keep-db", "--json", str(kept)]) == 0
    name = json.loads(kept.read_text())["database"]
    try:
        add_migrations(newest)
        args = ["bench-peers", *common, "--database", name, "--base", "HEAD", "--json", str(out)]
        assert main(args) == 0
        o = json.loads(out.read_text())["sets"]["mem"]["systems"]["poimen"]["over_base"]
        assert o["questions"] == 7 and o["same_answers"] == 7, o
        # this version migrated the reused database, its newest migration included
        with psycopg.connect(make_conninfo(empty_url, dbname=name)) as conn:
            assert conn.execute(
                "SELECT count(*) FROM memory.schema_migrations WHERE version = %s", (newest,)
            ).fetchone() == (1,)
    finally:
        drop_database(empty_url, name)
    assert databases() == before


def test_a_failed_base_leaves_no_database_behind(
    databases: Callable[[], set[str]],
    sets: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The base's migrate fails (here: its code does not import): the run stops with the
    base's error, and neither the loaded database nor its base copy is left behind."""
    broken = tmp_path / "broken"
    (broken / "service" / "poimen_memory").mkdir(parents=True)
    (broken / "service" / "poimen_memory" / "__init__.py").write_text(
        "raise RuntimeError('this base does not import')\n"
    )
    monkeypatch.setattr(peers, "base_code", lambda ref, cache: ("0" * 40, broken))
    before = databases()
    mem, _ = sets
    args = ["bench-peers", "--set", str(mem), "--systems", "poimen", "--base", "HEAD",
            "--cache", str(tmp_path / "cache"), "--anonymous"]  # fmt: skip
    with pytest.raises(SystemExit, match="this base does not import"):
        main(args)
    assert databases() == before


def test_the_runs_keys_are_one_per_project_and_leave_with_it(fixture_url: str) -> None:
    """tenant_keys stores one read-only key per project; drop_tenant_keys takes them (and
    no other key) away again, so a kept database answers without a key afterwards."""
    with psycopg.connect(fixture_url, autocommit=True) as conn:
        projects = [r[0] for r in conn.execute("SELECT name FROM memory.projects ORDER BY 1")]
        conn.execute(
            "INSERT INTO memory.api_keys (key_hash, prefix, projects, note)"
            " VALUES (sha256('someone else'), 'pm_other', '{poimen}', 'not the bench''s')"
        )
    keys = peers.tenant_keys([fixture_url])
    assert sorted(k for k in keys if k is not None) == projects
    with psycopg.connect(fixture_url, autocommit=True) as conn:
        stored = conn.execute(
            "SELECT projects, can_write FROM memory.api_keys WHERE note = 'bench-peers'"
        ).fetchall()
        assert sorted(stored) == [([p], False) for p in projects]
        peers.drop_tenant_keys([fixture_url])
        left = conn.execute("SELECT note FROM memory.api_keys").fetchall()
    assert left == [("not the bench's",)]


def test_a_keyed_run_refuses_a_question_without_a_project(
    databases: Callable[[], set[str]],
    sets: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each question is asked with its project's key, and a key must name its project: a
    question without one is refused before anything is loaded, with the way out."""
    before = databases()
    mem, _ = sets
    assert main(["bench-peers", "--set", str(mem), "--systems", "poimen"]) == 2
    err = capsys.readouterr().err
    assert "names no project" in err and "--anonymous" in err
    assert databases() == before


def test_bench_peers_refuses_a_base_that_is_not_a_commit(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    for ref in ("no-such-ref-anywhere", "--output=/tmp/x"):
        with pytest.raises(SystemExit, match="not a commit"):
            peers.base_code(ref, cache)
    assert not cache.exists()  # nothing extracted


def test_twins_take_turns_to_be_asked_first() -> None:
    order = ["supabase", "poimen", "poimen@base", "poimen-evidence0", "poimen-evidence0@base"]
    assert peers.twins_swapped(order) == [
        "supabase", "poimen@base", "poimen", "poimen-evidence0@base", "poimen-evidence0",
    ]  # fmt: skip
    assert peers.twins_swapped(peers.twins_swapped(order)) == order
    assert peers.request_kind("poimen-evidence0@base") == "poimen-evidence0"
    assert peers.version("poimen-evidence0@base") == "base" and peers.version("poimen") == ""
