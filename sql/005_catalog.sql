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
