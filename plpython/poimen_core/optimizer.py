"""Query optimizer: decides how a free-text query should be searched.

Stdlib only, because the same file runs inside PostgreSQL's PL/Python on the
distribution's python3 (3.11+), where third-party packages are not available.

``optimize_query(raw)`` runs six stages (normalize, tokenize, extract entities,
analyse characteristics, classify question type, route) and returns a frozen
``QueryContext``. The routing table and the question-type precedence are
documented in docs/query-routing.md; keep the two in step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from poimen_core.dates import DateRange, extract_dates, span
from poimen_core.vocabulary import REFERENCE_TIME_HINT, REFERENCE_TIME_RULE, REFERENCE_YEARS

__all__ = [
    "ENTITY_KEYS",
    "MAX_QUERY_CHARS",
    "OPTIMIZER_VERSION",
    "QueryContext",
    "QueryOptimizerError",
    "QuestionType",
    "SearchStrategy",
    "check_reference_time",
    "optimize_query",
    "reference_time_error",
]

# Bump whenever a rule, pattern or confidence changes: the service compares it with
# the copy loaded into PL/Python to detect a stale deployment.
OPTIMIZER_VERSION = "1.1.0"

# Bounds the regex work and the size of what is echoed back; longer queries are
# almost always pasted documents, whose first 4096 characters carry the intent.
MAX_QUERY_CHARS = 4096

# Every context carries all four keys so callers never need .get() defaults.
ENTITY_KEYS = ("year", "phrase", "tag", "mention")

MIN_TOKENS_FOR_ROUTING = 3

QUERY_HINT = "Pass a query containing at least one non-whitespace character."


class QueryOptimizerError(ValueError):
    """Raised when a query cannot be optimized: not a string, empty after normalizing, or a
    reference time outside REFERENCE_YEARS. ``hint`` says what to pass instead."""

    def __init__(self, message: str, hint: str = QUERY_HINT) -> None:
        super().__init__(message)
        self.hint = hint


def reference_time_error(shown: str) -> QueryOptimizerError:
    return QueryOptimizerError(f"{REFERENCE_TIME_RULE}, got {shown}", hint=REFERENCE_TIME_HINT)


def check_reference_time(ts: datetime) -> datetime:
    """``ts`` in UTC when its year is within REFERENCE_YEARS; QueryOptimizerError otherwise
    (a naive timestamp is taken as UTC)."""
    try:
        utc = (ts if ts.tzinfo else ts.replace(tzinfo=UTC)).astimezone(UTC)
    except OverflowError:
        utc = None
    if utc is None or not REFERENCE_YEARS[0] <= utc.year <= REFERENCE_YEARS[1]:
        raise reference_time_error(ts.isoformat())
    return utc


class SearchStrategy(StrEnum):
    LexicalOnly = "LexicalOnly"
    LexicalFirst = "LexicalFirst"
    Hybrid = "Hybrid"
    # Never chosen from the text: the service falls back to it when no lexical engine exists.
    SemanticOnly = "SemanticOnly"


class QuestionType(StrEnum):
    Factual = "Factual"
    Procedural = "Procedural"
    Comparative = "Comparative"
    Troubleshooting = "Troubleshooting"
    Navigational = "Navigational"
    Open = "Open"


@dataclass(frozen=True)
class QueryContext:
    raw_query: str
    normalized_query: str
    tokens: tuple[str, ...]
    token_count: int
    entities: dict[str, list[str]]
    has_special_syntax: bool
    has_date_filters: bool
    has_negation: bool
    question_type: QuestionType
    search_strategy: SearchStrategy
    confidence: float
    reasons: tuple[str, ...] = field(default_factory=tuple)
    dates: tuple[DateRange, ...] = ()
    reference_time: datetime | None = None

    @property
    def time_filter(self) -> dict[str, str] | None:
        """The range the dates that ask for it cover (inclusive ISO days), or None."""
        rng = span(list(self.dates))
        return None if rng is None else {"since": rng[0].isoformat(), "until": rng[1].isoformat()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable view; enums become their string values."""
        return {
            "raw_query": self.raw_query,
            "normalized_query": self.normalized_query,
            "tokens": list(self.tokens),
            "token_count": self.token_count,
            "entities": {key: list(values) for key, values in self.entities.items()},
            "has_special_syntax": self.has_special_syntax,
            "has_date_filters": self.has_date_filters,
            "has_negation": self.has_negation,
            "question_type": self.question_type.value,
            "search_strategy": self.search_strategy.value,
            "confidence": self.confidence,
            "reasons": list(self.reasons),
            "dates": [d.to_dict() for d in self.dates],
            "time_filter": self.time_filter,
            "reference_time": self.reference_time.isoformat() if self.reference_time else None,
            "optimizer_version": OPTIMIZER_VERSION,
        }


