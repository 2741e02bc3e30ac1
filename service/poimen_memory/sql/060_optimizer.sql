-- The query optimizer inside PostgreSQL: a shim into the same stdlib-only module the
-- service imports (plpython/poimen_core), installed by `poimen-memory migrate`.

-- PL/Python prefixes every error it raises with the Python exception's type
-- ("plpy.Error: ...", "spiexceptions.InsufficientPrivilege: ..."), which no SQL user should
-- have to read past. The entry points a user calls are PL/pgSQL fronts over the PL/Python
-- bodies (memory.embed over memory._embed, memory.add_nodes over memory._add_nodes,
-- memory.optimize_query over memory._optimize_query) that re-raise through this: each
-- front's `@plain_errors@` is the one exception handler migrate writes in its place
-- (db/migrate.py, _with_plain_errors).
CREATE OR REPLACE FUNCTION memory._plain_error(sqlstate text, message text, detail text, hint text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    m text := regexp_replace(message, '^(plpy\.Error|spiexceptions\.[A-Za-z]+): ', '');
BEGIN
    IF coalesce(detail, '') <> '' AND coalesce(hint, '') <> '' THEN
        RAISE EXCEPTION USING ERRCODE = sqlstate, MESSAGE = m, DETAIL = detail, HINT = hint;
    ELSIF coalesce(detail, '') <> '' THEN
        RAISE EXCEPTION USING ERRCODE = sqlstate, MESSAGE = m, DETAIL = detail;
    ELSIF coalesce(hint, '') <> '' THEN
        RAISE EXCEPTION USING ERRCODE = sqlstate, MESSAGE = m, HINT = hint;
    END IF;
    RAISE EXCEPTION USING ERRCODE = sqlstate, MESSAGE = m;
END $$;
COMMENT ON FUNCTION memory._plain_error(text, text, text, text) IS
    'Raises the error (SQLSTATE, message, detail, hint) again, without the exception type PL/Python puts before a message (plpy.Error: ...): the PL/pgSQL fronts of the PL/Python functions call it.';

CREATE OR REPLACE FUNCTION memory.plpython_path()
RETURNS text
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE p text;
BEGIN
    SELECT value INTO p FROM memory.config WHERE key = 'plpython_path';
    IF p IS NULL THEN
        RAISE EXCEPTION 'the PL/Python module path is not configured'
            USING ERRCODE = @vocabulary.sqlstate_component_unavailable@,
                  HINT = 'Run `poimen-memory migrate` (from any host: it writes the module into the database), or set a directory the server reads: INSERT INTO memory.config VALUES (''plpython_path'', ''/path/containing/poimen_core'').';
    END IF;
    RETURN p;
END $$;
COMMENT ON FUNCTION memory.plpython_path() IS
    'Directory holding the poimen_core package for PL/Python (content-hashed per version).';

CREATE OR REPLACE FUNCTION memory.plpython_load()
RETURNS text
-- PARALLEL UNSAFE: plpy.execute runs in a subtransaction (see memory.optimize_query).
LANGUAGE plpython3u STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
import sys
# Prepared once a backend (a statement planned at every call was most of this function's
# cost, which every PL/Python call pays); PostgreSQL plans it again if memory.config changes.
# (SD: this function's own, renewed when a deploy replaces the function.)
if "config" not in SD:
    SD["config"] = plpy.prepare(
        "SELECT (SELECT value FROM memory.config WHERE key = 'plpython_path') AS p,"
        " (SELECT value FROM memory.config WHERE key = 'plpython_checksum') AS c")
row = plpy.execute(SD["config"])[0]
# Without a directory on this host, the package comes from memory._plpython_modules, which
# migrate rewrites on every deploy: the checksum names the version a backend has imported.
where = row["p"] if row["p"] is not None else "database:%s" % (row["c"] or "none")
if GD.get("poimen_path") != where:  # new deploy: drop the stale module, import the new one
    for m in [m for m in sys.modules if m.split(".")[0] == "poimen_core"]: del sys.modules[m]
    sys.path[:] = [p for p in sys.path if p != GD.get("poimen_path")]
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "poimen_finder", False)]
    if row["p"] is not None:
        sys.path.insert(0, row["p"])
    else:
        import importlib.abc, importlib.util
        src = {r["name"]: r["source"] for r in plpy.execute(
            "SELECT name, source FROM memory._plpython_modules WHERE name LIKE '%.py'")}
        class PoimenFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
            # Imports poimen_core.* from the rows read above, never from a file.
            poimen_finder = True
            def find_spec(self, fullname, path=None, target=None):
                parts = fullname.split(".")
                if parts[0] != "poimen_core" or len(parts) > 2:
                    return None
                fname = "__init__.py" if len(parts) == 1 else parts[1] + ".py"
                if fname not in src:
                    return None
                return importlib.util.spec_from_loader(
                    fullname, self, origin="memory._plpython_modules:" + fname,
                    is_package=len(parts) == 1)
            def create_module(self, spec):
                return None
            def exec_module(self, module):
                fname = module.__spec__.origin.rsplit(":", 1)[1]
                if fname == "__init__.py":
                    module.__path__ = []
                exec(compile(src[fname], module.__spec__.origin, "exec"), module.__dict__)
        sys.meta_path.insert(0, PoimenFinder())
    GD["poimen_path"] = where
