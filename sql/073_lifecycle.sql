-- Memory that changes (migration 0012): forget (retire or erase), history, and the support
-- of derived nodes whose evidence went away. Versions are written by the one writer
-- (memory._write_nodes, sql/068_write.sql); these functions only end versions (UPDATE),
-- never insert a node or an edge.

-- The support of derived nodes, for forget's policy (flag or cascade): the same definition
-- as every result's support (memory._support_at, sql/055_support.sql), so the two can never
-- disagree.
CREATE OR REPLACE FUNCTION memory.support(node_ids bigint[])
RETURNS TABLE (node_id bigint, support text, parents integer, supporting integer)
-- PL/pgSQL, not SQL: a SQL body is checked when it is created, before migration 0012 on a
-- deploy that stops there.
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN QUERY
    SELECT s.node_id, s.support, s.parents, s.supporting
    FROM memory._support_at(node_ids) s;
END
$$;
COMMENT ON FUNCTION memory.support(bigint[]) IS
    'The support of each node from its evidence, now (memory._support_at): full (every parent it rests on is current and itself full), stale (a parent, or one further down, was rewritten since: the review queue lists it), partial (some parents were retired, erased or never resolved), none (all were), NULL for a node written without parents. parents: memory.nodes.parents_declared; supporting: the parents still there. Row-level security applies.';

CREATE OR REPLACE FUNCTION memory._forget(
    project text, external_ids text[], source text, since text, until text,
    erase boolean, reason text
)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    pid integer := memory.project_id(project);
    lo timestamptz;
    hi timestamptz;
    who text := memory._writer();
    policy text := memory._policy_value('forget_derived');
    hit bigint[];      -- the versions the filter names
    ended bigint[];    -- current versions this call ended
    derived bigint[];  -- current derived nodes the cascade ended
    n_erased integer := 0;
    more bigint[];
    affected bigint[];
