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

-- The row the three return, declared once (memory._declare_row): one cited L0 turn, its
-- rank, its score, its own direct rank and the ranks of the results that cite it.
SELECT memory._declare_row('evidence_row',
    'rank integer, node_id bigint, external_id text, sha256 text, project text, title text, text text, source text, breadcrumb text[], "timestamp" timestamptz, score double precision, direct_rank integer, cited_by integer[], neighbour_score double precision, metadata jsonb, revision integer, superseded boolean');

-- One candidate of memory.select_evidence between its statements, held in an array of this
-- type rather than a JSON document: the scores stay double precision (JSON held them as
-- numeric, converted at every read), and the citation reservation and the final rows read
-- the typed fields directly instead of rescanning and casting the JSON list per result.
SELECT memory._declare_row('evidence_candidate',
    'id bigint, s double precision, pos integer, by_rank integer[], beside double precision, project_id integer, title text');

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
    rrf_k integer DEFAULT NULL,
    filter jsonb DEFAULT NULL,
    as_of timestamptz DEFAULT NULL,
    deeper bigint[] DEFAULT NULL,
    query text DEFAULT NULL,
    valid_at timestamptz DEFAULT NULL
)
RETURNS SETOF memory.evidence_row
-- PARALLEL UNSAFE: the second hop runs memory.lexical_search, which sets plan_cache_mode.
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
SET jit = off  -- memory._plan_cache_mode (sql/071_execute.sql) says why
AS $$
#variable_conflict use_column
DECLARE
    pol record;
    pid integer := memory.project_id(project_name);
    lim integer;
    cands memory.evidence_candidate[];
    reserved bigint[] := '{}';
    reserved_cite integer[] := '{}';  -- the result ranks the reserved turns cite
    first_citing integer[];     -- per result rank, the position in cands of its best cited turn
    pick integer;
    terms text;
    hop memory.evidence_candidate[] := '{}';  -- the second hop's turns: id and BM25 score s
    words text[];
    -- What the legs saw (memory._leg_visibility: valid time at the instant they tested it):
    -- a neighbour the evidence adds beside their turns passes the same test.
    scope memory.visibility := memory._leg_visibility(pid, NULL, since, before, filter, NULL,
                                                      as_of, valid_at);
    -- A direct match or a deeper candidate's citation is tested on all but transaction time:
    -- the legs chose the versions, and a result may rest on one rewritten since
    -- (memory._provenance_reach, memory._rests_on).
    cited memory.visibility := scope;
    cite_all boolean;  -- cited tests nothing but the project: no citation needs a look
