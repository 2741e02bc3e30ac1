"""Tenant: the projects asserted to Postgres are real project names, so the ',' join of the
per-transaction setting cannot widen them; '*' only as ALL_PROJECTS."""

from __future__ import annotations

import pytest

from poimen_memory.db import tenant
from poimen_memory.errors import Forbidden


@pytest.mark.parametrize("name", ["*", "a,b", "a*", "", " a", "-a", "a" * 129, "a\n"])
def test_of_refuses_a_name_outside_the_project_rule(name: str) -> None:
    with pytest.raises(Forbidden) as err:
        tenant.Tenant.of(["poimen", name], can_write=True)
    assert err.value.sqlstate == "42501" and err.value.hint


@pytest.mark.parametrize(
    ("read", "write"),
    [({"a,b"}, set()), ({"a"}, {"a,b"}), ({"*", "a"}, set()), ({"a*"}, set())],
)
def test_direct_construction_refuses_comma_and_star(read: set[str], write: set[str]) -> None:
    with pytest.raises(Forbidden):
        tenant.Tenant(frozenset(read), frozenset(write))


def test_valid_names_and_the_sentinels() -> None:
    t = tenant.Tenant.of(["b", "a.1:x-y_z"], can_write=False)
    assert t.params() == {"read": "a.1:x-y_z,b", "write": "", "key": ""}
    assert tenant.ALL_PROJECTS.params() == {"read": "*", "write": "*", "key": ""}
    assert tenant.NO_PROJECT.params() == {"read": "", "write": "", "key": ""}
    # The API key's id travels too: memory.history records it as the writer.
    keyed = tenant.Tenant.of(["a"], can_write=True, key_id=7)
    assert keyed.params() == {"read": "a", "write": "a", "key": "7"}
