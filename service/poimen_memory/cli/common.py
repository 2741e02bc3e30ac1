"""What every command shares: the settings, parsed once, and the database to talk to."""

from __future__ import annotations

from poimen_memory.db.connect import database_url
from poimen_memory.settings import Settings


def load_settings() -> Settings:
    return Settings.from_env()


def started_url(s: Settings) -> str:
    """The database URL, starting the embedded cluster first when none is configured."""
    return database_url(s, start=True)
