-- The one executor: runs a plan of memory._plan (sql/066_plan.sql). memory._run_legs runs the
-- legs it names (lexical, semantic or by-ids, the evidence's direct L0 legs) and fuses them;
-- memory._finish builds the answer: the results with their provenance, the evidence list
-- and each result's tree kept to the cited turns. memory._execute is both in one call. The
-- HTTP service calls them in one statement (two when a reranker reorders the fused
-- candidates in between); memory.query, memory.answer and memory.evidence call them too,
-- so an answer is the same whichever interface asked.

-- One leg as fuse_legs takes it: {"ids": [..], "scores": [..]} in rank order. The three
-- stage functions behind one aggregation each; a kind runs its own statement alone.
CREATE OR REPLACE FUNCTION memory._leg(
    kind text, query text, query_embedding vector, ids bigint[], project text, levels text[],
    k integer, since timestamptz, before timestamptz, filter jsonb DEFAULT NULL,
    grammar jsonb DEFAULT NULL, as_of timestamptz DEFAULT NULL, valid_at timestamptz DEFAULT NULL
)
RETURNS jsonb
-- PL/pgSQL, not SQL: PostgreSQL 15 plans a SQL function's body at every call.
-- PARALLEL UNSAFE: memory.semantic_search sets hnsw.ef_search.
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
BEGIN
    -- One statement per kind, not one UNION ALL of the three cut by "kind = ..." filters:
    -- the union's generic plan costed all three branches, so PL/pgSQL re-planned it at
    -- every call (87 us, four legs an answer); each of these keeps its generic plan. The
    -- rows are aggregated in rank order, sorted once (sql/040_fusion.sql's sorted-subquery
    -- aggregates: two ordered aggregates sorted them twice).
    IF kind = 'lexical' THEN
        RETURN (SELECT jsonb_build_object('ids', coalesce(jsonb_agg(r.node_id), '[]'),
                                          'scores', coalesce(jsonb_agg(r.score), '[]'))
                FROM (SELECT l.node_id, l.lexical_score AS score
                      FROM memory.lexical_search($2, $5, $6, $7, since => $8, before => $9,
                                                 filter => $10, as_of => $12, valid_at => $13) l
                      ORDER BY l.rank) r);
    ELSIF kind = 'semantic' THEN
        RETURN (SELECT jsonb_build_object('ids', coalesce(jsonb_agg(r.node_id), '[]'),
                                          'scores', coalesce(jsonb_agg(r.score), '[]'))
                FROM (SELECT s.node_id, s.query_score AS score
                      FROM memory.semantic_search($3, $5, $6, $7, since => $8, before => $9,
                                                  filter => $10, grammar => $11,
                                                  as_of => $12, valid_at => $13) s
                      ORDER BY s.rank) r);
    ELSIF kind = 'by_ids' THEN
        RETURN (SELECT jsonb_build_object('ids', coalesce(jsonb_agg(r.node_id), '[]'),
                                          'scores', coalesce(jsonb_agg(r.score), '[]'))
                FROM (SELECT s.node_id, s.query_score AS score
                      FROM memory.search_by_ids($3, $4, $5, $6, $7, since => $8, before => $9,
                                                filter => $10, grammar => $11,
                                                as_of => $12, valid_at => $13) s
                      ORDER BY s.rank) r);
    END IF;
    RETURN '{"ids": [], "scores": []}';
END $$;
COMMENT ON FUNCTION memory._leg(text, text, vector, bigint[], text, text[], integer, timestamptz, timestamptz, jsonb, jsonb, timestamptz, timestamptz) IS
    'One leg of memory.fuse_legs ({"ids": [..], "scores": [..]}, best first): kind lexical (memory.lexical_search of query, which reads the query grammar itself), semantic (memory.semantic_search of query_embedding) or by_ids (memory.search_by_ids over ids), each with the project, levels, k, since/before, the metadata filter, as_of and valid_at; the vector legs with the grammar''s constraints (grammar, a memory.parse_query parse).';

CREATE OR REPLACE FUNCTION memory._opensearch_leg(hits jsonb, project_id integer)
RETURNS jsonb
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    -- the current versions (OpenSearch indexes them only), of the project when given
    vis memory.visibility := memory._visibility(project_id => project_id);
BEGIN
    -- A sha256 is unique within a project: with a project, one node per hit.
    RETURN (SELECT jsonb_build_object('ids', coalesce(jsonb_agg(x.id ORDER BY x.ord), '[]'),
                              'scores', coalesce(jsonb_agg(x.score ORDER BY x.ord), '[]'))
    FROM (SELECT DISTINCT ON (h.ord) n.id, h.ord, (h.hit ->> 'score')::double precision AS score
          FROM jsonb_array_elements(coalesce($1, '[]')) WITH ORDINALITY AS h(hit, ord)
          JOIN memory.nodes n ON n.sha256 = decode(h.hit ->> 'sha256', 'hex')
                             AND memory._visible(n, vis)
          ORDER BY h.ord, n.id) x);
END $$;
COMMENT ON FUNCTION memory._opensearch_leg(jsonb, integer) IS
    'OpenSearch hits ([{"sha256": hex, "score": s}, ..], best first) as a leg: the nodes they name (in the project, when given); hits no node matches drop out.';

-- The Postgres lexical legs a plan names, as the calls they are (arguments of
-- memory.lexical_search): what memory._serve_start runs while the service embeds the query,
-- and what memory._run_legs compares with its own plan's before it takes those legs back.
CREATE OR REPLACE FUNCTION memory._lexical_calls(plan jsonb)
RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- Stripped of nulls: a leg the plan does not run is absent, not JSON null.
    RETURN jsonb_strip_nulls(jsonb_build_object(
    'lexical', CASE WHEN plan -> 'lexical' ->> 'engine' = 'postgres-bm25' THEN
        jsonb_build_object('query', plan -> 'query', 'project', plan -> 'project',
                           'levels', plan -> 'levels', 'k', plan -> 'lexical' -> 'depth',
                           'since', plan -> 'since_ts', 'before', plan -> 'before_ts',
                           'filter', plan -> 'filter', 'as_of', plan -> 'as_of',
                           'valid_at', plan -> 'valid_at') END,
    'evidence_lexical', CASE WHEN (plan -> 'evidence' ->> 'lexical')::boolean THEN
        jsonb_build_object('query', plan -> 'query', 'project', plan -> 'project',
                           'levels', '["L0"]'::jsonb, 'k', plan -> 'evidence' -> 'candidates',
                           'since', plan -> 'since_ts', 'before', plan -> 'before_ts',
                           'filter', plan -> 'filter', 'as_of', plan -> 'as_of',
                           'valid_at', plan -> 'valid_at') END));
END
$$;
COMMENT ON FUNCTION memory._lexical_calls(jsonb) IS
    'The arguments of the Postgres lexical legs a plan names ({"lexical": .., "evidence_lexical": ..}, each absent when the plan runs no such leg; NULL arguments absent too).';

CREATE OR REPLACE FUNCTION memory._lexical_call(call jsonb)
RETURNS jsonb
-- PARALLEL UNSAFE: memory.lexical_search sets plan_cache_mode
LANGUAGE sql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
RETURN memory._leg('lexical', call ->> 'query', NULL, NULL, call ->> 'project',
                   ARRAY(SELECT jsonb_array_elements_text(call -> 'levels')),
                   (call ->> 'k')::integer, (call ->> 'since')::timestamptz,
                   (call ->> 'before')::timestamptz, call -> 'filter', NULL,
                   (call ->> 'as_of')::timestamptz, (call ->> 'valid_at')::timestamptz);
COMMENT ON FUNCTION memory._lexical_call(jsonb) IS
    'Runs one call of memory._lexical_calls: memory.lexical_search as a leg.';

-- The stage times an answer reports under "stages", measured one way: the milliseconds
-- since the stage began, reported only for a stage that ran.
CREATE OR REPLACE FUNCTION memory._stage_time(st jsonb, key text, t timestamptz, ran boolean DEFAULT true)
RETURNS jsonb
-- VOLATILE: it reads clock_timestamp().
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN CASE WHEN ran THEN st || jsonb_build_object(key, extract(epoch FROM clock_timestamp() - t) * 1000)
                ELSE st END;
END
$$;
COMMENT ON FUNCTION memory._stage_time(jsonb, text, timestamptz, boolean) IS
    'The stage times st with key set to the milliseconds since t, when ran (the stage ran; default true); otherwise st unchanged.';

-- The visibility of a plan's legs (memory._leg_visibility of the plan's project, levels or
-- the ones given, time range, metadata filter, grammar, as_of and valid_at): the value each
-- leg memory._run_legs runs builds from the same arguments (memory.semantic_search,
-- memory.search_by_ids), and what memory.explain_query explains the vector stages with.
CREATE OR REPLACE FUNCTION memory._plan_visibility(plan jsonb, levels text[] DEFAULT NULL)
RETURNS memory.visibility
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN memory._leg_visibility(
    (plan ->> 'project_id')::integer,
    coalesce(levels, ARRAY(SELECT jsonb_array_elements_text(plan -> 'levels'))),
    (plan ->> 'since_ts')::timestamptz, (plan ->> 'before_ts')::timestamptz,
    nullif(plan -> 'filter', 'null'), plan -> 'grammar',
    (plan ->> 'as_of')::timestamptz, (plan ->> 'valid_at')::timestamptz);
