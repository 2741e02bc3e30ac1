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
