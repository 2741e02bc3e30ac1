-- Catalog hygiene: the schema version and the schema's COMMENT. The comments on every table,
-- type and column are in 950_comments.sql, applied after everything they describe exists.

CREATE OR REPLACE FUNCTION memory.version()
RETURNS TABLE (schema_version text, migrations text[], plpython_checksum text)
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT max(m.version), array_agg(m.version ORDER BY m.version),
           (SELECT c.value FROM memory.config c WHERE c.key = 'plpython_checksum')
    FROM memory.schema_migrations m
$$;
COMMENT ON FUNCTION memory.version() IS
    'The installed schema: the newest applied migration, all applied migrations, and the checksum of the PL/Python module recorded by the last migrate.';

COMMENT ON SCHEMA memory IS
    'poimen-memory: L0 evidence, L1 memories and L2 syntheses with provenance edges, in-database BM25 and vector retrieval. Entry point: memory.query (alias public.memory_query). See docs/sql-api.md.';

-- The domain of a project's name (migration 0015) checks the vocabulary's pattern
-- (poimen_core/vocabulary.py PROJECT_NAME). Written only when it differs: ALTER DOMAIN
-- checks every stored name again under a lock on memory.projects, and a deploy that
-- changes nothing takes no lock. Before migration 0015 there is no domain to check.
DO $$
DECLARE
    pattern constant text := @vocabulary.project_name@;
BEGIN
    IF pg_catalog.to_regtype('memory.project_name') IS NULL OR EXISTS (
        SELECT FROM pg_catalog.pg_constraint c
        WHERE c.contypid = pg_catalog.to_regtype('memory.project_name')
          AND c.conname = 'project_name_check'
          AND pg_catalog.pg_get_constraintdef(c.oid)
              = pg_catalog.format('CHECK ((VALUE ~ %L::text))', pattern)) THEN
        RETURN;
    END IF;
    ALTER DOMAIN memory.project_name DROP CONSTRAINT IF EXISTS project_name_check;
    EXECUTE pg_catalog.format(
        'ALTER DOMAIN memory.project_name ADD CONSTRAINT project_name_check CHECK (VALUE ~ %L)',
        pattern);
END $$;

-- A declared row type, memory.<name>: sql/ files declare their rows with it before the
-- functions that return or take them (sql/019_visibility.sql, 040_fusion.sql,
-- 069_query_row.sql, 090_nodes.sql ...) rather than in a migration, since a row type holds
-- no data. It is created when missing; a stored type of the same shape is left as it is
-- (its OID and its functions kept). A different shape is refused: changing it means
-- dropping the functions that return or take it, and that is a run-once change, written
-- in a migration (as migrations/0022_drop_old_signatures.sql retired the older shapes),
-- which runs before sql/ makes the type and its functions again.
CREATE OR REPLACE FUNCTION memory._declare_row(type_name text, columns text)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
DECLARE
    target text := 'memory.' || pg_catalog.quote_ident(type_name);
    wanted text := 'pg_temp.' || pg_catalog.quote_ident('wanted_' || type_name);
    differs text;
BEGIN
    IF pg_catalog.to_regtype(target) IS NULL THEN
        EXECUTE pg_catalog.format('CREATE TYPE %s AS (%s)', target, columns);
        RETURN;
    END IF;
    EXECUTE pg_catalog.format('CREATE TYPE %s AS (%s)', wanted, columns);
    SELECT pg_catalog.string_agg(d.attname::text, ', ' ORDER BY d.attname) INTO differs FROM (
        (SELECT a.attname, a.atttypid, a.atttypmod, a.attnum FROM pg_catalog.pg_attribute a
         WHERE a.attrelid = pg_catalog.to_regclass(wanted) AND a.attnum > 0
         EXCEPT
         SELECT a.attname, a.atttypid, a.atttypmod, a.attnum FROM pg_catalog.pg_attribute a
         WHERE a.attrelid = pg_catalog.to_regclass(target) AND a.attnum > 0 AND NOT a.attisdropped)
        UNION
        (SELECT a.attname, a.atttypid, a.atttypmod, a.attnum FROM pg_catalog.pg_attribute a
         WHERE a.attrelid = pg_catalog.to_regclass(target) AND a.attnum > 0 AND NOT a.attisdropped
         EXCEPT
         SELECT a.attname, a.atttypid, a.atttypmod, a.attnum FROM pg_catalog.pg_attribute a
         WHERE a.attrelid = pg_catalog.to_regclass(wanted) AND a.attnum > 0)) d;
    EXECUTE pg_catalog.format('DROP TYPE %s', wanted);
    IF differs IS NOT NULL THEN
        RAISE EXCEPTION 'the row type % has another shape than sql/ declares (columns %)', target, differs
            USING HINT = 'A row type''s shape changes in a run-once migration (migrations/): drop the '
                         'type and the functions returning or taking it there; sql/ makes them again.';
    END IF;
END $$;
COMMENT ON FUNCTION memory._declare_row(text, text) IS
    'Declares the row type memory.<type_name> with the given columns (the text of CREATE TYPE ... AS (columns)): creates it when missing, keeps a stored type of that shape, and refuses one of another shape (a shape change is a run-once migration). Owner only.';
