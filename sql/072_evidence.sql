-- Evidence: the L0 turns a response cites, within a budget (issue 13).
--
-- The provenance of ten L1/L2 results cites about 19 turns, and only 40% of the turns of a
-- conversation have an L1 above them, so the trees alone miss evidence that no memory was
-- derived from. A response therefore cites a ranked list of L0 turns: those its results
-- derive from, and those the query matches directly (a Hybrid pair of legs at level L0).
-- Each candidate scores its own direct match (normalised by the question's best) plus
-- weight / sqrt(rank) of every result whose provenance reaches it, so a turn both matched
-- and cited by the top result comes first, a turn several results derive from is better
-- supported than one only one does, and a turn only cited by the tenth result competes
-- with a fair direct match; then each turn gains evidence_neighbours times
-- the scores of the candidates said just before and after it. Measured on LoCoMo dev in
-- docs/benchmarks.md ("Evidence within a budget"); the policy keys evidence_* tune it.

CREATE OR REPLACE FUNCTION memory.select_evidence(
    result_ids bigint[],
    semantic jsonb,
    lexical jsonb,
    fusion text DEFAULT NULL,
    budget integer DEFAULT NULL,
    project_name text DEFAULT NULL,
    max_depth integer DEFAULT 4,
    since timestamptz DEFAULT NULL,
    before timestamptz DEFAULT NULL,
    dense_weight double precision DEFAULT NULL,
    rrf_k integer DEFAULT NULL
)
RETURNS TABLE (rank integer, node_id bigint, external_id text, sha256 text, project text,
               title text, text text, source text, breadcrumb text[],
               "timestamp" timestamptz, score double precision, direct_rank integer,
               cited_by integer[], neighbour_score double precision)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    pol record;
    pid integer := memory.project_id(project_name);
    lim integer;
BEGIN
    SELECT * INTO pol FROM memory.policy();
    lim := coalesce(budget, pol.evidence_budget);
    PERFORM memory.check_evidence_budget(lim);
    IF result_ids IS NULL THEN
        RAISE EXCEPTION 'result_ids must not be NULL'
            USING ERRCODE = '22023', HINT = 'Pass the results in rank order, or ''{}'' for direct evidence alone.';
    END IF;
    IF max_depth IS NULL OR max_depth < 1 THEN
        RAISE EXCEPTION 'max_depth must be at least 1, got %', coalesce(max_depth::text, 'NULL')
            USING ERRCODE = '22023', HINT = 'The provenance depth walked from each result; 4 reaches L0 from L2.';
    END IF;
    PERFORM memory.check_fusion(fusion);
    IF lim = 0 THEN
        RETURN;
    END IF;
    RETURN QUERY
    -- The direct legs fused as a Hybrid pair even when one is empty: a lone leg is then
    -- min-max scaled as in a fusion, so its scores weigh against citations the same way
    -- whichever leg ran. Only L0 turns of the project in the time range count.
    WITH direct AS (
        SELECT f.node_id, greatest(f.fused_score, 0) AS s,
               row_number() OVER (ORDER BY f.fused_score DESC, least(f.ranks[1], f.ranks[2]),
                                           f.node_id)::integer AS pos
        FROM memory.fuse_legs(coalesce(semantic, '{"ids":[],"scores":[]}'),
                              coalesce(lexical, '{"ids":[],"scores":[]}'), 'Hybrid',
                              coalesce(fusion, pol.fusion), coalesce(dense_weight, pol.dense_weight),
                              coalesce(rrf_k, pol.rrf_k), pol.evidence_candidates) f
        JOIN memory.nodes n ON n.id = f.node_id AND n.level = 'L0'
             AND (pid IS NULL OR n.project_id = pid)
             AND (since IS NULL OR n.ts >= since) AND (before IS NULL OR n.ts < before)
    ),
    scaled AS (
        SELECT d.node_id, d.pos, d.s / nullif(max(d.s) OVER (), 0) AS s FROM direct d
    ),
    -- A result's own sources are cited whatever their time: the result passed the filter.
    cites AS (
        SELECT w.parent_id AS node_id, array_agg(DISTINCT r.ord::integer ORDER BY r.ord::integer) AS by_rank
        FROM memory.provenance_walk(result_ids, max_depth) w
        JOIN unnest(result_ids) WITH ORDINALITY AS r(id, ord) ON r.id = w.root_id
        GROUP BY w.parent_id
    ),
    scored AS (
        SELECT coalesce(s.node_id, c.node_id) AS node_id, s.pos, c.by_rank,
               coalesce(s.s, 0)
                 + coalesce(pol.evidence_weight * (SELECT sum(1 / sqrt(x)) FROM unnest(c.by_rank) x), 0)
                   AS score
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
    -- ingest order, at most 64 ids away, in the time range. An answer often spans a
    -- question and its reply.
    near AS (
        SELECT b.id AS node_id, sum(o.score) * pol.evidence_neighbours AS s
        FROM own o
        CROSS JOIN LATERAL (
            (SELECT n.id FROM memory.nodes n
             WHERE n.id < o.node_id AND n.id >= o.node_id - 64 AND n.project_id = o.project_id
               AND n.level = 'L0' AND n.title = o.title
               AND (since IS NULL OR n.ts >= since) AND (before IS NULL OR n.ts < before)
             ORDER BY n.id DESC LIMIT 1)
            UNION ALL
            (SELECT n.id FROM memory.nodes n
             WHERE n.id > o.node_id AND n.id <= o.node_id + 64 AND n.project_id = o.project_id
               AND n.level = 'L0' AND n.title = o.title
               AND (since IS NULL OR n.ts >= since) AND (before IS NULL OR n.ts < before)
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
           encode(n.sha256, 'hex'), p.name, n.title, n.text, n.source, n.breadcrumb, n.ts,
           x.score, x.pos, coalesce(x.by_rank, '{}'), x.beside
    FROM total x
    JOIN memory.nodes n ON n.id = x.node_id
    JOIN memory.projects p ON p.id = n.project_id
    WHERE x.score > 0  -- the weakest direct match of a convex leg scores 0: no evidence
    ORDER BY x.score DESC, x.node_id
    LIMIT lim;
END $$;
COMMENT ON FUNCTION memory.select_evidence(bigint[], jsonb, jsonb, text, integer, text, integer, timestamptz, timestamptz, double precision, integer) IS
    'The L0 turns an answer cites, best first, at most budget (default memory.policy() evidence_budget; 0: none): the L0 provenance of result_ids (the results in rank order, walked max_depth levels) and the direct L0 legs the caller ran ({"ids":[..],"scores":[..]}, fused as a Hybrid pair by memory.fuse_legs with fusion, dense_weight and rrf_k, each NULL: the policy). Each turn scores its direct match over the best plus evidence_weight / sqrt(rank) summed over the results citing it; then every turn gains evidence_neighbours times the scores of the candidates just before and after it in its session (same project and title, nearest in ingest order within 64 ids; neighbour_score is that part). since/before (since <= ts < before) keep direct matches and neighbours in range; a result''s own sources are cited whatever their time. Turns scoring 0 are left out. direct_rank is the turn''s rank among the direct matches (NULL: not one), cited_by the ranks of the results whose provenance reaches it.';

-- memory.evidence in two steps: the checks and the direct L0 legs (PL/pgSQL, for the
-- embedder's fallback), then memory.select_evidence's ranking. Its parameters are
-- positional because memory.evidence's own names (project, ...) are also result columns,
-- which PL/pgSQL does not allow.
CREATE OR REPLACE FUNCTION memory.evidence_legs(
    p_query text,
    p_result_ids bigint[],
    p_embedding vector,
    p_project text,
    p_budget integer,
    p_since text,
    p_until text,
    p_fusion text,
    OUT semantic jsonb,
    OUT lexical jsonb,
    OUT since_ts timestamptz,
    OUT before_ts timestamptz
)
-- PARALLEL UNSAFE: it may embed in the database (PL/Python) and runs semantic_search.
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
DECLARE
    pol record;
    emb vector := p_embedding;
    why text;
    fix text;
BEGIN
    semantic := '{"ids":[],"scores":[]}';
    lexical := '{"ids":[],"scores":[]}';
    -- Every argument is checked before any search, as memory.query does.
    PERFORM memory.check_query(p_query);
    IF p_result_ids IS NULL THEN
        RAISE EXCEPTION 'result_ids must not be NULL'
            USING ERRCODE = '22023', HINT = 'Pass the results in rank order, e.g. ARRAY(SELECT node_id FROM memory_query(...) ORDER BY rank), or ''{}''.';
    END IF;
    SELECT * INTO pol FROM memory.policy();
    PERFORM memory.check_evidence_budget(coalesce(p_budget, pol.evidence_budget));
    PERFORM memory.check_fusion(p_fusion);
    SELECT t.since_ts, t.before_ts INTO since_ts, before_ts FROM memory.time_range(p_since, p_until) t;
    PERFORM memory.project_id(p_project);
    PERFORM memory.check_embedding(p_embedding);
    IF coalesce(p_budget, pol.evidence_budget) = 0 THEN
        RETURN;  -- off costs no search
    END IF;
    IF emb IS NULL THEN
        BEGIN
            emb := memory.embed(p_query);
        EXCEPTION WHEN SQLSTATE 'PM503' THEN
            GET STACKED DIAGNOSTICS why = MESSAGE_TEXT, fix = PG_EXCEPTION_HINT;
            RAISE NOTICE 'memory.evidence: no query embedding (%), so direct evidence is lexical only', why
                USING HINT = coalesce(nullif(fix, ''), 'Run `make setup` and `poimen-memory migrate` on the database host, or pass query_embedding.');
        END;
    END IF;
    SELECT jsonb_build_object('ids', coalesce(jsonb_agg(l.node_id ORDER BY l.rank), '[]'),
                              'scores', coalesce(jsonb_agg(l.lexical_score ORDER BY l.rank), '[]'))
      INTO lexical
      FROM memory.lexical_search(p_query, p_project, ARRAY['L0'], pol.evidence_candidates,
                                 since => since_ts, before => before_ts) l;
    IF emb IS NOT NULL THEN
        SELECT jsonb_build_object('ids', coalesce(jsonb_agg(s.node_id ORDER BY s.rank), '[]'),
                                  'scores', coalesce(jsonb_agg(s.query_score ORDER BY s.rank), '[]'))
          INTO semantic
          FROM memory.semantic_search(emb, p_project, ARRAY['L0'], pol.evidence_candidates,
                                      since => since_ts, before => before_ts) s;
    END IF;
END $$;
COMMENT ON FUNCTION memory.evidence_legs(text, bigint[], vector, text, integer, text, text, text) IS
    'The first step of memory.evidence (call that instead): checks every argument, then runs the direct L0 legs (none when the budget is 0) and returns them with the parsed time range.';

CREATE OR REPLACE FUNCTION memory.evidence(
    query text,
    result_ids bigint[],
    query_embedding vector DEFAULT NULL,
    project text DEFAULT NULL,
    budget integer DEFAULT NULL,
    since text DEFAULT NULL,
    until text DEFAULT NULL,
    fusion text DEFAULT NULL
)
RETURNS TABLE (rank integer, node_id bigint, external_id text, sha256 text, project text,
               title text, text text, source text, breadcrumb text[],
               "timestamp" timestamptz, score double precision, direct_rank integer,
               cited_by integer[], neighbour_score double precision)
LANGUAGE sql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT e.*
    FROM memory.evidence_legs(query, result_ids, query_embedding, project, budget, since,
                              until, fusion) l
    CROSS JOIN LATERAL memory.select_evidence(result_ids, l.semantic, l.lexical, fusion,
                                              budget, project, 4, l.since_ts,
                                              l.before_ts) e
    ORDER BY e.rank;
END;
COMMENT ON FUNCTION memory.evidence(text, bigint[], vector, text, integer, text, text, text) IS
    'The L0 evidence of an answer, for SQL users: pass the query and memory.query''s result ids in rank order (and its embedding, or it embeds again); it runs the direct L0 legs (lexical, and semantic when an embedding is given or memory.embed can make one), each evidence_candidates deep and kept to since/until (ISO, as memory.query; dates the optimizer extracts do not apply here), and returns memory.select_evidence with fusion (NULL: the policy). For a Hybrid answer the HTTP service returns the same list as "evidence"; it skips a leg its route did not run (no embedding, no lexical engine).';
