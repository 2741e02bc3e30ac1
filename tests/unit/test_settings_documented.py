"""Every setting the service reads is documented: each environment key a FromEnv class
declares appears, as `KEY`, in docs/ (configuration.md, or the page of its upstream)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import poimen_memory.settings as settings_module

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _declared_keys() -> list[str]:
    keys = []
    for value in vars(settings_module).values():
        if (
            isinstance(value, type)
            and issubclass(value, settings_module.FromEnv)
            and value is not settings_module.FromEnv
        ):
            keys += [f.metadata["env"] for f in fields(value) if f.metadata.get("env")]
    return keys


def test_every_setting_is_documented() -> None:
    keys = _declared_keys()
    assert "POIMEN_MCP_PAGE_SIZE" in keys and len(keys) > 50
    text = "".join(p.read_text() for p in sorted(DOCS.glob("*.md")))
    missing = [k for k in keys if f"`{k}`" not in text]
    assert not missing, f"settings with no `KEY` in docs/: {missing}"
