-- Entry points on the default search_path, so `SELECT * FROM memory_query('...')` works.
-- Each alias is made from its target's catalog entry (arguments with their defaults, result,
-- volatility, parallel label), so an alias can never disagree with what it calls. An alias
-- is replaced in place, so its OID (and anything a DBA built on it) survives a re-run.
-- Every overload gets its alias. When a target's signature changes, the migration that
-- drops the old target drops its alias too (as migrations/0022_drop_old_signatures.sql
-- did the older ones).
DO $$
DECLARE
    a record;
    target regprocedure;
    body text;
BEGIN
    FOR a IN SELECT * FROM (VALUES ('memory', 'query', 'memory_query'),
                                   ('memory', 'optimize_query', 'memory_optimize_query'))
                           AS v(nsp, fn, alias)
    LOOP
        FOR target IN
            SELECT p.oid FROM pg_catalog.pg_proc p
            WHERE p.pronamespace = a.nsp::regnamespace AND p.proname = a.fn
        LOOP
            SELECT pg_catalog.format('SELECT * FROM %I.%I(%s)', a.nsp, a.fn,
                                     pg_catalog.string_agg('$' || i, ', ' ORDER BY i))
              INTO body
              FROM pg_catalog.generate_series(1, (SELECT p.pronargs FROM pg_catalog.pg_proc p
                                                   WHERE p.oid = target)) AS i;
            EXECUTE pg_catalog.format(
                'CREATE OR REPLACE FUNCTION public.%I(%s) RETURNS %s LANGUAGE sql %s '
                'SET search_path = pg_catalog, pg_temp AS %L',
                a.alias, pg_catalog.pg_get_function_arguments(target),
                pg_catalog.pg_get_function_result(target),
                (SELECT CASE p.provolatile WHEN 'i' THEN 'IMMUTABLE' WHEN 's' THEN 'STABLE'
                                           ELSE 'VOLATILE' END
                        || CASE p.proparallel WHEN 's' THEN ' PARALLEL SAFE'
                                              WHEN 'r' THEN ' PARALLEL RESTRICTED'
                                              ELSE ' PARALLEL UNSAFE' END
                 FROM pg_catalog.pg_proc p WHERE p.oid = target),
                body);
            EXECUTE pg_catalog.format(
                'COMMENT ON FUNCTION public.%I(%s) IS %L', a.alias,
                pg_catalog.pg_get_function_identity_arguments(target),
                pg_catalog.format('Alias of %s.%s on the default search_path, made from its signature by sql/079_aliases.sql. See docs/sql-api.md.', a.nsp, a.fn));
        END LOOP;
    END LOOP;
END $$;
