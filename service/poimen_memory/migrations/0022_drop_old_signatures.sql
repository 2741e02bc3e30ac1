-- Old signatures and row shapes, dropped once (issue 41). The sql/ files are re-run on every
-- migrate and only create or replace; until this migration each of them also opened with
-- the DROP FUNCTIONs of the signatures it had outgrown, re-run on every deploy. They are
-- all here now, run once, and a later signature change adds its DROP to a new migration.
--
-- Order: migrations run before sql/, in the same transaction, so what this drops sql/ makes
-- again (with its new signature) before anyone sees the gap. Everything is conditional: a
-- database that never had a signature (a fresh one, or one migrated past it) skips it
-- without a notice, so migrate's report stays quiet. Callers go before what they call (a
-- SQL function's atomic body depends on what it calls). A row-level security policy that
-- calls a dropped function goes with it: sql/085_tenants.sql makes the policies again.

-- Without SET search_path: the signatures name pgvector's type as migrate's search_path
-- finds it (public, or the schema pgvector lives in).
CREATE FUNCTION pg_temp.drop_function(signature text)
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    f regprocedure;
    pol record;
BEGIN
    BEGIN
        f := pg_catalog.to_regprocedure(signature);
    EXCEPTION WHEN undefined_object THEN
        RETURN;  -- a type of the signature does not exist: neither does the function
    END;
    IF f IS NULL THEN
        RETURN;
    END IF;
    FOR pol IN SELECT p.polname, p.polrelid::regclass AS rel
               FROM pg_catalog.pg_depend d JOIN pg_catalog.pg_policy p ON p.oid = d.objid
               WHERE d.classid = 'pg_catalog.pg_policy'::regclass AND d.refobjid = f LOOP
        EXECUTE pg_catalog.format('DROP POLICY %I ON %s', pol.polname, pol.rel);
    END LOOP;
    EXECUTE pg_catalog.format('DROP FUNCTION %s', f);
END $$;

-- A declared row type (memory._declare_row) of another shape than the one sql/ declares
-- now goes, with the functions that return it (returned_by first, in that order: callers
-- before what they call), and returned_by's functions go wherever they still return
-- something else (an anonymous TABLE, before the row was declared). sql/ declares the row
-- and makes the functions again. No CASCADE: an object a DBA built on them stops the
-- migration and is named in the error.
CREATE FUNCTION pg_temp.retire_row(type_name text, columns text, returned_by text[])
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    target text := 'memory.' || pg_catalog.quote_ident(type_name);
    wanted text := 'pg_temp.' || pg_catalog.quote_ident('wanted_' || type_name);
    current_type regtype := pg_catalog.to_regtype(target);
    same boolean;
    f regprocedure;
BEGIN
    EXECUTE pg_catalog.format('CREATE TYPE %s AS (%s)', wanted, columns);
    same := current_type IS NULL OR NOT EXISTS (
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
        EXECUTE pg_catalog.format('DROP TYPE %s', target);
    END IF;
    EXECUTE pg_catalog.format('DROP TYPE %s', wanted);
END $$;

-- Result columns added (a result shape cannot be replaced in place): the older shapes go.
DO $$
BEGIN
    -- memory.policy(): extracted_dates, the evidence keys, min_cosine, then recency
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_proc p
               WHERE p.oid = pg_catalog.to_regprocedure('memory.policy()')
                 AND NOT 'evidence_speaker_seeds' = ANY (p.proargnames)) THEN
        DROP FUNCTION memory.policy();
    END IF;
    -- memory._stored_nodes: revision (migration 0012)
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_proc p
               WHERE p.oid = pg_catalog.to_regprocedure('memory._stored_nodes(text[], text[])')
                 AND NOT 'revision' = ANY (p.proargnames)) THEN
        DROP FUNCTION memory._stored_nodes(text[], text[]);
    END IF;
    -- memory.history: valid_from and valid_to (valid time)
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_proc p
               WHERE p.oid = pg_catalog.to_regprocedure('memory.history(text, text)')
                 AND NOT 'valid_to' = ANY (p.proargnames)) THEN
        DROP FUNCTION memory.history(text, text);
    END IF;
    -- the evidence rows gained metadata (issue 24): callers before what they call
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_proc p
               WHERE p.pronamespace = 'memory'::regnamespace
                 AND p.proname IN ('select_evidence', 'evidence', '_evidence')
                 AND NOT 'metadata' = ANY (p.proargnames)) THEN
        PERFORM pg_temp.drop_function(s) FROM pg_catalog.unnest(ARRAY[
            'memory.evidence(text, bigint[], vector, text, integer, text, text, text, text[], text, integer, double precision, integer, timestamptz)',
            'memory._evidence(text, bigint[], vector, text, integer, text, text, text, text[], text, integer, double precision, integer, timestamptz)',
            'memory.select_evidence(bigint[], jsonb, jsonb, text, integer, text, integer, timestamptz, timestamptz, double precision, integer)']) AS s;
    END IF;
