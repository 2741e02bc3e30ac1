-- The one writer of nodes and edges. memory._write_nodes is the only code that inserts into
-- memory.nodes and memory.edges: the service's ingest (CLI and POST /memory/nodes, with the
-- vectors it computed) and memory.add_nodes (PL/Python, embedding in the database) both
-- validate with poimen_core.nodes and then batch into it. Plain SQL and PL/pgSQL, so the
-- service can write into a database without PL/Python.

CREATE OR REPLACE FUNCTION memory._stored_nodes(projects text[], external_ids text[])
RETURNS TABLE (project text, external_id text, id bigint, level text, sha256 bytea, revision integer)
-- PL/pgSQL, not SQL: a SQL body is checked when it is created, and a deploy that stops
-- before migration 0012 (tests apply one migration per deploy) has no revision column yet.
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN QUERY
    SELECT p.name::text, n.external_id, n.id, n.level, n.sha256, n.revision
    FROM memory.nodes n JOIN memory.projects p ON p.id = n.project_id
    WHERE (p.name, n.external_id) IN (SELECT * FROM unnest(projects, external_ids))
      AND n.expired_at IS NULL;
END
$$;
COMMENT ON FUNCTION memory._stored_nodes(text[], text[]) IS
    'The current versions of the nodes named by (project, external id) pairs, the i-th project with the i-th id: what a writer validates a batch against before writing (poimen_core.nodes.validate). Row-level security applies.';

CREATE OR REPLACE FUNCTION memory._stored_hashes(hashes bytea[])
RETURNS TABLE (sha256 bytea, id bigint)
LANGUAGE plpgsql STABLE PARALLEL SAFE  -- plpgsql: see memory._stored_nodes
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN QUERY
    SELECT n.sha256, n.id FROM memory.nodes n WHERE n.sha256 = ANY (hashes) AND n.expired_at IS NULL;
END
$$;
COMMENT ON FUNCTION memory._stored_hashes(bytea[]) IS
    'The current versions among content hashes (a node''s hash includes its project and external id): the duplicates a writer skips. An old version''s content written again is no duplicate: it becomes a new version. Row-level security applies.';

CREATE OR REPLACE FUNCTION memory._writer()
RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    -- The service's API key id counts only for members of @role.service@, the role that
    -- asserts projects for its callers (sql/085_tenants.sql); anyone else is its role.
    SELECT CASE WHEN nullif(current_setting('poimen.api_key', true), '') IS NOT NULL
                     AND pg_has_role(current_user, '@role.service@', 'MEMBER')
                THEN 'api_key:' || current_setting('poimen.api_key', true)
                ELSE 'role:' || current_user END
$$;
COMMENT ON FUNCTION memory._writer() IS
    'Who is writing, as memory.nodes.written_by and ended_by record it: api_key:<id> when the HTTP service writes for an API key (poimen.api_key, honoured for members of @role.service@ only), role:<name> otherwise.';

-- Who wrote or ended a version is the database's record, not the writer's say: a writer may
-- INSERT and UPDATE memory.nodes directly (the column grants, sql/900_grants.sql), and once
-- could set written_by or ended_by to an API key's id, so memory.history named another
-- writer, or end a version (expired_at) naming nobody. The triggers fire only when the value
-- is not memory._writer()'s (the writer and forget always set that, so they never fire
-- there), or when who ended a version would change. The table's owner writes history as it
-- was (a restore, a migration); anyone else leaving written_by (or, ending a version,
-- ended_by) NULL is recorded as who they are, and any other value is refused.
CREATE OR REPLACE FUNCTION memory._writer_recorded()
RETURNS trigger
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    who text := memory._writer();
    col text := CASE TG_OP WHEN 'INSERT' THEN 'written_by' ELSE 'ended_by' END;
    given text := CASE TG_OP WHEN 'INSERT' THEN NEW.written_by ELSE NEW.ended_by END;