if "poimen_entry" not in GD:
    import importlib
    def poimen_entry(module, name, what, hint):
        # The one place a shim's import failure becomes PM503: restored on another host, or
        # the directory was removed.
        try:
            return getattr(importlib.import_module("poimen_core." + module), name)
        except ImportError as e:
            plpy.error("the PL/Python %s module cannot be imported on this host" % what,
                       sqlstate=@vocabulary.sqlstate_component_unavailable@, hint=hint,
                       detail="%s (memory.config plpython_path = %s)" % (e, GD["poimen_path"]))
    GD["poimen_entry"] = poimen_entry
return where
$$;
COMMENT ON FUNCTION memory.plpython_load() IS
    'Makes this deploy''s poimen_core importable in the backend, dropping an older version''s modules: from the directory memory.config plpython_path names when it has one, else from memory._plpython_modules (written by migrate, so a database on another host needs none of the service''s files). Keeps GD["poimen_entry"](module, name, what, hint): a poimen_core function, or PM503 with the hint when it cannot be imported. Returns the directory, or database:<checksum>. Called by every PL/Python shim.';

CREATE OR REPLACE FUNCTION memory._optimize_query(query text, reference_time timestamptz)
RETURNS jsonb
-- PARALLEL UNSAFE: every plpy.execute runs in a subtransaction, which a parallel operation
-- forbids ("cannot start subtransactions during a parallel operation").
LANGUAGE plpython3u STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
-- reference_time reaches Python as text: pin the format Python's fromisoformat reads.
SET DateStyle = 'ISO, YMD'
SET TimeZone = 'UTC'
AS $$
# Prepared once a backend: SD is this function's own (planned under its search_path) and
# is renewed when a deploy replaces the function.
if "load" not in SD:
    SD["load"] = plpy.prepare("SELECT memory.plpython_load() AS p")
plpy.execute(SD["load"])
plan_for_sql = GD["poimen_entry"](
    "plentry", "plan_for_sql", "optimizer",
    "Run `poimen-memory migrate` (from any host: it writes the module into the database); text-only queries "
    "(no query_embedding) and forced strategies work without it.")
return plan_for_sql(plpy, query, reference_time)
$$;
COMMENT ON FUNCTION memory._optimize_query(text, timestamptz) IS
    'Routes a raw query: question type, search strategy (LexicalOnly, LexicalFirst, Hybrid), confidence, the reasons, and the dates the text names (relative ones such as "last week" resolved against reference_time; NULL: now) with the time_filter they ask for, as jsonb. Same module as the HTTP service. PM503 when the module is missing on this host. Callers go through memory.optimize_query, which checks reference_time first.';

-- A PL/pgSQL front, so that a bad reference_time is refused as the planner refuses it
-- (22023 with a plain message), before Python sees a value it cannot represent, and the
-- module's errors read without PL/Python's prefix.
CREATE OR REPLACE FUNCTION memory.optimize_query(query text, reference_time timestamptz)
RETURNS jsonb
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN memory._optimize_query(query, memory.check_reference_time(reference_time));
@plain_errors@
END $$;
COMMENT ON FUNCTION memory.optimize_query(text, timestamptz) IS
    'Routes a raw query: question type, search strategy (LexicalOnly, LexicalFirst, Hybrid), confidence, the reasons, and the dates the text names (relative ones such as "last week" resolved against reference_time; NULL: now) with the time_filter they ask for, as jsonb. Same module as the HTTP service. 22023 for a reference_time outside the years memory.check_reference_time takes; PM503 when the module is missing on this host.';

CREATE OR REPLACE FUNCTION memory.optimize_query(query text)
RETURNS jsonb
LANGUAGE sql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
RETURN memory.optimize_query(query, NULL::timestamptz);
COMMENT ON FUNCTION memory.optimize_query(text) IS
    'memory.optimize_query(query, reference_time) with relative dates resolved against now.';
