-- memory.query and memory.answer: the SQL user's entry points, over the one plan
-- (066_plan.sql) and the one executor (071_execute.sql); memory.hydrate, a page of rows.
-- Parallel labels: memory.query may call the PL/Python optimizer, whose plpy.execute runs in
-- a subtransaction, which a parallel operation forbids: it and its aliases are PARALLEL
-- UNSAFE. The stages it calls stay PARALLEL SAFE where they are.

-- memory._hydrate is the body; memory.hydrate computes the page's support itself, while an
-- answer (memory._finish) passes the support it already computed to demote the results in
-- doubt: support walks every result's parents, and their derived parents' (issue 42: it ran
-- twice an answer, 1.1 ms of its ~20 ms of database time on LoCoMo).
CREATE OR REPLACE FUNCTION memory._hydrate(
    ids bigint[],
    query_embedding vector,
    max_depth integer,
    project_name text,
    as_of timestamptz,
    support_valid_at timestamptz,
    -- {"node_id": {"support": .., "changed_parents": ..}} of memory._support_at at as_of and
    -- support_valid_at, for every id of the page (memory._support_rows); NULL: computed here,
    -- by the same function
    support_rows jsonb
)
RETURNS TABLE (node_id bigint, level text, sha256 text, project text, title text, text text,
               source text, breadcrumb text[], "timestamp" timestamptz,
               query_score double precision, provenance jsonb, external_id text,
               provenance_truncated boolean, metadata jsonb, support text,
               changed_parents jsonb)
