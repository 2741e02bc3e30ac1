"""POIMEN_ROLE_PREFIX through the settings parser, as the service and the CLI read it: a
value the roles cannot be named with stops start-up with a ConfigError naming the variable
and the rule; an empty one counts as unset (the database's name), as every setting's does."""

from __future__ import annotations

import pytest

from poimen_core.vocabulary import ROLE_PREFIX_MAX
from poimen_memory.cli.main import main
from poimen_memory.errors import ConfigError
from poimen_memory.settings import Settings

RULE = f"must match [a-z][a-z0-9_]* and be at most {ROLE_PREFIX_MAX} characters"

BAD = [
    "1x",  # starts with a digit
    "_x",  # starts with an underscore
    "x" * (ROLE_PREFIX_MAX + 1),  # no room left for _memory_service in 63 bytes
    "Poimen",  # upper case
    "my-memory",  # a hyphen
    "my memory",
    "poimen;drop",
]


@pytest.mark.parametrize("raw", BAD)
def test_a_bad_prefix_is_a_config_error_naming_the_variable_and_the_rule(raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"POIMEN_ROLE_PREFIX": raw})
    assert info.value.message.startswith(f"POIMEN_ROLE_PREFIX={raw!r}: ")
    assert RULE in info.value.message


@pytest.mark.parametrize("raw", ["1x", "x" * (ROLE_PREFIX_MAX + 1)])
def test_the_cli_stops_before_connecting(
    raw: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("POIMEN_ROLE_PREFIX", raw)
    # Nowhere to connect to: the setting is refused before any connection is tried.
    monkeypatch.setenv("POIMEN_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    assert main(["migrate"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: POIMEN_ROLE_PREFIX={raw!r}: {RULE}"), err


@pytest.mark.parametrize("raw", ["", " ", "\t"])
def test_an_empty_prefix_counts_as_unset(raw: str) -> None:
    # Unset: the first migrate names the roles after the database (db/roles.py prefix_for).
    assert Settings.from_env({"POIMEN_ROLE_PREFIX": raw}).role_prefix is None
    assert Settings.from_env({}).role_prefix is None


@pytest.mark.parametrize("raw", ["x", "poimen", "my_memory_2", "x" * ROLE_PREFIX_MAX])
def test_a_good_prefix_is_kept(raw: str) -> None:
    assert Settings.from_env({"POIMEN_ROLE_PREFIX": raw}).role_prefix == raw
