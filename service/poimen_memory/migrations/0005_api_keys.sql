-- API keys for the HTTP service (`poimen-memory keys`). Only a SHA-256 of each key is
-- stored: keys are 256 random bits, so a fast hash is enough and the table leaks nothing
-- usable. Owner-only: neither memory_reader nor memory_writer may read it.
CREATE TABLE memory.api_keys (
    id         integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key_hash   bytea NOT NULL UNIQUE CHECK (length(key_hash) = 32),
    prefix     text NOT NULL,
    projects   text[] NOT NULL CHECK (cardinality(projects) > 0),
    can_write  boolean NOT NULL DEFAULT false,
    note       text,
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);
COMMENT ON TABLE memory.api_keys IS
    'HTTP API keys: SHA-256 of the key, its printable prefix, the projects it may read (and write, with can_write). Once any unrevoked key exists, the service requires one on every request.';
COMMENT ON COLUMN memory.api_keys.key_hash IS 'sha256 of the whole key; the key itself is never stored';
COMMENT ON COLUMN memory.api_keys.prefix IS 'the first characters of the key, to tell keys apart in listings';
COMMENT ON COLUMN memory.api_keys.projects IS 'project names the key may query (and write to, with can_write)';
COMMENT ON COLUMN memory.api_keys.revoked_at IS 'set by `poimen-memory keys revoke`; a revoked key is refused';
