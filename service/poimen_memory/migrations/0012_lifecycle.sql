-- Memory that changes (issue 24): a node is a chain of versions, one row each, in
-- memory.nodes itself, so provenance edges, hydrate and the one writer keep working on
-- node ids. A version is current while expired_at IS NULL; writing new content under an
-- external id retires the current version (end_reason 'superseded') and inserts the next
-- revision; memory.forget retires ('retired') or erases ('erased': the text, vector,
-- metadata and postings of every version blanked, the rows kept as tombstones without
-- content). Only current rows have postings and count in the BM25 statistics
-- (sql/020_lexical.sql), so the default query path reads exactly what it read before.
ALTER TABLE memory.nodes
    ADD COLUMN revision   integer NOT NULL DEFAULT 1 CHECK (revision >= 1),
    ADD COLUMN expired_at timestamptz,
    ADD COLUMN end_reason text CHECK (end_reason IN ('superseded', 'retired', 'erased')),
    ADD COLUMN written_by text,
    ADD COLUMN ended_by   text,
    ADD COLUMN end_note   text,
    ADD COLUMN erased_at  timestamptz,
    ADD CONSTRAINT nodes_end_check CHECK ((expired_at IS NULL) = (end_reason IS NULL)),
    ADD CONSTRAINT nodes_erased_check CHECK (erased_at IS NULL OR expired_at IS NOT NULL);

-- An erased version keeps no text: the CHECK of migration 0001 (text <> '') allows that
-- for erased rows only.
ALTER TABLE memory.nodes DROP CONSTRAINT nodes_text_check,
    ADD CONSTRAINT nodes_text_check CHECK (text <> '' OR erased_at IS NOT NULL);

-- Keys per version: an external id and a content hash are unique per revision, and an
-- external id has at most one current version. Writing an old version's content again
-- makes a new revision (the same hash under another revision number). Neither new index
-- leads with project_id, and the index of current versions names external_id IS NOT NULL
-- in its predicate, which only a lookup by id implies: otherwise the planner takes them for
-- a project's filtered scans (which say expired_at IS NULL too) in place of
-- nodes_project_level_idx.
ALTER TABLE memory.nodes
    DROP CONSTRAINT nodes_project_id_external_id_key,
    ADD CONSTRAINT nodes_external_id_revision_key UNIQUE (external_id, revision, project_id),
    DROP CONSTRAINT nodes_sha256_key,
    ADD CONSTRAINT nodes_sha256_key UNIQUE (sha256, project_id, revision);
CREATE UNIQUE INDEX nodes_current_external_id ON memory.nodes (external_id, project_id)
    WHERE expired_at IS NULL AND external_id IS NOT NULL;

COMMENT ON COLUMN memory.nodes.revision IS
    'the version number of this row among the rows of its external id (1, 2, ...); a node without an external id has one version';
COMMENT ON COLUMN memory.nodes.expired_at IS
    'transaction time: when this version stopped being current (NULL: current); created_at is when it became current';
COMMENT ON COLUMN memory.nodes.end_reason IS
    'why the version ended: superseded (a new version was written), retired (memory.forget) or erased (memory.forget erase => true; its content is gone)';
COMMENT ON COLUMN memory.nodes.written_by IS
    'who wrote this version: api_key:<id> for the HTTP service, role:<name> for a database role';
COMMENT ON COLUMN memory.nodes.ended_by IS 'who ended this version (same form as written_by)';
COMMENT ON COLUMN memory.nodes.end_note IS 'the reason the forgetter gave, if any';
COMMENT ON COLUMN memory.nodes.erased_at IS
    'when the content of this version was erased (text, vector, metadata, postings); the row stays as a tombstone';