END $$;

-- memory.query and the entry points made from its signature (memory.answer,
-- memory.plan_query, memory.explain_query) before unsupported (issue 40), and before it
-- filter, min_cosine, as_of and valid_at.
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid FROM pg_catalog.pg_proc p
             WHERE p.pronamespace = 'memory'::regnamespace
               AND p.proname IN ('query', 'answer', 'plan_query', 'explain_query')
               AND NOT 'unsupported' = ANY (coalesce(p.proargnames, '{}'))
    LOOP
        EXECUTE pg_catalog.format('DROP FUNCTION %s', f);
    END LOOP;
END $$;

-- Signatures that grew or changed, oldest first within each function, callers first.
SELECT pg_temp.drop_function(s) FROM pg_catalog.unnest(ARRAY[
    -- memory.node_filter: as_of and valid_at; then replaced by memory._leg_visibility
    -- (sql/019_visibility.sql, issue 41)
    'memory.node_filter(text, text[], timestamptz, timestamptz)',
    'memory.node_filter(text, text[], timestamptz, timestamptz, timestamptz, timestamptz)',
    -- memory._declare_row: returned_by went (the retired shapes are dropped here)
    'memory._declare_row(text, text, text[])',
    -- the per-operation lexical triggers' functions, before memory.nodes_lexical_statement
    'memory.nodes_lexical_insert()',
    'memory.nodes_lexical_delete()',
    'memory.nodes_lexical_update()',
    'memory.nodes_lexical_truncate()',
    -- memory.lexical_search: since/before, exhaustive (memory.lexical_search_exact went),
    -- filter, then as_of and valid_at
    'memory.lexical_search(text, text, text[], integer, double precision, double precision)',
    'memory.lexical_search_exact(text, text, text[], integer, double precision, double precision, timestamptz, timestamptz)',
    'memory.lexical_search_exact(text, text, text[], integer, double precision, double precision)',
    'memory.lexical_search(text, text, text[], integer, double precision, double precision, timestamptz, timestamptz)',
    'memory.lexical_search(text, text, text[], integer, double precision, double precision, timestamptz, timestamptz, boolean)',
    'memory.lexical_search(text, text, text[], integer, double precision, double precision, timestamptz, timestamptz, boolean, jsonb)',
    -- the vector stages: since/before, filter and grammar, then as_of and valid_at
    'memory.semantic_search(vector, text, text[], integer, integer)',
    'memory.exact_search(vector, text, text[], integer)',
    'memory.search_by_ids(vector, bigint[], text, text[], integer)',
    'memory.semantic_search(vector, text, text[], integer, integer, timestamptz, timestamptz)',
    'memory.search_by_ids(vector, bigint[], text, text[], integer, timestamptz, timestamptz)',
    'memory.semantic_search(vector, text, text[], integer, integer, timestamptz, timestamptz, jsonb, jsonb)',
    'memory.search_by_ids(vector, bigint[], text, text[], integer, timestamptz, timestamptz, jsonb, jsonb)',
    'memory.exact_search(vector, text, text[], integer, timestamptz, timestamptz)',
    'memory.exact_search(vector, text, text[], integer, timestamptz, timestamptz, jsonb)',
    -- provenance: as_of; root_project
    'memory.provenance_walk(bigint[], integer)',
    'memory.provenance_forest(bigint[], integer, integer[])',
    'memory.provenance(bigint, integer)',
    -- memory.query's first signatures ("limit" became k; node_id, external_id in the
    -- result), then since, until and reference_time (the time filter); run_query, its
    -- implementation before memory.answer's
    'public.memory_query(text, vector, text, text[], integer, text, text)',
    'memory.query(text, vector, text, text[], integer, text, text, integer, integer)',
    'memory.run_query(text, vector, text, text[], integer, text, text, integer, integer)',
    'public.memory_query(text, vector, text, text[], integer, text, text, integer, integer, double precision)',
    'memory.query(text, vector, text, text[], integer, text, text, integer, integer, double precision)',
    'memory.run_query(text, vector, text, text[], integer, text, text, integer, integer, double precision)',
    'memory.run_query(text, vector, text, text[], integer, text, text, integer, integer, double precision, text, text, timestamptz)',
    -- memory.hydrate: project, as_of (and metadata and support in its rows), then
    -- support_valid_at and changed_parents (issue 40)
    'memory.hydrate(bigint[], vector, integer)',
    'memory.hydrate(bigint[], vector, integer, text)',
    'memory.hydrate(bigint[], vector, integer, text, timestamptz)',
    -- memory.select_evidence: filter, as_of, the deeper candidates, the query's text
    -- (issue 29), then valid_at
    'memory.select_evidence(bigint[], jsonb, jsonb, text, integer, text, integer, timestamptz, timestamptz, double precision, integer)',
    'memory.select_evidence(bigint[], jsonb, jsonb, text, integer, text, integer, timestamptz, timestamptz, double precision, integer, jsonb)',
    'memory.select_evidence(bigint[], jsonb, jsonb, text, integer, text, integer, timestamptz, timestamptz, double precision, integer, jsonb, timestamptz)',
    'memory.select_evidence(bigint[], jsonb, jsonb, text, integer, text, integer, timestamptz, timestamptz, double precision, integer, jsonb, timestamptz, bigint[])',
    'memory.select_evidence(bigint[], jsonb, jsonb, text, integer, text, integer, timestamptz, timestamptz, double precision, integer, jsonb, timestamptz, bigint[], text)',
    -- memory.evidence: the old two-step form, then filter, then as_of and valid_at
    'memory.evidence(text, bigint[], vector, text, integer, text, text, text)',
    'memory.evidence_legs(text, bigint[], vector, text, integer, text, text, text)',
    'memory.evidence(text, bigint[], vector, text, integer, text, text, text, text[], text, integer, double precision, integer, timestamptz)',
    'memory._evidence(text, bigint[], vector, text, integer, text, text, text, text[], text, integer, double precision, integer, timestamptz)',
    'memory.evidence(text, bigint[], vector, text, integer, text, text, text, text[], text, integer, double precision, integer, timestamptz, jsonb)',
    'memory._evidence(text, bigint[], vector, text, integer, text, text, text, text[], text, integer, double precision, integer, timestamptz, jsonb)',
    -- memory.forget: filter, level, dry_run and max_nodes (issue 40)
    'memory.forget(text, text[], text, text, text, boolean, text)',
    'memory._forget(text, text[], text, text, text, boolean, text)',
    -- memory.explain_query's first form
    'memory.explain_query(text, vector, text, text[], integer, text, boolean)',
    -- edges carry their project (migration 0009): their policies no longer call it
    'memory.node_writable(bigint)',
    -- memory._project_graphs: hold
    'memory._project_graphs()',
    -- memory.list_nodes: filter and newest_first, and expires_at in its rows (issue 40)
    'memory.list_nodes(text, text, text, text, text, text, integer)',
    'memory._list_nodes(text, text, text, text, text, text, integer, text[])',
    -- issue 41: memory._nodes_where takes the listing's visibility
    'memory._nodes_where(boolean, boolean, boolean, boolean, boolean, boolean, boolean, boolean, boolean)']) AS s;