BEGIN
    IF pid IS NULL THEN
        RAISE EXCEPTION 'forget needs a project' USING ERRCODE = '22023',
            HINT = 'Name the project whose nodes to forget.';
    END IF;
    IF external_ids IS NULL AND source IS NULL AND since IS NULL AND until IS NULL THEN
        RAISE EXCEPTION 'forget needs ids or a filter (source, since, until)' USING ERRCODE = '22023',
            HINT = 'To forget every node of the project, pass since => ''-infinity''.';
    END IF;
    SELECT t.since_ts, t.before_ts INTO lo, hi FROM memory.time_range(since, until) t;
    -- The nodes named: by id every version of the id; by filter the versions that match,
    -- then (to erase) every version of their ids. Current versions are locked in id order,
    -- as memory._write_nodes locks them, so a forget and a write of one node take turns.
    hit := ARRAY(
        SELECT n.id FROM memory.nodes n
        WHERE n.project_id = pid AND n.erased_at IS NULL
          AND (external_ids IS NULL OR n.external_id = ANY (external_ids))
          AND (source IS NULL OR n.source = source)
          AND (lo IS NULL OR n.ts >= lo) AND (hi IS NULL OR n.ts < hi)
          AND (erase OR n.expired_at IS NULL)
        ORDER BY n.id);
    IF erase THEN
        hit := ARRAY(
            SELECT n.id FROM memory.nodes n
            WHERE n.project_id = pid AND n.erased_at IS NULL
              AND (n.id = ANY (hit)
                   OR n.external_id IN (SELECT h.external_id FROM memory.nodes h
                                        WHERE h.id = ANY (hit) AND h.project_id = pid))
            ORDER BY n.id);
    END IF;
    PERFORM 1 FROM memory.nodes n WHERE n.id = ANY (hit) AND n.project_id = pid
      ORDER BY n.id FOR UPDATE;
    IF NOT erase THEN
        UPDATE memory.nodes n
           SET expired_at = now(), end_reason = 'retired', ended_by = who, end_note = reason
         WHERE n.id = ANY (hit) AND n.project_id = pid AND n.expired_at IS NULL;
        ended := hit;
    ELSE
        ended := ARRAY(SELECT n.id FROM memory.nodes n
                       WHERE n.id = ANY (hit) AND n.project_id = pid AND n.expired_at IS NULL);
        -- A tombstone: the row stays (its revision, level, external id, times and edges),
        -- its content goes. The old tuples hold the text until VACUUM reclaims them and the
        -- WAL until it is recycled (docs/lifecycle.md, "Erase").
        UPDATE memory.nodes n
           SET text = '', title = NULL, breadcrumb = '{}', source = NULL, ts = NULL,
               metadata = '{}', embedding = NULL, valid_from = NULL, valid_to = NULL,
               sha256 = sha256(convert_to('poimen-erased:' || n.id, 'UTF8')),
               erased_at = now(),
               expired_at = coalesce(n.expired_at, now()),
               end_reason = CASE WHEN n.expired_at IS NULL THEN 'erased' ELSE n.end_reason END,
               ended_by = CASE WHEN n.expired_at IS NULL THEN who ELSE n.ended_by END,
               end_note = CASE WHEN n.expired_at IS NULL THEN reason ELSE n.end_note END
         WHERE n.id = ANY (hit) AND n.project_id = pid;
        GET DIAGNOSTICS n_erased = ROW_COUNT;
    END IF;

    -- Derived nodes left without support: flagged (memory.support says none) or, under
    -- the policy forget_derived = cascade, ended the same way, level by level upwards.
    derived := '{}';
    affected := ended;
    IF policy = 'cascade' THEN
        LOOP
            more := ARRAY(
                SELECT s.node_id
                FROM memory.support(ARRAY(
                         SELECT DISTINCT e.child_id FROM memory.edges e
                         JOIN memory.nodes c ON c.id = e.child_id AND c.project_id = e.project_id
                         WHERE e.parent_id = ANY (affected) AND e.project_id = pid
                           AND c.expired_at IS NULL)) s
                WHERE s.support = 'none'
                ORDER BY s.node_id);
            EXIT WHEN cardinality(more) = 0;
            PERFORM 1 FROM memory.nodes n WHERE n.id = ANY (more) AND n.project_id = pid
              ORDER BY n.id FOR UPDATE;
            IF erase THEN
                UPDATE memory.nodes n
                   SET text = '', title = NULL, breadcrumb = '{}', source = NULL, ts = NULL,
                       metadata = '{}', embedding = NULL, valid_from = NULL, valid_to = NULL,
                       sha256 = sha256(convert_to('poimen-erased:' || n.id, 'UTF8')),
                       erased_at = now(), expired_at = now(), end_reason = 'erased',
                       ended_by = who, end_note = 'its evidence was erased'
                 WHERE n.id = ANY (more) AND n.project_id = pid AND n.expired_at IS NULL;
            ELSE
                UPDATE memory.nodes n
                   SET expired_at = now(), end_reason = 'retired', ended_by = who,
                       end_note = 'its evidence was retired'
                 WHERE n.id = ANY (more) AND n.project_id = pid AND n.expired_at IS NULL;
            END IF;
            derived := derived || more;
            affected := more;
        END LOOP;
    END IF;
    -- What this put in doubt goes to the review queue; the items of the versions it ended
    -- are done (retired).
    PERFORM memory._review_changes(CASE WHEN erase THEN hit ELSE ended END || derived, who);
    RETURN jsonb_build_object(
        'retired', CASE WHEN erase THEN 0 ELSE cardinality(ended) END,
        'erased', n_erased,
        'nodes', (SELECT coalesce(jsonb_agg(DISTINCT n.external_id) FILTER (WHERE n.external_id IS NOT NULL), '[]')
                  FROM memory.nodes n WHERE n.id = ANY (hit) AND n.project_id = pid),
        'derived_policy', policy,
        'derived_ended', cardinality(derived),
        'derived_unsupported', (
            SELECT count(*) FROM memory.support(ARRAY(
                SELECT DISTINCT e.child_id FROM memory.edges e
                JOIN memory.nodes c ON c.id = e.child_id AND c.project_id = e.project_id
                WHERE e.parent_id = ANY (hit) AND e.project_id = pid AND c.expired_at IS NULL)) s
            WHERE s.support <> 'full'));
END $$;
COMMENT ON FUNCTION memory._forget(text, text[], text, text, text, boolean, text) IS
    'The implementation of memory.forget: ends the current versions of the project''s nodes named by external ids or matched by source and ts range (since/until as in memory.query), retired (kept in history) or, with erase, erased (every version blanked to a tombstone). Derived nodes left with no support follow under forget_derived = cascade.';

