-- Rank fusion of two or more ranked lists.

-- The row both fusions return, declared once (memory._declare_row): per id its rank and
-- score in each input list, the fused score, and how it was fused.
SELECT memory._declare_row('fused_row',
    'node_id bigint, ranks integer[], scores double precision[], fused_score double precision, fusion_method text');

-- The one fusion, for memory.fuse and memory.fuse_legs: the ranked lists as JSON objects
-- ({"ids": [..], "scores": [..], "weight": w}), the weights apart when the caller decides
-- them (memory.fuse_legs: a leg's own "weight" is then not read). memory.fuse_legs passes
-- its legs as they are, not rebuilt into one JSON document to be taken apart again.
CREATE OR REPLACE FUNCTION memory._fuse_lists(
    items jsonb[],
    weights double precision[],
    method text,
    k integer,
    final_k integer
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
    n integer := cardinality(items);
    bad text[];
    odd boolean;
    list_nos integer[];
    ranks integer[];
    ids text[];
    scores double precision[];
BEGIN
    IF method IS NULL OR NOT method = ANY (@vocabulary.fusions@) THEN
        RAISE EXCEPTION 'unknown fusion method "%"', method
            USING ERRCODE = '22023', HINT = 'Use rrf or convex.';
    END IF;
    IF k IS NULL OR k < 0 OR final_k IS NULL OR final_k < 1 THEN
        RAISE EXCEPTION 'k must be >= 0 and final_k >= 1 (got %, %)', k, final_k USING ERRCODE = '22023';
    END IF;
    -- Every weight is read before any score, and the ids after both have passed, as they
    -- always were: lists with several faults fail on the one they always failed on.
    SELECT coalesce(weights, array_agg(coalesce(x.weight, 1.0) ORDER BY x.ord)),
           array_agg(format('lists[%s].weight', x.ord - 1)) FILTER (WHERE x.weight IN ('NaN', 'Infinity', '-Infinity')),
           -- "ids" that is not an array (an error) or "scores" a single value (the first id's)
           bool_or(jsonb_typeof(coalesce(x.item -> 'ids', '[]')) <> 'array'
                   OR jsonb_typeof(x.item -> 'scores') IN ('string', 'number', 'boolean'))
      INTO weights, bad, odd
      FROM (SELECT li.item, li.ord,
                   CASE WHEN weights IS NULL THEN (li.item ->> 'weight')::double precision END AS weight
            FROM unnest(items) WITH ORDINALITY AS li(item, ord)) x;
    -- JSON has no NaN, but the strings "NaN" and "Infinity" cast to float8, and would sort
    -- above every fused score: refuse them, naming the list and field. Ids and scores are
    -- read side by side; a score past the last id is checked too.
    SELECT array_agg(e.list_no), array_agg(e.pos::integer), array_agg(e.id), array_agg(e.score),
           bad || array_agg(format('lists[%s].scores', e.list_no)) FILTER (WHERE e.score IN ('NaN', 'Infinity', '-Infinity'))
      INTO list_nos, ranks, ids, scores, bad
      FROM (SELECT (li.ord - 1)::integer AS list_no, e.id, e.score::double precision AS score, e.pos
            FROM unnest(items) WITH ORDINALITY AS li(item, ord),
                 ROWS FROM (jsonb_array_elements_text(CASE jsonb_typeof(li.item -> 'ids') WHEN 'array'
                                                           THEN li.item -> 'ids' ELSE '[]' END),
                            jsonb_array_elements_text(CASE jsonb_typeof(li.item -> 'scores') WHEN 'array'
                                                           THEN li.item -> 'scores' ELSE '[]' END))
                      WITH ORDINALITY AS e(id, score, pos)) e;
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION '% must be finite numbers', (SELECT string_agg(DISTINCT b, ', ') FROM unnest(bad) b)
            USING ERRCODE = '22023', HINT = 'Weights and scores may not be NaN or Infinity.';
    END IF;
    IF odd THEN
        -- Read id by id as JSON allows: a single value as "scores" is the first id's score
        -- (unchecked, as it always was), and "ids" that is no array fails being read as one.
        SELECT array_agg((li.ord - 1)::integer), array_agg(e.pos::integer), array_agg(e.id),
               array_agg((li.item -> 'scores' ->> (e.pos::integer - 1))::double precision)
          INTO list_nos, ranks, ids, scores
          FROM unnest(items) WITH ORDINALITY AS li(item, ord),
               jsonb_array_elements_text(coalesce(li.item -> 'ids', '[]')) WITH ORDINALITY AS e(id, pos)
         WHERE e.id IS NOT NULL AND e.id::bigint IS NOT NULL;
    END IF;
    RETURN QUERY
    SELECT f.id,
           -- One slot per input list, NULL where the id was absent; an id in every list
           -- has them already, and two lists (memory.fuse_legs) need no subquery.
           CASE n WHEN cardinality(f.in_lists) THEN f.rank_by_list
                  WHEN 2 THEN ARRAY[f.rank_by_list[array_position(f.in_lists, 0)],
                                    f.rank_by_list[array_position(f.in_lists, 1)]]
                  ELSE ARRAY(SELECT f.rank_by_list[array_position(f.in_lists, i)] FROM generate_series(0, n - 1) i) END,
           CASE n WHEN cardinality(f.in_lists) THEN f.score_by_list
                  WHEN 2 THEN ARRAY[f.score_by_list[array_position(f.in_lists, 0)],
                                    f.score_by_list[array_position(f.in_lists, 1)]]
                  ELSE ARRAY(SELECT f.score_by_list[array_position(f.in_lists, i)] FROM generate_series(0, n - 1) i) END,
           f.fused,
           method
    FROM (
        -- No ORDER BY in the aggregates: PostgreSQL 15 sorts each group's rows again for
        -- every ordered aggregate (four sorts per id were most of a fusion's cost), and
        -- the subquery's (id, list) order gives every group its rows in list order (a
        -- function's rows have no parallel plan; a sort added on id alone, which is not
        -- stable, would break it; PostgreSQL 16 sorts once for all ordered aggregates).
        SELECT e.id,
               array_agg(e.list_no) AS in_lists,
               array_agg(e.rank) AS rank_by_list,
               array_agg(e.score) AS score_by_list,
               -- summed in list order: a floating-point sum's last bit depends on the order
               -- its terms arrive in, and equal candidates must tie exactly (then by id)
               CASE WHEN method = 'rrf' THEN sum(weights[e.list_no + 1] / (k + e.rank))
                    ELSE sum(weights[e.list_no + 1]
                             * coalesce(CASE WHEN e.hi = e.lo THEN 1.0
                                             ELSE (e.score - e.lo) / (e.hi - e.lo) END, 0)) END AS fused,
               min(e.rank) AS best_rank
        FROM (
            SELECT d.*, min(d.score) OVER w AS lo, max(d.score) OVER w AS hi
            FROM (
                -- First occurrence wins when an id repeats within a list.
                SELECT DISTINCT ON (u.list_no, u.id) u.list_no, u.id, u.rank, u.score
                FROM unnest(list_nos, ids::bigint[], ranks, scores) AS u(list_no, id, rank, score)
                WHERE u.id IS NOT NULL
                ORDER BY u.list_no, u.id, u.rank
            ) d
            WINDOW w AS (PARTITION BY d.list_no)
            ORDER BY d.id, d.list_no
        ) e
        GROUP BY e.id
        -- Deterministic ties: higher score, then best single-list rank, then lower id.
        ORDER BY fused DESC, best_rank, e.id
        LIMIT final_k
    ) f
    -- the subquery's order again, stated (free: its rows arrive in it)
    ORDER BY f.fused DESC, f.best_rank, f.id;
END $$;
COMMENT ON FUNCTION memory._fuse_lists(jsonb[], double precision[], text, integer, integer) IS
    'memory.fuse over its lists as an array (items: {"ids":[..],"scores":[..],"weight":w} each) and, unless NULL, the weights apart (then no item''s "weight" is read): the checks on method, k, final_k, the weights and the scores, then the fusion.';

CREATE OR REPLACE FUNCTION memory.fuse(
    lists jsonb,
    method text DEFAULT 'rrf',
    k integer DEFAULT 60,
    final_k integer DEFAULT 50
)
RETURNS SETOF memory.fused_row
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF lists IS NULL OR jsonb_typeof(lists) <> 'array' OR jsonb_array_length(lists) < 1 THEN
        RAISE EXCEPTION 'lists must be a JSON array of ranked lists'
            USING ERRCODE = '22023',
                  HINT = 'e.g. ''[{"ids":[3,1,2]},{"ids":[2,5],"weight":0.5}]''; "scores" is needed for method convex.';
    END IF;
    RETURN QUERY
    SELECT * FROM memory._fuse_lists(ARRAY(SELECT jsonb_array_elements(lists)), NULL, method, k, final_k);
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
-- Pure computation over its arguments, as memory._fuse_lists: one plan serves every call
-- (PostgreSQL otherwise kept making one per call, 0.05 ms an answer).
SET plan_cache_mode = force_generic_plan
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
    FROM memory._fuse_lists(
        ARRAY[semantic, lexical],
        ARRAY[CASE WHEN strategy = 'LexicalOnly' THEN 0
                   WHEN fusion = 'convex' AND strategy IN ('Hybrid', 'LexicalFirst')
                        THEN memory.check_weight('dense_weight', dense_weight)
                   ELSE 1 END,
              CASE WHEN strategy = 'SemanticOnly' THEN 0
                   WHEN fusion = 'convex' AND strategy IN ('Hybrid', 'LexicalFirst') THEN 1 - dense_weight
                   WHEN strategy = 'LexicalFirst' THEN 0
                   ELSE 1 END]::double precision[],
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
    candidates memory.fused_row[], plan jsonb, query_embedding vector, OUT fused jsonb,
    OUT withheld integer, OUT held bigint[]
)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
DECLARE
    floor double precision := CASE WHEN (plan -> 'floor' ->> 'applied')::boolean AND query_embedding IS NOT NULL
                                   THEN (plan -> 'floor' ->> 'min_cosine')::double precision END;
    -- distinct: ts_delete takes a lexeme out once (and the count is of distinct terms)
    terms text[] := ARRAY(SELECT DISTINCT t FROM jsonb_array_elements_text(coalesce(plan -> 'floor' -> 'terms', '[]')) t
                          WHERE t IS NOT NULL);
    need integer := (plan -> 'floor' ->> 'keep_with_terms')::integer;
    recent boolean := coalesce((plan -> 'recency' ->> 'applied')::boolean, false);
    boost jsonb := coalesce(plan -> 'grammar' -> 'boost', '[]');
    -- recency or a soft phrase may lift a candidate from below the final k
    reorders boolean := recent OR jsonb_array_length(boost) > 0;
BEGIN
    withheld := 0;
    held := '{}';
    IF candidates IS NULL OR (floor IS NULL AND NOT recent AND jsonb_array_length(boost) = 0) THEN
        -- the rows' own fields, in order (NULL for none, as a jsonb_agg of no rows)
        fused := CASE WHEN cardinality(candidates) > 0 THEN to_jsonb(candidates) END;
        RETURN;
    END IF;
    -- The fused list is every candidate when the floor applies (memory._run_legs), so that
    -- held names every one it holds back, whatever k (the evidence's deeper candidates,
    -- memory._deeper, leave them out for any k); without recency or a soft phrase the page
    -- is still cut from the first final_k: the floor never brings up one from below them.
    -- The candidates come typed (memory.fused_row) and only the kept ones become JSON: as a
    -- JSON list both ways, every candidate's scores went float -> numeric -> float (issue 42).
    -- Recency's score replaces the fused one in what it keeps; the keys are the row type's,
    -- as in the early return above.
    SELECT coalesce(jsonb_agg(to_jsonb(ROW(r.node_id, r.ranks, r.scores,
                                           CASE WHEN recent THEN r.s ELSE r.fused_score END,
                                           r.fusion_method)::memory.fused_row)
                              ORDER BY r.hits DESC, r.s DESC NULLS LAST, r.o)
                        FILTER (WHERE NOT r.low AND r.pos <= (plan ->> 'final_k')::integer
                                      AND (reorders OR r.o <= (plan ->> 'final_k')::integer)), '[]'),
           count(*) FILTER (WHERE r.low AND (reorders OR r.o <= (plan ->> 'final_k')::integer)),
           -- what the floor held back: no evidence cites it either (memory._deeper)
           coalesce(array_agg(r.node_id) FILTER (WHERE r.low), '{}')
      INTO fused, withheld, held
      FROM (SELECT l.*, row_number() OVER (PARTITION BY l.low ORDER BY l.hits DESC, l.s DESC NULLS LAST, l.o) AS pos
      FROM (SELECT f.node_id, f.ranks, f.scores, f.fused_score, f.fusion_method, f.o, f.s, f.hits,
                   -- The floor: a candidate whose cosine similarity to the query is below
                   -- it is held back, unless the query's words vouch for it: it holds
                   -- keep_with_terms of the query's terms (memory._plan) or a phrase the
                   -- caller quoted (a node without a vector cannot be judged: kept).
                   f.below AND f.hits = 0
                     -- (how many terms it holds: the lexemes ts_delete takes out of it, a
                     -- binary search each, 6x cheaper than intersecting its whole array)
                     AND NOT coalesce(need IS NOT NULL
                                      AND length(f.tsv) - length(ts_delete(f.tsv, terms)) >= need,
                                      false) AS low
            FROM (SELECT x.node_id, x.ranks, x.scores, x.fused_score, x.fusion_method,
                         x.o, n.tsv,
                         CASE WHEN recent THEN s.s END AS s,
                         coalesce(1 - (n.embedding <=> query_embedding) < floor, false) AS below,
                         -- A soft phrase raises what contains it: the candidates holding
                         -- more of them first, in their order (memory.parse_query's boost).
                         (SELECT count(*) FROM jsonb_array_elements(boost) b(item)
                          WHERE memory._grammar_has(n.tsv, memory._grammar_doc(n.title, n.breadcrumb, n.text), b.item)) AS hits
                  FROM unnest(candidates) WITH ORDINALITY
                       AS x(node_id, ranks, scores, fused_score, fusion_method, o)
                  LEFT JOIN memory.nodes n ON n.id = x.node_id
                  -- Recency: each score times 1 - w + w * 0.5 ^ (age / half-life), the age
                  -- counted from the plan's origin, and a node from after it by its distance
                  -- too (counted as new, a node dated 9999 was never aged and kept the whole
                  -- boost: issue 43); one without a timestamp gets no boost. Ties keep the
                  -- fused order.
                  LEFT JOIN LATERAL (
                      SELECT x.fused_score
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
COMMENT ON FUNCTION memory._after_fusion(memory.fused_row[], jsonb, vector) IS
    'The fused candidates (memory.fuse_legs rows, best first) made into the final_k list the page is cut from (as JSON, the rows'' fields), as the plan says: the relevance floor holds back those below min_cosine whose words do not vouch for them (withheld counts them, held names them; plan.floor), recency rescores them (plan.recency), the query''s soft phrases (plan.grammar.boost) rank the candidates containing more of them first.';
