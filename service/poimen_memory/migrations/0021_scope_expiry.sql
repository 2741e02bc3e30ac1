-- Scope, expiry and retention (issue 40).
--
-- expires_at: the instant a node leaves answers (NULL: never). Not content (like metadata):
-- it is not in the content hash. Set by the writer from the node's JSON, or from the
-- project's retention for its level (memory.retention) when the node names none. Answers
-- treat a node whose expiry has passed as not visible at once (the valid-time test, which
-- memory._valid_at runs only where some current node is bounded); `poimen-memory expire`
-- then retires or erases it through memory.forget's implementation. A column without a
-- default: no table rewrite.
ALTER TABLE memory.nodes ADD COLUMN expires_at timestamptz;
COMMENT ON COLUMN memory.nodes.expires_at IS
    'When the node leaves answers (NULL: never): the expires_at of its JSON, else its project''s retention for its level (memory.retention) from when it was written. Not content. Tested with valid time (memory._valid_at); poimen-memory expire retires or erases what has expired.';

-- The bounded current versions now include those with an expiry: memory._valid_at's one
-- probe still tells a store with neither (the usual case) that no test is needed.
DROP INDEX IF EXISTS memory.nodes_valid_bounded;
CREATE INDEX nodes_valid_bounded ON memory.nodes (project_id)
    WHERE expired_at IS NULL AND (valid_from IS NOT NULL OR valid_to IS NOT NULL OR expires_at IS NOT NULL);

-- Listing, counting and forgetting by metadata read current versions only: a partial GIN
-- index of their metadata (jsonb_path_ops: containment only, a third of jsonb_ops) stays
-- the size of the current store however many versions ended. nodes_metadata_gin (0013,
-- every version) stays for the queries under as_of.
CREATE INDEX nodes_metadata_current_gin ON memory.nodes USING gin (metadata jsonb_path_ops)
    WHERE expired_at IS NULL;

-- A project's retention per level: nodes written at that level expire max_age after they
-- were written, and `poimen-memory expire` retires or erases them (action).
CREATE TABLE memory.retention (
    project_id integer NOT NULL REFERENCES memory.projects (id) ON DELETE CASCADE,
    level      text NOT NULL CHECK (level IN ('L0', 'L1', 'L2')),
    max_age    interval NOT NULL CHECK (max_age > interval '0'),
    action     text NOT NULL DEFAULT 'retire' CHECK (action IN ('retire', 'erase')),
    set_at     timestamptz NOT NULL DEFAULT now(),
    set_by     text,
    PRIMARY KEY (project_id, level)
);
COMMENT ON TABLE memory.retention IS
    'Retention per project and level (memory.set_retention): a node of that level expires max_age after it was written (memory.nodes.expires_at), and poimen-memory expire retires or erases it (action). Row-level security: a role sees and sets only its projects''.';
COMMENT ON COLUMN memory.retention.project_id IS 'The project (memory.projects.id).';
COMMENT ON COLUMN memory.retention.level IS 'The level the retention applies to: L0, L1 or L2.';
COMMENT ON COLUMN memory.retention.max_age IS 'How long after it was written a node of this level stays in answers.';
COMMENT ON COLUMN memory.retention.action IS 'What poimen-memory expire does with an expired node: retire (kept in history) or erase (content destroyed).';
COMMENT ON COLUMN memory.retention.set_at IS 'When the retention was last set.';
COMMENT ON COLUMN memory.retention.set_by IS 'Who set it: api_key:<id> or role:<name> (memory._writer).';
ALTER TABLE memory.retention ENABLE ROW LEVEL SECURITY;

-- The way back to anonymous mode (issue 40). Once a key was made, the service requires
-- one, and revoking the last key locks the API rather than opening it (a revoke must never
-- widen access). `poimen-memory keys anonymous` is the owner's explicit decision to open
-- it again: with no active key, it sets every revoked key aside; keys set aside do not
-- count as "a key exists", and stay listed (their ids are in memory.nodes.written_by).
ALTER TABLE memory.api_keys ADD COLUMN set_aside_at timestamptz;
COMMENT ON COLUMN memory.api_keys.set_aside_at IS
    'set by `poimen-memory keys anonymous` on revoked keys: they no longer count, and with no other key the service is anonymous again';
