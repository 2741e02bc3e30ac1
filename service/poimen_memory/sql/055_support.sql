-- Support (issue 40): a derived node rests on the parent versions it was written with, and
-- is only as true as they are. One definition, read by every reader (query results and
-- their demotion, memory.get_node, memory.list_nodes, memory.support, forget's cascade and
-- the review queue), evaluated at any instant of transaction time (as_of) and valid time.
--
-- A parent is an external id (a node without one: its row). The version a child rests on
-- is the newest version of that id it has an edge to (a database from before issue 40 also
-- holds the edges the writer added to newer versions; the newest wins, so those still read
-- as current). At an instant T (NULL: now) that version is
--   current     visible at T (created_at <= T < expired_at, not erased) and valid at the
--               valid-time instant when one is tested;
--   superseded  not visible at T, while another version of the id is: the evidence was
--               rewritten after the claim was derived from it;
--   retired / erased  the id has no version visible at T;
--   invalid     visible, but not valid at the valid-time instant.
-- A node's support then combines its parents', a derived parent counting with its own:
--   full     every parent it was written with is current and itself full (or evidence);
--   stale    none is gone, but one was superseded, or rests on a superseded one below it;
--   partial  some parents are gone (retired, erased, invalid, never resolved), or partial;
--   none     every parent is gone;
--   NULL     the node was written without parents (evidence, or an underived memory).

CREATE OR REPLACE FUNCTION memory._rested_parents(
    ids bigint[], as_of timestamptz DEFAULT NULL, valid_at timestamptz DEFAULT NULL
)
RETURNS TABLE (child_id bigint, parent_id bigint, external_id text, level text,
               revision integer, precedence integer, state text, current_id bigint,
               current_revision integer)
-- PL/pgSQL: it keeps its plan for the session (every answer calls it, and a page of
-- memory.list_nodes once per node). One generic plan: a custom plan was made at every call
-- (the planner found the generic one dearer), and planning, not running, was most of the
-- call's time (1.1 ms of it on a loaded machine, and twice that once memory._visible is
-- inlined into it three times; 0.1 ms with the one plan; every lookup is by key).
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET plan_cache_mode = force_generic_plan
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    -- visible: held at as_of (NULL: current) and not expired then (an expired node,
    -- migration 0021, has left answers: it supports nothing); valid: in valid time at valid_at
    held memory.visibility := memory._versions_at(as_of);
    in_valid_time memory.visibility := memory._visibility(every_version => true, valid_at => valid_at);
