-- Memory that keeps itself true (issue 40). A derived node rests on the parent versions it
-- was written with: an update of its evidence no longer relinks it to the new version
-- (memory._write_nodes did, so an L2 citing a contradicted claim stayed "full"). What a
-- change puts in doubt is computed from the edges (memory._support_at: stale, partial,
-- none, at any as_of) and listed here, as work for a person, an agent or a job.
--
-- The queue is pgmq's model in one table: an item is claimable once its visibility time
-- (vt) has passed; a claim moves vt into the future (FOR UPDATE SKIP LOCKED, so concurrent
-- workers never take the same item) and a worker that dies loses nothing: the item comes
-- back when vt passes. An item ends when the node gets a new version (rewritten), is
-- confirmed against its current parents (confirmed) or leaves the store (retired).
CREATE TABLE memory.review_queue (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    project_id   integer NOT NULL REFERENCES memory.projects (id) ON DELETE CASCADE,
    node_id      bigint NOT NULL,
    external_id  text,
    level        text NOT NULL CHECK (level IN ('L1', 'L2')),
    reason       text NOT NULL CHECK (reason IN ('evidence_changed', 'evidence_gone', 'evidence_stale')),
    changes      jsonb NOT NULL DEFAULT '[]' CHECK (jsonb_typeof(changes) = 'array'),
    enqueued_at  timestamptz NOT NULL DEFAULT now(),
    vt           timestamptz NOT NULL DEFAULT now(),
    claims       integer NOT NULL DEFAULT 0 CHECK (claims >= 0),
    claimed_by   text,
    completed_at timestamptz,
    completed_by text,
    outcome      text CHECK (outcome IN ('confirmed', 'rewritten', 'retired')),
    note         text CHECK (length(note) <= 2000),
    CONSTRAINT review_queue_done_check CHECK ((completed_at IS NULL) = (outcome IS NULL))
);
-- One open item per derived version: a second change below it updates the item.
CREATE UNIQUE INDEX review_queue_open ON memory.review_queue (node_id) WHERE completed_at IS NULL;
-- What a worker claims next, in claim order (memory.review_claim: L1 before L2, then by
-- visibility time): a project's open items, and every project's.
CREATE INDEX review_queue_ready ON memory.review_queue (project_id, level, vt, id)
    WHERE completed_at IS NULL;
CREATE INDEX review_queue_ready_all ON memory.review_queue (level, vt, id)
    WHERE completed_at IS NULL;
ALTER TABLE memory.review_queue ENABLE ROW LEVEL SECURITY;

COMMENT ON TABLE memory.review_queue IS
    'Derived nodes (L1/L2) whose evidence changed, one open item per current version: listed, claimed (visibility timeout) and completed by review workers (memory.review_claim, memory.review_confirm; a new version of the node completes its item). Row-level security: the project''s readers see, its writers work the items.';
COMMENT ON COLUMN memory.review_queue.id IS 'the item''s id (item_id in memory.review_list and memory.review_confirm)';
COMMENT ON COLUMN memory.review_queue.project_id IS 'the project of the node (row-level security reads it)';
COMMENT ON COLUMN memory.review_queue.external_id IS 'the node''s external id, as written';
COMMENT ON COLUMN memory.review_queue.level IS 'the node''s level: L1 or L2 (evidence is never in doubt)';
COMMENT ON COLUMN memory.review_queue.enqueued_at IS 'when the first change put the node in doubt';
COMMENT ON COLUMN memory.review_queue.completed_at IS 'when the item was done (NULL: open)';
COMMENT ON COLUMN memory.review_queue.completed_by IS 'who completed it (api_key:<id> or role:<name>)';
COMMENT ON COLUMN memory.review_queue.note IS 'what the worker said when confirming (at most 2000 characters)';
COMMENT ON COLUMN memory.review_queue.node_id IS 'the derived version whose evidence changed (memory.nodes.id)';
COMMENT ON COLUMN memory.review_queue.reason IS
    'evidence_changed: a parent it rests on has a newer version; evidence_gone: a parent was retired or erased; evidence_stale: a parent is itself in doubt (a change further down)';
COMMENT ON COLUMN memory.review_queue.changes IS
    'the parents that changed: [{"external_id", "revision" (the version it rests on), "current_revision" (NULL: gone), "state"}]';
COMMENT ON COLUMN memory.review_queue.vt IS 'visibility time: the item may be claimed from then on (a claim moves it into the future)';
COMMENT ON COLUMN memory.review_queue.claims IS 'how many times the item was claimed';
COMMENT ON COLUMN memory.review_queue.claimed_by IS 'who claimed it last (api_key:<id> or role:<name>)';
COMMENT ON COLUMN memory.review_queue.outcome IS
    'confirmed (the claim holds against the current parents), rewritten (a new version was written), retired (the node left the store)';

-- When an edge was made. A confirmed review (memory.review_confirm) makes a node rest on its
-- parents' current versions by a new edge; as of an earlier instant that edge did not exist,
-- and the node rested on what it rested on then. Edges made before this migration have
-- none (NULL: as old as their child). No default at ADD (no rewrite of the table); new
-- edges get their transaction's time.
ALTER TABLE memory.edges ADD COLUMN linked_at timestamptz;
ALTER TABLE memory.edges ALTER COLUMN linked_at SET DEFAULT now();
COMMENT ON COLUMN memory.edges.linked_at IS
    'when the edge was made (NULL: before migration 0019, as old as its child); as_of reads only the edges made by then';
