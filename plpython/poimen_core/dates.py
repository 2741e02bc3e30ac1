"""Dates in a query's text, as day ranges relative to a reference time.

Stdlib only (it runs inside PL/Python too). The optimizer reports every date it finds;
whether one becomes a time filter is the retrieval policy's decision (memory.policy(),
``extracted_dates``), so this module only says what the text names and whether the
wording asks to restrict by it ("on 8 May 2023", "in 2024", "last week") or merely
mentions it ("the 2024 roadmap").

Ranges are whole UTC days: ``since`` is the first day and ``until`` the last day, both
inclusive, the same convention as the ``since``/``until`` arguments of memory.query and
GET /memory/query, so an extracted range can be passed back as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

__all__ = ["DateRange", "extract_dates", "span"]

_MONTHS = {
    name: number
    for number, names in enumerate(
        (
            ("january", "jan"),
            ("february", "feb"),
            ("march", "mar"),
            ("april", "apr"),
            ("may",),
            ("june", "jun"),
            ("july", "jul"),
            ("august", "aug"),
            ("september", "sept", "sep"),
            ("october", "oct"),
            ("november", "nov"),
            ("december", "dec"),
        ),
        start=1,
    )
    for name in names
}
_MONTH = "(" + "|".join(sorted(_MONTHS, key=len, reverse=True)) + r")\.?"
_DAY = r"([0-9]{1,2})(?:st|nd|rd|th)?"
_YEAR = r"((?:19|20)[0-9]{2})"
# A preposition right before the date is what makes a mention a restriction.
_ASKS = re.compile(r"(?:^|\W)(?:on|in|during|from)\s+(?:the\s+)?$")

# Most specific first; a span matched by one form is masked before the next runs, so
# "8 may 2023" is one day, not also a month and a year.
_FORMS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("iso", re.compile(r"(?<![\w-])([0-9]{4})-([0-9]{2})-([0-9]{2})(?![\w-])")),
    ("day month year", re.compile(rf"(?<!\w){_DAY}\s+(?:of\s+)?{_MONTH}\s*,?\s*{_YEAR}(?!\w)")),
    ("month day year", re.compile(rf"(?<!\w){_MONTH}\s+{_DAY}\s*,\s*{_YEAR}(?!\w)")),
    ("month year", re.compile(rf"(?<!\w){_MONTH}\s*,?\s+(?:of\s+)?{_YEAR}(?!\w)")),
    ("year", re.compile(rf"(?<![\w#@]){_YEAR}(?!\w)")),
    (
        "relative",
        re.compile(r"(?<!\w)(yesterday|today|(?:last|this|past) (?:week|month|year))(?!\w)"),
    ),
)


@dataclass(frozen=True)
class DateRange:
    text: str
    form: str
    since: date
    until: date
    asks_filter: bool
    """True when the wording restricts by the date: a preposition (on, in, during, from)
    before it, or a relative term ("last week"), which only means a time."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "form": self.form,
            "since": self.since.isoformat(),
            "until": self.until.isoformat(),
            "asks_filter": self.asks_filter,
        }


def extract_dates(text: str, reference: datetime | None = None) -> list[DateRange]:
    """Every date ``text`` (already lowercased) names, in order of appearance. Relative
    terms are resolved against ``reference`` (default: now), taken in UTC."""
    ref = (reference or datetime.now(UTC)).astimezone(UTC).date()
    found: list[tuple[int, DateRange]] = []
    masked = text
    for form, pattern in _FORMS:
        for m in pattern.finditer(masked):
            rng = _range(form, m.groups(), ref)
            if rng is None:
                continue  # "31 february 2023": not a date
            asks = form == "relative" or bool(_ASKS.search(text[: m.start()]))
            found.append((m.start(), DateRange(m.group(0), form, rng[0], rng[1], asks)))
        masked = pattern.sub(lambda m: " " * len(m.group(0)), masked)
    return [r for _, r in sorted(found, key=lambda x: x[0])]


def span(ranges: list[DateRange]) -> tuple[date, date] | None:
    """The smallest range covering every range that asks to filter: "between May and
    June 2023" names two months and means both."""
    asked = [r for r in ranges if r.asks_filter]
    if not asked:
        return None
    return min(r.since for r in asked), max(r.until for r in asked)


def _range(form: str, g: tuple[str | Any, ...], ref: date) -> tuple[date, date] | None:
    try:
        if form == "iso":
            d = date(int(g[0]), int(g[1]), int(g[2]))
            return d, d
        if form == "day month year":
            d = date(int(g[2]), _MONTHS[g[1]], int(g[0]))
            return d, d
        if form == "month day year":
            d = date(int(g[2]), _MONTHS[g[0]], int(g[1]))
            return d, d
    except ValueError:
        return None
    if form == "month year":
        return _month(int(g[1]), _MONTHS[g[0]])
    if form == "year":
        y = int(g[0])
        return date(y, 1, 1), date(y, 12, 31)
    return _relative(g[0], ref)


def _month(year: int, month: int) -> tuple[date, date]:
    first = date(year, month, 1)
    following = date(year + month // 12, month % 12 + 1, 1)
    return first, following - timedelta(days=1)


def _relative(term: str, ref: date) -> tuple[date, date]:
    if term == "today":
        return ref, ref
    if term == "yesterday":
        return ref - timedelta(days=1), ref - timedelta(days=1)
    which, unit = term.split(" ")
    if which == "past":  # a sliding window that ends today
        days = {"week": 7, "month": 30, "year": 365}[unit]
        return ref - timedelta(days=days - 1), ref
    back = 1 if which == "last" else 0  # "last" is the previous calendar unit
    if unit == "week":  # ISO weeks, Monday first
        monday = ref - timedelta(days=ref.weekday()) - timedelta(weeks=back)
        return monday, monday + timedelta(days=6)
    if unit == "month":
        y, m = (ref.year, ref.month - back) if ref.month > back else (ref.year - 1, 12)
        return _month(y, m)
    return date(ref.year - back, 1, 1), date(ref.year - back, 12, 31)
