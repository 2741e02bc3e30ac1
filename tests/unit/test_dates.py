"""Date extraction: each accepted form, relative terms against a fixed reference time,
and the rule that decides whether a mention asks to filter."""

from datetime import UTC, date, datetime, timedelta, timezone

import pytest

from poimen_core.dates import extract_dates, span
from poimen_core.optimizer import optimize_query

# A Wednesday, so "this week" and "last week" straddle nothing.
REF = datetime(2024, 3, 6, 15, 30, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "form", "since", "until"),
    [
        ("on 8 may 2023", "day month year", date(2023, 5, 8), date(2023, 5, 8)),
        ("on 8th december, 2023", "day month year", date(2023, 12, 8), date(2023, 12, 8)),
        ("on 21 of nov 2023", "day month year", date(2023, 11, 21), date(2023, 11, 21)),
        ("on december 1,2023", "month day year", date(2023, 12, 1), date(2023, 12, 1)),
        ("on october 24, 2023", "month day year", date(2023, 10, 24), date(2023, 10, 24)),
        ("on 2023-05-08", "iso", date(2023, 5, 8), date(2023, 5, 8)),
        ("in may 2023", "month year", date(2023, 5, 1), date(2023, 5, 31)),
        ("in february 2024", "month year", date(2024, 2, 1), date(2024, 2, 29)),
        ("during dec. 2023", "month year", date(2023, 12, 1), date(2023, 12, 31)),
        ("in 2024", "year", date(2024, 1, 1), date(2024, 12, 31)),
        ("yesterday", "relative", date(2024, 3, 5), date(2024, 3, 5)),
        ("today", "relative", date(2024, 3, 6), date(2024, 3, 6)),
        ("last week", "relative", date(2024, 2, 26), date(2024, 3, 3)),
        ("this week", "relative", date(2024, 3, 4), date(2024, 3, 10)),
        ("past week", "relative", date(2024, 2, 29), date(2024, 3, 6)),
        ("last month", "relative", date(2024, 2, 1), date(2024, 2, 29)),
        ("this month", "relative", date(2024, 3, 1), date(2024, 3, 31)),
        ("last year", "relative", date(2023, 1, 1), date(2023, 12, 31)),
    ],
)
def test_each_form(text: str, form: str, since: date, until: date) -> None:
    (found,) = extract_dates(text, REF)
    assert (found.form, found.since, found.until) == (form, since, until)
    assert found.asks_filter


def test_last_month_in_january_is_december_of_the_year_before() -> None:
    (found,) = extract_dates("last month", datetime(2024, 1, 15, tzinfo=UTC))
    assert (found.since, found.until) == (date(2023, 12, 1), date(2023, 12, 31))


def test_relative_terms_use_the_utc_day_of_the_reference() -> None:
    # 01:00 on the 7th at UTC+3 is still the 6th in UTC.
    ref = datetime(2024, 3, 7, 1, 0, tzinfo=timezone(timedelta(hours=3)))
    (found,) = extract_dates("yesterday", ref)
    assert found.since == date(2024, 3, 5)


def test_a_day_is_not_also_a_month_and_a_year() -> None:
    assert [d.form for d in extract_dates("what did she say on 8 may 2023", REF)] == [
        "day month year"
    ]


@pytest.mark.parametrize(
    "text", ["on 31 february 2023", "on 2023-13-01", "port 8080", "v2024", "#2024", "may i ask"]
)
def test_not_dates(text: str) -> None:
    assert extract_dates(text, REF) == []


@pytest.mark.parametrize(
    ("text", "asks"),
    [
        ("the 2024 roadmap", False),
        ("failures in 2024", True),
        ("what did tim read on 8th december, 2023?", True),
        ("how many pets, as of december 2023?", False),
        ("what happened the monday before july 24, 2023?", False),
    ],
)
def test_only_a_preposition_or_a_relative_term_asks_to_filter(text: str, asks: bool) -> None:
    (found,) = extract_dates(text, REF)
    assert found.asks_filter is asks


def test_span_covers_every_range_that_asks_and_nothing_else() -> None:
    ranges = extract_dates("in may 2023 or during july 2023, not the 2020 plan", REF)
    assert span(ranges) == (date(2023, 5, 1), date(2023, 7, 31))
    assert span(extract_dates("the 2020 plan", REF)) is None


def test_optimizer_reports_dates_and_the_filter_they_ask_for() -> None:
    data = optimize_query("What did Audrey eat for dinner on October 24, 2023?").to_dict()
    assert data["time_filter"] == {"since": "2023-10-24", "until": "2023-10-24"}
    assert data["dates"][0]["text"] == "october 24, 2023"
    # an absolute date needs no reference time: none given, none recorded
    assert data["reference_time"] is None
    rel = optimize_query("notes from last week", REF).to_dict()
    assert rel["reference_time"] == REF.isoformat()
    assert rel["time_filter"] == {"since": "2024-02-26", "until": "2024-03-03"}
