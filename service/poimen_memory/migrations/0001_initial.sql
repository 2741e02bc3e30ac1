-- poimen-memory schema, version 1. Released migrations are frozen: the runner refuses
-- to proceed when this file's checksum differs from the one recorded at apply time.
CREATE EXTENSION IF NOT EXISTS vector;
CREATE EXTENSION IF NOT EXISTS plpython3u;

-- Key/value settings the SQL layer reads (e.g. the PL/Python module path).
CREATE TABLE memory.config (
    key        text PRIMARY KEY,
    value      text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE memory.projects (
    id         integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name       text NOT NULL UNIQUE
               CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$'),
    created_at timestamptz NOT NULL DEFAULT now()
);

-- The embedding model and dimension, recorded once per database. nodes.embedding is
-- retyped to vector(dim) when this row is written (memory.configure_embedding).
CREATE TABLE memory.embedding_model (
    singleton     boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    model         text NOT NULL,
    dim           integer NOT NULL CHECK (dim BETWEEN 1 AND 16000),
    configured_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE memory.nodes (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    sha256      bytea NOT NULL UNIQUE CHECK (length(sha256) = 32),
    project_id  integer NOT NULL REFERENCES memory.projects (id) ON DELETE CASCADE,
    level       text NOT NULL CHECK (level IN ('L0', 'L1', 'L2')),
    external_id text,
    title       text,
    breadcrumb  text[] NOT NULL DEFAULT '{}',
    text        text NOT NULL CHECK (text <> ''),
    source      text,
    ts          timestamptz,
    metadata    jsonb NOT NULL DEFAULT '{}',
    embedding   vector,
    tsv         tsvector NOT NULL DEFAULT ''::tsvector,
    lex_len     integer NOT NULL DEFAULT 0,
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (project_id, external_id)
);
CREATE INDEX nodes_project_level_idx ON memory.nodes (project_id, level);
CREATE INDEX nodes_tsv_gin ON memory.nodes USING gin (tsv);

-- Provenance: child was derived from parent. precedence orders a child's parents.
CREATE TABLE memory.edges (
    child_id   bigint NOT NULL REFERENCES memory.nodes (id) ON DELETE CASCADE,
    parent_id  bigint NOT NULL REFERENCES memory.nodes (id) ON DELETE CASCADE,
    precedence integer NOT NULL DEFAULT 0,
    PRIMARY KEY (child_id, parent_id),
    CHECK (child_id <> parent_id)
);
CREATE INDEX edges_parent_idx ON memory.edges (parent_id);

-- BM25 statistics, kept exact by statement triggers on memory.nodes (sql/020_lexical.sql).
-- postings: one row per (lexeme, node) with its term frequency and the node's length.
CREATE TABLE memory.postings (
    lexeme     text NOT NULL,
    project_id integer NOT NULL,
    node_id    bigint NOT NULL,
    level      text NOT NULL,
    tf         integer NOT NULL,
    dl         integer NOT NULL,
    PRIMARY KEY (lexeme, project_id, node_id)
);
CREATE INDEX postings_node_idx ON memory.postings (node_id);

CREATE TABLE memory.term_stats (
    project_id integer NOT NULL,
    lexeme     text NOT NULL,
    df         integer NOT NULL CHECK (df >= 0),
    PRIMARY KEY (project_id, lexeme)
);

CREATE TABLE memory.corpus_stats (
    project_id integer PRIMARY KEY,
    n_docs     bigint NOT NULL CHECK (n_docs >= 0),
    total_len  bigint NOT NULL CHECK (total_len >= 0)
);

-- OpenSearch dual-write: rows are written in the node's own transaction and drained later.
CREATE TABLE memory.opensearch_outbox (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    node_id     bigint NOT NULL,
    op          text NOT NULL CHECK (op IN ('index', 'delete')),
    enqueued_at timestamptz NOT NULL DEFAULT now(),
    attempts    integer NOT NULL DEFAULT 0,
    last_error  text
);
