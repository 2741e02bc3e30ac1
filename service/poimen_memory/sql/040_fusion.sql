-- Rank fusion of two or more ranked lists.

-- The row both fusions return, declared once (memory._declare_row): per id its rank and
-- score in each input list, the fused score, and how it was fused.
SELECT memory._declare_row('fused_row',
    'node_id bigint, ranks integer[], scores double precision[], fused_score double precision, fusion_method text');

CREATE OR REPLACE FUNCTION memory.fuse(
    lists jsonb,
    method text DEFAULT 'rrf',
    k integer DEFAULT 60,
    final_k integer DEFAULT 50
)
RETURNS SETOF memory.fused_row
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
-- Pure computation over its arguments: a plan made for one call's lists serves any other,
-- and re-planning the statement at every call (PL/pgSQL's custom plans) cost 0.24 ms of a
-- 1.1 ms fusion of two 50-lists.
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    n_lists integer;
    bad text;
BEGIN
    IF lists IS NULL OR jsonb_typeof(lists) <> 'array' OR jsonb_array_length(lists) < 1 THEN
        RAISE EXCEPTION 'lists must be a JSON array of ranked lists'
            USING ERRCODE = '22023',
                  HINT = 'e.g. ''[{"ids":[3,1,2]},{"ids":[2,5],"weight":0.5}]''; "scores" is needed for method convex.';
    END IF;
    IF method IS NULL OR NOT method = ANY (@vocabulary.fusions@) THEN
        RAISE EXCEPTION 'unknown fusion method "%"', method
            USING ERRCODE = '22023', HINT = 'Use rrf or convex.';
    END IF;
    IF k IS NULL OR k < 0 OR final_k IS NULL OR final_k < 1 THEN
        RAISE EXCEPTION 'k must be >= 0 and final_k >= 1 (got %, %)', k, final_k USING ERRCODE = '22023';
    END IF;
    n_lists := jsonb_array_length(lists);
    -- JSON has no NaN, but the strings "NaN" and "Infinity" cast to float8, and would sort
    -- above every fused score: refuse them, naming the list and field.
    SELECT string_agg(DISTINCT b.arg, ', ') INTO bad
    FROM (
        SELECT format('lists[%s].weight', li.ord - 1) AS arg
        FROM jsonb_array_elements(lists) WITH ORDINALITY AS li(item, ord)
        WHERE (li.item ->> 'weight')::double precision IN ('NaN', 'Infinity', '-Infinity')
        UNION ALL
        SELECT format('lists[%s].scores', li.ord - 1)
        FROM jsonb_array_elements(lists) WITH ORDINALITY AS li(item, ord),
             jsonb_array_elements_text(CASE jsonb_typeof(li.item -> 'scores') WHEN 'array'
                                            THEN li.item -> 'scores' ELSE '[]' END) AS s(v)
        WHERE s.v::double precision IN ('NaN', 'Infinity', '-Infinity')
    ) b;
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION '% must be finite numbers', bad
            USING ERRCODE = '22023', HINT = 'Weights and scores may not be NaN or Infinity.';
    END IF;
    RETURN QUERY
    WITH l AS (
        SELECT (li.ord - 1)::integer AS list_no,
               coalesce((li.item ->> 'weight')::double precision, 1.0) AS weight,
               li.item
        FROM jsonb_array_elements(lists) WITH ORDINALITY AS li(item, ord)
    ), entries AS (
        -- First occurrence wins when an id repeats within a list.
        SELECT DISTINCT ON (l.list_no, e.id::bigint)
               l.list_no, l.weight, e.id::bigint AS id, e.pos::integer AS rank,
               (l.item -> 'scores' ->> (e.pos::integer - 1))::double precision AS score
        FROM l, jsonb_array_elements_text(coalesce(l.item -> 'ids', '[]')) WITH ORDINALITY AS e(id, pos)
        WHERE e.id IS NOT NULL
        ORDER BY l.list_no, e.id::bigint, e.pos
    ), normed AS (
        SELECT e.*,
               CASE WHEN max(e.score) OVER w = min(e.score) OVER w THEN 1.0
                    ELSE (e.score - min(e.score) OVER w) / (max(e.score) OVER w - min(e.score) OVER w)
               END AS norm
        FROM entries e
        WINDOW w AS (PARTITION BY e.list_no)
    ), fused AS (
        SELECT n.id,
               array_agg(n.rank ORDER BY n.list_no) AS rank_by_list,
               array_agg(n.list_no ORDER BY n.list_no) AS list_nos,
               array_agg(n.score ORDER BY n.list_no) AS score_by_list,
               -- summed in list order: a floating-point sum's last bit depends on the order
               -- its terms arrive in, and equal candidates must tie exactly (then by id)
               CASE WHEN method = 'rrf' THEN sum(n.weight / (k + n.rank) ORDER BY n.list_no)
                    ELSE sum(n.weight * coalesce(n.norm, 0) ORDER BY n.list_no) END AS fused,
               min(n.rank) AS best_rank
        FROM normed n
        GROUP BY n.id
    )
    SELECT f.id,
           -- Expand to one slot per input list, NULL where the id was absent.
           ARRAY(SELECT f.rank_by_list[array_position(f.list_nos, i)] FROM generate_series(0, n_lists - 1) i),
           ARRAY(SELECT f.score_by_list[array_position(f.list_nos, i)] FROM generate_series(0, n_lists - 1) i),
           f.fused::double precision,
           method
    FROM fused f
    -- Deterministic ties: higher score, then best single-list rank, then lower id.
    ORDER BY f.fused DESC, f.best_rank, f.id
    LIMIT final_k;
END $$;
COMMENT ON FUNCTION memory.fuse(jsonb, text, integer, integer) IS
    'Fuses ranked lists [{"ids":[..],"scores":[..],"weight":w},..]. rrf: sum of w/(k+rank). convex: sum of w*minmax(score) per list. Returns per-id ranks/scores (one slot per list, NULL if absent); ties break by best rank, then id.';

CREATE OR REPLACE FUNCTION memory.fuse_legs(
    semantic jsonb,
    lexical jsonb,
    strategy text,
    fusion text DEFAULT 'rrf',
    dense_weight double precision DEFAULT 0.4,
    k integer DEFAULT 60,
    final_k integer DEFAULT 50
)
RETURNS SETOF memory.fused_row
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
-- One place decides how a routed strategy weighs its legs, for memory.query and the service.
-- Convex leans lexical (dense_weight 0.4 measured best); RRF keeps equal weights; the
-- classic cascade (rrf) is the cosine order of the lexical ids alone.
AS $$
BEGIN
    RETURN QUERY
    SELECT f.node_id, f.ranks, f.scores, f.fused_score,
           CASE strategy WHEN 'Hybrid' THEN f.fusion_method
                         WHEN 'LexicalFirst' THEN CASE WHEN fusion = 'convex' THEN 'cascade+convex'
                                                       ELSE 'cascade' END
                         ELSE 'none' END
    FROM memory.fuse(
        jsonb_build_array(
            semantic || jsonb_build_object('weight',
                CASE WHEN strategy = 'LexicalOnly' THEN 0
                     WHEN fusion = 'convex' AND strategy IN ('Hybrid', 'LexicalFirst')
                          THEN memory.check_weight('dense_weight', dense_weight)
                     ELSE 1 END),
            lexical || jsonb_build_object('weight',
                CASE WHEN strategy = 'SemanticOnly' THEN 0
                     WHEN fusion = 'convex' AND strategy IN ('Hybrid', 'LexicalFirst') THEN 1 - dense_weight
                     WHEN strategy = 'LexicalFirst' THEN 0
                     ELSE 1 END)),
        CASE WHEN strategy IN ('Hybrid', 'LexicalFirst') THEN fusion ELSE 'rrf' END,
        k, final_k) f
    -- A cascade keeps only ids the by-ids stage ranked.
    WHERE strategy <> 'LexicalFirst' OR f.ranks[1] IS NOT NULL;
END
$$;
COMMENT ON FUNCTION memory.fuse_legs(jsonb, jsonb, text, text, double precision, integer, integer) IS
    'Fuses a semantic and a lexical leg ({"ids":[..],"scores":[..]}) the way the routed strategy needs: weights, method, the cascade filter and the reported fusion_method.';

-- What happens to the fused list before the page is cut from it (memory._run_legs), in
-- one place: the relevance floor holds candidates back, recency rescores them, the soft
-- phrases of the query grammar raise the ones that contain them; then the final k.
CREATE OR REPLACE FUNCTION memory._after_fusion(
    candidates jsonb, plan jsonb, query_embedding vector, OUT fused jsonb, OUT withheld integer,
    OUT held bigint[]
)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
DECLARE
    floor double precision := CASE WHEN (plan -> 'floor' ->> 'applied')::boolean AND query_embedding IS NOT NULL
                                   THEN (plan -> 'floor' ->> 'min_cosine')::double precision END;
    terms text[] := ARRAY(SELECT jsonb_array_elements_text(coalesce(plan -> 'floor' -> 'terms', '[]')));
    need integer := (plan -> 'floor' ->> 'keep_with_terms')::integer;
    recent boolean := coalesce((plan -> 'recency' ->> 'applied')::boolean, false);
    boost jsonb := coalesce(plan -> 'grammar' -> 'boost', '[]');
    -- recency or a soft phrase may lift a candidate from below the final k
    reorders boolean := recent OR jsonb_array_length(boost) > 0;
BEGIN
    withheld := 0;
    held := '{}';
    IF candidates IS NULL OR (floor IS NULL AND NOT recent AND jsonb_array_length(boost) = 0) THEN
        fused := candidates;
        RETURN;
    END IF;
    -- The fused list is every candidate when the floor applies (memory._run_legs), so that
    -- held names every one it holds back, whatever k (the evidence's deeper candidates,
    -- memory._deeper, leave them out for any k); without recency or a soft phrase the page
    -- is still cut from the first final_k: the floor never brings up one from below them.
    SELECT coalesce(jsonb_agg(r.v ORDER BY r.hits DESC, r.s DESC NULLS LAST, r.o)
                        FILTER (WHERE NOT r.low AND r.pos <= (plan ->> 'final_k')::integer
                                      AND (reorders OR r.o <= (plan ->> 'final_k')::integer)), '[]'),
           count(*) FILTER (WHERE r.low AND (reorders OR r.o <= (plan ->> 'final_k')::integer)),
           -- what the floor held back: no evidence cites it either (memory._deeper)
           coalesce(array_agg((r.v ->> 'node_id')::bigint) FILTER (WHERE r.low), '{}')
      INTO fused, withheld, held
      FROM (SELECT l.*, row_number() OVER (PARTITION BY l.low ORDER BY l.hits DESC, l.s DESC NULLS LAST, l.o) AS pos
      FROM (SELECT f.v, f.o, f.s, f.hits,
                   -- The floor: a candidate whose cosine similarity to the query is below
                   -- it is held back, unless the query's words vouch for it: it holds
                   -- keep_with_terms of the query's terms (memory._plan) or a phrase the
                   -- caller quoted (a node without a vector cannot be judged: kept).
                   f.below AND f.hits = 0
                     AND NOT coalesce(need IS NOT NULL
                                      AND cardinality(ARRAY(SELECT unnest(terms)
                                                            INTERSECT SELECT unnest(tsvector_to_array(f.tsv))))
                                          >= need, false) AS low
            FROM (SELECT CASE WHEN recent THEN x.v || jsonb_build_object('fused_score', s.s) ELSE x.v END AS v,
                         x.o, n.tsv,
                         CASE WHEN recent THEN s.s END AS s,
                         coalesce(1 - (n.embedding <=> query_embedding) < floor, false) AS below,
                         -- A soft phrase raises what contains it: the candidates holding
                         -- more of them first, in their order (memory.parse_query's boost).
                         (SELECT count(*) FROM jsonb_array_elements(boost) b(item)
                          WHERE memory._grammar_has(n.tsv, memory._grammar_doc(n.title, n.breadcrumb, n.text), b.item)) AS hits
                  FROM ROWS FROM (jsonb_array_elements(candidates), jsonb_to_recordset(candidates) AS (node_id bigint))
                       WITH ORDINALITY AS x(v, node_id, o)
                  LEFT JOIN memory.nodes n ON n.id = x.node_id
                  -- Recency: each score times 1 - w + w * 0.5 ^ (age / half-life), the age
                  -- counted from the plan's origin, and a node from after it by its distance
                  -- too (counted as new, a node dated 9999 was never aged and kept the whole
                  -- boost: issue 43); one without a timestamp gets no boost. Ties keep the
                  -- fused order.
                  LEFT JOIN LATERAL (
                      SELECT (x.v ->> 'fused_score')::double precision
                               * (1 - w.w + w.w * CASE WHEN n.ts IS NULL THEN 0  -- (greatest skips NULLs)
                                     ELSE power(0.5::double precision, least(  -- 0.5 ^ 1000: no underflow
                                         abs(extract(epoch FROM w.origin - n.ts)) / 86400.0 / w.h,
                                         1000)) END) AS s
                      FROM (SELECT (plan -> 'recency' ->> 'weight')::double precision AS w,
                                   (plan -> 'recency' ->> 'half_life_days')::double precision AS h,
                                   coalesce((plan -> 'recency' ->> 'origin')::timestamptz, now()) AS origin) w
                      WHERE recent
                  ) s ON true) f) l) r;
END $$;
COMMENT ON FUNCTION memory._after_fusion(jsonb, jsonb, vector) IS
    'The fused candidates (memory.fuse_legs rows as JSON, best first) made into the final_k list the page is cut from, as the plan says: the relevance floor holds back those below min_cosine whose words do not vouch for them (withheld counts them, held names them; plan.floor), recency rescores them (plan.recency), the query''s soft phrases (plan.grammar.boost) rank the candidates containing more of them first.';
