-- Keys that carry the project, so memory.partition_by_project() can turn these tables into
-- LIST partitions by project (a partitioned table's unique keys and foreign keys must
-- include its partition key). The unpartitioned layout gets the very same keys, so one set
-- of statements (ON CONFLICT targets, edge inserts) serves both layouts.
--
-- * nodes: primary key (id, project_id); the content hash is unique per project,
--   (sha256, project_id), led by sha256 so a lookup by hash alone still uses it. A hash
--   stored in a project a writer cannot see no longer blocks (or reveals) the same hash
--   in its own project.
-- * edges: carry the project of both ends; the foreign keys (child_id, project_id) and
--   (parent_id, project_id) make an edge across projects impossible. Provenance never
--   crossed projects through ingest or memory.add_nodes; an edge a DBA wrote by hand
--   across projects stops this migration (nothing is dropped silently).
DO $$
DECLARE
    crossing bigint;
BEGIN
    SELECT count(*) INTO crossing
    FROM memory.edges e
    JOIN memory.nodes c ON c.id = e.child_id
    JOIN memory.nodes p ON p.id = e.parent_id
    WHERE c.project_id <> p.project_id;
    IF crossing > 0 THEN
        RAISE EXCEPTION 'migration 0009: % provenance edges join nodes of different projects', crossing
            USING ERRCODE = '23514',
                  DETAIL = 'Edges must now stay within one project (their foreign keys carry the project).',
                  HINT = 'List them with SELECT e.* FROM memory.edges e JOIN memory.nodes c ON c.id = e.child_id JOIN memory.nodes p ON p.id = e.parent_id WHERE c.project_id <> p.project_id; then delete or move them and migrate again.';
    END IF;
END $$;

ALTER TABLE memory.edges ADD COLUMN project_id integer;
UPDATE memory.edges e SET project_id = n.project_id FROM memory.nodes n WHERE n.id = e.child_id;
ALTER TABLE memory.edges
    ALTER COLUMN project_id SET NOT NULL,
    DROP CONSTRAINT edges_child_id_fkey,
    DROP CONSTRAINT edges_parent_id_fkey,
    DROP CONSTRAINT edges_pkey;

ALTER TABLE memory.nodes
    DROP CONSTRAINT nodes_pkey,
    ADD CONSTRAINT nodes_pkey PRIMARY KEY (id, project_id),
    DROP CONSTRAINT nodes_sha256_key,
    ADD CONSTRAINT nodes_sha256_key UNIQUE (sha256, project_id);

ALTER TABLE memory.edges
    ADD CONSTRAINT edges_pkey PRIMARY KEY (child_id, parent_id, project_id),
    ADD CONSTRAINT edges_child_id_fkey FOREIGN KEY (child_id, project_id)
        REFERENCES memory.nodes (id, project_id) ON DELETE CASCADE,
    ADD CONSTRAINT edges_parent_id_fkey FOREIGN KEY (parent_id, project_id)
        REFERENCES memory.nodes (id, project_id) ON DELETE CASCADE;
