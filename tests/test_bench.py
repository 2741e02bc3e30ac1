"""`poimen-memory bench` on a tiny synthetic corpus (the HTTP part is covered separately)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest

from poimen_lab.bench import synthetic
from poimen_lab.bench.ann import matched, recall
from poimen_lab.bench.command import NATURAL_DEFAULT
from poimen_lab.bench.curve import plot as plot_curve
from poimen_lab.bench.curve import rows
from poimen_memory.cli.main import main


@pytest.fixture
def env(empty_url: str, work_dir: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("POIMEN_DATABASE_URL", empty_url)
    monkeypatch.setenv("POIMEN_HOME", str(work_dir))
    monkeypatch.delenv("POIMEN_EMBEDDINGS_URL", raising=False)
    return empty_url


def _databases(admin: psycopg.Connection[Any]) -> set[str]:
    return {r[0] for r in admin.execute("SELECT datname FROM pg_database").fetchall()}


def test_tiny_bench_end_to_end(
    env: str, tmp_path: Path, admin: psycopg.Connection[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    before = _databases(admin)
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    args = [
        "bench",
        "--nodes",
        "500",
        "--queries",
        "20",
        "--no-http",
        "--ingest-nodes",
        "8",
        "--json",
        str(out),
        "--plot",
        str(png),
    ]
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert r["nodes"] == 500 and r["load"]["hnsw_build_seconds"] > 0 and r["load"]["edges"] > 0
    for label in ("unfiltered", "filtered_1pct"):
        a = r["ann"][label]
        assert [x["ef_search"] for x in a["ours"]] == [x["ef_search"] for x in a["hnswlib"]]
        # At ef_search 400 both graphs are searched exhaustively at this size.
        assert a["ours"][-1]["recall@10"] >= 0.95
        assert a["numpy"]["recall@10"] >= 0.95  # numpy and exact_search agree (up to ties)
        assert a["matched"] and all(x["p50_ms"] > 0 for x in a["ours"])
    assert r["ann"]["filtered_1pct"]["filter_nodes"] < 20
    lx = r["lexical"]
    assert lx["identical_top10"] >= 0.9 and lx["lexical_search"]["p50_ms"] > 0
    assert r["fuse_rrf_2x50"]["p50_ms"] > 0 and r["provenance_walk_10"]["p50_ms"] > 0
    assert r["l0_reached_per_query"] > 0
    assert r["ingest"]["nodes"] == 8 and r["ingest"]["ingest_nodes_per_s"] > 0
    assert "http" not in r and "lexical_search_over_bm25s_p50" in r["ratios"]
    # The acceptance table: every part that ran has its ratio, and the goals print.
    for key in ("filtered_over_unfiltered_p50", "ingest_over_raw_embed"):
        assert r["ratios"][key] > 0
    assert 0 <= r["ratios"]["filtered_limit_filled"] <= 1  # the 1% project has < 10 nodes here
    assert "http_p50_over_inprocess_p50" not in r["ratios"]  # --no-http
    if NATURAL_DEFAULT.joinpath("nodes.jsonl").exists():
        assert r["lexical_natural"]["identical_top10"] >= 0.9
        assert r["ratios"]["lexical_natural_corpus"] == "scifact"
    assert png.stat().st_size > 0
    out_text = capsys.readouterr().out
    assert "recall@10" in out_text and "http_rps8_over_embed_rps8" in out_text
    assert _databases(admin) == before  # the benchmark database was dropped

    # The cost curve reads the same JSON: one column per run, in size order, each stage's
    # value the run's own; stages a --no-http run lacks are empty, not an error.
    small = dict(r, nodes=100)
    curve = {row[0]: row[1:] for row in rows([r, small])}
    assert curve["exact_search"] == [r["ann"]["unfiltered"]["exact_search"]["p50_ms"]] * 2
    assert curve["GET /memory/query, 1 client"] == [None, None]
    plot_curve(tmp_path / "curve.png", [small, r])
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_synthetic_corpus_shape() -> None:
    c = synthetic.generate(2000, 16, 10, seed=3)
    assert c.vectors.shape == (2000, 16) and c.query_vectors.shape == (10, 16)
    assert np.allclose(np.linalg.norm(c.vectors, axis=1), 1, atol=1e-5)
    share = {lv: c.levels.count(lv) / 2000 for lv in ("L0", "L1", "L2")}
    assert 0.6 < share["L0"] < 0.8 and 0.02 < share["L2"] < 0.09
    assert 0 < c.projects.count(synthetic.SMALL) < 60
    for i, ps in enumerate(c.parents):
        below = {"L0": None, "L1": "L0", "L2": "L1"}[c.levels[i]]
        assert all(c.levels[p] == below and c.projects[p] == c.projects[i] for p in ps)
    assert any(c.parents[i] for i in range(2000) if c.levels[i] == "L2")
    again = synthetic.generate(2000, 16, 10, seed=3)
    assert again.texts == c.texts and np.array_equal(again.vectors, c.vectors)


def test_matched_recall_and_recall() -> None:
    assert recall([[1, 2, 3]], [[1, 2, 4]]) == pytest.approx(2 / 3)
    ours = [
        {"ef_search": 10, "recall@10": 0.9, "p50_ms": 2.0},
        {"ef_search": 40, "recall@10": 0.99, "p50_ms": 4.0},
    ]
    peer = [{"ef_search": 10, "recall@10": 0.95, "p50_ms": 0.1}]
    rows = {m["target_recall"]: m for m in matched(ours, peer)}
    assert rows[0.9]["ratio_ours_over_peer"] == 20.0 and rows[0.95]["ours_ef"] == 40
    assert "peer_ef" not in rows[0.99] and "ratio_ours_over_peer" not in rows[0.99]


def test_http_load_against_the_fixture_database(fixture_url: str) -> None:
    from poimen_lab.bench.http import run

    texts = [f"kong upload body buffer incident number {i}" for i in range(5 + 2 * 4)]
    rows = run(fixture_url, texts, concurrency=(1, 2), requests=4)
    assert [r["clients"] for r in rows] == [1, 2]
    for r in rows:
        assert r["errors"] == 0 and r["requests"] == 4 and r["req_per_s"] > 0
        assert 0 < r["p50_ms"] <= r["p95_ms"] and sum(r["strategies"].values()) == 4
        # Each request embeds (the server process) and runs statements (its sessions).
        assert r["server_cpu_ms"] > 0 and r["database_cpu_ms"] > 0


def test_the_service_query_path_in_process(fixture_url: str, embedder: Any) -> None:
    """inprocess.service runs the service's own Retriever.query with no HTTP in front, over
    the same pool and role, and counts its CPU as the HTTP load does."""
    from poimen_lab.bench import inprocess

    texts = [f"kong upload body buffer incident number {i}" for i in range(5 + 2 * 4)]
    params = {"limit": "3", "evidence": "0", "project": "poimen"}
    rows = inprocess.service(fixture_url, embedder, texts, params, concurrency=(1, 2), requests=4)
    assert [r["clients"] for r in rows] == [1, 2]
    for r in rows:
        assert r["errors"] == 0 and r["requests"] == 4 and 0 < r["p50_ms"] <= r["p95_ms"]
        assert r["server_cpu_ms"] > 0 and r["database_cpu_ms"] > 0
    bad = inprocess.service(
        fixture_url, embedder, texts, {**params, "project": "no-such-project"},
        concurrency=(1,), requests=4,
    )  # fmt: skip
    assert bad[0]["errors"] == 4  # an unknown project is counted, as a 404 would be


def test_two_versions_side_by_side(fixture_url: str) -> None:
    """poimen_lab.bench.versions with this checkout on both sides: every request answered,
    both servers measured, the ratios those of the numbers it reports."""
    from poimen_lab.bench.versions import run

    questions = [{"text": f"kong upload body buffer {i}", "project": "poimen"} for i in range(13)]
    env = {"POIMEN_DATABASE_URL": fixture_url}
    out = run(env, env, questions, single=4, block=2, concurrency=2, limit=3)
    for v in ("A", "B"):
        assert 0 < out[v]["p50_ms"] <= out[v]["p95_ms"]
        assert len(out[v]["req_per_s_2"]) == 2 and min(out[v]["req_per_s_2"]) > 0
    assert out["ratios"]["p50_b_over_a"] == round(out["B"]["p50_ms"] / out["A"]["p50_ms"], 3)
    with pytest.raises(ValueError, match="need 13 questions"):
        run(env, env, questions[:12], single=4, block=2, concurrency=2)


def test_the_http_ratios_are_the_runs_they_name() -> None:
    """Each HTTP ratio divides the two runs its name says, and the evidence-list pair has a
    goal of its own: the default answer through the service's role costs what the owner's
    does (row-level security adds no scan)."""
    from poimen_lab.bench.command import GOALS, _ratios

    def one(p50: float, rps: float = 1.0) -> list[dict[str, Any]]:
        return [{"clients": 1, "p50_ms": p50}, {"clients": 8, "req_per_s": rps}]

    r: dict[str, Any] = {
        "load": {"hnsw_build_seconds": 2.0},
        "ann": {"hnswlib_build_seconds": 1.0, "unfiltered": {"exact_search": {"p50_ms": 4.0},
                "numpy": {"p50_ms": 2.0}, "matched": [], "ours": []},
                "filtered_1pct": {"matched": [], "ours": []}},
        "lexical": {"ratio_p50_ours_over_bm25s": 3.0},
        "http": one(30.0, 60.0), "http_key": one(33.0, 50.0), "http_owner": one(24.0),
        "http_evidence": [{"clients": 1, "p50_ms": 45.0}],
        "http_owner_evidence": [{"clients": 1, "p50_ms": 40.0}],
        "inprocess": {"p50_ms": 20.0}, "embed_only": {"queries_per_s": 100.0},
        "service_inprocess": one(25.0, 75.0),
    }  # fmt: skip
    ratios = _ratios(r)
    # Where the time goes: HTTP over the service's own path, that path over the reference.
    assert ratios["http_p50_over_service_p50"] == 1.2
    assert ratios["http_rps8_over_service_rps8"] == 0.8
    assert ratios["service_p50_over_inprocess_p50"] == 1.25
    assert ratios["service_rps8_over_embed_rps8"] == 0.75
    assert ratios["http_p50_over_inprocess_p50"] == 1.5
    assert ratios["http_key_rps8_over_embed_rps8"] == 0.5
    assert ratios["http_p50_over_owner_p50"] == 1.25
    assert ratios["http_evidence_p50_over_owner_p50"] == 1.12
    assert GOALS["http_evidence_p50_over_owner_p50"] == (1.2, "<=")
    r["http_evidence"][0]["errors"] = 200  # every request failed: nothing to compare
    assert "http_evidence_p50_over_owner_p50" not in _ratios(r)
    del r["http_owner_evidence"]
    assert "http_evidence_p50_over_owner_p50" not in _ratios(r)


# --- the realistic corpus and bench-recall (issue 28) ------------------------------------


@pytest.fixture
def real_folder(tmp_path: Path) -> Path:
    """The project's own fixture as a data folder (nodes.jsonl, queries.jsonl): the
    evaluation sets are never test inputs."""
    folder = tmp_path / "fixture-data"
    folder.mkdir()
    fixtures = Path(__file__).parent / "fixtures"
    (folder / "nodes.jsonl").write_text((fixtures / "memory_nodes.jsonl").read_text())
    (folder / "queries.jsonl").write_text((fixtures / "eval_queries.jsonl").read_text())
    return folder


def test_realistic_corpus_shape(real_folder: Path, tmp_path: Path) -> None:
    from poimen_lab.bench import realistic

    calls: list[int] = []

    def embed(texts: list[str]) -> Any:  # deterministic stand-in vectors, counted
        calls.append(len(texts))
        rng = np.random.default_rng(len(texts))
        return rng.standard_normal((len(texts), 24)).astype(np.float32)

    real = realistic.embed_cached([real_folder], embed, "stand-in", tmp_path / "cache")
    again = realistic.embed_cached([real_folder], embed, "stand-in", tmp_path / "cache")
    assert len(calls) == 2  # texts and questions once; the second call read the cache
    assert np.array_equal(again.vectors, real.vectors)
    assert list((tmp_path / "cache").glob("real-*.npz"))
    c = realistic.generate(real, 3000, 7, seed=1, projects=40)
    assert c.vectors.shape == (3000, 24) and c.query_vectors.shape == (7, 24)
    assert np.allclose(np.linalg.norm(c.vectors, axis=1), 1, atol=1e-5)
    sizes = sorted((c.projects.count(p) for p in set(c.projects)), reverse=True)
    assert len(sizes) == 40 and sum(sizes) == 3000
    assert sizes[0] == c.projects.count(synthetic.MAIN)  # the largest is the bench's main
    assert 0.1 < sizes[0] / 3000 < 0.3 and sizes[0] > 10 * sizes[-1]  # Zipf: 1/r
    assert 0 < c.projects.count(synthetic.SMALL) <= 0.03 * 3000  # the one nearest 1%
    # Every node is a real text, and lies near a real vector (the mix of a real vector and
    # one of its neighbours, plus noise).
    assert set(c.texts) <= set(real.texts)
    nearest_real = (c.vectors @ real.vectors.T).max(axis=1)
    assert np.median(nearest_real) > 0.7
    assert set(c.query_texts) <= set(real.questions)
    same = realistic.generate(real, 3000, 7, seed=1, projects=40)
    assert same.texts == c.texts and np.array_equal(same.vectors, c.vectors)


def test_bench_recall_on_the_realistic_corpus(
    env: str, real_folder: Path, tmp_path: Path, admin: psycopg.Connection[Any]
) -> None:
    """bench-recall at a tiny size, on real MiniLM vectors of the fixture's texts: as the
    service's role under row-level security, the exact stage returns numpy's top 10 for every
    project under exact_scan_max_nodes (200 here), side by side with the HNSW path; the
    largest project (past both thresholds) gets graphs of its own at load, measured beside
    the shared graph's filtered scan; memory_query()'s answers against an exact semantic leg."""
    before = _databases(admin)
    out = tmp_path / "recall.json"
    args = ["bench-recall", "--corpus", "real", "--data", str(tmp_path), "--cache",
            str(tmp_path / "cache"), "--nodes", "1500", "--queries", "6", "--projects", "30",
            "--exact-scan-max-nodes", "200", "--project-graph-min-nodes", "200",
            "--answer-queries", "3", "--http-requests", "2", "--json", str(out)]  # fmt: skip
    # --data names the folder holding the sources: the fixture folder under a source's name
    (tmp_path / "fixture-data").rename(tmp_path / "locomo-dev")
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert r["load"]["project_graphs"] >= 1
    by = {(x["scope"], x["setting"]): x for x in r["results"]}
    assert by[("unfiltered", "default")]["path"] == "shared graph, ef 100"
    assert by[("unfiltered", "default")]["recall@10"] >= 0.9
    assert by[("unfiltered", "ef_search 400")]["path"] == "shared graph, ef 400"
    projects = [x for x in r["results"] if x["project"] is not None]
    largest = max(projects, key=lambda x: x["nodes"])
    owned = {x["setting"]: x for x in projects if x["project"] == largest["project"]}
    assert owned["default"]["path"] == "own graph, ef 400", owned
    assert owned["shared graph"]["path"] == "shared graph, ef 400", owned
    assert owned["HNSW, ef_search 200"]["path"] == "own graph, ef 200", owned
    small = [x for x in projects if x["nodes"] <= 200]
    assert small
    for x in projects:
        assert x["p50_ms"] > 0 and x["queries"] == 6
        assert x["recall@10"] >= 0.5, x
    for x in small:
        if x["setting"] == "default":
            assert x["path"] == "exact" and x["recall@10"] == 1.0, x
        else:
            assert x["path"].startswith("shared graph"), x
    answers = {a["scope"]: a for a in r["answers"]}
    assert set(answers) == {x["scope"] for x in r["results"]}
    for a in answers.values():
        assert a["queries"] == 3 and 0.5 <= a["recall@10"] <= 1.0 and a["exact_p50_ms"] > 0, a
    # GET /memory/query per scope, one client and eight, beside the embedder's own rate
    assert [h["scope"] for h in r["http"]["scopes"]] == [x["scope"] for x in r["answers"]]
    for h in r["http"]["scopes"]:
        assert [(x["clients"], x["requests"], x["errors"]) for x in h["loads"]] == [
            (1, 2, 0),
            (8, 2, 0),
        ], h
    assert r["http"]["embed_only"]["queries_per_s"] > 0
    assert r["profile"]["real"]["nn1_cosine_p50"] > r["profile"]["real"]["random_pair_cosine_p50"]
    assert _databases(admin) == before
    # the plot of recall against the store's size reads the run's JSON
    from poimen_lab.bench import recall

    png = tmp_path / "recall.png"
    assert recall.main([str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_on_the_realistic_corpus(env: str, real_folder: Path, tmp_path: Path) -> None:
    """`poimen-memory bench --corpus real`: the same parts on the realistic corpus, whose
    largest project is the bench's main and the one nearest 1% its small one."""
    (tmp_path / "fixture-data").rename(tmp_path / "scifact")
    out = tmp_path / "bench.json"
    args = ["bench", "--corpus", "real", "--data", str(tmp_path), "--cache",
            str(tmp_path / "cache"), "--nodes", "800", "--queries", "5", "--projects", "20",
            "--no-http", "--ingest-nodes", "0", "--natural", str(tmp_path / "none"),
            "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert r["corpus"] == "real" and r["dim"] == 384
    small = r["ann"]["filtered_1pct"]
    assert 0 < small["filter_nodes"] < 80
    # The bench's 1% project is under exact_scan_max_nodes: the exact stage at every ef.
    assert all(x["recall@10"] == 1.0 for x in small["ours"])
    assert r["ann"]["unfiltered"]["ours"][-1]["recall@10"] >= 0.9


def test_bench_fair_building_blocks(tmp_path: Path) -> None:
    """bench-fair's corpus split, costly queries and argument checks, without a server."""
    from poimen_lab.bench.fair import classify, costly_texts, split_projects

    nodes = [
        {"id": "locomo:c1:D1:1", "project": "c1", "parents": []},
        {"id": "locomo:c1:D2:1", "project": "c1", "parents": []},
        {"id": "locomo:c1:D2:1#A0", "project": "c1", "parents": ["locomo:c1:D2:1"]},
        {"id": "locomo:c1:S2", "project": "c1", "parents": ["locomo:c1:D2:1#A0", "locomo:c1:D1:1"]},
        {"id": "locomo:c2:D3:1", "project": "c2", "parents": []},
    ]
    records, projects = split_projects(nodes, 1, whole=["c2"])
    assert projects == {"c1": ["c1.s01", "c1.s02"], "c2": ["c2"]}
    by_id = {r["id"]: r for r in records}
    assert by_id["locomo:c1:S2"]["project"] == "c1.s02"
    # provenance stays inside a project: the parent in session 1 is dropped
    assert by_id["locomo:c1:S2"]["parents"] == ["locomo:c1:D2:1#A0"]
    assert split_projects(nodes, 2)[1]["c1"] == ["c1.s01"]
    words = [f"word{i:03d}" for i in range(500)]
    texts = costly_texts(words, 3, 200, seed=1)
    assert len(set(texts)) == 3
    for t in texts:
        assert 190 <= len(t) <= 200 and len(set(t.split())) == len(t.split())
    assert [classify(s) for s in (200, 429, 503, None)] == ["200", "429", "503", "connection error"]
    assert main(["bench-fair", "--rounds", "0"]) == 2
    assert main(["bench-fair", "--setups", "fair,nosuch"]) == 2
    assert main(["bench-fair", "--setups", "x:HOME=/"]) == 2  # only POIMEN_ settings
    assert main(["bench-fair", "--data", str(tmp_path)]) == 2  # no nodes.jsonl there


def test_bench_fair_counts_every_status(fixture_url: str, tmp_path: Path) -> None:
    """A tiny bench-fair run against the fixture database, as the service's role with four
    keys: a rate of one request per key (a bucket of 1, refilled every 1,000 s) makes each
    key's first request a 200 and every later one a 429, so the tally is known exactly."""
    from poimen_lab.bench.fair import Tenants, run, summarise
    from poimen_lab.bench.http import CPU
    from poimen_lab.live_server import live_server_process
    from poimen_memory.db.connect import connect, ensure_service_login
    from service_client import make_key

    with connect(fixture_url, autocommit=True) as conn:
        ensure_service_login(conn, "poimen_service")
    service = fixture_url.replace("postgresql://postgres@", "postgresql://poimen_service@")
    keys = [make_key(fixture_url, ["poimen"]) for _ in range(4)]
    texts = ["kong upload body buffer", "why do uploads fail", "gateway limits"]
    tenants = Tenants(
        normal={f"normal-{i}": (keys[i], texts) for i in range(3)}, costly=(keys[3], texts)
    )
    env = {"POIMEN_DATABASE_URL": service, "POIMEN_HTTP_CLIENT_RATE": "0.001",
           "POIMEN_HTTP_CLIENT_BURST": "1", "POIMEN_HTTP_CLIENT_INFLIGHT": "2"}  # fmt: skip
    with live_server_process(env, tmp_path / "server.log") as (base, pid):
        phases = run(
            {"tiny": (base, CPU(pid, fixture_url))}, tenants,
            rounds=1, seconds=0.5, concurrency=1, parallel=2, pause=0.02,
        )["tiny"]  # fmt: skip
    assert [p["attack"] for p in phases] == [False, True]
    assert set(phases[0]["keys"]) == {"normal-0", "normal-1", "normal-2"}
    assert set(phases[1]["keys"]) == {"normal-0", "normal-1", "normal-2", "costly"}
    sm = summarise(phases)
    for name, k in sm["keys"].items():
        seen = Counter(k.get("alone_statuses", {})) + Counter(k["attack_statuses"])
        assert seen["200"] == 1 and seen["429"] > 0 and set(seen) == {"200", "429"}, name
        if name != "costly":
            assert k["ratio"] is not None and k["alone_per_s"] is not None
    assert "costly" not in phases[0]["keys"] and "alone_per_s" not in sm["keys"]["costly"]
    assert all(p["server_cpu_s"] >= 0 and p["cpu_cores_busy"] >= 0 for p in phases)
