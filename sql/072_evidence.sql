-- Evidence: the L0 turns a response cites, within a budget (issue 13).
--
-- The provenance of ten L1/L2 results cites about 19 turns, and only 40% of the turns of a
-- conversation have an L1 above them, so the trees alone miss evidence that no memory was
-- derived from. A response therefore cites a ranked list of L0 turns: those its results
-- derive from, and those the query matches directly (a Hybrid pair of legs at level L0).
-- Each candidate scores its own direct match (normalised by the question's best) plus
-- weight / sqrt(rank) of the best-ranked result whose provenance reaches it, so a turn both
-- matched and cited by the top result comes first, and a turn only cited by the tenth
-- result competes with a fair direct match; then each turn gains evidence_neighbours times
-- the scores of the candidates said just before and after it. Measured on LoCoMo dev in docs/benchmarks.md
-- ("Evidence within a budget"); the policy keys evidence_* tune it.

CREATE OR REPLACE FUNCTION memory.select_evidence(
    result_ids bigint[],
    semantic jsonb,
    lexical jsonb,
    fusion text DEFAULT NULL,
    budget integer DEFAULT NULL,
    project_name text DEFAULT NULL,
    max_depth integer DEFAULT 4
)
RETURNS TABLE (rank integer, node_id bigint, external_id text, sha256 text, title text,
               text text, source text, breadcrumb text[], "timestamp" timestamptz,
               score double precision, direct_rank integer, cited_by integer[],
               neighbour_score double precision)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    pol record;
    pid integer := memory.project_id(project_name);
    lim integer;
    strat text;
BEGIN
    SELECT * INTO pol FROM memory.policy();
    lim := coalesce(budget, pol.evidence_budget);
    IF lim NOT BETWEEN 0 AND 100 THEN
        RAISE EXCEPTION 'budget must be within 0..100, got %', lim
            USING ERRCODE = '22023', HINT = 'budget is the most L0 turns cited; 0 turns evidence off.';
    END IF;
    IF fusion IS NOT NULL AND fusion NOT IN ('rrf', 'convex') THEN
        RAISE EXCEPTION 'unknown fusion "%"', fusion
            USING ERRCODE = '22023', HINT = 'Use rrf, convex or NULL (the policy decides).';
    END IF;
    IF lim = 0 THEN
        RETURN;
    END IF;
    -- The direct legs' score is the answer's score, as memory.query reports it: one leg's
    -- own score, or the fused score of two.
    strat := CASE WHEN jsonb_array_length(coalesce(semantic -> 'ids', '[]')) = 0 THEN 'LexicalOnly'
                  WHEN jsonb_array_length(coalesce(lexical -> 'ids', '[]')) = 0 THEN 'SemanticOnly'
                  ELSE 'Hybrid' END;
    RETURN QUERY
    WITH direct AS (
        SELECT f.node_id,
               CASE strat WHEN 'LexicalOnly' THEN f.scores[2]
                          WHEN 'SemanticOnly' THEN f.scores[1]
                          ELSE f.fused_score END AS s,
               row_number() OVER (ORDER BY f.fused_score DESC, f.node_id)::integer AS pos
        FROM memory.fuse_legs(coalesce(semantic, '{"ids":[],"scores":[]}'),
                              coalesce(lexical, '{"ids":[],"scores":[]}'), strat,
                              coalesce(fusion, pol.fusion), pol.dense_weight, pol.rrf_k,
                              pol.evidence_candidates) f
    ),
    scaled AS (
        SELECT d.node_id, d.pos, d.s / nullif(max(d.s) OVER (), 0) AS s FROM direct d
    ),
    cites AS (
        SELECT w.parent_id AS node_id, array_agg(DISTINCT r.ord::integer ORDER BY r.ord::integer) AS by_rank
        FROM memory.provenance_walk(result_ids, max_depth) w
        JOIN unnest(result_ids) WITH ORDINALITY AS r(id, ord) ON r.id = w.root_id
        GROUP BY w.parent_id
    ),
    scored AS (
        SELECT coalesce(s.node_id, c.node_id) AS node_id, s.pos, c.by_rank,
               coalesce(greatest(s.s, 0), 0)
               + coalesce(pol.evidence_weight / sqrt(c.by_rank[1]), 0) AS score
        FROM scaled s FULL JOIN cites c ON c.node_id = s.node_id
    ),
    own AS (
        SELECT x.*, n.project_id, n.title
        FROM scored x
        JOIN memory.nodes n ON n.id = x.node_id AND n.level = 'L0'
             AND (pid IS NULL OR n.project_id = pid)
    ),
    -- The turns said just before and after a candidate, in the same session: the L0 node
    -- of the same project and title (a session's or a document's heading) nearest in
    -- ingest order, at most 64 ids away. An answer often spans a question and its reply.
    near AS (
        SELECT b.id AS node_id, sum(o.score) * pol.evidence_neighbours AS s
        FROM own o
        CROSS JOIN LATERAL (
            (SELECT n.id FROM memory.nodes n
             WHERE n.id < o.node_id AND n.id >= o.node_id - 64 AND n.project_id = o.project_id
               AND n.level = 'L0' AND n.title = o.title
             ORDER BY n.id DESC LIMIT 1)
            UNION ALL
            (SELECT n.id FROM memory.nodes n
             WHERE n.id > o.node_id AND n.id <= o.node_id + 64 AND n.project_id = o.project_id
               AND n.level = 'L0' AND n.title = o.title
             ORDER BY n.id LIMIT 1)
        ) b
        WHERE pol.evidence_neighbours > 0
        GROUP BY b.id
    ),
    total AS (
        SELECT coalesce(o.node_id, nb.node_id) AS node_id, o.pos, o.by_rank,
               coalesce(o.score, 0) + coalesce(nb.s, 0) AS score, coalesce(nb.s, 0) AS beside
        FROM own o FULL JOIN near nb ON nb.node_id = o.node_id
    )
    SELECT (row_number() OVER (ORDER BY x.score DESC, x.node_id))::integer, n.id, n.external_id,
           encode(n.sha256, 'hex'), n.title, n.text, n.source, n.breadcrumb, n.ts, x.score,
           x.pos, coalesce(x.by_rank, '{}'), x.beside
    FROM total x
    JOIN memory.nodes n ON n.id = x.node_id
    WHERE x.score > 0  -- the weakest direct match of a convex leg scores 0: no evidence
    ORDER BY x.score DESC, x.node_id
    LIMIT lim;
END $$;
COMMENT ON FUNCTION memory.select_evidence(bigint[], jsonb, jsonb, text, integer, text, integer) IS
    'The L0 turns a response cites, best first, at most budget (default memory.policy() evidence_budget; 0: none): the L0 provenance of result_ids (the results in rank order) and the direct L0 legs ({"ids":[..],"scores":[..]}, fused like memory.fuse_legs), each scored by its direct match normalised by the best plus evidence_weight / sqrt(rank of the best result citing it), and then every turn (candidate or not) gains evidence_neighbours times the scores of the candidates just before and after it in its session (same project and title, nearest in ingest order; neighbour_score is that part). Turns scoring 0 (the weakest direct match of a convex fusion) are left out. direct_rank is the turn''s rank among the direct matches (NULL: cited only), cited_by the ranks of the results whose provenance reaches it.';

CREATE OR REPLACE FUNCTION memory.evidence(
    query text,
    result_ids bigint[],
    query_embedding vector DEFAULT NULL,
    project text DEFAULT NULL,
    budget integer DEFAULT NULL,
    since text DEFAULT NULL,
    until text DEFAULT NULL
)
RETURNS TABLE (rank integer, node_id bigint, external_id text, sha256 text, title text,
               text text, source text, breadcrumb text[], "timestamp" timestamptz,
               score double precision, direct_rank integer, cited_by integer[],
               neighbour_score double precision)
-- PARALLEL UNSAFE: it may embed in the database (PL/Python) and runs semantic_search.
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    pol record;
    lo timestamptz;
    hi timestamptz;
    emb vector := query_embedding;
    sem jsonb := '{"ids":[],"scores":[]}';
    lex jsonb;
    why text;
BEGIN
    PERFORM memory.check_query(query);
    IF result_ids IS NULL THEN
        RAISE EXCEPTION 'result_ids must not be NULL'
            USING ERRCODE = '22023', HINT = 'Pass the results in rank order, e.g. ARRAY(SELECT node_id FROM memory_query(...) ORDER BY rank), or ''{}''.';
    END IF;
    SELECT t.since_ts, t.before_ts INTO lo, hi FROM memory.time_range(since, until) t;
    PERFORM memory.project_id(project);
    PERFORM memory.check_embedding(query_embedding);
    SELECT * INTO pol FROM memory.policy();
    IF coalesce(budget, pol.evidence_budget) = 0 THEN
        RETURN;  -- select_evidence checks the range; off costs no search
    END IF;
    IF emb IS NULL THEN
        BEGIN
            emb := memory.embed(query);
        EXCEPTION WHEN SQLSTATE 'PM503' THEN
            GET STACKED DIAGNOSTICS why = MESSAGE_TEXT;
            RAISE NOTICE 'memory.evidence: no query embedding (%), so direct evidence is lexical only', why;
        END;
    END IF;
    SELECT jsonb_build_object('ids', coalesce(jsonb_agg(l.node_id ORDER BY l.rank), '[]'),
                              'scores', coalesce(jsonb_agg(l.lexical_score ORDER BY l.rank), '[]'))
      INTO lex
      FROM memory.lexical_search(query, project, ARRAY['L0'], pol.evidence_candidates,
                                 since => lo, before => hi) l;
    IF emb IS NOT NULL THEN
        SELECT jsonb_build_object('ids', coalesce(jsonb_agg(s.node_id ORDER BY s.rank), '[]'),
                                  'scores', coalesce(jsonb_agg(s.query_score ORDER BY s.rank), '[]'))
          INTO sem
          FROM memory.semantic_search(emb, project, ARRAY['L0'], pol.evidence_candidates,
                                      since => lo, before => hi) s;
    END IF;
    RETURN QUERY SELECT * FROM memory.select_evidence(result_ids, sem, lex, NULL, budget, project);
END $$;
COMMENT ON FUNCTION memory.evidence(text, bigint[], vector, text, integer, text, text) IS
    'The L0 evidence of a response, for SQL users: pass the query and the result ids of memory.query in rank order; it runs the direct L0 legs (lexical, and semantic when an embedding is given or memory.embed can make one) and returns memory.select_evidence. The HTTP service returns the same list as "evidence". since/until as in memory.query.';
