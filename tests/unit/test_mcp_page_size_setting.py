"""POIMEN_MCP_PAGE_SIZE: a page of resources/list holds at least one project; a value that
is not a positive integer stops start-up with a ConfigError naming the variable."""

from __future__ import annotations

import pytest

from poimen_memory.errors import ConfigError
from poimen_memory.settings import Settings


def test_the_default_and_a_valid_value() -> None:
    assert Settings.from_env({}).mcp_page_size == 100
    assert Settings.from_env({"POIMEN_MCP_PAGE_SIZE": "7"}).mcp_page_size == 7


@pytest.mark.parametrize("value", ["0", "-3", "ten", "1.5"])
def test_a_bad_value_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="POIMEN_MCP_PAGE_SIZE"):
        Settings.from_env({"POIMEN_MCP_PAGE_SIZE": value})
