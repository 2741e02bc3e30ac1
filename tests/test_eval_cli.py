"""`poimen-memory eval` end to end on the project's own fixture, in a fresh database."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from poimen_memory.cli.main import main

FIXTURES = Path(__file__).parent / "fixtures"
NODES = FIXTURES / "memory_nodes.jsonl"
QUERIES = FIXTURES / "eval_queries.jsonl"
QRELS = FIXTURES / "eval_qrels.jsonl"


@pytest.fixture
def env(empty_url: str, work_dir: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("POIMEN_DATABASE_URL", empty_url)
    monkeypatch.setenv("POIMEN_HOME", str(work_dir))  # PL/Python module goes under work_dir
    monkeypatch.delenv("POIMEN_RERANK_URL", raising=False)
    monkeypatch.delenv("POIMEN_EMBEDDINGS_URL", raising=False)
    return empty_url


def _eval(*extra: str) -> list[str]:
    return [
        "eval",
        "--nodes",
        str(NODES),
        "--queries",
        str(QUERIES),
        "--qrels",
        str(QRELS),
        "--quiet",
        "--embed-sample",
        "4",
        *extra,
    ]


def test_all_modes_json_plot_and_extras(
    env: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png, sweep = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "sweep.png"
    assert (
        main(_eval("--json", str(out), "--plot", str(png), "--bm25s", "--sweep", str(sweep))) == 0
    )
    result = json.loads(out.read_text())
    assert result["dataset"] == "fixtures" and result["queries"] == 8
    assert set(result["modes"]) == {
        "lexical",
        "semantic",
        "exact",
        "hybrid",
        "hybrid-convex",
        "cascade",
        "auto",
        "bm25s",
    }
    for name, m in result["modes"].items():
        assert {"ndcg@10", "recall@10", "recall@100", "mrr@10", "p50_ms", "p95_ms"} <= set(m), name
        assert all(0 <= m[k] <= 1 for k in ("ndcg@10", "recall@10", "recall@100", "mrr@10"))
        assert "evidence_recall@5" not in m and "l0_recall@10" not in m
    # All levels are searched: exact cosine search over 21 nodes finds every gold node by 100.
    assert result["modes"]["exact"]["recall@100"] == 1.0
    assert result["ingest"]["inserted"] == 21 and result["ingest"]["nodes_per_s"] > 0
    assert result["ingest"]["raw_embed_nodes_per_s"] > 0
    assert set(result["by_category"]["hybrid"]) == {"incident", "runbook"}
    cmp_ = result["bm25_comparison"]
    assert cmp_["bm25s"]["ndcg@10"] == pytest.approx(cmp_["postgres_sql"]["ndcg@10"], abs=1e-3)
    assert cmp_["identical_top10"] >= 0.75
    assert {"rrf", "convex", "cascade", "by_group"} <= set(result["sweep"]["best"])
    # The service's defaults (convex 0.4 or rrf 10, 50 candidates) are on the sweep's grid.
    assert result["sweep"]["vs_default_ndcg@10"]
    for d in result["sweep"]["vs_default_ndcg@10"].values():
        assert d["ci95_low"] <= d["diff"] <= d["ci95_high"]
    assert png.stat().st_size > 0 and sweep.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "ndcg@10" in printed and "hybrid-convex" in printed


def test_second_run_reuses_the_database(env: str, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main(_eval("--modes", "lexical", "--embed-sample", "0")) == 0
    assert main(_eval("--modes", "lexical", "--json", str(out), "--embed-sample", "0")) == 0
    result = json.loads(out.read_text())
    assert result["ingest"]["inserted"] == 0 and result["ingest"]["duplicates"] == 21
    assert "raw_embed_nodes_per_s" not in result["ingest"]


def test_evidence_walks_provenance_to_l0(env: str, tmp_path: Path) -> None:
    sessions = tmp_path / "qrels_sessions.jsonl"
    sessions.write_text(
        "".join(
            json.dumps({"query_id": q, "node_id": n, "score": 1}) + "\n"
            for q, n in [
                ("q1", "poimen:syn:1"),
                ("q2", "poimen:syn:1"),
                ("q3", "poimen:syn:2"),
                ("q6", "atlas:syn:1"),
            ]
        )
    )
    qrels = tmp_path / "qrels.jsonl"
    qrels.write_text(QRELS.read_text())
    out = tmp_path / "r.json"
    args = [
        "eval",
        "--nodes",
        str(NODES),
        "--queries",
        str(QUERIES),
        "--qrels",
        str(qrels),
        "--evidence",
        "--modes",
        "lexical,hybrid,exact",
        "--json",
        str(out),
        "--quiet",
        "--embed-sample",
        "0",
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["levels"] == ["L0"]
    hybrid = result["modes"]["hybrid"]
    for key in ("evidence_recall@5", "evidence_recall@10", "session_recall@10", "l0_recall@10"):
        assert 0 <= hybrid[key] <= 1, key
    # Every L1 of the fixture cites its L0 turns, so ten L1/L2 results cover most gold turns.
    assert hybrid["evidence_recall@10"] >= 0.75
    assert hybrid["evidence_recall@10"] >= hybrid["evidence_recall@5"]
    assert hybrid["l0_recall@10"] == hybrid["recall@10"]
    assert "evidence_recall@5" not in result["modes"]["exact"]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bad_inputs_exit_2_with_a_message(
    env: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.jsonl"
    assert (
        main(["eval", "--nodes", str(NODES), "--queries", str(missing), "--qrels", str(QRELS)]) == 2
    )
    assert "nope.jsonl: no such file" in capsys.readouterr().err

    bad_json = _write(tmp_path / "q.jsonl", ['{"id": "q1", "text": "x"}', "{not json"])
    assert (
        main(["eval", "--nodes", str(NODES), "--queries", str(bad_json), "--qrels", str(QRELS)])
        == 2
    )
    assert "q.jsonl:2: not valid JSON" in capsys.readouterr().err

    no_text = _write(tmp_path / "q2.jsonl", ['{"id": "q1"}'])
    assert (
        main(["eval", "--nodes", str(NODES), "--queries", str(no_text), "--qrels", str(QRELS)]) == 2
    )
    assert "'text' must be a non-empty string" in capsys.readouterr().err

    wrong = _write(
        tmp_path / "qrels.jsonl",
        [json.dumps({"query_id": f"q{i}", "node_id": f"x:{i}"}) for i in range(1, 9)],
    )
    assert (
        main(["eval", "--nodes", str(NODES), "--queries", str(QUERIES), "--qrels", str(wrong)]) == 2
    )
    assert "8 of 8 judgements name nodes that are not in the nodes file" in capsys.readouterr().err


def test_a_few_unknown_qrels_only_warn(
    env: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    qrels = _write(
        tmp_path / "qrels.jsonl",
        [*QRELS.read_text().splitlines(), '{"query_id": "q1", "node_id": "poimen:gone"}'],
    )
    args = [
        "eval",
        "--nodes",
        str(NODES),
        "--queries",
        str(QUERIES),
        "--qrels",
        str(qrels),
        "--modes",
        "lexical",
        "--quiet",
        "--embed-sample",
        "0",
    ]
    assert main(args) == 0
    assert "1 of 12 judgements name unknown nodes" in capsys.readouterr().err


def test_unknown_mode_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(_eval("--modes", "lexical,magic"))
    assert exc.value.code == 2
    assert "unknown mode" in capsys.readouterr().err


@pytest.mark.parametrize("default_fusion", ["convex", "rrf"])
def test_depth_100_path_agrees_with_the_real_path(fixture_url: str, default_fusion: str) -> None:
    """With every node a candidate (21 nodes), the stage-SQL ranking behind recall@100 must
    start with exactly what Retriever.query returned, whatever the service's fusion."""
    import asyncio

    from poimen_core.vocabulary import LEVELS
    from poimen_lab.eval.command import _corpus
    from poimen_lab.eval.data import load
    from poimen_lab.eval.runner import MODES, Runner
    from poimen_memory.db.connect import connect
    from poimen_memory.db.queries import q
    from poimen_memory.embedders.factory import build_embedder
    from poimen_memory.retrieval.policy import read_policy
    from poimen_memory.services import open_services
    from poimen_memory.settings import Settings

    settings = Settings.from_env({})
    data = load(NODES, QUERIES, QRELS)
    embedder = build_embedder(settings.embedding)
    with connect(fixture_url, autocommit=True) as conn:
        # The policy is the database's: set the default fusion there, as a DBA would.
        conn.execute(q("set_policy"), {"key": "fusion", "value": default_fusion})
        # The deep path ranks candidates before the relevance floor holds any back (the
        # floor is memory._after_fusion's, one home): compared here with the floor off.
        conn.execute(q("set_policy"), {"key": "min_cosine", "value": "-1"})
        corpus = _corpus(conn, data.records)
        policy = read_policy(conn)
    assert policy.fusion == default_fusion

    async def check() -> None:
        async with open_services(settings, url=fixture_url, embedder=embedder, wait=True) as svc:
            runner = Runner(
                svc.pool,
                embedder,
                settings,
                corpus,
                levels=LEVELS,
                limit=10,
                depth=100,
                retriever=svc.retriever,
                policy=policy,
            )
            for mode in (m for m in MODES if m != "hybrid-rerank"):
                for qy in data.queries:
                    out = await runner.run(mode, qy)
                    assert out.error is None and out.deep is not None
                    assert out.ranked, (mode, qy.id)
                    assert out.deep[: len(out.ranked)] == out.ranked, (mode, qy.id, out.fusion)

    asyncio.run(check())