BEGIN
    IF pg_catalog.pg_has_role(current_user, (SELECT c.relowner FROM pg_catalog.pg_class c
                                             WHERE c.oid = TG_RELID), 'MEMBER') THEN
        RETURN NEW;
    END IF;
    IF TG_OP = 'INSERT' AND given IS NULL THEN
        NEW.written_by := who;
        RETURN NEW;
    END IF;
    -- A version ended here (expired_at set) without saying by whom: this session ended it.
    IF TG_OP = 'UPDATE' AND OLD.expired_at IS NULL AND NEW.expired_at IS NOT NULL
       AND OLD.ended_by IS NULL AND given IS NULL THEN
        NEW.ended_by := who;
        RETURN NEW;
    END IF;
    -- Anything else: naming another writer, or rewriting who ended a version.
    RAISE EXCEPTION '% is recorded by the database: this session writes as %', col, who
        USING ERRCODE = '42501',
              DETAIL = pg_catalog.format('%s was set to %s%s', col,
                                         coalesce(pg_catalog.quote_literal(given), 'NULL'),
                                         CASE WHEN TG_OP = 'UPDATE' AND OLD.ended_by IS NOT NULL
                                              THEN pg_catalog.format(' (it was %s)', pg_catalog.quote_literal(OLD.ended_by))
                                              ELSE '' END),
              HINT = 'Leave it out (or set it to memory._writer()); memory.add_nodes and memory.forget record it.';
END $$;
COMMENT ON FUNCTION memory._writer_recorded() IS
    'Row trigger on memory.nodes: a version''s written_by (INSERT) and ended_by (UPDATE) are memory._writer(), who is writing; NULL written_by is filled in, another value refused (42501), except for the table''s owner (a restore writes history as it was).';