COMMENT ON FUNCTION memory._plan_visibility(jsonb, text[]) IS
    'The visibility (memory.visibility) of a plan''s legs: memory._leg_visibility of its project_id, levels (or the levels given: the evidence''s legs are at L0), since_ts/before_ts, filter, grammar, as_of and valid_at.';

CREATE OR REPLACE FUNCTION memory._run_legs(
    plan jsonb, query_embedding vector, hits jsonb DEFAULT NULL, answer boolean DEFAULT true,
    prefetched jsonb DEFAULT NULL
)
RETURNS jsonb
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, public, pg_temp
SET jit = off  -- memory._plan_cache_mode says why
AS $$
DECLARE
    project text := plan ->> 'project';
    lv text[] := ARRAY(SELECT jsonb_array_elements_text(plan -> 'levels'));
    strat text := plan ->> 'search_strategy';
    lo timestamptz := (plan ->> 'since_ts')::timestamptz;
    hi timestamptz := (plan ->> 'before_ts')::timestamptz;
    ev jsonb := plan -> 'evidence';
    flt jsonb := nullif(plan -> 'filter', 'null');
    gr jsonb := memory._grammar_constraints(plan -> 'grammar');
    as_of timestamptz := (plan ->> 'as_of')::timestamptz;
    va timestamptz := (plan ->> 'valid_at')::timestamptz;
    empty constant jsonb := '{"ids": [], "scores": []}';
    lex_engine text;
    calls jsonb := memory._lexical_calls(plan);
    ev_failed jsonb;
    lex jsonb := empty;
    sem jsonb := empty;
    ev_lex jsonb := empty;
    ev_sem jsonb := empty;
    legs integer := 0;
    fused jsonb;
    cands memory.fused_row[];
    cut integer;  -- the fusion's final k
    fused_order bigint[];
    recent boolean := coalesce((plan -> 'recency' ->> 'applied')::boolean, false);
    withheld integer := 0;
    held bigint[] := '{}';
    st jsonb := '{}';
    t timestamptz;
    -- run while OpenSearch answered (memory._serve through => 'semantic'), for this very plan
    sem_prefetched boolean := answer AND coalesce(prefetched -> 'semantic_plan' = plan, false);
