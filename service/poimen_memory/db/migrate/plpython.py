"""The PL/Python install: poimen_core held in memory._plpython_modules (what any database
server imports, wherever it runs), copied into a directory the server reads only when asked
(the embedded cluster, `migrate --plpython-dir`), the embedder's packages named when asked,
and what memory.config records of both (Placement)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import py_compile
import re
import shutil
import sys
from dataclasses import dataclass
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
    _compile(pkg)
    return target


def _compile(pkg: Path) -> None:
    """Write the package's bytecode beside it. The server's OS user cannot write there, so
    each backend compiled the modules again at its first PL/Python call: 90 ms of that
    call's CPU against 50 ms with the bytecode. Compiled by this process's Python, which a
    server of the same X.Y reads (3.11 here) and one of another version ignores (its cache
    tag differs). Named and checked as a plain `import` reads them whatever this process
    runs with (PYTHONPYCACHEPREFIX, -O, SOURCE_DATE_EPOCH): beside the source, optimisation
    level 0, checked by the source's mtime and size. Run on every install, not only on a
    new copy, so an older install gets its bytecode at the next migrate (a dozen files,
    rewritten atomically: simpler than reading their headers first); where the directory
    cannot be written, the server compiles as before."""
    cache = pkg / "__pycache__"
    with contextlib.suppress(OSError, py_compile.PyCompileError):
        cache.mkdir(exist_ok=True)
        cache.chmod(0o755)
        for source in sorted(pkg.glob("*.py")):
            target = cache / f"{source.stem}.{sys.implementation.cache_tag}.pyc"
            py_compile.compile(
                str(source), cfile=str(target), doraise=True, optimize=0,
                invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP,
            )  # fmt: skip
            target.chmod(0o644)


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


@dataclass(frozen=True)
class Placement:
    """Where the database server imports PL/Python from, as memory.config records it.

    module_dir: the content-hashed copy of poimen_core in a directory the server reads
    (plpython_path), or None: the server imports it from memory._plpython_modules, which
    needs no file of any host. deps: the directory of the embedder's packages on the
    database host (plpython_deps, one subdirectory per Python X.Y), or None: the server's
    Python imports them from its own sys.path (its site-packages). A path is recorded only
    when the caller asks for one (the embedded cluster, `migrate --plpython-dir`,
    `--embedder-packages`): a path of the host that runs migrate means nothing on another.
    """

    module_dir: Path | None
    deps: Path | None


def placement(plpython_root: Path | None, embedder_packages: Path | None = None) -> Placement:
    """What migrate records for its arguments, computed without copying anything: migrate
    and check both decide it here. plpython_root: where this host installs the module for a
    server that reads it (skipped when the server's OS user cannot reach it); the embedder's
    packages default to this host's (`make setup`) only beside such a root."""
    root = module_root(plpython_root)
    module_dir = None if root is None else root / plpython_checksum()[:16]
    if embedder_packages is not None:
        deps: Path | None = embedder_packages
    elif root is not None:
        deps = deps_target(root.parent)
    else:
        deps = None
    return Placement(module_dir, deps)


def write_config(conn: psycopg.Connection[Any], where: Placement) -> None:
    """The product's keys in memory.config as migrate sets them (a module directory not
    asked for is removed, so a stale path of another host goes; the embedder's packages
    are the database host's, kept unless named); a row already right is not rewritten."""
    if where.module_dir is None:
        conn.execute(catalog("config_delete"), ("plpython_path",))
    else:
        conn.execute(catalog("config_set"), ("plpython_path", str(where.module_dir)))
    if where.deps is not None:
        conn.execute(catalog("config_set"), ("plpython_deps", str(where.deps)))
    conn.execute(catalog("config_set"), ("plpython_checksum", plpython_checksum()))


def record_module(conn: psycopg.Connection[Any], where: Placement) -> None:
    """What migrate's transaction records of the module: its rows in
    memory._plpython_modules (always: any server can import them), and the keys."""
    _write_modules(conn)
    write_config(conn, where)


def plpython_findings(conn: psycopg.Connection[Any], where: Placement | None) -> list[str]:
    """What comparing memory.config with what migrate writes cannot tell: a module
    directory recorded that this host does not hold. where None (a caller that does not say
    where the server imports from): only the recorded keys' consistency with this code."""
    if where is not None:
        d = where.module_dir
        if d is not None and not (d / "poimen_core" / "__init__.py").exists():
            return [f"config missing (migrate restores it): PL/Python module directory {d}"]
        return []
    code = plpython_checksum()
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
    return found