CREATE OR REPLACE FUNCTION memory.forget(
    project text,
    external_ids text[] DEFAULT NULL,
    source text DEFAULT NULL,
    since text DEFAULT NULL,
    until text DEFAULT NULL,
    erase boolean DEFAULT false,
    reason text DEFAULT NULL
)
RETURNS jsonb
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT memory._forget(project, external_ids, source, since, until, erase, reason)
$$;
COMMENT ON FUNCTION memory.forget(text, text[], text, text, text, boolean, text) IS
    'Forgets a project''s nodes by external ids or by filter (source; since/until: inclusive ISO dates or timestamps on the node''s timestamp). By default retires them: their current versions end (end_reason retired), leave every answer and the BM25 statistics, and stay in memory.history. erase => true (privacy requests) blanks every version to a tombstone: text, title, source, timestamp, metadata, vector and postings go, the OpenSearch documents are deleted through the outbox; VACUUM FULL afterwards removes the old tuples from the relation files (docs/lifecycle.md). Derived L1/L2 left without support are flagged (memory.support) or, with memory.set_policy(''forget_derived'', ''cascade''), ended too. Returns {"retired", "erased", "nodes", "derived_policy", "derived_ended", "derived_unsupported"}. Row-level security applies: 42501 outside the caller''s projects.';

CREATE OR REPLACE FUNCTION memory.forget(
    project text, external_id text, erase boolean DEFAULT false, reason text DEFAULT NULL
)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM memory.nodes n
                   WHERE n.project_id = memory.project_id(project) AND n.external_id = forget.external_id
                     AND n.erased_at IS NULL AND (erase OR n.expired_at IS NULL)) THEN
        RAISE EXCEPTION 'no current node % in project %', external_id, project
            USING ERRCODE = @vocabulary.sqlstate_unknown_node@,
                  HINT = 'memory.history(project, id) lists its versions; a retired node can still be erased (erase => true).';
    END IF;
    RETURN memory._forget(project, ARRAY[external_id], NULL, NULL, NULL, erase, reason);
END $$;
COMMENT ON FUNCTION memory.forget(text, text, boolean, text) IS
    'Forgets one node by external id: memory.forget with external_ids => ARRAY[external_id]; PM444 when the id has no current version (or, with erase, no version left to erase).';

-- The shape of memory.history's rows; valid_from and valid_to were added (valid time).
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_proc p
               WHERE p.oid = pg_catalog.to_regprocedure('memory.history(text, text)')
                 AND NOT 'valid_to' = ANY (p.proargnames)) THEN
        DROP FUNCTION memory.history(text, text);
    END IF;
END $$;
CREATE OR REPLACE FUNCTION memory.history(project text, external_id text)
RETURNS TABLE (revision integer, node_id bigint, current boolean, level text, sha256 text,
               title text, text text, source text, "timestamp" timestamptz, metadata jsonb,
               created_at timestamptz, expired_at timestamptz, end_reason text,
               written_by text, ended_by text, end_note text, erased_at timestamptz,
               valid_from timestamptz, valid_to timestamptz)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    pid integer := memory.project_id(project);
BEGIN
    RETURN QUERY
    SELECT n.revision, n.id, n.expired_at IS NULL, n.level,
           CASE WHEN n.erased_at IS NULL THEN encode(n.sha256, 'hex') END,
           n.title, nullif(n.text, ''), n.source, n.ts, n.metadata, n.created_at, n.expired_at,
           n.end_reason, n.written_by, n.ended_by, n.end_note, n.erased_at,
           n.valid_from, n.valid_to
    FROM memory.nodes n
    WHERE n.project_id = pid AND n.external_id = history.external_id
    ORDER BY n.revision;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no node % in project %', external_id, project
            USING ERRCODE = @vocabulary.sqlstate_unknown_node@,
                  HINT = 'Ids are unique per project: check the project and the id.';
    END IF;
END $$;
COMMENT ON FUNCTION memory.history(text, text) IS
    'Every version of a node, oldest first: revision, node_id, whether it is current, its content (NULL once erased), when it became current (created_at) and ended (expired_at), why it ended (superseded, retired, erased), who wrote and who ended it (api_key:<id> or role:<name>), the forgetter''s note, its valid time (valid_from, valid_to). PM444 for an unknown id. Row-level security applies.';
