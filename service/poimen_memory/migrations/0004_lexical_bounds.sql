-- Score bounds for pruned BM25 (memory.lexical_search, sql/020_lexical.sql).
-- A posting's BM25 term weight tf*(k1+1) / (tf + k1*(1 - b + b*dl/avgdl)) only grows with tf
-- and shrinks with dl/tf, so per (project, lexeme) the largest tf and the smallest dl/tf
-- bound every posting's weight for any avgdl, k1 >= 0 and 0 <= b <= 1. The statistics
-- triggers keep them valid on every write (an insert can only raise max_tf or lower
-- min_dl_per_tf); deletes leave them valid but loose until memory.refresh_lexical_bounds.
ALTER TABLE memory.term_stats
    ADD COLUMN max_tf integer NOT NULL DEFAULT 0 CHECK (max_tf >= 0),
    ADD COLUMN min_dl_per_tf double precision NOT NULL DEFAULT 0 CHECK (min_dl_per_tf >= 0);

UPDATE memory.term_stats t
SET max_tf = s.max_tf, min_dl_per_tf = s.min_ratio
FROM (SELECT project_id, lexeme, max(tf) AS max_tf,
             min(dl::double precision / greatest(tf, 1)) AS min_ratio
      FROM memory.postings GROUP BY 1, 2) s
WHERE t.project_id = s.project_id AND t.lexeme = s.lexeme;

-- Queries without a project read every project's statistics for their lexemes.
CREATE INDEX term_stats_lexeme_idx ON memory.term_stats (lexeme)
    INCLUDE (project_id, df, max_tf, min_dl_per_tf);
