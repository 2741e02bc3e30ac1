"""Our measure definitions agree with ir-measures (trec_eval) on small synthetic runs."""

from __future__ import annotations

import random

import ir_measures
import pytest
from ir_measures import RR, R, nDCG

from poimen_lab.measures import MEASURES, coverage, evaluate, per_query, percentile

IR = {"ndcg@10": nDCG @ 10, "recall@10": R @ 10, "recall@100": R @ 100, "mrr@10": RR @ 10}


def _synthetic(seed: int) -> tuple[dict[str, dict[str, int]], dict[str, list[str]]]:
    rng = random.Random(seed)
    docs = [f"d{i}" for i in range(300)]
    qrels: dict[str, dict[str, int]] = {}
    run: dict[str, list[str]] = {}
    for q in range(40):
        qid = f"q{q}"
        judged = rng.sample(docs, rng.randint(1, 8))
        # Graded relevance, some judged non-relevant (0) documents too.
        qrels[qid] = {d: rng.choice([0, 1, 1, 2, 3]) for d in judged}
        if all(r == 0 for r in qrels[qid].values()):
            qrels[qid][judged[0]] = 1
        pool = list(judged) + rng.sample(docs, 150)
        rng.shuffle(pool)
        run[qid] = list(dict.fromkeys(pool))[: rng.randint(1, 140)]
    return qrels, run


def _ir_run(run: dict[str, list[str]]) -> dict[str, dict[str, float]]:
    # Strictly decreasing scores: trec_eval's own tie-breaking never comes into play.
    return {q: {d: float(len(ids) - i) for i, d in enumerate(ids)} for q, ids in run.items()}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_per_query_values_match_ir_measures(seed: int) -> None:
    qrels, run = _synthetic(seed)
    expected: dict[tuple[str, str], float] = {}
    for m in ir_measures.iter_calc(list(IR.values()), qrels, _ir_run(run)):
        expected[(str(m.measure), m.query_id)] = m.value
    for name, measure in IR.items():
        ours = per_query(qrels, run, name)
        for qid in qrels:
            assert ours[qid] == pytest.approx(expected[(str(measure), qid)], abs=1e-9), (name, qid)


def test_aggregates_match_ir_measures() -> None:
    qrels, run = _synthetic(7)
    agg = ir_measures.calc_aggregate(list(IR.values()), qrels, _ir_run(run))
    ours = evaluate(qrels, run, list(MEASURES))
    for name, measure in IR.items():
        assert ours[name] == pytest.approx(agg[measure], abs=1e-9)


def test_missing_and_empty_runs_count_as_zero() -> None:
    qrels = {"a": {"x": 1}, "b": {"y": 1}, "c": {"z": 1}}
    run = {"a": ["x"], "b": []}
    assert evaluate(qrels, run, ["recall@10", "mrr@10", "ndcg@10"]) == {
        "recall@10": pytest.approx(1 / 3),
        "mrr@10": pytest.approx(1 / 3),
        "ndcg@10": pytest.approx(1 / 3),
    }


def test_hand_computed_values() -> None:
    judged = {"a": 1, "b": 2, "n": 0}
    ranked = ["n", "b", "x", "a"]
    fn, k = MEASURES["ndcg@10"]
    dcg = 2 / 1.584962500721156 + 1 / 2.321928094887362
    idcg = 2 + 1 / 1.584962500721156
    assert fn(judged, ranked, k) == pytest.approx(dcg / idcg)
    assert MEASURES["mrr@10"][0](judged, ranked, 10) == pytest.approx(0.5)
    assert MEASURES["recall@10"][0](judged, ranked[:2], 10) == pytest.approx(0.5)
    assert coverage({"a", "b"}, {"b", "c"}) == 0.5 and coverage(set(), {"c"}) == 0.0


def test_percentile_matches_numpy_linear() -> None:
    import numpy as np

    xs = [5.0, 1.0, 9.0, 3.0, 7.5, 2.2]
    for p in (0, 50, 95, 100):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    assert percentile([], 50) == 0.0