# Lookarounds instead of \b so that "port 8080", "v2024", "2024a" or "#2024" are not years,
# and [0-9] because \d would also accept other scripts' digits.
_YEAR = re.compile(r"(?<![\w#@])((?:19|20)[0-9]{2})(?!\w)")
_PHRASE = re.compile(r'"([^"]*)"')
# The preceding-character guard keeps "c#", "issue#12" and e-mail addresses out;
# requiring a word character after the sigil is what makes a lone "#" or "@" plain text.
_TAG = re.compile(r"(?<![\w#])#(\w+(?:-\w+)*)")
_MENTION = re.compile(r"(?<![\w@])@(\w+(?:[.-]\w+)*)")

# "no" is deliberately absent: it is too common inside error text ("no such file",
# "no route to host") where it does not ask to exclude anything.
_NEGATION_WORDS = frozenset({"not", "without", "except"})
_EDGE_PUNCTUATION = ".,;:!?\"'()[]{}"

# How a question starts: an interrogative or an auxiliary that opens one.
_QUESTION_START = (
    r"(?:when|what|who|whom|whose|why|how|which|did|does|do|is|are|was|were|would|will"
    r"|can|could|should|has|have|had)"
)

# Ordered (type, pattern) rules; the first match wins. One type may appear at two
# levels: an explicit phrasing of intent ("how do i ...") outranks topical keywords
# ("fix", "install") that merely say what the query is about.
_QUESTION_RULES: tuple[tuple[QuestionType, str, re.Pattern[str]], ...] = tuple(
    (qtype, name, re.compile(pattern))
    for qtype, name, pattern in (
        (
            QuestionType.Procedural,
            "how-to phrasing",
            r"\bhow (?:do|can|should|would|could) (?:i|we|you|one)\b|\bhow to\b",
        ),
        (
            QuestionType.Navigational,
            "navigation phrasing",
            r"^(?:where (?:is|are|can i find|do i find)|go to|take me to|open|docs for)\b",
        ),
        (
            QuestionType.Comparative,
            "comparison keyword",
            r"\b(?:compare[sd]?|comparing|comparison|vs|versus|difference between"
            r"|differences between|better than|worse than)\b",
        ),
        (
            QuestionType.Troubleshooting,
            "failure keyword",
            r"\b(?:errors?|fail(?:s|ed|ing|ures?)?|broken|crash(?:es|ed|ing)?|timeouts?"
            r"|timed out|not working|(?:doesn't|does not|won't|can't|cannot) (?:work|start)"
            r"|exceptions?|traceback|stack ?trace|bugs?|fix(?:es|ed|ing)?|debug(?:ging)?)\b",
        ),
        (
            QuestionType.Procedural,
            "procedure keyword",
            r"\b(?:steps?|install(?:ing|ation)?|configur(?:e|ing|ation)|set ?up|tutorial"
            r"|guide|walkthrough)\b",
        ),
        (
            QuestionType.Navigational,
            "navigation keyword",
            # Not inside a question: "when did Melanie go to the museum?" asks when, and
            # "what did Caroline find" asks what (42 of the 1,157 LoCoMo dev questions were
            # routed LexicalFirst for their "go to", "find" or "open").
            r"^(?!" + _QUESTION_START + r"\b).*"
            r"\b(?:where is|where are|find|go to|link|links|page|url|docs for|open)\b",
        ),
        (
            QuestionType.Factual,
            "fact question",
            r"\b(?:what (?:is|are|was|were|does)|who|when|which|how (?:many|much|long|old)"
            r"|define|definition of|meaning of)\b",
        ),
    )
)