BEGIN
    IF (plan ->> 'needs_embedding')::boolean AND query_embedding IS NULL THEN
        RAISE EXCEPTION 'the plan routes % and needs a query vector', strat
            USING ERRCODE = '22023', HINT = 'Pass the query embedding, or plan without one (capability vector false).';
    END IF;
    t := clock_timestamp();
    lex_engine := CASE WHEN answer THEN plan -> 'lexical' ->> 'engine' END;
    IF lex_engine = 'postgres-bm25' AND prefetched -> 'calls' -> 'lexical' = calls -> 'lexical' THEN
        -- run beside the embedding (memory._serve_start) for this very call
        lex := prefetched -> 'lexical';
        st := st || jsonb_build_object('lexical_time_ms', prefetched -> 'stages' -> 'lexical_time_ms');
    ELSE
        CASE lex_engine
            WHEN 'postgres-bm25' THEN
                lex := memory._lexical_call(calls -> 'lexical');
            WHEN 'opensearch' THEN
                lex := memory._opensearch_leg(hits, (plan ->> 'project_id')::integer);
            ELSE NULL;
        END CASE;
        st := memory._stage_time(st, 'lexical_time_ms', t, lex_engine IS NOT NULL);
    END IF;
    t := clock_timestamp();
    IF NOT answer THEN
        NULL;  -- the evidence's legs alone (memory.evidence)
    ELSIF sem_prefetched THEN
        sem := prefetched -> 'semantic';
    ELSIF plan -> 'semantic' ->> 'engine' = 'hnsw' THEN
        sem := memory._leg('semantic', NULL, query_embedding, NULL, project, lv,
                           (plan -> 'semantic' ->> 'depth')::integer, lo, hi, flt, gr, as_of, va);
    ELSIF plan -> 'semantic' ->> 'engine' = 'by-ids' THEN
        sem := memory._leg('by_ids', NULL, query_embedding,
                           ARRAY(SELECT jsonb_array_elements_text(lex -> 'ids')::bigint),
                           project, lv,
                                    coalesce((plan -> 'semantic' ->> 'depth')::integer,
                                             greatest(jsonb_array_length(lex -> 'ids'), 1)),
                                    lo, hi, flt, gr, as_of, va);
    END IF;
    st := CASE WHEN sem_prefetched
               THEN st || jsonb_build_object('semantic_time_ms', prefetched -> 'semantic_time_ms')
               ELSE memory._stage_time(st, 'semantic_time_ms', t,
                                       answer AND plan -> 'semantic' ->> 'engine' IS NOT NULL) END;
    t := clock_timestamp();
    IF (ev ->> 'reuses_legs')::boolean AND answer THEN
        ev_lex := lex;
        ev_sem := sem;
    ELSE
        -- A failure of the evidence's own legs degrades the evidence, not the answer (but a
        -- standby's recovery conflict, 40001, fails the statement: the service then asks
        -- the primary).
        BEGIN
            IF (ev ->> 'lexical')::boolean THEN
                IF prefetched -> 'calls' -> 'evidence_lexical' = calls -> 'evidence_lexical' THEN
                    ev_lex := prefetched -> 'evidence_lexical';
                ELSE
                    ev_lex := memory._lexical_call(calls -> 'evidence_lexical');
                END IF;
                legs := legs + 1;
            END IF;
            IF (ev ->> 'semantic')::boolean AND query_embedding IS NOT NULL THEN
                ev_sem := memory._leg('semantic', NULL, query_embedding, NULL, project, ARRAY['L0'],
                                      (ev ->> 'candidates')::integer, lo, hi, flt, gr, as_of, va);
                legs := legs + 1;
            END IF;
        EXCEPTION WHEN OTHERS THEN
            IF SQLSTATE = '40001' THEN
                RAISE;
            END IF;
            ev_failed := jsonb_build_object('sqlstate', SQLSTATE, 'message', SQLERRM);
            ev_lex := empty;
            ev_sem := empty;
        END;
    END IF;
    st := memory._stage_time(st, 'evidence_legs_time_ms', t, legs > 0);
    t := clock_timestamp();
    -- recency and a soft phrase may lift a candidate from below the final k, and the floor
    -- names every candidate it holds back (memory._after_fusion): all of them
    cut := CASE WHEN recent OR jsonb_array_length(coalesce(plan -> 'grammar' -> 'boost', '[]')) > 0
                     OR coalesce((plan -> 'floor' ->> 'applied')::boolean, false)
                THEN 1000 ELSE (plan ->> 'final_k')::integer END;
    -- typed until the final k is known: only what the state keeps becomes JSON
    cands := ARRAY(SELECT f::memory.fused_row
                   FROM memory.fuse_legs(sem, lex, strat, plan ->> 'fusion',
                                         (plan ->> 'dense_weight')::double precision,
                                         (plan ->> 'rrf_k')::integer, cut) f
                   ORDER BY f.fused_score DESC, least(f.ranks[1], f.ranks[2]), f.node_id);
    -- the fused order before the floor, recency and soft phrases, cut deep: memory._deeper
    -- reads the candidates after the results from it rather than fusing the legs again
    fused_order := ARRAY(SELECT c.node_id FROM unnest(cands) WITH ORDINALITY AS c(node_id, ranks, scores,
                                                                                  fused_score, fusion_method, o)
                         ORDER BY c.o);
    -- the floor, recency and soft phrases (sql/040_fusion.sql), then the final k
    SELECT a.fused, a.withheld, a.held INTO fused, withheld, held FROM memory._after_fusion(cands, plan, query_embedding) a;
    st := memory._stage_time(st, 'fusion_time_ms', t);
    RETURN jsonb_build_object('lexical', lex, 'semantic', sem, 'evidence_lexical', ev_lex,
                              'evidence_semantic', ev_sem, 'evidence_legs', legs,
                              'evidence_failed', ev_failed,
                              'fused', coalesce(fused, '[]'), 'withheld', withheld,
                              'fused_order', to_jsonb(fused_order), 'fused_cut', cut,
                              'withheld_ids', to_jsonb(held), 'stages', st);