-- Every form of memory._leg before as_of and valid_at (and before it filter and grammar),
-- after memory._lexical_call (a SQL body that depends on it): sql/071_execute.sql makes
-- both again.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_proc p
               WHERE p.pronamespace = 'memory'::regnamespace AND p.proname = '_leg'
                 AND NOT 'valid_at' = ANY (coalesce(p.proargnames, '{}'))) THEN
        PERFORM pg_temp.drop_function('memory._lexical_call(jsonb)');
        PERFORM pg_temp.drop_function(p.oid::regprocedure::text) FROM pg_catalog.pg_proc p
        WHERE p.pronamespace = 'memory'::regnamespace AND p.proname = '_leg'
          AND NOT 'valid_at' = ANY (coalesce(p.proargnames, '{}'));
    END IF;
END $$;

-- The declared rows in the shapes sql/ declares now (memory._declare_row): an older shape
-- goes with the functions that return it; functions that returned an anonymous TABLE
-- before the row was declared go too.
SELECT pg_temp.retire_row('fused_row',
    'node_id bigint, ranks integer[], scores double precision[], fused_score double precision, fusion_method text',
    ARRAY['memory.fuse(jsonb, text, integer, integer)',
          'memory.fuse_legs(jsonb, jsonb, text, text, double precision, integer, integer)']);
