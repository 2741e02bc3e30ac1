-- Metadata filters (issue 25): memory.nodes.metadata @> filter, inside every leg. A GIN
-- index with jsonb_path_ops serves containment only, and is about a third of the size of
-- the default jsonb_ops. sql/088_indexes.sql restores it on every migrate.
CREATE INDEX IF NOT EXISTS nodes_metadata_gin ON memory.nodes USING gin (metadata jsonb_path_ops);
