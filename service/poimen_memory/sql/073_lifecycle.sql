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

-- Scope (issue 40): forget by metadata (filter) and level too, a dry run, and a bound.

-- The most nodes one forget ends unless the caller names another bound (max_nodes): a
-- filter that matches more than the caller thought (a typo'd key, a missing project) is
-- refused whole instead of retiring a store. The service's default is
-- POIMEN_FORGET_MAX_NODES.
CREATE OR REPLACE FUNCTION memory._forget_max_nodes()
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
RETURN 1000;
COMMENT ON FUNCTION memory._forget_max_nodes() IS
    'The default bound of memory.forget (max_nodes, 1000): a forget matching more nodes is refused (PM422) unless the caller names a higher bound or NULL.';

CREATE OR REPLACE FUNCTION memory._forget(
    project text, external_ids text[], source text, since text, until text,
    erase boolean, reason text, filter jsonb DEFAULT NULL, level text DEFAULT NULL,
    dry_run boolean DEFAULT false, max_nodes integer DEFAULT NULL, node_ids bigint[] DEFAULT NULL
)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    pid integer := memory.project_id(project);
    flt jsonb := memory.check_filter(filter);
    lo timestamptz;
    hi timestamptz;
    -- the nodes the filter names (memory._visible): a retire reads current versions, an
    -- erase every version not yet erased
    scope memory.visibility;
    who text := memory._writer();
    policy text := memory._policy_value('forget_derived');
    hit bigint[];      -- the versions the filter names
    ended bigint[];    -- current versions this call ended
    derived bigint[];  -- current derived nodes the cascade ended
    n_erased integer := 0;
    matched integer;   -- the nodes named (an external id, or a version without one)
    more bigint[];
    affected bigint[];
    attempts integer := 0;
BEGIN
    IF pid IS NULL THEN
        RAISE EXCEPTION 'forget needs a project' USING ERRCODE = '22023',
            HINT = 'Name the project whose nodes to forget.';
    END IF;
    IF external_ids IS NULL AND node_ids IS NULL AND source IS NULL AND since IS NULL
       AND until IS NULL AND flt IS NULL AND level IS NULL THEN
        RAISE EXCEPTION 'forget needs ids or a filter (filter, source, level, since, until)' USING ERRCODE = '22023',
            HINT = 'To forget every node of the project, pass since => ''-infinity''.';
    END IF;
    IF level IS NOT NULL AND NOT level = ANY (@vocabulary.levels@) THEN
        RAISE EXCEPTION 'level must be one of L0, L1, L2, got %', level USING ERRCODE = '22023';
    END IF;
    PERFORM memory.check_note('reason', reason);  -- kept in every version it ends
    IF max_nodes IS NOT NULL AND max_nodes < 1 THEN
        RAISE EXCEPTION 'max_nodes must be at least 1, got %', max_nodes USING ERRCODE = '22023',
            HINT = 'NULL: no bound.';
    END IF;
    SELECT t.since_ts, t.before_ts INTO lo, hi FROM memory.time_range(since, until) t;
    scope := memory._visibility(project_id => pid, levels => CASE WHEN level IS NOT NULL THEN ARRAY[level] END,
                                since => lo, before => hi, filter => flt, every_version => erase);
    -- The nodes named: by id every version of the id; by filter the versions that match,
    -- then (to erase) every version of their ids. Current versions are locked in id order,
    -- as memory._write_nodes locks them, so a forget and a write of one node take turns.
    -- A retire reads current versions only (memory._visible, inlined: expired_at IS NULL
    -- to the planner), so that a metadata filter reads the partial index
    -- nodes_metadata_current_gin.
    -- In a loop: a writer that supersedes a matched version while this waits for its lock
    -- makes a new current version this did not see; the set is read again until every
    -- current version of the ids it names is one it holds (as memory._write_nodes does), so
    -- a retire ends what is current and an erase blanks every version, the new one too.
    LOOP
    IF erase THEN
        hit := ARRAY(
            SELECT n.id FROM memory.nodes n
            WHERE n.project_id = pid AND n.erased_at IS NULL AND memory._visible(n, scope)
              AND (external_ids IS NULL OR n.external_id = ANY (external_ids))
              AND (node_ids IS NULL OR n.id = ANY (node_ids))
              AND (source IS NULL OR n.source = source)
            ORDER BY n.id);
        hit := ARRAY(
            SELECT n.id FROM memory.nodes n
            WHERE n.project_id = pid AND n.erased_at IS NULL
              AND (n.id = ANY (hit)
                   OR n.external_id IN (SELECT h.external_id FROM memory.nodes h
                                        WHERE h.id = ANY (hit) AND h.project_id = pid))
            ORDER BY n.id);
    ELSE
        hit := ARRAY(
            SELECT n.id FROM memory.nodes n
            WHERE n.project_id = pid AND memory._visible(n, scope)
              AND (external_ids IS NULL OR n.external_id = ANY (external_ids))
              AND (node_ids IS NULL OR n.id = ANY (node_ids))
              AND (source IS NULL OR n.source = source)
            ORDER BY n.id);
    END IF;
    matched := (SELECT count(DISTINCT coalesce(n.external_id, n.id::text)) FROM memory.nodes n
                WHERE n.id = ANY (hit) AND n.project_id = pid);
    -- A dry run stops here: what the same call would forget now, nothing written or locked.
    -- The answer's keys plus dry_run and matched (derived_*: not simulated, 0), the ids in
    -- full: the bound below does not apply, so the caller learns how many a filter matches
    -- and the real call (nothing changed in between) ends exactly these.
    IF dry_run THEN
        -- The ids listed are bounded (the first max_nodes, else 1000, by id): a dry run of a
        -- whole large project must not answer millions; matched counts them all.
        RETURN jsonb_build_object(
            'dry_run', true, 'matched', matched, 'retired', 0, 'erased', 0,
            'nodes', (SELECT coalesce(jsonb_agg(x.external_id ORDER BY x.external_id), '[]')
                      FROM (SELECT DISTINCT n.external_id FROM memory.nodes n
                            WHERE n.id = ANY (hit) AND n.project_id = pid
                              AND n.external_id IS NOT NULL
                            ORDER BY n.external_id
                            LIMIT coalesce(max_nodes, 1000)) x),
            'nodes_truncated', matched > coalesce(max_nodes, 1000),
            'derived_policy', policy, 'derived_ended', 0, 'derived_unsupported', 0);
    END IF;
    IF max_nodes IS NOT NULL AND matched > max_nodes THEN
        RAISE EXCEPTION 'forget would end % nodes, more than max_nodes = %', matched, max_nodes
            USING ERRCODE = @vocabulary.sqlstate_too_many_nodes@,
                  DETAIL = 'Nothing was forgotten.',
                  HINT = 'Check the filter with dry_run => true, then pass a higher max_nodes (or NULL: no bound), or forget in smaller parts.';
    END IF;
    PERFORM 1 FROM memory.nodes n WHERE n.id = ANY (hit) AND n.project_id = pid
      ORDER BY n.id FOR UPDATE;
    EXIT WHEN NOT EXISTS (
        SELECT 1 FROM memory.nodes n
        WHERE n.project_id = pid AND n.expired_at IS NULL AND n.id <> ALL (hit)
          AND n.external_id IN (SELECT h.external_id FROM memory.nodes h
                                WHERE h.id = ANY (hit) AND h.project_id = pid));
    attempts := attempts + 1;
    IF attempts > 100 THEN
        RAISE EXCEPTION 'could not lock the current versions of the nodes being forgotten'
            USING ERRCODE = '40001', HINT = 'Retry the forget.';
    END IF;
    END LOOP;
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
COMMENT ON FUNCTION memory._forget(text, text[], text, text, text, boolean, text, jsonb, text, boolean, integer, bigint[]) IS
    'The implementation of memory.forget (and of poimen-memory expire, which names versions by node_ids): ends the current versions of the project''s nodes named by external ids or node ids or matched by source, ts range (since/until as in memory.query), metadata (filter: metadata @> filter, memory.check_filter) and level, retired (kept in history) or, with erase, erased (every version blanked to a tombstone). dry_run: the answer the call would give, nothing written. More than max_nodes nodes (NULL: no bound): PM422, nothing written. Derived nodes left with no support follow under forget_derived = cascade.';

CREATE OR REPLACE FUNCTION memory.forget(
    project text,
    external_ids text[] DEFAULT NULL,
    source text DEFAULT NULL,
    since text DEFAULT NULL,
    until text DEFAULT NULL,
    erase boolean DEFAULT false,
    reason text DEFAULT NULL,
    filter jsonb DEFAULT NULL,
    level text DEFAULT NULL,
    dry_run boolean DEFAULT false,
    max_nodes integer DEFAULT memory._forget_max_nodes()
)
RETURNS jsonb
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT memory._forget(project, external_ids, source, since, until, erase, reason,
                          filter, level, dry_run, max_nodes)
$$;
COMMENT ON FUNCTION memory.forget(text, text[], text, text, text, boolean, text, jsonb, text, boolean, integer) IS
    'Forgets a project''s nodes by external ids or by filter (filter: a JSON object the node''s metadata contains, as memory_query''s; source; level; since/until: inclusive ISO dates or timestamps on the node''s timestamp). By default retires them: their current versions end (end_reason retired), leave every answer and the BM25 statistics, and stay in memory.history. erase => true (privacy requests) blanks every version to a tombstone: text, title, source, timestamp, metadata, vector and postings go, the OpenSearch documents are deleted through the outbox; VACUUM FULL afterwards removes the old tuples from the relation files (docs/lifecycle.md). Derived L1/L2 left without support are flagged (memory.support) or, with memory.set_policy(''forget_derived'', ''cascade''), ended too. dry_run => true answers what the call would forget (matched: how many nodes, nodes: their ids, the first max_nodes (else 1000) in id order, nodes_truncated when there are more) and writes nothing. A call matching more than max_nodes nodes (default 1000; NULL: no bound) is refused whole with PM422. Returns {"retired", "erased", "nodes", "derived_policy", "derived_ended", "derived_unsupported"}, and for a dry run also "dry_run": true and "matched". reason (kept in every version it ends) at most @vocabulary.note_max_chars@ characters (22023). Row-level security applies: 42501 outside the caller''s projects.';

CREATE OR REPLACE FUNCTION memory.forget(
    project text, external_id text, erase boolean DEFAULT false, reason text DEFAULT NULL
)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM memory.check_note('reason', reason);  -- the argument before the node
    IF NOT EXISTS (SELECT 1 FROM memory.nodes n
                   WHERE n.project_id = memory.project_id(project) AND n.external_id = forget.external_id
                     AND n.erased_at IS NULL AND (erase OR n.expired_at IS NULL)) THEN
        RAISE EXCEPTION 'no current node % in project %', external_id, project
            USING ERRCODE = @vocabulary.sqlstate_unknown_node@,
                  HINT = 'memory.history(project, id) lists its versions; a retired node can still be erased (erase => true).';
    END IF;
    RETURN memory._forget(project, ARRAY[external_id], NULL, NULL, NULL, erase, reason);  -- one id: no bound
END $$;
COMMENT ON FUNCTION memory.forget(text, text, boolean, text) IS
    'Forgets one node by external id: memory.forget with external_ids => ARRAY[external_id]; PM444 when the id has no current version (or, with erase, no version left to erase).';

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
    pid integer;
BEGIN
    -- Named, not looked up: a NULL would be read as "no node <NULL> in project <NULL>".
    IF project IS NULL THEN
        RAISE EXCEPTION 'project must not be NULL'
            USING ERRCODE = '22023', HINT = 'memory.history(project, external_id): ids are unique per project.';
    END IF;
    IF external_id IS NULL THEN
        RAISE EXCEPTION 'external_id must not be NULL'
            USING ERRCODE = '22023', HINT = 'memory.history(project, external_id): the node''s id, as written.';
    END IF;
    pid := memory.project_id(project);
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

-- Expiry and retention (issue 40, migration 0021). A node's expires_at (its JSON's, or its
-- project's retention for its level from when it was written) takes it out of answers at
-- once: the search stages test it with valid time (memory._valid_at), memory.get_node and
-- memory.list_nodes beside expired_at. memory.expire then ends what has expired, through
-- memory._forget, so history, the BM25 statistics, OpenSearch and derived nodes follow as
-- for any forget. PL/pgSQL throughout: memory.retention is created by migration 0021.
CREATE OR REPLACE FUNCTION memory.set_retention(
    project text, level text, max_age interval, action text DEFAULT 'retire'
)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    pid integer := memory.project_id(project);
    changed integer := 0;
BEGIN
    IF pid IS NULL THEN
        RAISE EXCEPTION 'set_retention needs a project' USING ERRCODE = '22023';
    END IF;
    IF level IS NULL OR NOT level = ANY (@vocabulary.levels@) THEN
        RAISE EXCEPTION 'level must be one of L0, L1, L2, got %', coalesce(level, 'NULL')
            USING ERRCODE = '22023';
    END IF;
    IF action IS NULL OR action NOT IN ('retire', 'erase') THEN
        RAISE EXCEPTION 'action must be retire or erase, got %', coalesce(action, 'NULL')
            USING ERRCODE = '22023';
    END IF;
    IF max_age IS NULL THEN
        -- No retention any more: the expiries already set stay (a node's own, or one the
        -- retention gave: the database does not tell them apart).
        DELETE FROM memory.retention r WHERE r.project_id = pid AND r.level = level;
    ELSE
        IF max_age <= interval '0' OR NOT isfinite(now() + max_age) THEN
            RAISE EXCEPTION 'max_age must be a positive, finite interval, got %', max_age
                USING ERRCODE = '22023', HINT = 'e.g. max_age => ''90 days''.';
        END IF;
        INSERT INTO memory.retention AS r (project_id, level, max_age, action, set_at, set_by)
        VALUES (pid, level, max_age, action, now(), memory._writer())
        ON CONFLICT ON CONSTRAINT retention_pkey DO UPDATE  -- not (project_id, level): level is the argument here
            SET max_age = EXCLUDED.max_age, action = EXCLUDED.action,
                set_at = EXCLUDED.set_at, set_by = EXCLUDED.set_by;
        -- Honoured at once: the current nodes of that level expire max_age after they were
        -- written, or sooner if they say so (a retention is a longest life, so a longer one
        -- set later does not lengthen an expiry already set).
        UPDATE memory.nodes n
           SET expires_at = n.created_at + max_age
         WHERE n.project_id = pid AND n.level = level AND n.expired_at IS NULL
           AND (n.expires_at IS NULL OR n.expires_at > n.created_at + max_age);
        GET DIAGNOSTICS changed = ROW_COUNT;
    END IF;
    RETURN jsonb_build_object('project', project, 'level', level, 'max_age', max_age::text,
                              'action', action, 'nodes_updated', changed);
END $$;
COMMENT ON FUNCTION memory.set_retention(text, text, interval, text) IS
    'Sets the retention of a project''s level: its nodes expire max_age after they were written (memory.nodes.expires_at; an earlier expiry of their own stays), at once for its current nodes and at write for new ones, and poimen-memory expire (memory.expire) retires them, or erases them with action => ''erase''. max_age NULL removes the retention (expiries already set stay). Returns {"project", "level", "max_age", "action", "nodes_updated"}. Row-level security applies: a role sets retention only in projects it may write.';

CREATE OR REPLACE FUNCTION memory.expire(project text, batch integer DEFAULT 1000)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    pid integer := memory.project_id(project);
    r record;
    res jsonb;
    n_retired integer := 0;
    n_erased integer := 0;
    n_derived integer := 0;
BEGIN
    IF pid IS NULL THEN
        RAISE EXCEPTION 'expire needs a project' USING ERRCODE = '22023';
    END IF;
    PERFORM memory.check_within('batch', batch, 1, 100000, 'batch is the most nodes one call ends; call again for the rest.');
    -- At most batch expired current versions, oldest node id first, by what their level's
    -- retention says to do (retire when none says).
    FOR r IN
        SELECT x.act, array_agg(x.id ORDER BY x.id) AS ids
        FROM (SELECT n.id, coalesce(t.action, 'retire') AS act
              FROM memory.nodes n
              LEFT JOIN memory.retention t ON t.project_id = n.project_id AND t.level = n.level
              WHERE n.project_id = pid AND n.expired_at IS NULL AND n.expires_at <= now()
              ORDER BY n.id LIMIT batch) x
        GROUP BY x.act ORDER BY x.act
    LOOP
        res := memory._forget(project, NULL, NULL, NULL, NULL, r.act = 'erase', 'expired',
                              node_ids => r.ids);
        IF r.act = 'erase' THEN
            n_erased := n_erased + cardinality(r.ids);
        ELSE
            n_retired := n_retired + cardinality(r.ids);
        END IF;
        n_derived := n_derived + (res ->> 'derived_ended')::integer;
    END LOOP;
    RETURN jsonb_build_object(
        'project', project, 'retired', n_retired, 'erased', n_erased, 'derived_ended', n_derived,
        'remaining', (SELECT count(*) FROM memory.nodes n
                      WHERE n.project_id = pid AND n.expired_at IS NULL AND n.expires_at <= now()));
END $$;
COMMENT ON FUNCTION memory.expire(text, integer) IS
    'Ends up to batch (1..100000, default 1000) of the project''s current nodes whose expires_at has passed, through memory.forget''s implementation: retired (end_note expired), or erased where their level''s retention says erase; derived nodes follow the forget_derived policy. Returns {"project", "retired", "erased" (nodes), "derived_ended", "remaining" (expired nodes still current: call again)}. poimen-memory expire calls it until none remain. Row-level security applies.';

CREATE OR REPLACE FUNCTION memory.retention()
RETURNS TABLE (project text, level text, max_age interval, action text, set_at timestamptz, set_by text)
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN QUERY
    SELECT p.name::text, r.level, r.max_age, r.action, r.set_at, r.set_by
    FROM memory.retention r JOIN memory.projects p ON p.id = r.project_id
    ORDER BY p.name, r.level;
END $$;
COMMENT ON FUNCTION memory.retention() IS
    'The retentions set (memory.set_retention), by project name and level. Row-level security applies: the projects the caller may read.';