END $$;
COMMENT ON FUNCTION memory._run_legs(jsonb, vector, jsonb, boolean, jsonb) IS
    'The first half of memory._execute: the legs a plan names (hits: the OpenSearch leg the service fetched) and their fusion, as the state memory._finish takes: lexical, semantic, evidence_lexical, evidence_semantic, fused (best first, final_k deep), withheld and withheld_ids (what the relevance floor held back), fused_order (the fused ids before the floor, recency and soft phrases, fused_cut deep: memory._deeper reads the candidates after the results from it) and stage times. answer => false runs the evidence''s direct legs only; prefetched (memory._serve_start''s, and memory._serve''s through => ''semantic'') gives legs already run, each taken only where its call is the plan''s own (the semantic leg''s: its whole plan).';

-- A result's provenance tree without the L0 turns the evidence does not cite.
CREATE OR REPLACE FUNCTION memory._cited_only(tree jsonb, cited text[], OUT kept jsonb, OUT omitted integer)
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    node jsonb;
    below record;
BEGIN
    kept := '[]';
    omitted := 0;
    FOR node IN SELECT x FROM jsonb_array_elements(coalesce(tree, '[]')) AS x LOOP
        IF node ->> 'level' = 'L0' AND (node ->> 'sha256' = ANY (cited)) IS NOT TRUE THEN
            omitted := omitted + 1;
            CONTINUE;
        END IF;
        IF coalesce(jsonb_array_length(node -> 'parents'), 0) = 0 THEN
            -- a leaf (most nodes of a tree): nothing below to keep, no call to make
            kept := kept || jsonb_build_array(node || '{"parents": []}');
            CONTINUE;
        END IF;
        SELECT * INTO below FROM memory._cited_only(node -> 'parents', cited);
        kept := kept || jsonb_build_array(node || jsonb_build_object('parents', below.kept));
        omitted := omitted + below.omitted;
    END LOOP;
END $$;
COMMENT ON FUNCTION memory._cited_only(jsonb, text[]) IS
    'A provenance tree (memory.hydrate''s jsonb) without its L0 nodes whose sha256 is not in cited, and how many it left out.';

-- How the statements an answer's second half runs are planned. Their PL/pgSQL plans are
-- kept per session, but PostgreSQL's choice between a custom plan (planned again at every
-- call, the parameters as constants) and the one generic plan kept custom plans for the
-- evidence list, the provenance walks and the result rows: the generic plan's estimate,
-- made without the parameters' values, is always dearer. Planning them was about 3.8 ms of
-- an answer's 28 ms of database CPU on LoCoMo (docs/benchmarks.md, "Planning an answer
-- once"), for the same plans. On the partitioned layout a custom plan is what prunes to
-- the named project's partition before locking (PostgreSQL 15 locks every partition a
-- cached generic plan names), so there the choice stays PostgreSQL's.
-- The executor's stages (memory._prepare, _run_legs, _finish) and memory.select_evidence
-- also run with jit = off: once a statement's estimate passes jit_above_cost (100,000),
-- PostgreSQL compiles its expressions first, and an answer's statements are short: on
-- SciFact the evidence's candidates statement, estimated at 131k, spent 66 ms of its 76 in
-- JIT compilation (docs/benchmarks.md, "Planning an answer once").
-- Inlined into its callers' expressions (migrate.INLINED: no SET clause, every name by its
-- schema): as a call it cost 125 us (a SQL function with a SET clause, planned at every
-- call) or 43 (PL/pgSQL), four to six an answer. pg_get_partkeydef, not a look at
-- pg_class.relkind: a sub-select would keep the planner from inlining it. A table's
-- partition key is there (not NULL) exactly when it is partitioned; to_regclass at each
-- use, so a partition_by_project in the same session is followed.
CREATE OR REPLACE FUNCTION memory._plan_cache_mode()
RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
SELECT CASE WHEN pg_catalog.pg_get_partkeydef(pg_catalog.to_regclass('memory.nodes')) IS NULL
            THEN 'force_generic_plan' ELSE 'auto' END
