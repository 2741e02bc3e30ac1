-- What a caller may see (issue 41): one typed value, memory.visibility, and one predicate,
-- memory._visible(node, visibility), that every leg, walk and listing tests its node rows
-- with. The rules a row passes (transaction time, valid time, expiry, project, levels, the
-- time window, the metadata filter, the query grammar) are written here once: a new filter
-- is a field of the type and a line of the predicate, and every caller has it.
--
-- The value is built once per statement (memory._visibility, or memory._leg_visibility for
-- the search legs, which default the valid-time instant) and handed to the statement as one
-- parameter. memory._visible is a SQL function of one expression, so PostgreSQL inlines it
-- into the statement: the parameter is a constant there (PL/pgSQL passes its variables, and
-- EXECUTE ... USING its arguments, as constants to a custom plan), every "field IS NULL OR"
-- folds away, and the planner sees the plain quals it saw when each leg wrote them out
-- (n.expired_at IS NULL for the current versions, n.metadata @> '{...}', n.level = ANY
-- ('{L1,L2}')), so the partial indexes (the L1/L2 HNSW graph, the current versions' GIN
-- index of metadata, nodes_valid_bounded) still serve them.

-- The type, created when missing. A row type holds no data, but functions take it: a change
-- of its shape is a run-once migration (drop it and its functions; sql/ makes them again),
-- as any signature change is (migrations/0022_drop_old_signatures.sql).
SELECT memory._declare_row('visibility',
    'project_id integer, levels text[], since timestamptz, before timestamptz, filter jsonb, '
    'ex_tsq tsquery, ex_re text, req_tsq tsquery[], req_re text[], '
    'as_of timestamptz, every_version boolean, valid_at timestamptz, live_at timestamptz');

-- A node passes the required groups of a query's grammar (memory._grammar_compile): for
-- each group i, its tsquery or its regex matches. A loop, so not in the predicate itself
-- (an inlined function may hold no subquery); called only when the query requires anything.
CREATE OR REPLACE FUNCTION memory._grammar_required(
    tsv tsvector, title text, breadcrumb text[], body text, req_tsq tsquery[], req_re text[]
)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    doc text;  -- memory._grammar_doc, made at most once, when a tsquery does not settle it
BEGIN
    FOR i IN 1 .. coalesce(cardinality(req_tsq), 0) LOOP
        CONTINUE WHEN coalesce(tsv @@ req_tsq[i], false);
        IF req_re[i] IS NOT NULL THEN
            doc := coalesce(doc, memory._grammar_doc(title, breadcrumb, body));
            CONTINUE WHEN doc ~* req_re[i];
        END IF;
        RETURN false;
    END LOOP;
    RETURN true;
END $$;

