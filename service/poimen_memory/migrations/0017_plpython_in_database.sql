-- The PL/Python package's source inside the database, so that a database server on another
-- host (or one whose OS user cannot read the service's files) imports the same poimen_core
-- the service runs: `poimen-memory migrate` rewrites the rows on every deploy, and
-- memory.plpython_load() imports from them when memory.config has no plpython_path.
-- Owner-only: the functions that read it run PL/Python as the owner's code, and a row
-- another role could write would be code run in every backend.
CREATE TABLE memory._plpython_modules (
    name     text PRIMARY KEY,
    source   text NOT NULL,
    checksum text NOT NULL
);
REVOKE ALL ON memory._plpython_modules FROM PUBLIC;
