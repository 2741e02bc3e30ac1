-- Retrieval policy: the one home of leg depths, the fusion default, RRF k and the dense
-- weight. memory.query and the HTTP service both read it here, so SQL and HTTP rank alike.
-- The defaults are the measured ones (docs/benchmarks.md); a DBA changes them with
-- memory.set_policy, which validates the value and records it in memory.config.

-- The one table of policy keys: memory.policy reads the defaults here, memory.set_policy the
-- check of a value (an expression of $1, the value as text) and its hint, memory.reset_policy
-- the names. A key is added here and in memory.policy's result columns, nowhere else.
CREATE OR REPLACE FUNCTION memory._policy_keys()
RETURNS TABLE (key text, default_value text, valid text, hint text)
-- PL/pgSQL, not SQL: it keeps its plan for the session (memory.policy runs twice a query).
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN QUERY VALUES
        ('fusion', 'convex', '$1 = ANY (' || quote_literal(@vocabulary.fusions@) || '::text[])', 'rrf|convex'),
        ('rrf_k', '10', '$1 ~ ''^[0-9]{1,6}$''', 'an integer >= 0'),
        ('dense_weight', '0.4', '$1 ~ ''^[0-9]*\.?[0-9]+$'' AND $1::double precision <= 1', '0..1'),
        ('candidates', '50', '$1 ~ ''^[0-9]{1,4}$'' AND $1::integer BETWEEN 1 AND 1000', '1..1000'),
        ('cascade_candidates', '200', '$1 ~ ''^[0-9]{1,5}$'' AND $1::integer BETWEEN 1 AND 10000', '1..10000'),
        ('fusion_by_type', '{}', 'memory._valid_fusion_by_type($1)', '{"Factual":"convex",...}'),
        ('exact_search_max_k', '1000', '$1 ~ ''^[0-9]{1,6}$'' AND $1::integer BETWEEN 1 AND 100000', '1..100000'),
        -- the semantic leg of a named project with at most this many current nodes ranks
        -- them exactly (stage semantic_exact, memory._semantic_stage); 0: always HNSW (issue 28)
        ('exact_scan_max_nodes', '5000', '$1 ~ ''^[0-9]{1,7}$'' AND $1::integer BETWEEN 0 AND 1000000', '0..1000000 nodes (0: off)'),
        -- hnsw.ef_search of a project's HNSW scan, its own graph's or the shared one's
        -- (memory._semantic_ef; issue 28: 400 measured against 200 at 100k and 1M nodes)
        ('filtered_ef_search', '400', '$1 ~ ''^[0-9]{1,4}$'' AND $1::integer BETWEEN 1 AND 1000', '1..1000'),
        -- a store past large_store_nodes (the table's planner estimate) runs a scan naming
        -- no project at large_store_ef_search instead of 100, and memory.scale_warnings
        -- reports its m = 16 graphs (issue 28: recall@10 0.928 -> 0.966 at 1M nodes)
        ('large_store_nodes', '500000', '$1 ~ ''^[0-9]{1,10}$'' AND $1::bigint BETWEEN 1 AND 10000000000', '1..10000000000 nodes'),
        ('large_store_ef_search', '200', '$1 ~ ''^[0-9]{1,4}$'' AND $1::integer BETWEEN 1 AND 1000', '1..1000'),
        -- a project past this many current nodes (and past exact_scan_max_nodes) holding
        -- under half of the store gets HNSW graphs of its own at the next migrate
        -- (memory._project_graphs, sql/088_indexes.sql; issue 28)
        ('project_graph_min_nodes', '5000', '$1 ~ ''^[0-9]{1,7}$'' AND $1::integer BETWEEN 0 AND 10000000', '0..10000000 nodes (0: off)'),
        -- at most this many projects have graphs of their own, the largest (n_docs, ties by
        -- id): each pair is planned by every statement on memory.nodes and checked by every
        -- insert (issue 42; docs/benchmarks.md, "A cap on per-project graphs"); 0: none
        ('project_graphs_max', '2', '$1 ~ ''^[0-9]{1,4}$'' AND $1::integer BETWEEN 0 AND 1000', '0..1000 projects (0: none)'),
        ('provenance_max_parents', '32', '$1 ~ ''^[0-9]{1,4}$'' AND $1::integer BETWEEN 1 AND 1000', '1..1000'),
        ('provenance_max_nodes', '256', '$1 ~ ''^[0-9]{1,6}$'' AND $1::integer BETWEEN 1 AND 100000', '1..100000'),
        -- a provenance tree's node shows this much of its text (bounded responses, issue 26)
        ('provenance_text_chars', '1000', '$1 ~ ''^[0-9]{1,6}$'' AND $1::integer BETWEEN 1 AND 100000', '1..100000 characters'),
        -- measured on LoCoMo dev (docs/benchmarks.md, "Time filters")
        ('extracted_dates', 'annotate', '$1 IN (''annotate'', ''filter'')', 'annotate|filter'),
        -- measured on LoCoMo dev (docs/benchmarks.md, "Evidence within a budget")
        ('evidence_budget', '20', '$1 ~ ''^[0-9]{1,3}$'' AND $1::integer BETWEEN 0 AND 100', '0..100 (0: off)'),
        ('evidence_candidates', '50', '$1 ~ ''^[0-9]{1,4}$'' AND $1::integer BETWEEN 1 AND 1000', '1..1000'),
        ('evidence_weight', '0.5', '$1 ~ ''^[0-9]*\.?[0-9]+$'' AND $1::double precision <= 10', '0..10'),
        ('evidence_neighbours', '0.4', '$1 ~ ''^[0-9]*\.?[0-9]+$'' AND $1::double precision <= 10', '0..10 (0: off)'),
        -- issue 29 (docs/benchmarks.md, "Evidence for the hard questions")
        ('evidence_session_decay', '1', '$1 ~ ''^[0-9]*\.?[0-9]+$'' AND $1::double precision <= 1', '0..1 (1: off)'),
        ('evidence_session_weight', '0.5', '$1 ~ ''^[0-9]*\.?[0-9]+$'' AND $1::double precision <= 10', '0..10 (0: off)'),
        ('evidence_hop_weight', '0', '$1 ~ ''^[0-9]*\.?[0-9]+$'' AND $1::double precision <= 10', '0..10 (0: off)'),
        ('evidence_hop_seeds', '3', '$1 ~ ''^[0-9]{1,3}$'' AND $1::integer BETWEEN 1 AND 100', '1..100'),
        ('evidence_deeper', '20', '$1 ~ ''^[0-9]{1,2}$'' AND $1::integer BETWEEN 0 AND 50', '0..50 (0: off)'),
        ('evidence_speaker_weight', '0.5', '$1 ~ ''^[0-9]*\.?[0-9]+$'' AND $1::double precision <= 10', '0..10 (0: off)'),
        ('evidence_speaker_seeds', '10', '$1 ~ ''^[0-9]{1,3}$'' AND $1::integer BETWEEN 1 AND 100', '1..100'),
        -- the relevance floor, on by default since issue 45 (docs/benchmarks.md, "A floor on
        -- by default"): NULL, the database's model's (the vocabulary's MODEL_FLOORS: 0.3 for
        -- MiniLM, 0.83 for e5, each keeping 95% of SciFact's training pairs); -1 turns it off
        -- (every cosine is at least -1)
        ('min_cosine', NULL, '$1 ~ ''^-?[0-9]*\.?[0-9]+$'' AND $1::double precision BETWEEN -1 AND 1', '-1..1'),
        -- a query of at most this many words is a keyword query: below the floor, a
        -- candidate holding one of its terms is kept (0: no query is a keyword query)
        ('floor_keyword_words', '3', '$1 ~ ''^[0-9]{1,2}$'' AND $1::integer BETWEEN 0 AND 50', '0..50 words'),
        -- and a longer query's candidate holding at least this share of its terms (at least
        -- one): 0.5 chosen on LoCoMo dev, whose L0 turns are short (docs/benchmarks.md)
        ('floor_term_share', '0.5', '$1 ~ ''^[0-9]*\.?[0-9]+$'' AND $1::double precision <= 1', '0..1 (1: all the terms)'),
        -- recency: off unless set (docs/benchmarks.md, "Recency")
        ('recency_half_life_days', NULL, '$1 ~ ''^[0-9]*\.?[0-9]+$'' AND $1::double precision BETWEEN 0.001 AND 36500', '0.001..36500 days'),
        ('recency_weight', '0.5', '$1 ~ ''^[0-9]*\.?[0-9]+$'' AND $1::double precision <= 1', '0..1'),
        -- the work a query may ask for, checked by memory._plan before anything runs (issue
        -- 43; docs/sql-api.md, "Query cost"): distinct scored terms (2,000 characters of
        -- prose hold at most 171; a LoCoMo question 15, a SciFact claim 23) and the postings
        -- the lexical leg would read (the terms'' document frequencies in the projects the
        -- query reads: a LoCoMo question at most 6,422, a SciFact claim 14,331)
        ('query_max_terms', '256', '$1 ~ ''^[0-9]{1,4}$'' AND $1::integer BETWEEN 1 AND 1000', '1..1000 distinct terms'),
        ('query_max_postings', '250000', '$1 ~ ''^[0-9]{1,10}$'' AND $1::bigint BETWEEN 1 AND 10000000000', '1..10000000000 postings'),
        ('forget_derived', 'flag', '$1 IN (''flag'', ''cascade'')', 'flag|cascade'),
        -- what an answer does with a result whose evidence changed or went (issue 40):
        -- ranks it below the supported ones, leaves it out, or keeps the fused order
        ('unsupported', 'demote', '$1 = ANY (' || quote_literal(@vocabulary.unsupported@) || '::text[])', 'demote|exclude|keep');
END $$;
COMMENT ON FUNCTION memory._policy_keys() IS
    'Every retrieval policy key: its built-in default (NULL: off, or the engine''s own), the check memory.set_policy applies to a new value (an SQL expression of $1) and the hint it gives when the check fails.';

-- The defaults as one constant, made from memory._policy_keys() whenever this file runs (so
-- a key is still added in one place): a function of no arguments that is IMMUTABLE is
-- evaluated once when a statement calling it is planned, so reading the policy costs a
-- lookup in memory.config, not a run of memory._policy_keys() (an answer read a key or the
-- whole policy 13 times, each a run of the 37-row function). A plan keeps the value it
-- folded: its readers below are created after this block, in the same file, so a change of
-- a default reaches them (PostgreSQL records no plan dependency on a folded function).
DO $do$
BEGIN
    EXECUTE pg_catalog.format($f$
CREATE OR REPLACE FUNCTION memory._policy_defaults()
RETURNS jsonb
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN %L::jsonb$f$,
        (SELECT pg_catalog.jsonb_object_agg(p.key, p.default_value) FROM memory._policy_keys() p));
END $do$;
COMMENT ON FUNCTION memory._policy_defaults() IS
    'Every policy key''s built-in default as one JSON object (NULL values: off, or the engine''s own), a constant made from memory._policy_keys() by migrate.';

CREATE OR REPLACE FUNCTION memory._policy_value(key text)
RETURNS text
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN coalesce((SELECT c.value FROM memory.config c WHERE c.key = _policy_value.key),
                    memory._policy_defaults() ->> key);
END $$;
COMMENT ON FUNCTION memory._policy_value(text) IS
    'One policy key''s value in force: memory.config''s, else its default from memory._policy_keys() (NULL: off, or an unknown key).';

CREATE OR REPLACE FUNCTION memory._valid_fusion_by_type(value text)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- {"Factual": "convex", "Open": "rrf"}: question types from memory.optimize_query.
    IF value IS NULL OR jsonb_typeof(value::jsonb) <> 'object' THEN
        RETURN false;
    END IF;
    RETURN NOT EXISTS (SELECT 1 FROM jsonb_each(value::jsonb) j
                       WHERE NOT j.key = ANY (@vocabulary.question_types@)
                          OR jsonb_typeof(j.value) <> 'string'
                          OR NOT (j.value #>> '{}') = ANY (@vocabulary.fusions@));
EXCEPTION WHEN invalid_text_representation THEN
    RETURN false;  -- not JSON at all
END $$;
COMMENT ON FUNCTION memory._valid_fusion_by_type(text) IS
    'Whether a fusion_by_type value is a JSON object from question types (memory.optimize_query''s) to fusions.';

CREATE OR REPLACE FUNCTION memory.policy()
RETURNS TABLE (fusion text, rrf_k integer, dense_weight double precision, candidates integer,
               cascade_candidates integer, fusion_by_type jsonb, extracted_dates text,
               evidence_budget integer, evidence_candidates integer,
               evidence_weight double precision, evidence_neighbours double precision,
               evidence_session_decay double precision, evidence_session_weight double precision,
               evidence_hop_weight double precision, evidence_hop_seeds integer,
               evidence_deeper integer, evidence_speaker_weight double precision,
               evidence_speaker_seeds integer,
               min_cosine double precision, recency_half_life_days double precision,
               recency_weight double precision)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN QUERY
    -- MATERIALIZED: inlined, the CTE's expression was copied into each of the 21 columns
    -- below and the merged object rebuilt 21 times a call (272 against 35 us a call)
    WITH v AS MATERIALIZED (
        -- the values set over the defaults (memory.config's other keys are never read)
        SELECT memory._policy_defaults()
               || coalesce((SELECT jsonb_object_agg(c.key, c.value) FROM memory.config c), '{}') AS v
    )
    SELECT v ->> 'fusion', (v ->> 'rrf_k')::integer, (v ->> 'dense_weight')::double precision,
           (v ->> 'candidates')::integer, (v ->> 'cascade_candidates')::integer,
           (v ->> 'fusion_by_type')::jsonb, v ->> 'extracted_dates',
           (v ->> 'evidence_budget')::integer, (v ->> 'evidence_candidates')::integer,
           (v ->> 'evidence_weight')::double precision,
           (v ->> 'evidence_neighbours')::double precision,
           (v ->> 'evidence_session_decay')::double precision,
           (v ->> 'evidence_session_weight')::double precision,
           (v ->> 'evidence_hop_weight')::double precision,
           (v ->> 'evidence_hop_seeds')::integer,
           (v ->> 'evidence_deeper')::integer,
           (v ->> 'evidence_speaker_weight')::double precision,
           (v ->> 'evidence_speaker_seeds')::integer,
           (v ->> 'min_cosine')::double precision,
           (v ->> 'recency_half_life_days')::double precision,
           (v ->> 'recency_weight')::double precision
    FROM v;
END
$$;
COMMENT ON FUNCTION memory.policy() IS
    'The retrieval policy in force, each key''s value or its default (memory._policy_keys()): default fusion (convex), RRF k (10), convex dense weight (0.4), Hybrid leg depth (candidates, 50), LexicalFirst lexical depth (cascade_candidates, 200), per-question-type fusion overrides, and what a date the optimizer extracts from the query does (extracted_dates: annotate, the default, only reports it in the plan; filter applies it as since/until when the caller gave none), and the evidence a response cites (memory.select_evidence: evidence_budget, 20, the most L0 turns cited; evidence_candidates, 50, the depth of the direct L0 legs; evidence_weight, 0.5, how much citation by a top result counts against a turn''s own match; evidence_neighbours, 0.4, how much a candidate lifts the turns said just before and after it), the relevance floor (min_cosine, NULL: the database model''s, @vocabulary.model_floors_prose@, none for another model; -1: off; the fused candidates whose cosine similarity to the query is below it are held back and counted as withheld unless the query''s words vouch for them: one of a keyword query''s terms, floor_keyword_words, 3, or floor_term_share, 0.5, of a longer query''s, both read by memory._plan), and recency (recency_half_life_days, NULL: off; each fused candidate''s score is multiplied by 1 - recency_weight + recency_weight * 0.5 ^ (age / half-life), its age the distance of its timestamp from the request''s reference_time or now, either side of it (a node dated in the future is aged too); a node without a timestamp gets no boost). Read by memory.query and by the HTTP service; change it with memory.set_policy.';

CREATE OR REPLACE FUNCTION memory.set_policy(key text, value text)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    k record;
    ok boolean;
BEGIN
    SELECT * INTO k FROM memory._policy_keys() p WHERE p.key = set_policy.key;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown policy key "%"', key
            USING ERRCODE = '22023',
                  HINT = 'Keys: ' || (SELECT string_agg(p.key, ', ') FROM memory._policy_keys() p) || '.';
    END IF;
    -- The checks are this file's constants, never the caller's text.
    EXECUTE 'SELECT coalesce(' || k.valid || ', false)' INTO ok USING value;
    IF NOT ok THEN
        RAISE EXCEPTION 'invalid value "%" for policy key "%"', value, key
            USING ERRCODE = '22023',
                  HINT = pg_catalog.format('%s: %s.', key, k.hint);
    END IF;
    INSERT INTO memory.config AS c (key, value) VALUES (key, value)
    ON CONFLICT ON CONSTRAINT config_pkey DO UPDATE SET value = EXCLUDED.value, updated_at = now();
END $$;
COMMENT ON FUNCTION memory.set_policy(text, text) IS
    'Sets one retrieval policy value after validating it (22023 otherwise). Takes effect for memory.query at once and for the HTTP service on its next query.';

CREATE OR REPLACE FUNCTION memory.reset_policy(key text DEFAULT NULL)
RETURNS void
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
    DELETE FROM memory.config c
    WHERE c.key IN (SELECT p.key FROM memory._policy_keys() p)
      AND (reset_policy.key IS NULL OR c.key = reset_policy.key)
$$;
COMMENT ON FUNCTION memory.reset_policy(text) IS
    'Returns one policy key (or, with NULL, all of them) to its built-in default.';