-- The predicate. LANGUAGE sql, one expression, IMMUTABLE (it reads its two arguments only:
-- every operator in it is immutable), neither STRICT nor SECURITY DEFINER, and without
-- SET search_path: PostgreSQL inlines no function that carries a SET clause, so this one
-- (one of the few such functions, migrate.INLINED: migrate leaves them unpinned, and
-- tests/test_sql_hygiene.py allows exactly those) names everything it calls
-- schema-qualified instead, and its operators are pg_catalog's (found first in any
-- search_path).
--   as_of NULL: the current versions (expired_at IS NULL, the predicate of the partial
--     indexes); as_of t: the versions the database held at t (created_at <= t < expired_at)
--     that are not erased; every_version: no transaction-time test at all;
--   valid_at t: valid_from <= t < valid_to (a NULL bound is open); live_at t: t < expires_at;
--   project_id, levels, since <= ts < before (a node without ts fails a bound), metadata @>
--     filter, and the grammar's compiled exclusions and required groups.
-- Every field NULL is no test.
-- n is anyelement, not memory.nodes: a function taking the table's row type is bound to
-- that table (memory.partition_by_project replaces the table, and a RETURN clause naming
-- it would make PostgreSQL refuse configure_embedding's ALTER TABLE ... TYPE). Called with
-- a node row it is resolved (and inlined) against memory.nodes' columns where it is used;
-- PostgreSQL checks a polymorphic SQL body there, not when it is made, so sql/ makes it on
-- a schema between migrations too (before valid_from, 0018, or expires_at, 0021).
CREATE OR REPLACE FUNCTION memory._visible(n anyelement, v memory.visibility)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
SELECT CASE WHEN (v).every_version THEN true
            WHEN (v).as_of IS NULL THEN (n).expired_at IS NULL
            ELSE (n).created_at <= (v).as_of
                 AND ((n).expired_at IS NULL OR (n).expired_at > (v).as_of)
                 AND (n).erased_at IS NULL END
   AND ((v).valid_at IS NULL OR (((n).valid_from IS NULL OR (n).valid_from <= (v).valid_at)
                                 AND ((n).valid_to IS NULL OR (n).valid_to > (v).valid_at)))
   AND ((v).live_at IS NULL OR (n).expires_at IS NULL OR (n).expires_at > (v).live_at)
   AND ((v).project_id IS NULL OR (n).project_id = (v).project_id)
   AND ((v).levels IS NULL OR (n).level = ANY ((v).levels))
   AND ((v).since IS NULL OR (n).ts >= (v).since)
   AND ((v).before IS NULL OR (n).ts < (v).before)
   AND ((v).filter IS NULL OR (n).metadata @> (v).filter)
   AND ((v).ex_tsq IS NULL OR NOT (n).tsv @@ (v).ex_tsq)
   AND ((v).ex_re IS NULL
        OR NOT memory._grammar_doc((n).title, (n).breadcrumb, (n).text) ~* (v).ex_re)
   AND ((v).req_tsq IS NULL
        OR memory._grammar_required((n).tsv, (n).title, (n).breadcrumb, (n).text,
                                    (v).req_tsq, (v).req_re))
$$;

-- A visibility with a query's grammar (a memory.parse_query parse, or its
-- memory._grammar_constraints; NULL: none) compiled into it once (memory._grammar_compile),
-- replacing the grammar it had: the one place a parse becomes the fields the predicate tests.
CREATE OR REPLACE FUNCTION memory._with_grammar(v memory.visibility, grammar jsonb)
RETURNS memory.visibility
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cons jsonb := CASE WHEN grammar IS NOT NULL THEN memory._grammar_constraints(grammar) END;
    gc record;
BEGIN
    v.ex_tsq := NULL;
    v.ex_re := NULL;
    v.req_tsq := NULL;
    v.req_re := NULL;
    IF cons IS NOT NULL THEN
        gc := memory._grammar_compile(cons);
        v.ex_tsq := gc.ex_tsq;
        v.ex_re := gc.ex_re;
        -- NULL when no group is required, so the predicate's test folds away
        IF cardinality(gc.req_tsq) > 0 THEN
            v.req_tsq := gc.req_tsq;
            v.req_re := gc.req_re;
        END IF;
    END IF;
    RETURN v;
END $$;

-- The value, checked: levels (memory.check_levels), filter (memory.check_filter: NULL for
-- none) and grammar (memory._with_grammar). Every argument is optional and named, so a
-- caller says only what it tests: memory._visibility(as_of => t) is "the versions held at
-- t". No instant is defaulted here: memory._leg_visibility does that for the search legs.
CREATE OR REPLACE FUNCTION memory._visibility(
    project_id integer DEFAULT NULL,
    levels text[] DEFAULT NULL,
    since timestamptz DEFAULT NULL,
    before timestamptz DEFAULT NULL,
    filter jsonb DEFAULT NULL,
    grammar jsonb DEFAULT NULL,
    as_of timestamptz DEFAULT NULL,
    every_version boolean DEFAULT NULL,
    valid_at timestamptz DEFAULT NULL,
    live_at timestamptz DEFAULT NULL
)
RETURNS memory.visibility
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v memory.visibility;
BEGIN
    -- Cheap when a part is absent (no call for it): support and provenance build one per
    -- call, and some of them run once per node of a page.
    v.project_id := project_id;
    v.levels := CASE WHEN levels IS NOT NULL THEN memory.check_levels(levels) END;
    v.since := since;
    v.before := before;
    v.filter := CASE WHEN filter IS NOT NULL THEN memory.check_filter(filter) END;
    v.as_of := as_of;
    v.every_version := every_version;
    v.valid_at := valid_at;
    v.live_at := live_at;
    IF grammar IS NOT NULL THEN
        v := memory._with_grammar(v, grammar);
    END IF;
    RETURN v;
END $$;

