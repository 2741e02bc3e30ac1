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


def test_narrowed_asserts_only_the_named_projects_of_the_key() -> None:
    # A request naming one project of a key covering many asserts that one alone: the
    # database's tenant checks then cost what a one-project key's do (issue 42).
    wide = tenant.Tenant.of([f"p{i}" for i in range(1000)], can_write=True, key_id=3)
    one = wide.narrowed({"p7"})
    assert one.params() == {"read": "p7", "write": "p7", "key": "3"}
    read_only = tenant.Tenant.of(["a", "b"], can_write=False).narrowed({"b"})
    assert read_only.params() == {"read": "b", "write": "", "key": ""}
    # Never wider than the key: a name it does not cover is dropped, not added.
    assert wide.narrowed({"p7", "other"}).params()["read"] == "p7"
    # Nothing named (a route that checks the key before reading a body): the key's own.
    assert wide.narrowed(set()) is wide
    # Anonymous mode asserts '*', which costs nothing to check: left as it is.
    assert tenant.ALL_PROJECTS.narrowed({"a"}) is tenant.ALL_PROJECTS
