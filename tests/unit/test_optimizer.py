import dataclasses
import json
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poimen_core.optimizer import (
    ENTITY_KEYS,
    MAX_QUERY_CHARS,
    OPTIMIZER_VERSION,
    QueryContext,
    QueryOptimizerError,
    QuestionType,
    SearchStrategy,
    optimize_query,
)

# --- acceptance cases --------------------------------------------------------------


def test_acceptance_short_query_is_lexical_only() -> None:
    ctx = optimize_query("fix port")
    assert ctx.search_strategy is SearchStrategy.LexicalOnly
    assert ctx.confidence >= 0.7


def test_acceptance_how_do_i_beats_fix() -> None:
    ctx = optimize_query("How do I fix kubernetes port 8080?")
    assert ctx.search_strategy is SearchStrategy.Hybrid
    assert ctx.question_type is QuestionType.Procedural
    assert ctx.confidence >= 0.9
    # 8080 is a port, not a year.
    assert not ctx.has_date_filters


def test_acceptance_tags_and_mentions_are_lexical_only() -> None:
    ctx = optimize_query("#networking @devops policy")
    assert ctx.search_strategy is SearchStrategy.LexicalOnly
    assert ctx.has_special_syntax
    assert ctx.entities["tag"] == ["networking"]
    assert ctx.entities["mention"] == ["devops"]


def test_acceptance_year_is_lexical_first() -> None:
    ctx = optimize_query("deployment failures in 2024")
    assert ctx.search_strategy is SearchStrategy.LexicalFirst
    assert ctx.has_date_filters
    assert ctx.entities["year"] == ["2024"]


def test_acceptance_compare_is_hybrid_comparative() -> None:
    ctx = optimize_query("Compare Docker and Kubernetes")
    assert ctx.search_strategy is SearchStrategy.Hybrid
    assert ctx.question_type is QuestionType.Comparative


# --- routing rules, in priority order ------------------------------------------------


@pytest.mark.parametrize("query", ["kubernetes", "fix port", "#networking policy"])
def test_rule1_fewer_than_three_tokens_is_lexical_only(query: str) -> None:
    ctx = optimize_query(query)
    assert ctx.token_count < 3
    assert ctx.search_strategy is SearchStrategy.LexicalOnly
    assert "short query" in ctx.reasons[-1]


@pytest.mark.parametrize(
    "query",
    [
        'logs mentioning "connection refused" today',
        "notes about #postgres tuning",
        "what did @alice decide",
        # Special syntax outranks the date and the how-to phrasing.
        "how do i use #helm in 2024",
    ],
)
def test_rule2_special_syntax_is_lexical_only(query: str) -> None:
    ctx = optimize_query(query)
    assert ctx.has_special_syntax
    assert ctx.search_strategy is SearchStrategy.LexicalOnly
    assert "special syntax" in ctx.reasons[-1]


def test_rule3_date_filter_outranks_question_type() -> None:
    ctx = optimize_query("how do i rotate certificates 2023")
    assert ctx.question_type is QuestionType.Procedural
    assert ctx.search_strategy is SearchStrategy.LexicalFirst
    assert ctx.confidence == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("query", "qtype"),
    [
        ("steps to install the agent", QuestionType.Procedural),
        ("why does the nightly build fail", QuestionType.Troubleshooting),
    ],
)
def test_rule4_procedural_and_troubleshooting_are_hybrid(query: str, qtype: QuestionType) -> None:
    ctx = optimize_query(query)
    assert ctx.question_type is qtype
    assert ctx.search_strategy is SearchStrategy.Hybrid
    assert ctx.confidence == pytest.approx(0.9)


@pytest.mark.parametrize("query", ["where is the runbook index", "docs for the billing api"])
def test_rule5_navigational_is_lexical_first(query: str) -> None:
    ctx = optimize_query(query)
    assert ctx.question_type is QuestionType.Navigational
    assert ctx.search_strategy is SearchStrategy.LexicalFirst


@pytest.mark.parametrize(
    ("query", "confidence"),
    [("what is a service mesh", 0.7), ("thoughts on team rituals", 0.5)],
)
def test_rule6_everything_else_is_hybrid(query: str, confidence: float) -> None:
    ctx = optimize_query(query)
    assert ctx.search_strategy is SearchStrategy.Hybrid
    assert ctx.confidence == pytest.approx(confidence)


def test_semantic_only_exists_but_is_never_chosen_from_text() -> None:
    assert SearchStrategy.SemanticOnly.value == "SemanticOnly"
    queries = ["fix port", "compare a and b", "where is x", "a b c d e", "what is love"]
    strategies = {optimize_query(q).search_strategy for q in queries}
    assert SearchStrategy.SemanticOnly not in strategies