BEGIN
    cited.every_version := true;
    cite_all := cited IS NOT DISTINCT FROM memory._visibility(project_id => pid, every_version => true);
    SELECT * INTO pol FROM memory.policy();
    IF pol.evidence_speaker_weight > 0 AND query IS NOT NULL THEN
        words := regexp_split_to_array(lower(query), '[^[:alnum:]]+');
    END IF;
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
    -- Every candidate scoring above 0, best first (memory.evidence_candidate: id, score s,
    -- direct rank pos, the citing ranks by_rank, the neighbours' part beside, the session).
    WITH fused AS (
        SELECT f.node_id, f.fused_score, least(f.ranks[1], f.ranks[2]) AS best
        FROM memory.fuse_legs(coalesce(semantic, '{"ids":[],"scores":[]}'),
                              coalesce(lexical, '{"ids":[],"scores":[]}'), 'Hybrid',
                              coalesce(fusion, pol.fusion), coalesce(dense_weight, pol.dense_weight),
                              coalesce(rrf_k, pol.rrf_k), pol.evidence_candidates) f
    ),
    -- A result's own sources are cited whatever their time: the result passed the filter.
    -- The deeper candidates (the fused ones after the results, memory._deeper) cite theirs
    -- at the ranks that follow the results', without reserving a turn, and only in the time
    -- range, valid time and the metadata filter (they are not shown, so they vouch for
    -- nothing).
    cites AS (
        SELECT w.parent_id AS node_id, array_agg(DISTINCT r.ord::integer ORDER BY r.ord::integer) AS by_rank
        FROM memory._provenance_reach(result_ids || coalesce(deeper, '{}'), max_depth, as_of) w
        JOIN unnest(result_ids || coalesce(deeper, '{}')) WITH ORDINALITY AS r(id, ord) ON r.id = w.root_id
        WHERE r.ord <= cardinality(result_ids) OR cite_all
           OR EXISTS (SELECT 1 FROM memory.nodes n
                      WHERE n.id = w.parent_id AND memory._visible(n, cited))
        GROUP BY w.parent_id
    ),
    -- Every candidate, a direct match or cited, looked up once: one index probe per id
    -- (LATERAL ... LIMIT 1; as a join, the planner, which takes a function to return 1,000
    -- rows, scanned every L0 row of the project and matched each against the list: 3,435
    -- rows read, 20,900 pairs tested for 419 turns), an L0 turn of the project, with what
    -- the steps below read (its session, its speaker's label, the neighbour window) and
    -- whether a direct match counts (memory._visible: the project, the time range, valid
    -- time, the filter, what the legs tested). The window's bounds are columns, not
    -- arithmetic in near's WHERE: under row-level security a qual that calls a function
    -- which is not leakproof (int8 '-' can raise) waits behind the policy's, so it cannot
    -- bound an index scan, and each probe read every L0 row of the project (1.8 s against
    -- 40 ms at 20k nodes, bench-overload). Both MATERIALIZED: a coalesce() is not
    -- leakproof either, so cand's, pulled up into this probe, or probed's, into near's,
    -- would wait behind the policy too, and each probe would scan the project.
    cand AS MATERIALIZED (
        SELECT coalesce(f.node_id, c.node_id) AS node_id, f.node_id IS NOT NULL AS matched,
               f.fused_score, f.best, c.by_rank
        FROM fused f FULL JOIN cites c ON c.node_id = f.node_id
    ),
    probed AS MATERIALIZED (
        SELECT x.node_id, x.fused_score, x.best, x.by_rank, n.vis, n.project_id, n.title,
               n.label, n.id - 64 AS lo, n.id + 64 AS hi, octet_length(n.title) > 2000 AS long_title
        FROM cand x
        CROSS JOIN LATERAL (SELECT n.id, n.project_id, n.title,
                                   CASE WHEN words IS NOT NULL AND strpos(left(n.text, 41), ':') > 1 THEN split_part(n.text, ':', 1) END AS label,
                                   x.matched AND memory._visible(n, cited) AS vis
                            FROM memory.nodes n
                            WHERE n.id = x.node_id AND n.level = 'L0'
                              AND (pid IS NULL OR n.project_id = pid)
                            LIMIT 1) n
        WHERE x.by_rank IS NOT NULL OR n.vis
    ),
    -- The direct legs fused as a Hybrid pair even when one is empty: a lone leg is then
    -- min-max scaled as in a fusion, so its scores weigh against citations the same way
    -- whichever leg ran. Only the direct matches that count are ranked and scaled.
    scaled AS (
        SELECT d.node_id, d.pos, d.s / nullif(max(d.s) OVER (), 0) AS s
        FROM (SELECT p.node_id, greatest(p.fused_score, 0) AS s,
                     row_number() OVER (ORDER BY p.fused_score DESC, p.best, p.node_id)::integer AS pos
              FROM probed p WHERE p.vis) d
    ),
    own0 AS (
        SELECT p.node_id, s.pos, p.by_rank, coalesce(s.s, 0) AS direct,
               coalesce(s.s, 0)
                 + coalesce(pol.evidence_weight * (SELECT sum(1 / sqrt(x)) FROM unnest(p.by_rank) x), 0)
                   AS score,
               p.project_id, p.title, p.label, p.lo, p.hi, p.long_title
        FROM probed p LEFT JOIN scaled s ON s.node_id = p.node_id
    ),
    -- The sessions the results span (evidence_session_weight > 0): a session scores
    -- 1 / sqrt(rank) summed over the results whose provenance reaches one of its turns.
    spans AS (
        SELECT sp.project_id, sp.title, sum(1 / sqrt(sp.r)) AS span
        FROM (SELECT DISTINCT p.project_id, p.title, r.r
              FROM probed p
              CROSS JOIN LATERAL unnest(p.by_rank) AS r(r)
              WHERE pol.evidence_session_weight > 0) sp
        GROUP BY sp.project_id, sp.title
    ),
    -- A direct match in a session the results span gains evidence_session_weight times
    -- its direct score times the session's span: the results route the budget to the
    -- sessions they come from, beyond the turns their own provenance names.
    own AS (
        SELECT o.node_id, o.pos, o.by_rank,
               o.score + coalesce(pol.evidence_session_weight * o.direct * sp.span, 0) AS score,
               o.project_id, o.title, o.label, o.lo, o.hi, o.long_title
        FROM own0 o
        LEFT JOIN spans sp ON sp.project_id = o.project_id AND sp.title = o.title
    ),
    -- The turns said just before and after a candidate, in the same session: the L0 node
    -- of the same project and title (a session's or a document's heading) nearest in
    -- ingest order, at most 64 ids away, in the time range and valid then. An answer often
    -- spans a question and its reply.
    -- One descent of nodes_l0_session per side (sql/088_indexes.sql): its predicate,
    -- octet_length(title) <= 2000, is written out so the planner can use it, and is true of
    -- the neighbour whenever it is of the candidate (the same title). A longer title is in
    -- no index: its candidate walks the primary key as before (the last two branches).
    -- long_title (NULL for no title, which matches nothing) picks the branches per
    -- candidate: a one-time filter each, so a candidate runs two of the four.
    near AS (
        SELECT b.id AS node_id, sum(o.score) * pol.evidence_neighbours AS s,
               min(o.project_id) AS project_id, min(o.title) AS title, min(b.label) AS label
        FROM own o
        CROSS JOIN LATERAL (
            (SELECT n.id, CASE WHEN words IS NOT NULL AND strpos(left(n.text, 41), ':') > 1 THEN split_part(n.text, ':', 1) END AS label FROM memory.nodes n
             WHERE n.project_id = o.project_id AND n.title = o.title AND n.level = 'L0'
               AND octet_length(n.title) <= 2000 AND n.id < o.node_id AND n.id >= o.lo
               AND NOT o.long_title AND memory._visible(n, scope)
             ORDER BY n.id DESC LIMIT 1)
            UNION ALL
            (SELECT n.id, CASE WHEN words IS NOT NULL AND strpos(left(n.text, 41), ':') > 1 THEN split_part(n.text, ':', 1) END AS label FROM memory.nodes n
             WHERE n.project_id = o.project_id AND n.title = o.title AND n.level = 'L0'
               AND octet_length(n.title) <= 2000 AND n.id > o.node_id AND n.id <= o.hi
               AND NOT o.long_title AND memory._visible(n, scope)
             ORDER BY n.id LIMIT 1)
            UNION ALL
            (SELECT n.id, CASE WHEN words IS NOT NULL AND strpos(left(n.text, 41), ':') > 1 THEN split_part(n.text, ':', 1) END AS label FROM memory.nodes n
             WHERE o.long_title AND n.id < o.node_id AND n.id >= o.lo AND n.project_id = o.project_id
               AND n.level = 'L0' AND n.title = o.title AND memory._visible(n, scope)
             ORDER BY n.id DESC LIMIT 1)
            UNION ALL
            (SELECT n.id, CASE WHEN words IS NOT NULL AND strpos(left(n.text, 41), ':') > 1 THEN split_part(n.text, ':', 1) END AS label FROM memory.nodes n
             WHERE o.long_title AND n.id > o.node_id AND n.id <= o.hi AND n.project_id = o.project_id
               AND n.level = 'L0' AND n.title = o.title AND memory._visible(n, scope)
             ORDER BY n.id LIMIT 1)
        ) b
        WHERE pol.evidence_neighbours > 0
        GROUP BY b.id
    ),
    total AS (
        SELECT coalesce(o.node_id, nb.node_id) AS node_id, o.pos, o.by_rank,
               coalesce(o.score, 0) + coalesce(nb.s, 0) AS score, coalesce(nb.s, 0) AS beside,
               coalesce(o.project_id, nb.project_id) AS project_id, coalesce(o.title, nb.title) AS title,
               CASE WHEN o.node_id IS NOT NULL THEN o.label ELSE nb.label END AS label
        FROM own o FULL JOIN near nb ON nb.node_id = o.node_id
    ),
    -- The speaker (evidence_speaker_weight > 0): a turn whose text opens with a label
    -- ("Caroline: ...") that is a word of the question scores 1 + the weight times as
    -- much: a question about a person is mostly answered by what that person said. Only
    -- when more than half of the evidence_speaker_seeds best candidates carry such a label (of
    -- any person the question names) already: a
    -- question whose best evidence another person said (one that names the wrong person)
    -- keeps its order. The label is read where each candidate's row is looked up anyway
    -- (probed, near, total).
    gate AS (
        SELECT count(*) FILTER (WHERE lower(t.label) = ANY (words)) * 2 > count(*) AS named
        FROM (SELECT t.label FROM total t WHERE words IS NOT NULL
              ORDER BY t.score DESC, t.node_id LIMIT pol.evidence_speaker_seeds) t
    ),
    spoken AS (
        SELECT x.node_id, x.pos, x.by_rank, x.beside, x.project_id, x.title,
               x.score * CASE WHEN g.named AND lower(x.label) = ANY (words)
                              THEN 1 + pol.evidence_speaker_weight ELSE 1 END AS score
        FROM total x CROSS JOIN gate g
    )
    SELECT coalesce(array_agg(ROW(x.node_id, x.score, x.pos, coalesce(x.by_rank, '{}'), x.beside,
                                  x.project_id, x.title)::memory.evidence_candidate
                              ORDER BY x.score DESC, x.node_id), '{}')
      INTO cands
      FROM spoken x
     WHERE x.score > 0;  -- the weakest direct match of a convex leg scores 0: no evidence
    -- A second hop (evidence_hop_weight > 0): the names in the best evidence so far (words
    -- written with a capital inside a sentence: people, places, events, titles) are a second,
    -- disjunctive lexical query over the L0 turns, and each of its turns gains
    -- evidence_hop_weight times its BM25 score over the best, competing for the budget: the
    -- turns a question needs that share a name with its best evidence but no word with it.
    IF pol.evidence_hop_weight > 0 AND cardinality(cands) > 0 THEN
        SELECT string_agg(DISTINCT m.w[1], ' ') INTO terms
          FROM (SELECT c.id
                FROM unnest(cands) WITH ORDINALITY AS c(id, s, pos, by_rank, beside, project_id, title, o)
                ORDER BY c.o LIMIT pol.evidence_hop_seeds) c
          JOIN memory.nodes n ON n.id = c.id AND (pid IS NULL OR n.project_id = pid)
          CROSS JOIN LATERAL regexp_matches(n.text, '[^.!?:\s]\s+([A-Z][[:alpha:]]+)', 'g') AS m(w);
        IF terms IS NOT NULL THEN
            SELECT coalesce(array_agg(ROW(h.node_id, h.lexical_score, NULL, NULL, NULL, NULL,
                                          NULL)::memory.evidence_candidate), '{}')
              INTO hop
              FROM memory.lexical_search(terms, project_name, ARRAY['L0'], pol.evidence_candidates,
                                         since => since, before => before, filter => scope.filter,
                                         as_of => as_of, valid_at => valid_at) h;
        END IF;
    END IF;
    -- Coverage (evidence_session_decay < 1): the budget is spent greedily by score, each
    -- turn's score multiplied by the decay once for every better turn of its session, so
    -- the n-th turn of one session competes with the best of another at decay^(n-1).
    -- Within a session the order is unchanged, which makes the greedy order a sort. A turn
    -- without a title is a session of its own (no heading says which turns go together).
    -- Without a decay or a second hop's turns (the defaults) the statement would give
    -- cands back as they are: it is not run.
    IF cardinality(hop) > 0 OR pol.evidence_session_decay < 1 THEN
        WITH c AS (
            SELECT * FROM unnest(cands)
        ),
        h AS (
            SELECT x.id, pol.evidence_hop_weight * x.s / nullif(max(x.s) OVER (), 0) AS hs
            FROM unnest(hop) x
        ),
        merged AS (
            SELECT coalesce(c.id, h.id) AS id, coalesce(c.s, 0) + coalesce(h.hs, 0) AS s, c.pos,
                   coalesce(c.by_rank, '{}') AS by_rank, coalesce(c.beside, 0) AS beside,
                   coalesce(c.project_id, n.project_id) AS project_id,
                   CASE WHEN c.id IS NOT NULL THEN c.title ELSE n.title END AS title
            FROM c FULL JOIN h ON h.id = c.id
            LEFT JOIN LATERAL (SELECT n.project_id, n.title FROM memory.nodes n
                               WHERE c.id IS NULL AND n.id = h.id LIMIT 1) n ON true
        ),
        covered AS (
            SELECT x.*, x.s * power(pol.evidence_session_decay,
                                    row_number() OVER (PARTITION BY x.project_id, x.title,
                                                                    CASE WHEN x.title IS NULL THEN x.id END
                                                       ORDER BY x.s DESC, x.id) - 1) AS spread
            FROM merged x
            WHERE x.s > 0
        )
        SELECT coalesce(array_agg(ROW(x.id, x.s, x.pos, x.by_rank, x.beside, x.project_id,
                                      x.title)::memory.evidence_candidate
                                  ORDER BY x.spread DESC, x.s DESC, x.id), '{}')
          INTO cands
          FROM covered x;
    END IF;
    -- Citation integrity (issue 24): every result whose provenance reaches an L0 candidate
    -- keeps at least one cited turn. In rank order, a result no reserved turn cites yet
    -- reserves its best-scoring cited turn, while the budget lasts; the rest of the budget
    -- is filled by score as before. A result the top turns already cite reserves nothing
    -- new (its best turn is among them), so the change touches only results the budget
    -- would have stripped. One pass over the list finds each rank's best cited turn (the
    -- first in list order citing it); the loop then keeps the ranks the reserved turns cite
    -- (reserved_cite) rather than looking through the list again per rank.
    IF coalesce(cardinality(result_ids), 0) > 0 THEN
        first_citing := ARRAY(
            SELECT f.o::integer
            FROM generate_series(1, cardinality(result_ids)) AS r(r)
            LEFT JOIN (SELECT b.r, min(c.o) AS o
                       FROM unnest(cands) WITH ORDINALITY
                            AS c(id, s, pos, by_rank, beside, project_id, title, o)
                       CROSS JOIN LATERAL unnest(c.by_rank) AS b(r)
                       WHERE b.r <= cardinality(result_ids)
                       GROUP BY b.r) f ON f.r = r.r
            ORDER BY r.r);
    END IF;
    FOR r IN 1..coalesce(cardinality(result_ids), 0) LOOP
        EXIT WHEN cardinality(reserved) >= lim;
        CONTINUE WHEN r = ANY (reserved_cite);
        pick := first_citing[r];
        IF pick IS NOT NULL THEN
            reserved := reserved || (cands[pick]).id;
            reserved_cite := reserved_cite || (cands[pick]).by_rank;
        END IF;
    END LOOP;
    RETURN QUERY
    -- The project's name by a lookup per row, not a join: under row-level security the
    -- planner cannot estimate the projects policy and would loop over every project the
    -- caller sees (the cost then grew with their number: tests/test_query_cost.py).
    SELECT (row_number() OVER (ORDER BY x.o))::integer, n.id, n.external_id,
           encode(n.sha256, 'hex'),
           coalesce(CASE WHEN pid IS NOT NULL THEN project_name END,
                    (SELECT p.name FROM memory.projects p WHERE p.id = n.project_id)),
           n.title, n.text, n.source, n.breadcrumb, n.ts,
           x.s, x.pos, x.by_rank,
           x.beside, n.metadata, n.revision,
           -- a result's source rewritten since it was derived (issue 40): cited as the
           -- version the claim rested on, marked
           CASE WHEN as_of IS NULL THEN n.expired_at IS NOT NULL
                ELSE n.expired_at IS NOT NULL AND n.expired_at <= as_of END
    -- Typed columns (a cast such as (v ->> 'id')::bigint in the join is not leakproof, so
    -- under row-level security it could not reach the index and every row of the project
    -- would be read; the same in memory._run_legs' floor).
    FROM ((SELECT c.* FROM unnest(cands) WITH ORDINALITY
                  AS c(id, s, pos, by_rank, beside, project_id, title, o)
           WHERE c.id = ANY (reserved))
          UNION ALL
          (SELECT c.* FROM unnest(cands) WITH ORDINALITY
                  AS c(id, s, pos, by_rank, beside, project_id, title, o)
           WHERE c.id <> ALL (reserved)
           ORDER BY c.o LIMIT lim - cardinality(reserved))) x
    JOIN memory.nodes n ON n.id = x.id AND (pid IS NULL OR n.project_id = pid)
    ORDER BY x.o;
END $$;
COMMENT ON FUNCTION memory.select_evidence(bigint[], jsonb, jsonb, text, integer, text, integer, timestamptz, timestamptz, double precision, integer, jsonb, timestamptz, bigint[], text, timestamptz) IS
    'The L0 turns an answer cites, best first, at most budget (default memory.policy() evidence_budget; 0: none): the L0 provenance of result_ids (the results in rank order, walked max_depth levels) and the direct L0 legs the caller ran ({"ids":[..],"scores":[..]}, fused as a Hybrid pair by memory.fuse_legs with fusion, dense_weight and rrf_k, each NULL: the policy). Each turn scores its direct match over the best plus evidence_weight / sqrt(rank) summed over the results citing it; then every turn gains evidence_neighbours times the scores of the candidates just before and after it in its session (same project and title, nearest in ingest order within 64 ids; neighbour_score is that part). since/before (since <= ts < before) keep direct matches and neighbours in range, and filter (a JSON object the metadata contains) the neighbours as the legs it ran did their matches; a result''s own sources are cited whatever their time or metadata; as_of: provenance and neighbours as the database held them then (NULL: current versions); valid_at: the neighbours (and the deeper candidates'' citations and the second hop) hold in valid time where the legs tested it (memory._valid_at: valid_at, else as_of, else now where the project has bounded nodes). Turns scoring 0 are left out. direct_rank is the turn''s rank among the direct matches (NULL: not one), cited_by the ranks of the results whose provenance reaches it; revision is the cited version''s, superseded true when a result rests on a version of the turn rewritten since (memory._rests_on). Issue 29''s policy keys: deeper (candidates after the results, memory._deeper) cite at the ranks after the results'' without reserving a turn; evidence_session_weight lifts a direct match in a session the results'' provenance reaches by that weight times its direct score times the session''s 1 / sqrt(rank) sum; evidence_hop_weight (off) adds a second lexical query of the names in the evidence_hop_seeds best turns; evidence_session_decay (off at 1) spends the budget at score times decay^(better turns of the same session); evidence_speaker_weight (0.5) multiplies by 1 + the weight the score of a turn whose text opens with a label ("Ana: ...") that is a word of query (the question''s text; NULL: no speaker term), when more than half of the evidence_speaker_seeds (10) best candidates carry such a label (not necessarily the same one).';

-- The fused candidates after an answer's results (issue 29): their provenance routes the
-- budget to the memories and sessions just below the page, at the ranks after the results'.
CREATE OR REPLACE FUNCTION memory._deeper(plan jsonb, state jsonb, ids bigint[])
RETURNS bigint[]
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    deep integer := (SELECT pol.evidence_deeper FROM memory.policy() pol);
    need integer := coalesce(cardinality(ids), 0) + deep;
    fused_n integer := jsonb_array_length(state -> 'fused_order');
BEGIN
    IF deep = 0 OR plan ->> 'search_strategy' IS NULL THEN
        RETURN '{}';
    END IF;
    -- The fusion memory._run_legs made (the same legs and arguments) holds the first need
    -- candidates when it went that deep, or when it held them all (fewer than its cut):
    -- its prefix is what fusing again to need would give. Not for a LexicalFirst cascade:
    -- memory.fuse_legs drops the ids its by-ids stage did not rank after the cut, so its
    -- list is neither a prefix of a deeper one nor short only when it holds them all.
    IF plan ->> 'search_strategy' <> 'LexicalFirst'
       AND (fused_n >= need OR fused_n < (state ->> 'fused_cut')::integer) THEN
        RETURN ARRAY(
            SELECT x.id
            FROM jsonb_array_elements_text(state -> 'fused_order') WITH ORDINALITY AS f(v, o),
                 LATERAL (SELECT f.v::bigint AS id) x
            WHERE f.o <= need
              AND x.id <> ALL (coalesce(ids, '{}'))
              AND x.id <> ALL (ARRAY(SELECT jsonb_array_elements_text(coalesce(state -> 'withheld_ids', '[]'))::bigint))
            ORDER BY f.o
            LIMIT deep);
    END IF;
    RETURN ARRAY(
        SELECT f.node_id
        FROM memory.fuse_legs(coalesce(state -> 'semantic', '{"ids":[],"scores":[]}'),
                              coalesce(state -> 'lexical', '{"ids":[],"scores":[]}'),
                              plan ->> 'search_strategy', plan ->> 'fusion',
                              (plan ->> 'dense_weight')::double precision,
                              (plan ->> 'rrf_k')::integer, coalesce(cardinality(ids), 0) + deep) f
        WHERE f.node_id <> ALL (coalesce(ids, '{}'))
          -- what the relevance floor held back is not cited (memory._after_fusion)
          AND f.node_id <> ALL (ARRAY(SELECT jsonb_array_elements_text(coalesce(state -> 'withheld_ids', '[]'))::bigint))
        ORDER BY f.fused_score DESC, least(f.ranks[1], f.ranks[2]), f.node_id
        LIMIT deep);
END $$;
COMMENT ON FUNCTION memory._deeper(jsonb, jsonb, bigint[]) IS
    'The fused candidates of a plan''s legs (memory._run_legs'' state) after the results ids, best first, at most memory.policy() evidence_deeper of them (0: none): memory.select_evidence cites their provenance at the ranks after the results''. Fused as the answer was, without recency; the candidates the relevance floor held back (state withheld_ids) are left out: what the answer does not show, it does not cite.';

-- memory.evidence runs the plan memory.query runs (the evidence legs it names) for the
-- SQL user's results.
CREATE OR REPLACE FUNCTION memory._evidence(
    p_query text, p_result_ids bigint[], p_embedding vector, p_project text, p_budget integer,
    p_since text, p_until text, p_fusion text, p_levels text[], p_strategy text,
    p_candidates integer, p_dense_weight double precision, p_rrf_k integer,
    p_reference_time timestamptz, p_filter jsonb, p_as_of timestamptz, p_valid_at timestamptz
)
RETURNS SETOF memory.evidence_row
LANGUAGE plpgsql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    p record;
    state jsonb;
BEGIN
    IF $2 IS NULL THEN
        RAISE EXCEPTION 'result_ids must not be NULL'
            USING ERRCODE = '22023', HINT = 'Pass the results in rank order, e.g. ARRAY(SELECT node_id FROM memory_query(...) ORDER BY rank), or ''{}''.';
    END IF;
    IF memory.check_evidence_budget(coalesce($5, (SELECT pol.evidence_budget FROM memory.policy() pol))) = 0 THEN
        RETURN;  -- off costs no plan, embedding or search
    END IF;
    -- k does not change the evidence: the plan's own check wants one.
    SELECT * INTO p FROM memory._prepare(
        memory._request($1, $4, $9, 5, $10, $8, $13, $11, $12, $6, $7, $14, memory.check_evidence_budget(
            coalesce($5, (SELECT pol.evidence_budget FROM memory.policy() pol))))
          || jsonb_build_object('filter', $15, 'as_of', $16, 'valid_at', $17),
        $3, 'memory.evidence');
    IF (p.plan -> 'evidence' ->> 'budget')::integer = 0 THEN
        RETURN;  -- off costs no search
    END IF;
    -- The answer's own legs too when the policy cites deeper candidates (memory._deeper).
    state := memory._run_legs(p.plan, p.embedding, NULL,
                              (SELECT pol.evidence_deeper > 0 FROM memory.policy() pol));
    IF cardinality($2) = 0 AND jsonb_array_length(state -> 'fused') = 0
       AND (state ->> 'withheld')::integer > 0 THEN
        -- no results, and the relevance floor withheld the whole page this plan makes: no
        -- answer cites no evidence, as memory.answer's (no results passed otherwise: the
        -- direct legs alone)
        RETURN;
    END IF;
    RETURN QUERY
    SELECT e.* FROM memory.select_evidence(
        $2, state -> 'evidence_semantic', state -> 'evidence_lexical', p.plan ->> 'fusion',
        (p.plan -> 'evidence' ->> 'budget')::integer, $4, 4,
        (p.plan ->> 'since_ts')::timestamptz, (p.plan ->> 'before_ts')::timestamptz,
        (p.plan ->> 'dense_weight')::double precision, (p.plan ->> 'rrf_k')::integer,
        nullif(p.plan -> 'filter', 'null'), (p.plan ->> 'as_of')::timestamptz,
        memory._deeper(p.plan, state, $2), $1, (p.plan ->> 'valid_at')::timestamptz) e
    ORDER BY e.rank;
END $$;
COMMENT ON FUNCTION memory._evidence(text, bigint[], vector, text, integer, text, text, text, text[], text, integer, double precision, integer, timestamptz, jsonb, timestamptz, timestamptz) IS
    'Implementation of memory.evidence (positional parameters: PL/pgSQL forbids a parameter named like a result column; call memory.evidence instead).';

CREATE OR REPLACE FUNCTION memory.evidence(
    query text,
    result_ids bigint[],
    query_embedding vector DEFAULT NULL,
    project text DEFAULT NULL,
    budget integer DEFAULT NULL,
    since text DEFAULT NULL,
    until text DEFAULT NULL,
    fusion text DEFAULT NULL,
    levels text[] DEFAULT ARRAY['L1', 'L2'],
    strategy text DEFAULT NULL,
    candidates integer DEFAULT NULL,
    dense_weight double precision DEFAULT NULL,
    rrf_k integer DEFAULT NULL,
    reference_time timestamptz DEFAULT NULL,
    filter jsonb DEFAULT NULL,
    as_of timestamptz DEFAULT NULL,
    valid_at timestamptz DEFAULT NULL
)
RETURNS SETOF memory.evidence_row
LANGUAGE sql STABLE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT * FROM memory._evidence(query, result_ids, query_embedding, project, budget, since,
                                   until, fusion, levels, strategy, candidates, dense_weight,
                                   rrf_k, reference_time, filter, as_of, valid_at);
END;
COMMENT ON FUNCTION memory.evidence(text, bigint[], vector, text, integer, text, text, text, text[], text, integer, double precision, integer, timestamptz, jsonb, timestamptz, timestamptz) IS
    'The L0 evidence of an answer, for SQL users: pass the query and memory.query''s result ids in rank order (its embedding too, or it embeds again) with the same arguments memory.query had (filter: the same metadata filter, which the direct L0 legs then apply as memory.query''s legs do; as_of and valid_at: the same instants, so the direct legs, the provenance and the neighbours are the versions held then and valid then, as in memory.answer; not min_cosine, which holds back results, the page the caller passes, and no evidence leg reads). It plans as memory.query does (the same route, fusion and time range, dates the optimizer extracts included under extracted_dates = filter), runs the direct L0 legs that plan names (lexical unless SemanticOnly, semantic unless LexicalOnly; each evidence_candidates deep) and returns memory.select_evidence: the list GET /memory/query and memory.answer return as "evidence". budget NULL: the policy''s evidence_budget; 0: none.';
