"""migrate points memory.embed at the packages `make setup` installed for the server's
Python, copying them where the server's OS user can read them when the checkout is private."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from poimen_memory.db.migrate import server_python_deps

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the server runs as another OS user only when we are root"
)


@pytest.fixture
def base() -> Iterator[Path]:
    # Not pytest's tmp_path: its /tmp/pytest-of-root is private, so nothing would be reachable.
    d = Path(tempfile.mkdtemp(prefix="poimen-deps-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_private_packages_are_copied_once_per_install(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    venv = base / "private" / "venv"
    deps = venv / "server-python" / "3.11"
    deps.mkdir(parents=True)
    (deps / ".poimen-deps").write_text("stamp 1")
    (deps / "mod.py").write_text("x = 1")
    (base / "private").chmod(0o700)  # like /root
    home = base / "home"
    monkeypatch.setattr(sys, "prefix", str(venv))

    first = server_python_deps(home)
    assert first is not None and first.parent == home / "server-python"
    assert (first / "3.11" / "mod.py").read_text() == "x = 1"
    assert server_python_deps(home) == first  # same install: the same copy, not a new one

    (deps / ".poimen-deps").write_text("stamp 2")  # `make setup` installed new versions
    second = server_python_deps(home)
    assert second is not None and second != first
    assert not first.exists()

    (base / "private").chmod(0o755)  # reachable: used in place
    assert server_python_deps(home) == venv / "server-python"


def test_no_install_means_no_path(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "prefix", str(base / "venv"))
    assert server_python_deps(base / "home") is None
