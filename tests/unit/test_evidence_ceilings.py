"""The ceilings `evidence_policies --oracle` reports (issue 29): what any router among the
settings measured could reach, and a router by question type chosen on training projects."""

from __future__ import annotations

import pytest

from poimen_lab.eval.evidence_policies import ceilings


def _row(recall: float) -> dict[str, float]:
    return {"evidence_recall@10": recall}


def test_the_oracle_takes_each_questions_best_and_the_router_chooses_on_training_only() -> None:
    # Two settings; "wide" wins category 1 on the training project and loses it held out.
    per = {
        "today": {"t1": _row(0.5), "t2": _row(1.0), "h1": _row(1.0), "h2": _row(0.0)},
        "wide": {"t1": _row(1.0), "t2": _row(0.5), "h1": _row(0.0), "h2": _row(0.5)},
    }
    cats = {"t1": 1, "t2": 2, "h1": 1, "h2": 2}
    projects = {"t1": "train", "t2": "train", "h1": "other", "h2": "other"}
    got = ceilings(per, cats, projects, {"train"})
    assert got["oracle"]["all"] == pytest.approx((1.0 + 1.0 + 1.0 + 0.5) / 4)
    assert got["oracle"]["cat 1"] == pytest.approx(1.0)
    assert got["chosen"] == {"1": "wide", "2": "today"}
    # Routed: t1 and h1 by "wide", t2 and h2 by "today".
    assert got["by type"]["all"] == pytest.approx((1.0 + 1.0 + 0.0 + 0.0) / 4)
    assert got["held out"]["cat 1"] == (pytest.approx(0.0), pytest.approx(1.0))
    assert got["held out"]["cat 2"] == (pytest.approx(0.0), pytest.approx(0.0))


def test_a_tie_on_training_keeps_the_earlier_setting() -> None:
    per = {"today": {"q": _row(0.5)}, "other": {"q": _row(0.5)}}
    got = ceilings(per, {"q": 3}, {"q": "train"}, {"train"})
    assert got["chosen"] == {"3": "today"}
