-- Run-once changes around memory.query, re-run safely on every migrate: the old signatures
-- dropped (callers first) and the declared result row memory.query_row, replaced only when
-- its shape changed. The functions themselves: sql/070_query.sql.

-- The signatures changed ("limit" became k; node_id, external_id in the result): drop the
-- old ones first. DROP ... IF EXISTS is a no-op on a database that never had them.
DROP FUNCTION IF EXISTS public.memory_query(text, vector, text, text[], integer, text, text);
DROP FUNCTION IF EXISTS memory.query(text, vector, text, text[], integer, text, text, integer, integer);
DROP FUNCTION IF EXISTS memory.run_query(text, vector, text, text[], integer, text, text, integer, integer);
-- since, until and reference_time were added (the time filter): drop the shorter ones,
-- callers first (their atomic bodies depend on what they call).
DROP FUNCTION IF EXISTS public.memory_query(text, vector, text, text[], integer, text, text, integer, integer, double precision);
DROP FUNCTION IF EXISTS memory.query(text, vector, text, text[], integer, text, text, integer, integer, double precision);
DROP FUNCTION IF EXISTS memory.run_query(text, vector, text, text[], integer, text, text, integer, integer, double precision);
-- The row memory.query returns, declared once: memory.query, its implementation and the
-- public.memory_query alias all return SETOF memory.query_row. Declared here, like the
-- functions, rather than in a migration: it holds no data. The wanted shape is built as a
-- temporary type and compared with the stored one; only a different shape replaces it (with
-- the functions returning it, recreated below), so an unchanged type keeps its OID.
DO $$
DECLARE
    f regprocedure;
BEGIN
    CREATE TYPE pg_temp.query_row AS (
        rank integer,
        node_id bigint,
        external_id text,
        level text,
        sha256 text,
        project text,
        title text,
        text text,
        source text,
        breadcrumb text[],
        "timestamp" timestamptz,
        query_score double precision,
        lexical_score double precision,
        final_score double precision,
        semantic_rank integer,
        lexical_rank integer,
        fusion_method text,
        search_strategy text,
        provenance jsonb,
        provenance_truncated boolean,
        metadata jsonb,
        support text,
        changed_parents jsonb,
        uncited_reason text
    );
    IF to_regtype('memory.query_row') IS NULL
       OR EXISTS ((SELECT a.attname, a.atttypid, a.atttypmod, a.attnum FROM pg_catalog.pg_attribute a
                   WHERE a.attrelid = 'pg_temp.query_row'::regclass AND a.attnum > 0
                  EXCEPT
                   SELECT a.attname, a.atttypid, a.atttypmod, a.attnum FROM pg_catalog.pg_attribute a
                   WHERE a.attrelid = pg_catalog.to_regclass('memory.query_row') AND a.attnum > 0 AND NOT a.attisdropped)
                  UNION ALL
                  (SELECT a.attname, a.atttypid, a.atttypmod, a.attnum FROM pg_catalog.pg_attribute a
                   WHERE a.attrelid = pg_catalog.to_regclass('memory.query_row') AND a.attnum > 0 AND NOT a.attisdropped
                  EXCEPT
                   SELECT a.attname, a.atttypid, a.atttypmod, a.attnum FROM pg_catalog.pg_attribute a
                   WHERE a.attrelid = 'pg_temp.query_row'::regclass AND a.attnum > 0)) THEN
        -- The functions returning the old shape go first, each alias before what it calls;
        -- no CASCADE: an object a DBA built on them stops the migration and is named in the
        -- error, rather than vanishing.
        FOR f IN
            SELECT p.oid FROM pg_catalog.pg_proc p
            WHERE p.prorettype = pg_catalog.to_regtype('memory.query_row')
            ORDER BY p.pronamespace = 'memory'::regnamespace, p.proname = 'run_query'
        LOOP
            EXECUTE pg_catalog.format('DROP FUNCTION %s', f);
        END LOOP;
        DROP TYPE IF EXISTS memory.query_row;
        EXECUTE (SELECT pg_catalog.format('CREATE TYPE memory.query_row AS (%s)',
                            pg_catalog.string_agg(pg_catalog.format('%I %s', a.attname,
                                pg_catalog.format_type(a.atttypid, a.atttypmod)), ', '
                                ORDER BY a.attnum))
                 FROM pg_catalog.pg_attribute a
                 WHERE a.attrelid = 'pg_temp.query_row'::regclass AND a.attnum > 0);
    END IF;
    DROP TYPE pg_temp.query_row;
    -- Before the declared type the query functions returned an anonymous TABLE; a return
    -- type cannot be replaced in place, so those are dropped, each alias before what it calls.
    FOR f IN
        SELECT p.oid FROM pg_catalog.pg_proc p
        WHERE p.prorettype = 'pg_catalog.record'::pg_catalog.regtype
          AND ((p.pronamespace = 'public'::regnamespace AND p.proname = 'memory_query')
               OR (p.pronamespace = 'memory'::regnamespace AND p.proname IN ('query', 'run_query')))
        ORDER BY p.proname = 'run_query', p.proname = 'query'
    LOOP
        EXECUTE pg_catalog.format('DROP FUNCTION %s', f);
    END LOOP;
END $$;