# --- question types --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "qtype"),
    [
        ("what is the default shared_buffers", QuestionType.Factual),
        ("who owns the payments service", QuestionType.Factual),
        ("how many replicas does search run", QuestionType.Factual),
        ("how to configure pgbouncer pools", QuestionType.Procedural),
        ("setup guide for the vpn", QuestionType.Procedural),
        ("postgres versus mysql for analytics", QuestionType.Comparative),
        ("difference between l1 and l2 memory", QuestionType.Comparative),
        ("what is the difference between docker and podman", QuestionType.Comparative),
        ("api gateway timeout after deploy", QuestionType.Troubleshooting),
        ("login page not working again", QuestionType.Troubleshooting),
        ("worker crashes on startup", QuestionType.Troubleshooting),
        ("where is the error log kept", QuestionType.Navigational),
        ("find the onboarding page", QuestionType.Navigational),
        ("go to the incident dashboard", QuestionType.Navigational),
        # Inside a question the same words are verbs, not a request to navigate.
        ("when did melanie go to the museum?", QuestionType.Factual),
        ("how often does caroline go to the beach with her kids?", QuestionType.Open),
        ("what did caroline find in her neighborhood?", QuestionType.Open),
        ("would john be open to moving abroad?", QuestionType.Open),
        ("ideas for the offsite agenda", QuestionType.Open),
    ],
)
def test_question_type(query: str, qtype: QuestionType) -> None:
    assert optimize_query(query).question_type is qtype


def test_excluded_terms_do_not_steer_question_type() -> None:
    ctx = optimize_query("deploy dashboards for staging -error")
    assert ctx.question_type is QuestionType.Open


# --- characteristics and entities ------------------------------------------------------


@pytest.mark.parametrize(
    "query",
    [
        "backups not older than a week",
        "deploy without downtime please",
        "all regions except eu-west",
        "kubernetes ingress -nginx",
        "services (except, legacy ones)",
    ],
)
def test_negation_detected(query: str) -> None:
    assert optimize_query(query).has_negation


@pytest.mark.parametrize("query", ["no such file or directory", "scale to -5 replicas", "a -- b"])
def test_no_false_negation(query: str) -> None:
    assert not optimize_query(query).has_negation


def test_entities_keep_every_distinct_value_in_order() -> None:
    ctx = optimize_query('"a b" #x @y 1999 "c" #z #x 2024 @w 1999')
    assert ctx.entities == {
        "year": ["1999", "2024"],
        "phrase": ["a b", "c"],
        "tag": ["x", "z"],
        "mention": ["y", "w"],
    }


def test_all_entity_keys_always_present() -> None:
    ctx = optimize_query("plain words only here")
    assert tuple(ctx.entities) == ENTITY_KEYS
    assert all(values == [] for values in ctx.entities.values())


@pytest.mark.parametrize(
    "query", ["port 8080 is busy", "v2024 release notes", "call 12024 now", "mail bob@2024.org"]
)
def test_numbers_that_are_not_years(query: str) -> None:
    ctx = optimize_query(query)
    assert ctx.entities["year"] == []
    assert not ctx.has_date_filters


def test_email_is_not_a_mention_and_csharp_is_not_a_tag() -> None:
    ctx = optimize_query("email ops@example.com about c# builds")
    assert ctx.entities["mention"] == []
    assert ctx.entities["tag"] == []
    assert not ctx.has_special_syntax


# --- robustness ------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["", "   ", "\t\n \u3000"])
def test_empty_input_raises(raw: str) -> None:
    with pytest.raises(QueryOptimizerError, match="empty"):
        optimize_query(raw)


def test_non_string_raises() -> None:
    with pytest.raises(QueryOptimizerError, match="must be a string"):
        optimize_query(None)  # type: ignore[arg-type]


def test_error_is_a_value_error() -> None:
    assert issubclass(QueryOptimizerError, ValueError)


@pytest.mark.parametrize("raw", ['"', "#", "@", '""', '" #'])
def test_lone_syntax_characters_are_plain_text(raw: str) -> None:
    ctx = optimize_query(raw)
    assert not ctx.has_special_syntax
    assert ctx.search_strategy is SearchStrategy.LexicalOnly
    assert all(values == [] for values in ctx.entities.values())


def test_unterminated_quote_is_not_a_phrase() -> None:
    ctx = optimize_query('search for "half open quote here')
    assert ctx.entities["phrase"] == []


