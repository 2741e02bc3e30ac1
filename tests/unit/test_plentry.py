import json
from typing import NoReturn

import pytest

from poimen_core.optimizer import OPTIMIZER_VERSION, QueryOptimizerError, optimize_query
from poimen_core.plentry import optimize_query_json, plan_for_sql


class FakePlpyError(Exception):
    def __init__(self, msg: str, kwargs: dict[str, str | None]) -> None:
        super().__init__(msg)
        self.msg = msg
        self.kwargs = kwargs


class FakePlpy:
    """Stands in for PL/Python's plpy, whose error() raises and never returns."""

    def error(
        self,
        msg: str,
        /,
        *,
        detail: str | None = None,
        hint: str | None = None,
        sqlstate: str | None = None,
    ) -> NoReturn:
        raise FakePlpyError(msg, {"detail": detail, "hint": hint, "sqlstate": sqlstate})


def test_optimize_query_json_matches_to_dict() -> None:
    raw = "deployment failures in 2024"
    assert json.loads(optimize_query_json(raw)) == optimize_query(raw).to_dict()


def test_optimize_query_json_null_raises() -> None:
    with pytest.raises(QueryOptimizerError, match="NULL"):
        optimize_query_json(None)


def test_optimize_query_json_is_ascii_safe() -> None:
    out = optimize_query_json("straße 🚀 #日本語")
    assert out.isascii()
    assert json.loads(out)["entities"]["tag"] == ["日本語"]


def test_plan_for_sql_returns_json_on_success() -> None:
    data = json.loads(plan_for_sql(FakePlpy(), "Compare Docker and Kubernetes"))
    assert data["search_strategy"] == "Hybrid"
    assert data["question_type"] == "Comparative"


@pytest.mark.parametrize(("raw", "received"), [(None, "NULL"), ("  \t ", "a 4-character string")])
def test_plan_for_sql_reports_bad_input_as_sql_error(raw: str | None, received: str) -> None:
    with pytest.raises(FakePlpyError) as info:
        plan_for_sql(FakePlpy(), raw)
    assert info.value.msg.startswith("poimen query optimizer:")
    assert info.value.kwargs["sqlstate"] == "22023"
    detail = info.value.kwargs["detail"]
    assert detail is not None
    assert received in detail
    assert OPTIMIZER_VERSION in detail
    assert info.value.kwargs["hint"]


def test_plan_for_sql_lets_unexpected_errors_through(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(raw: str | None, reference_time: str | None = None) -> str:
        raise RuntimeError("bug")

    monkeypatch.setattr("poimen_core.plentry.optimize_query_json", boom)
    with pytest.raises(RuntimeError, match="bug"):
        plan_for_sql(FakePlpy(), "anything at all")
