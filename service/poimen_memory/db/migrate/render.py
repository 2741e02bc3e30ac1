"""The sql/ files' text as a database runs it: the renderer's passes over their markers.

A file says ``@vocabulary.NAME@`` for a shared word (poimen_core.vocabulary),
``@role.reader@`` (and writer, service) for this database's roles (db/roles.py),
``@plain_errors@`` where a PL/pgSQL front's exception handler goes, and ``public`` for
pgvector's schema in its functions' ``SET search_path``; a database without plpython3u gets
each PL/Python function as a PL/pgSQL stub that raises PM503."""

from __future__ import annotations

import re
from pathlib import Path

from psycopg import sql

from poimen_core.vocabulary import sql_literals
from poimen_memory.db.roles import Roles
from poimen_memory.errors import MigrationError

_SET_PATH_LINE = re.compile(r"^(SET search_path = )(.*)$", re.MULTILINE)


def _with_vector_schema(text: str, schema: str) -> str:
    """The files name pgvector's schema as public in their `SET search_path = ...` function
    clauses; CREATE FUNCTION validates a body under that path, so it must be the real one."""
    if schema == "public":
        return text
    quoted = sql.Identifier(schema).as_string(None)
    return _SET_PATH_LINE.sub(
        lambda m: m.group(1) + re.sub(r"\bpublic\b", quoted, m.group(2)), text
    )


_VOCABULARY = re.compile(r"@vocabulary\.(\w+)@")


def with_vocabulary(text: str, path: Path) -> str:
    """The shared words (poimen_core.vocabulary) in place of the file's markers."""
    words = sql_literals()

    def word(m: re.Match[str]) -> str:
        if m.group(1) not in words:
            raise MigrationError(
                f"{path.name} names an unknown vocabulary word {m.group(0)}",
                hint=f"poimen_core/vocabulary.py defines: {', '.join(sorted(words))}",
            )
        return words[m.group(1)]

    return _VOCABULARY.sub(word, text)


# PL/Python is an add-on: a managed PostgreSQL (RDS, Cloud SQL, Azure, Supabase, Neon)
# never offers plpython3u, and only a superuser may create it. Without it every PL/Python
# function is made as a PL/pgSQL function of the same signature that raises PM503, which
# the planner already answers (routing as Hybrid; the lexical leg where memory.embed is
# missing) and callers already expect where the module is not installed on a host.
_PLPYTHON_FUNCTION = re.compile(
    r"(?P<head>CREATE OR REPLACE FUNCTION (?P<name>[\w.]+)\((?:(?!\$\$).)*?)"
    r"LANGUAGE plpython3u(?P<tail>(?:(?!\$\$).)*?)AS \$\$\n.*?\n\$\$;",
    re.DOTALL,
)


def _without_plpython(text: str) -> str:
    def stub(m: re.Match[str]) -> str:
        return (
            f"{m.group('head')}LANGUAGE plpgsql{m.group('tail')}AS $$\nBEGIN\n"
            f"    RAISE EXCEPTION '{m.group('name')} needs PL/Python, which this database "
            "does not have'\n"
            "        USING ERRCODE = @vocabulary.sqlstate_component_unavailable@,\n"
            "              HINT = 'plpython3u is a superuser''s extension (managed services do "
            "not offer it): pass query_embedding, write through the service, or see "
            "docs/managed-postgres.md';\n"
            "END $$;"
        )

    return _PLPYTHON_FUNCTION.sub(stub, text)


# PL/Python prefixes an error's message with the Python exception's type ("plpy.Error: ...");
# the functions users call are PL/pgSQL fronts over the PL/Python bodies, whose exception
# handler re-raises through memory._plain_error (sql/060_optimizer.sql). The handler is one
# text, here: a front's file writes the marker `@plain_errors@` on its own line where the
# handler goes (after the block's statements), and holds only the call of its body.
_PLAIN_ERRORS = re.compile(r"^(?P<indent>[ \t]*)@plain_errors@[ \t]*$", re.MULTILINE)
_PLAIN_ERRORS_HANDLER = """\
EXCEPTION WHEN OTHERS THEN
    DECLARE
        st text; m text; d text; h text;
    BEGIN
        GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, m = MESSAGE_TEXT,
                                d = PG_EXCEPTION_DETAIL, h = PG_EXCEPTION_HINT;
        PERFORM memory._plain_error(st, m, d, h);
    END;"""


def _with_plain_errors(text: str) -> str:
    def handler(m: re.Match[str]) -> str:
        return "\n".join(m.group("indent") + line for line in _PLAIN_ERRORS_HANDLER.split("\n"))

    return _PLAIN_ERRORS.sub(handler, text)


def render_sql(
    text: str, path: Path, *, roles: Roles, schema: str = "public", plpython: bool = True
) -> str:
    """A sql/ file's text (or a part of one, read from ``path``) as this database runs it:
    PL/Python functions as PM503 stubs where it has no plpython3u, the PL/pgSQL fronts'
    exception handler (``@plain_errors@``), the vocabulary's words,
    this database's role names, and pgvector's ``schema`` in the functions' search_path.
    Everything that runs the files' SQL renders it here, so no copy misses a marker."""
    text = with_vocabulary(text if plpython else _without_plpython(text), path)
    return _with_vector_schema(roles.render(_with_plain_errors(text)), schema)
