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

-- A declared result row, memory.<name>, as the functions that return it want it: sql/ files
-- declare their rows with it before the functions (sql/040_fusion.sql, 090_nodes.sql; the
-- older memory.query_row of 069_query_row.sql is declared the same way by hand, with the
-- query functions' past signatures), rather than in a migration, since a row type holds
-- no data. The wanted shape is built as a temporary type and compared with the stored one;
-- only a different shape replaces it, after dropping the functions that return it (an
-- unchanged type keeps its OID and its functions). returned_by names those functions,
-- callers first (a SQL function's atomic body depends on what it calls): each is dropped in
-- that order, and also where it still returns another type (an anonymous TABLE before the
-- row was declared). No CASCADE: an object a DBA built on them stops the migration and is
-- named in the error.
CREATE OR REPLACE FUNCTION memory._declare_row(type_name text, columns text, returned_by text[])
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
-- public: pgvector's schema (migrate writes the real one), so that returned_by may name a
-- function with a vector argument (memory.evidence).
SET search_path = pg_catalog, public, pg_temp
AS $$
DECLARE
    target text := 'memory.' || pg_catalog.quote_ident(type_name);
    wanted text := 'pg_temp.' || pg_catalog.quote_ident('wanted_' || type_name);
    current_type regtype := pg_catalog.to_regtype(target);
    same boolean;
    f regprocedure;
BEGIN
    EXECUTE pg_catalog.format('CREATE TYPE %s AS (%s)', wanted, columns);
    same := current_type IS NOT NULL AND NOT EXISTS (
        (SELECT a.attname, a.atttypid, a.atttypmod, a.attnum FROM pg_catalog.pg_attribute a
         WHERE a.attrelid = pg_catalog.to_regclass(wanted) AND a.attnum > 0
         EXCEPT
         SELECT a.attname, a.atttypid, a.atttypmod, a.attnum FROM pg_catalog.pg_attribute a
         WHERE a.attrelid = pg_catalog.to_regclass(target) AND a.attnum > 0 AND NOT a.attisdropped)
        UNION ALL
        (SELECT a.attname, a.atttypid, a.atttypmod, a.attnum FROM pg_catalog.pg_attribute a
         WHERE a.attrelid = pg_catalog.to_regclass(target) AND a.attnum > 0 AND NOT a.attisdropped
         EXCEPT
         SELECT a.attname, a.atttypid, a.atttypmod, a.attnum FROM pg_catalog.pg_attribute a
         WHERE a.attrelid = pg_catalog.to_regclass(wanted) AND a.attnum > 0));
    FOR f IN
        SELECT p.oid FROM pg_catalog.pg_proc p
        LEFT JOIN LATERAL pg_catalog.unnest(returned_by) WITH ORDINALITY AS r(sig, ord)
               ON pg_catalog.to_regprocedure(r.sig) = p.oid
        WHERE (r.ord IS NOT NULL AND p.prorettype IS DISTINCT FROM current_type)
           OR (NOT same AND p.prorettype = current_type)
        ORDER BY r.ord NULLS LAST, p.oid
    LOOP
        EXECUTE pg_catalog.format('DROP FUNCTION %s', f);
    END LOOP;
    IF NOT same THEN
        EXECUTE pg_catalog.format('DROP TYPE IF EXISTS %s', target);
        EXECUTE (SELECT pg_catalog.format('CREATE TYPE %s AS (%s)', target,
                            pg_catalog.string_agg(pg_catalog.format('%I %s', a.attname,
                                pg_catalog.format_type(a.atttypid, a.atttypmod)), ', '
                                ORDER BY a.attnum))
                 FROM pg_catalog.pg_attribute a
                 WHERE a.attrelid = pg_catalog.to_regclass(wanted) AND a.attnum > 0);
    END IF;
    EXECUTE pg_catalog.format('DROP TYPE %s', wanted);
END $$;
COMMENT ON FUNCTION memory._declare_row(text, text, text[]) IS
    'Declares the row type memory.<type_name> with the given columns (the text of CREATE TYPE ... AS (columns)); replaces it only when its shape differs, dropping the functions that return it first, and drops the functions of returned_by (signatures, callers first) that return anything else. sql/ re-creates them. Owner only.';
