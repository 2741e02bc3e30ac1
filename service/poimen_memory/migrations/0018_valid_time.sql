-- Valid time (issue 24): when a fact held in the world, beside the transaction time every
-- version already carries (created_at, expired_at: when the database learned and retired
-- it). Both bounds are optional; a node with neither holds always. New columns without a
-- default: no table rewrite, and every stored node stays valid at all times.
ALTER TABLE memory.nodes
    ADD COLUMN valid_from timestamptz,
    ADD COLUMN valid_to   timestamptz,
    ADD CONSTRAINT nodes_valid_check CHECK (valid_from < valid_to);

COMMENT ON COLUMN memory.nodes.valid_from IS
    'Valid time: the first instant the fact held in the world (NULL: since always). Set by the writer; part of the version''s content.';
COMMENT ON COLUMN memory.nodes.valid_to IS
    'Valid time: the instant the fact stopped holding, exclusive (NULL: still holds). Queries see nodes valid now unless they name valid_at.';

-- The current versions with a bounded valid time: queries look here first, and a project
-- with none (the usual case) pays nothing for the valid-time test (memory._valid_at).
CREATE INDEX nodes_valid_bounded ON memory.nodes (project_id)
    WHERE expired_at IS NULL AND (valid_from IS NOT NULL OR valid_to IS NOT NULL);
