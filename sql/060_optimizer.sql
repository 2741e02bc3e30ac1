-- The query optimizer inside PostgreSQL: a shim into the same stdlib-only module the
-- service imports (plpython/poimen_core), installed by `poimen-memory migrate`.

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
                  HINT = 'Run `poimen-memory migrate` on the database host, or set it: INSERT INTO memory.config VALUES (''plpython_path'', ''/path/containing/poimen_core'').';
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
path = plpy.execute("SELECT memory.plpython_path() AS p")[0]["p"]
if GD.get("poimen_path") != path:  # new deploy: drop the stale module, import the new one
    for m in [m for m in sys.modules if m.split(".")[0] == "poimen_core"]: del sys.modules[m]
    sys.path[:] = [path] + [p for p in sys.path if p != GD.get("poimen_path")]; GD["poimen_path"] = path
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
return path
$$;
COMMENT ON FUNCTION memory.plpython_load() IS
    'Puts this deploy''s poimen_core directory (memory.plpython_path()) first on the backend''s sys.path, dropping an older copy''s modules, and keeps GD["poimen_entry"](module, name, what, hint): a poimen_core function, or PM503 with the hint when this host cannot import it. Returns the directory. Called by every PL/Python shim.';

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
plpy.execute("SELECT memory.plpython_load()")
plan_for_sql = GD["poimen_entry"](
    "plentry", "plan_for_sql", "optimizer",
    "Run `poimen-memory migrate` on this database host; text-only queries "
    "(no query_embedding) and forced strategies work without it.")
return plan_for_sql(plpy, query, reference_time)
$$;
COMMENT ON FUNCTION memory._optimize_query(text, timestamptz) IS
    'Routes a raw query: question type, search strategy (LexicalOnly, LexicalFirst, Hybrid), confidence, the reasons, and the dates the text names (relative ones such as "last week" resolved against reference_time; NULL: now) with the time_filter they ask for, as jsonb. Same module as the HTTP service. PM503 when the module is missing on this host. Callers go through memory.optimize_query, which checks reference_time first.';

-- A PL/pgSQL front, so that a bad reference_time is refused as the planner refuses it
-- (22023 with a plain message), before Python sees a value it cannot represent.
CREATE OR REPLACE FUNCTION memory.optimize_query(query text, reference_time timestamptz)
RETURNS jsonb
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN memory._optimize_query(query, memory.check_reference_time(reference_time));
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
