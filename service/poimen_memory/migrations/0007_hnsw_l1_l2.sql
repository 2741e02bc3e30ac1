-- A second HNSW index over the L1/L2 rows only. memory.query searches levels {L1,L2} by
-- default; with the full index the planner must filter out the L0 majority while walking
-- the graph and, costing that, often chose an exact scan plus sort instead. The partial
-- index matches the default filter, so the planner can use it (docs/benchmarks.md).
-- Databases without an embedding model get it from memory.configure_embedding.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM memory.embedding_model) THEN
        CREATE INDEX IF NOT EXISTS nodes_embedding_hnsw_l1_l2 ON memory.nodes
            USING hnsw (embedding vector_cosine_ops) WITH (m = 16, ef_construction = 64)
            WHERE level IN ('L1', 'L2');
    END IF;
END $$;