SELECT pg_temp.retire_row('evidence_row',
    'rank integer, node_id bigint, external_id text, sha256 text, project text, title text, text text, source text, breadcrumb text[], "timestamp" timestamptz, score double precision, direct_rank integer, cited_by integer[], neighbour_score double precision, metadata jsonb, revision integer, superseded boolean',
    ARRAY['memory.evidence(text, bigint[], vector, text, integer, text, text, text, text[], text, integer, double precision, integer, timestamptz, jsonb, timestamptz, timestamptz)',
          'memory._evidence(text, bigint[], vector, text, integer, text, text, text, text[], text, integer, double precision, integer, timestamptz, jsonb, timestamptz, timestamptz)',
          'memory.select_evidence(bigint[], jsonb, jsonb, text, integer, text, integer, timestamptz, timestamptz, double precision, integer, jsonb, timestamptz, bigint[], text, timestamptz)']);
SELECT pg_temp.retire_row('review_item',
    'item_id bigint, project text, node_id bigint, external_id text, level text, reason text, changes jsonb, enqueued_at timestamptz, vt timestamptz, claims integer, claimed_by text, text text, parents jsonb',
    ARRAY['memory.review_list(text, integer, bigint)',
          'memory.review_claim(text, integer, integer)',
          'memory._review_rows(bigint[])']);
SELECT pg_temp.retire_row('node_row',
    'node_id bigint, external_id text, project text, level text, sha256 text, title text, text text, source text, breadcrumb text[], "timestamp" timestamptz, metadata jsonb, created_at timestamptz, parents jsonb, parents_total integer, children jsonb, children_total integer, parents_declared integer, support text, versions jsonb, valid_from timestamptz, valid_to timestamptz, revision integer',
    ARRAY['memory.get_node(text, text)', 'memory._get_node(text, text, text[])']);
SELECT pg_temp.retire_row('node_list_row',
    'node_id bigint, external_id text, project text, level text, sha256 text, title text, text text, source text, breadcrumb text[], "timestamp" timestamptz, metadata jsonb, created_at timestamptz, support text, cursor text, valid_from timestamptz, valid_to timestamptz, expires_at timestamptz, revision integer',
    ARRAY['memory.list_nodes(text, text, text, text, text, text, integer, jsonb, boolean)',
          'memory._list_nodes(text, text, text, text, text, text, integer, text[], jsonb, boolean)']);
-- memory.query_row: the functions returning an older shape go, each alias before what it
-- calls (the public alias, memory.query, run_query).
SELECT pg_temp.retire_row('query_row',
    'rank integer, node_id bigint, external_id text, level text, sha256 text, project text, title text, text text, source text, breadcrumb text[], "timestamp" timestamptz, query_score double precision, lexical_score double precision, final_score double precision, semantic_rank integer, lexical_rank integer, fusion_method text, search_strategy text, provenance jsonb, provenance_truncated boolean, metadata jsonb, support text, changed_parents jsonb, uncited_reason text',
    ARRAY(SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p
          WHERE p.prorettype = pg_catalog.to_regtype('memory.query_row')
          ORDER BY p.pronamespace = 'memory'::regnamespace, p.proname = 'run_query'));
-- Before the declared row the query functions returned an anonymous TABLE: each alias
-- before what it calls.
SELECT pg_temp.drop_function(p.oid::regprocedure::text)
FROM pg_catalog.pg_proc p
WHERE p.prorettype = 'pg_catalog.record'::pg_catalog.regtype
  AND ((p.pronamespace = 'public'::regnamespace AND p.proname = 'memory_query')
       OR (p.pronamespace = 'memory'::regnamespace AND p.proname IN ('query', 'run_query')))
ORDER BY p.proname = 'run_query', p.proname = 'query';

-- The public aliases (sql/079_aliases.sql) of a signature their targets no longer have.
SELECT pg_temp.drop_function(p.oid::regprocedure::text)
FROM pg_catalog.pg_proc p
WHERE p.pronamespace = 'public'::regnamespace
  AND ((p.proname = 'memory_query'
        AND p.oid IS DISTINCT FROM pg_catalog.to_regprocedure('public.memory_query(text, vector, text, text[], integer, text, text, integer, integer, double precision, text, text, timestamptz, jsonb, double precision, timestamptz, timestamptz, text)'))
       OR (p.proname = 'memory_optimize_query'
           AND p.oid IS DISTINCT FROM pg_catalog.to_regprocedure('public.memory_optimize_query(text, timestamptz)')));

DROP FUNCTION pg_temp.retire_row(text, text, text[]);
DROP FUNCTION pg_temp.drop_function(text);