-- The visibility of a search leg (lexical, semantic, by ids, exact, the evidence's direct
-- legs and neighbours): as_of and valid_at checked (memory.check_instant) and valid time
-- and expiry tested at memory._valid_at's instant: valid_at, else as_of, else now where the
-- project holds a node with a bounded valid time or an expiry (NULL: no test).
CREATE OR REPLACE FUNCTION memory._leg_visibility(
    project_id integer, levels text[], since timestamptz, before timestamptz,
    filter jsonb DEFAULT NULL, grammar jsonb DEFAULT NULL,
    as_of timestamptz DEFAULT NULL, valid_at timestamptz DEFAULT NULL
)
RETURNS memory.visibility
-- STABLE: memory._valid_at reads memory.nodes.
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    lv text[] := memory.check_levels(levels);
    flt jsonb := CASE WHEN filter IS NOT NULL THEN memory.check_filter(filter) END;
    va timestamptz := memory._valid_at(project_id, memory.check_instant(as_of, 'as_of'),
                                       memory.check_instant(valid_at, 'valid_at'));
BEGIN
    RETURN memory._visibility(project_id => project_id, levels => lv, since => since,
                              before => before, filter => flt, grammar => grammar,
                              as_of => as_of, valid_at => va, live_at => va);
END $$;

-- Whether a visibility tests nothing but the project and the levels, of the current
-- versions: no past (as_of, every_version), valid time, expiry, time window, metadata filter
-- or grammar. A statement made for such a visibility alone can state its tests as plain
-- quals and keep one plan for every value (memory._vector_stage).
CREATE OR REPLACE FUNCTION memory._current_only(v memory.visibility)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN v.as_of IS NULL AND NOT coalesce(v.every_version, false) AND v.valid_at IS NULL
       AND v.live_at IS NULL AND v.since IS NULL AND v.before IS NULL AND v.filter IS NULL
       AND v.ex_tsq IS NULL AND v.ex_re IS NULL AND v.req_tsq IS NULL AND v.req_re IS NULL;

-- The versions an answer's provenance and support rest on at as_of (NULL: now): visible
-- then, and not past their expiry at that instant.
CREATE OR REPLACE FUNCTION memory._versions_at(as_of timestamptz)
RETURNS memory.visibility
-- PL/pgSQL, not SQL: PostgreSQL 15 plans a SQL function's body at every call, and support
-- calls this once per node it judges.
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN memory._visibility(as_of => as_of, live_at => coalesce(as_of, now()));
END $$;

COMMENT ON FUNCTION memory._grammar_required(tsvector, text, text[], text, tsquery[], text[]) IS
    'Whether a node (its tsvector, and its title, breadcrumb and text for memory._grammar_doc) satisfies every required group of a compiled grammar (memory._grammar_compile: req_tsq[i] or req_re[i] matches). Called by memory._visible.';
COMMENT ON FUNCTION memory._visible(anyelement, memory.visibility) IS
    'Whether node row n (a memory.nodes row) passes the visibility v: transaction time (as_of; NULL: current versions; every_version: no test), valid time (valid_at), expiry (live_at), project, levels, since <= ts < before, metadata @> filter and the compiled grammar. The one predicate of every leg; inlined by the planner (LANGUAGE sql, no SET clause), so its tests reach the indexes.';
COMMENT ON FUNCTION memory._with_grammar(memory.visibility, jsonb) IS
    'The visibility v with grammar (a memory.parse_query parse or its constraints; NULL: none) compiled into its grammar fields, replacing theirs.';
COMMENT ON FUNCTION memory._visibility(integer, text[], timestamptz, timestamptz, jsonb, jsonb, timestamptz, boolean, timestamptz, timestamptz) IS
    'A memory.visibility from named, optional parts: levels and filter checked (22023), grammar compiled; no instant defaulted (memory._leg_visibility does that for the search legs).';
COMMENT ON FUNCTION memory._leg_visibility(integer, text[], timestamptz, timestamptz, jsonb, jsonb, timestamptz, timestamptz) IS
    'The visibility of a search leg: memory._visibility with as_of and valid_at checked (memory.check_instant) and valid time and expiry tested at memory._valid_at''s instant (valid_at, else as_of, else now where the project has bounded nodes; NULL: no test).';
COMMENT ON FUNCTION memory._versions_at(timestamptz) IS
    'The visibility of the versions provenance and support rest on at as_of (NULL: now): held then and not past their expiry then.';
COMMENT ON FUNCTION memory._current_only(memory.visibility) IS
    'Whether visibility v tests only the project and levels of the current versions (no as_of, every_version, valid_at, live_at, since, before, filter or grammar field set).';