BEGIN
    RETURN QUERY
    WITH rested AS (
        SELECT DISTINCT ON (e.child_id, coalesce(p.external_id, '#' || p.id))
               e.child_id, p.id, p.project_id, p.external_id, p.level, p.revision, e.precedence,
               memory._visible(p, held) AS visible,
               memory._visible(p, in_valid_time) AS valid,
               p.erased_at IS NOT NULL AS erased,
               p.expires_at <= coalesce(as_of, now()) AND p.expired_at IS NULL AS expired
        FROM unnest(ids) AS r(id)
        JOIN memory.edges e ON e.child_id = r.id
        JOIN memory.nodes p ON p.id = e.parent_id AND p.project_id = e.project_id
        -- as of an instant: the versions and the edges that existed then (an edge a review's
        -- confirmation added later, memory._rest_on_current, is not the past's)
        WHERE as_of IS NULL OR (p.created_at <= as_of AND (e.linked_at IS NULL OR e.linked_at <= as_of))
        ORDER BY e.child_id, coalesce(p.external_id, '#' || p.id), p.revision DESC
    )
    SELECT r.child_id, r.id, r.external_id, r.level, r.revision, r.precedence,
           CASE WHEN r.visible AND r.valid THEN 'current'
                WHEN r.visible THEN 'invalid'
                WHEN c.id IS NOT NULL THEN 'superseded'
                WHEN r.erased THEN 'erased'
                WHEN r.expired THEN 'expired'
                ELSE 'retired' END,
           CASE WHEN r.visible THEN r.id ELSE c.id END,
           CASE WHEN r.visible THEN r.revision ELSE c.revision END
    FROM rested r
    -- Only for a version that is no longer visible (rare): the id's visible version, by the
    -- index of current versions (now) or of revisions (as_of).
    LEFT JOIN LATERAL (
        SELECT v.id, v.revision FROM memory.nodes v
        WHERE NOT r.visible AND r.external_id IS NOT NULL
          AND v.external_id = r.external_id AND v.project_id = r.project_id
          AND memory._visible(v, held)
        ORDER BY v.revision DESC LIMIT 1) c ON true;
END $$;
COMMENT ON FUNCTION memory._rested_parents(bigint[], timestamptz, timestamptz) IS
    'The parents each node rests on, one row per parent (external id): the newest version it has an edge to (parent_id, revision), its state at as_of (NULL: now) and valid_at (NULL: no valid-time test): current, superseded (another version of the id is visible: current_id, current_revision), retired, erased, expired (its expires_at has passed; the id has no visible version) or invalid (visible, not valid at valid_at). As of an instant, only the edges linked by then count (edges.linked_at).';

-- One parent a node rests on (memory._rested_parents' row), held by memory._support_at
-- between its statements in an array of this type rather than a JSON document: the JSON
-- round trip (to_jsonb of each row, then ->> and a cast at every read) cost an answer about
-- half a millisecond (issue 42).
SELECT memory._declare_row('rested_parent',
    'child_id bigint, parent_id bigint, external_id text, level text, revision integer, precedence integer, state text, current_id bigint, current_revision integer');

CREATE OR REPLACE FUNCTION memory._support_at(
    ids bigint[], as_of timestamptz DEFAULT NULL, valid_at timestamptz DEFAULT NULL,
    depth integer DEFAULT 4
)
RETURNS TABLE (node_id bigint, support text, parents integer, supporting integer,
               changed_parents jsonb)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    rp memory.rested_parent[];
    derived bigint[];
    below jsonb := '{}';
BEGIN
    IF ids IS NULL OR cardinality(ids) = 0 THEN
        RETURN;
    END IF;
    rp := ARRAY(SELECT r::memory.rested_parent FROM memory._rested_parents(ids, as_of, valid_at) r);
    -- The derived parents that are there: their own support counts (L2 over L1 over L0).
    -- A rewritten derived parent counts with the version the node rests on: what was
    -- forgotten below that version is gone for the node too (stale at best).
    derived := ARRAY(SELECT DISTINCT CASE x.state WHEN 'current' THEN x.current_id ELSE x.parent_id END
                     FROM unnest(rp) x
                     WHERE x.state IN ('current', 'superseded') AND x.level <> 'L0');
    IF cardinality(derived) > 0 AND depth > 1 THEN
        SELECT coalesce(jsonb_object_agg(s.node_id::text, s.support), '{}') INTO below
          FROM memory._support_at(derived, as_of, valid_at, depth - 1) s
         WHERE s.support IS NOT NULL;
    END IF;
    RETURN QUERY
    WITH p AS (
        SELECT x.child_id, x.external_id, x.revision, x.current_revision, x.state, x.precedence,
               -- what this parent does to its child
               CASE x.state
                    WHEN 'current' THEN CASE below ->> x.current_id::text
                                            WHEN 'stale' THEN 'stale'
                                            WHEN 'partial' THEN 'partial'
                                            WHEN 'none' THEN 'gone'
                                            ELSE 'ok' END
                    WHEN 'superseded' THEN CASE below ->> x.parent_id::text
                                               WHEN 'partial' THEN 'partial'
                                               WHEN 'none' THEN 'gone'
                                               ELSE 'stale' END
                    ELSE 'gone' END AS effect,
               below ->> x.current_id::text AS parent_support
        FROM unnest(rp) x
    ),
    agg AS (
        SELECT p.child_id,
               count(*) FILTER (WHERE p.effect <> 'gone')::integer AS there,
               count(*) FILTER (WHERE p.effect = 'stale') AS stale,
               count(*) FILTER (WHERE p.effect = 'partial') AS partial,
               jsonb_agg(jsonb_build_object(
                   'external_id', p.external_id, 'revision', p.revision,
                   'current_revision', p.current_revision,
                   -- a current parent in doubt itself says so (stale, partial, none)
                   'state', CASE WHEN p.state = 'current' THEN p.parent_support ELSE p.state END)
                   ORDER BY p.precedence, p.external_id) FILTER (WHERE p.effect <> 'ok') AS changed
        FROM p GROUP BY p.child_id
    )
    SELECT n.id,
           CASE WHEN greatest(n.parents_declared, coalesce(a.there, 0)) = 0
                     AND a.child_id IS NULL THEN NULL
                WHEN coalesce(a.there, 0) = 0 THEN 'none'
                WHEN a.there < n.parents_declared OR a.partial > 0 THEN 'partial'
                WHEN a.stale > 0 THEN 'stale'
                ELSE 'full' END,
           n.parents_declared, coalesce(a.there, 0), a.changed
    FROM unnest(ids) WITH ORDINALITY AS r(id, ord)
    JOIN memory.nodes n ON n.id = r.id
    LEFT JOIN agg a ON a.child_id = n.id
    ORDER BY r.ord;
END $$;
COMMENT ON FUNCTION memory._support_at(bigint[], timestamptz, timestamptz, integer) IS
    'The support of each node at as_of (NULL: now) and valid_at (NULL: no valid-time test), from the parents it rests on (memory._rested_parents), transitively: full, stale (a parent, or one further down, was superseded), partial (some parents gone or partial), none (every parent gone), NULL (written without parents). parents: the parents it was written with; supporting: those still there; changed_parents: the parents that are not full and current, [{external_id, revision (the version it rests on), current_revision (NULL: gone), state}]. depth bounds the recursion through derived parents.';

-- The instant support tests valid time at: the caller's valid_at only, never a default
-- (not now, not as_of): a claim derived from a fact whose valid time has ended is no less
-- supported for it, and an answer as_of now must say what an answer without as_of says.
CREATE OR REPLACE FUNCTION memory._support_valid_at(plan jsonb)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN (plan ->> 'valid_at')::timestamptz;
COMMENT ON FUNCTION memory._support_valid_at(jsonb) IS
    'The valid-time instant an answer''s support is evaluated at: the valid_at the caller gave, else none (support is about what the store holds, not about when facts held).';

-- Is a parent version one the child still cites? Its current version, or the version the
-- child rests on when the id has been rewritten since (marked superseded where shown). Only
-- called for a version that is not current (rare), from the provenance walk and forest.
CREATE OR REPLACE FUNCTION memory._cites_superseded(
    child_id bigint, parent_id bigint, as_of timestamptz DEFAULT NULL
)
RETURNS boolean
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    held memory.visibility := memory._versions_at(as_of);
BEGIN
    -- The same rule as memory._rested_parents' superseded state, for one edge, in two index
    -- probes: no edge of the child to a newer version of the id (a database from before
    -- issue 40 has one for every relinked parent), and a version of the id visible then.
    RETURN EXISTS (
        SELECT 1 FROM memory.nodes p
        WHERE p.id = parent_id AND p.external_id IS NOT NULL AND p.erased_at IS NULL
          AND NOT EXISTS (
              SELECT 1 FROM memory.edges e
              JOIN memory.nodes v ON v.id = e.parent_id AND v.project_id = e.project_id
              WHERE e.child_id = child_id AND e.project_id = p.project_id
                AND v.external_id = p.external_id AND v.revision > p.revision
                AND (as_of IS NULL OR (v.created_at <= as_of
                                       AND (e.linked_at IS NULL OR e.linked_at <= as_of))))
          AND EXISTS (
              SELECT 1 FROM memory.nodes v
              WHERE v.external_id = p.external_id AND v.project_id = p.project_id
                AND memory._visible(v, held)));
END $$;
COMMENT ON FUNCTION memory._cites_superseded(bigint, bigint, timestamptz) IS
    'Whether child_id still cites parent_id although it is not the visible version at as_of (NULL: now): the version the child rests on, superseded since by another version of the same id (memory._rested_parents).';

-- Does child_id rest on parent version p (a memory.nodes row) through an edge linked at
-- linked_at, as the database held it at as_of (NULL: now)? The edge was linked by then;
-- p has not expired then (alive, from
-- memory._visibility(every_version => true, live_at => coalesce(as_of, now()))), and is
-- the version held then (known, memory._visibility(as_of => as_of)) or a version rewritten
-- since that the child still cites (memory._cites_superseded). The one rule of every walk
-- (sql/050_provenance.sql); inlined by the planner (LANGUAGE sql, no SET clause:
-- migrate.INLINED), so the edge's test stays on the edge's scan and the node's on the
-- node's. p is polymorphic, as in memory._visible, and the edge's two columns are
-- arguments: a body is checked against a table's row type when it is created, and this
-- file is also applied over older migrations (tests/test_migrations.py), whose edges have
-- no linked_at.
CREATE OR REPLACE FUNCTION memory._rests_on(
    p anyelement, child_id bigint, linked_at timestamptz, as_of timestamptz,
    known memory.visibility, alive memory.visibility
)
RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
SELECT (as_of IS NULL OR linked_at IS NULL OR linked_at <= as_of)
   AND memory._visible(p, alive)
   AND (memory._visible(p, known)
        OR ((p).end_reason = 'superseded' AND (p).erased_at IS NULL
            AND memory._cites_superseded(child_id, (p).id, as_of)))
$$;
COMMENT ON FUNCTION memory._rests_on(anyelement, bigint, timestamptz, timestamptz, memory.visibility, memory.visibility) IS
    'Whether child_id rests on parent version p (a memory.nodes row) through an edge linked at linked_at, at as_of (NULL: now): the edge linked by then, p alive then (alive: memory._visibility(every_version => true, live_at => coalesce(as_of, now()))) and either the version held then (known: memory._visibility(as_of => as_of)) or one rewritten since that the child still cites (memory._cites_superseded). The rule of memory.provenance_walk, memory._provenance_reach and memory.provenance_forest; inlined by the planner.';