LANGUAGE plpgsql STABLE PARALLEL SAFE
-- public holds pgvector's <=> unless migrate finds vector elsewhere and pins that schema.
SET search_path = pg_catalog, public, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    pid integer := memory.project_id(project_name);
BEGIN
    -- Checked once, not per row in the statement below (a call a row, with its SET clause).
    query_embedding := memory.check_embedding(query_embedding);
    -- One way to the rows' support, whoever calls: the answer's, else computed here.
    support_rows := coalesce(support_rows, memory._support_rows(ids, as_of, support_valid_at));
    -- Static (as a dynamic statement the page was planned at every call: 0.3 of an answer's
    -- 1.8 ms of planning on LoCoMo), under the caller's plan_cache_mode: memory._finish's
    -- choice (memory._plan_cache_mode) makes its plan once a session on one table, and
    -- leaves it to PostgreSQL (auto) on the partitioned layout, where a plan made per call
    -- prunes to the project's partition and one made for any project probes every
    -- partition, the one it prices higher wherever there are more than a few. (A SET
    -- clause choosing per layout would need set_config, which a parallel worker, where
    -- memory.hydrate may run, refuses.) Each node is a probe of the primary key by id; the
    -- project is a filter of the probe (as a range of keys it made an index condition that
    -- a plan made for every project, guessing the range's size, preferred to the probes:
    -- all of a project's rows read for a page).
    RETURN QUERY
    WITH page AS MATERIALIZED (
        SELECT n.id, n.project_id, n.level, n.sha256, n.title, n.text, n.source,
               n.breadcrumb, n.ts, n.embedding, n.external_id, n.metadata,
               n.parents_declared,
               row_number() OVER (ORDER BY i.ord)::integer AS pos
        FROM unnest(ids) WITH ORDINALITY AS i(id, ord)
        JOIN memory.nodes n ON n.id = i.id AND (pid IS NULL OR n.project_id = pid)
    )
    SELECT n.id, n.level, encode(n.sha256, 'hex'),
           coalesce(CASE WHEN pid IS NOT NULL THEN project_name END,
                    (SELECT p.name FROM memory.projects p WHERE p.id = n.project_id)),
           n.title, n.text, n.source, n.breadcrumb, n.ts,
           CASE WHEN query_embedding IS NULL OR n.embedding IS NULL THEN NULL
                ELSE 1 - (n.embedding <=> query_embedding) END,
           pv.tree, n.external_id, pv.truncated, n.metadata, su.support, su.changed_parents
    FROM page n
    JOIN memory.provenance_forest(
             ARRAY(SELECT g.id FROM page g ORDER BY g.pos), max_depth,
             ARRAY(SELECT g.project_id FROM page g ORDER BY g.pos), as_of) pv
      ON pv.position = n.pos
    -- a node without support (memory._support_at gives it no row) is left out
    JOIN LATERAL (SELECT s.v ->> 'support' AS support,
                         nullif(s.v -> 'changed_parents', 'null') AS changed_parents
                  FROM (SELECT support_rows -> n.id::text) AS s(v) WHERE s.v IS NOT NULL) su ON true
    ORDER BY n.pos;
END $$;
COMMENT ON FUNCTION memory._hydrate(bigint[], vector, integer, text, timestamptz, timestamptz, jsonb) IS
    'memory.hydrate''s rows (the query vector checked once, whatever the ids: memory.check_embedding), with each node''s support and changed_parents taken from support_rows ({"node_id": {"support", "changed_parents"}}, memory._support_rows at the same as_of and support_valid_at; a node it has no entry for is left out) instead of computed again; support_rows NULL: computed here, as memory.hydrate does.';

-- Each node's support (memory._support_at) as memory._hydrate takes it: keyed by node id.
CREATE OR REPLACE FUNCTION memory._support_rows(
    ids bigint[], as_of timestamptz, valid_at timestamptz
)
RETURNS jsonb
-- PL/pgSQL, not SQL: PostgreSQL 15 plans a SQL function's body at every call.
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN (SELECT coalesce(jsonb_object_agg(s.node_id::text,
                                             jsonb_build_object('support', s.support,
                                                                'changed_parents', s.changed_parents)),
                            '{}')
            FROM memory._support_at(ids, as_of, valid_at) s);
END $$;
COMMENT ON FUNCTION memory._support_rows(bigint[], timestamptz, timestamptz) IS
    'The support of each of ids at as_of and valid_at (memory._support_at), as {"node_id": {"support", "changed_parents"}}: what memory._finish demotes the results in doubt by and hands memory._hydrate, so an answer computes it once.';

CREATE OR REPLACE FUNCTION memory.hydrate(
    ids bigint[],
    query_embedding vector DEFAULT NULL,
    max_depth integer DEFAULT 4,
    project_name text DEFAULT NULL,  -- not "project": that is a result column
    as_of timestamptz DEFAULT NULL,
    support_valid_at timestamptz DEFAULT NULL
)
RETURNS TABLE (node_id bigint, level text, sha256 text, project text, title text, text text,
               source text, breadcrumb text[], "timestamp" timestamptz,
               query_score double precision, provenance jsonb, external_id text,
               provenance_truncated boolean, metadata jsonb, support text,
               changed_parents jsonb)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN QUERY SELECT * FROM memory._hydrate(ids, query_embedding, max_depth, project_name,
                                               as_of, support_valid_at, NULL);
END $$;
COMMENT ON FUNCTION memory.hydrate(bigint[], vector, integer, text, timestamptz, timestamptz) IS
    'Node rows for the given ids, in input order (with project_name: only ids of that project, PM404 when unknown), with query_score (if an embedding is given; it is checked whatever the ids, memory.check_embedding), provenance down to L0 as nested jsonb (capped: memory.provenance_forest, all trees in one pass; a parent version rewritten since is shown marked superseded), external_id, provenance_truncated when a cap left parents out, metadata, support and changed_parents (memory._support_at at as_of and support_valid_at: full, stale, partial, none, or NULL for a node written without parents). as_of: provenance through the versions visible then. One round trip for a whole result page.';

CREATE OR REPLACE FUNCTION memory._answer(req jsonb, query_embedding vector, caller text)
RETURNS jsonb
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
DECLARE
    p record;
BEGIN
    -- The one plan and the one executor (sql/066_plan.sql, sql/071_execute.sql).
    SELECT * INTO p FROM memory._prepare(req, query_embedding, caller);
    RETURN memory._execute(p.plan, p.embedding);
END $$;
COMMENT ON FUNCTION memory._answer(jsonb, vector, text) IS
    'Implementation of memory.answer and memory.query: the request (memory._request) planned and run; caller names the entry point in NOTICEs.';

CREATE OR REPLACE FUNCTION memory.query(
    query text,
    query_embedding vector DEFAULT NULL,
    project text DEFAULT NULL,
    levels text[] DEFAULT ARRAY['L1', 'L2'],
    k integer DEFAULT 5,
    strategy text DEFAULT NULL,
    fusion text DEFAULT NULL,
    rrf_k integer DEFAULT NULL,
    candidates integer DEFAULT NULL,
    dense_weight double precision DEFAULT NULL,
    since text DEFAULT NULL,
    until text DEFAULT NULL,
    reference_time timestamptz DEFAULT NULL,
    filter jsonb DEFAULT NULL,
    min_cosine double precision DEFAULT NULL,
    as_of timestamptz DEFAULT NULL,
    valid_at timestamptz DEFAULT NULL,
    unsupported text DEFAULT NULL
)
RETURNS SETOF memory.query_row
LANGUAGE sql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    -- memory.answer's results; they cite no evidence list, so the plan's budget is 0 and
    -- each row keeps its whole provenance tree.
    SELECT * FROM jsonb_populate_recordset(
        NULL::memory.query_row,
        memory._answer(memory._request(query, project, levels, k, strategy, fusion, rrf_k,
                                       candidates, dense_weight, since, until, reference_time,
                                       0) || jsonb_build_object('filter', filter, 'min_cosine', min_cosine,
                                                                'as_of', as_of, 'valid_at', valid_at,
                                                                'unsupported', unsupported),
                       query_embedding, 'memory.query') -> 'results');
END;
COMMENT ON FUNCTION memory.query(text, vector, text, text[], integer, text, text, integer, integer, double precision, text, text, timestamptz, jsonb, double precision, timestamptz, timestamptz, text) IS
    'One-call retrieval: routes by the optimizer (or strategy), runs lexical/semantic legs, fuses them, and returns the top k (1..50) nodes with node_id, external_id, scores, ranks and provenance down to L0. Without query_embedding it routes and embeds in the database (memory.embed), as the HTTP service does; where the embedder or PL/Python is missing the lexical leg answers alone, with a NOTICE. fusion, rrf_k, candidates and dense_weight default to memory.policy(), the same policy the HTTP service reads. since/until (inclusive ISO dates or timestamps) keep only nodes whose timestamp is in range, inside every leg before its top k; reference_time (default now) anchors relative dates the optimizer extracts ("last week"), which filter only under memory.policy() extracted_dates = filter. The query grammar holds in every leg (strict +"phrases", -exclusions, OR, #tags, @mentions: docs/sql-api.md; a phrase quoted in a question raises what contains it instead); filter (a JSON object) keeps only nodes whose metadata contains it, inside every leg before its top k. min_cosine (default memory.policy() min_cosine, else the database model''s: @vocabulary.model_floors_prose@; -1: off) holds back the fused candidates whose cosine similarity to the query is below it unless the query''s words vouch for them (docs/sql-api.md, "Relevance floor"): the answer may be empty. as_of (time travel) answers from the versions the database held then, BM25 scored with the corpus statistics of that moment; valid_at keeps nodes whose valid time holds then (default: as_of, else now); both inside every leg before its top k (docs/lifecycle.md). Each row says its support (full, stale, partial, none: memory._support_at at those instants) and changed_parents; unsupported (demote, exclude, keep; NULL: the policy''s, demote) ranks results in doubt below the supported ones, leaves them out, or keeps the fused order.';

CREATE OR REPLACE FUNCTION memory._only(name text)
RETURNS regprocedure
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN (SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
        WHERE p.pronamespace = 'memory'::regnamespace AND p.proname = name);
COMMENT ON FUNCTION memory._only(text) IS
    'The one function of schema memory with this name, whatever schema its argument types live in (sql/ files use it to comment generated functions).';

-- memory.answer and memory.plan_query take memory.query's arguments, and evidence: made from
-- its catalog entry (as the public aliases are, sql/079_aliases.sql), so the three entry
-- points can never disagree about a name, a type or a default.
DO $$
DECLARE
    -- By name, not by a signature naming vector: pgvector's schema need not be on the path.
    args text := (SELECT pg_catalog.pg_get_function_arguments(p.oid) FROM pg_catalog.pg_proc p
                  WHERE p.pronamespace = 'memory'::regnamespace AND p.proname = 'query');
    request text := 'memory._request(query, project, levels, k, strategy, fusion, rrf_k, '
                    'candidates, dense_weight, since, until, reference_time, evidence) '
                    '|| jsonb_build_object(''filter'', filter, ''min_cosine'', min_cosine, '
                    '''as_of'', as_of, ''valid_at'', valid_at, ''unsupported'', unsupported)';
BEGIN
    EXECUTE pg_catalog.format(
        'CREATE OR REPLACE FUNCTION memory.answer(%s, evidence integer DEFAULT NULL) '
        'RETURNS jsonb LANGUAGE sql STABLE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp '
        'RETURN memory._answer(%s, query_embedding, %L)', args, request, 'memory.answer');
    EXECUTE pg_catalog.format('COMMENT ON FUNCTION %s IS %L', memory._only('answer'),
        'The whole answer GET /memory/query gives, as jsonb: search_strategy, plan (memory.plan_query''s), results (as memory.query''s rows, each provenance tree kept to the cited L0 turns, provenance_l0_omitted counting the rest), evidence (the cited L0 turns, best first, at most evidence of them: NULL, the policy''s evidence_budget; 0: none, whole trees), counts and stage times. Arguments as memory.query.');
    -- The plan is made as memory._prepare makes it for memory.answer: a query vector is at
    -- hand (given, or memory.embed would make one).
    EXECUTE pg_catalog.format(
        'CREATE OR REPLACE FUNCTION memory.plan_query(%s, evidence integer DEFAULT NULL) '
        'RETURNS jsonb LANGUAGE sql STABLE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp '
        'RETURN memory._plan(%s)', args, request);
    EXECUTE pg_catalog.format('COMMENT ON FUNCTION %s IS %L', memory._only('plan_query'),
        'The plan memory.answer (and memory.query, with evidence 0) runs for these arguments, without running it (jsonb: search_strategy, why, fusion, dense_weight, rrf_k, each leg''s engine and depth, levels, since_ts/before_ts, time_filter, evidence). query_embedding is not read: a vector is assumed at hand.');
END $$;
