"""The product's roles belong to one database (docs/security.md, "Roles per database").

PostgreSQL's roles are the cluster's, not a database's: had every product database used
``memory_reader``, a grant made for one (``memory.grant_project(reader, '*')``) would let a
role made for another read it too. So each database gets its own three group roles,
``<prefix>_memory_reader``, ``_writer`` and ``_service``, and its CONNECT privilege goes to
its reader (so to the others) and its owner only.

The prefix is chosen once, at the first ``migrate``: ``POIMEN_ROLE_PREFIX`` when set, else
the database's name. It is then recorded in ``memory.config`` (``role_prefix``), so the
names follow the data through a dump and restore under another database name, and the
sql/ files are rendered with them (``@role.reader@`` and so on). A database migrated
before roles were per database used the cluster-wide ``memory_reader`` trio; its first
``migrate`` since moves it to its own roles (db/migrate/roles.py, ``move_roles``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from poimen_core.vocabulary import ROLE_PREFIX_MAX

_PLACEHOLDER = re.compile(r"@role\.(reader|writer|service)@")
KINDS = ("reader", "writer", "service")


@dataclass(frozen=True)
class Roles:
    """The group roles of one database, in the order each is a member of the one before."""

    prefix: str

    @property
    def reader(self) -> str:
        return self.name("reader")

    @property
    def writer(self) -> str:
        return self.name("writer")

    @property
    def service(self) -> str:
        return self.name("service")

    def name(self, kind: str) -> str:
        return f"{self.prefix}_memory_{kind}" if self.prefix else f"memory_{kind}"

    @property
    def all(self) -> tuple[str, str, str]:
        return (self.reader, self.writer, self.service)

    def render(self, text: str) -> str:
        """The sql/ files' ``@role.reader@``, ``@role.writer@``, ``@role.service@`` markers
        as this database's names: plain lower-case identifiers, safe both bare and quoted."""
        return _PLACEHOLDER.sub(lambda m: self.name(m.group(1)), text)


# The roles every database shared before they were per database.
LEGACY = Roles("")


def prefix_for(database: str) -> str:
    """The default prefix: the database's name where it is already a plain identifier that
    fits; otherwise its lower-cased, underscored form with a short hash of the real name, so
    two databases whose names differ only in what that form loses still get two prefixes."""
    plain = re.sub(r"[^a-z0-9_]", "_", database.lower())
    if not plain[:1].isalpha():
        plain = "db_" + plain
    if plain == database and len(plain) <= ROLE_PREFIX_MAX:
        return plain
    digest = hashlib.sha256(database.encode()).hexdigest()[:8]
    return f"{plain[: ROLE_PREFIX_MAX - 9]}_{digest}"
