-- The OpenSearch outbox is filled by triggers, so every insert, update and delete of a node
-- reaches it however it was made (ingest, memory.add_nodes, a DBA's UPDATE). The triggers
-- only write while OpenSearch is in use: the service (or `poimen-memory opensearch`)
-- records 'opensearch_outbox' = 'on' in memory.config; otherwise the queue stays empty.

CREATE OR REPLACE FUNCTION memory.enqueue_opensearch()
RETURNS trigger
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SECURITY DEFINER  -- writers change nodes; only the owner writes the outbox
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM memory.config c
                   WHERE c.key = 'opensearch_outbox' AND c.value = 'on') THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'DELETE' THEN
        INSERT INTO memory.opensearch_outbox (node_id, op, sha256)
        SELECT o.id, 'delete', o.sha256 FROM old_rows o;
    ELSIF TG_OP = 'UPDATE' THEN
        -- A new content hash is a new document id: the old document must go. So must the
        -- document of a version that stops being current (superseded, retired, erased:
        -- OpenSearch holds current versions only, migration 0012).
        INSERT INTO memory.opensearch_outbox (node_id, op, sha256)
        SELECT o.id, 'delete', o.sha256
        FROM new_rows n JOIN old_rows o ON o.id = n.id
        WHERE n.sha256 IS DISTINCT FROM o.sha256
           OR (o.expired_at IS NULL AND n.expired_at IS NOT NULL);
        -- Only current rows whose document changed; an embedding-only UPDATE (reembed) is
        -- not queued.
        INSERT INTO memory.opensearch_outbox (node_id, op, sha256)
        SELECT n.id, 'index', n.sha256
        FROM new_rows n JOIN old_rows o ON o.id = n.id
        WHERE n.expired_at IS NULL
          AND (n.text, n.title, n.breadcrumb, n.source, n.level, n.project_id, n.sha256)
              IS DISTINCT FROM (o.text, o.title, o.breadcrumb, o.source, o.level, o.project_id, o.sha256);
    ELSE
        INSERT INTO memory.opensearch_outbox (node_id, op, sha256)
        SELECT n.id, 'index', n.sha256 FROM new_rows n;
    END IF;
    RETURN NULL;
END $$;
COMMENT ON FUNCTION memory.enqueue_opensearch() IS
    'Statement trigger on memory.nodes: queues index/delete operations for OpenSearch while memory.config opensearch_outbox = on.';

SELECT memory._ensure_statement_triggers('memory.nodes', 'nodes_outbox', 'memory.enqueue_opensearch');

CREATE OR REPLACE FUNCTION memory.enable_outbox()
RETURNS void
LANGUAGE sql VOLATILE PARALLEL UNSAFE
-- memory.config is owner-only (it holds the path PL/Python imports from); the service's
-- role may switch this one key on, nothing else.
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO memory.config (key, value) VALUES ('opensearch_outbox', 'on')
    ON CONFLICT (key) DO UPDATE SET value = 'on', updated_at = now()
$$;
COMMENT ON FUNCTION memory.enable_outbox() IS
    'Turns the OpenSearch outbox triggers on (memory.config opensearch_outbox = on). Called by the service and `poimen-memory opensearch` when OpenSearch is configured.';