def optimize_query(raw: str, reference_time: datetime | None = None) -> QueryContext:
    """Analyse ``raw`` and choose a search strategy. Relative dates ("last week") are
    resolved against ``reference_time`` (default: now).

    Raises QueryOptimizerError when ``raw`` is not a string or is empty after normalizing.
    """
    if not isinstance(raw, str):
        raise QueryOptimizerError(f"query must be a string, got {type(raw).__name__}")
    reasons: list[str] = []

    normalized = " ".join(raw.lower().split())
    if not normalized:
        raise QueryOptimizerError("query is empty or whitespace-only")
    if len(normalized) > MAX_QUERY_CHARS:
        # Truncating may leave a trailing space; strip it to keep the trimmed invariant.
        normalized = normalized[:MAX_QUERY_CHARS].rstrip()
        reasons.append(f"query truncated to {MAX_QUERY_CHARS} characters")

    tokens = tuple(normalized.split(" "))
    entities = _extract_entities(normalized)
    has_special_syntax = bool(entities["phrase"] or entities["tag"] or entities["mention"])
    has_date_filters = bool(entities["year"])
    has_negation = any(_is_negation(token) for token in tokens)

    now = check_reference_time(reference_time) if reference_time else datetime.now(UTC)
    dates = tuple(extract_dates(normalized, now))
    relative = any(d.form == "relative" for d in dates)

    question_type, why = _classify(tokens)
    reasons.append(why)
    strategy, confidence, why = _route(
        len(tokens), has_special_syntax, has_date_filters, question_type
    )
    reasons.append(why)

    return QueryContext(
        raw_query=raw,
        normalized_query=normalized,
        tokens=tokens,
        token_count=len(tokens),
        entities=entities,
        has_special_syntax=has_special_syntax,
        has_date_filters=has_date_filters,
        has_negation=has_negation,
        question_type=question_type,
        search_strategy=strategy,
        confidence=confidence,
        reasons=tuple(reasons),
        dates=dates,
        # Recorded when it was given or used: a relative date means nothing without it.
        reference_time=reference_time if reference_time or not relative else now,
    )


def _extract_entities(text: str) -> dict[str, list[str]]:
    phrases = [p.strip() for p in _PHRASE.findall(text)]
    return {
        "year": _distinct(_YEAR.findall(text)),
        # '""' says nothing to match exactly, so it is not special syntax.
        "phrase": _distinct([p for p in phrases if p]),
        "tag": _distinct(_TAG.findall(text)),
        "mention": _distinct(_MENTION.findall(text)),
    }


def _distinct(values: list[str]) -> list[str]:
    return list(dict.fromkeys(values))


def _is_exclusion(token: str) -> bool:
    # Only "-" followed by a letter: "-5" is a number and "--" is punctuation.
    return len(token) > 1 and token[0] == "-" and token[1].isalpha()


def _is_negation(token: str) -> bool:
    return _is_exclusion(token) or token.strip(_EDGE_PUNCTUATION) in _NEGATION_WORDS


def _classify(tokens: tuple[str, ...]) -> tuple[QuestionType, str]:
    # Excluded terms ("-error") say what the user does NOT want, so they must not
    # steer the question type.
    text = " ".join(token for token in tokens if not _is_exclusion(token))
    for qtype, name, pattern in _QUESTION_RULES:
        match = pattern.search(text)
        if match:
            return qtype, f"question type {qtype.value}: {name} '{match.group(0)}'"
    return QuestionType.Open, "question type Open: no question pattern matched"


def _route(
    token_count: int,
    has_special_syntax: bool,
    has_date_filters: bool,
    question_type: QuestionType,
) -> tuple[SearchStrategy, float, str]:
    if token_count < MIN_TOKENS_FOR_ROUTING:
        # One or two words are keyword lookups; embeddings of so little text are noisy.
        return (
            SearchStrategy.LexicalOnly,
            0.8,
            f"route LexicalOnly: short query ({token_count} < {MIN_TOKENS_FOR_ROUTING} tokens)",
        )
    if has_special_syntax:
        # Exact phrases, tags and mentions are operators an embedding cannot honour.
        return (
            SearchStrategy.LexicalOnly,
            0.9,
            "route LexicalOnly: special syntax (phrase, #tag or @mention)",
        )
    if has_date_filters:
        return SearchStrategy.LexicalFirst, 0.8, "route LexicalFirst: year filter present"
    if question_type in (QuestionType.Procedural, QuestionType.Troubleshooting):
        # Answers paraphrase the question, so semantic recall matters as much as keywords.
        return (
            SearchStrategy.Hybrid,
            0.9,
            f"route Hybrid: {question_type.value} question benefits from semantic recall",
        )
    if question_type is QuestionType.Navigational:
        return (
            SearchStrategy.LexicalFirst,
            0.75,
            "route LexicalFirst: navigational query names what it is looking for",
        )
    # Open queries carry the least signal, hence the lowest confidence in the default.
    confidence = 0.5 if question_type is QuestionType.Open else 0.7
    return (
        SearchStrategy.Hybrid,
        confidence,
        f"route Hybrid: default for {question_type.value} question",
    )