SELECT memory._ensure_trigger('memory.nodes', 'nodes_written_by',
    'CREATE TRIGGER nodes_written_by BEFORE INSERT ON memory.nodes
     FOR EACH ROW WHEN ((new.written_by IS DISTINCT FROM memory._writer())) EXECUTE FUNCTION memory._writer_recorded()')
FROM pg_catalog.pg_attribute a  -- from migration 0012 on
WHERE a.attrelid = 'memory.nodes'::regclass AND a.attname = 'ended_by' AND NOT a.attisdropped;
SELECT memory._ensure_trigger('memory.nodes', 'nodes_ended_by',
    'CREATE TRIGGER nodes_ended_by BEFORE UPDATE OF expired_at, ended_by ON memory.nodes
     FOR EACH ROW WHEN ((((new.ended_by IS DISTINCT FROM old.ended_by) AND ((old.ended_by IS NOT NULL) OR (new.ended_by IS DISTINCT FROM memory._writer()))) OR ((old.expired_at IS NULL) AND (new.expired_at IS NOT NULL) AND (new.ended_by IS DISTINCT FROM memory._writer())))) EXECUTE FUNCTION memory._writer_recorded()')
FROM pg_catalog.pg_attribute a  -- from migration 0012 on
WHERE a.attrelid = 'memory.nodes'::regclass AND a.attname = 'ended_by' AND NOT a.attisdropped;

CREATE OR REPLACE FUNCTION memory._ensure_projects(names text[])
RETURNS void
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
    -- In name order, so two writers creating the same projects lock them in one order.
    INSERT INTO memory.projects (name)
    SELECT DISTINCT unnest(names) ORDER BY 1
    ON CONFLICT (name) DO NOTHING
$$;
COMMENT ON FUNCTION memory._ensure_projects(text[]) IS
    'Creates the named projects that do not exist (and, on the partitioned layout, their partitions). A writer calls it before it reads anything: the partitions lock memory.nodes and its kin ACCESS EXCLUSIVE, and upgrading from the ACCESS SHARE a read leaves would deadlock two writers that create projects at once. The bulk ingest calls it in a short transaction of its own, so queries do not wait for a whole load.';

-- When a write changes nothing: the current version has the same content hash (text,
-- title, source, level, id, valid time) and the same metadata, timestamp and breadcrumb,
-- which the hash leaves out. Anything else is a new version (issue 40: a change of
-- metadata or timestamp alone used to be dropped as a duplicate).
CREATE OR REPLACE FUNCTION memory._same_version(
    v_sha256 bytea, v_metadata jsonb, v_ts timestamptz, v_breadcrumb text[], node jsonb
)
RETURNS boolean
-- STABLE, not IMMUTABLE: a timestamp without an offset is read in the session's TimeZone.
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
-- A key the row leaves out is not compared (a row written by hand to link a stored node,
-- with its hash and parents only): poimen_core.nodes.write_row always sends all three.
RETURN v_sha256 = decode(node->>'sha256', 'hex')
   AND (NOT node ? 'metadata' OR v_metadata = node->'metadata')
   AND (NOT node ? 'ts' OR v_ts IS NOT DISTINCT FROM (node->>'ts')::timestamptz)
   AND (NOT node ? 'breadcrumb'
        OR v_breadcrumb = ARRAY(SELECT jsonb_array_elements_text(node->'breadcrumb')));
COMMENT ON FUNCTION memory._same_version(bytea, jsonb, timestamptz, text[], jsonb) IS
    'Whether a stored version (its sha256, metadata, ts and breadcrumb) equals a node row of memory._write_nodes: then writing the row changes nothing (unchanged); otherwise it is the next version.';

CREATE OR REPLACE FUNCTION memory._write_nodes(
    nodes jsonb,
    embeddings vector[] DEFAULT NULL,
    embed boolean DEFAULT false
)
RETURNS jsonb
-- VOLATILE and PARALLEL UNSAFE: it writes. SECURITY INVOKER (the default): row-level
-- security and the caller's grants apply to every row written.
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
DECLARE
    n_inserted integer;
    n_superseded integer;
    n_linked integer;
    linked bigint[];
    unresolved jsonb;
    locked bigint[];
    seen bigint[];
    attempts integer := 0;
    stale record;
    made bigint[];  -- the versions this call inserted
    report jsonb;
    who text := memory._writer();
BEGIN
    IF jsonb_typeof(nodes) IS DISTINCT FROM 'array' THEN
        RAISE EXCEPTION 'nodes must be a JSON array of node rows, got %',
            coalesce(jsonb_typeof(nodes), 'NULL')
            USING ERRCODE = '22023';
    END IF;
    IF embeddings IS NOT NULL AND cardinality(embeddings) <> jsonb_array_length(nodes) THEN
        RAISE EXCEPTION '% nodes but % vectors', jsonb_array_length(nodes), cardinality(embeddings)
            USING ERRCODE = '22023',
                  HINT = 'The i-th vector belongs to the i-th node; NULL where the node is stored.';
    END IF;
    -- Projects before anything is read: on the partitioned layout a new project's partitions
    -- lock memory.nodes and its kin ACCESS EXCLUSIVE, and upgrading from the ACCESS SHARE a
    -- read leaves would deadlock two writers that create projects at once.
    PERFORM memory._ensure_projects(ARRAY(SELECT e->>'project' FROM jsonb_array_elements(nodes) AS e));

    -- Versions (migration 0012). The current versions of the batch's external ids are
    -- locked, in id order, before anything is decided about them: two writers of one id
    -- take turns, and the second decides on what the first wrote. A version the other
    -- writer ended while this one waited drops out of the locked set (its expired_at is
    -- set), and the version that replaced it is only visible to a later statement, so the
    -- lock is taken again until what is locked is what is current (READ COMMITTED; under
    -- REPEATABLE READ the wait ends in a serialization failure, 40001, instead).
    LOOP
        SELECT array_agg(l.id ORDER BY l.id) INTO locked
        FROM (SELECT n.id FROM memory.nodes n JOIN memory.projects p ON p.id = n.project_id
              WHERE (p.name, n.external_id) IN (SELECT e->>'project', e->>'external_id'
                                                FROM jsonb_array_elements(nodes) AS e
                                                WHERE e->>'external_id' IS NOT NULL)
                AND n.expired_at IS NULL
              ORDER BY n.id FOR UPDATE OF n) l;
        SELECT array_agg(n.id ORDER BY n.id) INTO seen
        FROM memory.nodes n JOIN memory.projects p ON p.id = n.project_id
        WHERE (p.name, n.external_id) IN (SELECT e->>'project', e->>'external_id'
                                          FROM jsonb_array_elements(nodes) AS e
                                          WHERE e->>'external_id' IS NOT NULL)
          AND n.expired_at IS NULL;
        EXIT WHEN coalesce(seen, '{}') <@ coalesce(locked, '{}');
        attempts := attempts + 1;
        IF attempts > 100 THEN
            RAISE EXCEPTION 'could not lock the current versions of the nodes being written'
                USING ERRCODE = '40001', HINT = 'Retry the write.';
        END IF;
    END LOOP;

    -- Optimistic concurrency: a node may name the revision it was read at ("revision";
    -- 0: the id must have no current version). A change under a stale revision is refused;
    -- a node equal to the current version (memory._same_version) is a no-op whatever it
    -- names.
    SELECT e.i, e.j->>'project' AS project, e.j->>'external_id' AS external_id,
           (e.j->>'revision')::integer AS named, c.revision AS current
      INTO stale
      FROM jsonb_array_elements(nodes) WITH ORDINALITY AS e(j, i)
      JOIN memory.projects p ON p.name = e.j->>'project'
      LEFT JOIN memory.nodes c ON c.project_id = p.id AND c.external_id = e.j->>'external_id'
                              AND c.expired_at IS NULL
     WHERE jsonb_typeof(e.j->'revision') = 'number'
       AND NOT coalesce(memory._same_version(c.sha256, c.metadata, c.ts, c.breadcrumb, e.j), false)
       AND coalesce(c.revision, 0) <> (e.j->>'revision')::integer
     ORDER BY e.i
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'node % of project % is at revision %, not %', stale.external_id,
            stale.project, coalesce(stale.current::text, 'none (no current version)'), stale.named
            USING ERRCODE = @vocabulary.sqlstate_stale_revision@,
                  DETAIL = format('node %s of the batch named revision %s; another write came first. Nothing was written.',
                                  stale.i, stale.named),
                  HINT = 'Read the node again (memory.history, GET /memory/nodes/{id}/history), merge, and write naming its current revision; or name none to write on top of it.';
    END IF;

    -- The current versions the batch changes (new content, or the same content with other
    -- metadata, timestamp or breadcrumb) end here: superseded. Only when
    -- the batch names stored ids: an UPDATE fires the statement triggers (statistics,
    -- outbox) even when it changes no row.
    n_superseded := 0;
    IF locked IS NOT NULL THEN
        UPDATE memory.nodes c
           SET expired_at = now(), end_reason = 'superseded', ended_by = who
          FROM jsonb_array_elements(nodes) AS e(j)
          JOIN memory.projects p ON p.name = e.j->>'project'
         WHERE c.id = ANY (locked) AND c.project_id = p.id
           AND c.external_id = e.j->>'external_id'
           AND NOT memory._same_version(c.sha256, c.metadata, c.ts, c.breadcrumb, e.j);
        GET DIAGNOSTICS n_superseded = ROW_COUNT;
    END IF;

    -- Only nodes not current yet: a node with an id when no version of it is left current
    -- (the one it changes ended above), a node without one when no current node of its
    -- project has its content hash (re-ingesting id-less content is a duplicate). A
    -- duplicate is neither embedded nor checked for a vector. A node without an id gets a
    -- generated one, 'n:' and a random UUID: never derived from the content, since an erase
    -- keeps ids and replaces content hashes (a hash of known text would confirm it).
    -- A version with the content of a stored one (the same hash: a change of metadata or
    -- timestamp only, or a rollback) reuses its vector: the text is the same, so the
    -- caller sends none and nothing is embedded again.
    -- One statement text for both sources of vectors (a vector the caller computed, or
    -- memory.embed here), so memory.embed is planned only where it is called: a database
    -- without PL/Python has no memory.embed, and the service's writes never name it.
    -- A new version of an id takes the next revision number after all of the id's rows.
    EXECUTE format($q$
        WITH ins AS (
        INSERT INTO memory.nodes AS n
            (sha256, project_id, level, external_id, title, breadcrumb, text, source, ts,
             metadata, embedding, revision, written_by, parents_declared, valid_from, valid_to%s)
        SELECT decode(e.j->>'sha256', 'hex'), p.id, e.j->>'level', k.xid,
               e.j->>'title', ARRAY(SELECT jsonb_array_elements_text(e.j->'breadcrumb')),
               e.j->>'text', e.j->>'source', (e.j->>'ts')::timestamptz, e.j->'metadata',
               coalesce($2[e.i],
                        (SELECT v.embedding FROM memory.nodes v
                         WHERE v.sha256 = decode(e.j->>'sha256', 'hex') AND v.project_id = p.id
                           AND v.embedding IS NOT NULL
                         ORDER BY v.revision DESC LIMIT 1),
                        %s),
               coalesce(k.first_revision,
                        coalesce((SELECT max(v.revision) FROM memory.nodes v
                                  WHERE v.project_id = p.id AND v.external_id = k.xid), 0) + 1),
               $3,
               -- the parents it names, resolved or not (memory.support_status)
               (SELECT count(DISTINCT x) FROM jsonb_array_elements_text(
                    coalesce(e.j->'parents', '[]')) AS x)::integer,
               (e.j->>'valid_from')::timestamptz, (e.j->>'valid_to')::timestamptz%s
        FROM jsonb_array_elements($1) WITH ORDINALITY AS e(j, i)
        JOIN memory.projects p ON p.name = e.j->>'project'
        -- A node without an id whose content was retired comes back under its old
        -- generated id, as its next version (the old rows hold its hash at revision 1: a
        -- new id at revision 1 would conflict with them and be dropped), unless that id
        -- has a current version with other content (written by id since): then a new id,
        -- numbered after the rows holding this content. An erased one has no hash left.
        LEFT JOIN LATERAL (
            SELECT v.external_id FROM memory.nodes v
            WHERE e.j->>'external_id' IS NULL AND v.sha256 = decode(e.j->>'sha256', 'hex')
              AND v.project_id = p.id
              AND NOT EXISTS (SELECT 1 FROM memory.nodes c
                              WHERE c.external_id = v.external_id AND c.project_id = p.id
                                AND c.expired_at IS NULL)
            ORDER BY v.revision DESC LIMIT 1) old ON true
        CROSS JOIN LATERAL (
            SELECT coalesce(e.j->>'external_id', old.external_id, 'n:' || gen_random_uuid()::text) AS xid,
                   CASE WHEN e.j->>'external_id' IS NULL AND old.external_id IS NULL THEN
                       coalesce((SELECT max(v.revision) FROM memory.nodes v
                                 WHERE v.sha256 = decode(e.j->>'sha256', 'hex')
                                   AND v.project_id = p.id), 0) + 1
                   END AS first_revision) k
        WHERE CASE WHEN e.j->>'external_id' IS NULL
                   THEN NOT EXISTS (SELECT 1 FROM memory.nodes s
                                    WHERE s.sha256 = decode(e.j->>'sha256', 'hex')
                                      AND s.project_id = p.id AND s.expired_at IS NULL)
                   ELSE NOT EXISTS (SELECT 1 FROM memory.nodes s
                                    WHERE s.external_id = e.j->>'external_id'
                                      AND s.project_id = p.id AND s.expired_at IS NULL) END
        ORDER BY e.i
        ON CONFLICT (sha256, project_id, revision) DO NOTHING
        RETURNING n.id)
        SELECT array_agg(ins.id), count(*) FROM ins$q$,
        -- expiry (migration 0021; not content): the node's own, capped by its project's
        -- retention for its level counted from now (least ignores a NULL)
        CASE WHEN to_regclass('memory.retention') IS NOT NULL THEN ', expires_at' ELSE '' END,
        CASE WHEN embed THEN $e$memory.embed(e.j->>'text')$e$
             ELSE 'memory._vector_missing(e.i)' END,
        CASE WHEN to_regclass('memory.retention') IS NOT NULL THEN $x$,
               least((e.j->>'expires_at')::timestamptz,
                     now() + (SELECT r.max_age FROM memory.retention r
                              WHERE r.project_id = p.id AND r.level = e.j->>'level'))$x$
             ELSE '' END)
    INTO made, n_inserted
    USING nodes, embeddings, who;

    IF n_superseded > 0 THEN
        -- Derived nodes rest on the versions they were derived from (issue 40): new content
        -- under a parent's id leaves them on the old version, stale, and in the review
        -- queue (memory._review_changes, below), never silently relinked. A new version
        -- with the old one's content (its metadata or timestamp alone changed) is the same
        -- evidence: its current children rest on it at once.
        INSERT INTO memory.edges (child_id, parent_id, precedence, project_id)
        SELECT ed.child_id, nv.id, ed.precedence, ed.project_id
        FROM memory.nodes old
        JOIN memory.nodes nv ON nv.project_id = old.project_id AND nv.external_id = old.external_id
                            AND nv.expired_at IS NULL AND nv.sha256 = old.sha256
        JOIN memory.edges ed ON ed.parent_id = old.id AND ed.project_id = old.project_id
        JOIN memory.nodes ch ON ch.id = ed.child_id AND ch.project_id = ed.project_id
                            AND ch.expired_at IS NULL
        WHERE old.id = ANY (locked) AND old.expired_at IS NOT NULL
        ORDER BY ed.child_id, nv.id
        ON CONFLICT (child_id, parent_id, project_id) DO NOTHING;
    END IF;

    -- A second statement, so that it sees the nodes just written: the edges of every node
    -- of the batch (stored before or now) to its parents, looked up by external id in the
    -- node's own project (an edge never crosses projects); precedence is the parent's place.
    WITH wanted AS (
        SELECT e.i, p.id AS project_id, c.id AS child_id, q.parent, q.pos - 1 AS precedence
        FROM jsonb_array_elements(nodes) WITH ORDINALITY AS e(j, i)
        JOIN memory.projects p ON p.name = e.j->>'project'
        JOIN memory.nodes c ON c.sha256 = decode(e.j->>'sha256', 'hex') AND c.project_id = p.id
                           AND c.expired_at IS NULL
        CROSS JOIN LATERAL jsonb_array_elements_text(coalesce(e.j->'parents', '[]'))
            WITH ORDINALITY AS q(parent, pos)
    ), resolved AS (
        SELECT w.*, pn.id AS parent_id
        FROM wanted w
        LEFT JOIN memory.nodes pn ON pn.project_id = w.project_id AND pn.external_id = w.parent
                                 AND pn.expired_at IS NULL
    ), made AS (
        INSERT INTO memory.edges (child_id, parent_id, precedence, project_id)
        SELECT child_id, parent_id, precedence, project_id FROM resolved
        WHERE parent_id IS NOT NULL
        ORDER BY i, precedence
        ON CONFLICT (child_id, parent_id, project_id) DO NOTHING
        RETURNING child_id
    )
    SELECT (SELECT count(*) FROM made), (SELECT array_agg(DISTINCT m.child_id) FROM made m),
           coalesce(jsonb_agg(jsonb_build_array(r.i, r.parent) ORDER BY r.i, r.precedence)
                    FILTER (WHERE r.parent_id IS NULL), '[]')
    INTO n_linked, linked, unresolved
    FROM resolved r;

    -- A stored node linked to more parents than it was written with (a later write names
    -- them): its count rises, so their loss is seen. Rare (a new node names at least the
    -- parents linked here), so the UPDATE, and the statement triggers it would fire, run
    -- only when some node needs it.
    IF linked IS NOT NULL AND EXISTS (
        SELECT 1 FROM memory.nodes n
        WHERE n.id = ANY (linked) AND n.parents_declared < memory.parents_present(n.id, n.project_id)
    ) THEN
        UPDATE memory.nodes n SET parents_declared = memory.parents_present(n.id, n.project_id)
        WHERE n.id = ANY (linked) AND n.parents_declared < memory.parents_present(n.id, n.project_id);
    END IF;

    -- What the batch put in doubt (after the edges: a node rewritten here with its parents
    -- named rests on their current versions): the review queue, and the items of the
    -- versions it ended are done (rewritten).
    IF n_superseded > 0 THEN
        PERFORM memory._review_changes(
            ARRAY(SELECT c.id FROM memory.nodes c
                  WHERE c.id = ANY (locked) AND c.expired_at IS NOT NULL ORDER BY c.id), who);
    END IF;

    -- What happened to each node of the batch, in its order: the current version it now
    -- names (by id; by content hash for a node written without an id, so a duplicate
    -- answers with the stored node's generated id), and whether this call wrote it: a new
    -- version when it replaced a current version of the id (one of the locked ones),
    -- created otherwise; unchanged when it was already current. A node given twice in the
    -- batch is written once: the first is created (or a new version), the others unchanged.
    SELECT coalesce(jsonb_agg(jsonb_build_object(
               'project', r.project, 'id', r.external_id, 'node_id', r.id,
               'revision', r.revision,
               'status', CASE WHEN NOT r.wrote THEN 'unchanged'
                              WHEN r.replaced THEN 'new_version'
                              ELSE 'created' END) ORDER BY r.i), '[]')
      INTO report
      FROM (SELECT e.i, e.j->>'project' AS project, c.external_id, c.id, c.revision,
                   coalesce(c.id = ANY (made), false)
                   AND row_number() OVER (PARTITION BY c.id ORDER BY e.i) = 1 AS wrote,
                   EXISTS (SELECT 1 FROM memory.nodes o
                           WHERE o.id = ANY (locked) AND o.project_id = c.project_id
                             AND o.external_id = c.external_id) AS replaced
              FROM jsonb_array_elements(nodes) WITH ORDINALITY AS e(j, i)
              JOIN memory.projects p ON p.name = e.j->>'project'
              LEFT JOIN LATERAL (
                  (SELECT x.id, x.external_id, x.revision, x.project_id FROM memory.nodes x
                   WHERE e.j->>'external_id' IS NOT NULL AND x.external_id = e.j->>'external_id'
                     AND x.project_id = p.id AND x.expired_at IS NULL)
                  UNION ALL
                  (SELECT x.id, x.external_id, x.revision, x.project_id FROM memory.nodes x
                   WHERE e.j->>'external_id' IS NULL AND x.sha256 = decode(e.j->>'sha256', 'hex')
                     AND x.project_id = p.id AND x.expired_at IS NULL)
                  LIMIT 1) c ON true) r;

    RETURN jsonb_build_object(
        'nodes', report,
        'inserted', n_inserted,
        'duplicates', jsonb_array_length(nodes) - n_inserted,
        'updated', n_superseded,
        'edges', n_linked,
        'unresolved', unresolved);
END
$$;
COMMENT ON FUNCTION memory._write_nodes(jsonb, vector[], boolean) IS
    'The one writer of nodes and edges, one batch in the calling transaction. nodes: a JSON array of validated node rows (sha256 as hex, project, level, external_id, title, breadcrumb, text, source, ts, metadata, parents as external ids, valid_from and valid_to (valid time, either NULL), and optionally revision: the revision the writer read, 0 for none); embeddings: the i-th node''s vector (NULL for a stored node); embed: compute a missing vector with memory.embed. Creates missing projects first, skips nodes equal to their current version (memory._same_version: content hash, metadata, timestamp, breadcrumb), writes any other node under a stored id as its next version (the current one ends: superseded; its current children keep resting on it, stale, and enter the review queue, unless its content hash is unchanged (metadata or timestamp alone): then they rest on the new one; the same content hash reuses the stored vector), gives a node without an id a generated one (''n:'' and a random UUID; a node without an id whose content hash is current in its project is a duplicate), refuses a stale revision (PM419, nothing written), links every node of the batch to its parents'' current versions in its own project. Returns {"nodes": [{"project", "id", "node_id", "revision", "status": "created" | "new_version" | "unchanged"}, ...] (one per node, in order: the current version it names), "inserted", "duplicates", "updated" (versions superseded), "edges", "unresolved": [[node number from 1, parent id], ...]}. Validation is the caller''s (poimen_core.nodes); row-level security applies.';

-- A review's confirmation (memory.review_confirm, sql/074_review.sql): the node's claim holds
-- against its parents as they are now, so it rests on their current versions from now on
-- (its edges to the versions it rested on stay, for history and as_of) and on the parents
-- that are left. Here, beside the writer, because it writes edges.
CREATE OR REPLACE FUNCTION memory._rest_on_current(p_node bigint, p_project integer)
RETURNS integer
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    relinked integer;
    there integer;
    wanted bigint[];
    got bigint[];
    attempts integer := 0;
BEGIN
    -- The parents' current versions are locked (FOR SHARE) before the node is made to rest
    -- on them: a writer superseding one of them meanwhile holds it FOR UPDATE, so this waits
    -- for it and then reads the version that replaced it; and a writer that comes later
    -- waits for this transaction, then finds the new edge and puts the node in doubt again
    -- (memory._review_changes). Read again until what is locked is what is current.
    LOOP
        -- the parents still there (current or rewritten), by id, and how many
        SELECT coalesce(array_agg(DISTINCT r.current_id ORDER BY r.current_id), '{}'), count(*)
          INTO wanted, there
          FROM memory._rested_parents(ARRAY[p_node]) r
         WHERE r.state IN ('current', 'superseded');
        got := ARRAY(SELECT v.id FROM memory.nodes v
                     WHERE v.id = ANY (wanted) AND v.project_id = p_project AND v.expired_at IS NULL
                     ORDER BY v.id FOR SHARE);
        EXIT WHEN got = wanted;
        attempts := attempts + 1;
        IF attempts > 100 THEN
            RAISE EXCEPTION 'could not lock the current versions of the parents of node %', p_node
                USING ERRCODE = '40001', HINT = 'Retry the confirmation.';
        END IF;
    END LOOP;
    INSERT INTO memory.edges (child_id, parent_id, precedence, project_id)
    SELECT p_node, r.current_id, r.precedence, p_project
    FROM memory._rested_parents(ARRAY[p_node]) r
    WHERE r.state = 'superseded'
    ORDER BY r.precedence
    ON CONFLICT (child_id, parent_id, project_id) DO NOTHING;
    GET DIAGNOSTICS relinked = ROW_COUNT;
    UPDATE memory.nodes n SET parents_declared = there
    WHERE n.id = p_node AND n.project_id = p_project AND n.parents_declared <> there;
    RETURN relinked;
END $$;
COMMENT ON FUNCTION memory._rest_on_current(bigint, integer) IS
    'Makes a node rest on the current versions of the parents it rested on (an edge to each rewritten parent''s current version; the old edges stay) and on the parents that are left (parents_declared lowered to them): what confirming a review item records. Returns the edges added.';

CREATE OR REPLACE FUNCTION memory._vector_missing(node bigint)
RETURNS vector
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, public, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'node % is not stored and has no vector', node
        USING ERRCODE = '22023',
              HINT = 'Pass its vector in embeddings, or embed => true to embed it in the database.';
END
$$;
COMMENT ON FUNCTION memory._vector_missing(bigint) IS
    'Raises 22023 for a node memory._write_nodes must write without a vector (embed => false): never a node stored without one.';

CREATE OR REPLACE FUNCTION memory._add_nodes(nodes jsonb)
RETURNS jsonb
-- VOLATILE: it writes. PARALLEL UNSAFE: writes, and plpy.execute opens subtransactions.
-- Not STRICT: NULL gets the same 22023 as any other non-array, not a silent NULL.
-- SECURITY INVOKER (the default): row-level security applies to the caller, so a writer
-- writes only the projects granted to it (sql/085_tenants.sql).
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE
-- Every name in the shim's statements is schema-qualified; nothing resolves through a
-- caller's schemas.
SET search_path = pg_catalog, pg_temp
AS $$
# Prepared once a backend: SD is this function's own (planned under its search_path) and
# is renewed when a deploy replaces the function.
if "load" not in SD:
    SD["load"] = plpy.prepare("SELECT memory.plpython_load() AS p")
plpy.execute(SD["load"])
add_nodes_for_sql = GD["poimen_entry"](
    "addnodes", "add_nodes_for_sql", "ingest",
    "Run `poimen-memory migrate` (from any host: it writes the module into the database), or write through the service.")
return add_nodes_for_sql(plpy, nodes)
$$;
COMMENT ON FUNCTION memory._add_nodes(jsonb) IS
    'The PL/Python body of memory.add_nodes, which callers use.';

-- The entry point: PL/pgSQL, so its errors read without PL/Python's prefix.
CREATE OR REPLACE FUNCTION memory.add_nodes(nodes jsonb)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN memory._add_nodes(nodes);
@plain_errors@
END $$;
COMMENT ON FUNCTION memory.add_nodes(jsonb) IS
    'Writes a JSON array of nodes in the JSONL format of `poimen-memory ingest` (docs/ingest.md), with its guarantees: every node validated first by the same code (22023 naming the node and field; nothing written), content-hash keys (a node already stored counts as a duplicate), parents linked by id within the array or among the project''s stored nodes, vectors from memory.embed, all in the calling statement (all or nothing). Returns {"nodes": [{"project", "id", "node_id", "revision", "status"}, ...] (one per node, in order; status created, new_version or unchanged; a node written without an id gets a generated one, ''n:'' and a random UUID), "inserted", "duplicates", "updated", "edges", "unresolved"}. The first write into an empty database records the model, which only the owner or @role.service@ may do (PM412 otherwise). Row-level security applies: 42501 names the node whose project the caller may not write.';
