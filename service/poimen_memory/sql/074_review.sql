-- The review queue (issue 40, migration 0019): the derived nodes a change put in doubt, for
-- workers (a person, the agent's own model, a job) to rewrite or confirm. The writer and
-- forget fill it (memory._review_changes); workers list, claim and confirm (pgmq's model:
-- a claim hides an item for a visibility timeout, FOR UPDATE SKIP LOCKED, so concurrent
-- workers never get the same item and a worker that dies loses nothing). Writing a new
-- version of the node completes its item (rewritten); so does retiring it (retired).

CREATE OR REPLACE FUNCTION memory._review_changes(ended bigint[], who text)
RETURNS integer
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    frontier bigint[] := ended;
    seen bigint[] := '{}';
    kids bigint[];
    opened integer := 0;
    n integer;
BEGIN
    IF ended IS NULL OR cardinality(ended) = 0 THEN
        RETURN 0;
    END IF;
    -- The ended versions' own items are done: a new version was written, or the node left.
    UPDATE memory.review_queue q
       SET completed_at = now(), completed_by = who,
           outcome = CASE WHEN v.end_reason = 'superseded' THEN 'rewritten' ELSE 'retired' END
      FROM memory.nodes v
     WHERE q.node_id = ANY (ended) AND q.completed_at IS NULL
       AND v.id = q.node_id AND v.project_id = q.project_id AND v.expired_at IS NOT NULL;
    -- Level by level upwards: the current derived versions resting on what changed, each
    -- with its support now (one that still holds, e.g. relinked to a version of the same
    -- content, is left alone).
    FOR depth IN 1..4 LOOP
        kids := ARRAY(SELECT DISTINCT e.child_id
                      FROM memory.edges e
                      JOIN memory.nodes c ON c.id = e.child_id AND c.project_id = e.project_id
                                         AND c.expired_at IS NULL
                      WHERE e.parent_id = ANY (frontier) AND e.child_id <> ALL (seen)
                      ORDER BY 1);
        EXIT WHEN cardinality(kids) = 0;
        INSERT INTO memory.review_queue AS q (project_id, node_id, external_id, level, reason, changes)
        SELECT c.project_id, c.id, c.external_id, c.level,
               CASE WHEN s.changed_parents @> '[{"state": "superseded"}]' THEN 'evidence_changed'
                    WHEN s.changed_parents @> '[{"state": "retired"}]'
                         OR s.changed_parents @> '[{"state": "erased"}]'
                         OR s.changed_parents @> '[{"state": "expired"}]' THEN 'evidence_gone'
                    ELSE 'evidence_stale' END,
               coalesce(s.changed_parents, '[]')
        FROM memory._support_at(kids) s
        JOIN memory.nodes c ON c.id = s.node_id
        WHERE s.support IN ('stale', 'partial', 'none') AND c.level IN ('L1', 'L2')
        ORDER BY c.id
        ON CONFLICT (node_id) WHERE completed_at IS NULL
        DO UPDATE SET reason = EXCLUDED.reason, changes = EXCLUDED.changes;
        GET DIAGNOSTICS n = ROW_COUNT;
        opened := opened + n;
        seen := seen || kids;
        frontier := kids;
    END LOOP;
    RETURN opened;
END $$;
COMMENT ON FUNCTION memory._review_changes(bigint[], text) IS
    'Called by the writer and forget with the versions a statement ended: their open review items complete (rewritten when superseded, else retired), and every current derived node above them, level by level, whose support is no longer full (memory._support_at) gets an open item (or its open item the new reason and changes). Returns the items opened or updated.';

-- The rows memory.review_list and memory.review_claim return, declared once.
SELECT memory._declare_row('review_item',
    'item_id bigint, project text, node_id bigint, external_id text, level text, reason text, changes jsonb, enqueued_at timestamptz, vt timestamptz, claims integer, claimed_by text, text text, parents jsonb');

-- An item as a worker needs it: the node's text and, for each parent it rests on, the text
-- it rested on and the text now (each cut at provenance_text_chars: bounded answers).
CREATE OR REPLACE FUNCTION memory._review_rows(item_ids bigint[])
RETURNS SETOF memory.review_item
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    chars integer := memory._policy_value('provenance_text_chars')::integer;
BEGIN
    RETURN QUERY
    SELECT q.id, (SELECT p.name::text FROM memory.projects p WHERE p.id = q.project_id),
           q.node_id, q.external_id, q.level, q.reason, q.changes, q.enqueued_at, q.vt,
           q.claims, q.claimed_by, left(n.text, chars),
           (SELECT coalesce(jsonb_agg(jsonb_build_object(
                       'external_id', r.external_id, 'level', r.level, 'revision', r.revision,
                       'state', r.state, 'text', left(rv.text, chars),
                       'current_revision', r.current_revision,
                       'current_text', CASE WHEN r.current_id IS DISTINCT FROM r.parent_id
                                            THEN left(cv.text, chars) END)
                       ORDER BY r.precedence, r.external_id), '[]')
            FROM memory._rested_parents(ARRAY[q.node_id]) r
            JOIN memory.nodes rv ON rv.id = r.parent_id
            LEFT JOIN memory.nodes cv ON cv.id = r.current_id)
    FROM unnest(item_ids) WITH ORDINALITY AS i(id, ord)
    JOIN memory.review_queue q ON q.id = i.id
    JOIN memory.nodes n ON n.id = q.node_id AND n.project_id = q.project_id
    ORDER BY i.ord;
END $$;
COMMENT ON FUNCTION memory._review_rows(bigint[]) IS
    'Review items as workers see them, in the given order: the item, the node''s text, and each parent the node rests on (memory._rested_parents) with its state, the text it rested on and, when another version is current, the current text (texts cut at provenance_text_chars).';

CREATE OR REPLACE FUNCTION memory._review_limit(n integer)
RETURNS integer
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF n IS NULL OR n < 1 OR n > 100 THEN
        RAISE EXCEPTION 'limit must be between 1 and 100, got %', coalesce(n::text, 'NULL')
            USING ERRCODE = '22023', HINT = 'Review items come in pages of at most 100.';
    END IF;
    RETURN n;
END $$;
COMMENT ON FUNCTION memory._review_limit(integer) IS
    'Checks a page size of the review queue (1..100; 22023 otherwise).';

CREATE OR REPLACE FUNCTION memory.review_list(
    project text DEFAULT NULL, "limit" integer DEFAULT 50, after bigint DEFAULT NULL
)
RETURNS SETOF memory.review_item
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    pid integer := memory.project_id(project);
    -- beside row-level security, which a superuser connection skips
    scope integer[] := memory._asserted_ids(false);
BEGIN
    RETURN QUERY
    SELECT r.* FROM memory._review_rows(ARRAY(
        SELECT q.id FROM memory.review_queue q
        WHERE q.completed_at IS NULL AND (pid IS NULL OR q.project_id = pid)
          AND (scope IS NULL OR q.project_id = ANY (scope))
          AND (after IS NULL OR q.id > after)
        ORDER BY q.id LIMIT memory._review_limit("limit"))) r;
END $$;
COMMENT ON FUNCTION memory.review_list(text, integer, bigint) IS
    'The open review items, oldest first, claimed or not (vt in the future: claimed until then): the derived nodes whose evidence changed (reason, changes), with the node''s text and its parents'' texts then and now. project: one project (PM404 when unknown; NULL: every project the caller can read); limit 1..100 (default 50); after: the item_id of the previous page''s last row. Row-level security applies.';

CREATE OR REPLACE FUNCTION memory.review_claim(
    project text DEFAULT NULL, "limit" integer DEFAULT 1, visibility_timeout integer DEFAULT 300
)
RETURNS SETOF memory.review_item
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    pid integer := memory.project_id(project);
    who text := memory._writer();
    scope integer[] := memory._asserted_ids(true);
    got bigint[];
BEGIN
    IF visibility_timeout IS NULL OR visibility_timeout NOT BETWEEN 1 AND 86400 THEN
        RAISE EXCEPTION 'visibility_timeout must be between 1 and 86400 seconds, got %',
            coalesce(visibility_timeout::text, 'NULL')
            USING ERRCODE = '22023',
                  HINT = 'How long a claimed item stays hidden from other workers; unfinished, it comes back then.';
    END IF;
    -- Evidence first (L1 before L2: a rewritten L1 changes what its L2 must say), then the
    -- oldest. SKIP LOCKED: a worker never waits for, nor takes, another's item.
    WITH ready AS (
        SELECT q.id FROM memory.review_queue q
        WHERE q.completed_at IS NULL AND q.vt <= clock_timestamp()
          AND (pid IS NULL OR q.project_id = pid)
          AND (scope IS NULL OR q.project_id = ANY (scope))
        ORDER BY q.level, q.vt, q.id
        LIMIT memory._review_limit("limit")
        FOR UPDATE SKIP LOCKED
    ), claimed AS (
        UPDATE memory.review_queue q
           SET vt = clock_timestamp() + make_interval(secs => visibility_timeout),
               claims = q.claims + 1, claimed_by = who
          FROM ready WHERE q.id = ready.id
        RETURNING q.id, q.level, q.enqueued_at
    )
    SELECT array_agg(c.id ORDER BY c.level, c.enqueued_at, c.id) INTO got FROM claimed c;
    RETURN QUERY SELECT r.* FROM memory._review_rows(coalesce(got, '{}')) r;
END $$;
COMMENT ON FUNCTION memory.review_claim(text, integer, integer) IS
    'Claims up to limit (1..100, default 1) open review items whose visibility time has passed, L1 before L2, oldest first, and hides them from other workers for visibility_timeout seconds (1..86400, default 300): FOR UPDATE SKIP LOCKED, so concurrent workers never get the same item, and an item its worker did not finish comes back when the timeout passes. Complete one by writing a new version of the node with its parents (memory.add_nodes, POST /memory/nodes) or by memory.review_confirm. Needs write access to the project (row-level security).';

CREATE OR REPLACE FUNCTION memory.review_confirm(item_id bigint, note text DEFAULT NULL)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    who text := memory._writer();
    it record;
    doubt record;
    relinked integer;
    there integer;
    sup text;
    resolved bigint[];
    scope integer[] := memory._asserted_ids(true);
BEGIN
    PERFORM memory.check_note('note', note);
    -- Another project's item is as unknown as one that never was, with or without
    -- row-level security (a superuser connection skips it): the asserted projects too.
    SELECT q.* INTO it FROM memory.review_queue q
    WHERE q.id = item_id AND q.completed_at IS NULL
      AND (scope IS NULL OR q.project_id = ANY (scope))
    FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no open review item %', coalesce(item_id::text, 'NULL')
            USING ERRCODE = @vocabulary.sqlstate_unknown_review_item@,
                  HINT = 'memory.review_list shows the open items; a new version of the node, or retiring it, completes its item.';
    END IF;
    -- A parent that is itself in doubt is reviewed first: confirming against it would vouch
    -- for what nobody checked.
    SELECT r.external_id, s.support, q.id AS parent_item INTO doubt
    FROM memory._rested_parents(ARRAY[it.node_id]) r
    JOIN memory._support_at(ARRAY[r.current_id]) s ON s.node_id = r.current_id
    LEFT JOIN memory.review_queue q ON q.node_id = r.current_id AND q.completed_at IS NULL
    WHERE r.state IN ('current', 'superseded') AND s.support IN ('stale', 'partial', 'none')
    ORDER BY r.precedence LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'node % rests on % (support %), which is itself in doubt',
            coalesce(it.external_id, it.node_id::text), doubt.external_id, doubt.support
            USING ERRCODE = @vocabulary.sqlstate_review_conflict@,
                  DETAIL = CASE WHEN doubt.parent_item IS NOT NULL
                                THEN format('Its review item is %s.', doubt.parent_item) END,
                  HINT = 'Review the parent first (rewrite or confirm it), then this item.';
    END IF;
    SELECT count(*) FILTER (WHERE r.state IN ('current', 'superseded')) INTO there
    FROM memory._rested_parents(ARRAY[it.node_id]) r;
    IF there = 0 THEN
        RAISE EXCEPTION 'node % has no parent left to confirm against', coalesce(it.external_id, it.node_id::text)
            USING ERRCODE = @vocabulary.sqlstate_review_conflict@,
                  HINT = 'Write a new version with new parents, or forget it (memory.forget).';
    END IF;
    -- The claim holds against the current parents: it rests on them from now on (the old
    -- edges stay, for history and as_of) and on the parents that are left.
    relinked := memory._rest_on_current(it.node_id, it.project_id);
    UPDATE memory.review_queue q
       SET completed_at = now(), completed_by = who, outcome = 'confirmed', note = review_confirm.note
     WHERE q.id = it.id;
    SELECT s.support INTO sup FROM memory._support_at(ARRAY[it.node_id]) s;
    IF sup IS DISTINCT FROM 'full' THEN
        -- A parent changed while this ran (or is in doubt further down): the item stays open.
        RAISE EXCEPTION 'node % is % after confirming it against its current parents',
            coalesce(it.external_id, it.node_id::text), coalesce(sup, 'without parents')
            USING ERRCODE = @vocabulary.sqlstate_review_conflict@,
                  DETAIL = 'Nothing was confirmed.',
                  HINT = 'Read the item again (memory.review_list) and review what changed.';
    END IF;
    -- What was in doubt only because of this node holds again: those items are done too.
    WITH RECURSIVE up(id, depth) AS (
        SELECT e.child_id, 1 FROM memory.edges e
        WHERE e.parent_id = it.node_id AND e.project_id = it.project_id
        UNION
        SELECT e.child_id, u.depth + 1 FROM up u
        JOIN memory.edges e ON e.parent_id = u.id AND e.project_id = it.project_id
        WHERE u.depth < 4
    ), done AS (
        UPDATE memory.review_queue q
           SET completed_at = now(), completed_by = who, outcome = 'confirmed',
               note = format('its evidence was confirmed (item %s)', it.id)
          FROM memory._support_at(ARRAY(SELECT DISTINCT u.id FROM up u)) s
         WHERE q.node_id = s.node_id AND q.completed_at IS NULL AND s.support = 'full'
        RETURNING q.id
    )
    SELECT coalesce(array_agg(d.id ORDER BY d.id), '{}') INTO resolved FROM done d;
    RETURN jsonb_build_object('item_id', it.id, 'node_id', it.node_id,
                              'external_id', it.external_id, 'outcome', 'confirmed',
                              'relinked', relinked, 'support', sup,
                              'resolved', to_jsonb(resolved));
END $$;
COMMENT ON FUNCTION memory.review_confirm(bigint, text) IS
    'Completes an open review item by confirming that its node''s claim still holds against the current parents: the node rests on their current versions from now on (the old edges stay for history and as_of), on the parents that are left (parents_declared lowered to them), and its support is full again; the item records who confirmed it and note (at most @vocabulary.note_max_chars@ characters). Items above it that were in doubt only because of it complete too (resolved). PM446 for no open item of this id; PM449 when a parent is itself in doubt (review it first) or none is left. Needs write access to the project (row-level security).';