def test_long_query_is_capped_and_noted() -> None:
    ctx = optimize_query("Word " * 2000)
    assert len(ctx.normalized_query) <= MAX_QUERY_CHARS
    assert ctx.normalized_query == ctx.normalized_query.strip()
    assert any("truncated" in reason for reason in ctx.reasons)
    assert ctx.token_count == len(ctx.tokens)


def test_query_at_cap_is_not_truncated() -> None:
    ctx = optimize_query("x" * MAX_QUERY_CHARS)
    assert len(ctx.normalized_query) == MAX_QUERY_CHARS
    assert not any("truncated" in reason for reason in ctx.reasons)


def test_unicode_mixed_scripts_and_emoji() -> None:
    ctx = optimize_query("  ÜBER  Straße 🚀 #日本語 @José   données  ")
    assert ctx.normalized_query == "über straße 🚀 #日本語 @josé données"
    assert ctx.entities["tag"] == ["日本語"]
    assert ctx.entities["mention"] == ["josé"]
    assert ctx.search_strategy is SearchStrategy.LexicalOnly


def test_normalize_collapses_whitespace_and_lowercases() -> None:
    ctx = optimize_query("\tHow   DO i\n\nInstall  Postgres ")
    assert ctx.normalized_query == "how do i install postgres"
    assert ctx.tokens == ("how", "do", "i", "install", "postgres")
    assert ctx.raw_query == "\tHow   DO i\n\nInstall  Postgres "


# --- the context object ----------------------------------------------------------------


def test_context_is_frozen() -> None:
    ctx = optimize_query("fix port")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.confidence = 0.1  # type: ignore[misc]


def test_to_dict_is_json_with_string_enums() -> None:
    ctx = optimize_query("How do I fix kubernetes port 8080?")
    data = json.loads(json.dumps(ctx.to_dict()))
    assert data["search_strategy"] == "Hybrid"
    assert data["question_type"] == "Procedural"
    assert data["tokens"] == list(ctx.tokens)
    assert data["entities"]["year"] == []
    assert data["optimizer_version"] == OPTIMIZER_VERSION
    assert isinstance(data["reasons"], list)
    assert data["reasons"]
    assert type(data["search_strategy"]) is str


def test_reasons_name_the_classification_and_the_route() -> None:
    reasons = optimize_query("deployment failures in 2024").reasons
    assert reasons[0].startswith("question type Troubleshooting")
    assert reasons[-1].startswith("route LexicalFirst")


def test_version_is_a_non_empty_string() -> None:
    assert isinstance(OPTIMIZER_VERSION, str)
    assert OPTIMIZER_VERSION


@given(st.text(max_size=300) | st.text(alphabet=' "#@-abc19020\t\n', max_size=60))
def test_property_valid_context_or_documented_error(raw: str) -> None:
    try:
        ctx = optimize_query(raw)
    except QueryOptimizerError:
        assert not raw.split()
        return
    assert isinstance(ctx, QueryContext)
    assert ctx.search_strategy in set(SearchStrategy)
    assert ctx.question_type in set(QuestionType)
    assert 0.0 <= ctx.confidence <= 1.0
    assert ctx.token_count == len(ctx.tokens) >= 1
    assert ctx.normalized_query == ctx.normalized_query.strip()
    assert ctx.normalized_query == ctx.normalized_query.lower()
    assert len(ctx.normalized_query) <= MAX_QUERY_CHARS
    assert ctx.reasons
    json.dumps(ctx.to_dict())


@pytest.mark.parametrize(
    ("query", "reference"),
    [
        ("notes from last week", datetime(1, 1, 1, tzinfo=UTC)),
        ("notes from last year", datetime(1, 3, 1, tzinfo=UTC)),
        ("notes from this month", datetime(9999, 12, 31, tzinfo=UTC)),
        ("notes", datetime(1, 1, 1, 1, tzinfo=timezone(timedelta(hours=20)))),
    ],
)
def test_a_reference_time_outside_its_years_is_refused(query: str, reference: datetime) -> None:
    with pytest.raises(QueryOptimizerError, match=r"within years 2\.\.9998") as info:
        optimize_query(query, reference)
    assert "reference_time" in info.value.hint


def test_every_relative_date_resolves_at_the_edges_of_the_years() -> None:
    for reference in (datetime(2, 1, 1, tzinfo=UTC), datetime(9998, 12, 31, 23, tzinfo=UTC)):
        for term in ("yesterday", "today", "last week", "this month", "last year", "past year"):
            ctx = optimize_query(f"notes from {term}", reference)
            assert ctx.dates and ctx.dates[0].form == "relative"