$$;
COMMENT ON FUNCTION memory._plan_cache_mode() IS
    'The plan_cache_mode memory._finish runs its statements with: force_generic_plan (plan once per session), or auto on the partitioned layout (custom plans prune to one partition).';

CREATE OR REPLACE FUNCTION memory._finish(
    plan jsonb, state jsonb, query_embedding vector,
    result_order bigint[] DEFAULT NULL, rerank jsonb DEFAULT NULL
)
RETURNS jsonb
-- PARALLEL UNSAFE: the evidence runs in a subtransaction (its EXCEPTION block).
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, public, pg_temp
-- The clause scopes the set_config below to this call: the caller's setting comes back.
SET plan_cache_mode = auto
SET jit = off
AS $$
DECLARE
    strat text := plan ->> 'search_strategy';
    ev jsonb := plan -> 'evidence';
    budget integer := (ev ->> 'budget')::integer;
    ids bigint[];
    results jsonb;
    evidence jsonb;
    st jsonb := coalesce(state -> 'stages', '{}');
    t timestamptz;
    failed jsonb;
    code text;
    msg text;
    doubted bigint[] := '{}';
    supports jsonb;
    support_took interval;
BEGIN
    PERFORM pg_catalog.set_config('plan_cache_mode', memory._plan_cache_mode(), true);
    -- The results: the reranker's order when one reordered the candidates, else the top k.
    ids := coalesce(result_order,
                    ARRAY(SELECT (f.v ->> 'node_id')::bigint
                          FROM jsonb_array_elements(state -> 'fused') WITH ORDINALITY AS f(v, o)
                          ORDER BY f.o LIMIT (plan ->> 'k')::integer));
    -- Support (issue 40): a result whose evidence changed or went (stale, partial, none at
    -- the answer's instants) ranks below the supported ones (demote, the default), or is
    -- left out (exclude), or keeps its place (keep); the answer counts what it moved.
    -- Computed once, for every result: the rows below take it from here (memory._hydrate),
    -- the results left out included (support is each node's own, whatever else is asked).
    t := clock_timestamp();
    supports := memory._support_rows(ids, (plan ->> 'as_of')::timestamptz,
                                     memory._support_valid_at(plan));
    -- counted in provenance_time_ms below, where the rows' support always was
    support_took := clock_timestamp() - t;
    IF coalesce(plan -> 'unsupported' ->> 'policy', 'keep') <> 'keep' AND cardinality(ids) > 0 THEN
        doubted := ARRAY(SELECT x.id
                         FROM unnest(ids) WITH ORDINALITY AS x(id, o)
                         WHERE supports -> x.id::text ->> 'support' IN ('stale', 'partial', 'none')
                         ORDER BY x.o);
        IF cardinality(doubted) > 0 THEN
            ids := ARRAY(SELECT x.id FROM unnest(ids) WITH ORDINALITY AS x(id, o)
                         WHERE x.id <> ALL (doubted) ORDER BY x.o)
                   || CASE WHEN plan -> 'unsupported' ->> 'policy' = 'demote' THEN doubted
                           ELSE '{}'::bigint[] END;
        END IF;
    END IF;
    t := clock_timestamp();
    failed := state -> 'evidence_failed';
    IF budget > 0 AND jsonb_typeof(failed) = 'object' THEN
        NULL;  -- its legs failed (memory._run_legs): no list, whole trees
    ELSIF budget > 0 AND cardinality(ids) = 0 AND (state ->> 'withheld')::integer > 0 THEN
        evidence := '[]';  -- the floor withheld every candidate: no answer cites no evidence
    ELSIF budget > 0 THEN
        -- A failure here degrades (the answer keeps its whole trees and says why): the
        -- results are ready by now and must not be lost to it.
        BEGIN
            SELECT jsonb_agg(to_jsonb(e) || '{"level": "L0"}' ORDER BY e.rank) INTO evidence
              FROM memory.select_evidence(ids, state -> 'evidence_semantic', state -> 'evidence_lexical',
                                          plan ->> 'fusion', budget, plan ->> 'project', 4,
                                          (plan ->> 'since_ts')::timestamptz, (plan ->> 'before_ts')::timestamptz,
                                          (plan ->> 'dense_weight')::double precision,
                                          (plan ->> 'rrf_k')::integer, nullif(plan -> 'filter', 'null'),
                                          (plan ->> 'as_of')::timestamptz,
                                          memory._deeper(plan, state, ids), plan ->> 'query',
                                          (plan ->> 'valid_at')::timestamptz) e;
            evidence := coalesce(evidence, '[]');
        EXCEPTION WHEN OTHERS THEN
            IF SQLSTATE = '40001' THEN
                RAISE;  -- a standby's recovery conflict: the service asks the primary
            END IF;
            GET STACKED DIAGNOSTICS code = RETURNED_SQLSTATE, msg = MESSAGE_TEXT;
            failed := jsonb_build_object('sqlstate', code, 'message', msg);
            evidence := NULL;
        END;
    END IF;
    st := memory._stage_time(st, 'evidence_time_ms', t, budget > 0);
    t := clock_timestamp() - support_took;
    WITH fz AS (
        SELECT (f.v ->> 'node_id')::bigint AS id, f.v FROM jsonb_array_elements(state -> 'fused') AS f(v)
    )
    SELECT jsonb_agg(jsonb_build_object(
               'rank', h.pos, 'node_id', h.node_id, 'external_id', h.external_id, 'level', h.level,
               'sha256', h.sha256, 'project', h.project, 'title', h.title, 'text', h.text,
               'source', h.source, 'breadcrumb', h.breadcrumb, 'timestamp', h."timestamp",
               -- cosine of unit vectors can leave [0, 1] by rounding or for opposed vectors
               'query_score', CASE WHEN h.query_score IS NOT NULL
                                   THEN greatest(0, least(1, h.query_score)) END,
               'lexical_score', fz.v -> 'scores' -> 1,
               -- a score of the answer, not a rank transform: the leg's own score for one
               -- leg (BM25; cosine for SemanticOnly and the rrf cascade, which orders by
               -- cosine), the fused score when two legs are blended
               'final_score', CASE WHEN strat = 'LexicalOnly' THEN fz.v -> 'scores' -> 1
                                   WHEN strat = 'SemanticOnly' OR fz.v ->> 'fusion_method' = 'cascade'
                                        THEN fz.v -> 'scores' -> 0
                                   ELSE fz.v -> 'fused_score' END,
               'rerank_score', rerank -> h.node_id::text,
               'semantic_rank', fz.v -> 'ranks' -> 0, 'lexical_rank', fz.v -> 'ranks' -> 1,
               'fusion_method', fz.v -> 'fusion_method', 'search_strategy', strat,
               'provenance', coalesce(c.kept, h.provenance),
               'provenance_truncated', h.provenance_truncated,
               'metadata', h.metadata, 'support', h.support,
               'changed_parents', h.changed_parents,
               -- why a derived result cites no L0 turn (NULL: it cites one, or is L0)
               'uncited_reason', CASE
                   WHEN h.level = 'L0'
                        OR jsonb_path_exists(coalesce(c.kept, h.provenance),
                                             'strict $.** ? (@.level == "L0")') THEN NULL
                   WHEN coalesce(c.omitted, 0) > 0 THEN 'evidence_budget'
                   WHEN h.provenance_truncated THEN 'provenance_cap'
                   WHEN h.support IN ('partial', 'none') THEN 'evidence_missing'
                   ELSE 'no_l0_evidence' END)
           || CASE WHEN evidence IS NULL THEN '{}'
                   ELSE jsonb_build_object('provenance_l0_omitted', c.omitted) END
           ORDER BY h.pos)
      INTO results
      FROM (SELECT x.*, x.ordinality::integer AS pos
            FROM memory._hydrate(ids, query_embedding, 4, plan ->> 'project',
                                 (plan ->> 'as_of')::timestamptz,
                                 memory._support_valid_at(plan), supports) WITH ORDINALITY AS x) h
      JOIN fz ON fz.id = h.node_id
      -- Without an evidence list, no call: an outer join's ON clause filters the rows the
      -- function made, where the subquery's WHERE is a one-time filter before it runs.
      LEFT JOIN LATERAL (SELECT co.kept, co.omitted
                         FROM memory._cited_only(
                                  h.provenance,
                                  ARRAY(SELECT e ->> 'sha256' FROM jsonb_array_elements(evidence) AS e
                                        WHERE e ->> 'project' = h.project)) co
                         WHERE evidence IS NOT NULL) c ON true;
    st := memory._stage_time(st, 'provenance_time_ms', t);
    RETURN jsonb_build_object(
        'search_strategy', strat,
        'plan', plan,
        'results', coalesce(results, '[]'),
        'evidence', evidence,
        'evidence_failed', failed,
        'counts', jsonb_build_object(
            -- null for a leg the plan did not run (0: it ran and found nothing)
            'semantic_candidates', CASE WHEN plan -> 'semantic' ->> 'engine' IS NOT NULL
                                        THEN jsonb_array_length(state -> 'semantic' -> 'ids') END,
            'lexical_candidates', CASE WHEN plan -> 'lexical' ->> 'engine' IS NOT NULL
                                       THEN jsonb_array_length(state -> 'lexical' -> 'ids') END,
            'fused', jsonb_array_length(state -> 'fused'),
            'withheld', coalesce((state ->> 'withheld')::integer, 0),
            -- results in doubt that the unsupported policy moved down or left out
            'demoted', CASE WHEN plan -> 'unsupported' ->> 'policy' = 'demote' THEN cardinality(doubted) ELSE 0 END,
            'excluded', CASE WHEN plan -> 'unsupported' ->> 'policy' = 'exclude' THEN cardinality(doubted) ELSE 0 END,
            'evidence_legs', state -> 'evidence_legs',
            'direct_candidates', jsonb_array_length(state -> 'evidence_lexical' -> 'ids')
                                 + jsonb_array_length(state -> 'evidence_semantic' -> 'ids')),
        'stages', st);
END $$;
COMMENT ON FUNCTION memory._finish(jsonb, jsonb, vector, bigint[], jsonb) IS
    'The second half of memory._execute: the answer document of a plan and the state memory._run_legs returned (result_order: the results in the reranker''s order; NULL: the fused top k; rerank: {"node_id": score}): search_strategy, plan, results (each with its scores, ranks, provenance, kept to the cited L0 turns when the plan cites evidence, support and changed_parents; results in doubt demoted or excluded as the plan''s unsupported policy says), evidence (NULL: none asked, or evidence_failed says why: sqlstate and message, and the trees stay whole), counts (demoted and excluded among them) and stage times.';

CREATE OR REPLACE FUNCTION memory._execute(plan jsonb, query_embedding vector, hits jsonb DEFAULT NULL)
RETURNS jsonb
LANGUAGE sql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
RETURN memory._finish(plan, memory._run_legs(plan, query_embedding, hits), query_embedding);
COMMENT ON FUNCTION memory._execute(jsonb, vector, jsonb) IS
    'Runs a plan of memory._plan end to end (memory._run_legs, then memory._finish with the fused top k) and returns the answer document.';

-- The SQL entry points' shared first step: the plan, and the query vector it needs, made in
-- the database when the caller gave none. Where the embedder cannot run here the plan is
-- made again without a vector (LexicalOnly), and a NOTICE says why.
CREATE OR REPLACE FUNCTION memory._prepare(
    req jsonb, query_embedding vector, caller text, OUT plan jsonb, OUT embedding vector
)
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
SET jit = off  -- memory._plan_cache_mode says why
AS $$
DECLARE
    why text;
    fix text;
BEGIN
    PERFORM memory.check_embedding(query_embedding);
    plan := memory._plan(req);
    embedding := query_embedding;
    IF (plan ->> 'needs_embedding')::boolean AND embedding IS NULL THEN
        BEGIN
            embedding := memory.embed(plan ->> 'query');
        EXCEPTION WHEN SQLSTATE @vocabulary.sqlstate_component_unavailable@ THEN
            -- The failing part's own hint: a missing package and a remote embedding server
            -- that is down are fixed in different places.
            GET STACKED DIAGNOSTICS why = MESSAGE_TEXT, fix = PG_EXCEPTION_HINT;
            RAISE NOTICE '%: no query embedding (%), so the lexical leg answers alone', caller, why
                USING HINT = coalesce(nullif(fix, ''), 'Run `make setup` and `poimen-memory migrate` on the database host, or pass query_embedding.');
            plan := memory._plan(req || jsonb_build_object('routing', plan -> 'routing'),
                                 jsonb_build_object('vector', false, 'vector_why',
                                                    format('no query embedding (%s): LexicalOnly', why)));
        END;
    END IF;
END $$;
COMMENT ON FUNCTION memory._prepare(jsonb, vector, text) IS
    'The plan of a SQL entry point (caller names it in NOTICEs) and its query vector: the one given, or memory.embed''s when the plan needs one; where memory.embed fails with PM503 the plan is made again without a vector.';

-- What the HTTP service calls: the tenant's projects travel with the statement (no
-- separate set_config), so a query is one statement and one round trip.
-- A plan travels from one of the service's statements to the next with what it was made
-- for (the request and the caps), and the next takes it back only when made for the same:
-- one place builds it and one decides, for memory._serve_start, _serve and _serve_finish.
CREATE OR REPLACE FUNCTION memory._carry_plan(plan jsonb, req jsonb, caps jsonb)
RETURNS jsonb
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN jsonb_build_object('plan', plan, 'planned_for', jsonb_build_object('req', req, 'caps', caps));
COMMENT ON FUNCTION memory._carry_plan(jsonb, jsonb, jsonb) IS
    'A plan with what it was made for ({"plan", "planned_for": {"req", "caps"}}), as the service''s next statement takes it back (memory._carried_plan).';

CREATE OR REPLACE FUNCTION memory._carried_plan(req jsonb, caps jsonb, carried jsonb)
RETURNS jsonb
-- PARALLEL UNSAFE: it may plan (memory._plan)
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- Made again when the request or the caps differ (a failed embedding or OpenSearch
    -- call changes the caps). A plan given back opens nothing: what it asks, the caller may
    -- ask by calling the stage functions, under the same row-level security.
    IF carried -> 'planned_for' = jsonb_build_object('req', req, 'caps', caps) THEN
        RETURN carried -> 'plan';
    END IF;
    RETURN memory._plan(req, caps);
END $$;
COMMENT ON FUNCTION memory._carried_plan(jsonb, jsonb, jsonb) IS
    'The plan carried (memory._carry_plan: prefetched of memory._serve_start, the state of memory._serve through candidates) when it was made for this request and caps, else memory._plan(req, caps).';

CREATE OR REPLACE FUNCTION memory._serve_start(req jsonb, caps jsonb)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    plan jsonb;
    calls jsonb;
    done jsonb := '{}';
    lex jsonb;
    ev_lex jsonb;
    st jsonb := '{}';
    t timestamptz;
BEGIN
    PERFORM memory._assert_projects(caps);
    plan := memory._plan(req, caps);
    -- The lexical legs need no vector: they run here, while the service embeds the query.
    calls := memory._lexical_calls(plan);
    IF calls -> 'lexical' IS NOT NULL THEN
        t := clock_timestamp();
        lex := memory._lexical_call(calls -> 'lexical');
        done := done || jsonb_build_object('lexical', calls -> 'lexical');
        st := memory._stage_time(st, 'lexical_time_ms', t);
    END IF;
    IF calls -> 'evidence_lexical' IS NOT NULL
       AND NOT (plan -> 'evidence' ->> 'reuses_legs')::boolean THEN
        ev_lex := memory._lexical_call(calls -> 'evidence_lexical');
        done := done || jsonb_build_object('evidence_lexical', calls -> 'evidence_lexical');
    END IF;
    -- The plan goes back too, with what it was made for: memory._serve takes it rather
    -- than planning again (a second plan cost an answer about 1 ms of CPU).
    RETURN plan || jsonb_build_object('prefetched', jsonb_build_object(
        'calls', done, 'lexical', lex, 'evidence_lexical', ev_lex, 'stages', st)
        || memory._carry_plan(plan, req, caps));
END $$;
COMMENT ON FUNCTION memory._serve_start(jsonb, jsonb) IS
    'The HTTP service''s first statement, under the projects caps asserts (read_projects, write_projects; honoured for members of @role.service@ only): the plan (memory._plan), and under prefetched the Postgres lexical legs it names, run while the service embeds the query, with the plan itself and what it was made for (plan, planned_for: the request and caps); memory._serve takes them back.';

CREATE OR REPLACE FUNCTION memory._serve(
    req jsonb, caps jsonb, query_embedding vector, hits jsonb DEFAULT NULL,
    through text DEFAULT 'answer', prefetched jsonb DEFAULT NULL
)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    plan jsonb;
    state jsonb;
BEGIN
    PERFORM memory._assert_projects(caps);
    plan := memory._carried_plan(req, caps, prefetched);  -- memory._serve_start's
    IF through = 'semantic' THEN
        -- Beside the service's OpenSearch call: the hnsw semantic leg alone, as
        -- memory._run_legs runs it with no lexical leg and no evidence legs of their own
        -- (they reuse the legs); the fusion of the one leg is dropped.
        IF plan -> 'semantic' ->> 'engine' IS DISTINCT FROM 'hnsw' THEN
            RETURN '{}';  -- none to run before the lexical leg (by-ids reads its ids)
        END IF;
        state := memory._run_legs(jsonb_set(jsonb_set(plan, '{lexical,engine}', 'null'),
                                            '{evidence,reuses_legs}', 'true'),
                                  query_embedding);
        RETURN jsonb_build_object('semantic_plan', plan, 'semantic', state -> 'semantic',
                                  'semantic_time_ms', state -> 'stages' -> 'semantic_time_ms');
    END IF;
    state := memory._run_legs(plan, query_embedding, hits, true, prefetched);
    IF through = 'candidates' THEN
        -- For the reranker: the fused candidates with their texts, and the state to finish
        -- (with the plan and what it was made for, which memory._serve_finish takes back).
        RETURN jsonb_build_object(
            'plan', plan,
            'state', state || memory._carry_plan(plan, req, caps),
            'texts', (SELECT coalesce(jsonb_object_agg(n.id::text, n.text), '{}')
                      FROM memory.nodes n
                      WHERE n.id IN (SELECT (f ->> 'node_id')::bigint
                                     FROM jsonb_array_elements(state -> 'fused') AS f)));
    END IF;
    RETURN memory._finish(plan, state, query_embedding);
END $$;
COMMENT ON FUNCTION memory._serve(jsonb, jsonb, vector, jsonb, text, jsonb) IS
    'The HTTP service''s query statement: takes back the plan memory._serve_start made (prefetched plan) when it was made for the same request and caps, else plans (memory._plan), runs the legs (taking back the prefetched legs whose calls are the plan''s own) and finishes the answer (memory._finish); through => ''candidates'' stops after fusion and returns the candidates'' texts for a reranker, with the state (the plan and what it was made for in it), and memory._serve_finish completes it; through => ''semantic'' runs the plan''s hnsw semantic leg alone, while the service calls OpenSearch, and returns it as prefetched for the same plan ({"semantic_plan", "semantic", "semantic_time_ms"}; {} when the plan runs no such leg).';

CREATE OR REPLACE FUNCTION memory._serve_finish(
    req jsonb, caps jsonb, state jsonb, query_embedding vector, result_order bigint[], rerank jsonb
)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM memory._assert_projects(caps);
    RETURN memory._finish(memory._carried_plan(req, caps, state),  -- memory._serve's
                          state, query_embedding, result_order, rerank);
END $$;
COMMENT ON FUNCTION memory._serve_finish(jsonb, jsonb, jsonb, vector, bigint[], jsonb) IS
    'The HTTP service''s statement after a reranker: the answer (memory._finish) of the state memory._serve returned, in the reranker''s order, with the plan that state holds when it was made for the same request and caps (else planned again).';

CREATE OR REPLACE FUNCTION memory._assert_projects(caps jsonb)
RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF caps ? 'read_projects' THEN
        -- Local: they end with the statement's transaction, never reaching the next
        -- borrower of a pooled connection.
        PERFORM set_config('poimen.read_projects', coalesce(caps ->> 'read_projects', ''), true),
                set_config('poimen.write_projects', coalesce(caps ->> 'write_projects', ''), true);
    END IF;
END $$;
COMMENT ON FUNCTION memory._assert_projects(jsonb) IS
    'Sets poimen.read_projects / poimen.write_projects for the transaction from caps (read_projects, write_projects: comma-separated names or *), as the service''s begin_request does; the policies honour them for members of @role.service@ only.';
