"""The PL/Python install: poimen_core copied where the server's OS user imports it (or held
in memory._plpython_modules, for a server that reads no file of this host), the embedder's
packages beside it, and what memory.config records of both."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import psycopg

import poimen_memory.db.migrate.layout as layout
from poimen_memory.db.migrate.layout import catalog
from poimen_memory.errors import MigrationError

# A content-hashed copy (of poimen_core, or of the embedder's packages), or the temporary
# one it is built in.
_COPY_NAME = re.compile(r"^[0-9a-f]{16}(\.tmp\d+)?$")


def deps_target(home: Path) -> Path | None:
    """Where server_python_deps puts (or finds) the embedder's packages, computed without
    copying anything: what migrate would record as plpython_deps."""
    src = Path(sys.prefix) / "server-python"
    stamps = sorted(src.glob("*/.poimen-deps"))
    if not stamps:
        return None
    if _unreachable_ancestor(src) is None:
        return src
    digest = hashlib.sha256(b"".join(p.parent.name.encode() + p.read_bytes() for p in stamps))
    return home / "server-python" / digest.hexdigest()[:16]


def server_python_deps(home: Path) -> Path | None:
    """Where the server imports the in-database embedder's packages from: the directory
    `make setup` filled (one subdirectory per Python X.Y of the PostgreSQL server,
    scripts/setup.sh), or None when it did not. When the server's OS user cannot reach that
    directory (a checkout under /root), it is copied once under ``home``, named by the
    setup stamps so a new install gets a new copy, and older copies are removed."""
    src = Path(sys.prefix) / "server-python"
    target = deps_target(home)
    if target is None or target == src:
        return target
    base = home / "server-python"
    if not target.is_dir():
        base.mkdir(parents=True, exist_ok=True)
        base.chmod(0o755)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp, symlinks=True)
        for d, _dirs, _files in os.walk(tmp):
            os.chmod(d, 0o755)
        tmp.rename(target)
    for old in base.iterdir():
        if old != target and _COPY_NAME.match(old.name):
            shutil.rmtree(old, ignore_errors=True)
    return target


def plpython_checksum() -> str:
    h = hashlib.sha256()
    for f in sorted(layout.PLPYTHON_SRC.glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _unreachable_ancestor(root: Path) -> Path | None:
    """The first ancestor of root the server's OS user cannot traverse, if we run as root
    (the embedded server then runs as postgres); None when every ancestor is reachable."""
    if os.geteuid() != 0:
        return None
    for p in reversed(root.parents):
        if p.exists() and (p.stat().st_mode & 0o001) == 0:
            return p
    return None


def module_root(plpython_root: Path | None) -> Path | None:
    """Where this host installs the PL/Python module for the server to import, or None
    when the server imports it from the database alone (memory._plpython_modules): no root,
    or one the server's OS user cannot reach (a database on another host, where no path of
    this one means anything, is the same case). migrate and check both decide it here."""
    if plpython_root is None or _unreachable_ancestor(plpython_root) is not None:
        return None
    return plpython_root


def install_plpython(root: Path) -> Path:
    """Copy the stdlib-only module where the server's postgres user can import it.

    The directory is named by content hash, so a new version never overwrites code that a
    running backend has loaded; the shim notices the path change and re-imports. Only
    directories the project owns (root and below) are created or have their mode set.
    memory.embed reads the tokenizer beside the package (its digest is checked on load).
    """
    blocked = _unreachable_ancestor(root)
    if blocked is not None:
        raise MigrationError(
            f"the PL/Python directory {root} is not reachable by the database server",
            detail=f"{blocked} has no execute (traverse) permission for other users",
            hint="set POIMEN_HOME to a directory the postgres user can reach (the default "
            "for root is /var/lib/poimen-memory), or run migrate --no-plpython",
        )
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    target = root / plpython_checksum()[:16]
    pkg = target / "poimen_core"
    if not (pkg / "__init__.py").exists():
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(
            layout.PLPYTHON_SRC,
            tmp / "poimen_core",
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
        for d in (tmp, tmp / "poimen_core"):
            d.chmod(0o755)
        shutil.copyfile(layout.TOKENIZER, tmp / layout.TOKENIZER.name)
        for f in [*(tmp / "poimen_core").iterdir(), tmp / layout.TOKENIZER.name]:
            f.chmod(0o644)
        try:
            tmp.rename(target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def remove_old_copies(root: Path, keep: Path) -> list[str]:
    """Delete earlier content-hashed copies (and abandoned temporaries) under root. Backends
    that imported an old copy keep it in memory; the shim re-imports from the new path."""
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for d in root.iterdir():
        if d.is_dir() and d != keep and _COPY_NAME.match(d.name):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    return sorted(removed)


def plpython_status(conn: psycopg.Connection[Any]) -> tuple[bool, bool]:
    """(installed in this database, installed or creatable by this role)."""
    row = conn.execute(catalog("plpython_status")).fetchone()
    assert row is not None
    return bool(row[0]), bool(row[1])


def plpython_sources() -> dict[str, str]:
    """poimen_core's files as memory._plpython_modules holds them (name to source), and the
    tokenizer memory.embed loads (the model itself comes with the embedder's packages)."""
    out = {f.name: f.read_text() for f in sorted(layout.PLPYTHON_SRC.glob("*.py"))}
    out[layout.TOKENIZER.name] = layout.TOKENIZER.read_text()
    return out


def _has_modules_table(conn: psycopg.Connection[Any]) -> bool:
    found = conn.execute(catalog("relation_exists"), ("memory._plpython_modules",)).fetchone()
    return found == (True,)


def _write_modules(conn: psycopg.Connection[Any]) -> None:
    """This code's poimen_core into memory._plpython_modules (migration 0017), so that the
    database imports it without reading any file of this host; a row already right is not
    rewritten, and a file this version no longer has is removed."""
    if not _has_modules_table(conn):
        return  # a ledger staged before 0017 (tests of older releases' upgrades)
    src = plpython_sources()
    rows = [(n, t, hashlib.sha256(t.encode()).hexdigest()) for n, t in src.items()]
    conn.execute(catalog("modules_remove_others"), (list(src),))
    with conn.cursor() as cur:
        cur.executemany(catalog("modules_write"), rows)


def module_findings(conn: psycopg.Connection[Any]) -> list[str]:
    """How memory._plpython_modules differs from this code's poimen_core: a row edited by
    hand (its source, or its checksum column), missing, or not from this code."""
    if not _has_modules_table(conn):
        return []
    have = {str(n): (str(t), str(c)) for n, t, c in conn.execute(catalog("modules_read"))}
    out: list[str] = []
    for name, text in plpython_sources().items():
        digest = hashlib.sha256(text.encode()).hexdigest()
        if name not in have:
            out.append(f"plpython module missing (migrate restores it): {name}")
        elif have[name][0] != text or have[name][1] != digest:
            out.append(
                f"plpython module changed by hand: {name}: sha256 "
                f"{hashlib.sha256(have[name][0].encode()).hexdigest()[:16]}, recorded "
                f"{have[name][1][:16]} (migrate makes it: {digest[:16]})"
            )
    out += [
        f"plpython module not from this code (migrate removes it): {n}"
        for n in sorted(set(have) - set(plpython_sources()))
    ]
    return out


def write_config(conn: psycopg.Connection[Any], py_path: str, deps: Path | None) -> None:
    """The product's keys in memory.config (where PL/Python imports from), as migrate sets
    them; a row already right is not rewritten."""
    conn.execute(catalog("config_set"), ("plpython_path", py_path))
    conn.execute(catalog("config_set"), ("plpython_checksum", plpython_checksum()))
    if deps is None:  # memory.embed then says to run `make setup` on this host
        conn.execute(catalog("config_delete"), ("plpython_deps",))
    else:
        conn.execute(catalog("config_set"), ("plpython_deps", str(deps)))


def record_module(
    conn: psycopg.Connection[Any], py_path: str | None, deps: Path | None, *, in_database: bool
) -> None:
    """What migrate's transaction records of the module: the keys of a copy on this host
    (py_path), the module's rows, no path where the server imports from the database alone
    (in_database), and this code's checksum in every case."""
    if py_path is not None:
        write_config(conn, py_path, deps)
    _write_modules(conn)
    if in_database:
        conn.execute(catalog("config_delete"), ("plpython_path",))
    conn.execute(catalog("config_set"), ("plpython_checksum", plpython_checksum()))


def plpython_findings(
    conn: psycopg.Connection[Any], plpython_root: Path | None
) -> tuple[str | None, list[str]]:
    """The plpython_path migrate would record (when this host installs the module), and
    what is wrong with the recorded keys that comparing with it cannot tell."""
    code = plpython_checksum()
    plpython_root = module_root(plpython_root)
    if plpython_root is not None:
        expected = plpython_root / code[:16]
        found = (
            []
            if (expected / "poimen_core" / "__init__.py").exists()
            else [f"config missing (migrate restores it): PL/Python module directory {expected}"]
        )
        return str(expected), found
    rows = dict(conn.execute(catalog("config_plpython")).fetchall())
    found = []
    if "plpython_path" in rows:
        if rows.get("plpython_checksum") != code:
            found.append(
                "config changed by hand: memory.config plpython_checksum: "
                f"{rows.get('plpython_checksum')} (this code: {code})"
            )
        if Path(str(rows["plpython_path"])).name != code[:16]:
            found.append(
                "config changed by hand: memory.config plpython_path: "
                f"{rows['plpython_path']} (migrate installs the module into <root>/{code[:16]})"
            )
    return None, found
