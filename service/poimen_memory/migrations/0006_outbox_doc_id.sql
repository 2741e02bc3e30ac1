-- The OpenSearch document id (the node's sha256) travels with each outbox row, so a delete
-- can still be sent after its node row is gone.
ALTER TABLE memory.opensearch_outbox ADD COLUMN sha256 bytea;
COMMENT ON COLUMN memory.opensearch_outbox.sha256 IS
    'sha256 of the node (the OpenSearch _id), copied by the trigger; needed for deletes';
