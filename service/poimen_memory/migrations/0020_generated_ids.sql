-- Every node has an id (issue 40). A node written without one used to keep external_id
-- NULL, and could never be fetched, updated or forgotten by id. From now on the writer
-- (memory._write_nodes, sql/068_write.sql) gives such a node a generated id, 'n:' and a
-- random UUID; this backfills the rows written before, every version (a retired id-less
-- node's history becomes reachable too).
--
-- Random, not derived from the content: an erase replaces a node's content hash because a
-- hash of known text would confirm it, and it keeps external ids; an id computed from the
-- text would be such a hash. The content hash itself is unchanged (an id-less node's hash
-- is computed with an empty id, poimen_core.nodes.node_sha256), so re-ingesting an old
-- file finds its nodes stored and writes nothing.
--
-- The UPDATE sets external_id only: the row trigger nodes_lexical_row fires on title,
-- breadcrumb and text only, and the statement triggers (BM25 statistics, OpenSearch
-- outbox) find no lexical or document change to act on. A statement trigger fires even
-- for an UPDATE of no row, so a database without id-less nodes (the usual case, and every
-- new one) skips the statement altogether.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM memory.nodes WHERE external_id IS NULL) THEN
        UPDATE memory.nodes SET external_id = 'n:' || gen_random_uuid()::text
        WHERE external_id IS NULL;
    END IF;
END $$;

COMMENT ON COLUMN memory.nodes.external_id IS
    'the node''s id, unique per project among current versions: the one its writer gave, or a generated one (''n:'' and a random UUID) for a node written without one; kept when the node is erased';
COMMENT ON COLUMN memory.nodes.revision IS
    'the version number of this row among the rows of its external id (1, 2, ...)';
